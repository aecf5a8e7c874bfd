//! `audit verify|tail|show|export|prove`: the signed audit log, offline.

use std::path::{Path, PathBuf};

use clap::Subcommand;

use super::{EX_USAGE, Output, StateArgs, UsageError, state_dir};

/// `audit verify`'s exit code when nothing could be verified: the log or the copy is
/// not there or cannot be read (1 is a log that does not hold).
pub(super) const EXIT_UNVERIFIED: i32 = 2;

#[derive(clap::Args, Clone)]
pub(super) struct AuditArgs {
    #[command(flatten)]
    state: StateArgs,
    /// The audit directory (default: <state dir>/audit); works on a copy elsewhere too.
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// Which records `tail` and `export` print.
#[derive(clap::Args, Clone, Default)]
pub(super) struct RecordFilter {
    /// Only records of this job.
    #[arg(long)]
    job: Option<String>,
    /// Only records of this event (job_finished, policy_decision, role_assumed, …).
    #[arg(long)]
    event: Option<String>,
    /// Only records since a time (2026-11-27T09:00:00Z, 2026-11-27) or for a while
    /// (90s, 30m, 2h, 7d).
    #[arg(long, value_name = "TIME")]
    since: Option<String>,
}

impl RecordFilter {
    fn active(&self) -> bool {
        self.job.is_some() || self.event.is_some() || self.since.is_some()
    }

