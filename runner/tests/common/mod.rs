//! Shared set-up for the end-to-end suites: a reference control plane on a free
//! loopback port and the real `byoc-runner` binary in a temp dir.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use byoc_control_plane::harness::{RunnerOptions, RunnerProcess, wait_polling};
use byoc_control_plane::state::JobState;
use byoc_control_plane::{ControlPlane, ControlPlaneConfig, EnqueueRequest, JobView};

pub const BIN: &str = env!("CARGO_BIN_EXE_byoc-runner");
pub const WAIT: Duration = Duration::from_secs(60);

pub struct Env {
    pub cp: ControlPlane,
    pub runner: RunnerProcess,
    pub dir: tempfile::TempDir,
}

pub async fn start_cp() -> ControlPlane {
    ControlPlane::start(ControlPlaneConfig { offer_timeout: Duration::from_secs(3), ..Default::default() })
        .await
        .expect("control plane starts")
}

pub async fn env_with(opts: RunnerOptions) -> Env {
    let cp = start_cp().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = RunnerProcess::start(Path::new(BIN), dir.path(), &cp, &opts).expect("runner starts");
    assert!(wait_polling(&cp, WAIT).await, "runner never polled; log:\n{}", runner.log());
    Env { cp, runner, dir }
}

pub async fn env() -> Env {
    env_with(RunnerOptions::default()).await
}

pub fn script(s: &str) -> EnqueueRequest {
    EnqueueRequest::new("action.script", serde_json::json!({ "script": s }))
}

impl Env {
    pub async fn finished(&self, job_id: &str) -> JobView {
        match self.cp.wait_for(job_id, WAIT, |v| v.result.is_some()).await {
            Some(v) => v,
            None => panic!(
                "job {job_id} did not finish: {:?}\nrunner log:\n{}",
                self.cp.job(job_id),
                self.runner.log()
            ),
        }
    }

    pub async fn rejected(&self, job_id: &str) -> JobView {
        match self.cp.wait_for(job_id, WAIT, |v| !v.rejections.is_empty()).await {
            Some(v) => v,
            None => panic!(
                "job {job_id} was not rejected: {:?}\nrunner log:\n{}",
                self.cp.job(job_id),
                self.runner.log()
            ),
        }
    }

    pub async fn state(&self, job_id: &str, state: JobState) -> JobView {
        match self.cp.wait_for(job_id, WAIT, |v| v.state == state).await {
            Some(v) => v,
            None => panic!(
                "job {job_id} never reached {state:?}: {:?}\nrunner log:\n{}",
                self.cp.job(job_id),
                self.runner.log()
            ),
        }
    }

    /// Wait until the job's uploaded log contains `needle` (woken by each upload).
    pub async fn log_contains(&self, job_id: &str, needle: &str) {
        let found = self
            .cp
            .wait_until(WAIT, |cp| {
                cp.log(job_id).is_some_and(|l| String::from_utf8_lossy(&l).contains(needle))
            })
            .await;
        assert!(found, "job {job_id} never logged {needle:?}; runner log:\n{}", self.runner.log());
    }

    pub fn cli_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--output", "json"]);
        let out = self.runner.cli(&all);
        assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("CLI prints JSON")
    }
}

/// A runner started with a systemd notification socket, so tests can wait for its
/// state changes (READY=1, STOPPING=1) as systemd would.
pub async fn env_with_notify() -> (Env, tokio::net::UnixDatagram) {
    let sock_dir = tempfile::tempdir().unwrap();
    let path = sock_dir.path().join("notify.sock");
    let sock = tokio::net::UnixDatagram::bind(&path).unwrap();
    let opts = RunnerOptions {
        env: vec![("NOTIFY_SOCKET".into(), path.display().to_string())],
        ..Default::default()
    };
    let e = env_with(opts).await;
    // Keep the socket's directory alive as long as the runner's temp dir.
    std::mem::forget(sock_dir);
    (e, sock)
}

/// Wait for a notification containing `needle` (e.g. "STOPPING=1").
pub async fn wait_notify(sock: &tokio::net::UnixDatagram, needle: &str) {
    let mut buf = vec![0u8; 4096];
    loop {
        let n = tokio::time::timeout(WAIT, sock.recv(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no {needle} notification"))
            .unwrap();
        if String::from_utf8_lossy(&buf[..n]).contains(needle) {
            return;
        }
    }
}

/// Wait until the runner's log contains `needle` (its own progress report).
pub async fn wait_log(runner: &RunnerProcess, needle: &str, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if runner.log().contains(needle) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// True when the process exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}
