//! `jobs list|show|logs|rejections`: the local journal and log spool, read-only.

use std::io::Write as _;

use clap::Subcommand;

use super::{Output, StateArgs, print_json, state_dir};
use crate::inspect;
use crate::state_dir::StateDir;

#[derive(Subcommand)]
pub(super) enum JobsCmd {
    /// List jobs, newest first
    ///
    /// Examples: byoc-runner jobs list --status failed --since 1d;
    /// byoc-runner jobs list --kind terraform -o json
    List {
        #[command(flatten)]
        state: StateArgs,
        /// At most this many jobs.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Include jobs archived from the journal (past jobs.journal_keep).
        #[arg(long)]
        all: bool,
        /// Only jobs with this status as listed: succeeded, failed, timed_out,
        /// cancelled, interrupted, running, received, rejected, awaiting_approval, …
        #[arg(long)]
        status: Option<String>,
        /// Only jobs of this kind (terraform, action.script, …).
        #[arg(long)]
        kind: Option<String>,
        /// Only jobs received since a time (2026-11-27T09:00:00Z, 2026-11-27) or for a
        /// while (90s, 30m, 2h, 7d).
        #[arg(long, value_name = "TIME")]
        since: Option<String>,
    },
    /// One job: its record, what was judged, its audit trail
    ///
    /// A job refused before the runner kept a record of it shows its rejection and
    /// what the audit log says of it.
    ///
    /// Example: byoc-runner jobs show job-01J…
    Show {
        #[command(flatten)]
        state: StateArgs,
        /// The job's id, or a prefix of it that names one job.
        job_id: String,
    },
    /// Print a job's log from the local spool
    ///
    /// The log's last line is the runner's account of how the job ended. A job that
    /// never ran has no log: the command says why on stderr.
    ///
    /// Examples: byoc-runner jobs logs -f JOB; byoc-runner jobs logs JOB --tail 20 --timestamps
    Logs {
        #[command(flatten)]
        state: StateArgs,
        /// The job's id, or a prefix of it that names one job.
        job_id: String,
        /// Keep printing as the job writes, until it ends (past the log cap, the
        /// omission marker and the tail arrive when it ends).
        #[arg(long, short = 'f')]
        follow: bool,
        /// Only the last N lines (with -f: then what follows).
        #[arg(long, short = 'n', value_name = "N")]
        tail: Option<usize>,
        /// Only lines written since a time (2026-11-27T09:00:00Z) or for a while (30m).
        #[arg(long, value_name = "TIME")]
        since: Option<String>,
        /// Begin each line with the time the runner wrote it (RFC 3339, UTC).
        #[arg(long, short = 't')]
        timestamps: bool,
    },
    /// Rejected deliveries with their reason codes, newest first
    ///
    /// Every job the runner refused (audit event job_rejected), with the reason code
    /// and what to fix.
    ///
    /// Example: byoc-runner jobs rejections --reason bad_signature --since 7d
    Rejections {
        #[command(flatten)]
        state: StateArgs,
        /// At most this many rejections.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Include refusals archived from the journal.
        #[arg(long)]
        all: bool,
        /// Only refusals with this reason code (bad_signature, expired, paused, …).
        #[arg(long)]
        reason: Option<String>,
        /// Only refusals since a time (2026-11-27T09:00:00Z, 2026-11-27) or for a
        /// while (90s, 30m, 2h, 7d).
        #[arg(long, value_name = "TIME")]
        since: Option<String>,
    },
}

