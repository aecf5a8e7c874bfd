//! The decision over a plan the runner rendered (its digest, summary, the policies'
//! verdict) and what is checked right before and read right after apply.

use std::collections::BTreeMap;
use std::path::Path;

use super::summary::summary;
use super::{MAX_OUTPUTS_BYTES, MAX_STATE_BYTES, OUTPUTS_JSON, Terraform, module_file, sha256_file, state};
use crate::tool::{Step, failed};
use crate::{ExecContext, ExecOutcome};

/// An allowed plan: what the result reports and apply is bound to.
pub(super) struct Judged {
    pub(super) plan_digest: String,
    pub(super) plan_value: serde_json::Value,
    pub(super) summary: serde_json::Value,
    pub(super) decision: byoc_policy::Decision,
    /// The result's outputs so far (digests, summary, verdict, violations).
    pub(super) base: serde_json::Value,
}

impl Terraform {
    /// Hash the sealed plan, take the JSON the runner rendered from it, refuse a summary
    /// carrying a secret, decide (audited with both digests). A denial is the step's
    /// failure (`policy_denied`); an allowed plan is logged.
    pub(super) async fn judge(
        &self,
        ctx: &mut ExecContext<'_>,
        plan_path: &Path,
        plan_bytes: Vec<u8>,
    ) -> Step<Judged> {
        // The digest of the plan the policies are about to see: the bytes show read,
        // which apply later runs only if the sealed copy still has them.
        let plan_digest =
            sha256_file(plan_path).map_err(|e| ExecOutcome::failed(format!("hashing the plan: {e}")))?;
        let plan_value: serde_json::Value = serde_json::from_slice(&plan_bytes).map_err(|e| {
            failed(
                "plan_unreadable",
                format!("terraform show -json is not JSON: {e}"),
                serde_json::Value::Null,
            )
        })?;
        let summary = summary(&plan_value);
        // Addresses can carry values (`for_each` over a secret): such a summary is not
        // reported, shown or decided on.
        if crate::secrets::carries_secret(ctx, &summary) {
            return Err(failed(
                "secret_in_plan_summary",
                "the plan's resource addresses contain a customer secret or credential (a for_each or count key made from it?): \
                 the summary is not reported; key the resources by something else"
                    .into(),
                serde_json::Value::Null,
            ));
        }
        let subject = crate::policy_gate::Subject {
            // A sandbox's runs are decided as sandbox plans (their own policies).
            source: if ctx.settings.policy.as_ref().is_some_and(|p| p.operation.starts_with("sandbox.")) {
                byoc_policy::Source::Sandbox
            } else {
                byoc_policy::Source::Terraform
            },
            admission: Default::default(),
            name: "plan",
            digest: Some(&plan_digest),
        };
        let decision = crate::policy_gate::decide(ctx, subject, &plan_bytes)
            .await
            .map_err(|e| failed(crate::policy_gate::UNAVAILABLE, e.to_string(), serde_json::Value::Null))?;
        let base = serde_json::json!({
            "plan_digest": plan_digest,
            "input_digest": decision.input_digest,
            "summary": summary,
            "verdict": decision.verdict,
            "violations": decision.violations.iter().map(byoc_policy::Finding::reference).collect::<Vec<_>>(),
            "passed": decision.passes.iter().map(byoc_policy::Finding::reference).collect::<Vec<_>>(),
        });
        if decision.verdict == byoc_policy::Verdict::Deny {
            return Err(failed(
                "policy_denied",
                format!("policy denied the plan: {}", decision.denials().join(", ")),
                base,
            ));
        }
        let _ = ctx.output.write(
            format!("[policy] ALLOW plan {plan_digest} ({} policies)\n", decision.policies.len()).as_bytes(),
        );
        Ok(Judged { plan_digest, plan_value, summary, decision, base })
    }
}

/// Exactly the plan the policies saw, or nothing: a changed sealed copy is refused
/// (`plan_tampered`, audited).
pub(super) fn still_the_plan(
    ctx: &ExecContext<'_>,
    plan_path: &Path,
    plan_digest: &str,
    base: &serde_json::Value,
) -> Step<()> {
    match sha256_file(plan_path) {
        Ok(d) if d == plan_digest => {}
        other => {
            let now = other.unwrap_or_else(|e| format!("unreadable ({e})"));
            if let Some(a) = &ctx.settings.audit {
                let _ = a.record(
                    "plan_tampered",
                    format!(
                        "plan file changed between the policy decision and apply: {plan_digest} -> {now}"
                    ),
                    BTreeMap::from([("plan".to_string(), plan_digest.to_string())]),
                );
            }
            return Err(failed(
                "plan_tampered",
                format!(
                    "the plan file changed after the policy decision ({plan_digest} -> {now}); not applied"
                ),
                base.clone(),
            ));
        }
    }
    Ok(())
}

/// The outputs after apply, without another terraform run where they can be had
/// otherwise (a run is ~30 ms of a fast module): none declared, none to read; from
/// `output -json`'s file when it ran; with local state, from the state file, which holds
/// them in `output -json`'s own shape.
pub(super) fn read_outputs(module: &Path, declares_outputs: bool, from_output_json: bool) -> Step<Vec<u8>> {
    if from_output_json {
        return module_file(module, OUTPUTS_JSON, MAX_OUTPUTS_BYTES)
            .map_err(|e| failed(e.code(), format!("reading outputs: {e}"), serde_json::Value::Null));
    }
    if !declares_outputs {
        return Ok(b"{}".to_vec());
    }
    let state = module_file(module, state::LOCAL_STATE, MAX_STATE_BYTES).map_err(|e| {
        failed(e.code(), format!("reading outputs from the state: {e}"), serde_json::Value::Null)
    })?;
    let v: serde_json::Value = serde_json::from_slice(&state)
        .map_err(|e| ExecOutcome::failed(format!("reading outputs: the state is not JSON: {e}")))?;
    Ok(serde_json::to_vec(&v["outputs"]).unwrap_or_default())
}
