//! Executors: the code that turns a verified, claimed job into work on the host.
//!
//! The pipeline only sees [`Executor`]: it hands over an [`ExecContext`] (working
//! directory, deadline, cancellation, output sink) and gets an [`ExecOutcome`] back.
//! The sandbox (a later stage) wraps process executors without changing this interface.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

pub use byoc_protocol::JobStatus;
pub use context::{ExecContext, ExecSettings};

pub mod artifact;
pub mod aws_sign;
mod cluster;
pub mod container;
pub mod context;
pub mod dns;
pub mod eks;
pub mod helm;
pub mod job_files;
pub mod jobnet;
pub mod kubernetes;
pub mod mask;
pub mod noop;
pub mod oci;
pub mod outputs;
pub mod policy_gate;
pub mod process;
pub mod runner_update;
pub mod sandboxed;
pub mod script;
pub mod secrets;
pub mod terraform;
pub mod tool;

/// Where job output goes (the runner's on-disk spool). Writes are small and local.
pub trait OutputSink: Send {
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()>;
}

impl OutputSink for Vec<u8> {
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        self.extend_from_slice(chunk);
        Ok(())
    }
}

/// How to sandbox process executors. `None` in [`ExecContext::sandbox`] runs them
/// unsandboxed (unit tests; `run-local --no-sandbox`).
#[derive(Debug, Clone)]
pub struct SandboxSettings {
    /// The helper program and its arguments (`byoc-runner sandbox-exec`).
    pub helper: PathBuf,
    pub helper_args: Vec<String>,
    /// Where per-job empty root mount points are created.
    pub roots_dir: PathBuf,
    pub limits: byoc_sandbox::cgroup::Limits,
    /// Whether to create per-job cgroups at all.
    pub cgroups: bool,
    pub tmp_size_mib: u64,
    pub nofile: u64,
    pub ro_paths: Vec<PathBuf>,
    pub hidden_paths: Vec<PathBuf>,
    pub host_uid: u32,
    pub host_gid: u32,
    /// The network boundary of networked jobs (`[sandbox.egress]`).
    pub network: jobnet::NetworkSettings,
    /// Refuse a job whose cgroup limits cannot be applied (`sandbox.require_limits`).
    pub require_limits: bool,
}

/// How `action.container` reaches the Docker Engine, and the limits it applies.
#[derive(Debug, Clone)]
pub struct ContainerSettings {
    pub docker_socket: PathBuf,
    pub memory_bytes: u64,
    pub pids: u64,
    /// Host uid/gid the container's process runs as.
    pub uid: u32,
    pub gid: u32,
    /// A static busybox: it holds a networked container's namespace and sets the
    /// blocking rules there (`roles.busybox`).
    pub busybox: PathBuf,
    /// The same egress settings as the process sandbox's.
    pub network: jobnet::NetworkSettings,
    /// Labels this runner's containers and networks (its runner id), so that a
    /// restart removes what it left and nothing else.
    pub owner: String,
    /// Make the next networked container's namespace while nothing waits for it (the
    /// daemon; `release_prepared` at its stop). Off for one-shot commands.
    pub prepare_networks: bool,
}

/// Where `oci.sync` finds registries and how hard it pushes.
#[derive(Debug, Clone)]
pub struct OciSettings {
    /// Registry host → base URL (a private endpoint; in tests, ECR's host mapped to a
    /// local registry), reached as configured. Unlisted hosts: HTTPS only, and never on
    /// a loopback, link-local, metadata or host address (`byoc_oci_sync::reach`).
    pub registry_endpoints: std::collections::BTreeMap<String, String>,
    /// Blobs copied at once.
    pub parallel: usize,
    /// Bytes per upload chunk.
    pub chunk_size: u64,
    /// Extra CA roots (PEM) for registries (the runner's `control_plane.ca_bundle`).
    pub ca_bundle: Option<std::path::PathBuf>,
}

impl OciSettings {
    /// Where the runner may connect for a job's registries: the configured endpoints (by
    /// name and by URL) as configured, anything else by the job rule.
    pub fn reach(&self) -> byoc_oci_sync::Reach {
        byoc_oci_sync::Reach::guarded(
            self.registry_endpoints.iter().flat_map(|(k, v)| [k.as_str(), v.as_str()]),
        )
    }

