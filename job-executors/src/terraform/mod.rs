//! `terraform`: plan, decide, apply. The `terraform` CLI runs in the sandbox with the
//! job's role credentials: `init`, `plan -out`; the plan is sealed once nothing of the
//! job runs and the runner renders it (`show -json` in a sandbox of its own, offline,
//! no credentials, its output to the runner: `render`); the policy decision (audited),
//! then `apply` of exactly that plan file, checked against its digest right before;
//! `output -json` into the result with sensitive values masked. A plan-only job keeps its plan for a later job that names
//! its digest. Destroy is `plan -destroy` through the same gate. The control plane gets
//! a summary (counts per action, addresses) and digests, not the plan.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Deserialize;
use sha2::Digest as _;

use crate::tool::{DEFAULT_PATH, Run, SealedDir, Stage, Step, failed, hand_over, safe_relative};
use crate::{ExecContext, ExecFuture, ExecOutcome, Executor, JobStatus};
use judge::{Judged, read_outputs, still_the_plan};
use summary::summary;

pub mod bucket;
mod customer_secrets;
mod drift;
mod gated;
mod judge;
pub mod planfile;
pub mod providers;
mod render;
mod saved_plan;
pub mod state;
mod summary;
mod tree;

use tree::{LOCK_FILE, RunnerTree};
pub use tree::{apply_staged, refused_module_path, refused_root_override};

/// The root module, in the job's working directory.
pub const MODULE_DIR: &str = "module";
const PLAN_FILE: &str = "plan.tfplan";
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
    /// Check the component against its state and its contract: `plan -refresh-only`
    /// (what changed outside terraform) and a normal plan (what a deploy would
    /// change), the policies over what drifted. Nothing is ever applied.
    Drift,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    mode: Mode,
    /// The root module from the install's registry: `<registry>/<repo>@sha256:…` (an
    /// OCI artifact whose one layer is a tar.gz of the module), synced there first.
    #[serde(default)]
    module: Option<String>,
    /// Or inline, for small modules and tests: relative path → content.
    #[serde(default)]
    files: BTreeMap<String, String>,
    /// A provider mirror from the install's registry, by digest (terraform's
    /// filesystem-mirror layout as an OCI artifact): its providers come from it and
    /// never from the network.
    #[serde(default)]
    providers: Option<String>,
    /// Names the saved plans (`[a-z0-9_-]`, e.g. the component).
    workspace: String,
    #[serde(default)]
    vars: BTreeMap<String, String>,
    /// Passed as TF_VAR_*, masked wherever output goes.
    #[serde(default)]
    secret_vars: BTreeMap<String, String>,
    /// The customer's secrets, by name: each passed as the terraform variable the app
    /// config declares for it (`terraform_variable`), read from the install's Secrets
    /// Manager under the job's role. The job never carries the value.
    #[serde(default)]
    secrets: Vec<String>,
    /// The job's own backend (`-backend-config` pairs for the backend its module
    /// declares): only where the customer's configuration allows it
    /// (`[terraform.state] allow_job_backend`); otherwise the state is the customer's
    /// (their bucket, or local state on the runner) and this is refused.
    #[serde(default)]
    backend_config: BTreeMap<String, String>,
    /// Apply this saved plan (from a plan-only job) instead of planning again.
    #[serde(default)]
    plan_digest: Option<String>,
}

pub struct Terraform {
    spec: Spec,
    module: Option<byoc_oci_sync::Reference>,
    providers: Option<byoc_oci_sync::Reference>,
    /// The spec as signed, for the drift check of what it deploys.
    raw: serde_json::Value,
}

