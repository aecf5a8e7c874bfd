//! `byoc-runner run`: the daemon (`run`). Start-up order matters and is fixed:
//!
//! 1. `start_up`: state dir, identity key, job journal (torn tail cut); enrollment
//!    (first start only; the bootstrap token is used once, never stored); the audit log;
//!    the job isolation (sandbox self-test, containers' leftovers); roles; the runtime;
//! 2. `settle_and_resume`: jobs the journal shows as started but not finished are
//!    reported as interrupted (never re-run); finished-but-unreported results are sent
//!    again; held jobs resume;
//! 3. `Background::spawn` (audit upload, idle upkeep, retention, metrics), READY=1, then
//!    the long-poll loop until the first SIGTERM;
//! 4. `drain_jobs`: no new polls, running jobs get `jobs.drain_grace_secs` to finish; a
//!    second SIGTERM (or the grace running out) cancels them; results are reported;
//! 5. `stop`: the last audit records, the background tasks end, exit.

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

use crate::clock::{now_ms, unix_now};
use crate::config::Config;
use crate::control_plane::retry::{self, Backoff, Retried};
use crate::control_plane::{ClientError, ControlPlane, CpClient};
use crate::identity::{self, Enrollment};
use crate::journal::{Journal, Phase};
use crate::pipeline::{self, Accepted, JobsInHand, PolledJob};
use crate::runtime::{Rt, Runtime};
use crate::state_dir::StateDir;

mod enroll;
mod local_drift;
mod slots;
mod upkeep;
use enroll::enroll_if_needed;
use slots::{SlotGuard, Slots};
use upkeep::{compact_journal, sweep_archives, sweep_logs, sweep_plans, write_metrics};

/// Environment variable that may carry the bootstrap token instead of a file.
pub const BOOTSTRAP_TOKEN_ENV: &str = "BYOC_RUNNER_BOOTSTRAP_TOKEN";

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("preparing state directory {path}: {source}")]
    StateDir { path: String, source: std::io::Error },
    #[error("finding this executable (the sandbox helper and policy evaluator): {0}")]
    CurrentExe(std::io::Error),
    #[error("setting up the lifecycle roles (the credential endpoint): {0}")]
    Roles(std::io::Error),
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    #[error(transparent)]
    Journal(#[from] crate::journal::RecordError),
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
    #[error("opening or writing the audit log: {0}")]
    Audit(#[from] byoc_audit::log::AuditError),
    #[error(
        "the audit export cannot start: {0}. Fix [audit.export] in the configuration (`byoc-runner config check`)"
    )]
    AuditExport(String),
    #[error("installing signal handlers: {0}")]
    Signals(std::io::Error),
    #[error(
        "the runner may open only {limit} files (RLIMIT_NOFILE, hard limit {hard}); it needs {MIN_OPEN_FILES}: raise LimitNOFILE in the unit (the packaged unit sets {UNIT_OPEN_FILES})"
    )]
    OpenFiles { limit: u64, hard: u64 },
    #[error(
        "the job sandbox cannot be built on this host: {0}. Check that user namespaces are enabled (sysctl user.max_user_namespaces > 0) and the unit allows them, or set [sandbox] enabled = false to run jobs unsandboxed"
    )]
    Sandbox(#[from] byoc_job_executors::sandboxed::SelfTestError),
}

fn sd_notify(states: &[sd_notify::NotifyState]) {
    // No-op without NOTIFY_SOCKET (not under systemd).
    let _ = sd_notify::notify(states);
}

/// Open files the daemon needs at least: each running job holds its spool, pipes, the
/// sockets of its namespace's services (up to 32 credential and 64 DNS connections) and
/// its cluster or registry connections.
pub const MIN_OPEN_FILES: u64 = 2048;
/// What the packaged unit's `LimitNOFILE` gives, and what the soft limit is raised to.
pub const UNIT_OPEN_FILES: u64 = 65_536;

