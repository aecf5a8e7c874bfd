//! Stage 6, gate: `ClaimedJob` → `ClearedJob`. What the customer holds a claimed job
//! for before it may run: its maintenance window (`window.rs` says which) and a local
//! approval rule (`approval.rs`), then the policy context is taken again as of the
//! moment it runs. A held job is journaled `waiting_window` or `awaiting_approval` and
//! reported with what it waits for on every heartbeat, without holding its group's
//! slot. When it may go on it is checked again as if it had just arrived (expiry,
//! pause, the role's switch and allowance); one that expired meanwhile is refused
//! `expired`, one the vendor cancelled is settled cancelled, and neither ever ran.
//!
//! A held job's envelope is kept in `<state dir>/held/<job>.json` (0600, fsynced) from
//! the moment it is held until it leaves the gate, unless it carries secrets (those
//! never go to disk): after a restart, `recover` verifies it again (signature, runner,
//! expiry) and the job goes through its path again from `resolve_role`, claimed again
//! (claims are idempotent per runner) and held again.

use std::time::Duration;

use byoc_protocol::{JobStatus, JobWaiting, RejectReason};

use super::authorize::PolicyChoice;
use super::claim::ClaimedJob;
use super::held::{forget_held, keep_held};
use super::resolve_role::ResolvedRole;
use super::window::{WindowClose, check, close_of, next_opening, policy_context};
use super::{Rejection, VerifiedJob, approval, refuse, resolve_role};
use crate::clock::rfc3339;
use crate::guardrails::WindowCheck;
use crate::journal::{Event, RecordError};
use crate::runtime::Rt;

