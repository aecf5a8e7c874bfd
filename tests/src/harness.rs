//! Starting a real `byoc-runner` process against a control plane: config file, state
//! dir and log file in a temp dir, signals, restarts. Shared by the end-to-end suites,
//! the demo and the benchmark.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::ControlPlane;

/// Settings for a runner under test; `extra` is appended to the config verbatim, with
/// `@RUNNER_DIR@` replaced by the runner's own temporary directory.
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    pub poll_wait_secs: u64,
    pub backoff_initial_ms: u64,
    pub backoff_max_secs: u64,
    pub heartbeat_secs: u64,
    pub drain_grace_secs: u64,
    pub kill_grace_secs: u64,
    pub actions_limit: usize,
    /// Appended to the `[control_plane]` table.
    pub control_plane_extra: String,
    pub extra: String,
    /// Environment for the runner process (e.g. HTTPS_PROXY).
    pub env: Vec<(String, String)>,
    /// Host directories jobs may read inside the sandbox.
    pub sandbox_ro_paths: Vec<PathBuf>,
    /// Appended to the `[sandbox]` table.
    pub sandbox_extra: String,
    /// Appended to the `[jobs]` table.
    pub jobs_extra: String,
    /// A command the runner is started through (it must exec the runner in place, as
    /// `unshare` does), e.g. to give it a mount namespace of its own.
    pub wrap: Vec<String>,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        RunnerOptions {
            poll_wait_secs: 30,
            backoff_initial_ms: 100,
            backoff_max_secs: 2,
            heartbeat_secs: 1,
            drain_grace_secs: 60,
            kill_grace_secs: 2,
            actions_limit: 4,
            control_plane_extra: String::new(),
            extra: String::new(),
            env: Vec::new(),
            sandbox_ro_paths: Vec::new(),
            sandbox_extra: String::new(),
            jobs_extra: String::new(),
            wrap: Vec::new(),
        }
    }
}

pub struct RunnerProcess {
    pub binary: PathBuf,
    pub dir: PathBuf,
    pub state_dir: PathBuf,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    env: Vec<(String, String)>,
    wrap: Vec<String>,
    child: Option<tokio::process::Child>,
}

impl RunnerProcess {
    /// Write a config for `cp` under `dir` and start the daemon with a fresh bootstrap
    /// token.
    pub fn start(
        binary: &Path,
        dir: &Path,
        cp: &ControlPlane,
        opts: &RunnerOptions,
    ) -> std::io::Result<Self> {
        let mut p = Self::prepare(binary, dir, cp, opts)?;
        p.spawn(Some(cp.bootstrap_token()))?;
        Ok(p)
    }

    /// Write the config without starting anything.
    pub fn prepare(
        binary: &Path,
        dir: &Path,
        cp: &ControlPlane,
        opts: &RunnerOptions,
    ) -> std::io::Result<Self> {
        let state_dir = dir.join("state");
        // In a directory of its own: the runner hides its config dir from jobs.
        let config_dir = dir.join("config");
        std::fs::create_dir_all(&config_dir)?;
        let config_path = config_dir.join("runner.toml");
        let config = format!(
            r#"[control_plane]
url = "{url}"
public_keys = ["{key}"]
allow_insecure_loopback = {insecure}
request_timeout_secs = 10
{cp_extra}

[runner]
state_dir = "{state}"
install_id = "{install}"

[poll]
wait_secs = {wait}
backoff_initial_ms = {bi}
backoff_max_secs = {bm}

[jobs]
heartbeat_secs = {hb}
drain_grace_secs = {dg}
kill_grace_secs = {kg}
{jobs_extra}

[jobs.groups]
actions = {al}

[sandbox]
extra_ro_paths = {ro}
{sandbox_extra}

[logging]
target = "stderr"
level = "info"
{extra}"#,
            url = cp.runner_url(),
            insecure = cp.runner_url().starts_with("http://"),
            cp_extra = opts.control_plane_extra,
            key = cp.public_key_b64(),
            state = state_dir.display(),
            install = cp.install_id(),
            wait = opts.poll_wait_secs,
            bi = opts.backoff_initial_ms,
            bm = opts.backoff_max_secs,
            hb = opts.heartbeat_secs,
            dg = opts.drain_grace_secs,
            kg = opts.kill_grace_secs,
            al = opts.actions_limit,
            extra = opts.extra.replace("@RUNNER_DIR@", &dir.display().to_string()),
            ro = serde_json::to_string(&opts.sandbox_ro_paths).unwrap_or_else(|_| "[]".into()),
            sandbox_extra = opts.sandbox_extra,
            jobs_extra = opts.jobs_extra,
        );
        std::fs::write(&config_path, config)?;
        Ok(RunnerProcess {
            binary: binary.to_path_buf(),
            dir: dir.to_path_buf(),
            state_dir,
            config_path,
            log_path: dir.join("runner.log"),
            env: opts.env.clone(),
            wrap: opts.wrap.clone(),
            child: None,
        })
    }