/// The soft limit to set given the current soft and hard limits: raised to the hard
/// limit (at most `UNIT_OPEN_FILES`), never lowered; an error below `MIN_OPEN_FILES`.
fn open_files_target(soft: u64, hard: u64) -> Result<u64, DaemonError> {
    let target = soft.max(hard.min(UNIT_OPEN_FILES));
    if target < MIN_OPEN_FILES {
        return Err(DaemonError::OpenFiles { limit: target, hard });
    }
    Ok(target)
}

/// Raise the open-files limit before anything opens many: a job cannot run the daemon
/// out of descriptors (its services are capped), and the daemon needs room for many jobs.
fn raise_open_files() -> Result<u64, DaemonError> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap_or((0, 0));
    let target = open_files_target(soft, hard)?;
    if target != soft && setrlimit(Resource::RLIMIT_NOFILE, target, hard).is_err() {
        return open_files_target(soft, soft);
    }
    Ok(target)
}

/// The daemon: start-up, the background tasks, the poll loop, and the drain and stop.
pub async fn run(config: Config) -> Result<(), DaemonError> {
    let (rt, audit, client) = start_up(config).await?;
    let drain = CancellationToken::new();
    spawn_signal_handler(rt.clone(), drain.clone())?;
    let notice = Arc::new(std::sync::OnceLock::new());
    crate::lifecycle::spawn_watch(&rt, drain.clone(), notice.clone());

    let slots = Arc::new(Slots {
        limits: rt.config.jobs.groups.clone(),
        running: Mutex::new(BTreeMap::new()),
        changed: Notify::new(),
        in_hand: JobsInHand::default(),
    });
    let mut tasks: JoinSet<()> = JoinSet::new();
    // The customer's copies of the audit log, before any job is touched: a sink that
    // cannot be built stops the start (the customer asked for the copy), one that
    // fails later never stops jobs.
    let export_stop = CancellationToken::new();
    let export_tasks = crate::audit_export::start(&rt.config, &rt.runner_id, &audit, &export_stop)
        .await
        .map_err(DaemonError::AuditExport)?;
    settle_and_resume(&rt, &slots, &mut tasks)?;
    rt.check_customer_controls();
    compact_journal(&rt);
    let background = Background::spawn(&rt, &audit, client, &slots, export_tasks, export_stop);

    let health = Arc::new(AtomicU64::new(now_ms()));
    // READY=1 goes first: the watchdog's first ping fires at once on another worker.
    sd_notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status("polling for jobs")]);
    spawn_watchdog(&rt, health.clone(), drain.clone());
    tracing::info!("Enrolled and polling.");

    poll_loop(&rt, &slots, &mut tasks, &drain, &health).await;

    drain_jobs(&rt, &slots, &mut tasks).await;
    complete_lifecycle(&rt, notice.get()).await;
    stop(&rt, &audit, background).await;
    Ok(())
}

/// Everything before the first poll: the state dir, the identity key, the journal,
/// enrollment, the audit log, the job isolation, the roles, the runtime.
async fn start_up(
    config: Config,
) -> Result<(Rt, Arc<crate::audit::Audit>, Arc<dyn ControlPlane>), DaemonError> {
    let (journal, enrollment, audit, client) = open_state(&config).await?;
    let state_dir = config.runner.state_dir.clone();
    let (sandbox, containers) = isolation(&config, &enrollment.runner_id).await?;
    prepare_control_dir(&state_dir, config.roles.admin_group.as_deref())?;
    let roles = crate::roles::Roles::from_config(&config, &enrollment.install_id, &state_dir)
        .await
        .map_err(DaemonError::Roles)?;
    tracing::info!(switches = %roles.source.describe(), sts = roles.assumer.is_some(), "Lifecycle roles.");
    let rt: Rt = Arc::new(Runtime {
        sandbox,
        containers,
        roles,
        pause: Mutex::new(Default::default()),
        allowances_sync: Mutex::new(()),
        runner_id: enrollment.runner_id.clone(),
        install_id: enrollment.install_id.clone(),
        state_dir: state_dir.clone(),
        update_terms_dir: crate::update::terms_dir(&crate::update::own_updater_dir()),
        journal: Arc::new(journal),
        audit: audit.clone(),
        // The runner's own drift checks are answered locally (`control_plane::local`).
        client: client.clone(),
        abort: CancellationToken::new(),
        stop_reporting: CancellationToken::new(),
        clock: Arc::new(crate::clock::SystemClock),
        leases: Default::default(),
        config,
    });
    let _ = std::fs::write(StateDir::of(&state_dir).pid(), std::process::id().to_string());
    Ok((rt, audit, client))
}

