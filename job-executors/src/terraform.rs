//! `terraform`: plan, decide, apply. The `terraform` CLI runs in the sandbox with the
//! job's role credentials: `init`, `plan -out`, `show -json` (into a file, never the
//! job log), the policy decision (audited), then `apply` of exactly that plan file,
//! checked against its digest right before; `output -json` into the result with
//! sensitive values masked. A plan-only job keeps its plan for a later job that names
//! its digest. Destroy is `plan -destroy` through the same gate. The control plane gets
//! a summary (counts per action, addresses) and digests, not the plan.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize;
use sha2::Digest as _;
use tokio::process::Command;

use crate::{ExecContext, ExecFuture, ExecOutcome, Executor, JobStatus};

pub(crate) const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
const MODULE_DIR: &str = "module";
const PLAN_FILE: &str = "plan.tfplan";
const PLAN_JSON: &str = "plan.json";
const OUTPUTS_JSON: &str = "outputs.json";
const MAX_FILES: usize = 512;
const MAX_FILES_BYTES: usize = 8 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Mode {
    /// Plan, decide, keep the plan for a later apply; nothing changes.
    Plan,
    /// Plan (or take a saved plan by digest), decide, apply.
    Apply,
    /// `plan -destroy`, decide, apply.
    Destroy,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    mode: Mode,
    /// The root module: relative path → content.
    files: BTreeMap<String, String>,
    /// Names the saved plans (`[a-z0-9_-]`, e.g. the component).
    workspace: String,
    #[serde(default)]
    vars: BTreeMap<String, String>,
    /// Passed as TF_VAR_*, masked wherever output goes.
    #[serde(default)]
    secret_vars: BTreeMap<String, String>,
    /// `-backend-config` pairs (on real installs the customer's S3 bucket).
    #[serde(default)]
    backend_config: BTreeMap<String, String>,
    /// Apply this saved plan (from a plan-only job) instead of planning again.
    #[serde(default)]
    plan_digest: Option<String>,
}

pub struct Terraform {
    spec: Spec,
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn valid_var(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && !s.starts_with(|c: char| c.is_ascii_digit())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A relative path that stays inside the module directory.
pub(crate) fn safe_relative(p: &str) -> bool {
    let path = Path::new(p);
    !p.is_empty()
        && p.len() <= 512
        && !p.contains('\0')
        && path.components().all(|c| matches!(c, Component::Normal(_)))
}

impl Terraform {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, String> {
        let s: Spec = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
        if s.files.is_empty() || s.files.len() > MAX_FILES {
            return Err(format!("files: 1 to {MAX_FILES} files"));
        }
        if s.files.values().map(String::len).sum::<usize>() > MAX_FILES_BYTES {
            return Err(format!("files: more than {MAX_FILES_BYTES} bytes in all"));
        }
        if let Some(bad) = s.files.keys().find(|p| !safe_relative(p)) {
            return Err(format!("files: {bad:?} is not a relative path inside the module"));
        }
        if !valid_name(&s.workspace) {
            return Err(format!("workspace {:?}: 1-64 of [a-z0-9_-]", s.workspace));
        }
        if let Some(bad) = s.vars.keys().chain(s.secret_vars.keys()).find(|v| !valid_var(v)) {
            return Err(format!("variable name {bad:?} is not valid"));
        }
        if let Some(dup) = s.vars.keys().find(|k| s.secret_vars.contains_key(*k)) {
            return Err(format!("{dup} is in both vars and secret_vars"));
        }
        if let Some((k, _)) = s.secret_vars.iter().find(|(_, v)| v.len() < crate::mask::MIN_SECRET_LEN) {
            return Err(format!(
                "secret_vars {k}: values shorter than {} bytes cannot be masked reliably",
                crate::mask::MIN_SECRET_LEN
            ));
        }
        match (&s.plan_digest, s.mode) {
            (Some(d), Mode::Apply) => {
                let hex = d.strip_prefix("sha256:").unwrap_or("");
                if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(format!("plan_digest {d:?} is not sha256:<64 hex>"));
                }
            }
            (Some(_), _) => return Err("plan_digest is only for mode = apply".into()),
            (None, _) => {}
        }
        Ok(Terraform { spec: s })
    }
}

fn sha256_file(p: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(p)?;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(format!("sha256:{}", hex::encode(h.finalize())))
}

/// As root the sandboxed tool runs as the unprivileged `host_uid`: it must own what it
/// writes to (the module directory, the plan file).
pub(crate) fn hand_over(ctx: &ExecContext<'_>, path: &Path) -> std::io::Result<()> {
    let Some(s) = &ctx.sandbox else { return Ok(()) };
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    std::os::unix::fs::chown(path, Some(s.host_uid), Some(s.host_gid))?;
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            hand_over(ctx, &entry?.path())?;
        }
    }
    Ok(())
}