    /// The client for a job's registries (the customer's CA bundle, the job rule).
    pub fn http(&self) -> Result<byoc_oci_sync::client::Http, byoc_oci_sync::SyncError> {
        byoc_oci_sync::Registry::http_client_for(self.ca_bundle.as_deref(), self.reach())
    }
}

impl Default for OciSettings {
    fn default() -> Self {
        OciSettings {
            registry_endpoints: Default::default(),
            parallel: 4,
            chunk_size: 64 << 20,
            ca_bundle: None,
        }
    }
}

/// Where `terraform` and `helm` jobs find their tools (absolute paths, visible inside
/// the sandbox: under /usr or a `sandbox.extra_ro_paths` directory) and keep saved plans.
/// The runner's own directories beside a job's working directory (never inside it,
/// where the job's processes write): the sealed plan, the terraform tree and data
/// directory, an artifact unpacked without a cache. Removed with the working directory.
pub const BESIDE_WORK: &[&str] = &[".sealed", ".tf", ".tfdata", ".render", ".old", ".artifact"];

/// `<work><suffix>`: a runner directory beside the job's working directory.
pub fn beside_work(work: &std::path::Path, suffix: &str) -> PathBuf {
    let mut p = work.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

#[derive(Debug, Clone)]
pub struct ToolSettings {
    pub terraform: PathBuf,
    pub helm: PathBuf,
    /// Saved plans of plan-only jobs, by workspace and digest (the runner's state dir).
    pub plans_dir: PathBuf,
    /// A saved plan older than this is stale and refused.
    pub plan_max_age: Duration,
    /// The customer's terraform CLI configuration (provider installation): read by the
    /// runner, a read-only copy given to every terraform step.
    pub cli_config_file: Option<PathBuf>,
    /// Jobs may name their own provider mirror (`providers`), which replaces the
    /// customer's CLI configuration for that job.
    pub job_provider_mirrors: bool,
    /// The customer's `terraform.plugin_cache_dir`: no longer used (a cache every job's
    /// init writes), said so in the job's log.
    pub plugin_cache_dir: Option<PathBuf>,
    /// Components fetched by digest: where they are cached, and the unpacking limits.
    pub artifacts: artifact::CacheSettings,
    /// Where components by digest come from (the install's registry, on a runner).
    pub artifact_source: artifact::ArtifactSource,
    /// Where terraform state lives (the customer's bucket, or local on the runner).
    pub state: terraform::state::StateSettings,
}

impl Default for ToolSettings {
    fn default() -> Self {
        ToolSettings {
            terraform: PathBuf::from("/usr/bin/terraform"),
            helm: PathBuf::from("/usr/bin/helm"),
            plans_dir: PathBuf::from("/var/lib/byoc-runner/plans"),
            plan_max_age: Duration::from_secs(3600),
            cli_config_file: None,
            job_provider_mirrors: true,
            plugin_cache_dir: None,
            artifacts: artifact::CacheSettings::default(),
            artifact_source: artifact::ArtifactSource::default(),
            state: terraform::state::StateSettings::default(),
        }
    }
}

/// What policy decisions of this job are made with: every policy that applies (built-in
/// pack at the customer's levels, the vendor's from the signed app config, the
/// customer's own) and the job's place in the lifecycle.
#[derive(Debug, Clone)]
pub struct JobPolicies {
    pub policies: Vec<byoc_policy::Policy>,
    pub params: serde_json::Value,
    /// The role type the job runs under (provision, maintenance, …; `none` without one).
    pub phase: String,
    pub operation: String,
    pub install: String,
    pub limits: byoc_policy::Limits,
    /// Evaluate in a separate process with a hard memory limit (`None`: in-process,
    /// bounded by time and input size only).
    pub evaluator: Option<Evaluator>,
    /// The app's admission policies for the cluster (`kubernetes_cluster`, Kyverno):
    /// (name, YAML). Kubernetes jobs apply them; a sandbox's deprovision removes them.
    pub cluster_policies: Vec<(String, String)>,
    /// `input.byoc.context`: the guardrails as the job was admitted (see
    /// `byoc_policy::Context::context`).
    pub context: serde_json::Value,
}

/// The separate evaluator: `program args… --memory-mib N`, an `EvalRequest` on stdin,
/// the decision as JSON on stdout.
#[derive(Debug, Clone)]
pub struct Evaluator {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub memory_mib: u64,
}

impl JobPolicies {
    /// Decide about `input` (a plan's JSON). Whatever goes wrong denies, with the reason.
    pub async fn decide(&self, ctx: byoc_policy::Context, input: &[u8]) -> byoc_policy::Decision {
        let Ok(text) = std::str::from_utf8(input) else {
            return byoc_policy::denied(&self.policies, input, "(input)", "input is not UTF-8 JSON".into());
        };
        let req = byoc_policy::EvalRequest {
            policies: self.policies.clone(),
            params: self.params.clone(),
            context: ctx,
            input: text.to_string(),
            time_per_policy_ms: self.limits.time_per_policy.as_millis() as u64,
            max_input_bytes: self.limits.max_input_bytes,
        };
        let Some(ev) = &self.evaluator else {
            return tokio::task::spawn_blocking(move || req.evaluate()).await.unwrap_or_else(|e| {
                byoc_policy::denied(&self.policies, input, "(evaluator)", format!("evaluation failed: {e}"))
            });
        };
        match run_evaluator(ev, &req, self.limits.time_per_policy * (self.policies.len() as u32 + 1)).await {
            Ok(d) => d,
            Err(e) => byoc_policy::denied(&self.policies, input, "(evaluator)", e.to_string()),
        }
    }
}

/// Why the evaluator process gave no decision (the job's decision is then a denial).
#[derive(Debug, thiserror::Error)]
pub enum EvaluatorError {
    #[error("encoding the request: {0}")]
    Encode(serde_json::Error),
    #[error("starting the policy evaluator {program}: {source}")]
    Start { program: PathBuf, source: std::io::Error },
    #[error("the policy evaluator ran longer than {secs}s and was stopped")]
    Timeout { secs: u64 },
    #[error("waiting for the policy evaluator: {0}")]
    Wait(std::io::Error),
    #[error(
        "the policy evaluator ended without a decision ({status}): it exceeded its {memory_mib} MiB memory limit or failed{}",
        if last_line.is_empty() { String::new() } else { format!(" ({last_line})") }
    )]
    NoDecision { status: std::process::ExitStatus, memory_mib: u64, last_line: String },
    #[error("the policy evaluator's answer: {0}")]
    Answer(serde_json::Error),
}

