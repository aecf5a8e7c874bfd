//! The numbers an operator watches, in Prometheus' text format: written by the daemon
//! to a file for node_exporter's textfile collector (`[metrics] textfile`, replaced
//! atomically every 15 s) and printed by `byoc-runner metrics`. Everything is read from
//! the state dir (journal, audit log, disk), so the command works with the daemon
//! stopped and both say the same.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead as _, Seek as _};
use std::path::Path;

use serde::Serialize;

use crate::inspect;
use crate::state_dir::StateDir;

/// Counts of audit events, read incrementally (the daemon keeps one and reads only
/// what was appended since).
#[derive(Debug, Default, Clone)]
pub struct AuditTally {
    offset: u64,
    pub records: u64,
    pub role_assumed: u64,
    pub role_assume_failed: u64,
    /// `policy_decision` records by verdict.
    pub policy: BTreeMap<String, u64>,
    /// Jobs that ended, by status (from the audit log: it is never compacted, so this
    /// only grows, as a counter must).
    pub finished: BTreeMap<String, u64>,
}

impl AuditTally {
    /// Read the whole records appended since the last call.
    pub fn update(&mut self, audit_dir: &Path) -> std::io::Result<()> {
        #[derive(serde::Deserialize)]
        struct Seen {
            event: String,
            #[serde(default)]
            detail: Option<String>,
            #[serde(default)]
            status: Option<String>,
        }
        let mut f = match std::fs::File::open(audit_dir.join(byoc_audit::log::LOG)) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        f.seek(std::io::SeekFrom::Start(self.offset))?;
        let mut reader = std::io::BufReader::new(f);
        let mut line = Vec::new();
        loop {
            line.clear();
            let n = reader.read_until(b'\n', &mut line)?;
            if n == 0 || line.last() != Some(&b'\n') {
                return Ok(()); // a record being written: next time
            }
            self.offset += n as u64;
            self.records += 1;
            let Ok(seen) = serde_json::from_slice::<Seen>(&line) else { continue };
            match seen.event.as_str() {
                "job_finished" | "job_cancelled" | "job_interrupted" => {
                    let status = seen.status.unwrap_or_else(|| "unknown".into());
                    *self.finished.entry(status).or_default() += 1;
                }
                "role_assumed" => self.role_assumed += 1,
                "role_assume_failed" => self.role_assume_failed += 1,
                "policy_decision" => {
                    let verdict =
                        seen.detail.as_deref().and_then(|d| d.split(':').next()).unwrap_or("unknown");
                    *self.policy.entry(verdict.to_string()).or_default() += 1;
                }
                _ => {}
            }
        }
    }
}

/// One sample: a metric's name, labels and value.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub name: &'static str,
    pub labels: BTreeMap<&'static str, String>,
    pub value: f64,
}

/// A metric: its samples with their help and type lines.
pub struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    samples: Vec<Sample>,
}

fn family(name: &'static str, kind: &'static str, help: &'static str) -> Family {
    Family { name, kind, help, samples: Vec::new() }
}