    /// A predicate over stored record lines.
    fn matcher(&self) -> anyhow::Result<impl Fn(&str) -> bool + use<>> {
        let since = self
            .since
            .as_deref()
            .map(|t| crate::clock::parse_since(t, crate::clock::now_ms()))
            .transpose()
            .map_err(|e| UsageError(format!("--since: {e}")))?;
        if let Some(e) = &self.event
            && !crate::audit::EVENTS.iter().any(|(name, _)| name == e)
        {
            let names: Vec<&str> = crate::audit::EVENTS.iter().map(|(name, _)| *name).collect();
            return Err(UsageError(format!(
                "--event {e:?} is not an audit event; the events: {}",
                names.join(", ")
            ))
            .into());
        }
        let (job, event) = (self.job.clone(), self.event.clone());
        Ok(move |line: &str| {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { return false };
            job.as_ref().is_none_or(|j| v["job"] == j.as_str())
                && event.as_ref().is_none_or(|e| v["event"] == e.as_str())
                && since.is_none_or(|t| v["time_ms"].as_u64().is_some_and(|ms| ms >= t))
        })
    }
}

#[derive(Subcommand)]
pub(super) enum AuditCmd {
    /// Check every record, the tree, every checkpoint
    ///
    /// Every record, the Merkle tree, every checkpoint and cosignature. Exit 0 when
    /// everything holds, 1 naming the first problem, 2 when nothing could be verified
    /// (the log or the copy is not there or cannot be read), 64 for a bad --trust file.
    ///
    /// Examples: byoc-runner audit verify; byoc-runner audit verify --from s3://audit-bucket/byoc-audit/ --trust keys.txt
    Verify {
        #[command(flatten)]
        a: AuditArgs,
        /// Keys to trust: lines `runner <base64>` and `control-plane <base64>` (default:
        /// the keys stored beside the log).
        #[arg(long)]
        trust: Option<PathBuf>,
        /// Verify an exported copy instead: `s3://BUCKET/PREFIX/<runner>` (read with your
        /// AWS credentials) or a directory holding the same objects. Gaps, altered and
        /// conflicting objects are named.
        #[arg(long, value_name = "SOURCE", conflicts_with = "dir")]
        from: Option<String>,
        /// The bucket's region (default: AWS_REGION or your AWS profile's).
        #[arg(long, requires = "from")]
        region: Option<String>,
        /// Another S3 endpoint (default: AWS_ENDPOINT_URL).
        #[arg(long, requires = "from")]
        endpoint_url: Option<String>,
    },
    /// The last records, one line each
    ///
    /// Each with its time in ISO 8601 (follow with -f; `-o json`: the records as
    /// stored, one JSON object a line).
    ///
    /// Example: byoc-runner audit tail -f --event job_rejected
    Tail {
        #[command(flatten)]
        a: AuditArgs,
        /// How many records.
        #[arg(short = 'n', long, default_value_t = 20)]
        lines: usize,
        /// Keep printing records as the daemon appends them.
        #[arg(short = 'f', long)]
        follow: bool,
        #[command(flatten)]
        filter: RecordFilter,
    },
    /// One record, by its sequence number
    ///
    /// Example: byoc-runner audit show 42 -o json
    Show {
        #[command(flatten)]
        a: AuditArgs,
        /// The record's sequence number (`audit tail` shows them).
        seq: u64,
    },
    /// Every record and checkpoint as JSON lines
    ///
    /// For a SIEM: always JSON lines. With a filter, only the records that match (no
    /// checkpoints).
    ///
    /// Example: byoc-runner audit export --since 2026-11-01 > audit.jsonl
    #[command(mut_arg("output", |a| a.hide(true)))]
    Export {
        #[command(flatten)]
        a: AuditArgs,
        #[command(flatten)]
        filter: RecordFilter,
    },
    /// The checkpoints' verifier key, for third-party verifiers
    ///
    /// The signed-note verifier key of this log's checkpoints (Go's
    /// golang.org/x/mod/sumdb/note: `name+hash+base64(0x01||key)`; the name is the
    /// checkpoints' origin), and the control plane's if stored.
    ///
    /// Example: byoc-runner audit key > runner.vkey
    Key {
        #[command(flatten)]
        a: AuditArgs,
    },
    /// An inclusion proof of a record, for a third party
    ///
    /// The proof that record SEQ is in the tree a signed checkpoint commits to (`-o
    /// json`: the proof alone, for a verifier).
    ///
    /// Example: byoc-runner audit prove 42 -o json > proof.json
    Prove {
        #[command(flatten)]
        a: AuditArgs,
        /// The record's sequence number (`audit tail` shows them).
        seq: u64,
    },
}

pub(super) fn run(cmd: AuditCmd) -> i32 {
    match cmd {
        AuditCmd::Verify { a, trust, from: Some(from), region, endpoint_url } => {
            verify_copy(&a, &from, trust.as_deref(), region, endpoint_url)
        }
        AuditCmd::Verify { a, trust, .. } => verify(&a, trust.as_deref()),
        AuditCmd::Key { a } => super::edge(|| key(&a)),
        cmd => super::edge(|| inspect(cmd)),
    }
}

/// `audit key`: the verifier keys, named as the checkpoints are signed.
fn key(a: &AuditArgs) -> anyhow::Result<()> {
    let dir = audit_dir(a)?;
    let (trust, _) = crate::audit::load_trust(&dir, None)?;
    let last = std::fs::read_to_string(dir.join(byoc_audit::log::CHECKPOINTS))
        .map_err(|e| anyhow::anyhow!("{}: {e}", dir.join(byoc_audit::log::CHECKPOINTS).display()))?;
    let origin = last
        .lines()
        .next_back()
        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .and_then(|v| v["note"].as_str().and_then(|n| n.lines().next()).map(str::to_string))
        .ok_or_else(|| anyhow::anyhow!("no checkpoint in {} to take the origin from", dir.display()))?;
    let runner = byoc_audit::note::verifier_key(&origin, &trust.runner);
    let control_plane: Vec<String> = trust
        .control_plane
        .iter()
        .map(|k| byoc_audit::note::verifier_key(byoc_audit::log::CONTROL_PLANE_KEY_NAME, k))
        .collect();
    if a.state.output == Output::Json {
        println!(
            "{}",
            serde_json::json!({"origin": origin, "runner": runner, "control_plane": control_plane})
        );
    } else {
        println!("{runner}");
        for k in control_plane {
            println!("{k}");
        }
    }
    Ok(())
}

/// `--dir`, else the state dir's `audit/` (the state dir checked as `status` checks it).
fn audit_dir(a: &AuditArgs) -> anyhow::Result<PathBuf> {
    match &a.dir {
        Some(d) => Ok(d.clone()),
        None => Ok(crate::state_dir::StateDir::of(&state_dir(&a.state)?).audit()),
    }
}

fn verify(a: &AuditArgs, trust: Option<&Path>) -> i32 {
    let dir = match audit_dir(a) {
        Ok(d) => d,
        Err(e) if super::exit_code_of(&e) == EX_USAGE => {
            eprintln!("error: {e:#}");
            return EX_USAGE;
        }
        Err(e) => {
            eprintln!("error: {e:#}: nothing was verified");
            return EXIT_UNVERIFIED;
        }
    };
    if let Err(e) = std::fs::read_dir(&dir) {
        eprintln!("error: audit directory {}: {e}: nothing was verified", dir.display());
        return EXIT_UNVERIFIED;
    }
    let (trust, pinned) = match crate::audit::load_trust(&dir, trust) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return EX_USAGE;
        }
    };
    match byoc_audit::verify::verify_dir(&dir, &trust) {
        Ok(report) => {
            if a.state.output == Output::Json {
                println!("{}", serde_json::json!({"ok": true, "keys_pinned": pinned, "report": report}));
            } else {
                println!(
                    "ok: {} records, {} checkpoints, {} acknowledged by the control plane (up to {}), root {}",
                    report.records,
                    report.checkpoints,
                    report.cosigned,
                    report.acknowledged_size,
                    report.root
                );
                if !pinned {
                    println!("note: keys taken from {} (pin them with --trust FILE)", dir.display());
                }
            }
            0
        }
        Err(e) => {
            if a.state.output == Output::Json {
                println!("{}", serde_json::json!({"ok": false, "error": e.to_string(), "detail": e}));
            } else {
                eprintln!("FAILED: {e}");
            }
            1
        }
    }
}