async fn run_evaluator(
    ev: &Evaluator,
    req: &byoc_policy::EvalRequest,
    budget: Duration,
) -> Result<byoc_policy::Decision, EvaluatorError> {
    use tokio::io::AsyncWriteExt as _;
    let body = serde_json::to_vec(req).map_err(EvaluatorError::Encode)?;
    let mut child = tokio::process::Command::new(&ev.program)
        .args(&ev.args)
        .arg("--memory-mib")
        .arg(ev.memory_mib.to_string())
        .env_clear()
        // Fewer malloc arenas: the address-space limit is about data, not reservations.
        .env("MALLOC_ARENA_MAX", "2")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| EvaluatorError::Start { program: ev.program.clone(), source })?;
    let stdin = child.stdin.take();
    let writer = async move {
        if let Some(mut stdin) = stdin {
            let _ = stdin.write_all(&body).await;
        }
    };
    let (_, out) = tokio::join!(writer, tokio::time::timeout(budget, child.wait_with_output()));
    let out =
        out.map_err(|_| EvaluatorError::Timeout { secs: budget.as_secs() })?.map_err(EvaluatorError::Wait)?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last_line = stderr.lines().last().unwrap_or("").chars().take(200).collect::<String>();
        return Err(EvaluatorError::NoDecision { status: out.status, memory_mib: ev.memory_mib, last_line });
    }
    serde_json::from_slice(&out.stdout).map_err(EvaluatorError::Answer)
}

/// Audit records an executor makes itself (the runner fills in job, kind, operation
/// and role). Never secrets: names, codes, references and digests.
pub trait JobAudit: Send + Sync {
    fn record(
        &self,
        event: &str,
        detail: String,
        digests: std::collections::BTreeMap<String, String>,
    ) -> Result<(), AuditFailed>;
}

/// The audit log did not take a record (the executor logs it; a decision it could not
/// record is not acted on).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the audit log did not take the record: {0}")]
pub struct AuditFailed(pub String);