pub(super) fn run(cmd: JobsCmd) -> anyhow::Result<()> {
    match cmd {
        JobsCmd::List { state, limit, all, status, kind, since } => {
            list(&state, limit, all, status, kind, since)
        }
        JobsCmd::Show { state, job_id } => show(&state, &job_id),
        JobsCmd::Logs { state, job_id, follow, tail, since, timestamps } => {
            // To a terminal, a job's control characters are shown, not obeyed: its output
            // cannot hide or rewrite the runner's last line.
            use std::io::IsTerminal as _;
            let escape = state.output == Output::Text && std::io::stdout().is_terminal();
            let view = LogView { tail, since: since_ms(since.as_deref())?, timestamps, escape };
            if follow && state.output != Output::Text {
                super::usage!("--follow prints the log as text; leave out -o json");
            }
            let dir = state_dir(&state)?;
            let job = match resolve(&dir, &job_id)? {
                Resolved::Job(job) => *job,
                Resolved::Rejected(Some(r)) => anyhow::bail!(
                    "job {job_id} has no log: it was rejected before it ran ({}: {}); `byoc-runner jobs show {job_id}`",
                    r.reason.code(),
                    r.detail
                ),
                Resolved::Rejected(None) => anyhow::bail!(
                    "job {job_id} has no log: the runner never kept a record of it (`byoc-runner jobs show {job_id}` shows what the audit log says)"
                ),
            };
            if follow {
                return follow_log(&dir, &job, &view);
            }
            logs(&dir, &job, &view, state.output)
        }
        JobsCmd::Rejections { state, limit, all, reason, since } => {
            rejections(&state, limit, all, reason, since)
        }
    }
}

fn list(
    state: &StateArgs,
    limit: usize,
    all: bool,
    status: Option<String>,
    kind: Option<String>,
    since: Option<String>,
) -> anyhow::Result<()> {
    let since = since_ms(since.as_deref())?;
    if let Some(s) = &status
        && !inspect::STATUS_LABELS.contains(&s.as_str())
    {
        super::usage!("--status {s:?}: one of {}", inspect::STATUS_LABELS.join(", "));
    }
    if let Some(k) = &kind
        && byoc_protocol::JobKind::parse(k).is_none()
    {
        let kinds: Vec<&str> = byoc_protocol::JobKind::ALL.iter().map(|k| k.as_str()).collect();
        super::usage!("--kind {k:?}: one of {}", kinds.join(", "));
    }
    let jobs = inspect::jobs(&state_dir(state)?, limit, all, |j| {
        status.as_ref().is_none_or(|s| inspect::status_label(j) == *s)
            && kind.as_ref().is_none_or(|k| j.kind == *k)
            && since.is_none_or(|t| j.received_at_ms >= t)
    })?;
    if state.output == Output::Json {
        return print_json(&jobs);
    }
    println!("{:<24} {:<16} {:<18} {:<21} {:>10}", "JOB", "KIND", "STATUS", "RECEIVED", "DURATION");
    for j in jobs {
        let dur = match (j.started_at_ms, j.finished.as_ref().map(|f| f.finished_at_ms)) {
            (Some(s), Some(f)) => format!("{:.1}s", f.saturating_sub(s) as f64 / 1000.0),
            _ => "-".into(),
        };
        println!(
            "{:<24} {:<16} {:<18} {:<21} {:>10}",
            j.job_id,
            j.kind,
            inspect::status_label(&j),
            crate::clock::rfc3339_ms(j.received_at_ms),
            dur
        );
    }
    Ok(())
}