/// A workspace or plan name (`[a-z0-9_-]`, 1-64): it becomes a directory and a key part.
pub fn valid_name(s: &str) -> bool {
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

impl Terraform {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, crate::InvalidSpec> {
        let s: Spec = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
        let module = match (&s.module, s.files.is_empty()) {
            (Some(m), true) => Some(crate::artifact::parse_reference("module", m)?),
            (Some(_), false) => {
                return Err(crate::InvalidSpec::from(
                    "name the module by digest (module) or inline (files), not both",
                ));
            }
            (None, true) => {
                return Err(crate::InvalidSpec::from(
                    "the module: module = \"<registry>/<repo>@sha256:…\", or files",
                ));
            }
            (None, false) => None,
        };
        if s.files.len() > MAX_FILES {
            return Err(crate::InvalidSpec::from(format!("files: 1 to {MAX_FILES} files")));
        }
        if s.files.values().map(String::len).sum::<usize>() > MAX_FILES_BYTES {
            return Err(crate::InvalidSpec::from(format!("files: more than {MAX_FILES_BYTES} bytes in all")));
        }
        if let Some(bad) = s.files.keys().find(|p| !safe_relative(p)) {
            return Err(crate::InvalidSpec::from(format!(
                "files: {bad:?} is not a relative path inside the module"
            )));
        }
        let runner_backend = s.backend_config.is_empty();
        let refused = |p: &Path| {
            refused_module_path(p).or(if runner_backend { refused_root_override(p) } else { None })
        };
        if let Some((bad, why)) = s.files.keys().find_map(|p| refused(Path::new(p)).map(|why| (p, why))) {
            return Err(crate::InvalidSpec::from(format!(
                "files: {bad:?} is {why}; a module carries configuration only"
            )));
        }
        if !valid_name(&s.workspace) {
            return Err(crate::InvalidSpec::from(format!("workspace {:?}: 1-64 of [a-z0-9_-]", s.workspace)));
        }
        if let Some(bad) = s.vars.keys().chain(s.secret_vars.keys()).find(|v| !valid_var(v)) {
            return Err(crate::InvalidSpec::from(format!("variable name {bad:?} is not valid")));
        }
        if let Some(dup) = s.vars.keys().find(|k| s.secret_vars.contains_key(*k)) {
            return Err(crate::InvalidSpec::from(format!("{dup} is in both vars and secret_vars")));
        }
        if let Some((k, _)) = s.secret_vars.iter().find(|(_, v)| v.len() < crate::mask::MIN_SECRET_LEN) {
            return Err(crate::InvalidSpec::from(format!(
                "secret_vars {k}: values shorter than {} bytes cannot be masked reliably",
                crate::mask::MIN_SECRET_LEN
            )));
        }
        match (&s.plan_digest, s.mode) {
            (Some(d), Mode::Apply) => {
                let hex = d.strip_prefix("sha256:").unwrap_or("");
                if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(crate::InvalidSpec::from(format!(
                        "plan_digest {d:?} is not sha256:<64 hex>"
                    )));
                }
            }
            (Some(_), _) => return Err(crate::InvalidSpec::from("plan_digest is only for mode = apply")),
            (None, _) => {}
        }
        if let Some(bad) = s.secrets.iter().find(|n| !crate::secrets::valid_name(n)) {
            return Err(crate::InvalidSpec::from(format!("secret name {bad:?}: 1-128 of [A-Za-z0-9_-]")));
        }
        let providers =
            s.providers.as_deref().map(|p| crate::artifact::parse_reference("providers", p)).transpose()?;
        Ok(Terraform { spec: s, module, providers, raw: spec.clone() })
    }
}

/// Caps on what the runner reads back of terraform's files in the job's directory.
const MAX_OUTPUTS_BYTES: u64 = 16 << 20;
pub(crate) const MAX_STATE_BYTES: u64 = 256 << 20;

/// `<work>/module` as the job's tree and the name beneath it: the module directory is the
/// job's (its code can put links there), its parent the runner's.
fn in_tree(module: &Path, name: &str) -> (PathBuf, PathBuf) {
    let root = module.parent().unwrap_or(module).to_path_buf();
    let rel = Path::new(module.file_name().unwrap_or_default()).join(name);
    (root, rel)
}

/// A file terraform wrote in the module directory, read the one safe way (`job_files`).
pub(crate) fn module_file(
    module: &Path,
    name: &str,
    max: u64,
) -> Result<Vec<u8>, crate::job_files::JobFileError> {
    let (root, rel) = in_tree(module, name);
    crate::job_files::read(&root, rel, max)
}

/// The same, `None` when terraform wrote no such file.
pub(crate) fn module_file_if_exists(
    module: &Path,
    name: &str,
    max: u64,
) -> Result<Option<Vec<u8>>, crate::job_files::JobFileError> {
    let (root, rel) = in_tree(module, name);
    crate::job_files::read_if_exists(&root, rel, max)
}

fn sha256_file(p: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(p)?;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(format!("sha256:{}", hex::encode(h.finalize())))
}

/// Copy the plan file terraform wrote in the module directory into the sealed
/// directory (`job_files`: no link followed, a regular file, at most the size a state may
/// have), once nothing of the job runs.
fn seal(module: &Path, name: &str, sealed: &SealedDir) -> Step<()> {
    let (root, rel) = in_tree(module, name);
    crate::job_files::JobTree::open(&root)
        .and_then(|t| t.copy_out(rel, &sealed.path.join(name), MAX_STATE_BYTES))
        .map_err(|e| failed(e.code(), format!("sealing the plan {name}: {e}"), serde_json::Value::Null))
}