/// How a job reaches its role's credentials. Both forms' secrets are in `feed`, so
/// they are masked wherever the job's output goes.
#[derive(Clone)]
pub struct JobCredentials {
    /// For sandboxed process jobs: the environment naming the credential endpoint in
    /// the job's own namespace (`AWS_CONTAINER_CREDENTIALS_FULL_URI` + token) ...
    pub endpoint_env: Vec<(String, String)>,
    /// ... and what serves it there, renewing the session as it nears expiry.
    pub endpoint: Option<std::sync::Arc<dyn jobnet::CredentialEndpoint>>,
    /// The session as of the job's start as `AWS_*` keys: for executors that run in
    /// the daemon (artifact sync, EKS tokens), and for containers when no renewable
    /// file session could be set up.
    pub static_env: Vec<(String, String)>,
    /// For containers (which cannot reach the host's loopback): a renewed credentials
    /// file behind an AWS config file's `credential_process`.
    pub container: Option<ContainerCredentials>,
    /// Every credential secret handed out so far, growing on refresh.
    pub feed: mask::SecretFeed,
    /// `Some`: the endpoint serves a read-only session until the executor opens this,
    /// once the customer's controls allowed exactly what the job will do (docs/ROLES.md,
    /// "Read-only until decided"); `None`: the role's session from the start.
    pub full_session: Option<FullSession>,
}