/// One job's record, with what the audit log says of it: the role it ran under, what
/// was judged, its trail.
fn show(state: &StateArgs, job_id: &str) -> anyhow::Result<()> {
    let dir = state_dir(state)?;
    let j = match resolve(&dir, job_id)? {
        Resolved::Job(j) => *j,
        // Refused before the journal had a record of it: what the refusal and the
        // audit log say.
        Resolved::Rejected(_) => return show_rejected(state, &dir, job_id),
    };
    let job_id = j.job_id.as_str();
    // What the audit log says of it: the role it ran under and its trail.
    let trail = audit_trail(&dir, job_id);
    let role = trail.iter().rev().find_map(|r| r["role"].as_str().filter(|s| !s.is_empty()));
    let judged = judged(&trail);
    if state.output == Output::Json {
        let mut v = serde_json::to_value(&j)?;
        v["role"] = role.into();
        v["judged"] = judged.into();
        v["audit"] = trail.clone().into();
        return print_json(&v);
    }
    println!("job:        {}", j.job_id);
    println!("kind:       {} ({} {})", j.kind, j.entity, j.operation);
    println!(
        "effect:     {}",
        j.effect.as_deref().unwrap_or("- (received before the runner recorded effects)")
    );
    println!("component:  {}", j.component.as_deref().unwrap_or("-"));
    println!("role:       {}", role.unwrap_or("none (no role asked, or refused before one)"));
    println!("status:     {}", inspect::status_label(&j));
    println!("phase:      {}", j.phase.as_str());
    println!("received:   {}", crate::clock::rfc3339_ms(j.received_at_ms));
    if let Some(s) = j.started_at_ms {
        println!("started:    {}", crate::clock::rfc3339_ms(s));
    }
    if let Some(f) = &j.finished {
        println!("finished:   {}", crate::clock::rfc3339_ms(f.finished_at_ms));
        println!("exit code:  {}", f.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()));
        println!("log:        {} bytes, sha256 {}", f.log_size, f.log_sha256);
        if f.log_omitted > 0 {
            println!("            truncated: {} bytes omitted (jobs.log_max_mib)", f.log_omitted);
        }
        if let Some(e) = &f.error {
            println!("error:      {e}");
        }
    }
    if let Some(d) = &j.detail {
        println!("detail:     {d}");
    }
    println!("payload:    sha256 {}", j.payload_sha256);
    for d in &judged {
        println!(
            "judged:     {} {}, as JSON {}: {}",
            d["subject"].as_str().unwrap_or("?"),
            d["digest"].as_str().unwrap_or("?"),
            d["json_digest"].as_str().unwrap_or("?"),
            d["decision"].as_str().unwrap_or("?")
        );
    }
    print_trail(&trail);
    Ok(())
}

/// What an id typed on the command line names.
enum Resolved {
    /// A job in the journal: by its exact id, or by a prefix only no exact id has.
    Job(Box<crate::journal::JobRecord>),
    /// A job the runner refused before it journaled it (its rejection, if kept), or
    /// one only the audit log knows.
    Rejected(Option<crate::journal::Rejection>),
}

/// Exact ids first (the journal's, then a rejection's or an audit record's), a prefix
/// only then; a prefix that matched is said on stderr with the full id, so what is
/// shown is never silently another job than the one typed.
fn resolve(dir: &std::path::Path, id: &str) -> anyhow::Result<Resolved> {
    match inspect::job(dir, id) {
        Ok(j) => return Ok(Resolved::Job(Box::new(j))),
        Err(inspect::InspectError::NoSuchJob(_)) => {}
        Err(e) => return Err(e.into()),
    }
    let rejection = inspect::rejection_of(dir, id)?;
    if rejection.is_some() || !audit_trail(dir, id).is_empty() {
        return Ok(Resolved::Rejected(rejection));
    }
    let j = inspect::job_by_prefix(dir, id)?;
    eprintln!("(job {} is the one job whose id starts with {id})", j.job_id);
    Ok(Resolved::Job(Box::new(j)))
}

/// A job the runner refused before it journaled it (`role_mismatch`, a job already
/// finished here): its rejection and its audit trail, or "no such job" when neither
/// knows it.
fn show_rejected(state: &StateArgs, dir: &std::path::Path, job_id: &str) -> anyhow::Result<()> {
    let rejection = inspect::rejection_of(dir, job_id)?;
    let trail = audit_trail(dir, job_id);
    let Some(r) = rejection.as_ref() else {
        if trail.is_empty() {
            return Err(inspect::InspectError::NoSuchJob(job_id.into()).into());
        }
        return print_trail_only(state, job_id, &trail);
    };
    if state.output == Output::Json {
        return print_json(&serde_json::json!({
            "job_id": job_id,
            "status": "rejected",
            "rejection": r,
            "audit": trail,
        }));
    }
    println!("job:        {job_id}");
    println!("status:     rejected (before the runner kept a record of the job)");
    println!("reason:     {}", r.reason.code());
    println!("detail:     {}", r.detail);
    println!("delivery:   {}", r.delivery_id);
    println!("rejected:   {}", crate::clock::rfc3339_ms(r.ts));
    print_trail(&trail);
    Ok(())
}

