//! Logging: whole-sentence messages with structured fields to journald, every field
//! prefixed `BYOC_` (`journalctl BYOC_JOB_ID=…`), INFO at priority 6; or to stderr
//! when journald is absent or not wanted. Audit records are mirrored by [`audit_entry`]
//! with a `MESSAGE_ID` per audit event, which `byoc-runner journal-catalog` explains
//! (the package installs it for `journalctl -x`).

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use tracing_journald::{Priority, PriorityMappings};

use crate::config::LogTarget;

const FIELD_PREFIX: &str = "BYOC";
const IDENTIFIER: &str = "byoc-runner";
/// Set once the daemon logs to journald: audit records then go there directly.
static TO_JOURNALD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Install the global subscriber. Returns which sink was chosen.
pub fn init(target: LogTarget, level: &str) -> &'static str {
    let filter = || EnvFilter::try_new(level).unwrap_or_else(|_| EnvFilter::new("info"));
    let journald = match target {
        LogTarget::Stderr => None,
        LogTarget::Auto | LogTarget::Journald => tracing_journald::layer().ok().map(|l| {
            l.with_field_prefix(Some(FIELD_PREFIX.into()))
                .with_syslog_identifier(IDENTIFIER.into())
                .with_priority_mappings(PriorityMappings {
                    error: Priority::Error,
                    warn: Priority::Warning,
                    info: Priority::Informational,
                    debug: Priority::Debug,
                    trace: Priority::Debug,
                })
        }),
    };
    match journald {
        Some(layer) => {
            let _ = tracing_subscriber::registry().with(filter()).with(layer).try_init();
            let _ = TO_JOURNALD.set(true);
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
                tracing::warn!("Journald socket not available; logging to stderr.");
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

/// The job a task runs: its audit entries carry the same job fields as its log lines
/// (which get them from the job's span).
#[derive(Debug, Clone)]
pub struct JobFields {
    pub job_id: String,
    pub install_id: String,
    pub kind: String,
    pub operation: String,
    pub role: String,
}

impl JobFields {
    pub fn of(p: &byoc_protocol::JobPayload) -> JobFields {
        JobFields {
            job_id: p.job_id.clone(),
            install_id: p.install_id.clone(),
            kind: p.kind.clone(),
            operation: p.operation.clone(),
            role: p.requested_role.clone().unwrap_or_else(|| "none".into()),
        }
    }
}

tokio::task_local! {
    pub static JOB: JobFields;
}

/// The `MESSAGE_ID` of an audit event's journal entries: 128 bits derived from its
/// name, the same on every runner and release.
pub fn audit_message_id(event: &str) -> String {
    let digest =
        <sha2::Sha256 as sha2::Digest>::digest(format!("byoc-runner audit event {event}").as_bytes());
    hex::encode(&digest[..16])
}

/// Events that are a warning whatever their fields say: something was refused, denied,
/// cut short or undone.
const WARNING_EVENTS: &[&str] = &[
    "job_rejected",
    "job_claim_refused",
    "job_cancelled",
    "job_interrupted",
    "job_fenced",
    "denied",
    "role_assume_failed",
    "update_rolled_back",
    "update_refused",
    "artifact_sync_failed",
    "state_unlock_failed",
    "audit_export_failed",
    "customer_record_invalid",
];

/// Job statuses that did not succeed.
const FAILED_STATUSES: &[&str] = &["failed", "timed_out", "cancelled", "interrupted", "rejected", "denied"];

/// An audit record's journal priority, from its outcome rather than its name: 4
/// (warning) for a failure, timeout, denial, refusal or rollback, else 6.
pub fn audit_priority(r: &byoc_audit::log::Record) -> u8 {
    let denied_plan =
        r.event == "policy_decision" && r.detail.as_deref().is_some_and(|d| d.starts_with("deny"));
    let failed = r.status.as_deref().is_some_and(|s| FAILED_STATUSES.contains(&s));
    if WARNING_EVENTS.contains(&r.event.as_str()) || r.event.ends_with("_failed") || failed || denied_plan {
        4
    } else {
        6
    }
}

/// Mirror one audit record to the journal: a sentence, the event's `MESSAGE_ID`,
/// the priority of its outcome ([`audit_priority`]) and `BYOC_` fields. Through
/// journald's socket when the daemon logs there; otherwise as an ordinary log line.
pub fn audit_entry(seq: u64, r: &byoc_audit::log::Record) {
    let sentence = audit_sentence(seq, r);
    let warning = audit_priority(r) <= 4;
    if TO_JOURNALD.get().copied().unwrap_or(false) {
        let mut fields: Vec<(&str, String)> = vec![
            ("MESSAGE", sentence.clone()),
            ("MESSAGE_ID", audit_message_id(&r.event)),
            ("PRIORITY", audit_priority(r).to_string()),
            ("SYSLOG_IDENTIFIER", IDENTIFIER.into()),
            ("BYOC_AUDIT_SEQ", seq.to_string()),
            ("BYOC_AUDIT_EVENT", r.event.clone()),
        ];
        // The running job's fields where the record leaves them out.
        let job = JOB.try_with(|f| f.clone()).ok().filter(|f| r.job.as_ref() == Some(&f.job_id));
        let or_job = |own: &Option<String>, from: fn(&JobFields) -> &String| {
            own.clone().filter(|v| !v.is_empty()).or_else(|| job.as_ref().map(|j| from(j).clone()))
        };
        let optional = [
            ("BYOC_JOB_ID", r.job.clone()),
            ("BYOC_INSTALL_ID", job.as_ref().map(|j| j.install_id.clone())),
            ("BYOC_KIND", or_job(&r.kind, |j| &j.kind)),
            ("BYOC_OPERATION", or_job(&r.operation, |j| &j.operation)),
            ("BYOC_ENTITY", r.entity.clone()),
            ("BYOC_ROLE", or_job(&r.role, |j| &j.role)),
            ("BYOC_STATUS", r.status.clone()),
            ("BYOC_REASON", r.reason.clone()),
        ];
        fields.extend(optional.into_iter().filter_map(|(k, v)| v.filter(|v| !v.is_empty()).map(|v| (k, v))));
        if journal_send(&fields).is_ok() {
            return;
        }
    }
    if warning {
        tracing::warn!(audit_seq = seq, audit_event = %r.event, job_id = r.job.as_deref().unwrap_or(""), "{sentence}");
    } else {
        tracing::info!(audit_seq = seq, audit_event = %r.event, job_id = r.job.as_deref().unwrap_or(""), "{sentence}");
    }
}

/// `Audit record 12, job_finished: job job-1 (action.script), status failed, exit code 3: log 40 bytes.`
pub fn audit_sentence(seq: u64, r: &byoc_audit::log::Record) -> String {
    let mut s = format!("Audit record {seq}, {}", r.event);
    if let Some(job) = r.job.as_deref().filter(|j| !j.is_empty()) {
        s.push_str(&format!(": job {job}"));
        if let Some(kind) = r.kind.as_deref().filter(|k| !k.is_empty()) {
            s.push_str(&format!(
                " ({kind}{})",
                r.operation.as_deref().map(|o| format!(" {o}")).unwrap_or_default()
            ));
        }
    }
    for (label, value) in [("role", &r.role), ("status", &r.status), ("reason", &r.reason)] {
        if let Some(v) = value.as_deref().filter(|v| !v.is_empty()) {
            s.push_str(&format!(", {label} {v}"));
        }
    }
    if let Some(code) = r.exit_code {
        s.push_str(&format!(", exit code {code}"));
    }
    if let Some(detail) = r.detail.as_deref().filter(|d| !d.is_empty()) {
        s.push_str(&format!(": {detail}"));
    }
    if !s.ends_with('.') {
        s.push('.');
    }
    s
}

/// One entry in journald's native protocol: `NAME=value` lines, or for a value with a
/// newline the name, its length (64-bit little-endian) and the bytes.
fn journal_send(fields: &[(&str, String)]) -> std::io::Result<()> {
    let mut datagram = Vec::new();
    for (name, value) in fields {
        datagram.extend_from_slice(name.as_bytes());
        if value.contains('\n') {
            datagram.push(b'\n');
            datagram.extend_from_slice(&(value.len() as u64).to_le_bytes());
        } else {
            datagram.push(b'=');
        }
        datagram.extend_from_slice(value.as_bytes());
        datagram.push(b'\n');
    }
    let socket = std::os::unix::net::UnixDatagram::unbound()?;
    socket.send_to(&datagram, "/run/systemd/journal/socket").map(drop)
}

/// The journal catalog (`/usr/lib/systemd/catalog/byoc-runner.catalog`): what each
/// audit event's entries mean, for `journalctl -x`.
pub fn journal_catalog() -> String {
    let mut out = String::from(
        "# byoc-runner: the signed audit log's events, mirrored to the journal.\n\
         # Generated by `byoc-runner journal-catalog`; installed by the package.\n",
    );
    for (event, meaning) in crate::audit::EVENTS {
        out.push_str(&format!(
            "\n-- {}\nSubject: byoc-runner audit: {event}\nDefined-By: byoc-runner\nDocumentation: man:byoc-runner(8)\n\n\
             {meaning}\n\n\
             Every audit record is also kept in the runner's signed, tamper-evident audit log;\n\
             `byoc-runner audit tail` shows it and `byoc-runner audit verify` checks it.\n",
            audit_message_id(event)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_audit_record_reads_as_a_sentence() {
        let r = byoc_audit::log::Record {
            event: "job_finished".into(),
            job: Some("job-1".into()),
            kind: Some("action.script".into()),
            status: Some("failed".into()),
            exit_code: Some(3),
            detail: Some("log 12 bytes".into()),
            ..Default::default()
        };
        assert_eq!(
            audit_sentence(7, &r),
            "Audit record 7, job_finished: job job-1 (action.script), status failed, exit code 3: log 12 bytes."
        );
    }

    #[test]
    fn a_records_priority_follows_its_outcome_not_its_name() {
        let r = |event: &str, status: Option<&str>, detail: Option<&str>| byoc_audit::log::Record {
            event: event.into(),
            status: status.map(str::to_string),
            detail: detail.map(str::to_string),
            ..Default::default()
        };
        for warning in [
            r("job_finished", Some("failed"), None),
            r("job_finished", Some("timed_out"), None),
            r("job_finished", Some("cancelled"), None),
            r("job_interrupted", None, None),
            r("denied", None, Some("by alice: not now")),
            r("policy_decision", None, Some("deny: 2 violations")),
            r("update_rolled_back", None, None),
            r("job_rejected", None, None),
            r("artifact_sync_failed", None, None),
        ] {
            assert_eq!(audit_priority(&warning), 4, "{warning:?}");
        }
        for info in [
            r("job_finished", Some("succeeded"), None),
            r("policy_decision", None, Some("allow: 0 violations")),
            r("approved", None, None),
            r("job_started", None, None),
        ] {
            assert_eq!(audit_priority(&info), 6, "{info:?}");
        }
    }

    #[test]
    fn every_catalogued_event_has_its_own_message_id() {
        let ids: std::collections::BTreeSet<String> =
            crate::audit::EVENTS.iter().map(|(e, _)| audit_message_id(e)).collect();
        assert_eq!(ids.len(), crate::audit::EVENTS.len());
        assert!(ids.iter().all(|id| id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit())));
        let catalog = journal_catalog();
        for (event, _) in crate::audit::EVENTS {
            assert!(
                catalog.contains(&format!(
                    "-- {}\nSubject: byoc-runner audit: {event}\n",
                    audit_message_id(event)
                ))
            );
        }
    }
}