/// The state dir, the identity key, the journal, enrollment and the audit log (its
/// start records written), and the control plane's client.
async fn open_state(
    config: &Config,
) -> Result<(Journal, identity::Enrollment, Arc<crate::audit::Audit>, Arc<dyn ControlPlane>), DaemonError> {
    let open_files = raise_open_files()?;
    tracing::debug!(open_files, "Open files limit.");
    let state_dir = config.runner.state_dir.clone();
    prepare_state_dir(&state_dir)?;
    let (key, created) = identity::load_or_create_key(&state_dir)?;
    if created {
        tracing::info!(path = %StateDir::of(&state_dir).key().display(), "Created runner identity key.");
    }
    let reserve = crate::disk::Reserve::new(&state_dir, &config.disk);
    reserve.hold();
    let (journal, torn) = Journal::open(&state_dir)?;
    let journal = journal.with_reserve(reserve.clone());
    if torn > 0 {
        tracing::warn!(bytes = torn, "Cut a torn record from the end of the job journal (crash mid-write).");
    }
    let enrollment = enroll_if_needed(config, &key).await?;
    tracing::info!(
        runner_id = %enrollment.runner_id,
        install_id = %enrollment.install_id,
        config_digest = %config.digest,
        "Runner starting."
    );
    let cp_keys: Vec<String> =
        config.control_plane.public_keys.values().map(|k| byoc_protocol::b64(k.as_bytes())).collect();
    let (audit, audit_cut) = crate::audit::Audit::open(
        &state_dir,
        key.clone(),
        &enrollment.runner_id,
        &enrollment.install_id,
        &cp_keys,
    )?;
    let audit = audit.with_reserve(reserve.clone());
    if audit_cut > 0 {
        tracing::warn!(
            bytes = audit_cut,
            "Cut a torn record from the end of the audit log (crash mid-write); the cut is recorded."
        );
    }
    audit.record(crate::audit_records::runner_started())?;
    audit.record(crate::audit_records::config_loaded(&config.source, &config.digest))?;
    if created {
        audit.record(crate::audit_records::key_created(key.verifying_key().as_bytes()))?;
    }
    let client: Arc<dyn ControlPlane> =
        Arc::new(CpClient::new(&config.control_plane)?.with_identity(enrollment.runner_id.clone(), key));
    let audit = Arc::new(audit);

    Ok((journal, enrollment, audit, client))
}

/// How jobs are isolated here: the sandbox (its self-test passed) and containers
/// (what a killed runner left of them removed).
async fn isolation(
    config: &Config,
    runner_id: &str,
) -> Result<
    (Option<byoc_job_executors::SandboxSettings>, Option<byoc_job_executors::ContainerSettings>),
    DaemonError,