/// A step failed: the outcome to return (and what it says, already in the log).
type Step<T> = Result<T, ExecOutcome>;

pub(crate) struct Run<'c, 'a> {
    /// The tool's name in log lines and errors.
    pub(crate) tool: &'static str,
    pub(crate) ctx: &'c mut ExecContext<'a>,
    pub(crate) started: Instant,
    pub(crate) env: Vec<(String, String)>,
}

impl Run<'_, '_> {
    fn log(&mut self, line: &str) {
        let _ = self.ctx.output.write(line.as_bytes());
    }

    fn remaining(&self) -> Duration {
        self.ctx.timeout.saturating_sub(self.started.elapsed())
    }

    /// Run one command (sandboxed when the sandbox is on) with the job's output.
    pub(crate) async fn cmd(&mut self, what: &str, argv: Vec<String>) -> Step<()> {
        self.log(&format!("[{}] {what}\n", self.tool));
        if self.remaining().is_zero() {
            return Err(ExecOutcome {
                status: JobStatus::TimedOut,
                exit_code: None,
                error: Some(format!("job exceeded its timeout of {}s", self.ctx.timeout.as_secs())),
                outputs: serde_json::Value::Null,
            });
        }
        let sub = ExecContext {
            job_id: self.ctx.job_id.clone(),
            work_dir: self.ctx.work_dir.clone(),
            timeout: self.remaining(),
            kill_grace: self.ctx.kill_grace,
            cancel: self.ctx.cancel.clone(),
            output: &mut *self.ctx.output,
            sandbox: self.ctx.sandbox.clone(),
            containers: None,
            credentials: self.ctx.credentials.clone(),
            oci: self.ctx.oci.clone(),
            audit: self.ctx.audit.clone(),
            tools: self.ctx.tools.clone(),
            policy: None,
        };
        let outcome = match sub.sandbox.clone() {
            Some(settings) => {
                let job = crate::sandboxed::Job { argv, env: self.env.clone(), network: true };
                crate::sandboxed::run(job, settings, sub).await
            }
            None => {
                let mut cmd = Command::new(&argv[0]);
                cmd.args(&argv[1..]).current_dir(&sub.work_dir).env_clear().envs(self.env.clone());
                crate::process::run_process_group(cmd, sub, None).await
            }
        };
        if outcome.status == JobStatus::Succeeded {
            Ok(())
        } else {
            let error =
                format!("{} {what}: {}", self.tool, outcome.error.clone().unwrap_or_else(|| "failed".into()));
            Err(ExecOutcome { error: Some(error), ..outcome })
        }
    }

    fn tf(&self, args: &[&str]) -> Vec<String> {
        let mut v = vec![self.ctx.tools.terraform.display().to_string(), format!("-chdir={MODULE_DIR}")];
        v.extend(args.iter().map(|s| s.to_string()));
        v
    }

    /// `terraform <args> > module/<file>`: captured into a file, not the job log.
    fn tf_to_file(&self, args: &str, file: &str) -> Vec<String> {
        vec![
            "/bin/sh".into(),
            "-c".into(),
            format!("exec \"$0\" -chdir={MODULE_DIR} {args} > {MODULE_DIR}/{file}"),
            self.ctx.tools.terraform.display().to_string(),
        ]
    }
}

pub(crate) fn failed(reason: &str, error: String, mut outputs: serde_json::Value) -> ExecOutcome {
    if let Some(o) = outputs.as_object_mut() {
        o.insert("reason".into(), reason.into());
    } else {
        outputs = serde_json::json!({ "reason": reason });
    }
    ExecOutcome { status: JobStatus::Failed, exit_code: None, error: Some(error), outputs }
}

