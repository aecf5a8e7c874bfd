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
}

impl RunLocalError {
    /// Invalid input is a usage error (EX_USAGE / EX_DATAERR territory).
    pub fn is_usage(&self) -> bool {
        !matches!(self, RunLocalError::WorkDir(_))
    }
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

/// Run the job; output goes to stdout unless `capture` is given.
pub async fn run(
    job: &LocalJob,
    exec: &dyn byoc_job_executors::Executor,
    capture: Option<&mut Vec<u8>>,
    sandboxed: bool,
) -> Result<ExecOutcome, RunLocalError> {
    let dir = tempfile::Builder::new().prefix("byoc-run-local-").tempdir().map_err(RunLocalError::WorkDir)?;
    let roots =
        tempfile::Builder::new().prefix("byoc-run-local-root-").tempdir().map_err(RunLocalError::WorkDir)?;
    let sandbox = if sandboxed { Some(local_sandbox(roots.path())?) } else { None };
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    // Ctrl-C cancels the job the way the control plane would (interrupt → kill).
    let ctrl_c = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            c.cancel();
        }
    });
    let mut stdout = Stdout;
    let output: &mut dyn OutputSink = match capture {
        Some(buf) => buf,
        None => &mut stdout,
    };
    let ctx = ExecContext {
        job_id: "local".into(),
        work_dir: dir.path().to_path_buf(),
        timeout: Duration::from_secs(job.timeout_secs),
        kill_grace: Duration::from_secs(5),
        cancel,
        output,
        sandbox,
        containers: Some(byoc_job_executors::ContainerSettings {
            docker_socket: PathBuf::from("/var/run/docker.sock"),
            memory_bytes: 2048 << 20,
            pids: 1024,
            uid: 65534,
            gid: 65534,
            busybox: PathBuf::from("/bin/busybox"),
            network: Default::default(),
            owner: "local".into(),
        }),
        credentials: None,
        oci: Default::default(),
        audit: None,
        tools: Default::default(),
        policy: None,
    };
    let outcome = byoc_job_executors::run_masked(exec, ctx).await;
    ctrl_c.abort();
    Ok(outcome)
}

/// Process exit code for a local run, following shell conventions.
pub fn exit_code(o: &ExecOutcome) -> i32 {
    match o.status {
        JobStatus::Succeeded => 0,
        JobStatus::TimedOut => 124,
        JobStatus::Cancelled => 130,
        JobStatus::Failed | JobStatus::Interrupted => match o.exit_code {
            Some(c) if (1..=255).contains(&c) => c,
            _ => 1,
        },
    }
}