> {
    let state_dir = &config.runner.state_dir;
    let helper = std::env::current_exe().map_err(DaemonError::CurrentExe)?;
    let sandbox = crate::runtime::sandbox_settings(config, helper);
    if let Some(s) = &sandbox {
        crate::runtime::sandbox_self_test(s, state_dir).await?;
    }
    match &sandbox {
        Some(s) => {
            let cgroup = match byoc_sandbox::cgroup::detect() {
                Some(byoc_sandbox::cgroup::Version::V1) => "v1",
                Some(byoc_sandbox::cgroup::Version::V2) => "v2",
                None => "none",
            };
            tracing::info!(
                cgroup,
                memory_mib = s.limits.memory_bytes / (1024 * 1024),
                pids = s.limits.pids,
                "Job sandbox enabled: cgroup {cgroup}, {} MiB and {} processes per job.",
                s.limits.memory_bytes / (1024 * 1024),
                s.limits.pids
            )
        }
        None => {
            tracing::warn!("Job sandbox DISABLED by configuration: jobs run with the runner's privileges.")
        }
    }
    if let Some(s) = &sandbox {
        match byoc_job_executors::jobnet::check_available(&s.network) {
            Ok(()) => tracing::info!(
                network = %byoc_job_executors::jobnet::describe(byoc_job_executors::jobnet::NetworkUse::UserMode, &s.network),
                "Job network boundary available."
            ),
            Err(why) => tracing::error!(
                reason = %why,
                "Job network boundary UNAVAILABLE: networked jobs are refused (sandbox_network_unavailable)."
            ),
        }
    }
    let mut containers = crate::runtime::container_settings(config);
    if let Some(c) = &mut containers {
        c.owner = runner_id.to_string();
        c.prepare_networks = true;
        // No job runs yet: containers, networks and output pipes of jobs a killed
        // runner left behind belong to interrupted jobs.
        byoc_job_executors::container::remove_leftovers(c).await;
        byoc_job_executors::container::remove_output_pipes(&StateDir::of(state_dir).work());
    }
    Ok((sandbox, containers))
}

/// Jobs the journal shows unfinished are settled (`recover`); held jobs resume.
fn settle_and_resume(rt: &Rt, slots: &Arc<Slots>, tasks: &mut JoinSet<()>) -> Result<(), DaemonError> {
    // Jobs claimed before the restart speak under the epoch of their lease.
    rt.journal.with_index(|index| {
        for j in index.jobs.values().filter(|j| j.lease_epoch > 0) {
            rt.client.remember_lease(&j.job_id, j.lease_epoch);
        }
    });
    let resumed = pipeline::recover::resume_held(rt);
    let resumed_ids = resumed.iter().map(|j| j.payload.job_id.clone()).collect();
    for settle in pipeline::recover::recover(rt, &slots.in_hand, &resumed_ids)? {
        tasks.spawn(settle);
    }
    for job in resumed {
        if let Some(in_hand) = slots.in_hand.mark(&job.payload.job_id) {
            start_job(rt, slots, tasks, job, in_hand);
        }
    }

    Ok(())
}

/// The daemon's background tasks: the audit upload, the idle upkeep (customer
/// controls, journal compaction, checkpoints, the heap), retention, metrics.
struct Background {
    audit_task: tokio::task::JoinHandle<()>,
    /// One per audit export sink (`[audit.export]`), stopped by `export_stop`.
    export_tasks: Vec<tokio::task::JoinHandle<()>>,
    export_stop: CancellationToken,
    idle_task: tokio::task::JoinHandle<()>,
    retention_task: tokio::task::JoinHandle<()>,
    metrics_task: Option<tokio::task::JoinHandle<()>>,
}