/// [`render::render`] with the job's remaining time and log.
async fn render_in(
    run: &mut Run<'_, '_>,
    sealed: &SealedDir,
    tree: &RunnerTree,
    name: &str,
    max: u64,
) -> Step<Vec<u8>> {
    let settings = run.ctx.settings().timeout(run.remaining(), run.ctx.settings.kill_grace);
    render::render(settings, &mut *run.ctx.output, &run.env, sealed, tree, name, max).await
}

/// terraform's own command lines.
impl Run<'_, '_> {
    /// Several terraform commands in one sandbox (each sandbox costs tens of ms to build
    /// and tear down): each announced in the log, the first failure ends the step with
    /// its exit code. A stop signal lets the running command stop gracefully (it gets
    /// the signal too; the shell exits after it, running nothing more). `extra` are
    /// appended, as arguments, to the first command (never interpolated).
    fn tf_script(&self, commands: &[(&str, String)], extra: &[String]) -> Vec<String> {
        let mut script = String::from("trap 'exit 130' INT TERM\n");
        for (i, (label, args)) in commands.iter().enumerate() {
            let tail = if i == 0 { " \"$@\"" } else { "" };
            let (args, redirect) = match args.split_once(" > ") {
                Some((a, file)) => (a, format!(" > {MODULE_DIR}/{file}")),
                None => (args.as_str(), String::new()),
            };
            script.push_str(&format!(
                "echo '[terraform] {label}'\n\"$0\" -chdir={MODULE_DIR} {args}{tail}{redirect} || exit $?\n"
            ));
        }
        let mut v = vec![
            "/bin/sh".into(),
            "-c".into(),
            script,
            self.ctx.settings.tools.terraform.display().to_string(),
        ];
        v.extend(extra.iter().cloned());
        v
    }
}

impl Terraform {
    fn saved_plan(&self, plans_dir: &Path, digest: &str) -> PathBuf {
        plans_dir.join(&self.spec.workspace).join(format!("{}.tfplan", digest.trim_start_matches("sha256:")))
    }

    async fn go(&self, ctx: &mut ExecContext<'_>) -> ExecOutcome {
        let Some(policy) = ctx.settings.policy.clone() else {
            return failed(
                "policy_unavailable",
                "no policy context: terraform jobs are decided by policy".into(),
                serde_json::Value::Null,
            );
        };
        let mut tree = match RunnerTree::create(ctx) {
            Ok(t) => t,
            Err(e) => {
                return ExecOutcome::failed(format!("creating the runner's terraform directories: {e}"));
            }
        };
        if let Err(outcome) = self.stage_module(ctx, &tree.module()).await {
            return outcome;
        }
        let local_state = match self.stage_state(ctx, &tree.module()) {
            Ok(held) => held,
            Err(outcome) => return outcome,
        };
        let module = ctx.settings.work_dir.join(MODULE_DIR);
        if let Err(outcome) = restage(ctx, &tree, &module, local_state.as_ref(), None) {
            return outcome;
        }
        let (env, customer_secrets) = match self.environment(ctx, &mut tree).await {
            Ok(e) => e,
            Err(outcome) => return outcome,
        };
        let mut run = Run {
            tool: "terraform",
            ctx,
            started: Instant::now(),
            env,
            watch: Some("Error acquiring the state lock"),
            seen: false,
            binds: tree.binds(true),
        };
        let mut outcome = match self.steps(&mut run, &policy, &module, &tree, local_state.as_ref()).await {
            Ok(o) | Err(o) => o,
        };
        if let (Some(report), Some(o)) = (&customer_secrets.report, outcome.outputs.as_object_mut()) {
            o.insert("secrets".into(), report.clone());
        }
        if run.seen && outcome.status != JobStatus::Succeeded {
            // Another holder, or a lock a killed runner left in the state bucket.
            outcome = failed(
                "state_locked",
                format!(
                    "workspace {:?}'s state is locked by another terraform run (its lock ID is in the job log); if none is running, \
                     remove the stale lock: `byoc-runner state unlock {} LOCK_ID` on the runner (audited)",
                    self.spec.workspace, self.spec.workspace
                ),
                outcome.outputs,
            );
        }
        // Whatever happened after the module was staged for apply: what terraform wrote
        // is the truth about what exists. Before that only job code could have written
        // the state file (plan never does): it is not kept.
        if let Some(held) = local_state.as_ref().filter(|_| tree.is_apply_staged()) {
            match held.keep(&module) {
                Ok(serial) => {
                    if let (Some(serial), Some(o)) = (serial, outcome.outputs.as_object_mut()) {
                        o.insert("state_serial".into(), serial.into());
                    }
                }
                Err(e) => {
                    run.log(&format!("[terraform] keeping the state failed: {e}\n"));
                    if outcome.status == JobStatus::Succeeded {
                        outcome = failed(e.code(), e.to_string(), outcome.outputs);
                    }
                }
            }
        }
        outcome
    }

