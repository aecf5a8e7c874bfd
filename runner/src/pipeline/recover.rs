//! After a crash or restart, before the first poll: what the journal shows unfinished
//! is settled, never re-run (the runner cannot know what a job already did, and
//! payloads are not stored).
//!
//! - received, not claimed: the claim may have reached the control plane before the
//!   crash, in which case it will never offer the job again. Claim it again (claims are
//!   idempotent per runner) and report it interrupted rather than leave it hanging.
//! - held by the customer's guardrails (`waiting_window`, `awaiting_approval`) with its
//!   envelope kept (`held::HELD_DIR`) that still verifies: resumed (`resume_held`),
//!   never settled here.
//! - claimed or started, not finished: journaled `interrupted` with what its log holds.
//! - finished, not acknowledged: reported again.

use std::future::Future;

use crate::clock::now_ms;
use crate::control_plane::retry::{Policy, Retried, retry};
use crate::journal::{Event, Phase, RecordError};
use crate::runtime::Rt;
use crate::spool;
use crate::state_dir::StateDir;

use super::{JobsInHand, report};

/// A job recovery wants finished in the background (on the daemon's task set).
pub type Settle = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Settle every unfinished job in the journal. Interrupted jobs are journaled before
/// this returns; their claims and reports are returned as tasks for the caller to run.
pub fn recover(
    rt: &Rt,
    in_hand: &JobsInHand,
    resumed: &std::collections::HashSet<String>,
) -> Result<Vec<Settle>, RecordError> {
    let mut tasks: Vec<Settle> = Vec::new();
    let unclaimed: Vec<(String, String, super::Origin)> = rt.journal.with_index(|i| {
        i.jobs
            .values()
            .filter(|j| j.phase == Phase::Received)
            .map(|j| (j.job_id.clone(), j.delivery_id.clone(), super::Origin::of_record(j)))
            .collect()
    });
    for (job_id, delivery_id, origin) in unclaimed {
        let mark = in_hand.mark(&job_id);
        let rt = rt.clone();
        tasks.push(in_job_span(&rt.clone(), job_id.clone(), async move {
            let _mark = mark;
            if let Err(e) = settle_unclaimed(&rt, origin, &job_id, &delivery_id).await {
                tracing::error!(error = %e, "Journal write failed while settling an unclaimed job: {e}.");
            }
        }));
    }
    let pending: Vec<(String, Phase)> = rt.journal.with_index(|i| {
        i.jobs
            .values()
            .filter(|j| {
                matches!(
                    j.phase,
                    Phase::Claimed
                        | Phase::WaitingWindow
                        | Phase::AwaitingApproval
                        | Phase::Started
                        | Phase::Finished
                )
            })
            .filter(|j| !resumed.contains(&j.job_id))
            .map(|j| (j.job_id.clone(), j.phase))
            .collect()
    });
    for (job_id, phase) in pending {
        if phase != Phase::Finished {
            interrupt(rt, &job_id, phase)?;
        }
        let rt = rt.clone();
        tasks.push(in_job_span(&rt.clone(), job_id.clone(), async move {
            let Some(finished) = super::FinishedJob::from_journal(&rt, &job_id) else { return };
            if let Err(e) = report::report(&rt, finished).await {
                tracing::error!(error = %e, "Journal write failed while reporting: {e}.");
            }
        }));
    }
    Ok(tasks)
}

