//! `byoc-runner run`: the daemon. Start-up order matters and is fixed:
//!
//! 1. state dir, identity key, job journal (torn tail cut);
//! 2. enrollment (first start only; the bootstrap token is used once, never stored);
//! 3. recovery: jobs the journal shows as started but not finished are reported as
//!    interrupted (never re-run); finished-but-unreported results are sent again;
//! 4. READY=1, then the long-poll loop until the first SIGTERM;
//! 5. drain: no new polls, running jobs get `jobs.drain_grace_secs` to finish; a second
//!    SIGTERM (or the grace running out) cancels them; results are reported, then exit.

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use byoc_protocol::{EnrollRequest, PollRequest};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::client::{ClientError, CpClient};
use crate::config::Config;
use crate::identity::{self, Enrollment};
use crate::journal::{Event, Journal, Phase, now_ms};
use crate::pipeline::claim::{self, ClaimOutcome};
use crate::pipeline::verify::Verifier;
use crate::pipeline::{Backoff, PolledJob, Rejection, Rt, Runtime, execute, report, resolve_role};
use crate::spool;

/// Environment variable that may carry the bootstrap token instead of a file.
pub const BOOTSTRAP_TOKEN_ENV: &str = "BYOC_RUNNER_BOOTSTRAP_TOKEN";
/// Marker file while the daemon runs (pid), for `byoc-runner status`.
pub const PID_FILE: &str = "daemon.pid";

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("preparing state directory {path}: {source}")]
    StateDir { path: String, source: std::io::Error },
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    #[error(transparent)]
    Journal(#[from] crate::journal::JournalError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(
        "this runner is not enrolled and no bootstrap token was found: set runner.bootstrap_token_file or {BOOTSTRAP_TOKEN_ENV} (the install stack provides a one-time token)"
    )]
    NoBootstrapToken,
    #[error("reading bootstrap token {path}: {source}")]
    BootstrapToken { path: String, source: std::io::Error },
    #[error(
        "enrollment refused by the control plane: {0}. The bootstrap token is one-time: request a new one from the vendor"
    )]
    EnrollmentRefused(String),
    #[error(
        "state dir belongs to install {enrolled:?} but the config says {configured:?}; use the right state_dir or re-enroll"
    )]
    InstallMismatch { enrolled: String, configured: String },
    #[error("opening the audit log: {0}")]
    Audit(String),
    #[error("installing signal handlers: {0}")]
    Signals(std::io::Error),
    #[error(
        "the job sandbox cannot be built on this host: {0}. Check that user namespaces are enabled (sysctl user.max_user_namespaces > 0) and the unit allows them, or set [sandbox] enabled = false to run jobs unsandboxed"
    )]
    Sandbox(String),
}

pub fn unix_now() -> i64 {
    (now_ms() / 1000) as i64
}

fn sd_notify(states: &[sd_notify::NotifyState]) {
    // No-op without NOTIFY_SOCKET (not under systemd).
    let _ = sd_notify::notify(states);
}

/// Per-group running counts against the configured limits.
struct Slots {
    limits: BTreeMap<String, usize>,
    running: Mutex<BTreeMap<String, usize>>,
    changed: Notify,
    /// Jobs with a live task (from `received` until reported or refused). A second
    /// delivery of one of these (the server re-offered it while our claim was still
    /// being retried) is dropped: the live task claims and runs it, once.
    in_hand: Mutex<std::collections::HashSet<String>>,
}

impl Slots {
    fn free_groups(&self) -> Vec<String> {
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        self.limits
            .iter()
            .filter(|(g, limit)| running.get(*g).copied().unwrap_or(0) < **limit)
            .map(|(g, _)| g.clone())
            .collect()
    }
    fn total(&self) -> usize {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).values().sum()
    }
    fn acquire(&self, group: &str) {
        *self.running.lock().unwrap_or_else(|e| e.into_inner()).entry(group.to_string()).or_default() += 1;
    }
    fn release(&self, group: &str) {
        if let Some(n) = self.running.lock().unwrap_or_else(|e| e.into_inner()).get_mut(group) {
            *n = n.saturating_sub(1);
        }
        self.changed.notify_waiters();
    }
}

