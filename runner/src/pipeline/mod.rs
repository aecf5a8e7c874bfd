//! A job's path through the runner, one module per stage, each taking the previous
//! stage's type and giving the next, so no stage can be skipped and still compile:
//!
//! | stage          | module             | takes → gives                          |
//! |----------------|--------------------|----------------------------------------|
//! | receive        | `receive.rs`       | poll response → `PolledJob`            |
//! | verify         | `verify.rs`        | `PolledJob` → `VerifiedJob` (journaled) |
//! | resolve_role   | `resolve_role.rs`  | `VerifiedJob` → `ResolvedJob`            |
//! | authorize      | `authorize.rs`     | `ResolvedJob` → `AuthorizedJob`          |
//! | window         | `window.rs`        | refuses a job outside a window whose rule refuses |
//! | claim          | `claim.rs`         | `AuthorizedJob` → `ClaimedJob`         |
//! | gate           | `gate.rs`          | `ClaimedJob` → `ClearedJob` (windows, `approval.rs`, policy context) |
//! | assume_role    | `assume_role.rs`   | `ClearedJob` → `AssumedJob`, or `NotAssumed` |
//! | execute        | `execute.rs`       | `AssumedJob` → `RanJob` (`not_run`: `NotAssumed` → `RanJob`) |
//! | record         | `record.rs`        | `RanJob` → `FinishedJob` (what it leaves for later; journaled) |
//! | report         | `report.rs`        | `FinishedJob` → `Reported`             |
//!
//! `accept` runs receive and verify on the poll loop, so the job's receipt (its nonce
//! spent) is journaled before the next poll and a replay is refused deterministically;
//! `run_job` runs the rest in the job's own task. Refusals on the way are `refuse.rs`;
//! after a crash, `recover.rs` settles what the journal shows unfinished.

pub mod approval;
pub mod assume_role;
pub mod authorize;
pub mod claim;
pub mod execute;
pub mod gate;
pub mod held;
pub mod plan_approval;
pub mod receive;
pub mod record;
pub mod recover;
pub mod refuse;
pub mod report;
pub mod resolve_role;
pub mod verify;
pub mod window;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::journal::{Event, RecordError};
use crate::runtime::Rt;

pub use assume_role::AssumedJob;
pub use authorize::AuthorizedJob;
pub use claim::ClaimedJob;
pub use execute::RanJob;
pub use gate::ClearedJob;
pub use receive::PolledJob;
pub use record::FinishedJob;
pub use resolve_role::ResolvedJob;
pub use verify::{Rejection, VerifiedJob};

/// Where a job came from, which decides whom its path answers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Delivered by the control plane: claimed, heartbeated, logged and reported there.
    Remote,
    /// One of the runner's own checks (`crate::drift`): the control plane never sent
    /// it; its claim, lease and result are settled on the VM
    /// (`control_plane::local::LocalChecks`), and the control plane learns of it from
    /// the audit log.
    Local,
}

impl Origin {
    /// A journaled job's origin. Journals written before `received` said so know the
    /// runner's own checks by their id alone.
    pub fn of_record(record: &crate::journal::JobRecord) -> Origin {
        if record.local || record.job_id.starts_with(byoc_protocol::LOCAL_JOB_PREFIX) {
            Origin::Local
        } else {
            Origin::Remote
        }
    }
}

/// What `accept` made of a delivery.
pub enum Accepted {
    /// Verified and journaled as received: run it with `run_job`, holding the mark.
    Job(Box<VerifiedJob>, InHand),
    /// Refused by `verify`; journaled. The caller reports it (`refuse::send_rejection`).
    Rejected(Rejection),
    /// Nothing to do: a second delivery of a job already in hand, or a job whose
    /// receipt could not be journaled (without it the runner cannot promise not to
    /// run it twice, so it does not run it at all).
    Dropped,
}

/// receive → verify → journal receipt. On the poll loop, before the next poll.
pub fn accept(rt: &Rt, polled: PolledJob, in_hand: &JobsInHand) -> Accepted {
    let pause = rt.check_customer_controls();
    let disk = rt.config.disk.check(&rt.state_dir);
    if disk.low.is_none() {
        crate::disk::Reserve::new(&rt.state_dir, &rt.config.disk).hold();
    }
    let readiness = readiness(rt);
    let verifier = verifier(rt, &readiness, pause.as_ref(), disk.low.as_deref());
    let job = match rt.journal.with_index(|index| verifier.verify(polled, index)) {
        Ok(job) => job,
        Err(rejection) => {
            refuse::journal_rejection(rt, &rejection);
            return Accepted::Rejected(rejection);
        }
    };
    let Some(mark) = in_hand.mark(&job.payload.job_id) else {
        tracing::info!(job_id = %job.payload.job_id, "Duplicate delivery of a job already in hand; ignored.");
        return Accepted::Dropped;
    };
    if let Err(e) = record_received(rt, &job) {
        tracing::error!(job_id = %job.payload.job_id, error = %e, "Could not journal the job; not running it: {e}.");
        return Accepted::Dropped;
    }
    Accepted::Job(Box::new(job), mark)
}