/// Counts per action and the addresses: what the control plane may see of a plan.
fn summary(plan: &serde_json::Value) -> serde_json::Value {
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    let mut addresses: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for rc in plan["resource_changes"].as_array().map(Vec::as_slice).unwrap_or_default() {
        let actions: Vec<&str> = rc["change"]["actions"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
            .unwrap_or_default();
        let action = match actions.as_slice() {
            ["no-op"] => continue,
            ["create"] => "create",
            ["update"] => "update",
            ["delete"] => "delete",
            ["read"] => "read",
            [_, _] => "replace",
            _ => "other",
        };
        *counts.entry(action).or_default() += 1;
        addresses.entry(action).or_default().push(rc["address"].as_str().unwrap_or("").to_string());
    }
    serde_json::json!({ "counts": counts, "addresses": addresses })
}

/// `output -json` with sensitive values replaced.
fn masked_outputs(raw: &[u8]) -> Result<serde_json::Value, String> {
    let v: serde_json::Value =
        serde_json::from_slice(raw).map_err(|e| format!("terraform output -json: {e}"))?;
    let mut out = serde_json::Map::new();
    for (k, o) in v.as_object().into_iter().flatten() {
        let value = if o["sensitive"].as_bool().unwrap_or(false) { "***".into() } else { o["value"].clone() };
        out.insert(k.clone(), value);
    }
    Ok(serde_json::Value::Object(out))
}

impl Terraform {
    fn saved_plan(&self, plans_dir: &Path, digest: &str) -> PathBuf {
        plans_dir.join(&self.spec.workspace).join(format!("{}.tfplan", digest.trim_start_matches("sha256:")))
    }

    async fn go(&self, ctx: &mut ExecContext<'_>) -> ExecOutcome {
        let Some(policy) = ctx.policy.clone() else {
            return failed(
                "policy_unavailable",
                "no policy context: terraform jobs are decided by policy".into(),
                serde_json::Value::Null,
            );
        };
        let module = ctx.work_dir.join(MODULE_DIR);
        for (rel, content) in &self.spec.files {
            let path = module.join(rel);
            if let Some(parent) = path.parent()
                && let Err(e) = std::fs::create_dir_all(parent)
            {
                return ExecOutcome::failed(format!("writing module file {rel}: {e}"));
            }
            if let Err(e) = std::fs::write(&path, content) {
                return ExecOutcome::failed(format!("writing module file {rel}: {e}"));
            }
        }
        let dir = match &ctx.sandbox {
            Some(_) => crate::sandboxed::work_dir_inside(),
            None => ctx.work_dir.clone(),
        };
        if let Err(e) = hand_over(ctx, &module) {
            return ExecOutcome::failed(format!("handing the module to the job's uid: {e}"));
        }
        let mut env: Vec<(String, String)> = vec![
            ("PATH".into(), DEFAULT_PATH.into()),
            ("HOME".into(), dir.display().to_string()),
            ("BYOC_JOB_ID".into(), ctx.job_id.clone()),
            ("TF_IN_AUTOMATION".into(), "1".into()),
            ("TF_INPUT".into(), "0".into()),
            ("CHECKPOINT_DISABLE".into(), "1".into()),
        ];
        if let Some(f) = &ctx.tools.cli_config_file {
            env.push(("TF_CLI_CONFIG_FILE".into(), f.display().to_string()));
        }
        if let Some(d) = &ctx.tools.plugin_cache_dir {
            env.push(("TF_PLUGIN_CACHE_DIR".into(), d.display().to_string()));
        }
        for (k, v) in self.spec.vars.iter().chain(&self.spec.secret_vars) {
            env.push((format!("TF_VAR_{k}"), v.clone()));
        }
        crate::add_role_env(ctx, &mut env, true);
        let mut run = Run { tool: "terraform", ctx, started: Instant::now(), env };
        match self.steps(&mut run, &policy, &module).await {
            Ok(o) | Err(o) => o,
        }
    }

    async fn steps(
        &self,
        run: &mut Run<'_, '_>,
        policy: &crate::PolicyScope,
        module: &Path,
    ) -> Step<ExecOutcome> {
        let mut init =
            vec!["init", "-input=false", "-no-color"].into_iter().map(String::from).collect::<Vec<_>>();
        init.extend(self.spec.backend_config.iter().map(|(k, v)| format!("-backend-config={k}={v}")));
        let init_refs: Vec<&str> = init.iter().map(String::as_str).collect();
        run.cmd("init", run.tf(&init_refs)).await?;

        let plan_path = module.join(PLAN_FILE);
        match &self.spec.plan_digest {
            Some(want) => {
                let saved = self.saved_plan(&run.ctx.tools.plans_dir, want);
                let age =
                    std::fs::metadata(&saved).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
                let Some(age) = age else {
                    return Err(failed(
                        "plan_unknown",
                        format!("no saved plan {want} for workspace {}", self.spec.workspace),
                        serde_json::Value::Null,
                    ));
                };
                if age > run.ctx.tools.plan_max_age {
                    return Err(failed(
                        "plan_stale",
                        format!(
                            "saved plan {want} is {}s old (the limit is {}s): plan again",
                            age.as_secs(),
                            run.ctx.tools.plan_max_age.as_secs()
                        ),
                        serde_json::Value::Null,
                    ));
                }
                match sha256_file(&saved) {
                    Ok(d) if d == *want => {}
                    Ok(d) => {
                        return Err(failed(
                            "plan_digest_mismatch",
                            format!("saved plan has digest {d}, the job names {want}"),
                            serde_json::Value::Null,
                        ));
                    }
                    Err(e) => return Err(ExecOutcome::failed(format!("reading saved plan: {e}"))),
                }
                if let Err(e) = std::fs::copy(&saved, &plan_path).and_then(|_| hand_over(run.ctx, &plan_path))
                {
                    return Err(ExecOutcome::failed(format!("copying saved plan: {e}")));
                }
                run.log(&format!("[terraform] applying saved plan {want}\n"));
            }
            None => {
                let mut args = vec!["plan", "-input=false", "-no-color", "-out=plan.tfplan"];
                if self.spec.mode == Mode::Destroy {
                    args.push("-destroy");
                }
                run.cmd(
                    if self.spec.mode == Mode::Destroy { "plan -destroy" } else { "plan" },
                    run.tf(&args),
                )
                .await?;
            }
        }
        // The digest of the plan the policies are about to see, taken before anything
        // else reads it; apply later runs only if the file still has it.
        let plan_digest =
            sha256_file(&plan_path).map_err(|e| ExecOutcome::failed(format!("hashing the plan: {e}")))?;
        run.cmd("show -json", run.tf_to_file(&format!("show -json {PLAN_FILE}"), PLAN_JSON)).await?;
        let plan_bytes = std::fs::read(module.join(PLAN_JSON))
            .map_err(|e| ExecOutcome::failed(format!("reading the plan JSON: {e}")))?;
        // The plan's JSON has values the control plane must not see: drop it now.
        let _ = std::fs::remove_file(module.join(PLAN_JSON));
        let plan_value: serde_json::Value = serde_json::from_slice(&plan_bytes).map_err(|e| {
            failed(
                "plan_unreadable",
                format!("terraform show -json is not JSON: {e}"),
                serde_json::Value::Null,
            )
        })?;
        let summary = summary(&plan_value);
        let subject = crate::policy_gate::Subject {
            // A sandbox's runs are decided as sandbox plans (their own policies).
            source: if policy.operation.starts_with("sandbox.") {
                byoc_policy::Source::Sandbox
            } else {
                byoc_policy::Source::Terraform
            },
            admission: Default::default(),
            name: "plan",
            digest: Some(&plan_digest),
        };
        let decision = crate::policy_gate::decide(run.ctx, subject, &plan_bytes)
            .await
            .map_err(|e| failed(crate::policy_gate::UNAVAILABLE, e, serde_json::Value::Null))?;
        let base = serde_json::json!({
            "plan_digest": plan_digest,
            "input_digest": decision.input_digest,
            "summary": summary,
            "verdict": decision.verdict,
            "violations": decision.violations.iter().map(|v| serde_json::json!({"rule": v.rule, "address": v.address, "policy": v.policy})).collect::<Vec<_>>(),
        });
        if decision.verdict == byoc_policy::Verdict::Deny {
            return Err(failed(
                "policy_denied",
                format!("policy denied the plan: {}", decision.denials().join(", ")),
                base,
            ));
        }
        run.log(&format!("[policy] ALLOW plan {plan_digest} ({} policies)\n", decision.policies.len()));
        if self.spec.mode == Mode::Plan {
            let saved = self.saved_plan(&run.ctx.tools.plans_dir, &plan_digest);
            // The result names this digest: the file and its directory entry are on
            // disk before the job reports success.
            let dir = saved.parent().map(Path::to_path_buf).unwrap_or_default();
            let keep = std::fs::create_dir_all(&dir)
                .and_then(|_| std::fs::copy(&plan_path, &saved).map(|_| ()))
                .and_then(|_| std::fs::File::open(&saved)?.sync_all())
                .and_then(|_| std::fs::File::open(&dir)?.sync_all());
            if let Err(e) = keep {
                return Err(ExecOutcome::failed(format!("saving the plan: {e}")));
            }
            return Ok(ExecOutcome {
                status: JobStatus::Succeeded,
                exit_code: Some(0),
                error: None,
                outputs: base,
            });
        }
        // Exactly the plan the policies saw, or nothing.
        match sha256_file(&plan_path) {
            Ok(d) if d == plan_digest => {}
            other => {
                let now = other.unwrap_or_else(|e| format!("unreadable ({e})"));
                if let Some(a) = &run.ctx.audit {
                    let _ = a.record(
                        "plan_tampered",
                        format!(
                            "plan file changed between the policy decision and apply: {plan_digest} -> {now}"
                        ),
                        BTreeMap::from([("plan".to_string(), plan_digest.clone())]),
                    );
                }
                return Err(failed(
                    "plan_tampered",
                    format!(
                        "the plan file changed after the policy decision ({plan_digest} -> {now}); not applied"
                    ),
                    base,
                ));
            }
        }
        run.cmd("apply", run.tf(&["apply", "-input=false", "-no-color", "-auto-approve", PLAN_FILE])).await?;
        run.cmd("output -json", run.tf_to_file("output -json", OUTPUTS_JSON)).await?;
        let raw = std::fs::read(module.join(OUTPUTS_JSON))
            .map_err(|e| ExecOutcome::failed(format!("reading outputs: {e}")))?;
        let outputs = masked_outputs(&raw).map_err(ExecOutcome::failed)?;
        let mut result = base;
        result["outputs"] = outputs;
        Ok(ExecOutcome { status: JobStatus::Succeeded, exit_code: Some(0), error: None, outputs: result })
    }
}

/// The decision, in the audit log: plan digest, policy digests, verdict, every
/// violation with its rule and resource address.
/// The decision in the job log (each violation, warning and error) and the audit log.
impl Executor for Terraform {
    fn run<'a>(&'a self, mut ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move { self.go(&mut ctx).await })
    }

    fn placement(&self) -> crate::Placement {
        crate::Placement::Sandbox { network: true }
    }

    fn secrets(&self) -> Vec<Vec<u8>> {
        self.spec.secret_vars.values().map(|v| v.as_bytes().to_vec()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(extra: serde_json::Value) -> serde_json::Value {
        let mut base = serde_json::json!({"mode": "apply", "files": {"main.tf": ""}, "workspace": "api"});
        for (k, v) in extra.as_object().into_iter().flatten() {
            base[k] = v.clone();
        }
        base
    }

    #[test]
    fn specs_are_validated_before_the_claim() {
        assert!(Terraform::from_spec(&spec(serde_json::json!({}))).is_ok());
        for (bad, why) in [
            (serde_json::json!({"files": {"../x.tf": ""}}), "relative path"),
            (serde_json::json!({"files": {"/etc/passwd": ""}}), "relative path"),
            (serde_json::json!({"files": {}}), "files"),
            (serde_json::json!({"workspace": "Bad Name"}), "workspace"),
            (serde_json::json!({"vars": {"a b": "1"}}), "variable name"),
            (serde_json::json!({"secret_vars": {"pw": "abc"}}), "masked"),
            (serde_json::json!({"plan_digest": "sha256:xyz"}), "plan_digest"),
            (
                serde_json::json!({"mode": "plan", "plan_digest": format!("sha256:{}", "a".repeat(64))}),
                "only for mode",
            ),
            (serde_json::json!({"mode": "yolo"}), "variant"),
        ] {
            let err = Terraform::from_spec(&spec(bad.clone())).err().unwrap_or_default();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn the_summary_counts_actions_and_lists_addresses() {
        let plan = serde_json::json!({"resource_changes": [
            {"address": "a.x", "change": {"actions": ["create"]}},
            {"address": "a.y", "change": {"actions": ["delete", "create"]}},
            {"address": "a.z", "change": {"actions": ["no-op"]}},
            {"address": "a.w", "change": {"actions": ["update"]}},
        ]});
        let s = summary(&plan);
        assert_eq!(s["counts"], serde_json::json!({"create": 1, "replace": 1, "update": 1}));
        assert_eq!(s["addresses"]["replace"][0], "a.y");
    }

    #[test]
    fn sensitive_outputs_are_masked() {
        let raw = br#"{"endpoint": {"sensitive": false, "type": "string", "value": "db.example"}, "password": {"sensitive": true, "type": "string", "value": "hunter2-hunter2"}}"#;
        let o = masked_outputs(raw).unwrap_or_default();
        assert_eq!(o["endpoint"], "db.example");
        assert_eq!(o["password"], "***");
    }
}
