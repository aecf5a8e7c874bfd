//! `jobs list|show|logs|rejections`: the local journal and log spool, read-only.

use std::io::Write as _;

use clap::Subcommand;

use super::{Output, StateArgs, print_json, state_dir};
use crate::inspect;
use crate::state_dir::StateDir;

#[derive(Subcommand)]
pub(super) enum JobsCmd {
    /// List jobs, newest first.
    ///
    /// Examples: byoc-runner jobs list --status failed --since 1d;
    /// byoc-runner jobs list --kind terraform -o json
    List {
        #[command(flatten)]
        state: StateArgs,
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Include jobs archived from the journal (past jobs.journal_keep).
        #[arg(long)]
        all: bool,
        /// Only jobs with this status as listed: succeeded, failed, timed_out,
        /// cancelled, interrupted, running, received, refused, waiting_window, …
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
    /// Show one job's journal record.
    Show {
        #[command(flatten)]
        state: StateArgs,
        job_id: String,
    },
    /// Print a job's log from the local spool.
    ///
    /// Example: byoc-runner jobs logs -f JOB
    Logs {
        #[command(flatten)]
        state: StateArgs,
        job_id: String,
        /// Keep printing as the job writes, until it ends (past the log cap, the
        /// omission marker and the tail arrive when it ends).
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// List refused deliveries with their reason codes, newest first.
    Rejections {
        #[command(flatten)]
        state: StateArgs,
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
        JobsCmd::Logs { state, job_id, follow: true } => {
            anyhow::ensure!(
                state.output == Output::Text,
                "--follow prints the log as text; leave out -o json"
            );
            follow_log(&state_dir(&state), &job_id)
        }
        JobsCmd::Logs { state, job_id, follow: false } => {
            let log = inspect::log(&state_dir(&state), &job_id)?;
            if state.output == Output::Json {
                return print_json(&serde_json::json!({
                    "job_id": job_id,
                    "size": log.len(),
                    "sha256": byoc_protocol::sha256_hex(&log),
                    "log": String::from_utf8_lossy(&log),
                }));
            }
            std::io::stdout().write_all(&log)?;
            Ok(())
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
    let jobs = inspect::jobs(&state_dir(state), limit, all, |j| {
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
    let dir = state_dir(state);
    let j = inspect::job(&dir, job_id)?;
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
    if !trail.is_empty() {
        println!("audit:");
        for r in &trail {
            println!("  {}", super::audit::record_line(&r.to_string()).trim_start());
        }
    }
    Ok(())
}

fn rejections(
    state: &StateArgs,
    limit: usize,
    all: bool,
    reason: Option<String>,
    since: Option<String>,
) -> anyhow::Result<()> {
    let since = since_ms(since.as_deref())?;
    let rs = inspect::rejections(&state_dir(state), limit, all, |r| {
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
        .map_err(|e| anyhow::anyhow!("--since: {e}"))
}

/// `jobs logs -f`: what the spool holds, then what the job adds, until the journal
/// says it ended (the omission marker and the tail of a log past its cap are written
/// then). A poll every quarter second: this reads files, it asks the daemon nothing.
fn follow_log(state_dir: &std::path::Path, job_id: &str) -> anyhow::Result<()> {
    use std::io::{Read as _, Seek as _};
    let path = crate::spool::spool_path(state_dir, job_id);
    let mut offset = 0u64;
    let mut out = std::io::stdout().lock();
    loop {
        // Read the journal first: whatever the spool holds after the job ended is all. A
        // job refused or not claimed ends without a result.
        let j = inspect::job(state_dir, job_id)?;
        let ended = j.finished.is_some()
            || matches!(j.phase, crate::journal::Phase::Refused | crate::journal::Phase::ClaimRefused);
        match std::fs::File::open(&path) {
            Ok(mut f) => {
                f.seek(std::io::SeekFrom::Start(offset))?;
                let mut buf = Vec::new();
                f.read_to_end(&mut buf)?;
                offset += buf.len() as u64;
                out.write_all(&buf)?;
                out.flush()?;
            }
            // Not written yet, or removed once reported and uploaded.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if ended && offset == 0 {
                    out.write_all(&inspect::log(state_dir, job_id)?)?;
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