    /// The verified module, in the runner's tree: the fetched artifact (by digest), then
    /// the spec's files over it; refused if it carries terraform's own files (see
    /// [`refused_module_path`]). Its lock file is always there (empty when the module
    /// has none), so that it can be sealed with the plan.
    async fn stage_module(&self, ctx: &mut ExecContext<'_>, module: &Path) -> Result<(), ExecOutcome> {
        if let Some(reference) = &self.module {
            match crate::artifact::fetch(&ctx.settings, reference).await {
                Ok(fetched) => {
                    let _ = ctx.output.write(
                        format!(
                            "[terraform] module {reference}: {} files, {} bytes{}\n",
                            fetched.files,
                            fetched.bytes,
                            if fetched.cached { " (cached)" } else { ", fetched and verified" }
                        )
                        .as_bytes(),
                    );
                    match tree::find_refused(&fetched.tree, self.spec.backend_config.is_empty()) {
                        Ok(None) => {}
                        Ok(Some((path, why))) => {
                            let _ = ctx.output.write(
                                format!(
                                    "[terraform] module {reference}: refused: {} is {why}\n",
                                    path.display()
                                )
                                .as_bytes(),
                            );
                            return Err(failed(
                                "artifact_invalid",
                                format!(
                                    "module {reference} carries {} ({why}): a module carries configuration only; nothing ran",
                                    path.display()
                                ),
                                serde_json::json!({"module": reference.to_string()}),
                            ));
                        }
                        Err(e) => {
                            return Err(ExecOutcome::failed(format!("reading the module's files: {e}")));
                        }
                    }
                    if let Err(e) = crate::artifact::copy_tree(&fetched.tree, module) {
                        return Err(ExecOutcome::failed(format!("copying the verified module: {e}")));
                    }
                    ctx.settings.artifact = Some(fetched.digest.to_string());
                }
                Err(e) => {
                    let _ = ctx.output.write(format!("[terraform] module {reference}: {e}\n").as_bytes());
                    return Err(failed(
                        &e.code(),
                        e.to_string(),
                        serde_json::json!({"module": reference.to_string()}),
                    ));
                }
            }
        }
        for (rel, content) in &self.spec.files {
            let path = module.join(rel);
            if let Some(parent) = path.parent()
                && let Err(e) = std::fs::create_dir_all(parent)
            {
                return Err(ExecOutcome::failed(format!("writing module file {rel}: {e}")));
            }
            if let Err(e) = std::fs::write(&path, content) {
                return Err(ExecOutcome::failed(format!("writing module file {rel}: {e}")));
            }
        }
        let lock = module.join(LOCK_FILE);
        if std::fs::symlink_metadata(&lock).is_err()
            && let Err(e) = std::fs::write(&lock, b"")
        {
            return Err(ExecOutcome::failed(format!("writing the module's lock file: {e}")));
        }
        Ok(())
    }