/// The switch from a job's read-only session to its role's full session: opened by the
/// executor right before it acts on an allowed decision, never closed again.
#[derive(Debug, Clone, Default)]
pub struct FullSession(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl FullSession {
    pub fn open(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    pub fn is_open(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The decision allowed what the job will do: from now on its credential endpoint
/// serves the role's full session (audited `role_session_opened` with `subject`, the
/// digest decided on). Nothing to do for a job whose session was never narrowed.
pub(crate) fn open_full_session(ctx: &mut ExecContext<'_>, subject: &str) -> Result<(), ExecOutcome> {
    let Some(full) = ctx.settings.credentials.as_ref().and_then(|c| c.full_session.clone()) else {
        return Ok(());
    };
    if full.is_open() {
        return Ok(());
    }
    // A widening nobody can see afterwards is not done.
    if let Some(a) = &ctx.settings.audit {
        a.record(
            "role_session_opened",
            "the decision allowed the plan: the job's role session is no longer read-only".into(),
            std::collections::BTreeMap::from([("plan".to_string(), subject.to_string())]),
        )
        .map_err(|e| ExecOutcome::failed(format!("opening the role's full session: {e}")))?;
    }
    full.open();
    let _ =
        ctx.output.write(b"[runner] the plan is allowed: the job's role session is no longer read-only\n");
    Ok(())
}

/// Mounts and environment that give a container its renewable role session.
#[derive(Debug, Clone)]
pub struct ContainerCredentials {
    /// Host directory (`config`, `credentials.json`) mounted read-only at `mount`.
    pub host_dir: std::path::PathBuf,
    pub mount: String,
    /// A static busybox mounted read-only at `busybox_mount`; the config's
    /// `credential_process` runs it.
    pub busybox: std::path::PathBuf,
    pub busybox_mount: String,
    /// `AWS_CONFIG_FILE` and the role's non-secret variables (region, role name).
    pub env: Vec<(String, String)>,
}

impl std::fmt::Debug for JobCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names only: values are secrets.
        let names: Vec<&str> =
            self.endpoint_env.iter().chain(&self.static_env).map(|(k, _)| k.as_str()).collect();
        f.debug_struct("JobCredentials").field("env", &names).finish()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ExecOutcome {
    pub status: JobStatus,
    pub exit_code: Option<i32>,
    pub error: Option<String>,
    pub outputs: serde_json::Value,
}

impl ExecOutcome {
    pub fn failed(error: impl Into<String>) -> Self {
        ExecOutcome {
            status: JobStatus::Failed,
            exit_code: None,
            error: Some(error.into()),
            outputs: serde_json::Value::Null,
        }
    }
}

pub type ExecFuture<'a> = Pin<Box<dyn Future<Output = ExecOutcome> + Send + 'a>>;

/// Where a job's code runs, and with which network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// In the runner itself (noop, artifact sync, kubernetes API calls): no job code
    /// runs on the host.
    InRunner,
    /// The process sandbox; `network`: egress through the user-mode stack, else an
    /// offline namespace.
    Sandbox { network: bool },
    /// A container through the Docker Engine.
    Container { network: bool },
}

/// Why a job cannot be taken here and now, with what to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// `sandbox_network_unavailable`
    NetworkUnavailable(String),
    /// `sandbox_limits_unavailable`
    LimitsUnavailable(String),
    /// `container_output_unavailable`
    OutputUnavailable(String),
}

/// Check, before a job is claimed, that its sandbox can be built as documented: the
/// network boundary for networked jobs, the cgroup limits unless the customer opted
/// out, a container's output relay. (With the sandbox switched off by configuration
/// there is nothing to build.)
pub fn refusal(
    placement: Placement,
    sandbox: Option<&SandboxSettings>,
    containers: Option<&ContainerSettings>,
) -> Option<Refusal> {
    match placement {
        Placement::InRunner => None,
        Placement::Sandbox { network } => {
            let s = sandbox?;
            if network && let Err(why) = jobnet::check_available(&s.network) {
                return Some(Refusal::NetworkUnavailable(why.0));
            }
            if s.cgroups && s.require_limits && byoc_sandbox::cgroup::detect().is_none() {
                return Some(Refusal::LimitsUnavailable(
                    "no usable cgroup hierarchy (cgroup v2 with the memory controller, or v1 memory and pids); \
                     fix the delegation (the packaged unit has Delegate=yes) or set sandbox.require_limits = false"
                        .into(),
                ));
            }
            None
        }
        Placement::Container { network } => {
            let c = containers?;
            if network && let Err(why) = container::check_network(c) {
                return Some(Refusal::NetworkUnavailable(why.0));
            }
            container::check_output(c).err().map(Refusal::OutputUnavailable)
        }
    }
}

/// The one line a job's log and its `started` record carry about its network.
pub fn describe_network(
    placement: Placement,
    sandbox: Option<&SandboxSettings>,
    containers: Option<&ContainerSettings>,
) -> String {
    match placement {
        Placement::InRunner => jobnet::describe(jobnet::NetworkUse::InRunner, &Default::default()),
        Placement::Sandbox { network } => match sandbox {
            None => "network: the host's (the sandbox is disabled by configuration)".into(),
            Some(s) => jobnet::describe(
                if network { jobnet::NetworkUse::UserMode } else { jobnet::NetworkUse::Offline },
                &s.network,
            ),
        },
        Placement::Container { network: false } => "network: none (container without a network)".into(),
        Placement::Container { network: true } => match containers {
            Some(c) => container::describe_network(c),
            None => "network: none (container actions are disabled)".into(),
        },
    }
}

pub trait Executor: Send + Sync {
    fn run<'a>(&'a self, ctx: ExecContext<'a>) -> ExecFuture<'a>;

    /// What the job does, derived from its kind and spec (never a label the vendor
    /// chose): its operation must be one the effect may run as, and the customer's rules
    /// can match it.
    fn effect(&self) -> byoc_protocol::Effect;

    /// Where its code runs (default: in the runner, no job code on the host).
    fn placement(&self) -> Placement {
        Placement::InRunner
    }

    /// Values this job marks secret: masked in its output, error and outputs.
    fn secrets(&self) -> Vec<Vec<u8>> {
        Vec::new()
    }

    /// The customer's secrets this job names and where it would put them: the runner
    /// refuses the job (`secret_target_not_declared`) unless the app config declares
    /// each (docs/SECRETS.md).
    fn secret_uses(&self) -> Vec<secrets::SecretUse> {
        Vec::new()
    }

    /// A drift check: it reads and judges, and changes nothing (docs/DRIFT.md). Only
    /// such a job may run as operation `component.drift`, which the customer's window
    /// and approval rules can treat apart from deploys.
    fn is_drift_check(&self) -> bool {
        false
    }

    /// What the runner itself will connect to for this job (cluster API servers,
    /// registries), each with the spec field that named it: checked before the claim
    /// ([`endpoint_refusal`]) and again when the connection is made.
    fn endpoints(&self) -> Vec<Endpoint> {
        Vec::new()
    }

    /// The terraform workspace whose local state this job may change (the runner
    /// journals it before the job starts, to keep that state after a crash).
    fn state_workspace(&self) -> Option<String> {
        None
    }

    /// For a deploy: the spec of a drift check of what it deploys (the same module,
    /// manifests or release, `mode`/`action = "drift"`), which the runner keeps to check
    /// the component on its own schedule. `None` for anything else.
    fn drift_spec(&self) -> Option<serde_json::Value> {
        None
    }

    /// A terraform job that brings its own provider mirror (the customer's
    /// `job_provider_mirrors` decides, before the claim).
    fn names_provider_mirror(&self) -> bool {
        false
    }

    /// A `runner.update`: what it asks, for the customer's terms (checked before the claim).
    fn runner_update(&self) -> Option<&runner_update::UpdateAsk> {
        None
    }
}

/// Something the runner connects to on a job's behalf.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A Kubernetes API server.
    Cluster { field: &'static str, url: url::Url },
    /// A registry, as references name it (`host[:port]`).
    Registry { field: &'static str, name: String },
}

/// The first endpoint of a job's the runner will not connect to (`invalid_spec` before
/// the claim): plain HTTP, or a loopback, link-local, metadata or host address that the
/// customer's configuration does not name (`byoc_oci_sync::reach`).
pub fn endpoint_refusal(
    exec: &dyn Executor,
    registries: &byoc_oci_sync::Reach,
    clusters: &byoc_oci_sync::Reach,
) -> Option<String> {
    exec.endpoints().into_iter().find_map(|e| {
        let (field, r) = match &e {
            Endpoint::Cluster { field, url } => (*field, clusters.check_url(url)),
            Endpoint::Registry { field, name } => (*field, registries.check_registry(name)),
        };
        r.err().map(|why| format!("{field}: {why}"))
    })
}

/// The operation `component.drift` is for drift checks, and drift checks run under it:
/// otherwise a deploy could pass as a check past rules written for deploys.
pub fn check_drift_operation(
    entity: &str,
    operation: &str,
    executor: &dyn Executor,
) -> Result<(), DriftOperationMismatch> {
    match (entity == "component" && operation == "drift", executor.is_drift_check()) {
        (true, false) => Err(DriftOperationMismatch::NotACheck),
        (false, true) => Err(DriftOperationMismatch::CheckUnder(format!("{entity}.{operation}"))),
        _ => Ok(()),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriftOperationMismatch {
    #[error(
        "operation component.drift is a check that changes nothing: only a drift check (terraform mode = \"drift\", kubernetes or helm action = \"drift\") may run as it"
    )]
    NotACheck,
    #[error("a drift check runs as operation component.drift, not {0}")]
    CheckUnder(String),
}

/// Put the job's role credentials into `env` (their names win over the job's own):
/// in the sandbox, the endpoint served inside the job's namespace; with the sandbox
/// switched off, the session's keys as of now (no renewal), said in the job's log.
pub(crate) fn add_role_env(ctx: &mut ExecContext<'_>, env: &mut Vec<(String, String)>, network: bool) {
    let Some(creds) = &ctx.settings.credentials else { return };
    let role_env = match (&ctx.settings.sandbox, network) {
        (Some(_), true) => creds.endpoint_env.clone(),
        (Some(_), false) => {
            let _ = ctx.output.write(
                b"[runner] network = false: the job's role credentials are not reachable without a network\n",
            );
            return;
        }
        (None, _) => {
            let _ = ctx.output.write(
                b"[runner] the sandbox is disabled by configuration: the job gets its role session's keys, not renewed\n",
            );
            creds.static_env.clone()
        }
    };
    env.retain(|(k, _)| !role_env.iter().any(|(n, _)| n == k));
    env.extend(role_env);
}

/// A job spec, or a value in it, that cannot be run as written: what is wrong with it
/// (the runner refuses the job with `invalid_spec` and this message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidSpec(pub String);

impl From<String> for InvalidSpec {
    fn from(s: String) -> Self {
        InvalidSpec(s)
    }
}

impl From<&str> for InvalidSpec {
    fn from(s: &str) -> Self {
        InvalidSpec(s.to_string())
    }
}

impl From<byoc_oci_sync::reference::InvalidReference> for InvalidSpec {
    fn from(e: byoc_oci_sync::reference::InvalidReference) -> Self {
        InvalidSpec(e.0)
    }
}

/// Serde default for switches that are on unless a spec turns them off (network).
pub(crate) fn default_true() -> bool {
    true
}

/// Check a job's declared environment: valid names, no name in both maps, secret values
/// long enough to mask.
pub fn validate_env(
    env: &std::collections::BTreeMap<String, String>,
    secret_env: &std::collections::BTreeMap<String, String>,
) -> Result<(), InvalidSpec> {
    for (name, value) in secret_env {
        if value.len() < mask::MIN_SECRET_LEN {
            return Err(InvalidSpec::from(format!(
                "secret_env {name}: values shorter than {} bytes cannot be masked reliably",
                mask::MIN_SECRET_LEN
            )));
        }
        if env.contains_key(name) {
            return Err(InvalidSpec::from(format!("{name} is in both env and secret_env")));
        }
    }
    for name in env.keys().chain(secret_env.keys()) {
        let valid = !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(InvalidSpec::from(format!("environment variable name {name:?} is not valid")));
        }
    }
    Ok(())
}

/// Run an executor with its secrets masked everywhere its output goes: the log stream
/// (before the sink sees a byte), the error text and the outputs.
pub async fn run_masked(exec: &dyn Executor, ctx: ExecContext<'_>) -> ExecOutcome {
    let (settings, output) = ctx.split();
    let feed = settings.credentials.as_ref().map(|c| c.feed.clone()).unwrap_or_default();
    let mut sink = match mask::MaskingSink::with_feed(exec.secrets(), feed, output) {
        Ok(s) => s,
        Err(e) => return ExecOutcome::failed(e.to_string()),
    };
    let inner = settings.build(&mut sink);
    let mut outcome = exec.run(inner).await;
    let masker = match sink.current_masker() {
        Ok(m) => m,
        Err(e) => {
            return ExecOutcome::failed(format!(
                "the job's output could not be masked: {e}; its outputs are withheld"
            ));
        }
    };
    if let Err(e) = sink.flush_end() {
        outcome = ExecOutcome { error: Some(format!("writing job log: {e}")), ..ExecOutcome::failed("") };
    }
    outcome.error = outcome.error.map(|e| masker.mask_str(&e));
    outcome.outputs = mask_json(&masker, outcome.outputs);
    outcome
}

fn mask_json(masker: &mask::Masker, v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::String(s) => Value::String(masker.mask_str(&s)),
        Value::Array(a) => Value::Array(a.into_iter().map(|v| mask_json(masker, v)).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, mask_json(masker, v))).collect()),
        other => other,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("unknown job kind {0:?}")]
    UnknownKind(String),
    #[error("invalid spec for {kind}: {reason}")]
    Invalid { kind: String, reason: String },
}

