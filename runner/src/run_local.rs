//! `byoc-runner run-local JOB_FILE`: run a job spec with the real executors and no
//! control plane, so vendors can test their actions. Output streams to stdout.
//!
//! Job file (JSON): `{"kind": "action.script", "spec": {...}, "timeout_secs": 600}`.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use byoc_job_executors::{ExecContext, ExecOutcome, JobStatus, OutputSink};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalJob {
    /// What the job shows, and why `run-local` cannot run it where that is so (it needs
    /// the demo's registries, an install's secrets, a provider from the internet):
    /// printed before the job runs, never sent anywhere.
    #[serde(default)]
    pub about: Option<String>,
    pub kind: String,
    #[serde(default)]
    pub spec: serde_json::Value,
    #[serde(default = "default_timeout")]
    pub timeout_secs: u64,
}

fn default_timeout() -> u64 {
    600
}

#[derive(Debug, thiserror::Error)]
pub enum RunLocalError {
    #[error("reading job file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("job file {path} is not a valid job: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("preparing a working directory: {0}")]
    WorkDir(std::io::Error),
    #[error("installing the Ctrl-C handler: {0}")]
    Interrupt(std::io::Error),
}

struct Stdout;

impl OutputSink for Stdout {
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        let mut out = std::io::stdout().lock();
        out.write_all(chunk)?;
        out.flush()
    }
}

pub fn load(path: &Path) -> Result<(LocalJob, Box<dyn byoc_job_executors::Executor>), RunLocalError> {
    let text = std::fs::read(path).map_err(|e| RunLocalError::Read { path: path.into(), source: e })?;
    let invalid = |reason: String| RunLocalError::Invalid { path: path.into(), reason };
    let job: LocalJob = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
    // `${NAME}` placeholders are filled in by whoever ships the file (scripts/demo for
    // examples/jobs); a job must not reach an executor with them.
    let spec = job.spec.to_string();
    if let Some(at) = spec.find("${") {
        let name: String = spec[at..].chars().take_while(|c| *c != '}').chain(std::iter::once('}')).collect();
        return Err(invalid(format!(
            "it holds the placeholder {name}, which scripts/demo fills in (a registry, a digest, a file); replace it{}",
            job.about.as_deref().map(|a| format!(" (about this job: {a})")).unwrap_or_default()
        )));
    }
    if job.timeout_secs == 0 {
        return Err(invalid("timeout_secs must be at least 1".into()));
    }
    let exec = byoc_job_executors::build(&job.kind, &job.spec).map_err(|e| invalid(e.to_string()))?;
    Ok((job, exec))
}

/// Sandbox settings for a local run: the default limits, roots in a temp dir, the
/// runner's default state and config dirs hidden.
pub fn local_sandbox(roots: &Path) -> Result<byoc_job_executors::SandboxSettings, RunLocalError> {
    let helper = std::env::current_exe().map_err(RunLocalError::WorkDir)?;
    Ok(byoc_job_executors::SandboxSettings {
        helper,
        helper_args: vec!["sandbox-exec".into()],
        roots_dir: roots.to_path_buf(),
        limits: byoc_sandbox::cgroup::Limits { memory_bytes: 2048 << 20, pids: 1024, cpu_millis: 2000 },
        cgroups: true,
        tmp_size_mib: 1024,
        nofile: 4096,
        ro_paths: vec![],
        hidden_paths: vec![
            PathBuf::from(crate::config::DEFAULT_STATE_DIR),
            PathBuf::from("/etc/byoc-runner"),
        ],
        host_uid: 65534,
        host_gid: 65534,
        // The same network boundary as on a customer's VM (slirp4netns required).
        network: Default::default(),
        // A vendor's workstation rarely delegates cgroups: run without limits, and
        // the job's log says so.
        require_limits: false,
    })
}

/// How a local run decides and deploys.
pub struct LocalOptions {
    pub sandboxed: bool,
    /// Stop after the policy decision.
    pub decide_only: bool,
    /// The policies terraform, helm and kubernetes jobs are decided with.
    pub policy: Option<byoc_job_executors::JobPolicies>,
    pub terraform: PathBuf,
    pub helm: PathBuf,
    /// terraform state, saved plans and fetched components, kept between local runs.
    pub state_dir: PathBuf,
    /// For components by digest: any registry (there is no install), this credential.
    pub registry_credential: Option<byoc_oci_sync::Credential>,
    pub registry_endpoints: std::collections::BTreeMap<String, String>,
    /// Cluster API servers the job may name on loopback or this machine's addresses.
    pub allowed_cluster_servers: Vec<String>,
    pub ca_bundle: Option<PathBuf>,
}

impl LocalOptions {
    fn oci(&self) -> byoc_job_executors::OciSettings {
        byoc_job_executors::OciSettings {
            registry_endpoints: self.registry_endpoints.clone(),
            ca_bundle: self.ca_bundle.clone(),
            ..Default::default()
        }
    }