pub async fn run(config: Config) -> Result<(), DaemonError> {
    let state_dir = config.runner.state_dir.clone();
    prepare_state_dir(&state_dir)?;
    let (key, created) = identity::load_or_create_key(&state_dir)?;
    if created {
        tracing::info!(path = %state_dir.join(identity::KEY_FILE).display(), "created runner identity key");
    }
    let (journal, torn) = Journal::open(&state_dir)?;
    if torn > 0 {
        tracing::warn!(bytes = torn, "cut a torn record from the end of the job journal (crash mid-write)");
    }
    let enrollment = enroll_if_needed(&config, &key).await?;
    tracing::info!(
        runner_id = %enrollment.runner_id,
        install_id = %enrollment.install_id,
        config_digest = %config.digest,
        "runner starting"
    );
    let cp_keys: Vec<String> =
        config.control_plane.public_keys.values().map(|k| byoc_protocol::b64(k.as_bytes())).collect();
    let (audit, audit_cut) = crate::audit::Audit::open(
        &state_dir,
        key.clone(),
        &enrollment.runner_id,
        &enrollment.install_id,
        &cp_keys,
    )
    .map_err(|e| DaemonError::Audit(e.to_string()))?;
    if audit_cut > 0 {
        tracing::warn!(
            bytes = audit_cut,
            "cut a torn record from the end of the audit log (crash mid-write); the cut is recorded"
        );
    }
    let started = byoc_audit::log::Record {
        event: "runner_started".into(),
        detail: Some(format!("byoc-runner {}", env!("CARGO_PKG_VERSION"))),
        ..Default::default()
    };
    audit.record(started).map_err(|e| DaemonError::Audit(e.to_string()))?;
    let mut loaded = byoc_audit::log::Record {
        event: "config_loaded".into(),
        detail: Some(config.source.display().to_string()),
        ..Default::default()
    };
    loaded.digests.insert("config_sha256".into(), config.digest.clone());
    audit.record(loaded).map_err(|e| DaemonError::Audit(e.to_string()))?;
    if created {
        let mut r = byoc_audit::log::Record { event: "key_created".into(), ..Default::default() };
        r.digests
            .insert("public_key_sha256".into(), byoc_protocol::sha256_hex(key.verifying_key().as_bytes()));
        audit.record(r).map_err(|e| DaemonError::Audit(e.to_string()))?;
    }
    let client = CpClient::new(&config.control_plane)?.with_identity(enrollment.runner_id.clone(), key);

    let helper = std::env::current_exe()
        .map_err(|e| DaemonError::StateDir { path: "current executable".into(), source: e })?;
    let sandbox = crate::pipeline::sandbox_settings(&config, helper);
    if let Some(s) = &sandbox {
        crate::pipeline::sandbox_self_test(s, &state_dir).await.map_err(DaemonError::Sandbox)?;
    }
    match &sandbox {
        Some(s) => tracing::info!(
            cgroup = ?byoc_sandbox::cgroup::detect(),
            memory_mib = s.limits.memory_bytes / (1024 * 1024),
            pids = s.limits.pids,
            "job sandbox enabled"
        ),
        None => {
            tracing::warn!("job sandbox DISABLED by configuration: jobs run with the runner's privileges")
        }
    }
    if let Some(s) = &sandbox {
        match byoc_job_executors::jobnet::check_available(&s.network) {
            Ok(()) => tracing::info!(
                network = %byoc_job_executors::jobnet::describe(byoc_job_executors::jobnet::NetworkUse::UserMode, &s.network),
                "job network boundary available"
            ),
            Err(why) => tracing::error!(
                reason = %why,
                "job network boundary UNAVAILABLE: networked jobs are refused (sandbox_network_unavailable)"
            ),
        }
    }
    let mut containers = crate::pipeline::container_settings(&config);
    if let Some(c) = &mut containers {
        c.owner = enrollment.runner_id.clone();
        // No job runs yet: containers and networks of jobs a killed runner left behind
        // belong to interrupted jobs.
        byoc_job_executors::container::remove_leftovers(c).await;
    }
    let roles = crate::roles::Roles::from_config(&config, &enrollment.install_id, &state_dir)
        .await
        .map_err(|e| DaemonError::StateDir { path: "credential endpoint on 127.0.0.1".into(), source: e })?;
    prepare_control_dir(&state_dir, config.roles.admin_group.as_deref())?;
    tracing::info!(switches = %roles.source.describe(), sts = roles.assumer.is_some(), "lifecycle roles");
    let rt: Rt = Arc::new(Runtime {
        sandbox,
        containers,
        roles,
        pause: Mutex::new(None),
        runner_id: enrollment.runner_id.clone(),
        install_id: enrollment.install_id.clone(),
        state_dir: state_dir.clone(),
        journal,
        audit,
        client,
        abort: CancellationToken::new(),
        stop_reporting: CancellationToken::new(),
        config,
    });
    let _ = std::fs::write(state_dir.join(PID_FILE), std::process::id().to_string());

    let drain = CancellationToken::new();
    spawn_signal_handler(rt.clone(), drain.clone())?;

    let slots = Arc::new(Slots {
        limits: rt.config.jobs.groups.clone(),
        running: Mutex::new(BTreeMap::new()),
        changed: Notify::new(),
        in_hand: Mutex::new(Default::default()),
    });
    let mut tasks: JoinSet<()> = JoinSet::new();
    recover(&rt, &slots, &mut tasks)?;
    rt.check_pause();

    let audit_task = tokio::spawn(crate::audit::upload_loop(rt.clone()));
    let idle = rt.clone();
    let idle_task = tokio::spawn(async move {
        // Idle heartbeat checkpoints make a silently cut tail visible as a gap.
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            // A pause written by the CLI is audited within one tick even when no job comes.
            idle.check_pause();
            if let Err(e) = idle.audit.checkpoint_if_idle() {
                tracing::error!(error = %e, "audit checkpoint failed");
            }
        }
    });
    let health = Arc::new(AtomicU64::new(now_ms()));
    spawn_watchdog(&rt, health.clone(), drain.clone());
    sd_notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status("polling for jobs")]);
    tracing::info!("enrolled and polling");

    poll_loop(&rt, &slots, &mut tasks, &drain, &health).await;

    // Drain.
    let running = slots.total();
    sd_notify(&[sd_notify::NotifyState::Stopping, sd_notify::NotifyState::Status("draining")]);
    tracing::info!(running, grace_secs = rt.config.jobs.drain_grace.as_secs(), "draining: no new jobs");
    let grace = tokio::time::sleep(rt.config.jobs.drain_grace);
    tokio::pin!(grace);
    while slots.total() > 0 {
        let changed = slots.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if slots.total() == 0 {
            break;
        }
        tokio::select! {
            _ = &mut changed => {}
            _ = &mut grace, if !rt.abort.is_cancelled() => {
                tracing::warn!("drain grace over: cancelling running jobs");
                rt.abort.cancel();
            }
            _ = rt.abort.cancelled() => {}
            Some(_) = tasks.join_next() => {}
        }
    }
    // Executions are over and journaled; give reports a moment, the rest waits for the
    // next start (the journal has them as finished-not-reported).
    let report_window = tokio::time::sleep(Duration::from_secs(10));
    tokio::pin!(report_window);
    loop {
        tokio::select! {
            next = tasks.join_next() => if next.is_none() { break },
            _ = &mut report_window => {
                tracing::warn!(pending = tasks.len(), "stopping with results not yet acknowledged; they are sent on next start");
                rt.stop_reporting.cancel();
                while tasks.join_next().await.is_some() {}
                break;
            }
        }
    }
    if let Err(e) =
        rt.audit.record(byoc_audit::log::Record { event: "runner_stopped".into(), ..Default::default() })
    {
        tracing::error!(error = %e, "could not audit the stop");
    }
    // Give the control plane a moment to acknowledge the last records.
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        while byoc_audit::log::acknowledged_size(rt.audit.dir()) < rt.audit.size() {
            rt.audit.changed.notify_waiters();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    rt.stop_reporting.cancel();
    idle_task.abort();
    let _ = audit_task.await;
    let _ = std::fs::remove_file(state_dir.join(PID_FILE));
    tracing::info!("runner stopped");
    Ok(())
}