fn print_trail_only(state: &StateArgs, job_id: &str, trail: &[serde_json::Value]) -> anyhow::Result<()> {
    if state.output == Output::Json {
        return print_json(&serde_json::json!({ "job_id": job_id, "audit": trail }));
    }
    println!("job:        {job_id} (not in the journal: what the audit log says of it)");
    print_trail(trail);
    Ok(())
}

fn print_trail(trail: &[serde_json::Value]) {
    if !trail.is_empty() {
        println!("audit:");
        for r in trail {
            println!("  {}", super::audit::record_line(&r.to_string()).trim_start());
        }
    }
}

fn rejections(
    state: &StateArgs,
    limit: usize,
    all: bool,
    reason: Option<String>,
    since: Option<String>,
) -> anyhow::Result<()> {
    let since = since_ms(since.as_deref())?;
    if let Some(r) = &reason
        && !byoc_protocol::RejectReason::ALL.iter().any(|c| c.code() == r)
    {
        let codes: Vec<&str> = byoc_protocol::RejectReason::ALL.iter().map(|c| c.code()).collect();
        super::usage!("--reason {r:?}: one of {}", codes.join(", "));
    }
    let rs = inspect::rejections(&state_dir(state)?, limit, all, |r| {
        reason.as_ref().is_none_or(|c| r.reason.code() == c.as_str()) && since.is_none_or(|t| r.ts >= t)
    })?;
    if state.output == Output::Json {
        return print_json(&rs);
    }
    println!("{:<21} {:<20} {:<24} DETAIL", "TIME", "REASON", "JOB");
    for r in rs {
        println!(
            "{:<21} {:<20} {:<24} {}",
            crate::clock::rfc3339_ms(r.ts),
            r.reason.code(),
            r.job_id.as_deref().unwrap_or("-"),
            r.detail
        );
    }
    Ok(())
}

fn since_ms(since: Option<&str>) -> anyhow::Result<Option<u64>> {
    since
        .map(|t| crate::clock::parse_since(t, crate::clock::now_ms()))
        .transpose()
        .map_err(|e| super::UsageError(format!("--since: {e}")).into())
}

/// What of a log to print: `--tail`, `--since`, `--timestamps`.
struct LogView {
    tail: Option<usize>,
    since: Option<u64>,
    timestamps: bool,
    /// Control characters as `^[` (as `cat -v`), for a terminal.
    escape: bool,
}

impl LogView {
    /// The lines of `bytes` (which start at `base` in the log) this view keeps, each
    /// with its write time when asked; `tail` applies when `first` (not to what -f adds).
    fn render(&self, bytes: &[u8], base: u64, marks: &[(u64, u64)], first: bool) -> Vec<u8> {
        let mut lines: Vec<(u64, &[u8])> = Vec::new();
        let mut at = 0usize;
        for piece in bytes.split_inclusive(|b| *b == b'\n') {
            lines.push((base + at as u64, piece));
            at += piece.len();
        }
        if let Some(since) = self.since {
            lines.retain(|(offset, _)| crate::spool::time_at(marks, *offset).is_some_and(|t| t >= since));
        }
        if first && let Some(n) = self.tail {
            let skip = lines.len().saturating_sub(n);
            lines.drain(..skip);
        }
        let mut out = Vec::with_capacity(bytes.len());
        for (offset, line) in lines {
            if self.timestamps {
                let stamp = crate::spool::time_at(marks, offset)
                    .map(crate::clock::rfc3339_millis)
                    .unwrap_or_else(|| "-".repeat(24));
                out.extend_from_slice(stamp.as_bytes());
                out.push(b' ');
            }
            if self.escape {
                escape_controls(line, &mut out);
            } else {
                out.extend_from_slice(line);
            }
        }
        out
    }

