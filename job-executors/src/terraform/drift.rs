//! Drift checks (`operation = "drift"`, docs/DRIFT.md): `plan -refresh-only` and a
//! normal plan against the component's durable state, in one sandbox, nothing applied;
//! the policies over what drifted; the changed attribute paths, never values.

use super::*;

const DRIFT_PLAN: &str = "drift.tfplan";
/// What a drift check takes of a plan's JSON, at most: the policies' input limit (the
/// decision would refuse more anyway), 64 MiB without the job's policies.
fn policy_input_cap(run: &Run<'_, '_>) -> u64 {
    run.ctx.settings.policy.as_ref().map(|p| p.limits.max_input_bytes as u64).unwrap_or(64 << 20)
}

/// Changed attribute paths reported per drifted resource, at most.
const MAX_DRIFT_PATHS: usize = 50;

/// Attribute paths whose values differ between `before` and `after` (`ingress[0].cidr_blocks`),
/// never the values. Objects and arrays are walked; anything else compares whole.
fn changed_paths(before: &serde_json::Value, after: &serde_json::Value, at: &str, out: &mut Vec<String>) {
    use serde_json::Value;
    if out.len() >= MAX_DRIFT_PATHS || before == after {
        return;
    }
    match (before, after) {
        (Value::Object(b), Value::Object(a)) => {
            let keys: std::collections::BTreeSet<&String> = b.keys().chain(a.keys()).collect();
            for k in keys {
                let path = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
                changed_paths(b.get(k).unwrap_or(&Value::Null), a.get(k).unwrap_or(&Value::Null), &path, out);
            }
        }
        (Value::Array(b), Value::Array(a)) if b.len() == a.len() => {
            for (i, (x, y)) in b.iter().zip(a).enumerate() {
                changed_paths(x, y, &format!("{at}[{i}]"), out);
            }
        }
        _ => out.push(if at.is_empty() { "(whole object)".into() } else { at.to_string() }),
    }
}

/// What drifted outside terraform: address, actions and the changed attribute paths.
fn drifted(refresh: &serde_json::Value) -> Vec<serde_json::Value> {
    refresh["resource_drift"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|rc| {
            let mut paths = Vec::new();
            changed_paths(&rc["change"]["before"], &rc["change"]["after"], "", &mut paths);
            serde_json::json!({
                "address": rc["address"],
                "actions": rc["change"]["actions"],
                "paths": paths,
            })
        })
        .collect()
}

impl Terraform {
    /// A drift check: both plans in one sandbox (nothing is applied, so no digest has
    /// to hold between steps), the policies over what drifted, a verdict.
    pub(super) async fn drift(
        &self,
        run: &mut Run<'_, '_>,
        module: &Path,
        tree: &RunnerTree,
        init: Vec<String>,
    ) -> Step<ExecOutcome> {
        let plans = [
            ("plan -refresh-only", format!("plan -refresh-only -input=false -no-color -out={DRIFT_PLAN}")),
            ("plan", format!("plan -input=false -no-color -out={PLAN_FILE}")),
        ];
        run.log("[terraform] drift check: refresh-only and contract plans; nothing is applied\n");
        let plans = after_init(run.tf_script(&plans, &[]));
        run.staged("init, plan -refresh-only, plan", init, vec![plans], None).await?;
        providers_verified(tree, &mut *run.ctx.output)?;
        let mut rendered = render_plans(run, module, tree).await?;
        let (contract, plan_digest) = rendered.pop().unwrap_or_default();
        let (refresh, refresh_digest) = rendered.pop().unwrap_or_default();
        // No state yet: the component was never deployed here; nothing can have drifted.
        let root = &refresh["prior_state"]["values"]["root_module"];
        let has = |k: &str| root[k].as_array().is_some_and(|a| !a.is_empty());
        if !has("resources") && !has("child_modules") {
            run.log(&format!(
                "[drift] workspace {} has no state: the component was never deployed here\n",
                self.spec.workspace
            ));
            return Ok(self.not_deployed(run, &contract, refresh_digest, plan_digest));
        }
        let drifted = drifted(&refresh);
        let would_change = summary(&contract);
        let doc_bytes = drift_as_changes(&refresh);
        let subject = crate::policy_gate::Subject {
            source: byoc_policy::Source::Terraform,
            admission: Default::default(),
            name: crate::policy_gate::DRIFT_SUBJECT,
            digest: Some(&refresh_digest),
        };
        let decision = crate::policy_gate::decide(run.ctx, subject, &doc_bytes)
            .await
            .map_err(|e| failed(crate::policy_gate::UNAVAILABLE, e.to_string(), serde_json::Value::Null))?;
        let changes = would_change["counts"].as_object().is_some_and(|c| !c.is_empty());
        let verdict = if decision.verdict == byoc_policy::Verdict::Deny {
            "violating"
        } else if !drifted.is_empty() || changes {
            "drifted"
        } else {
            "clean"
        };
        run.log(&format!(
            "[drift] {verdict}: {} resource(s) changed outside terraform, a deploy would change {}\n",
            drifted.len(),
            if changes { would_change["counts"].to_string() } else { "nothing".into() }
        ));
        if let Some(a) = &run.ctx.settings.audit {
            let _ = a.record(
                "drift_checked",
                format!(
                    "workspace {}: {verdict}; {} drifted, policy {:?}",
                    self.spec.workspace,
                    drifted.len(),
                    decision.verdict
                ),
                BTreeMap::from([
                    ("refresh_plan".to_string(), refresh_digest.clone()),
                    ("plan".to_string(), plan_digest.clone()),
                    ("input".to_string(), decision.input_digest.clone()),
                ]),
            );
        }
        Ok(ExecOutcome {
            status: JobStatus::Succeeded,
            exit_code: Some(0),
            error: None,
            outputs: serde_json::json!({
                "drift": {
                    "workspace": self.spec.workspace,
                    "verdict": verdict,
                    "drifted": drifted,
                    "would_change": would_change,
                    "refresh_plan_digest": refresh_digest,
                    "plan_digest": plan_digest,
                },
                "verdict": decision.verdict,
                "input_digest": decision.input_digest,
                "violations": decision.violations.iter().map(byoc_policy::Finding::reference).collect::<Vec<_>>(),
            }),
        })
    }