/// `control/` holds the customer's pause file. With `roles.admin_group` its group may
/// write there (0770), so the group can pause without root.
fn prepare_control_dir(state_dir: &Path, admin_group: Option<&str>) -> Result<(), DaemonError> {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = state_dir.join(crate::roles::pause::CONTROL_DIR);
    let err = |e| DaemonError::StateDir { path: dir.display().to_string(), source: e };
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(err)?;
    if let Some(name) = admin_group {
        match nix::unistd::Group::from_name(name) {
            Ok(Some(g)) => {
                std::os::unix::fs::chown(&dir, None, Some(g.gid.as_raw())).map_err(err)?;
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).map_err(err)?;
                // The group must also reach control/ through the state dir.
                let _ = std::os::unix::fs::chown(state_dir, None, Some(g.gid.as_raw()));
                let _ = std::fs::set_permissions(state_dir, std::fs::Permissions::from_mode(0o710));
            }
            _ => tracing::warn!(group = name, "roles.admin_group does not exist; only root can pause"),
        }
    }
    Ok(())
}

fn prepare_state_dir(state_dir: &Path) -> Result<(), DaemonError> {
    for dir in [state_dir.to_path_buf(), state_dir.join(spool::SPOOL_DIR), state_dir.join(execute::WORK_DIR)]
    {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| DaemonError::StateDir { path: dir.display().to_string(), source: e })?;
    }
    Ok(())
}