    /// (Re)start the daemon process on the same state dir.
    pub fn spawn(&mut self, bootstrap_token: Option<String>) -> std::io::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log_path)?;
        let mut cmd = match self.wrap.split_first() {
            Some((program, args)) => {
                let mut c = tokio::process::Command::new(program);
                c.args(args).arg(&self.binary);
                c
            }
            None => tokio::process::Command::new(&self.binary),
        };
        cmd.kill_on_drop(true)
            .arg("run")
            .arg("--config")
            .arg(&self.config_path)
            .env_remove("BYOC_RUNNER_BOOTSTRAP_TOKEN")
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("HTTP_PROXY")
            .env_remove("http_proxy")
            .envs(self.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(t) = bootstrap_token {
            cmd.env("BYOC_RUNNER_BOOTSTRAP_TOKEN", t);
        }
        self.child = Some(cmd.spawn()?);
        Ok(())
    }

    /// The environment the runner is started with (also its CLI's and updater's).
    pub fn env(&self) -> &[(String, String)] {
        &self.env
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(|c| c.id())
    }

    pub fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid() {
            let _ = kill(Pid::from_raw(pid as i32), sig);
        }
    }

    /// `kill -9` and reap.
    pub async fn kill9(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let _ = child.start_kill();
        child.wait().await.ok()
    }

    /// Wait for the process to exit on its own, up to `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let status = tokio::time::timeout(timeout, child.wait()).await.ok()?.ok()?;
        self.child = None;
        Some(status)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Run a CLI subcommand of the same binary against this runner's config, with the
    /// runner's environment (e.g. its AWS identity for `roles --refresh`).
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(&self.binary)
            .args(args)
            .arg("--config")
            .arg(&self.config_path)
            .envs(self.env.iter().cloned())
            .output()
            .expect("running the runner CLI")
    }
}

/// Wait until the runner has enrolled and its first poll reached the control plane.
impl Drop for RunnerProcess {
    /// A killed runner cannot remove the container network it made ahead of the next
    /// job (its next start would): the suites remove it, so that the engine's address
    /// pools do not run out over a run.
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
            // Dead before the listing below, so that it makes nothing after it.
            if let Some(pid) = child.id() {
                let _ = nix::sys::wait::waitpid(Pid::from_raw(pid as i32), None);
            }
        }
        if !self.log().contains("container network ahead") {
            return;
        }
        let Ok(enrollment) = std::fs::read(self.state_dir.join("enrollment.json")) else { return };
        let Some(runner_id) = serde_json::from_slice::<serde_json::Value>(&enrollment)
            .ok()
            .and_then(|e| e["runner_id"].as_str().map(str::to_string))
        else {
            return;
        };
        let ids = |what: &[&str]| -> Vec<String> {
            let out = Command::new("docker")
                .args(what)
                .args(["-q", "--filter", &format!("label=byoc-runner.runner={runner_id}")])
                .args(["--filter", "label=byoc-runner.job=prepared"])
                .output();
            out.map(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().map(str::to_string).collect())
                .unwrap_or_default()
        };
        for c in ids(&["ps", "-a"]) {
            let _ = Command::new("docker").args(["rm", "-f", &c]).output();
        }
        for n in ids(&["network", "ls"]) {
            let _ = Command::new("docker").args(["network", "rm", &n]).output();
        }
    }
}

pub async fn wait_polling(cp: &ControlPlane, timeout: Duration) -> bool {
    cp.wait_until(timeout, |cp| cp.runners().iter().any(|r| r.polls > 0)).await
}