/// A concurrency slot a job can give back while it waits and take again to run.
pub trait JobSlot: Send {
    fn release(&mut self);
    /// Wait until the group has room, then hold a slot again.
    fn reacquire(&mut self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// No slots (unit tests, `run-local`).
impl JobSlot for () {
    fn release(&mut self) {}
    fn reacquire(&mut self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async {})
    }
}

/// A job the customer's gates let through, about to run.
pub struct ClearedJob {
    pub verified: VerifiedJob,
    pub role: Option<ResolvedRole>,
    /// Its policy decision, with the context as of now.
    pub policy: PolicyChoice,
    /// When its maintenance window closes, for a rule that cancels the job then.
    pub window_close: Option<WindowClose>,
}

pub enum Gated {
    /// Let through: run it.
    Cleared(Box<ClearedJob>),
    /// Refused, expired or cancelled while it waited; journaled (a cancelled one has a
    /// result to report).
    Settled,
}

/// The gate. `window` is the verdict taken before the claim (a job outside a window
/// whose rule refuses never got here).
pub async fn clear(
    rt: &Rt,
    claimed: ClaimedJob,
    slot: &mut impl JobSlot,
    window: WindowCheck,
) -> Result<Gated, RecordError> {
    let mut claimed = claimed;
    if matches!(window, WindowCheck::Closed { .. }) {
        claimed = match wait_for_window(rt, claimed, slot, window).await? {
            Waited::Run(claimed) => *claimed,
            Waited::Settled => return Ok(Gated::Settled),
        };
    } else {
        claimed.window_close = close_of(&window);
    }
    if let Some(rule) = approval::approval_rule(rt, &claimed.verified) {
        claimed = match approval::await_approval(rt, claimed, slot, &rule).await? {
            Waited::Run(claimed) => *claimed,
            Waited::Settled => return Ok(Gated::Settled),
        };
    }
    let ClaimedJob { verified, role, mut policy, window_close, approvals, .. } = claimed;
    // The context its policies read is as of now, after any wait.
    if let Some(scope) = policy.scope.as_mut() {
        let now = check(rt, &verified);
        scope.context = policy_context(rt, &verified, &now, &approvals);
    }
    Ok(Gated::Cleared(Box::new(ClearedJob { verified, role, policy, window_close })))
}

pub(super) enum Waited {
    /// The window opened and the job passed its checks again: run it.
    Run(Box<ClaimedJob>),
    /// Refused, expired or cancelled while it waited; journaled and reported.
    Settled,
}

/// What a gate says about a held job at one look.
pub(super) enum Look {
    /// It may go on.
    Ready,
    /// Not yet: what to report.
    Wait(JobWaiting),
    /// Never: refuse it with this reason.
    Refuse(RejectReason, String),
}

/// Hold a claimed job until its window opens. `slot` is given back while it waits.
async fn wait_for_window(
    rt: &Rt,
    job: ClaimedJob,
    slot: &mut impl JobSlot,
    first: WindowCheck,
) -> Result<Waited, RecordError> {
    let mut current = Some(first);
    hold(rt, job, slot, |rt, job| {
        let now = current.take().unwrap_or_else(|| check(rt, job));
        match now {
            WindowCheck::Closed { rule, next, .. } => Look::Wait(JobWaiting {
                state: "waiting_window".into(),
                until: next.as_ref().map(|(_, t)| *t),
                detail: format!("rule {rule:?}: {}", next_opening(&next)),
            }),
            _ => Look::Ready,
        }
    })
    .await
}

/// A held job's state, for people.
fn held_as(state: &str) -> &str {
    match state {
        "waiting_window" => "waiting for its maintenance window",
        "awaiting_approval" => "awaiting approval",
        other => other,
    }
}

/// The refusal of a received job, carrying its ids.
pub(super) fn rejection_of(job: &VerifiedJob, reason: RejectReason, detail: String) -> Rejection {
    let p = &job.payload;
    Rejection {
        delivery_id: job.delivery_id.clone(),
        reason,
        detail,
        job_id: Some(p.job_id.clone()),
        nonce: Some(p.nonce.clone()),
        expires_at: Some(p.expires_at),
    }
}

/// The loop every gate shares: journal and report what the job waits for (again
/// whenever that changes), heartbeat the lease (a vendor cancel settles the job),
/// refuse it once its envelope expires, look at the gate about every second, then
/// check it again as if it had just arrived.
pub(super) async fn hold<F>(
    rt: &Rt,
    job: ClaimedJob,
    slot: &mut impl JobSlot,
    mut look: F,
) -> Result<Waited, RecordError>
where
    F: FnMut(&Rt, &VerifiedJob) -> Look,
{
    let job_id = job.verified.payload.job_id.clone();
    if !job.verified.executor.secrets().is_empty() {
        // A job's secrets (a one-time registry token, secret_env) never go to disk.
        tracing::info!(
            "The held job carries secrets, so its envelope is not kept on disk: a restart meanwhile would settle it as interrupted."
        );
    } else if let Err(e) = keep_held(rt, &job.verified) {
        // It can still wait; only a restart meanwhile would lose it (settled interrupted).
        tracing::warn!(error = %e, "Could not keep the held job's envelope; a restart would settle it as interrupted: {e}.");
    }
    slot.release();
    let waited = hold_loop(rt, job, slot, &mut look).await;
    // Kept only while held: a runner stopping mid-wait keeps it for the next start.
    if !rt.abort.is_cancelled() {
        forget_held(rt, &job_id);
    }
    waited
}

async fn hold_loop<F>(
    rt: &Rt,
    job: ClaimedJob,
    slot: &mut impl JobSlot,
    look: &mut F,
) -> Result<Waited, RecordError>
where
    F: FnMut(&Rt, &VerifiedJob) -> Look,
{
    let job_id = job.verified.payload.job_id.clone();
    let expires_at = job.verified.payload.expires_at;
    let mut reported: Option<JobWaiting> = None;
    let mut last_heartbeat: Option<std::time::Instant> = None;
    loop {
        // The CLI's records (an approval, a denial) reach the audit log before what
        // they cause.
        let _ = rt.check_customer_controls();
        let waiting = match look(rt, &job.verified) {
            Look::Ready => break,
            Look::Refuse(reason, detail) => {
                refuse::refuse_received(rt, &job.verified, rejection_of(&job.verified, reason, detail))
                    .await?;
                return Ok(Waited::Settled);
            }
            Look::Wait(w) => w,
        };
        let changed = reported.as_ref() != Some(&waiting);
        if changed {
            let until = waiting.until.map(crate::clock::rfc3339);
            tracing::info!(
                state = %waiting.state,
                until = until.as_deref().unwrap_or("-"),
                detail = %waiting.detail,
                "Job held by the customer's guardrails ({}) until {}: {}.",
                waiting.state,
                until.as_deref().unwrap_or("further notice"),
                waiting.detail
            );
            rt.transition(Event::Waiting {
                job_id: job_id.clone(),
                state: waiting.state.clone(),
                until: waiting.until,
                detail: waiting.detail.clone(),
            })?;
            reported = Some(waiting.clone());
        }
        if changed || last_heartbeat.is_none_or(|t| t.elapsed() >= rt.config.jobs.heartbeat_interval) {
            last_heartbeat = Some(std::time::Instant::now());
            let sent = crate::leases::now_ns();
            match rt.plane(job.verified.origin).heartbeat(&job_id, Some(&waiting)).await {
                Ok(hb) if hb.cancel => {
                    tracing::warn!("Control plane cancelled the job while it was held.");
                    settle_cancelled(rt, &job_id, &waiting.state)?;
                    return Ok(Waited::Settled);
                }
                Ok(hb) => rt.leases.renewed(&job_id, sent, hb.lease_secs),
                Err(e) if crate::control_plane::is_fenced(&e) => {
                    // Another runner holds the job now: it never runs here.
                    tracing::warn!(error = %e, "The job's lease was given to another runner while it was held.");
                    rt.transition(Event::Fenced { job_id: job_id.clone(), detail: e.to_string() })?;
                    return Ok(Waited::Settled);
                }
                Err(e) => tracing::warn!(error = %e, "Heartbeat of a held job failed: {e}."),
            }
        }
        if rt.clock.unix_now() > expires_at {
            let detail = format!(
                "the envelope expired at {} while the job was {}; it never ran",
                rfc3339(expires_at),
                held_as(&waiting.state)
            );
            refuse::refuse_received(
                rt,
                &job.verified,
                rejection_of(&job.verified, RejectReason::Expired, detail),
            )
            .await?;
            return Ok(Waited::Settled);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1).min(rt.config.jobs.heartbeat_interval)) => {}
            _ = rt.abort.cancelled() => {
                // The runner is stopping: the next start settles the job as interrupted.
                return Ok(Waited::Settled);
            }
        }
    }
    slot.reacquire().await;
    recheck(rt, job).await
}

