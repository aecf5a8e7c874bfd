//! The one policy gate every deciding executor goes through (terraform plans, helm
//! releases and uninstalls, kubernetes applies and deletions): the decision over the
//! exact input, its audit record (the subject's digest, the input's, every policy's),
//! and the same `[policy] DENY|WARN|ERROR` lines in the job's log whoever asks.

use std::collections::BTreeMap;

use crate::ExecContext;

/// The subject name of a drift check's decision (`input.byoc.drift` is then true).
pub const DRIFT_SUBJECT: &str = "drift";

/// What a decision is about.
pub struct Subject<'a> {
    pub source: byoc_policy::Source,
    pub admission: byoc_policy::Admission,
    /// Names it in the audit record (`plan`, `manifests`, `deletions`).
    pub name: &'a str,
    /// Its digest (a plan file's); `None`: the input's.
    pub digest: Option<&'a str>,
}

/// What an allowed plan is, for the customer asked to approve it before it is applied.
pub struct ApplyRequest<'a> {
    /// `terraform`.
    pub tool: &'a str,
    /// The plan file's digest: an approval binds to exactly this plan.
    pub plan_digest: &'a str,
    /// Counts and addresses per action (never values).
    pub summary: &'a serde_json::Value,
    pub decision: &'a byoc_policy::Decision,
    /// The job's cancellation: a cancel while it waits ends the wait.
    pub cancel: &'a tokio_util::sync::CancellationToken,
}

/// Why an allowed plan is not applied after all.
#[derive(Debug, Clone)]
pub struct ApprovalRefused {
    /// `approval_denied`, `approval_expired`, `cancelled`, …
    pub reason: String,
    pub message: String,
}

/// The customer's approval of an allowed plan, asked between the decision and apply
/// (the runner's `[[guardrails.approval_rule]]` with `on = "plan"`). Returns once the
/// plan may be applied (with a line for the job's log if an approval was given), or
/// why not. The time it waits does not count against the job's timeout.
pub trait ApplyApproval: Send + Sync {
    fn approve<'a>(
        &'a self,
        req: ApplyRequest<'a>,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Option<String>, ApprovalRefused>> + Send + 'a>,
    >;
}

/// Ask the customer's approval of an allowed change before it is made, if their rules
/// want it (`ApplyApproval`): `Ok(waited)` to go on (the caller keeps the wait out of
/// the job's time), `Err(outcome)` to stop with nothing applied. `digest` names exactly
/// what is approved (a plan file's, the manifests'), `summary` what it does.
pub async fn approve_apply(
    ctx: &mut ExecContext<'_>,
    tool: &str,
    digest: &str,
    summary: &serde_json::Value,
    decision: &byoc_policy::Decision,
    outputs: &serde_json::Value,
) -> Result<std::time::Duration, crate::ExecOutcome> {
    let Some(approval) = ctx.settings.apply_approval.clone() else { return Ok(std::time::Duration::ZERO) };
    let asked = std::time::Instant::now();
    let cancel = ctx.settings.cancel.clone();
    let req = ApplyRequest { tool, plan_digest: digest, summary, decision, cancel: &cancel };
    match approval.approve(req).await {
        Ok(note) => {
            if let Some(note) = note {
                log(ctx, format!("[approval] {note}\n"));
            }
            Ok(asked.elapsed())
        }
        Err(r) => {
            log(ctx, format!("[approval] not applied: {}\n", r.message));
            let mut outcome = crate::tool::failed(&r.reason, r.message, outputs.clone());
            if r.reason == "cancelled" {
                outcome.status = crate::JobStatus::Cancelled;
            }
            Err(outcome)
        }
    }
}

/// A job's decisions need its policies; without them nothing is decided (and so
/// nothing proceeds): `policy_unavailable`.
pub const UNAVAILABLE: &str = "policy_unavailable";

