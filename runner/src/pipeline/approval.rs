//! The gate's local approvals: a job under an approval rule (`[[guardrails.approval]]`)
//! waits until a local admin approves it (`byoc-runner approve`); denied → refused
//! `approval_denied`, unanswered past the rule's expiry → refused `approval_expired`.

use byoc_protocol::{JobWaiting, RejectReason};

use super::claim::ClaimedJob;
use super::gate::{JobSlot, Look, Waited, hold, rejection_of};
use super::window::JobFacts;
use super::{VerifiedJob, refuse};
use crate::clock::rfc3339;
use crate::journal::RecordError;
use crate::runtime::Rt;

/// The approval rule that holds `job` before it runs, if any.
/// Under `[update] mode = "approve"`, an update no rule of the customer's names waits
/// for a person all the same.
pub fn approval_rule(rt: &Rt, job: &VerifiedJob) -> Option<crate::guardrails::ApprovalRule> {
    let rule = rt.config.guardrails.approval_for(&JobFacts::of(job).attributes()).cloned();
    let update = job.executor.runner_update().is_some();
    rule.or_else(|| {
        (update && rt.config.update.mode == crate::config::UpdateMode::Approve)
            .then(crate::update::approval_rule)
    })
}

/// Hold a claimed job until a local admin approves it (`byoc-runner approve`), under
/// `rule`. Denied → refused `approval_denied`; unanswered past the rule's expiry →
/// refused `approval_expired`.
pub(super) async fn await_approval(
    rt: &Rt,
    job: ClaimedJob,
    slot: &mut impl JobSlot,
    rule: &crate::guardrails::ApprovalRule,
) -> Result<Waited, RecordError> {
    use crate::approvals;
    let JobFacts { role, operation, component, .. } = JobFacts::of(&job.verified);
    let now_ms = rt.clock.now_ms();
    let kept = approvals::read_request(&rt.state_dir, &job.verified.payload.job_id);
    let resumed = kept.is_some();
    let request = kept.unwrap_or_else(|| approvals::Request {
        job_id: job.verified.payload.job_id.clone(),
        kind: job.verified.payload.kind.clone(),
        operation,
        role,
        component,
        rule: rule.name.clone(),
        requested_at_ms: now_ms,
        expires_at_ms: now_ms + rule.expires_secs * 1000,
        plan_digest: None,
        judged_digest: None,
        summary: None,
        findings: Vec::new(),
        passed: Vec::new(),
        update_version: job.verified.executor.runner_update().map(|u| u.version.clone()),
    });
    // A resumed job's request stands as it was (with any answer given meanwhile).
    if let Err(e) = if resumed { Ok(()) } else { approvals::write_request(&rt.state_dir, &request) } {
        // Nobody could approve a request that was never written: refuse, say why.
        let detail = format!("the approval request could not be written, so nobody could approve it: {e}");
        let rejection = rejection_of(&job.verified, RejectReason::ApprovalDenied, detail);
        refuse::refuse_received(rt, &job.verified, rejection).await?;
        return Ok(Waited::Settled);
    }
    let job_id = request.job_id.clone();
    let mut given: Option<approvals::Decision> = None;
    let waited = hold(rt, job, slot, |rt, _| match approvals::decision(&rt.state_dir, &job_id) {
        Some(d) if d.approved => {
            given = Some(d);
            Look::Ready
        }
        Some(d) => Look::Refuse(
            RejectReason::ApprovalDenied,
            format!("denied by {}{}", d.by, d.reason.map(|r| format!(": {r}")).unwrap_or_default()),
        ),
        None if rt.clock.now_ms() >= request.expires_at_ms => Look::Refuse(
            RejectReason::ApprovalExpired,
            format!(
                "nobody approved it before its request expired at {} (rule {:?})",
                rfc3339((request.expires_at_ms / 1000) as i64),
                request.rule
            ),
        ),
        None => Look::Wait(JobWaiting {
            state: "awaiting_approval".into(),
            until: Some((request.expires_at_ms / 1000) as i64),
            detail: format!(
                "rule {:?}: approve with `byoc-runner approve {job_id}{}` or refuse with `byoc-runner deny {job_id} --reason …`",
                request.rule,
                request.update_version.as_deref().map(|v| format!(" --version {v}")).unwrap_or_default()
            ),
        }),
    })
    .await;
    // A runner stopping mid-wait keeps the request (and any answer) for the next start.
    if !rt.abort.is_cancelled() {
        approvals::clear(&rt.state_dir, &job_id);
    }
    match (waited, given) {
        (Ok(Waited::Run(mut job)), Some(d)) => {
            job.approvals.push(serde_json::json!({
                "rule": request.rule, "by": d.by, "reason": d.reason, "at_ms": d.at_ms,
            }));
            Ok(Waited::Run(job))
        }
        (waited, _) => waited,
    }
}
