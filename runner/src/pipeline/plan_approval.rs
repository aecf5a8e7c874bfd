//! Approvals of a plan (`[[guardrails.approval_rule]]` with `on = "plan"`,
//! docs/GUARDRAILS.md): asked by the terraform executor between an ALLOW decision and
//! apply (`byoc_job_executors::policy_gate::ApplyApproval`). The request names the plan's
//! digest and shows its summary and the findings that made the rule ask; the answer
//! binds to that digest, so a different plan (a new job, a changed module) needs its
//! own approval. While it waits the job's heartbeats say `awaiting_approval`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use byoc_job_executors::policy_gate::{ApplyApproval, ApplyRequest, ApprovalRefused};
use byoc_protocol::JobWaiting;

use crate::approvals;
use crate::guardrails::{ApprovalRule, rfc3339};
use crate::journal::Event;
use crate::runtime::Rt;

use super::VerifiedJob;

/// What a running job's heartbeats report as holding it (shared with the heartbeat
/// companion).
pub type Holding = Arc<Mutex<Option<JobWaiting>>>;

pub struct PlanApprover {
    rt: Rt,
    rule: ApprovalRule,
    job_id: String,
    kind: String,
    operation: String,
    role: Option<String>,
    component: Option<String>,
    holding: Holding,
}

impl PlanApprover {
    /// The approver for `job`, if an `on = "plan"` rule names it.
    pub fn for_job(rt: &Rt, job: &VerifiedJob, holding: Holding) -> Option<Arc<dyn ApplyApproval>> {
        let scoped = super::window::Scoped::of(job);
        let rule = rt.config.guardrails.plan_approval_for(&scoped.scope())?.clone();
        let super::window::Scoped { role, operation, component, .. } = scoped;
        Some(Arc::new(PlanApprover {
            rt: rt.clone(),
            rule,
            job_id: job.payload.job_id.clone(),
            kind: job.payload.kind.clone(),
            operation,
            role,
            component,
            holding,
        }))
    }

    fn set_holding(&self, w: Option<JobWaiting>) {
        *self.holding.lock().unwrap_or_else(|e| e.into_inner()) = w;
    }

    async fn wait(
        &self,
        req: &ApplyRequest<'_>,
        why: Vec<String>,
    ) -> Result<Option<String>, ApprovalRefused> {
        let refused = |reason: &str, message: String| ApprovalRefused { reason: reason.into(), message };
        let now_ms = self.rt.clock.now_ms();
        let request = approvals::Request {
            job_id: self.job_id.clone(),
            kind: self.kind.clone(),
            operation: self.operation.clone(),
            role: self.role.clone(),
            component: self.component.clone(),
            rule: self.rule.name.clone(),
            requested_at_ms: now_ms,
            expires_at_ms: now_ms + self.rule.expires_secs * 1000,
            plan_digest: Some(req.plan_digest.to_string()),
            summary: Some(req.summary.clone()),
            findings: why,
        };
        approvals::write_request(&self.rt.state_dir, &request).map_err(|e| {
            refused(
                "approval_denied",
                format!("the approval request could not be written, so nobody could approve it: {e}"),
            )
        })?;
        let waiting = JobWaiting {
            state: "awaiting_approval".into(),
            until: Some((request.expires_at_ms / 1000) as i64),
            detail: format!(
                "rule {:?}: plan {} awaits approval: `byoc-runner approve {}` or `byoc-runner deny {} --reason …`",
                self.rule.name, req.plan_digest, self.job_id, self.job_id
            ),
        };
        self.rt
            .transition(Event::Waiting {
                job_id: self.job_id.clone(),
                state: waiting.state.clone(),
                until: waiting.until,
                detail: waiting.detail.clone(),
            })
            .map_err(|e| {
                refused("approval_denied", format!("the approval request could not be journaled: {e}"))
            })?;
        tracing::info!(plan = %req.plan_digest, rule = %self.rule.name, "the plan awaits the customer's approval");
        self.set_holding(Some(waiting));
        loop {
            // The CLI's record of the answer reaches the audit log before its effect.
            let _ = self.rt.check_customer_controls();
            match approvals::decision(&self.rt.state_dir, &self.job_id) {
                Some(d) if d.approved && d.plan_digest.as_deref() == Some(req.plan_digest) => {
                    return Ok(Some(format!(
                        "plan {} approved by {}{}",
                        req.plan_digest,
                        d.by,
                        d.reason.map(|r| format!(": {r}")).unwrap_or_default()
                    )));
                }
                Some(d) if d.approved => {
                    return Err(refused(
                        "approval_plan_mismatch",
                        format!(
                            "the approval given by {} is for plan {}, not this plan {}: not applied",
                            d.by,
                            d.plan_digest.as_deref().unwrap_or("(none)"),
                            req.plan_digest
                        ),
                    ));
                }
                Some(d) => {
                    return Err(refused(
                        "approval_denied",
                        format!(
                            "plan {} denied by {}{}",
                            req.plan_digest,
                            d.by,
                            d.reason.map(|r| format!(": {r}")).unwrap_or_default()
                        ),
                    ));
                }
                None if self.rt.clock.now_ms() >= request.expires_at_ms => {
                    return Err(refused(
                        "approval_expired",
                        format!(
                            "nobody approved plan {} before its request expired at {} (rule {:?})",
                            req.plan_digest,
                            rfc3339((request.expires_at_ms / 1000) as i64),
                            self.rule.name
                        ),
                    ));
                }
                None => {}
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = req.cancel.cancelled() => {
                    return Err(refused("cancelled", format!("cancelled while plan {} awaited approval", req.plan_digest)));
                }
            }
        }
    }
}

impl ApplyApproval for PlanApprover {
    fn approve<'a>(
        &'a self,
        req: ApplyRequest<'a>,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Option<String>, ApprovalRefused>> + Send + 'a>,
    > {
        Box::pin(async move {
            let Some(why) = self.rule.asks_for(req.decision) else { return Ok(None) };
            let answer = self.wait(&req, why).await;
            approvals::clear(&self.rt.state_dir, &self.job_id);
            self.set_holding(None);
            answer
        })
    }
}