impl Background {
    fn spawn(
        rt: &Rt,
        audit: &Arc<crate::audit::Audit>,
        client: Arc<dyn ControlPlane>,
        slots: &Arc<Slots>,
        export_tasks: Vec<tokio::task::JoinHandle<()>>,
        export_stop: CancellationToken,
    ) -> Background {
        let audit_task =
            tokio::spawn(crate::audit::upload_loop(audit.clone(), client, rt.stop_reporting.clone()));
        let idle = rt.clone();
        let idle_audit = audit.clone();
        let idle_slots = slots.clone();
        let idle_task = tokio::spawn(async move {
            // Idle heartbeat checkpoints make a silently cut tail visible as a gap.
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            // The audit log's size when the runner last went quiet, and at the last tick:
            // every job adds records, an idle runner none.
            let (mut paged_out_at, mut last_size) = (idle_audit.size(), idle_audit.size());
            loop {
                tick.tick().await;
                // A pause written by the CLI is audited within one tick even when no job comes.
                idle.check_customer_controls();
                compact_journal(&idle);
                if let Err(e) = idle_audit.checkpoint_if_idle() {
                    tracing::error!(error = %e, "Audit checkpoint failed: {e}.");
                }
                // What a large job's buffers left free in the heap goes back to the kernel
                // while no job runs (the runner idles most of its life; the walk is cheap).
                if idle_slots.total() == 0 {
                    byoc_sandbox::return_free_heap();
                    // Quiet for a whole tick after jobs ran: the code they ran goes back to
                    // the page cache, once per quiet spell (the idle loop's own pages come
                    // back at once and stay).
                    let size = idle_audit.size();
                    if size == last_size && size != paged_out_at {
                        let bytes = byoc_sandbox::page_out_read_only_mappings();
                        tracing::debug!(bytes, "Idle: read-only mappings paged out.");
                        paged_out_at = size;
                    }
                    last_size = size;
                }
            }
        });
        let (logs_keep, archives_keep) =
            (rt.config.jobs.log_retention, rt.config.jobs.journal_archive_retention);
        let retention_task = {
            let rt = rt.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(3600));
                loop {
                    tick.tick().await;
                    sweep_plans(&rt);
                    if let Some(keep) = logs_keep {
                        sweep_logs(&rt, keep);
                    }
                    if let Some(keep) = archives_keep {
                        sweep_archives(&rt, keep);
                    }
                }
            })
        };
        let metrics_task = rt.config.metrics_textfile.clone().map(|path| {
            let rt = rt.clone();
            tokio::spawn(async move {
                let mut tally = crate::metrics::AuditTally::default();
                let mut tick = tokio::time::interval(Duration::from_secs(15));
                loop {
                    tick.tick().await;
                    write_metrics(&rt, &path, &mut tally);
                }
            })
        });
        Background { audit_task, export_tasks, export_stop, idle_task, retention_task, metrics_task }
    }
}

/// Drained for the instance's termination: the runner leaves the install (its place
/// goes to a replacement; what it held, to another runner at once), then an Auto
/// Scaling group may terminate the instance.
async fn complete_lifecycle(rt: &Rt, notice: Option<&crate::lifecycle::Notice>) {
    let Some(notice) = notice.filter(|n| n.action == "terminate") else { return };
    match rt.client.retire().await {
        Ok(()) => {
            tracing::info!("Retired from the install: a replacement may take this runner's place.");
            rt.audit_or_log(
                crate::audit_records::note(
                    "runner_retired",
                    format!(
                        "the instance is being terminated ({}): this runner left the install",
                        notice.kind
                    ),
                ),
                "the retirement",
            );
        }
        // What it held goes to another runner when its lease runs out; its place waits
        // for the vendor to retire it.
        Err(e) => tracing::warn!(error = %e, "Could not retire from the install: {e}."),
    }
    if notice.kind != "autoscaling" || rt.config.lifecycle.autoscaling_group.is_none() {
        return;
    }
    match crate::lifecycle::complete_lifecycle_action(&rt.config).await {
        Ok(detail) => {
            tracing::info!(%detail, "Lifecycle action completed: the instance may go.");
            rt.audit_or_log(
                crate::audit_records::note("lifecycle_action_completed", detail),
                "the lifecycle action",
            );
        }
        Err(e) => {
            // The hook's timeout ends it anyway (its default result).
            tracing::error!(error = %e, "Completing the lifecycle action failed: {e}.");
            rt.audit_or_log(crate::audit_records::note("lifecycle_action_failed", e), "the lifecycle action");
        }
    }
}

/// No new jobs: running ones get the drain grace, then are cancelled; reports get a
/// moment, the rest is sent at the next start (the journal has them).
async fn drain_jobs(rt: &Rt, slots: &Arc<Slots>, tasks: &mut JoinSet<()>) {
    // Drain.
    let running = slots.total();
    sd_notify(&[sd_notify::NotifyState::Stopping, sd_notify::NotifyState::Status("draining")]);
    tracing::info!(running, grace_secs = rt.config.jobs.drain_grace.as_secs(), "Draining: no new jobs.");
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
                tracing::warn!("Drain grace over: cancelling running jobs.");
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
                tracing::warn!(pending = tasks.len(), "Stopping with results not yet acknowledged; they are sent on next start.");
                rt.stop_reporting.cancel();
                while tasks.join_next().await.is_some() {}
                break;
            }
        }
    }
}