/// Build the executor for a job kind from its spec. Validation happens here, before
/// the job is claimed, so a bad spec is a rejection rather than a failed run.
pub fn build(kind: &str, spec: &serde_json::Value) -> Result<Box<dyn Executor>, SpecError> {
    use byoc_protocol::JobKind;
    let Some(k) = JobKind::parse(kind) else { return Err(SpecError::UnknownKind(kind.into())) };
    let invalid = |e: InvalidSpec| SpecError::Invalid { kind: kind.into(), reason: e.0 };
    Ok(match k {
        JobKind::Noop => Box::new(noop::Noop::from_spec(spec).map_err(invalid)?),
        JobKind::ActionScript => Box::new(script::Script::from_spec(spec).map_err(invalid)?),
        JobKind::ActionContainer => Box::new(container::Container::from_spec(spec).map_err(invalid)?),
        JobKind::Terraform => Box::new(terraform::Terraform::from_spec(spec).map_err(invalid)?),
        JobKind::Helm => Box::new(helm::Helm::from_spec(spec).map_err(invalid)?),
        JobKind::Kubernetes => Box::new(kubernetes::Kubernetes::from_spec(spec).map_err(invalid)?),
        JobKind::OciSync => Box::new(oci::OciSync::from_spec(spec).map_err(invalid)?),
        JobKind::SecretsSync => Box::new(secrets::sync::SecretsSync::from_spec(spec).map_err(invalid)?),
        JobKind::RunnerUpdate => Box::new(runner_update::RunnerUpdate::from_spec(spec).map_err(invalid)?),
    })
}
