//! `[runner]`, `[poll]`, `[jobs]`, `[logging]`: the daemon's own identity, pace and limits.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use super::DEFAULT_STATE_DIR;
use super::fields::Fields;

#[derive(Debug, Clone)]
pub struct RunnerConfig {
    pub state_dir: PathBuf,
    pub install_id: String,
    pub bootstrap_token_file: Option<PathBuf>,
    pub hostname: Option<String>,
}

impl RunnerConfig {
    /// `None` when the install id is missing (the problem is recorded).
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Option<Self> {
        let mut f = Fields::new("runner", table, problems);
        let state_dir =
            PathBuf::from(f.get::<String>("state_dir").unwrap_or_else(|| DEFAULT_STATE_DIR.into()));
        let install_id: Option<String> = f.required("install_id");
        let bootstrap_token_file = f.get::<String>("bootstrap_token_file").map(PathBuf::from);
        let hostname: Option<String> = f.get("hostname");
        f.require_absolute("state_dir", &state_dir);
        f.finish();
        Some(RunnerConfig { state_dir, install_id: install_id?, bootstrap_token_file, hostname })
    }
}

#[derive(Debug, Clone)]
pub struct PollConfig {
    pub wait: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

impl PollConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("poll", table, problems);
        let wait = f.secs("wait_secs", 30, 1..=60);
        let backoff_initial = Duration::from_millis(f.ranged("backoff_initial_ms", 500, 10..=60_000));
        let backoff_max = f.secs("backoff_max_secs", 30, 1..=3600);
        let problems = f.finish();
        if backoff_initial > backoff_max {
            problems.push("poll.backoff_initial_ms: larger than poll.backoff_max_secs".into());
        }
        PollConfig { wait, backoff_initial, backoff_max }
    }
}

#[derive(Debug, Clone)]
pub struct JobsConfig {
    pub drain_grace: Duration,
    pub kill_grace: Duration,
    pub heartbeat_interval: Duration,
    pub max_clock_skew: Duration,
    pub max_timeout: Duration,
    /// A job's log on disk: past it only the head and the tail are kept.
    pub log_max_bytes: u64,
    /// Acknowledged job logs older than this are removed (`None`: kept forever).
    pub log_retention: Option<Duration>,
    /// Settled jobs the journal keeps; older ones move to `journal-archive/`.
    pub journal_keep: usize,
    /// Journal archives whose newest line is older than this are removed (`None`:
    /// kept forever).
    pub journal_archive_retention: Option<Duration>,
    /// Concurrency limit per job group.
    pub groups: BTreeMap<String, usize>,
}

impl JobsConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("jobs", table, problems);
        let drain_grace = f.secs("drain_grace_secs", 300, 0..=86_400);
        let kill_grace = f.secs("kill_grace_secs", 10, 1..=600);
        let heartbeat_interval = f.secs("heartbeat_secs", 15, 1..=300);
        let max_clock_skew = f.secs("max_clock_skew_secs", 60, 0..=3600);
        let max_timeout = f.secs("max_timeout_secs", 6 * 3600, 1..=7 * 86_400);
        let log_max_bytes = f.ranged("log_max_mib", 256, 1..=1024 * 1024) << 20;
        let retention_days = f.ranged("log_retention_days", 30, 0..=36_500);
        let log_retention = (retention_days > 0).then(|| Duration::from_secs(retention_days * 86_400));
        let journal_keep = f.ranged("journal_keep", 1000, 10..=1_000_000) as usize;
        let archive_days = f.ranged("journal_archive_days", 365, 0..=36_500);
        let journal_archive_retention =
            (archive_days > 0).then(|| Duration::from_secs(archive_days * 86_400));
        let groups_t = f.table("groups");
        let problems = f.finish();
        let mut groups = BTreeMap::new();
        let mut g = Fields::new("jobs.groups", groups_t, problems);
        for (group, default) in [("deploys", 1), ("actions", 4), ("syncs", 2)] {
            groups.insert(group.to_string(), g.ranged(group, default, 1..=64) as usize);
        }
        g.finish();
        JobsConfig {
            drain_grace,
            kill_grace,
            heartbeat_interval,
            max_clock_skew,
            max_timeout,
            log_max_bytes,
            log_retention,
            journal_keep,
            journal_archive_retention,
            groups,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogTarget {
    Auto,
    Journald,
    Stderr,
}

#[derive(Debug, Clone)]
pub struct LoggingConfig {
    pub target: LogTarget,
    pub level: String,
}

impl LoggingConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("logging", table, problems);
        let target = match f.get::<String>("target").as_deref() {
            None | Some("auto") => LogTarget::Auto,
            Some("journald") => LogTarget::Journald,
            Some("stderr") => LogTarget::Stderr,
            Some(other) => {
                f.problem(format!("logging.target: {other:?} is not one of auto, journald, stderr"));
                LogTarget::Auto
            }
        };
        let level = f.get::<String>("level").unwrap_or_else(|| "info".into());
        let problems = f.finish();
        if tracing_subscriber::EnvFilter::try_new(&level).is_err() {
            problems
                .push(format!("logging.level: {level:?} is not a valid filter (try \"info\" or \"debug\")"));
        }
        LoggingConfig { target, level }
    }
}