async fn enroll_if_needed(
    config: &Config,
    key: &ed25519_dalek::SigningKey,
) -> Result<Enrollment, DaemonError> {
    let state_dir = &config.runner.state_dir;
    if let Some(e) = identity::load_enrollment(state_dir)? {
        if e.install_id != config.runner.install_id {
            return Err(DaemonError::InstallMismatch {
                enrolled: e.install_id,
                configured: config.runner.install_id.clone(),
            });
        }
        return Ok(e);
    }
    let token = match (&config.runner.bootstrap_token_file, std::env::var(BOOTSTRAP_TOKEN_ENV)) {
        (_, Ok(t)) if !t.trim().is_empty() => t.trim().to_string(),
        (Some(path), _) => std::fs::read_to_string(path)
            .map_err(|e| DaemonError::BootstrapToken { path: path.display().to_string(), source: e })?
            .trim()
            .to_string(),
        _ => return Err(DaemonError::NoBootstrapToken),
    };
    let client = CpClient::new(&config.control_plane)?;
    let public_key = byoc_protocol::b64(key.verifying_key().as_bytes());
    let req = EnrollRequest {
        bootstrap_token: token,
        public_key: public_key.clone(),
        hostname: config.runner.hostname.clone().unwrap_or_else(hostname),
    };
    let mut backoff = Backoff::new(config.poll.backoff_initial, config.poll.backoff_max);
    let resp = loop {
        match client.enroll(&req).await {
            Ok(r) => break r,
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, "enrollment failed; retrying");
                tokio::time::sleep(backoff.next_delay()).await;
            }
            Err(ClientError::Unauthorized { body, .. }) => return Err(DaemonError::EnrollmentRefused(body)),
            Err(e) => return Err(e.into()),
        }
    };
    if resp.install_id != config.runner.install_id {
        return Err(DaemonError::InstallMismatch {
            enrolled: resp.install_id,
            configured: config.runner.install_id.clone(),
        });
    }
    let e = Enrollment {
        runner_id: resp.runner_id,
        install_id: resp.install_id,
        control_plane_url: config.control_plane.url.to_string(),
        enrolled_at: unix_now(),
        public_key,
    };
    identity::save_enrollment(state_dir, &e)?;
    // The token is spent; do not leave it lying around where we can remove it.
    if let Some(path) = &config.runner.bootstrap_token_file
        && let Err(err) = std::fs::remove_file(path)
    {
        tracing::warn!(path = %path.display(), error = %err, "could not remove the used bootstrap token file");
    }
    tracing::info!(runner_id = %e.runner_id, "enrolled with the control plane");
    Ok(e)
}