    /// Where the state lives: never the job's scratch directory. The install's backend
    /// (its override file written into the verified module), with the runner's local
    /// state held (staged into each module copy); a backend of the job's own only where
    /// the customer allows it.
    fn stage_state(
        &self,
        ctx: &mut ExecContext<'_>,
        module: &Path,
    ) -> Result<Option<state::LocalState>, ExecOutcome> {
        let state_settings = &ctx.settings.tools.state;
        if !self.spec.backend_config.is_empty() {
            if !state_settings.allow_job_backend {
                return Err(failed(
                    "backend_not_allowed",
                    "the job names its own terraform backend (backend_config), which this runner's configuration does not allow: its state goes to the install's state bucket or the runner's local state".into(),
                    serde_json::Value::Null,
                ));
            }
            return Ok(None);
        }
        let override_path = module.join(state::OVERRIDE_FILE);
        let text = state::override_file(&state_settings.backend, &self.spec.workspace);
        if let Err(e) = std::fs::write(&override_path, text) {
            return Err(ExecOutcome::failed(format!("writing the backend configuration: {e}")));
        }
        let mut local_state = None;
        if let state::Backend::Local { root } = &state_settings.backend {
            let held = state::LocalState::acquire(root, &self.spec.workspace)
                .map_err(|e| failed(e.code(), e.to_string(), serde_json::Value::Null))?;
            local_state = Some(held);
        }
        let place = match &state_settings.backend {
            state::Backend::Local { .. } => "local, on this runner".to_string(),
            state::Backend::S3 { bucket, key_prefix, .. } => format!(
                "s3://{bucket}/{}/{}/terraform.tfstate",
                key_prefix.trim_matches('/'),
                self.spec.workspace
            ),
        };
        let _ = ctx
            .output
            .write(format!("[terraform] state of workspace {}: {place}\n", self.spec.workspace).as_bytes());
        Ok(local_state)
    }

    /// Terraform's environment: no prompts or update checks; HOME, the CLI
    /// configuration and the data directory the runner's (see [`tree`]); the job's
    /// variables, the customer's secrets it may read, the role's credentials.
    async fn environment(
        &self,
        ctx: &mut ExecContext<'_>,
        tree: &mut RunnerTree,
    ) -> Result<(Vec<(String, String)>, customer_secrets::CustomerSecrets), ExecOutcome> {
        let cli_config = match &self.providers {
            Some(reference) => self.provider_mirror(ctx, reference, tree).await?,
            None => match &ctx.settings.tools.cli_config_file {
                Some(f) => tree::read_customer_cli_config(f).map_err(|why| {
                    failed(
                        tree::CONFIG_UNREADABLE,
                        format!(
                            "terraform.cli_config_file cannot be read ({why}): the runner reads it and gives every terraform step a \
                             read-only copy; make it a readable regular file, or remove the setting"
                        ),
                        serde_json::Value::Null,
                    )
                })?,
                // No provider from anywhere: terraform's built-in provider only. Providers
                // come from a mirror (the job's, where allowed, or the customer's file).
                None => providers::NO_INSTALLATION.as_bytes().to_vec(),
            },
        };
        tree.write_cli_config(&cli_config)
            .map_err(|e| ExecOutcome::failed(format!("writing the terraform CLI configuration: {e}")))?;
        if ctx.settings.tools.plugin_cache_dir.is_some() {
            let _ = ctx.output.write(
                b"[terraform] terraform.plugin_cache_dir is not used: a cache every job's init writes would let one job's code \
                  change the providers of the next; use a filesystem mirror (terraform.cli_config_file)\n",
            );
        }
        let mut env: Vec<(String, String)> = vec![
            ("PATH".into(), DEFAULT_PATH.into()),
            ("HOME".into(), tree.home().display().to_string()),
            ("BYOC_JOB_ID".into(), ctx.settings.job_id.clone()),
            ("TF_IN_AUTOMATION".into(), "1".into()),
            ("TF_INPUT".into(), "0".into()),
            ("CHECKPOINT_DISABLE".into(), "1".into()),
            ("TF_CLI_CONFIG_FILE".into(), tree.cli_config().display().to_string()),
            ("TF_DATA_DIR".into(), tree.data_dir().display().to_string()),
        ];
        for (k, v) in self.spec.vars.iter().chain(&self.spec.secret_vars) {
            env.push((format!("TF_VAR_{k}"), v.clone()));
        }
        let customer_secrets = self.customer_secrets(ctx).await?;
        for (variable, value) in &customer_secrets.env {
            env.push((format!("TF_VAR_{variable}"), value.clone()));
        }
        crate::add_role_env(ctx, &mut env, true);
        Ok((env, customer_secrets))
    }