impl Family {
    fn add(&mut self, labels: &[(&'static str, String)], value: f64) {
        self.samples.push(Sample { name: self.name, labels: labels.iter().cloned().collect(), value });
    }
}

/// Every metric, from the state dir as it is now.
pub fn collect(
    state_dir: &Path,
    disk: &crate::disk::DiskSettings,
    tally: &AuditTally,
    now_ms: u64,
) -> Result<Vec<Family>, inspect::InspectError> {
    // The journal read once for every figure.
    let index = inspect::load_index(state_dir)?;
    let st = inspect::status_of(state_dir, &index)?;
    let mut out = Vec::new();

    job_families(&st, &index, &mut out);
    audit_families(state_dir, tally, now_ms, &mut out);
    host_families(state_dir, disk, &st, &mut out);
    Ok(out)
}

/// The journal's figures: the daemon, jobs by status, refusals, pickup.
fn job_families(st: &inspect::Status, index: &crate::journal::Index, out: &mut Vec<Family>) {
    let mut f =
        family("byoc_runner_daemon_running", "gauge", "1 while the runner daemon's process is alive.");
    f.add(&[], f64::from(u8::from(st.daemon_running)));
    out.push(f);

    let mut f = family(
        "byoc_runner_jobs",
        "gauge",
        "Jobs in the local journal, by status (or phase while unfinished).",
    );
    for (status, n) in &st.jobs_by_status {
        f.add(&[("status", status.clone())], *n as f64);
    }
    out.push(f);

    let mut f = family("byoc_runner_jobs_running", "gauge", "Jobs claimed or started and not finished.");
    f.add(&[], st.jobs_running.len() as f64);
    out.push(f);

    let mut f = family(
        "byoc_runner_jobs_unreported",
        "gauge",
        "Finished jobs whose result the control plane has not acknowledged.",
    );
    f.add(&[], st.jobs_unreported.len() as f64);
    out.push(f);

    let mut by_reason: BTreeMap<String, u64> = BTreeMap::new();
    for r in &index.rejections {
        *by_reason.entry(r.reason.code().to_string()).or_default() += 1;
    }
    let mut f = family(
        "byoc_runner_rejections",
        "gauge",
        "Deliveries refused, by reason code (the journal's record).",
    );
    for (reason, n) in by_reason {
        f.add(&[("reason", reason)], n as f64);
    }
    out.push(f);

    // Pickup: received → started, over the most recent 1,000 jobs that started.
    let mut pickup: Vec<u64> = index
        .order
        .iter()
        .rev()
        .filter_map(|id| index.jobs.get(id))
        .filter_map(|j| j.started_at_ms.map(|s| s.saturating_sub(j.received_at_ms)))
        .take(1000)
        .collect();
    pickup.sort_unstable();
    let mut f = family(
        "byoc_runner_pickup_seconds",
        "summary",
        "Delivery received to job started, over the most recent 1,000 jobs that started.",
    );
    if !pickup.is_empty() {
        for q in [0.5, 0.99] {
            let v = pickup[((pickup.len() - 1) as f64 * q).round() as usize];
            f.add(&[("quantile", q.to_string())], v as f64 / 1000.0);
        }
    }
    out.push(f);
}

/// The audit log's figures: jobs ended, role sessions, policy verdicts, records and
/// the control plane's cosignatures.
fn audit_families(state_dir: &Path, tally: &AuditTally, now_ms: u64, out: &mut Vec<Family>) {
    let mut f = family(
        "byoc_runner_jobs_finished_total",
        "counter",
        "Jobs that ended, by status (audit log; unlike byoc_runner_jobs, archiving does not lower it).",
    );
    for (status, n) in &tally.finished {
        f.add(&[("status", status.clone())], *n as f64);
    }
    out.push(f);

    let mut f = family(
        "byoc_runner_role_assumptions_total",
        "counter",
        "Role sessions for jobs, by result (audit log).",
    );
    f.add(&[("result", "assumed".into())], tally.role_assumed as f64);
    f.add(&[("result", "failed".into())], tally.role_assume_failed as f64);
    out.push(f);

    let mut f = family(
        "byoc_runner_policy_decisions_total",
        "counter",
        "Policy decisions on plans and manifests, by verdict (audit log).",
    );
    for verdict in ["allow", "deny"] {
        f.add(&[("verdict", verdict.into())], tally.policy.get(verdict).copied().unwrap_or(0) as f64);
    }
    out.push(f);

    let audit_dir = StateDir::of(state_dir).audit();
    let mut f = family("byoc_runner_audit_records", "gauge", "Records in the signed audit log.");
    f.add(&[], tally.records as f64);
    out.push(f);
    let mut f = family(
        "byoc_runner_audit_acknowledged_records",
        "gauge",
        "Audit records the control plane has cosigned.",
    );
    f.add(&[], byoc_audit::log::acknowledged_size(&audit_dir) as f64);
    out.push(f);
    // The customer's audit copies: one sample per sink and figure.
    let exports = crate::audit_export::status(state_dir);
    type Figure = fn(&crate::audit_export::ExportStatus, u64) -> Option<f64>;
    let figures: [(&'static str, &'static str, &'static str, Figure); 4] = [
        (
            "byoc_runner_audit_export_lag_records",
            "gauge",
            "Signed audit records a customer's sink (s3, cloudwatch, otlp) does not hold yet.",
            |e, _| Some(e.lag_records as f64),
        ),
        (
            "byoc_runner_audit_export_failing",
            "gauge",
            "1 while a customer's audit sink refuses the copy (jobs go on; it catches up).",
            |e, _| Some(if e.failing_since_ms.is_some() { 1.0 } else { 0.0 }),
        ),
        (
            "byoc_runner_audit_export_errors_total",
            "counter",
            "Failed deliveries to a customer's audit sink.",
            |e, _| Some(e.errors_total as f64),
        ),
        (
            "byoc_runner_audit_export_last_success_age_seconds",
            "gauge",
            "Seconds since a customer's audit sink last took the copy (absent: never).",
            |e, now| e.last_success_ms.map(|at| now.saturating_sub(at) as f64 / 1000.0),
        ),
    ];
    for (name, kind, help, figure) in figures {
        let mut f = family(name, kind, help);
        for e in &exports {
            if let Some(v) = figure(e, now_ms) {
                f.add(&[("sink", e.sink.clone())], v);
            }
        }
        out.push(f);
    }
    let mut f = family(
        "byoc_runner_audit_last_acknowledgement_age_seconds",
        "gauge",
        "Seconds since the control plane last cosigned the audit log (absent: never).",
    );
    if let Ok(modified) =
        std::fs::metadata(audit_dir.join(byoc_audit::log::COSIGNED)).and_then(|m| m.modified())
    {
        let at = modified.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        f.add(&[], now_ms.saturating_sub(at) as f64 / 1000.0);
    }
    out.push(f);
}

/// The host's figures: disk, the state dir's parts, the daemon's memory.
fn host_families(
    state_dir: &Path,
    disk: &crate::disk::DiskSettings,
    st: &inspect::Status,
    out: &mut Vec<Family>,
) {
    let check = disk.check(state_dir);
    let mut f = family("byoc_runner_disk_free_bytes", "gauge", "Free bytes on the state dir's filesystem.");
    if let Some(free) = check.free_bytes {
        f.add(&[], free as f64);
    }
    out.push(f);
    let mut f = family("byoc_runner_disk_low", "gauge", "1 while new jobs are refused with disk_low.");
    f.add(&[], f64::from(u8::from(check.low.is_some())));
    out.push(f);
    let mut f = family("byoc_runner_state_bytes", "gauge", "Bytes the state dir holds, by part.");
    for (part, bytes) in &st.disk_use {
        f.add(&[("part", (*part).to_string())], *bytes as f64);
    }
    out.push(f);

    let mut f = family("byoc_runner_resident_memory_bytes", "gauge", "Resident memory of the runner daemon.");
    if let Some(kib) = st.daemon_pid.and_then(rss_kib) {
        f.add(&[], (kib * 1024) as f64);
    }
    out.push(f);
}

fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Prometheus text exposition format 0.0.4.
pub fn render(families: &[Family]) -> String {
    let mut out = String::new();
    for f in families {
        let _ = writeln!(out, "# HELP {} {}", f.name, f.help);
        let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind);
        for s in &f.samples {
            let labels: Vec<String> = s
                .labels
                .iter()
                .map(|(k, v)| {
                    format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n"))
                })
                .collect();
            let labels = if labels.is_empty() { String::new() } else { format!("{{{}}}", labels.join(",")) };
            let _ = writeln!(out, "{}{labels} {}", s.name, s.value);
        }
    }
    out
}

/// The samples alone (for `-o json`).
pub fn samples(families: &[Family]) -> Vec<&Sample> {
    families.iter().flat_map(|f| &f.samples).collect()
}

/// Replace `path` with `text` atomically (node_exporter must never read half a file).
/// The directory is the customer's (node_exporter's textfile collector may own it).
pub fn write_textfile(path: &Path, text: &str) -> std::io::Result<()> {
    byoc_statefs::write(path, text.as_bytes(), byoc_statefs::Options { mode: 0o644, check_owner: false })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_format_has_help_type_and_escaped_labels() {
        let mut f = family("byoc_runner_test", "gauge", "A test.");
        f.add(&[("reason", "a\"b\\c".into())], 2.0);
        f.add(&[], 1.5);
        let text = render(&[f]);
        assert_eq!(
            text,
            "# HELP byoc_runner_test A test.\n# TYPE byoc_runner_test gauge\nbyoc_runner_test{reason=\"a\\\"b\\\\c\"} 2\nbyoc_runner_test 1.5\n"
        );
    }

    #[test]
    fn the_audit_tally_reads_only_whole_new_records() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join(byoc_audit::log::LOG);
        std::fs::write(
            &log,
            "{\"event\":\"role_assumed\"}\n{\"event\":\"policy_decision\",\"detail\":\"deny: 1 violations\"}\n{\"event\":\"pol",
        )
        .expect("log");
        let mut t = AuditTally::default();
        t.update(dir.path()).expect("tally");
        assert_eq!((t.records, t.role_assumed, t.policy.get("deny").copied()), (2, 1, Some(1)));
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).expect("append");
        f.write_all(b"icy_decision\",\"detail\":\"allow: 0 violations\"}\n").expect("append");
        t.update(dir.path()).expect("tally");
        assert_eq!((t.records, t.policy.get("allow").copied()), (3, Some(1)));
    }
}
