//! Logging: structured fields to journald (no field prefix, so `JOB_ID=…` matches
//! `journalctl JOB_ID=…`), or to stderr when journald is absent or not wanted.

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::config::LogTarget;

/// Install the global subscriber. Returns which sink was chosen.
pub fn init(target: LogTarget, level: &str) -> &'static str {
    let filter = || EnvFilter::try_new(level).unwrap_or_else(|_| EnvFilter::new("info"));
    let journald = match target {
        LogTarget::Stderr => None,
        LogTarget::Auto | LogTarget::Journald => tracing_journald::layer()
            .ok()
            .map(|l| l.with_field_prefix(None).with_syslog_identifier("byoc-runner".into())),
    };
    match journald {
        Some(layer) => {
            let _ = tracing_subscriber::registry().with(filter()).with(layer).try_init();
            "journald"
        }
        None => {
            let _ = tracing_subscriber::registry()
                .with(filter())
                .with(
                    tracing_subscriber::fmt::layer()
                        .with_ansi(colour_on_stderr())
                        .with_writer(std::io::stderr)
                        .with_target(false),
                )
                .try_init();
            if target == LogTarget::Journald {
                tracing::warn!("journald socket not available; logging to stderr");
            }
            "stderr"
        }
    }
}

/// For CLI commands: plain stderr at warn unless RUST_LOG says otherwise.
pub fn init_cli() {
    let _ = tracing_subscriber::fmt()
        .with_ansi(colour_on_stderr())
        .with_writer(std::io::stderr)
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")))
        .try_init();
}

/// Colour only for a person at a terminal, and never when `NO_COLOR` is set
/// (no-color.org): never escape codes in a pipe, a file or the journal.
fn colour_on_stderr() -> bool {
    use std::io::IsTerminal as _;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