    async fn steps(
        &self,
        run: &mut Run<'_, '_>,
        policy: &crate::JobPolicies,
        module: &Path,
        tree: &RunnerTree,
        local_state: Option<&state::LocalState>,
    ) -> Step<ExecOutcome> {
        let backend: Vec<String> =
            self.spec.backend_config.iter().map(|(k, v)| format!("-backend-config={k}={v}")).collect();
        let init = run.tf_script(&[("init", "init -input=false -no-color".to_string())], &backend);
        if self.spec.mode == Mode::Drift {
            return self.drift(run, module, tree, init).await;
        }
        // The plan the policies decide on and apply applies is the runner's sealed copy:
        // the job reads it and cannot change it (see `Run::staged`).
        let sealed = SealedDir::create(run.ctx)
            .map_err(|e| ExecOutcome::failed(format!("creating the sealed plan directory: {e}")))?;
        let plan_path = sealed.path.join(PLAN_FILE);
        match &self.spec.plan_digest {
            Some(want) => {
                self.take_saved_plan(run, want, &sealed)?;
                plan_backend_is_ours(&run.ctx.settings, &self.spec, &plan_path)?;
                run.log(&format!("[terraform] applying saved plan {want}\n"));
                // The providers rendering and applying the plan need; nothing of the
                // job's runs in this sandbox.
                run.cmd("init", init).await?;
                providers_verified(tree, &mut *run.ctx.output)?;
            }
            None => {
                let destroy = self.spec.mode == Mode::Destroy;
                let plan = (
                    if destroy { "plan -destroy" } else { "plan" },
                    format!(
                        "plan -input=false -no-color -out={PLAN_FILE}{}",
                        if destroy { " -destroy" } else { "" }
                    ),
                );
                let gated = matches!(self.spec.mode, Mode::Apply | Mode::Destroy)
                    && !run.ctx.settings.decide_only
                    && run.ctx.settings.apply_approval.is_none();
                let plan = after_init(run.tf_script(&[plan], &[]));
                if gated {
                    let apply = (
                        "apply",
                        format!("apply -input=false -no-color -auto-approve {}", sealed.inside(PLAN_FILE)),
                    );
                    let commands = gated::Commands { init, plan, apply: run.tf_script(&[apply], &[]) };
                    let restage = Restage { tree, local_state };
                    return self.plan_decide_apply(run, policy, module, restage, &sealed, commands).await;
                }
                // init, then plan with the data directory frozen; when the sandbox has
                // ended, so has every process of the job: the plan terraform wrote is
                // sealed as it is now, with the lock file it was made with.
                run.staged("init, plan", init, vec![plan], None).await?;
                providers_verified(tree, &mut *run.ctx.output)?;
                seal(module, PLAN_FILE, &sealed)?;
                seal(module, LOCK_FILE, &sealed)?;
                plan_backend_is_ours(&run.ctx.settings, &self.spec, &plan_path)?;
            }
        }
        let plan_json =
            render_in(run, &sealed, tree, PLAN_FILE, policy.limits.max_input_bytes as u64).await?;
        let judged = self.judge(run.ctx, &plan_path, plan_json).await?;
        let Judged { plan_digest, plan_value, summary, decision, base } = judged;

        if run.ctx.settings.decide_only {
            run.log("[terraform] stopping after the decision: nothing applied\n");
            return Ok(ExecOutcome {
                status: JobStatus::Succeeded,
                exit_code: Some(0),
                error: None,
                outputs: base,
            });
        }
        if self.spec.mode == Mode::Plan {
            let saved = self.saved_plan(&run.ctx.settings.tools.plans_dir, &plan_digest);
            keep_plan(&sealed, &saved).map_err(|e| ExecOutcome::failed(format!("saving the plan: {e}")))?;
            return Ok(ExecOutcome {
                status: JobStatus::Succeeded,
                exit_code: Some(0),
                error: None,
                outputs: base,
            });
        }
        // The customer's approval of exactly this plan, if their rules ask for it; the
        // wait is not the job's time.
        run.started +=
            crate::policy_gate::approve_apply(run.ctx, "terraform", &plan_digest, &summary, &decision, &base)
                .await?;
        // Exactly the plan the policies saw, or nothing.
        still_the_plan(run.ctx, &plan_path, &plan_digest, &base)?;
        crate::open_full_session(run.ctx, &plan_digest)?;
        restage(run.ctx, tree, module, local_state, Some(&sealed))?;
        run.binds = tree.binds(false);
        self.apply_sealed(run, module, &sealed, &plan_value, local_state.is_some(), base).await
    }