/// `audit verify --from`: the exported copy alone, reassembled in a temporary directory.
fn verify_copy(
    a: &AuditArgs,
    from: &str,
    trust: Option<&Path>,
    region: Option<String>,
    endpoint_url: Option<String>,
) -> i32 {
    use crate::audit_export::copy;
    let json = a.state.output == Output::Json;
    let source = match copy::Source::parse(from) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: --from {e}");
            return EX_USAGE;
        }
    };
    let fetched = (|| -> Result<_, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("starting the runtime: {e}"))?;
        rt.block_on(async {
            let aws = match &source {
                copy::Source::S3 { .. } => Some(copy::S3Access::from_env(region, endpoint_url).await?),
                copy::Source::Dir(_) => None,
            };
            copy::fetch(&source, aws.as_ref()).await.map_err(|e| e.to_string())
        })
    })();
    let objects = match fetched {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {source}: {e}: nothing was verified");
            return EXIT_UNVERIFIED;
        }
    };
    let work = match tempfile::tempdir() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: a temporary directory: {e}: nothing was verified");
            return EXIT_UNVERIFIED;
        }
    };
    // The copy at the source's top, or (no key there, none pinned) each runner's copy
    // beneath it: the install's whole trail.
    let runners = copy::runners_in(&objects);
    if trust.is_some() || objects.contains_key(byoc_audit::log::RUNNER_PUB) || runners.is_empty() {
        let (code, value) =
            verify_one(&source.to_string(), copy::verify(&source, &objects, work.path(), trust), json);
        if json {
            println!("{value}");
        }
        return code;
    }
    let mut code = 0;
    let mut all = Vec::new();
    for (i, runner) in runners.iter().enumerate() {
        let label = format!("{}/{runner}", source.to_string().trim_end_matches('/'));
        // Not the copy's name: it comes from the bucket.
        let dir = work.path().join(format!("copy-{i}"));
        let result = std::fs::create_dir(&dir)
            .map_err(|e| copy::CopyError::Fetch(format!("{}: {e}", dir.display())))
            .and_then(|()| copy::verify(&source, &copy::copy_of(&objects, runner), &dir, None));
        let (c, value) = verify_one(&label, result, json);
        code = code.max(c);
        all.push(value);
    }
    if json {
        println!("{}", serde_json::json!({"ok": code == 0, "source": source.to_string(), "runners": all}));
    }
    code
}

/// One copy's verdict: printed (text) or returned (JSON), with the exit code.
fn verify_one(
    label: &str,
    result: Result<
        (byoc_audit::verify::Report, byoc_audit::export::Assembled, bool),
        crate::audit_export::copy::CopyError,
    >,
    json: bool,
) -> (i32, serde_json::Value) {
    use crate::audit_export::copy::CopyError;
    match result {
        Ok((report, assembled, pinned)) => {
            if !json {
                println!(
                    "ok: {label}: {} records, {} checkpoints, {} acknowledged by the control plane (up to {}), root {}",
                    report.records,
                    report.checkpoints,
                    report.cosigned,
                    report.acknowledged_size,
                    report.root
                );
                if !assembled.ignored.is_empty() {
                    println!("note: {} objects outside the layout were ignored", assembled.ignored.len());
                }
                if !pinned {
                    println!(
                        "note: keys taken from the copy itself (pin the runner's key with --trust FILE)"
                    );
                }
            }
            let value = serde_json::json!({"ok": true, "source": label, "keys_pinned": pinned, "ignored": assembled.ignored, "report": report});
            (0, value)
        }
        Err(CopyError::Trust(e)) => {
            eprintln!("error: {e}");
            (EX_USAGE, serde_json::json!({"ok": false, "source": label, "error": e}))
        }
        Err(e) => {
            if !json {
                eprintln!("FAILED: {label}: {e}");
            }
            (1, serde_json::json!({"ok": false, "source": label, "error": e.to_string()}))
        }
    }
}