    fn needs_times(&self) -> bool {
        self.since.is_some() || self.timestamps
    }
}

/// `line` with its control characters but newline and tab written as `^X` (`^[` for
/// ESC, `^M` for CR, `^?` for DEL).
fn escape_controls(line: &[u8], out: &mut Vec<u8>) {
    for &b in line {
        match b {
            b'\n' | b'\t' => out.push(b),
            0..=0x1f => out.extend_from_slice(&[b'^', b + 0x40]),
            0x7f => out.extend_from_slice(b"^?"),
            _ => out.push(b),
        }
    }
}

/// `jobs logs` (not following): the log, or why there is none.
fn logs(
    dir: &std::path::Path,
    job: &crate::journal::JobRecord,
    view: &LogView,
    output: Output,
) -> anyhow::Result<()> {
    let log = inspect::log(dir, &job.job_id)?;
    let marks = crate::spool::read_times(dir, &job.job_id);
    if view.needs_times() && marks.is_empty() && !log.is_empty() {
        anyhow::bail!(
            "job {}'s log has no write times (it was written before the runner kept them): leave out --since and --timestamps",
            job.job_id
        );
    }
    let shown = view.render(&log, 0, &marks, true);
    let note = if log.is_empty() { Some(no_log_reason(job)) } else { None };
    if output == Output::Json {
        return print_json(&serde_json::json!({
            "job_id": job.job_id,
            "size": log.len(),
            "sha256": byoc_protocol::sha256_hex(&log),
            "log": String::from_utf8_lossy(&shown),
            "note": note,
        }));
    }
    if let Some(note) = note {
        eprintln!("{note}");
    }
    std::io::stdout().write_all(&shown)?;
    Ok(())
}

/// Why a job's log is empty, in a sentence that names what to do.
fn no_log_reason(j: &crate::journal::JobRecord) -> String {
    use crate::journal::Phase;
    let id = &j.job_id;
    let detail = j.detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default();
    match j.phase {
        Phase::Refused => format!(
            "job {id} has no log: it was rejected before it ran{detail} (`byoc-runner jobs show {id}`)"
        ),
        Phase::ClaimRefused => format!("job {id} has no log: the control plane did not let it run{detail}"),
        Phase::Received | Phase::Claimed => format!("job {id} has no log yet: it has not started"),
        Phase::WaitingWindow => format!("job {id} has no log yet: {}", waiting_for(j)),
        Phase::AwaitingApproval => format!("job {id} has no log yet: {}", waiting_for(j)),
        _ => format!("job {id} wrote nothing to its log"),
    }
}

/// What a held job waits for, and what the customer can do about it.
fn waiting_for(j: &crate::journal::JobRecord) -> String {
    match j.phase {
        crate::journal::Phase::AwaitingApproval => format!(
            "it waits for a local approval (`byoc-runner approvals show {0}`, then `byoc-runner approve {0}` or `deny`)",
            j.job_id
        ),
        _ => format!(
            "it waits for the customer's maintenance window to open{}",
            j.detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default()
        ),
    }
}