/// The last records and the background tasks' end.
async fn stop(rt: &Rt, audit: &Arc<crate::audit::Audit>, background: Background) {
    byoc_job_executors::sandboxed::settle().await;
    byoc_job_executors::container::release_prepared().await;
    rt.audit_or_log(crate::audit_records::runner_stopped(), "the stop");
    // Give the control plane a moment to acknowledge the last records.
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        while byoc_audit::log::acknowledged_size(audit.dir()) < audit.size() {
            audit.changed.notify_waiters();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    // And the customer's copies a moment to take the last records (the rest at the next start).
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        while !crate::audit_export::caught_up(&rt.state_dir, audit.size()) {
            audit.changed.notify_waiters();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    background.export_stop.cancel();
    for t in background.export_tasks {
        let _ = t.await;
    }
    rt.stop_reporting.cancel();
    background.idle_task.abort();
    background.retention_task.abort();
    if let Some(t) = background.metrics_task {
        t.abort();
    }
    let _ = background.audit_task.await;
    let _ = std::fs::remove_file(StateDir::of(&rt.state_dir).pid());
    tracing::info!("Runner stopped.");
}

/// `control/` and what the admin group may use (`roles::control`): made by the daemon's
/// user, so it can read and remove what root or the group leave there.
fn prepare_control_dir(state_dir: &Path, admin_group: Option<&str>) -> Result<(), DaemonError> {
    let problems = crate::roles::control::prepare(state_dir, admin_group).map_err(|e| {
        DaemonError::StateDir { path: StateDir::of(state_dir).control().display().to_string(), source: e }
    })?;
    for problem in problems {
        tracing::warn!(
            group = admin_group.unwrap_or_default(),
            problem = %problem,
            "Members of roles.admin_group cannot act until root fixes this."
        );
    }
    Ok(())
}

pub(crate) fn prepare_state_dir(state_dir: &Path) -> Result<(), DaemonError> {
    for dir in [state_dir.to_path_buf(), StateDir::of(state_dir).spool(), StateDir::of(state_dir).work()] {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| DaemonError::StateDir { path: dir.display().to_string(), source: e })?;
    }
    Ok(())
}

/// A test-only fault, read from the daemon's own environment (which only the unit's
/// files set; a job cannot reach it): the poll loop stops coming round, so the watchdog's
/// negative case can be shown under systemd. Never set it on a real install.
const WEDGE_FAULT_ENV: &str = "BYOC_RUNNER_TEST_FAULT_WEDGE_POLL_LOOP";

/// How often a poll loop that is waiting for a free slot refreshes its health (well
/// under the watchdog's stall threshold, which is at least 10 s past a poll's length).
const HEALTH_REFRESH: Duration = Duration::from_secs(5);

async fn poll_loop(
    rt: &Rt,
    slots: &Arc<Slots>,
    tasks: &mut JoinSet<()>,
    drain: &CancellationToken,
    health: &Arc<AtomicU64>,
) {
    let mut backoff = Backoff::new(rt.config.poll.backoff_initial, rt.config.poll.backoff_max);
    let mut local_drift = local_drift::LocalDrift::default();
    let mut updates = UpdateWatch::default();
    if std::env::var_os(WEDGE_FAULT_ENV).is_some_and(|v| v == "1") {
        // Test fault (the VM suite's watchdog case): a loop that never comes round.
        tracing::error!("{WEDGE_FAULT_ENV}=1: the poll loop is wedged on purpose");
        drain.cancelled().await;
        return;
    }
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
                // Waiting for a slot is progress: the loop comes round to refresh its
                // health, or the watchdog would restart a runner whose slots are all
                // busy with long jobs.
                tokio::select! {
                    _ = changed => {}
                    _ = drain.cancelled() => return,
                    _ = tokio::time::sleep(HEALTH_REFRESH) => {}
                }
            }
            continue;
        }
        // The runner's own drift checks, due or asked for, before the control plane's.
        local_drift.start_due(rt, slots, tasks);
        let pause = rt.check_customer_controls();
        // Before every poll too, not only on the idle tick: a busy runner stays within
        // journal_keep (the check is a count; the file is rewritten every keep/4 jobs).
        compact_journal(rt);
        let req = poll_request(rt, free_groups, pause);
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
        // For `status`, recorded after a delivery is on its way (off the pickup path).
        let answered_at = rt.clock.now_ms();
        match polled {
            Ok(None) => {
                backoff.reset();
                crate::contact::poll_answered(&rt.state_dir, answered_at);
                updates.poll_answered(rt, answered_at);
            }
            Ok(Some(resp)) => {
                backoff.reset();
                handle_delivery(rt, slots, tasks, PolledJob::from(resp));
                crate::contact::poll_answered(&rt.state_dir, answered_at);
                updates.poll_answered(rt, answered_at);
            }
            Err(e) => {
                crate::contact::poll_failed(&rt.state_dir, answered_at, &e.to_string());
                let delay = backoff.next_delay();
                tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "Poll failed: {e}.");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = drain.cancelled() => return,
                }
            }
        }
    }
}