/// Jobs the guardrails held when the runner stopped whose kept envelope still
/// verifies: they go through their path again (`pipeline::run_job`). The others are
/// left to `recover`, which settles them as interrupted.
pub fn resume_held(rt: &Rt) -> Vec<super::VerifiedJob> {
    let held: Vec<String> = rt.journal.with_index(|i| {
        i.jobs
            .values()
            .filter(|j| matches!(j.phase, Phase::WaitingWindow | Phase::AwaitingApproval))
            .map(|j| j.job_id.clone())
            .collect()
    });
    let readiness = super::readiness(rt);
    let mut out = Vec::new();
    for job_id in held {
        let Some(polled) = super::held::kept_delivery(&rt.state_dir, &job_id) else {
            tracing::warn!(job_id = %job_id, "A held job's envelope was not kept; settling it as interrupted.");
            continue;
        };
        // Pause and disk are checked again when it leaves the gate, not here.
        let verifier =
            super::verify::Verifier { resume_held: true, ..super::verifier(rt, &readiness, None, None) };
        match rt.journal.with_index(|index| verifier.verify(polled, index)) {
            Ok(job) if job.payload.job_id == job_id => {
                tracing::info!(job_id = %job_id, "Resuming a job the guardrails held when the runner stopped.");
                out.push(job);
            }
            Ok(_) => {
                tracing::warn!(job_id = %job_id, "A held job's kept envelope is another job's; settling it as interrupted.")
            }
            Err(r) => {
                tracing::warn!(job_id = %job_id, reason = r.reason.code(), detail = %r.detail, "A held job's kept envelope no longer verifies; settling it as interrupted.")
            }
        }
    }
    out
}

fn in_job_span(rt: &Rt, job_id: String, task: impl Future<Output = ()> + Send + 'static) -> Settle {
    let span = tracing::info_span!("job", job_id = %job_id, install_id = %rt.install_id);
    Box::pin(tracing::Instrument::instrument(task, span))
}