/// `jobs logs -f`: what the spool holds, then what the job adds, until the journal
/// says it ended (the omission marker and the tail of a log past its cap are written
/// then). Whole lines only while it runs. A poll every quarter second: this reads
/// files, it asks the daemon nothing.
fn follow_log(
    state_dir: &std::path::Path,
    job: &crate::journal::JobRecord,
    view: &LogView,
) -> anyhow::Result<()> {
    use std::io::{Read as _, Seek as _};
    let job_id = job.job_id.as_str();
    let path = crate::spool::spool_path(state_dir, job_id);
    let mut offset = 0u64;
    let mut first = true;
    let mut said_waiting = None;
    let mut out = std::io::stdout().lock();
    loop {
        // Read the journal first: whatever the spool holds after the job ended is all. A
        // job refused or not claimed ends without a result.
        let j = inspect::job(state_dir, job_id)?;
        let ended = j.finished.is_some()
            || matches!(j.phase, crate::journal::Phase::Refused | crate::journal::Phase::ClaimRefused);
        if matches!(j.phase, crate::journal::Phase::WaitingWindow | crate::journal::Phase::AwaitingApproval)
            && said_waiting != Some(j.phase)
        {
            eprintln!("[byoc-runner] job {job_id} {}", waiting_for(&j).trim_start_matches("it "));
            said_waiting = Some(j.phase);
        }
        match std::fs::File::open(&path) {
            Ok(mut f) => {
                f.seek(std::io::SeekFrom::Start(offset))?;
                let mut buf = Vec::new();
                f.read_to_end(&mut buf)?;
                // While it runs, up to the last whole line (the rest comes next time).
                let upto = if ended {
                    buf.len()
                } else {
                    buf.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1)
                };
                if upto > 0 || (ended && first) {
                    let marks = if view.needs_times() {
                        crate::spool::read_times(state_dir, job_id)
                    } else {
                        Vec::new()
                    };
                    out.write_all(&view.render(&buf[..upto], offset, &marks, first))?;
                    out.flush()?;
                    offset += upto as u64;
                    first = false;
                }
            }
            // Not written yet, or removed once reported and uploaded.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if ended && offset == 0 {
                    let log = inspect::log(state_dir, job_id)?;
                    if log.is_empty() {
                        eprintln!("{}", no_log_reason(&j));
                    }
                    out.write_all(&view.render(&log, 0, &[], true))?;
                }
            }
            Err(e) => return Err(e.into()),
        }
        if ended {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

/// What each policy decision of the job judged, from its `policy_decision` records: the
/// subject (`plan`, `manifests`, `deletions`) by digest, the digest of the JSON the
/// policies read (for a plan, the runner's rendering of it) and the verdict.
fn judged(trail: &[serde_json::Value]) -> Vec<serde_json::Value> {
    trail
        .iter()
        .filter(|r| r["event"] == "policy_decision")
        .filter_map(|r| {
            let digests = r["digests"].as_object()?;
            let (subject, digest) = digests
                .iter()
                .find(|(k, _)| !k.starts_with("policy:") && *k != "artifact" && !k.ends_with("_json"))?;
            Some(serde_json::json!({
                "subject": subject,
                "digest": digest,
                "json_digest": digests.get(&format!("{subject}_json")),
                "decision": r["detail"].as_str().unwrap_or_default(),
            }))
        })
        .collect()
}

/// The job's records in the audit log, oldest first (none when the log cannot be read:
/// `jobs show` is still the journal's view).
fn audit_trail(state_dir: &std::path::Path, job_id: &str) -> Vec<serde_json::Value> {
    let dir = StateDir::of(state_dir).audit();
    byoc_audit::log::read_lines(&dir, 0, u64::MAX)
        .unwrap_or_default()
        .iter()
        .filter(|l| l.contains(job_id))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["job"] == job_id)
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_jobs_control_characters_are_shown_not_obeyed_on_a_terminal() {
        let mut out = Vec::new();
        super::escape_controls(b"[runner] job succeeded\x1b[8m\r\tok\x7f\n", &mut out);
        assert_eq!(String::from_utf8(out).unwrap(), "[runner] job succeeded^[[8m^M\tok^?\n");
    }

    #[test]
    fn what_was_judged_comes_from_the_policy_decisions() {
        let trail = vec![
            serde_json::json!({"event": "job_started", "digests": {"payload": "sha256:p"}}),
            serde_json::json!({"event": "policy_decision", "detail": "allow: 0 violations",
                "digests": {"artifact": "sha256:a", "plan": "sha256:1", "plan_json": "sha256:2", "policy:x.rego": "sha256:3"}}),
        ];
        let judged = super::judged(&trail);
        assert_eq!(
            judged,
            vec![
                serde_json::json!({"subject": "plan", "digest": "sha256:1", "json_digest": "sha256:2", "decision": "allow: 0 violations"})
            ]
        );
    }
}