fn inspect(cmd: AuditCmd) -> anyhow::Result<()> {
    use anyhow::Context as _;
    match cmd {
        AuditCmd::Verify { .. } | AuditCmd::Key { .. } => unreachable!("handled before"),
        AuditCmd::Tail { a, lines, follow, filter } => {
            let dir = audit_dir(&a)?;
            let json = a.state.output == Output::Json;
            let keep = filter.matcher()?;
            let show = |l: &str| {
                if keep(l) {
                    println!("{}", if json { l.to_string() } else { record_line(l) });
                }
            };
            let all = byoc_audit::log::read_lines(&dir, 0, u64::MAX)?;
            let mut printed = all.len();
            let matching: Vec<&String> = all.iter().filter(|l| keep(l)).collect();
            for l in matching.iter().skip(matching.len().saturating_sub(lines)) {
                show(l);
            }
            if !follow {
                return Ok(());
            }
            loop {
                // A file has no change notification we can rely on everywhere; poll gently.
                std::thread::sleep(std::time::Duration::from_millis(500));
                let more = byoc_audit::log::read_lines(&dir, printed as u64, u64::MAX)?;
                printed += more.len();
                for l in more {
                    show(&l);
                }
            }
        }
        AuditCmd::Show { a, seq } => {
            let dir = audit_dir(&a)?;
            let line = byoc_audit::log::read_lines(&dir, seq, seq + 1)?
                .pop()
                .with_context(|| format!("no record {seq} in {}", dir.display()))?;
            if a.state.output == Output::Json {
                println!("{line}");
            } else {
                // For people: the record's time in ISO 8601 beside its milliseconds.
                let mut v: serde_json::Value = serde_json::from_str(&line)?;
                if let Some(ms) = v["time_ms"].as_u64() {
                    v["time"] = crate::clock::rfc3339_ms(ms).into();
                }
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
            Ok(())
        }
        AuditCmd::Export { a, filter } => {
            let dir = audit_dir(&a)?;
            let keep = filter.matcher()?;
            for l in byoc_audit::log::read_lines(&dir, 0, u64::MAX)?.into_iter().filter(|l| keep(l)) {
                println!("{{\"type\":\"record\",\"record\":{l}}}");
            }
            if filter.active() {
                return Ok(());
            }
            for (file, kind) in
                [(byoc_audit::log::CHECKPOINTS, "checkpoint"), (byoc_audit::log::COSIGNED, "cosigned")]
            {
                for c in byoc_audit::log::read_checkpoints(&dir.join(file)) {
                    println!("{}", serde_json::json!({"type": kind, "size": c.size, "note": c.note}));
                }
            }
            Ok(())
        }
        AuditCmd::Prove { a, seq } => {
            let proof = crate::audit::prove(&audit_dir(&a)?, seq)?;
            if a.state.output == Output::Json {
                println!("{}", serde_json::to_string(&proof)?);
            } else {
                let v = serde_json::to_value(&proof)?;
                println!("inclusion proof of record {seq} (give it to a verifier with -o json):");
                for (k, val) in v.as_object().into_iter().flatten() {
                    println!("  {k}: {}", val.to_string().trim_matches('"'));
                }
            }
            Ok(())
        }
    }
}

/// One stored record as a line for people: sequence, time in ISO 8601, event, then the
/// fields it has. A line that is not a record is printed as it is.
pub(super) fn record_line(line: &str) -> String {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { return line.to_string() };
    let mut out = format!(
        "{:>6}  {}  {}",
        v["seq"].as_u64().map(|n| n.to_string()).unwrap_or_default(),
        v["time_ms"].as_u64().map(crate::clock::rfc3339_ms).unwrap_or_default(),
        v["event"].as_str().unwrap_or("?")
    );
    for key in ["job", "kind", "operation", "role", "status", "reason", "exit_code"] {
        match &v[key] {
            serde_json::Value::Null => {}
            serde_json::Value::String(s) if s.is_empty() => {}
            serde_json::Value::String(s) => out.push_str(&format!(" {key}={s}")),
            other => out.push_str(&format!(" {key}={other}")),
        }
    }
    if let Some(d) = v["detail"].as_str().filter(|d| !d.is_empty()) {
        out.push_str(&format!(" -- {d}"));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_record_reads_as_one_line_with_an_iso_time() {
        let line = r#"{"seq":7,"time_ms":1764201600000,"install":"i","event":"job_finished","job":"job-1","kind":"action.script","role":null,"status":"succeeded","exit_code":0,"digests":{},"detail":"ran"}"#;
        assert_eq!(
            super::record_line(line),
            "     7  2025-11-27T00:00:00Z  job_finished job=job-1 kind=action.script status=succeeded exit_code=0 -- ran"
        );
        assert_eq!(super::record_line("not json"), "not json");
    }
}