fn hostname() -> String {
    nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "unknown".into())
}

/// After a crash: started-but-unfinished jobs become `interrupted` (they are not run
/// again: the runner cannot know what they already did), then every finished job that
/// was never acknowledged is reported.
fn recover(rt: &Rt, slots: &Arc<Slots>, tasks: &mut JoinSet<()>) -> Result<(), DaemonError> {
    // Received but not claimed (as far as the journal knows): the claim may have reached
    // the control plane before the crash, in which case it will never offer the job
    // again. Claim it again (claims are idempotent per runner) and, having no spec to
    // run (payloads are not stored), report it interrupted rather than leave it hanging.
    let unclaimed: Vec<(String, String)> = rt.journal.with_index(|i| {
        i.jobs
            .values()
            .filter(|j| j.phase == Phase::Received)
            .map(|j| (j.job_id.clone(), j.delivery_id.clone()))
            .collect()
    });
    for (job_id, delivery_id) in unclaimed {
        slots.in_hand.lock().unwrap_or_else(|e| e.into_inner()).insert(job_id.clone());
        let in_hand = InHand { slots: slots.clone(), job_id: job_id.clone() };
        let rt = rt.clone();
        let span = tracing::info_span!("job", job_id = %job_id, install_id = %rt.install_id);
        tasks.spawn(tracing::Instrument::instrument(
            async move {
                let _in_hand = in_hand;
                if let Err(e) = settle_unclaimed(&rt, &job_id, &delivery_id).await {
                    tracing::error!(error = %e, "journal write failed while settling an unclaimed job");
                }
            },
            span,
        ));
    }
    let pending: Vec<(String, Phase)> = rt.journal.with_index(|i| {
        i.jobs
            .values()
            .filter(|j| matches!(j.phase, Phase::Claimed | Phase::Started | Phase::Finished))
            .map(|j| (j.job_id.clone(), j.phase))
            .collect()
    });
    for (job_id, phase) in pending {
        if phase != Phase::Finished {
            let (log_size, log_sha256) = spool::digest_file(&spool::spool_path(&rt.state_dir, &job_id))
                .unwrap_or((0, byoc_protocol::sha256_hex(b"")));
            let started = rt.journal.job(&job_id).and_then(|j| j.started_at_ms);
            tracing::warn!(job_id = %job_id, was = phase.as_str(), "job was interrupted by a runner restart; reporting it, not re-running it");
            rt.transition(Event::Finished {
                job_id: job_id.clone(),
                status: byoc_protocol::JobStatus::Interrupted,
                exit_code: None,
                error: Some(format!(
                    "the runner stopped while the job was {}; it was not re-run",
                    phase.as_str()
                )),
                log_size,
                log_sha256,
                started_at_ms: started,
                finished_at_ms: now_ms(),
                outputs: serde_json::Value::Null,
            })?;
            let _ = std::fs::remove_dir_all(rt.state_dir.join(execute::WORK_DIR).join(&job_id));
            // The sandbox's mount point (its namespace died with the runner).
            let _ = std::fs::remove_dir(rt.state_dir.join(crate::pipeline::ROOTS_DIR).join(&job_id));
        }
        let rt = rt.clone();
        let span = tracing::info_span!("job", job_id = %job_id, install_id = %rt.install_id);
        tasks.spawn(tracing::Instrument::instrument(
            async move {
                if let Err(e) = report::report(&rt, &job_id).await {
                    tracing::error!(error = %e, "journal write failed while reporting");
                }
            },
            span,
        ));
    }
    Ok(())
}