/// The job has no policies to decide with (the customer's policy directory, or the app config's
/// policies, have problems; the job log says which), so nothing can be decided.
#[derive(Debug, thiserror::Error)]
#[error("no policy context: {subject} are decided by policy")]
pub struct NoJobPolicies {
    pub subject: String,
}

/// Decide about `input` (JSON: a plan, or manifests), audit it and log it.
pub async fn decide(
    ctx: &mut ExecContext<'_>,
    subject: Subject<'_>,
    input: &[u8],
) -> Result<byoc_policy::Decision, NoJobPolicies> {
    let Some(policy) = ctx.settings.policy.clone() else {
        return Err(NoJobPolicies { subject: subject.name.to_string() });
    };
    let pctx = byoc_policy::Context {
        source: subject.source,
        phase: policy.phase.clone(),
        operation: policy.operation.clone(),
        install: policy.install.clone(),
        admission: subject.admission,
        context: policy.context.clone(),
        drift: subject.name == DRIFT_SUBJECT,
    };
    let started = std::time::Instant::now();
    let input = crate::secrets::mask_policy_input(ctx, input);
    let d = policy.decide(pctx, &input).await;
    log(
        ctx,
        format!(
            "[policy] decided in {} ms ({} ms evaluating)\n",
            started.elapsed().as_millis(),
            d.elapsed_ms
        ),
    );
    audit(ctx, &d, subject.name, subject.digest.unwrap_or(&d.input_digest));
    let findings = d.violations.iter().map(|f| ("DENY", f)).chain(d.warnings.iter().map(|f| ("WARN", f)));
    for (label, f) in findings.chain(d.passes.iter().map(|f| ("PASS", f))) {
        let address = if f.address.is_empty() { "-" } else { &f.address };
        log(ctx, format!("[policy] {label} {} [{}] {address}: {}\n", f.policy, f.rule, f.message));
    }
    for e in &d.errors {
        log(ctx, format!("[policy] ERROR {} [{}]: {}\n", e.policy, e.code, e.reason));
    }
    Ok(d)
}

/// ` passed [..]` for the audit detail, when any `pass` rule reported (at most 20 named).
fn passed(d: &byoc_policy::Decision) -> String {
    let all = d.passed();
    if all.is_empty() {
        return String::new();
    }
    let more = all.len().saturating_sub(20);
    let named = all.into_iter().take(20).collect::<Vec<_>>().join(", ");
    if more > 0 { format!(" passed [{named}, and {more} more]") } else { format!(" passed [{named}]") }
}

fn log(ctx: &mut ExecContext<'_>, line: String) {
    let _ = ctx.output.write(line.as_bytes());
}

/// The `policy_decision` audit record: verdict, counts and what denied; digests of the
/// subject, the input and every policy.
fn audit(ctx: &ExecContext<'_>, d: &byoc_policy::Decision, subject: &str, digest: &str) {
    let Some(audit) = &ctx.settings.audit else { return };
    let mut digests = BTreeMap::new();
    digests.insert(subject.to_string(), digest.to_string());
    digests.insert(format!("{subject}_json"), d.input_digest.clone());
    if let Some(artifact) = &ctx.settings.artifact {
        digests.insert("artifact".into(), artifact.clone());
    }
    for p in &d.policies {
        digests.insert(format!("policy:{}", p.name), p.digest.clone());
    }
    let verdict = match d.verdict {
        byoc_policy::Verdict::Allow => "allow",
        byoc_policy::Verdict::Deny => "deny",
    };
    let detail = format!(
        "{verdict}: {} violations, {} warnings, {} passed, {} errors [{}]{}",
        d.violations.len(),
        d.warnings.len(),
        d.passes.len(),
        d.errors.len(),
        d.denials().join(", "),
        passed(d)
    );
    if let Err(e) = audit.record("policy_decision", detail, digests) {
        tracing::error!(error = %e, "Could not audit a policy decision: {e}.");
    }
}