/// Whether this host can build a job's sandbox as documented now.
pub(crate) fn readiness(
    rt: &Rt,
) -> impl Fn(&dyn byoc_job_executors::Executor) -> Option<byoc_job_executors::Refusal> + Sync + '_ {
    |exec: &dyn byoc_job_executors::Executor| {
        byoc_job_executors::refusal(exec.placement(), rt.sandbox.as_ref(), rt.containers.as_ref())
    }
}

/// The runtime's verifier of deliveries, as of now.
pub(crate) fn verifier<'a>(
    rt: &'a Rt,
    readiness: &'a (dyn Fn(&dyn byoc_job_executors::Executor) -> Option<byoc_job_executors::Refusal> + Sync),
    paused: Option<&'a crate::roles::pause::Pause>,
    disk_low: Option<&'a str>,
) -> verify::Verifier<'a> {
    verify::Verifier {
        install: &rt.roles.install,
        paused,
        disk_low,
        keys: &rt.config.control_plane.public_keys,
        runner_id: &rt.runner_id,
        install_id: &rt.install_id,
        max_skew: rt.config.jobs.max_clock_skew,
        max_timeout: rt.config.jobs.max_timeout,
        now: rt.clock.unix_now(),
        readiness,
        registries: byoc_job_executors::OciSettings {
            registry_endpoints: rt.config.oci.registry_endpoints.clone(),
            ..Default::default()
        }
        .reach(),
        clusters: rt.config.kubernetes.reach(),
        job_provider_mirrors: rt.config.terraform.job_provider_mirrors,
        resume_held: false,
        update: Some((&rt.config.update, &rt.update_terms_dir)),
    }
}

/// Journal `received` before anything acts on the job: its nonce is spent.
pub(crate) fn record_received(rt: &Rt, job: &VerifiedJob) -> Result<(), RecordError> {
    let p = &job.payload;
    // On the poll loop, before the job's own task: its journal entry gets the job's fields.
    let fields = crate::logging::JobFields::of(p);
    crate::logging::JOB.sync_scope(fields, || {
        rt.transition(Event::Received {
            job_id: p.job_id.clone(),
            delivery_id: job.delivery_id.clone(),
            nonce: p.nonce.clone(),
            expires_at: p.expires_at,
            kind: p.kind.clone(),
            operation: p.operation.clone(),
            entity: p.entity.clone(),
            payload_sha256: job.payload_sha256.clone(),
            timeout_secs: p.timeout_secs,
            effect: Some(job.executor.effect().as_str().to_string()),
            component: p.role_request.as_ref().map(|r| r.entity_name.clone()).filter(|n| !n.is_empty()),
            local: job.origin == Origin::Local,
        })
    })
}

/// The rest of an accepted job's path, in order. `slot` (the daemon's concurrency
/// slot) is released when execution ends, and while the job waits for a maintenance
/// window; reporting may take longer. An error is a journal write that failed: the
/// job's state is uncertain until the next start.
pub async fn run_job<Slot: gate::JobSlot>(
    rt: Rt,
    job: VerifiedJob,
    mut slot: Slot,
) -> Result<(), RecordError> {
    let job_id = job.payload.job_id.clone();
    let scoped = match resolve_role::resolve(&rt, job).await {
        Ok(scoped) => scoped,
        Err(refused) => {
            let (job, rejection) = *refused;
            return refuse::refuse_received(&rt, &job, rejection).await;
        }
    };
    let authorized = match authorize::authorize(&rt, scoped) {
        Ok(job) => job,
        Err(e) => {
            // Left `received`: the next start settles it as interrupted.
            tracing::error!(error = %e, "Not running the job: {e}.");
            return Ok(());
        }
    };
    let window = window::check(&rt, &authorized.verified);
    if let Some(rejection) = window::outside_window(&authorized.verified, &window) {
        return refuse::refuse_received(&rt, &authorized.verified, rejection).await;
    }
    let claimed = match claim::claim(&rt, authorized).await? {
        claim::ClaimOutcome::Claimed(claimed) => *claimed,
        claim::ClaimOutcome::NotClaimed { .. } => return Ok(()),
    };
    let cleared = match gate::clear(&rt, claimed, &mut slot, window).await? {
        gate::Gated::Cleared(cleared) => *cleared,
        gate::Gated::Settled => {
            rt.leases.release(&job_id);
            return report_if_finished(&rt, &job_id).await;
        }
    };
    let ran = match assume_role::assume(&rt, cleared).await {
        Ok(assumed) => execute::execute(&rt, assumed).await?,
        Err(not_assumed) => execute::not_run(&rt, *not_assumed).await?,
    };
    let finished = record::record(&rt, ran)?;
    drop(slot);
    report::report(&rt, finished).await.map(|_| ())
}

/// A job settled while it waited: a cancelled one has a result to report.
async fn report_if_finished(rt: &Rt, job_id: &str) -> Result<(), RecordError> {
    match FinishedJob::from_journal(rt, job_id) {
        Some(finished) => report::report(rt, finished).await.map(|_| ()),
        None => Ok(()),
    }
}