async fn settle_unclaimed(
    rt: &Rt,
    job_id: &str,
    delivery_id: &str,
) -> Result<(), crate::journal::JournalError> {
    let mut backoff = Backoff::new(rt.config.poll.backoff_initial, rt.config.poll.backoff_max);
    let claimed = loop {
        match rt.client.claim(job_id, delivery_id).await {
            Ok(c) => break Ok(c.lease_secs),
            Err(e) if e.is_transient() => tokio::select! {
                _ = tokio::time::sleep(backoff.next_delay()) => {}
                _ = rt.stop_reporting.cancelled() => return Ok(()),
            },
            Err(e) => break Err(e.to_string()),
        }
    };
    match claimed {
        Err(detail) => {
            rt.transition(Event::ClaimRefused { job_id: job_id.into(), detail })?;
            Ok(())
        }
        Ok(lease_secs) => {
            tracing::warn!(
                "job was received but not started before a runner restart; reporting it, not running it"
            );
            rt.transition(Event::Claimed { job_id: job_id.into(), lease_secs })?;
            rt.transition(Event::Finished {
                job_id: job_id.into(),
                status: byoc_protocol::JobStatus::Interrupted,
                exit_code: None,
                error: Some(
                    "the runner restarted after receiving the job and before starting it; it was not run"
                        .into(),
                ),
                log_size: 0,
                log_sha256: byoc_protocol::sha256_hex(b""),
                started_at_ms: None,
                finished_at_ms: now_ms(),
                outputs: serde_json::Value::Null,
            })?;
            report::report(rt, job_id).await.map(|_| ())
        }
    }
}

async fn poll_loop(
    rt: &Rt,
    slots: &Arc<Slots>,
    tasks: &mut JoinSet<()>,
    drain: &CancellationToken,
    health: &Arc<AtomicU64>,
) {
    let mut backoff = Backoff::new(rt.config.poll.backoff_initial, rt.config.poll.backoff_max);
    loop {
        health.store(now_ms(), Ordering::Relaxed);
        while tasks.try_join_next().is_some() {}
        if drain.is_cancelled() {
            return;
        }
        let free_groups = slots.free_groups();
        if free_groups.is_empty() {
            let changed = slots.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if slots.free_groups().is_empty() {
                tokio::select! {
                    _ = changed => {}
                    _ = drain.cancelled() => return,
                }
            }
            continue;
        }
        let pause = rt.check_pause();
        let running_jobs: Vec<String> = rt.journal.with_index(|i| {
            i.jobs
                .values()
                .filter(|j| matches!(j.phase, Phase::Claimed | Phase::Started))
                .map(|j| j.job_id.clone())
                .collect()
        });
        let req = PollRequest {
            wait_secs: rt.config.poll.wait.as_secs(),
            free_groups,
            running_jobs,
            draining: false,
            version: env!("CARGO_PKG_VERSION").to_string(),
            paused: pause.is_some(),
            pause_reason: pause.and_then(|p| p.reason),
        };
        // A poll sent while some group was full names only the free groups; if a slot
        // frees while it is held, poll again at once so that group's jobs are not kept
        // waiting for the hold to run out.
        let narrowed = req.free_groups.len() < slots.limits.len();
        let slot_freed = slots.changed.notified();
        tokio::pin!(slot_freed);
        slot_freed.as_mut().enable();
        let polled = tokio::select! {
            r = rt.client.poll(&req) => r,
            _ = &mut slot_freed, if narrowed => continue,
            _ = drain.cancelled() => return,
        };
        match polled {
            Ok(None) => backoff.reset(),
            Ok(Some(resp)) => {
                backoff.reset();
                handle_delivery(rt, slots, tasks, PolledJob::from(resp)).await;
            }
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "poll failed");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = drain.cancelled() => return,
                }
            }
        }
    }
}

