//! A job's path through the runner, one module per stage:
//!
//! `poll → verify → resolve_role → claim → execute → report`
//!
//! Each stage consumes the previous stage's type (`PolledJob → VerifiedJob →
//! ScopedJob → ClaimedJob → FinishedJob`), so no stage can be skipped and still
//! compile. `verify` also derives the job's role with the precedence chain and refuses
//! a proposal that differs; `resolve_role` checks the customer's switches; `execute`
//! assumes the role. Policy authorization slots in before `execute` the same way.

pub mod claim;
pub mod execute;
pub mod poll;
pub mod report;
pub mod resolve_role;
pub mod verify;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::client::CpClient;
use crate::config::Config;
use crate::journal::Journal;

pub use claim::ClaimedJob;
pub use execute::FinishedJob;
pub use poll::PolledJob;
pub use resolve_role::ScopedJob;
pub use verify::{Rejection, VerifiedJob};

/// What every stage may use: shared, read-mostly runner context.
pub struct Runtime {
    pub config: Config,
    pub runner_id: String,
    pub install_id: String,
    pub state_dir: PathBuf,
    pub journal: Journal,
    pub audit: crate::audit::Audit,
    pub client: CpClient,
    /// Cancelled on the second SIGTERM: every running job is cancelled.
    pub abort: CancellationToken,
    /// How process jobs are sandboxed (None: disabled by configuration).
    pub sandbox: Option<byoc_job_executors::SandboxSettings>,
    pub containers: Option<byoc_job_executors::ContainerSettings>,
    /// Lifecycle roles: switches, STS, the credential endpoint.
    pub roles: crate::roles::Roles,
    /// The pause last seen in force (audited when it changes).
    pub pause: std::sync::Mutex<Option<crate::roles::pause::Pause>>,
    /// Cancelled when the daemon stops for good: reporting loops give up (the journal
    /// keeps what was not reported, for the next start).
    pub stop_reporting: CancellationToken,
}

pub type Rt = Arc<Runtime>;

impl Runtime {
    /// Journal a job transition, then audit it; both are fsynced before the caller acts.
    pub fn transition(&self, event: crate::journal::Event) -> Result<(), crate::journal::JournalError> {
        let record = crate::audit::record_for(&event);
        self.journal.append(event)?;
        self.audit.record(record).map_err(|e| crate::journal::JournalError::Audit(e.to_string()))?;
        Ok(())
    }
}

impl Runtime {
    /// The customer's pause as of now. A change since the last look is audited (the
    /// CLI that writes the pause file cannot write the daemon's audit log).
    pub fn check_pause(&self) -> Option<crate::roles::pause::Pause> {
        let now = crate::roles::pause::read(&self.state_dir);
        let mut last = self.pause.lock().unwrap_or_else(|e| e.into_inner());
        if *last != now {
            let record = match &now {
                Some(p) => {
                    tracing::warn!(by = %p.by, reason = p.reason.as_deref().unwrap_or(""), "runner paused by the customer: new jobs are refused");
                    byoc_audit::log::Record {
                        event: "runner_paused".into(),
                        reason: Some("paused".into()),
                        detail: Some(format!(
                            "by {}{}",
                            p.by,
                            p.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
                        )),
                        ..Default::default()
                    }
                }
                None => {
                    tracing::info!("runner resumed by the customer");
                    byoc_audit::log::Record { event: "runner_resumed".into(), ..Default::default() }
                }
            };
            if let Err(e) = self.audit.record(record) {
                tracing::error!(error = %e, "could not audit a pause change");
            } else {
                *last = now.clone();
            }
        }
        now
    }
}

/// The directory under the state dir where per-job sandbox root mount points live.
pub const ROOTS_DIR: &str = "roots";

/// Prove the sandbox can be built here before taking any job.
pub async fn sandbox_self_test(
    settings: &byoc_job_executors::SandboxSettings,
    state_dir: &std::path::Path,
) -> Result<(), String> {
    byoc_job_executors::sandboxed::self_test(settings, &state_dir.join(ROOTS_DIR)).await
}

/// Container settings from the configuration (limits shared with the sandbox).
pub fn container_settings(config: &Config) -> Option<byoc_job_executors::ContainerSettings> {
    let c = &config.containers;
    c.enabled.then(|| byoc_job_executors::ContainerSettings {
        docker_socket: c.docker_socket.clone(),
        memory_bytes: config.sandbox.memory_mib * 1024 * 1024,
        pids: config.sandbox.pids,
        uid: config.sandbox.uid,
        gid: config.sandbox.gid,
        busybox: config.roles.busybox.clone(),
        network: config.sandbox.egress.clone(),
        owner: String::new(),
    })
}

/// Sandbox settings from the configuration: the helper is this very binary.
pub fn sandbox_settings(
    config: &Config,
    helper: std::path::PathBuf,
) -> Option<byoc_job_executors::SandboxSettings> {
    let s = &config.sandbox;
    if !s.enabled {
        return None;
    }
    let state_dir = config.runner.state_dir.clone();
    let mut hidden = vec![state_dir.clone(), PathBuf::from("/etc/byoc-runner")];
    if let Some(dir) = config.source.parent().filter(|d| d.is_absolute()) {
        hidden.push(dir.to_path_buf());
    }
    Some(byoc_job_executors::SandboxSettings {
        helper,
        helper_args: vec!["sandbox-exec".into()],
        roots_dir: state_dir.join(ROOTS_DIR),
        limits: byoc_sandbox::cgroup::Limits {
            memory_bytes: s.memory_mib * 1024 * 1024,
            pids: s.pids,
            cpu_millis: s.cpu_percent * 10,
        },
        cgroups: s.cgroups,
        tmp_size_mib: s.tmp_size_mib,
        nofile: s.nofile,
        ro_paths: s.extra_ro_paths.clone(),
        hidden_paths: hidden,
        host_uid: s.uid,
        host_gid: s.gid,
        network: s.egress.clone(),
        require_limits: s.require_limits,
    })
}

/// Jittered exponential backoff, capped: only used after errors.
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Backoff { initial, max, current: initial }
    }

    pub fn reset(&mut self) {
        self.current = self.initial;
    }

    /// Next delay: uniformly in [current/2, current], then current doubles (capped).
    pub fn next_delay(&mut self) -> Duration {
        let base = self.current;
        self.current = (self.current * 2).min(self.max);
        let half = base / 2;
        half + half.mul_f64(rand::random::<f64>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_caps_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        let delays: Vec<Duration> = (0..6).map(|_| b.next_delay()).collect();
        for (d, cap) in delays.iter().zip([100u64, 200, 400, 800, 800, 800]) {
            assert!(
                *d <= Duration::from_millis(cap) && *d >= Duration::from_millis(cap / 2),
                "{d:?} vs {cap}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