/// A held job let through, checked again as if it had just arrived: the customer may
/// have paused the runner or switched the role off while it waited.
async fn recheck(rt: &Rt, job: ClaimedJob) -> Result<Waited, RecordError> {
    let ClaimedJob { verified, policy, lease_secs, approvals, .. } = job;
    if let Some(p) = rt.check_customer_controls() {
        let detail = format!("the customer paused the runner while the job was held (by {})", p.by);
        let rejection = rejection_of(&verified, RejectReason::Paused, detail);
        refuse::refuse_received(rt, &verified, rejection).await?;
        return Ok(Waited::Settled);
    }
    match resolve_role::resolve(rt, verified).await {
        Ok(scoped) => {
            let window_close = close_of(&check(rt, &scoped.verified));
            Ok(Waited::Run(Box::new(ClaimedJob {
                verified: scoped.verified,
                role: scoped.role,
                policy,
                lease_secs,
                window_close,
                approvals,
            })))
        }
        Err(refused) => {
            let (verified, rejection) = *refused;
            refuse::refuse_received(rt, &verified, rejection).await?;
            Ok(Waited::Settled)
        }
    }
}

/// The vendor cancelled a job that never started: journaled cancelled, reported.
fn settle_cancelled(rt: &Rt, job_id: &str, state: &str) -> Result<(), RecordError> {
    rt.transition(Event::Finished {
        job_id: job_id.to_string(),
        status: JobStatus::Cancelled,
        exit_code: None,
        error: Some(format!("cancelled by the control plane while it was {}; it never ran", held_as(state))),
        log_size: 0,
        log_sha256: byoc_protocol::sha256_hex(b""),
        log_omitted: 0,
        started_at_ms: None,
        finished_at_ms: crate::clock::now_ms(),
        outputs: serde_json::Value::Null,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Clock as _;
    use crate::guardrails::OnClose;
    use crate::pipeline::{Accepted, JobsInHand, accept, run_job};
    use crate::testing::{self, NOW, journaled};
    use byoc_protocol::JobHeartbeatResponse;

    /// One window an hour after the fixed clock's start, for an hour; jobs of
    /// `action.trigger` are bound to it.
    fn config(outside: &str) -> String {
        format!(
            "[[guardrails.window]]\nname = \"change\"\nonce = [\"{}/1h\"]\n\
             [[guardrails.window_rule]]\nname = \"actions\"\nwindows = [\"change\"]\n\
             operations = [\"action.trigger\"]\noutside = \"{outside}\"\n",
            rfc3339(NOW + 3600)
        )
    }

    fn accepted(f: &testing::Fakes, payload: byoc_protocol::JobPayload) -> VerifiedJob {
        let in_hand = JobsInHand::default();
        match accept(&f.rt, f.delivery(&payload), &in_hand) {
            Accepted::Job(job, _) => *job,
            _ => panic!("not accepted"),
        }
    }

    /// Until the job is journaled waiting (the stage runs in another task).
    async fn until_waiting(f: &testing::Fakes) {
        for _ in 0..500 {
            if journaled(f).iter().any(|e| e == "waiting") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("never waited: {:?}", journaled(f));
    }

    #[tokio::test]
    async fn a_job_outside_its_window_waits_is_reported_and_runs_when_it_opens() {
        let f = testing::runtime_with(&config("wait")).await;
        let mut payload = testing::payload("job-1");
        payload.expires_at = NOW + 7200;
        let job = accepted(&f, payload);
        let task = tokio::spawn(run_job(f.rt.clone(), job, ()));
        until_waiting(&f).await;
        assert!(!task.is_finished());
        let detail = f.rt.journal.job("job-1").and_then(|j| j.detail).unwrap_or_default();
        assert!(detail.contains("\"change\" opens next at"), "{detail}");
        assert_eq!(f.rt.journal.job("job-1").map(|j| j.phase), Some(crate::journal::Phase::WaitingWindow));
        f.clock.advance_secs(3600);
        task.await.expect("task").expect("journal");
        assert_eq!(journaled(&f), ["received", "claimed", "waiting", "started", "finished", "reported"]);
        let calls = f.cp.calls();
        assert_eq!(calls.first().map(String::as_str), Some("claim job-1"));
        assert!(calls.contains(&"heartbeat job-1 waiting_window".to_string()), "{calls:?}");
        assert_eq!(calls.last().map(String::as_str), Some("result job-1 succeeded"));
        let audited = f.audit.records.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let wait = audited.iter().find(|r| r.event == "window_wait").expect("window_wait audited");
        assert!(wait.detail.as_deref().unwrap_or("").contains(&rfc3339(NOW + 3600)), "{wait:?}");
    }

    #[tokio::test]
    async fn a_rule_that_refuses_refuses_outside_its_window_before_the_claim() {
        let f = testing::runtime_with(&config("refuse")).await;
        let job = accepted(&f, testing::payload("job-1"));
        run_job(f.rt.clone(), job, ()).await.expect("journal");
        assert_eq!(journaled(&f), ["received", "refused"]);
        assert_eq!(f.cp.calls(), ["reject dl-job-1 outside_window"]);
        let detail = f.rt.journal.job("job-1").and_then(|j| j.detail).unwrap_or_default();
        assert!(detail.starts_with("outside_window: "), "{detail}");
        assert!(detail.contains(&rfc3339(NOW + 3600)), "{detail}");
    }

    #[tokio::test]
    async fn inside_its_window_a_job_runs_at_once_and_other_jobs_are_not_bound() {
        let f = testing::runtime_with(&config("refuse")).await;
        f.clock.advance_secs(3601);
        let mut payload = testing::payload("job-1");
        payload.issued_at = NOW + 3590;
        payload.expires_at = NOW + 4000;
        run_job(f.rt.clone(), accepted(&f, payload), ()).await.expect("journal");
        assert_eq!(journaled(&f), ["received", "claimed", "started", "finished", "reported"]);
        // A sandbox job is not named by the rule: it runs outside the window.
        let f = testing::runtime_with(&config("refuse")).await;
        let mut other = testing::payload("job-2");
        other.entity = "sandbox".into();
        other.operation = "provision".into();
        run_job(f.rt.clone(), accepted(&f, other), ()).await.expect("journal");
        assert_eq!(journaled(&f), ["received", "claimed", "started", "finished", "reported"]);
    }

    #[tokio::test]
    async fn a_job_that_expires_while_it_waits_is_rejected_expired_and_never_runs() {
        let f = testing::runtime_with(&config("wait")).await;
        let job = accepted(&f, testing::payload("job-1"));
        let task = tokio::spawn(run_job(f.rt.clone(), job, ()));
        until_waiting(&f).await;
        // The envelope (valid 300 s) expires an hour before the window opens.
        f.clock.advance_secs(301);
        task.await.expect("task").expect("journal");
        assert_eq!(journaled(&f), ["received", "claimed", "waiting", "refused"]);
        assert_eq!(f.cp.calls().last().map(String::as_str), Some("reject dl-job-1 expired"));
    }

    #[tokio::test]
    async fn a_job_cancelled_while_it_waits_is_settled_cancelled_and_never_runs() {
        let f = testing::runtime_with(&config("wait")).await;
        f.cp.heartbeats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(Ok(JobHeartbeatResponse { lease_secs: 60, cancel: true }));
        let job = accepted(&f, testing::payload("job-1"));
        run_job(f.rt.clone(), job, ()).await.expect("journal");
        assert_eq!(journaled(&f), ["received", "claimed", "waiting", "finished", "reported"]);
        let j = f.rt.journal.job("job-1").expect("job");
        let finished = j.finished.expect("finished");
        assert_eq!(finished.status, JobStatus::Cancelled);
        assert_eq!(j.started_at_ms, None);
    }

    #[tokio::test]
    async fn the_policy_context_names_the_open_window_and_the_role() {
        let f = testing::runtime_with(&config("wait")).await;
        let job = testing::verified("job-1", Some("maintenance"));
        let closed = policy_context(&f.rt, &job, &check(&f.rt, &job), &[]);
        assert_eq!(closed["window"], serde_json::Value::Null);
        assert_eq!(closed["now_unix"], NOW);
        assert_eq!(closed["role"]["type"], "maintenance");
        assert_eq!((closed["effect"].as_str(), closed["kind"].as_str()), (Some("read"), Some("runner.noop")));
        f.clock.advance_secs(3600);
        let open = policy_context(&f.rt, &job, &check(&f.rt, &job), &[serde_json::json!({"by": "alice"})]);
        assert_eq!(open["window"]["name"], "change");
        assert_eq!(open["window"]["rule"], "actions");
        assert_eq!(open["window"]["closes_at_unix"], NOW + 7200);
        assert_eq!(open["windows_open"], serde_json::json!(["change"]));
        assert_eq!(open["approvals"][0]["by"], "alice");
    }

    /// Every action needs approval; requests live 10 minutes.
    const APPROVALS: &str = "[[guardrails.approval_rule]]\nname = \"actions\"\noperations = [\"action.trigger\"]\nexpires = \"10m\"\n";

    async fn until_requested(f: &testing::Fakes) -> crate::approvals::Request {
        for _ in 0..500 {
            if let Some((r, _)) = crate::approvals::requests(&f.rt.state_dir).into_iter().next() {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no approval request: {:?}", journaled(f));
    }

    fn decision(approved: bool) -> crate::approvals::Decision {
        crate::approvals::Decision {
            approved,
            by: "alice".into(),
            uid: 0,
            reason: Some("INC-7".into()),
            at_ms: 0,
            plan_digest: None,
        }
    }

    #[tokio::test]
    async fn an_approved_job_runs_and_its_request_is_cleared() {
        let f = testing::runtime_with(APPROVALS).await;
        let task = tokio::spawn(run_job(f.rt.clone(), accepted(&f, testing::payload("job-1")), ()));
        let r = until_requested(&f).await;
        assert_eq!(
            (r.kind.as_str(), r.operation.as_str(), r.rule.as_str()),
            ("runner.noop", "action.trigger", "actions")
        );
        assert_eq!(r.expires_at_ms, (NOW as u64 + 600) * 1000);
        assert_eq!(f.rt.journal.job("job-1").map(|j| j.phase), Some(crate::journal::Phase::AwaitingApproval));
        crate::approvals::decide(&f.rt.state_dir, "job-1", decision(true), f.clock.now_ms()).expect("decide");
        task.await.expect("task").expect("journal");
        assert_eq!(journaled(&f), ["received", "claimed", "waiting", "started", "finished", "reported"]);
        assert!(f.cp.calls().contains(&"heartbeat job-1 awaiting_approval".to_string()));
        assert!(crate::approvals::requests(&f.rt.state_dir).is_empty(), "request left behind");
        let audited = f.audit.records.lock().unwrap_or_else(|e| e.into_inner()).clone();
        assert!(audited.iter().any(|r| r.event == "approval_requested"));
    }

    #[tokio::test]
    async fn a_denied_job_is_refused_and_never_runs() {
        let f = testing::runtime_with(APPROVALS).await;
        let task = tokio::spawn(run_job(f.rt.clone(), accepted(&f, testing::payload("job-1")), ()));
        until_requested(&f).await;
        crate::approvals::decide(&f.rt.state_dir, "job-1", decision(false), f.clock.now_ms())
            .expect("decide");
        task.await.expect("task").expect("journal");
        assert_eq!(journaled(&f), ["received", "claimed", "waiting", "refused"]);
        assert_eq!(f.cp.calls().last().map(String::as_str), Some("reject dl-job-1 approval_denied"));
        let detail = f.rt.journal.job("job-1").and_then(|j| j.detail).unwrap_or_default();
        assert!(detail.contains("denied by alice: INC-7"), "{detail}");
    }

    #[tokio::test]
    async fn an_unanswered_request_expires_and_the_job_is_refused() {
        let f = testing::runtime_with(APPROVALS).await;
        let mut payload = testing::payload("job-1");
        payload.expires_at = NOW + 3600;
        let task = tokio::spawn(run_job(f.rt.clone(), accepted(&f, payload), ()));
        until_requested(&f).await;
        f.clock.advance_secs(600);
        task.await.expect("task").expect("journal");
        assert_eq!(journaled(&f), ["received", "claimed", "waiting", "refused"]);
        assert_eq!(f.cp.calls().last().map(String::as_str), Some("reject dl-job-1 approval_expired"));
    }

    #[test]
    fn only_a_rule_that_cancels_gives_a_close_time() {
        let open =
            |on_close| WindowCheck::Open { rule: "r".into(), window: "w".into(), closes_at: 42, on_close };
        assert_eq!(close_of(&open(OnClose::Cancel)), Some(WindowClose { window: "w".into(), at: 42 }));
        assert_eq!(close_of(&open(OnClose::Continue)), None);
        assert_eq!(close_of(&WindowCheck::Unbound), None);
    }
}