async fn handle_delivery(rt: &Rt, slots: &Arc<Slots>, tasks: &mut JoinSet<()>, polled: PolledJob) {
    let pause = rt.check_pause();
    let verifier = Verifier {
        install: &rt.roles.install,
        paused: pause.as_ref(),
        keys: &rt.config.control_plane.public_keys,
        runner_id: &rt.runner_id,
        install_id: &rt.install_id,
        max_skew: rt.config.jobs.max_clock_skew,
        max_timeout: rt.config.jobs.max_timeout,
        now: unix_now(),
        readiness: &|exec| {
            byoc_job_executors::refusal(exec.placement(), rt.sandbox.as_ref(), rt.containers.as_ref())
        },
    };
    let verified = rt.journal.with_index(|index| verifier.verify(polled, index));
    let job = match verified {
        Ok(job) => job,
        Err(rejection) => return reject(rt, tasks, rejection),
    };
    let p = &job.payload;
    if !slots.in_hand.lock().unwrap_or_else(|e| e.into_inner()).insert(p.job_id.clone()) {
        tracing::info!(job_id = %p.job_id, "duplicate delivery of a job already in hand; ignored");
        return;
    }
    let in_hand = InHand { slots: slots.clone(), job_id: p.job_id.clone() };
    let span = tracing::info_span!(
        "job",
        job_id = %p.job_id,
        install_id = %p.install_id,
        kind = %p.kind,
        operation = %p.operation,
        role = p.requested_role.as_deref().unwrap_or("none"),
    );
    if let Err(e) = claim::record_received(rt, &job) {
        // Without a durable record the runner cannot promise not to re-run it: refuse.
        tracing::error!(parent: &span, error = %e, "could not journal the job; not running it");
        return;
    }
    let group = byoc_protocol::job_group(&p.kind).to_string();
    slots.acquire(&group);
    let slot = SlotGuard { slots: slots.clone(), group };
    let rt = rt.clone();
    tasks.spawn(tracing::Instrument::instrument(
        async move {
            let _in_hand = in_hand;
            let job_id = job.payload.job_id.clone();
            let scoped = match resolve_role::scope(&rt, job).await {
                Ok(scoped) => scoped,
                Err(refused) => {
                    let (job, rejection) = *refused;
                    if let Err(e) = refuse_received(&rt, &job, rejection).await {
                        tracing::error!(error = %e, "job journal write failed while refusing a job");
                    }
                    return;
                }
            };
            if let Some(role) = &scoped.role {
                let p = &scoped.verified.payload;
                let mut r = byoc_audit::log::Record {
                    event: "role_resolved".into(),
                    job: Some(job_id.clone()),
                    kind: Some(p.kind.clone()),
                    operation: Some(p.operation.clone()),
                    role: Some(role.derived.role.name.clone()),
                    detail: Some(format!(
                        "{} by {} {:?}; {}",
                        role.arn,
                        role.derived.step.as_str(),
                        role.derived.reference,
                        role.switch_source
                    )),
                    ..Default::default()
                };
                if let Some(app) = &p.app_config {
                    r.digests.insert(
                        "app_config_sha256".into(),
                        byoc_protocol::sha256_hex(&serde_json::to_vec(app).unwrap_or_default()),
                    );
                }
                if let Err(e) = rt.audit.record(r) {
                    tracing::error!(error = %e, "could not audit the role; not running the job");
                    return;
                }
            }
            let result = match claim::claim(&rt, scoped).await {
                Ok(ClaimOutcome::NotClaimed { .. }) => Ok(()),
                Ok(ClaimOutcome::Claimed(claimed)) => {
                    let finished = execute::execute(&rt, *claimed).await;
                    // The slot frees when execution ends; reporting may take longer.
                    drop(slot);
                    match finished {
                        Ok(_) => report::report(&rt, &job_id).await.map(|_| ()),
                        Err(e) => Err(e),
                    }
                }
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                tracing::error!(error = %e, "job journal write failed; the job's state is uncertain until restart");
            }
        },
        span,
    ));
}