    fn cluster_reach(&self) -> byoc_oci_sync::Reach {
        byoc_oci_sync::Reach::guarded(&self.allowed_cluster_servers)
    }
}

/// The runner's rule for what a job may make it connect to, as a daemon applies it
/// before the claim: refused here before anything runs.
pub fn check_endpoints(
    path: &Path,
    exec: &dyn byoc_job_executors::Executor,
    options: &LocalOptions,
) -> Result<(), RunLocalError> {
    match byoc_job_executors::endpoint_refusal(exec, &options.oci().reach(), &options.cluster_reach()) {
        Some(reason) => Err(RunLocalError::Invalid { path: path.into(), reason }),
        None => Ok(()),
    }
}

/// Run the job; output goes to stdout unless `capture` is given.
pub async fn run(
    job: &LocalJob,
    exec: &dyn byoc_job_executors::Executor,
    capture: Option<&mut Vec<u8>>,
    options: &LocalOptions,
) -> Result<ExecOutcome, RunLocalError> {
    let dir = tempfile::Builder::new().prefix("byoc-run-local-").tempdir().map_err(RunLocalError::WorkDir)?;
    let roots =
        tempfile::Builder::new().prefix("byoc-run-local-root-").tempdir().map_err(RunLocalError::WorkDir)?;
    let mut sandbox = if options.sandboxed { Some(local_sandbox(roots.path())?) } else { None };
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    // Ctrl-C cancels the job the way the control plane would (interrupt → kill). The
    // handler is in place before the job starts: a Ctrl-C at its first line cancels it.
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(RunLocalError::Interrupt)?;
    let ctrl_c = tokio::spawn(async move {
        if interrupt.recv().await.is_some() {
            c.cancel();
        }
    });
    let mut stdout = Stdout;
    let output: &mut dyn OutputSink = match capture {
        Some(buf) => buf,
        None => &mut stdout,
    };
    let containers = byoc_job_executors::ContainerSettings {
        docker_socket: PathBuf::from("/var/run/docker.sock"),
        memory_bytes: 2048 << 20,
        pids: 1024,
        uid: 65534,
        gid: 65534,
        busybox: PathBuf::from("/bin/busybox"),
        network: Default::default(),
        owner: "local".into(),
        prepare_networks: false,
    };
    let mut tools = byoc_job_executors::ToolSettings {
        terraform: options.terraform.clone(),
        helm: options.helm.clone(),
        plans_dir: crate::state_dir::StateDir::of(&options.state_dir).plans(),
        artifacts: byoc_job_executors::artifact::CacheSettings {
            dir: Some(crate::state_dir::StateDir::of(&options.state_dir).artifacts()),
            ..Default::default()
        },
        artifact_source: byoc_job_executors::artifact::ArtifactSource::AnyRegistry {
            credential: options.registry_credential.clone(),
        },
        ..Default::default()
    };
    tools.state.backend = byoc_job_executors::terraform::state::Backend::Local {
        root: crate::state_dir::StateDir::of(&options.state_dir).tfstate(),
    };
    if let Some(s) = &mut sandbox {
        // The tools must be visible inside the sandbox wherever they are installed.
        for tool in [&options.terraform, &options.helm] {
            if let Some(dir) = tool.parent().filter(|d| d.is_absolute() && !d.starts_with("/usr")) {
                s.ro_paths.push(dir.to_path_buf());
            }
        }
    }
    // Its own name: concurrent local runs must not share a cgroup (the end of one would
    // kill the other's processes).
    let job_id = format!("local-{}", byoc_protocol::random_hex(4));
    let ctx = ExecContext::builder(job_id, dir.path())
        .timeout(Duration::from_secs(job.timeout_secs), Duration::from_secs(5))
        .cancel(cancel)
        .isolation(sandbox, Some(containers))
        .oci(options.oci())
        .cluster_reach(options.cluster_reach())
        .tools(tools)
        .policy(options.policy.clone())
        .decide_only(options.decide_only)
        .build(output);
    let outcome = byoc_job_executors::run_masked(exec, ctx).await;
    byoc_job_executors::sandboxed::settle().await;
    ctrl_c.abort();
    Ok(outcome)
}

/// Process exit code for a local run, following shell conventions.
/// `run-local` could not run the job, or the runner stopped it without an exit code of
/// its own (a refusal, a denied plan): 125, as `docker run` reports its own failures.
pub const EXIT_RUNNER: i32 = 125;

pub fn exit_code(o: &ExecOutcome) -> i32 {
    match o.status {
        JobStatus::Succeeded => 0,
        JobStatus::TimedOut => 124,
        JobStatus::Cancelled => 130,
        JobStatus::Failed | JobStatus::Interrupted => match o.exit_code {
            Some(c) if (1..=255).contains(&c) => c,
            _ => EXIT_RUNNER,
        },
    }
}