/// The updater's side of the poll loop: the health it waits for (once, after the first
/// answered poll), and its outcome audited (whichever version reads it).
#[derive(Default)]
struct UpdateWatch {
    healthy: bool,
    /// The pin file as last seen (`None` before the first look): a change is audited.
    pin: Option<Option<Vec<u8>>>,
}

impl UpdateWatch {
    fn poll_answered(&mut self, rt: &Rt, at_ms: u64) {
        if !self.healthy {
            self.healthy = true;
            let key = crate::identity::load_or_create_key(&rt.state_dir)
                .map(|(k, _)| byoc_protocol::sha256_hex(k.verifying_key().as_bytes()))
                .unwrap_or_default();
            crate::update::record_health(&rt.state_dir, &key, at_ms);
            crate::update::announce_pending(&rt.state_dir, &crate::update::own_updater_dir());
        }
        crate::update::record_outcome(&rt.state_dir, &crate::update::own_updater_dir(), rt.audit.as_ref());
        let pin = std::fs::read(crate::update::pin_path(&rt.update_terms_dir)).ok();
        if self.pin.as_ref().is_some_and(|seen| *seen != pin) {
            let detail = match &pin {
                Some(bytes) => format!(
                    "pinned: {}",
                    String::from_utf8_lossy(bytes).split_whitespace().collect::<Vec<_>>().join(" ")
                ),
                None => "unpinned".into(),
            };
            if let Err(e) = rt.audit.record(crate::audit_records::note("update_pin_changed", detail)) {
                tracing::error!(error = %e, "Could not audit the update pin's change: {e}.");
            }
        }
        self.pin = Some(pin);
    }
}

/// A poll's wait while an update is staged or being applied.
const UPDATE_POLL_WAIT_SECS: u64 = 1;

/// What a poll tells the control plane: the free groups, the jobs this runner holds,
/// whether the customer paused it.
fn poll_request(rt: &Rt, free_groups: Vec<String>, pause: Option<crate::roles::pause::Pause>) -> PollRequest {
    let running_jobs: Vec<String> = rt.journal.with_index(|i| {
        i.jobs
            .values()
            .filter(|j| {
                matches!(
                    j.phase,
                    Phase::Claimed | Phase::WaitingWindow | Phase::AwaitingApproval | Phase::Started
                )
            })
            .map(|j| j.job_id.clone())
            .collect()
    });
    let pending_update = crate::update::pending(&rt.state_dir);
    // While an update is in flight the updater waits on this daemon's answered polls
    // (its health, then its outcome audited): short polls keep that to seconds.
    let wait = rt.config.poll.wait.as_secs();
    PollRequest {
        wait_secs: if pending_update.is_some() { wait.min(UPDATE_POLL_WAIT_SECS) } else { wait },
        free_groups,
        running_jobs,
        draining: false,
        version: crate::update::running_version().to_string(),
        pending_update,
        paused: pause.is_some(),
        pause_reason: pause.and_then(|p| p.reason),
    }
}