/// Jobs with a live task (from `received` until reported or refused). A second
/// delivery of one of these (the server re-offered it while our claim was still
/// being retried) is dropped: the live task claims and runs it, once.
#[derive(Clone, Default)]
pub struct JobsInHand(Arc<Mutex<HashSet<String>>>);

impl JobsInHand {
    /// Mark a job in hand; `None` if it already was.
    pub fn mark(&self, job_id: &str) -> Option<InHand> {
        let fresh = self.0.lock().unwrap_or_else(|e| e.into_inner()).insert(job_id.to_string());
        fresh.then(|| InHand { set: self.clone(), job_id: job_id.to_string() })
    }

    /// Whether a job whose id starts with `prefix` is in hand.
    pub fn any_starting_with(&self, prefix: &str) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|id| id.starts_with(prefix))
    }
}

/// A job's mark in `JobsInHand`, removed when dropped.
pub struct InHand {
    set: JobsInHand,
    job_id: String,
}

impl Drop for InHand {
    fn drop(&mut self) {
        self.set.0.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.job_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, journaled};
    use byoc_protocol::RejectReason;

    #[tokio::test]
    async fn an_accepted_job_runs_every_stage_in_order() {
        let f = testing::runtime().await;
        let in_hand = JobsInHand::default();
        let Accepted::Job(job, mark) = accept(&f.rt, f.delivery(&testing::payload("job-1")), &in_hand) else {
            panic!("not accepted")
        };
        // A second delivery while the first is in hand is dropped, not run twice.
        assert!(matches!(accept(&f.rt, f.delivery(&testing::payload("job-1")), &in_hand), Accepted::Dropped));
        run_job(f.rt.clone(), *job, ()).await.expect("journal");
        drop(mark);
        assert_eq!(journaled(&f), ["received", "claimed", "started", "finished", "reported"]);
        assert_eq!(f.cp.calls(), ["claim job-1", "result job-1 succeeded"]);
    }

    #[tokio::test]
    async fn a_local_check_answers_to_the_vm_and_the_control_plane_hears_nothing_of_it() {
        let f = testing::runtime().await;
        let mut job = testing::verified("job-1", None);
        job.origin = Origin::Local;
        testing::receive(&f, &job);
        run_job(f.rt.clone(), job, ()).await.expect("journal");
        assert_eq!(journaled(&f), ["received", "claimed", "started", "finished", "reported"]);
        assert!(f.cp.calls().is_empty(), "{:?}", f.cp.calls());
        // After a restart its report still goes nowhere but the VM.
        let finished = FinishedJob::from_journal(&f.rt, "job-1").expect("finished");
        assert_eq!(finished.origin, Origin::Local);
    }

    #[tokio::test]
    async fn a_replayed_envelope_is_rejected_and_journaled() {
        let f = testing::runtime().await;
        let in_hand = JobsInHand::default();
        let Accepted::Job(job, _mark) = accept(&f.rt, f.delivery(&testing::payload("job-1")), &in_hand)
        else {
            panic!("not accepted")
        };
        run_job(f.rt.clone(), *job, ()).await.expect("journal");
        let mut replay = testing::payload("job-2");
        replay.nonce = "nonce-job-1".into();
        let Accepted::Rejected(r) = accept(&f.rt, f.delivery(&replay), &in_hand) else { panic!("accepted") };
        assert_eq!(r.reason, RejectReason::ReplayedNonce);
        assert_eq!(journaled(&f).last().map(String::as_str), Some("rejected"));
    }

    #[tokio::test]
    async fn an_expired_envelope_is_rejected_by_the_runtime_clock() {
        let f = testing::runtime().await;
        f.clock.advance_secs(3600);
        let Accepted::Rejected(r) =
            accept(&f.rt, f.delivery(&testing::payload("job-1")), &JobsInHand::default())
        else {
            panic!("accepted")
        };
        assert_eq!(r.reason, RejectReason::Expired);
    }

    #[tokio::test]
    async fn a_receipt_that_cannot_be_journaled_is_never_run() {
        let f = testing::runtime().await;
        f.journal.fail_appends.store(true, std::sync::atomic::Ordering::SeqCst);
        let in_hand = JobsInHand::default();
        assert!(matches!(accept(&f.rt, f.delivery(&testing::payload("job-1")), &in_hand), Accepted::Dropped));
        assert!(in_hand.mark("job-1").is_some(), "its mark is released");
        assert!(f.cp.calls().is_empty());
    }

    #[tokio::test]
    async fn a_switched_off_role_is_refused_before_the_claim() {
        let f = testing::runtime().await;
        f.switches.set("maintenance", false);
        run_job(f.rt.clone(), testing::verified("job-1", Some("maintenance")), ()).await.expect("journal");
        assert_eq!(f.cp.calls(), ["reject dl-job-1 role_disabled"]);
        assert_eq!(f.sts.calls.load(std::sync::atomic::Ordering::SeqCst), 0);
    }
}
