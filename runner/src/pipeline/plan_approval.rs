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
use crate::clock::rfc3339;
use crate::guardrails::ApprovalRule;
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
        let scoped = super::window::JobFacts::of(job);
        let rule = rt.config.guardrails.plan_approval_for(&scoped.attributes())?.clone();
        let super::window::JobFacts { role, operation, component, .. } = scoped;
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

    /// The approval request a person is shown: the plan, what was judged, the findings.
    fn request(&self, req: &ApplyRequest<'_>, findings: Vec<String>) -> approvals::Request {
        let now_ms = self.rt.clock.now_ms();
        approvals::Request {
            job_id: self.job_id.clone(),
            kind: self.kind.clone(),
            operation: self.operation.clone(),
            role: self.role.clone(),
            component: self.component.clone(),
            rule: self.rule.name.clone(),
            requested_at_ms: now_ms,
            expires_at_ms: now_ms + self.rule.expires_secs * 1000,
            plan_digest: Some(req.plan_digest.to_string()),
            judged_digest: Some(req.decision.input_digest.clone()),
            summary: Some(req.summary.clone()),
            findings,
            passed: req.decision.passed(),
            update_version: None,
        }
    }

    async fn wait(
        &self,
        req: &ApplyRequest<'_>,
        why: Vec<String>,
    ) -> Result<Option<String>, ApprovalRefused> {
        let refused = |reason: &str, message: String| ApprovalRefused { reason: reason.into(), message };
        let request = self.request(req, why);
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
        tracing::info!(plan = %req.plan_digest, rule = %self.rule.name, "The plan awaits the customer's approval.");
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Clock as _;
    use crate::testing::{self, NOW};
    use byoc_policy::{Decision, Verdict};

    const PLAN_RULE: &str = "[[guardrails.approval_rule]]\nname = \"plans\"\noperations = [\"action.trigger\"]\n\
                             on = \"plan\"\nexpires = \"10m\"\n";

    fn allowed() -> Decision {
        Decision {
            verdict: Verdict::Allow,
            input_digest: "sha256:input".into(),
            policies: Vec::new(),
            violations: Vec::new(),
            warnings: Vec::new(),
            // A check that passed: shown to the approver beside the plan.
            passes: vec![byoc_policy::Finding {
                policy: "vendor/tags.rego".into(),
                origin: byoc_policy::Origin::Vendor,
                enforcement: byoc_policy::Enforcement::Mandatory,
                rule: "tags".into(),
                address: "aws_s3_bucket.a".into(),
                message: "aws_s3_bucket.a is tagged".into(),
                convention: Some(byoc_policy::Convention::Nuon),
                from_rule: "pass".into(),
                details: None,
            }],
            errors: Vec::new(),
            elapsed_ms: 0,
        }
    }

    fn approver(f: &testing::Fakes, job_id: &str) -> (Arc<dyn ApplyApproval>, Holding) {
        let holding = Holding::default();
        let in_hand = super::super::JobsInHand::default();
        let super::super::Accepted::Job(job, _) =
            super::super::accept(&f.rt, f.delivery(&testing::payload(job_id)), &in_hand)
        else {
            panic!("not accepted")
        };
        (PlanApprover::for_job(&f.rt, &job, holding.clone()).expect("the rule names the job"), holding)
    }

    /// Ask for `digest`'s approval; answer with `answer` (approved, the digest shown)
    /// once the request is on disk; the approver's verdict.
    async fn ask(
        f: &testing::Fakes,
        job_id: &str,
        digest: &str,
        answer: Option<(bool, &str)>,
    ) -> Result<Option<String>, ApprovalRefused> {
        let (approver, holding) = approver(f, job_id);
        let (summary, decision, cancel) = (
            serde_json::json!({"counts": {"create": 1}}),
            allowed(),
            tokio_util::sync::CancellationToken::new(),
        );
        let req = ApplyRequest {
            tool: "terraform",
            plan_digest: digest,
            summary: &summary,
            decision: &decision,
            cancel: &cancel,
        };
        let asking = approver.approve(req);
        tokio::pin!(asking);
        loop {
            tokio::select! {
                verdict = &mut asking => return verdict,
                _ = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
            let Some((r, None)) = approvals::requests(&f.rt.state_dir).into_iter().next() else { continue };
            assert_eq!(r.plan_digest.as_deref(), Some(digest));
            assert_eq!(r.passed, ["tags@aws_s3_bucket.a"]);
            assert_eq!(holding.lock().unwrap().as_ref().map(|w| w.state.as_str()), Some("awaiting_approval"));
            match answer {
                Some((approved, shown)) => {
                    let d = approvals::Decision {
                        approved,
                        by: "alice".into(),
                        uid: 0,
                        reason: Some("CHG-9".into()),
                        at_ms: 0,
                        plan_digest: Some(shown.into()),
                    };
                    approvals::decide(&f.rt.state_dir, job_id, d, f.clock.now_ms()).expect("decide");
                }
                None => f.clock.advance_secs(600),
            }
        }
    }

    #[tokio::test]
    async fn an_approval_covers_exactly_the_plan_it_was_shown() {
        let f = testing::runtime_with(PLAN_RULE).await;
        let ok = ask(&f, "job-1", "sha256:aaa", Some((true, "sha256:aaa"))).await.expect("approved");
        assert!(ok.is_some_and(|m| m.contains("plan sha256:aaa approved by alice: CHG-9")));
        assert!(approvals::requests(&f.rt.state_dir).is_empty(), "request left behind");

        let other =
            ask(&f, "job-2", "sha256:bbb", Some((true, "sha256:aaa"))).await.expect_err("another plan");
        assert_eq!(other.reason, "approval_plan_mismatch", "{other:?}");
    }

    #[tokio::test]
    async fn a_denied_or_unanswered_plan_is_not_applied() {
        let f = testing::runtime_with(PLAN_RULE).await;
        let denied = ask(&f, "job-1", "sha256:aaa", Some((false, "sha256:aaa"))).await.expect_err("denied");
        assert_eq!(denied.reason, "approval_denied");
        assert!(denied.message.contains("denied by alice: CHG-9"), "{denied:?}");
        let expired = ask(&f, "job-2", "sha256:aaa", None).await.expect_err("expired");
        assert_eq!(expired.reason, "approval_expired", "{expired:?}");
        assert!(expired.message.contains(&rfc3339(NOW + 600)), "{expired:?}");
    }

    #[tokio::test]
    async fn a_rule_that_asks_only_on_warnings_lets_a_clean_plan_through_without_a_request() {
        let f = testing::runtime_with(&format!("{PLAN_RULE}when = \"warn\"\n")).await;
        let (approver, _) = approver(&f, "job-1");
        let (summary, decision, cancel) =
            (serde_json::json!({}), allowed(), tokio_util::sync::CancellationToken::new());
        let req = ApplyRequest {
            tool: "terraform",
            plan_digest: "sha256:aaa",
            summary: &summary,
            decision: &decision,
            cancel: &cancel,
        };
        assert_eq!(approver.approve(req).await.expect("no approval needed"), None);
        assert!(approvals::requests(&f.rt.state_dir).is_empty());
    }
}