/// A delivery through `pipeline::accept`; an accepted job runs in its own task with a
/// slot of its group.
fn handle_delivery(rt: &Rt, slots: &Arc<Slots>, tasks: &mut JoinSet<()>, polled: PolledJob) {
    let (job, in_hand) = match pipeline::accept(rt, polled, &slots.in_hand) {
        Accepted::Job(job, in_hand) => (*job, in_hand),
        Accepted::Rejected(rejection) => {
            let rt = rt.clone();
            tasks.spawn(async move {
                pipeline::refuse::send_rejection(&rt, pipeline::Origin::Remote, &rejection).await
            });
            return;
        }
        Accepted::Dropped => return,
    };
    start_job(rt, slots, tasks, job, in_hand);
}

/// Run an accepted (or resumed) job in its own task with a slot of its group.
fn start_job(
    rt: &Rt,
    slots: &Arc<Slots>,
    tasks: &mut JoinSet<()>,
    job: pipeline::VerifiedJob,
    in_hand: pipeline::InHand,
) {
    let p = &job.payload;
    let span = tracing::info_span!(
        "job",
        job_id = %p.job_id,
        install_id = %p.install_id,
        kind = %p.kind,
        operation = %p.operation,
        role = p.requested_role.as_deref().unwrap_or("none"),
    );
    let fields = crate::logging::JobFields::of(p);
    let group = byoc_protocol::job_group(&p.kind).to_string();
    let slot = SlotGuard::take(slots, group);
    let rt = rt.clone();
    tasks.spawn(tracing::Instrument::instrument(
        crate::logging::JOB.scope(fields, async move {
            let _in_hand = in_hand;
            let job_id = job.payload.job_id.clone();
            if let Err(e) = pipeline::run_job(rt.clone(), job, slot).await {
                tracing::error!(error = %e, "Job journal write failed; the job's state is uncertain until restart: {e}.");
            }
            // A resumed job may have gone through without being held again (its window
            // had opened): its kept envelope goes too, unless the runner is stopping.
            if !rt.abort.is_cancelled() {
                pipeline::held::forget_held(&rt, &job_id);
            }
        }),
        span,
    ));
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
                tracing::info!("Stop requested: draining (a second SIGTERM cancels running jobs).");
                drain.cancel();
            } else {
                tracing::warn!("Second stop request: cancelling running jobs.");
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
                tracing::error!(stalled_ms = age, "Poll loop stalled; withholding watchdog ping.");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_open_files_limit_is_raised_to_the_hard_limit_and_refused_when_too_low() {
        assert_eq!(open_files_target(1024, 524_288).ok(), Some(UNIT_OPEN_FILES));
        assert_eq!(open_files_target(1024, 4096).ok(), Some(4096));
        assert_eq!(open_files_target(100_000, 200_000).ok(), Some(100_000), "never lowered");
        let e = open_files_target(1024, 1024).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("LimitNOFILE") && e.contains("1024"), "{e}");
    }

    #[tokio::test]
    async fn polls_are_short_while_an_update_is_staged_so_the_updater_hears_back_in_seconds() {
        let f = crate::testing::runtime().await;
        let idle = poll_request(&f.rt, Vec::new(), None);
        assert_eq!((idle.wait_secs, idle.pending_update), (f.rt.config.poll.wait.as_secs(), None));
        assert!(idle.wait_secs > UPDATE_POLL_WAIT_SECS);
        let request = crate::update::Request {
            job_id: "job-1".into(),
            version: "9.9.9".into(),
            from_version: "1.0.0".into(),
            package: "byoc-runner_9.9.9_amd64.deb".into(),
            package_sha256: "00".repeat(32),
            sums_sha256: "11".repeat(32),
            min_rollback_version: None,
            rollback: false,
            staged_at_ms: 1,
        };
        std::fs::create_dir_all(crate::update::dir(&f.rt.state_dir)).unwrap();
        std::fs::write(crate::update::request_path(&f.rt.state_dir), serde_json::to_vec(&request).unwrap())
            .unwrap();
        let updating = poll_request(&f.rt, Vec::new(), None);
        assert_eq!(
            (updating.wait_secs, updating.pending_update.as_deref()),
            (UPDATE_POLL_WAIT_SECS, Some("9.9.9"))
        );
    }
}