/// A claimed or started job the runner stopped under: finished as interrupted, with
/// what its log holds; its working directory and sandbox mount point removed.
fn interrupt(rt: &Rt, job_id: &str, phase: Phase) -> Result<(), RecordError> {
    // Past its cap the log's tail is in a ring beside the spool: it goes after the head,
    // in order, as the job's end would have put it.
    let cap = spool::LogCap::of(rt.config.jobs.log_max_bytes);
    let recovered = spool::recover_tail(&rt.state_dir, job_id, cap).unwrap_or_else(|e| {
        tracing::warn!(error = %e, job_id = %job_id, "Could not put an interrupted job's log tail after its head; the head stands as its log: {e}.");
        let _ = std::fs::remove_file(spool::tail_path(&rt.state_dir, job_id));
        None
    });
    let why = format!("the runner stopped while the job was {}; it was not re-run", phase.as_str());
    // Its log ends, as every job's does, with how it ended (a job's own output never
    // has the last word).
    let log = spool::spool_path(&rt.state_dir, job_id);
    if log.exists()
        && let Err(e) = spool::append_last_line(&log, &format!("[runner] job interrupted: {why}"))
    {
        tracing::warn!(error = %e, job_id = %job_id, "Could not end an interrupted job's log with its outcome: {e}.");
    }
    let log_omitted = recovered.map_or(0, |d| d.omitted);
    let (log_size, log_sha256) = spool::digest_file(&log).unwrap_or((0, byoc_protocol::sha256_hex(b"")));
    let started = rt.journal.job(job_id).and_then(|j| j.started_at_ms);
    rt.transition(Event::Finished {
        job_id: job_id.to_string(),
        status: byoc_protocol::JobStatus::Interrupted,
        exit_code: None,
        error: Some(why),
        log_size,
        log_sha256,
        log_omitted,
        started_at_ms: started,
        finished_at_ms: now_ms(),
        outputs: serde_json::Value::Null,
    })?;
    let work_dir = StateDir::of(&rt.state_dir).work().join(job_id);
    // A terraform job's local state, as far as terraform got, goes back to its workspace
    // before the directory does: what it created exists, and the next plan must know.
    // The workspace is the one journaled when the job started, never a name read from
    // the job's directory.
    let tfstate = StateDir::of(&rt.state_dir).tfstate();
    let workspace = rt.journal.job(job_id).and_then(|j| j.state_workspace);
    let salvaged = match &workspace {
        // Only while its module is staged for apply (the runner's marker beside it): before,
        // only job code could have written a state file there (plan never does); after,
        // the job kept its state itself and removed the marker.
        Some(ws)
            if work_dir.is_dir() && byoc_job_executors::terraform::apply_staged(&work_dir) == Some(true) =>
        {
            byoc_job_executors::terraform::state::salvage(&work_dir, &tfstate, ws)
        }
        _ => Ok(None),
    };
    match salvaged {
        Ok(Some(serial)) => {
            tracing::warn!(
                workspace = workspace.as_deref().unwrap_or_default(),
                serial,
                "Kept the terraform state the interrupted job left."
            )
        }
        Ok(None) => {}
        Err(e) => {
            // Keep the directory: the state in it is the only record of what was made.
            tracing::error!(error = %e, dir = %work_dir.display(), "Could not keep an interrupted job's terraform state; its directory is left in place: {e}.");
            return Ok(());
        }
    }
    let _ = std::fs::remove_dir_all(&work_dir);
    // The runner's directories beside it (a terraform job's sealed plan and tree).
    for suffix in byoc_job_executors::BESIDE_WORK {
        let _ = std::fs::remove_dir_all(byoc_job_executors::beside_work(&work_dir, suffix));
    }
    // The sandboxes' mount points, `<job id>-s<n>` (their namespaces died with the runner).
    let roots = StateDir::of(&rt.state_dir).roots();
    let prefix = format!("{job_id}-s");
    for entry in std::fs::read_dir(&roots).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let ours = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if ours {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
    Ok(())
}

async fn settle_unclaimed(
    rt: &Rt,
    origin: super::Origin,
    job_id: &str,
    delivery_id: &str,
) -> Result<(), RecordError> {
    let policy = Policy::new(rt.config.poll.backoff_initial, rt.config.poll.backoff_max);
    let claimed = retry(policy, &rt.stop_reporting, |_| async {
        // Claimed only to be reported, never run: nothing to hold to the lease.
        match rt.plane(origin).claim(job_id, delivery_id, false).await {
            Ok(c) => Ok(Ok((c.lease_secs, c.epoch))),
            Err(e) if e.is_transient() => Err(e),
            Err(e) => Ok(Err(e.to_string())),
        }
    })
    .await;
    match claimed {
        Retried::Stopped | Retried::Exhausted(_) => Ok(()),
        Retried::Done(Err(detail)) => rt.transition(Event::ClaimRefused { job_id: job_id.into(), detail }),
        Retried::Done(Ok((lease_secs, epoch))) => {
            rt.transition(Event::Claimed { job_id: job_id.into(), lease_secs, epoch })?;
            rt.transition(Event::Finished {
                job_id: job_id.into(),
                status: byoc_protocol::JobStatus::Interrupted,
                exit_code: None,
                error: Some(
                    "the runner restarted after receiving the job and before starting it; it was not run"
                        .into(),
                ),
                log_size: 0,
                log_sha256: byoc_protocol::sha256_hex(b""),
                log_omitted: 0,
                started_at_ms: None,
                finished_at_ms: now_ms(),
                outputs: serde_json::Value::Null,
            })?;
            match super::FinishedJob::from_journal(rt, job_id) {
                Some(finished) => report::report(rt, finished).await.map(|_| ()),
                None => Ok(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::testing::{self, Fakes, conflict, journaled};

    async fn settle(f: &Fakes) {
        for task in recover(&f.rt, &JobsInHand::default(), &Default::default()).expect("journal") {
            task.await;
        }
    }

    fn reported_statuses(f: &Fakes) -> Vec<&'static str> {
        f.cp.reported.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|r| r.status.as_str()).collect()
    }

    #[tokio::test]
    async fn a_started_job_is_reported_interrupted_never_rerun() {
        let f = testing::runtime().await;
        testing::receive(&f, &testing::verified("job-1", None));
        f.rt.transition(Event::Claimed { job_id: "job-1".into(), lease_secs: 60, epoch: 0 })
            .expect("journal");
        f.rt.transition(Event::Started {
            job_id: "job-1".into(),
            started_at_ms: 5,
            network: None,
            state_workspace: None,
        })
        .expect("journal");
        let work = StateDir::of(&f.rt.state_dir).work().join("job-1");
        std::fs::create_dir_all(&work).expect("work dir");
        let sealed = work.with_file_name("job-1.sealed");
        std::fs::create_dir_all(&sealed).expect("sealed dir");
        std::fs::write(sealed.join("plan.tfplan"), b"plan").expect("sealed plan");
        settle(&f).await;
        assert_eq!(journaled(&f), ["received", "claimed", "started", "finished", "reported"]);
        assert_eq!(reported_statuses(&f), ["interrupted"]);
        assert!(!work.exists(), "the interrupted job's working directory is removed");
        assert!(!sealed.exists(), "and the runner's sealed copies beside it");
        assert!(!f.cp.calls().iter().any(|c| c.starts_with("claim")), "nothing is claimed again");
    }

    #[tokio::test]
    async fn a_received_job_is_claimed_again_then_reported_interrupted() {
        let f = testing::runtime().await;
        testing::receive(&f, &testing::verified("job-1", None));
        settle(&f).await;
        assert_eq!(journaled(&f), ["received", "claimed", "finished", "reported"]);
        assert_eq!(f.cp.calls(), ["claim job-1", "result job-1 interrupted"]);
    }

    #[tokio::test]
    async fn a_received_job_whose_claim_is_refused_is_left_unrun_and_unreported() {
        let f = testing::runtime().await;
        testing::receive(&f, &testing::verified("job-1", None));
        f.cp.script_claims([Err(conflict("claim", "job expired"))]);
        settle(&f).await;
        assert_eq!(journaled(&f), ["received", "claim_refused"]);
        assert!(reported_statuses(&f).is_empty());
    }

    #[tokio::test]
    async fn a_finished_unreported_job_is_reported_as_it_finished() {
        let f = testing::runtime().await;
        testing::receive(&f, &testing::verified("job-1", None));
        for event in [
            Event::Claimed { job_id: "job-1".into(), lease_secs: 60, epoch: 0 },
            Event::Finished {
                job_id: "job-1".into(),
                status: byoc_protocol::JobStatus::Failed,
                exit_code: Some(3),
                error: None,
                log_size: 0,
                log_sha256: byoc_protocol::sha256_hex(b""),
                log_omitted: 0,
                started_at_ms: None,
                finished_at_ms: 9,
                outputs: serde_json::Value::Null,
            },
        ] {
            f.rt.transition(event).expect("journal");
        }
        settle(&f).await;
        assert_eq!(reported_statuses(&f), ["failed"]);
        assert_eq!(journaled(&f).iter().filter(|e| *e == "finished").count(), 1);
    }

    #[tokio::test]
    async fn reported_and_refused_jobs_are_left_alone() {
        let f = testing::runtime().await;
        testing::receive(&f, &testing::verified("job-1", None));
        f.rt.transition(Event::ClaimRefused { job_id: "job-1".into(), detail: "taken".into() })
            .expect("journal");
        assert!(recover(&f.rt, &JobsInHand::default(), &Default::default()).expect("journal").is_empty());
    }

    #[tokio::test]
    async fn an_interruption_that_cannot_be_journaled_stops_the_start() {
        let f = testing::runtime().await;
        testing::receive(&f, &testing::verified("job-1", None));
        f.rt.transition(Event::Claimed { job_id: "job-1".into(), lease_secs: 60, epoch: 0 })
            .expect("journal");
        f.journal.fail_appends.store(true, Ordering::SeqCst);
        assert!(recover(&f.rt, &JobsInHand::default(), &Default::default()).is_err());
    }
}