    /// Apply the sealed plan and read its outputs, without another terraform run where
    /// they can be had otherwise (a run is ~30 ms of a fast module): none declared, none
    /// to read; with local state, the state file holds them in `output -json`'s shape.
    async fn apply_sealed(
        &self,
        run: &mut Run<'_, '_>,
        module: &Path,
        sealed: &SealedDir,
        plan_value: &serde_json::Value,
        state_beside_module: bool,
        base: serde_json::Value,
    ) -> Step<ExecOutcome> {
        let declares_outputs = gated::declares_outputs(plan_value);
        let apply =
            ("apply", format!("apply -input=false -no-color -auto-approve {}", sealed.inside(PLAN_FILE)));
        let with_output_json = declares_outputs && !state_beside_module;
        if with_output_json {
            // apply and output in one sandbox.
            let output = ("output -json", format!("output -json > {OUTPUTS_JSON}"));
            run.staged("apply, output -json", run.tf_script(&[apply, output], &[]), vec![], Some(sealed))
                .await?;
        } else {
            run.staged("apply", run.tf_script(&[apply], &[]), vec![], Some(sealed)).await?;
        }
        let raw = read_outputs(module, declares_outputs, with_output_json)?;
        let outputs = crate::outputs::from_terraform(&raw)
            .map_err(|e| ExecOutcome::failed(format!("terraform output -json is not JSON: {e}")))?;
        let mut result = base;
        result["outputs"] = outputs;
        Ok(ExecOutcome { status: JobStatus::Succeeded, exit_code: Some(0), error: None, outputs: result })
    }
}

/// What apply starts from: the runner's tree and the local state it holds.
struct Restage<'t> {
    tree: &'t RunnerTree,
    local_state: Option<&'t state::LocalState>,
}

/// Reason code: the sealed plan names a backend other than the one the runner configured.
const PLAN_BACKEND_MISMATCH: &str = "plan_backend_mismatch";

/// Apply takes the backend from the plan file, not from the module: the sealed plan must
/// name the one the runner configured (the same type, settings and the default
/// workspace), or nothing is decided or applied. A job's own backend, where the customer
/// allows one, is the job's.
fn plan_backend_is_ours(settings: &crate::ExecSettings, spec: &Spec, plan: &Path) -> Step<()> {
    use std::io::Read as _;
    if !spec.backend_config.is_empty() {
        return Ok(());
    }
    let refuse = |why: String| {
        failed(
            PLAN_BACKEND_MISMATCH,
            format!(
                "{why}: something of the job's rewrote the plan terraform wrote; nothing was decided or applied"
            ),
            serde_json::Value::Null,
        )
    };
    let mut bytes = Vec::new();
    std::fs::File::open(plan)
        .and_then(|f| f.take(MAX_STATE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| ExecOutcome::failed(format!("reading the sealed plan: {e}")))?;
    let got = planfile::backend(&bytes)
        .map_err(|why| refuse(format!("the sealed plan's backend cannot be read ({why})")))?;
    let (kind, config) = state::plan_backend(&settings.tools.state.backend, &spec.workspace);
    if got.kind != kind || got.workspace != "default" || got.config != config {
        let keys: Vec<&String> = got.config.as_object().map(|o| o.keys().collect()).unwrap_or_default();
        return Err(refuse(format!(
            "the sealed plan names backend {:?} (workspace {:?}, settings {keys:?}), not the {kind} backend the runner configured",
            got.kind, got.workspace
        )));
    }
    Ok(())
}

/// Reason code: a provider init installed is not the verified mirror's.
const PROVIDER_UNVERIFIED: &str = "provider_unverified";

/// The providers init installed are the job's verified mirror's (see
/// [`RunnerTree::verify_installed`]), or the step fails before anything renders or
/// applies with them.
fn providers_verified(tree: &RunnerTree, out: &mut dyn crate::OutputSink) -> Step<()> {
    match tree.verify_installed() {
        Ok(0) => Ok(()),
        Ok(n) => {
            let _ = out.write(
                format!("[terraform] {n} installed provider package(s): the mirror's, as verified\n")
                    .as_bytes(),
            );
            Ok(())
        }
        Err(why) => Err(failed(
            PROVIDER_UNVERIFIED,
            format!(
                "a provider terraform installed is not the verified mirror's ({why}): nothing was rendered or applied"
            ),
            serde_json::Value::Null,
        )),
    }
}

/// The stage after `init`: the data directory frozen before it starts, so that nothing
/// the job's code runs (a provider, a data source's program) can change the providers
/// or modules init installed.
fn after_init(argv: Vec<String>) -> Stage {
    Stage { argv, seal: vec![], gate: false, freeze: vec![PathBuf::from(tree::DATA_INSIDE)] }
}

/// A fresh module directory for the next step, from the verified module: the held local
/// state staged into it, and with `sealed`, the lock file the judged plan was made with
/// (apply checks the plan against it); handed to the job's uid.
fn restage(
    ctx: &ExecContext<'_>,
    tree: &RunnerTree,
    module: &Path,
    local_state: Option<&state::LocalState>,
    sealed: Option<&SealedDir>,
) -> Step<()> {
    tree::restage_module(&tree.module(), module).map_err(|e| {
        ExecOutcome::failed(format!("copying the verified module into the job's directory: {e}"))
    })?;
    if let Some(held) = local_state {
        held.stage(module).map_err(|e| failed(e.code(), e.to_string(), serde_json::Value::Null))?;
    }
    if let Some(sealed) = sealed {
        let lock = module.join(LOCK_FILE);
        let _ = std::fs::remove_file(&lock);
        std::fs::copy(sealed.path.join(LOCK_FILE), &lock)
            .map_err(|e| ExecOutcome::failed(format!("staging the plan's lock file: {e}")))?;
        tree.mark_apply_staged().map_err(|e| ExecOutcome::failed(format!("marking the apply: {e}")))?;
    }
    hand_over(ctx, module)
        .map_err(|e| ExecOutcome::failed(format!("handing the module to the job's uid: {e}")))
}

/// The decision, in the audit log: plan digest, policy digests, verdict, every
/// violation with its rule and resource address.
/// The decision in the job log (each violation, warning and error) and the audit log.
impl Executor for Terraform {
    fn effect(&self) -> byoc_protocol::Effect {
        use byoc_protocol::Effect;
        match self.spec.mode {
            Mode::Plan | Mode::Drift => Effect::Read,
            Mode::Apply => Effect::Change,
            Mode::Destroy => Effect::Destroy,
        }
    }

    fn run<'a>(&'a self, mut ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move { self.go(&mut ctx).await })
    }

    fn placement(&self) -> crate::Placement {
        crate::Placement::Sandbox { network: true }
    }

    fn secrets(&self) -> Vec<Vec<u8>> {
        self.spec.secret_vars.values().map(|v| v.as_bytes().to_vec()).collect()
    }

    fn secret_uses(&self) -> Vec<crate::secrets::SecretUse> {
        crate::secrets::uses(&self.spec.secrets, crate::secrets::Target::TerraformVariable)
    }

    fn is_drift_check(&self) -> bool {
        self.spec.mode == Mode::Drift
    }

    fn endpoints(&self) -> Vec<crate::Endpoint> {
        let m = self
            .module
            .iter()
            .map(|r| crate::Endpoint::Registry { field: "module", name: r.registry.clone() });
        let p = self
            .providers
            .iter()
            .map(|r| crate::Endpoint::Registry { field: "providers", name: r.registry.clone() });
        m.chain(p).collect()
    }

    fn state_workspace(&self) -> Option<String> {
        Some(self.spec.workspace.clone())
    }

    fn names_provider_mirror(&self) -> bool {
        self.providers.is_some()
    }

    fn drift_spec(&self) -> Option<serde_json::Value> {
        (self.spec.mode == Mode::Apply).then(|| {
            let mut spec = self.raw.clone();
            if let Some(o) = spec.as_object_mut() {
                o.insert("mode".into(), "drift".into());
                o.remove("plan_digest");
            }
            spec
        })
    }
}