    /// No state yet: the component was never deployed here, and nothing can have drifted.
    fn not_deployed(
        &self,
        run: &mut Run<'_, '_>,
        contract: &serde_json::Value,
        refresh_digest: String,
        plan_digest: String,
    ) -> ExecOutcome {
        if let Some(a) = &run.ctx.settings.audit {
            let _ = a.record(
                "drift_checked",
                format!("workspace {}: not_deployed (no state)", self.spec.workspace),
                BTreeMap::from([("refresh_plan".to_string(), refresh_digest.clone())]),
            );
        }
        ExecOutcome {
            status: JobStatus::Succeeded,
            exit_code: Some(0),
            error: None,
            outputs: serde_json::json!({"drift": {
                "workspace": self.spec.workspace,
                "verdict": "not_deployed",
                "drifted": [],
                "would_change": summary(contract),
                "refresh_plan_digest": refresh_digest,
                "plan_digest": plan_digest,
            }, "violations": []}),
        }
    }
}

/// Both plans sealed as they are and rendered by the runner (offline, no
/// credentials), with their digests: the refresh-only plan, then the contract plan.
async fn render_plans(
    run: &mut Run<'_, '_>,
    module: &Path,
    tree: &RunnerTree,
) -> Step<Vec<(serde_json::Value, String)>> {
    // The sandbox has ended, and every process of the job with it: both plans are
    // sealed as they are and rendered by the runner (offline, no credentials).
    let sealed = SealedDir::create(run.ctx)
        .map_err(|e| ExecOutcome::failed(format!("creating the sealed plan directory: {e}")))?;
    let cap = policy_input_cap(run);
    let mut rendered = Vec::new();
    seal(module, LOCK_FILE, &sealed)?;
    for plan in [DRIFT_PLAN, PLAN_FILE] {
        seal(module, plan, &sealed)?;
        let digest = sha256_file(&sealed.path.join(plan))
            .map_err(|e| ExecOutcome::failed(format!("hashing the plan {plan}: {e}")))?;
        let bytes = render_in(run, &sealed, tree, plan, cap).await?;
        let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
            failed(
                "plan_unreadable",
                format!("terraform show -json is not JSON: {e}"),
                serde_json::Value::Null,
            )
        })?;
        rendered.push((value, digest));
    }
    Ok(rendered)
}

/// The policies see what drifted as changes: a console edit that opened a security
/// group to the internet is a violation though nobody deployed it.
fn drift_as_changes(refresh: &serde_json::Value) -> Vec<u8> {
    let mut doc = refresh.clone();
    if let Some(o) = doc.as_object_mut() {
        let drift = match &refresh["resource_drift"] {
            serde_json::Value::Array(a) => serde_json::Value::Array(a.clone()),
            // terraform leaves the key out when nothing drifted.
            _ => serde_json::Value::Array(Vec::new()),
        };
        o.insert("resource_changes".into(), drift);
    }
    serde_json::to_vec(&doc).unwrap_or_default()
}