/// Marks a job as having a live task until dropped.
struct InHand {
    slots: Arc<Slots>,
    job_id: String,
}

impl Drop for InHand {
    fn drop(&mut self) {
        self.slots.in_hand.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.job_id);
    }
}

/// Holds a group slot; frees it (and wakes the poll loop) when dropped.
struct SlotGuard {
    slots: Arc<Slots>,
    group: String,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.slots.release(&self.group);
    }
}

/// A received job refused before its claim: journaled (and audited) as refused, then
/// reported to the control plane like any rejection.
async fn refuse_received(
    rt: &Rt,
    job: &crate::pipeline::VerifiedJob,
    r: Rejection,
) -> Result<(), crate::journal::JournalError> {
    tracing::warn!(reason = r.reason.code(), detail = %r.detail, "job refused");
    rt.transition(Event::Refused {
        job_id: job.payload.job_id.clone(),
        delivery_id: r.delivery_id.clone(),
        reason: r.reason,
        detail: r.detail.clone(),
        role: job.role.as_ref().map(|d| d.role.name.clone()),
    })?;
    send_rejection(rt, &r).await;
    Ok(())
}

/// Tell the control plane why a delivery was refused (bounded retries).
async fn send_rejection(rt: &Rt, r: &Rejection) {
    let mut backoff = Backoff::new(rt.config.poll.backoff_initial, rt.config.poll.backoff_max);
    for _ in 0..5 {
        match rt.client.reject(&r.delivery_id, r.reason, &r.detail).await {
            Ok(()) => return,
            Err(e) if e.is_transient() => {
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next_delay()) => {}
                    _ = rt.stop_reporting.cancelled() => return,
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "control plane did not take the rejection report");
                return;
            }
        }
    }
}

fn reject(rt: &Rt, tasks: &mut JoinSet<()>, r: Rejection) {
    tracing::warn!(
        reason = r.reason.code(),
        delivery_id = %r.delivery_id,
        job_id = r.job_id.as_deref().unwrap_or(""),
        detail = %r.detail,
        "job rejected"
    );
    if let Err(e) = rt.transition(Event::Rejected {
        delivery_id: r.delivery_id.clone(),
        job_id: r.job_id.clone(),
        nonce: r.nonce.clone(),
        expires_at: r.expires_at,
        reason: r.reason,
        detail: r.detail.clone(),
    }) {
        tracing::error!(error = %e, "could not journal a rejection");
    }
    let rt = rt.clone();
    tasks.spawn(async move { send_rejection(&rt, &r).await });
}

fn spawn_signal_handler(rt: Rt, drain: CancellationToken) -> Result<(), DaemonError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    tokio::spawn(async move {
        let mut count = 0;
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            count += 1;
            if count == 1 {
                tracing::info!("stop requested: draining (a second SIGTERM cancels running jobs)");
                drain.cancel();
            } else {
                tracing::warn!("second stop request: cancelling running jobs");
                rt.abort.cancel();
            }
        }
    });
    Ok(())
}

/// WATCHDOG=1 only while the poll loop is making progress: a wedged loop gets the
/// runner restarted by systemd.
fn spawn_watchdog(rt: &Rt, health: Arc<AtomicU64>, drain: CancellationToken) {
    let Some(interval) = sd_notify::watchdog_enabled() else { return };
    let c = &rt.config;
    let stall_ms =
        (c.poll.wait + c.control_plane.request_timeout + c.poll.backoff_max + Duration::from_secs(10))
            .as_millis() as u64;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval / 2);
        loop {
            tick.tick().await;
            let age = now_ms().saturating_sub(health.load(Ordering::Relaxed));
            if age < stall_ms || drain.is_cancelled() {
                sd_notify(&[sd_notify::NotifyState::Watchdog]);
            } else {
                tracing::error!(stalled_ms = age, "poll loop stalled; withholding watchdog ping");
            }
        }
    });
}