/// Keep a plan by its digest, with the lock file it was made with: the result names it,
/// so the files and their directory entry are on disk before the job reports success.
fn keep_plan(sealed: &SealedDir, saved: &Path) -> std::io::Result<()> {
    let dir = saved.parent().map(Path::to_path_buf).unwrap_or_default();
    std::fs::create_dir_all(&dir)?;
    let lock = saved_lock(saved);
    std::fs::copy(sealed.path.join(LOCK_FILE), &lock)?;
    std::fs::File::open(&lock)?.sync_all()?;
    std::fs::copy(sealed.path.join(PLAN_FILE), saved)?;
    std::fs::File::open(saved)?.sync_all()?;
    std::fs::File::open(&dir)?.sync_all()
}

/// The lock file kept beside a saved plan.
fn saved_lock(saved: &Path) -> PathBuf {
    saved.with_extension("lock.hcl")
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
            let err = Terraform::from_spec(&spec(bad.clone())).err().map(|e| e.0).unwrap_or_default();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn sensitive_outputs_are_masked() {
        let raw = br#"{"endpoint": {"sensitive": false, "type": "string", "value": "db.example"}, "password": {"sensitive": true, "type": "string", "value": "hunter2-hunter2"}}"#;
        let o = crate::outputs::from_terraform(raw).unwrap_or_default();
        assert_eq!(o["endpoint"], "db.example");
        assert_eq!(o["password"], "***");
    }
}
