//! The customer's CLI on a fixed state directory, compared with the outputs kept in
//! `tests/golden/` (text and JSON): a change to what customers see shows up as a diff
//! here. `BYOC_BLESS=1 cargo test --test cli_golden` writes the files afresh.
//! Needs nothing but the binary: part of the fast tier.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use byoc_protocol::{JobStatus, RejectReason};
use byoc_runner::journal::{Event, Line};

const BIN: &str = env!("CARGO_BIN_EXE_byoc-runner");
/// 2026-11-27T09:00:00Z.
const T0: u64 = 1_795_770_000_000;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// A state directory with one finished job (its log kept), one awaiting approval and
/// one refused delivery, every time fixed.
fn fixed_state(dir: &Path, with_audit: bool) {
    let received = |id: &str, kind: &str, op: &str, at: u64, effect: &str| Line {
        ts: at,
        event: Event::Received {
            job_id: id.into(),
            delivery_id: format!("d-{id}"),
            nonce: format!("n-{id}"),
            expires_at: 4_102_444_800,
            kind: kind.into(),
            operation: op.into(),
            entity: "component".into(),
            payload_sha256: "ab".repeat(32),
            timeout_secs: 600,
            effect: Some(effect.into()),
            component: Some("api".into()),
            local: false,
        },
    };
    let log = b"hello from the job\n";
    let lines = vec![
        received("job-0000000000000001", "action.script", "trigger", T0, "run"),
        Line {
            ts: T0 + 20,
            event: Event::Claimed { job_id: "job-0000000000000001".into(), lease_secs: 60, epoch: 0 },
        },
        Line {
            ts: T0 + 30,
            event: Event::Started {
                job_id: "job-0000000000000001".into(),
                started_at_ms: T0 + 30,
                network: None,
                state_workspace: None,
            },
        },
        Line {
            ts: T0 + 1_530,
            event: Event::Finished {
                job_id: "job-0000000000000001".into(),
                status: JobStatus::Succeeded,
                exit_code: Some(0),
                error: None,
                log_size: log.len() as u64,
                log_sha256: byoc_protocol::sha256_hex(log),
                log_omitted: 0,
                started_at_ms: Some(T0 + 30),
                finished_at_ms: T0 + 1_530,
                outputs: serde_json::json!({}),
            },
        },
        Line { ts: T0 + 1_600, event: Event::Reported { job_id: "job-0000000000000001".into() } },
        received("job-0000000000000002", "action.script", "trigger", T0 + 60_000, "run"),
        Line {
            ts: T0 + 60_020,
            event: Event::Claimed { job_id: "job-0000000000000002".into(), lease_secs: 60, epoch: 0 },
        },
        Line {
            ts: T0 + 60_030,
            event: Event::Waiting {
                job_id: "job-0000000000000002".into(),
                state: "awaiting_approval".into(),
                until: Some(4_102_444_800),
                detail: "rule \"actions\": awaits approval".into(),
            },
        },
        Line {
            ts: T0 + 120_000,
            event: Event::Rejected {
                delivery_id: "d-3".into(),
                job_id: Some("job-0000000000000003".into()),
                nonce: None,
                expires_at: None,
                reason: RejectReason::Expired,
                detail: "expired at 2026-11-27T08:59:00Z".into(),
            },
        },
    ];
    let text: String = lines.iter().map(|l| serde_json::to_string(l).unwrap() + "\n").collect();
    std::fs::write(byoc_runner::state_dir::StateDir::of(dir).journal(), text).unwrap();
    let spool = byoc_runner::spool::spool_path(dir, "job-0000000000000001");
    std::fs::create_dir_all(spool.parent().unwrap()).unwrap();
    std::fs::write(spool, log).unwrap();
    // When its bytes were written: all at once, 10 ms after the job started.
    let mut times = 0u64.to_le_bytes().to_vec();
    times.extend_from_slice(&(T0 + 40).to_le_bytes());
    std::fs::write(byoc_runner::spool::times_path(dir, "job-0000000000000001"), times).unwrap();
    // An audit log with a few records (its times are the clock's: not for golden files).
    if with_audit {
        audit_log(dir);
    }
    byoc_runner::approvals::write_request(
        dir,
        &byoc_runner::approvals::Request {
            job_id: "job-0000000000000002".into(),
            kind: "action.script".into(),
            operation: "action.trigger".into(),
            role: None,
            component: Some("api".into()),
            rule: "actions".into(),
            requested_at_ms: T0 + 60_030,
            expires_at_ms: 4_102_444_800_000,
            plan_digest: None,
            judged_digest: None,
            summary: None,
            findings: vec![],
            passed: vec![],
            update_version: None,
        },
    )
    .unwrap();
}

fn audit_log(dir: &Path) {
    let (mut audit, _) = byoc_audit::log::AuditWriter::open(
        &byoc_runner::state_dir::StateDir::of(dir).audit(),
        ed25519_dalek::SigningKey::from_bytes(&[9u8; 32]),
        "rn-golden",
        "inst-golden",
        &[],
    )
    .unwrap();
    for event in ["job_received", "job_started", "job_finished"] {
        audit
            .append(byoc_audit::log::Record {
                event: event.into(),
                job: Some("job-0000000000000001".into()),
                ..Default::default()
            })
            .unwrap();
    }
}

/// A configuration of the suite's own (not the machine's), with the defaults a fresh
/// install has.
fn config_file() -> PathBuf {
    // Written once per test process (tests run in threads and share it).
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("byoc-cli-golden-{}.toml", std::process::id()));
        std::fs::write(
            &path,
            "[control_plane]\nurl = \"https://cp.vendor.example\"\npublic_keys = [\"11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=\"]\n\n[runner]\ninstall_id = \"inst-1\"\n",
        )
        .unwrap();
        path
    })
    .clone()
}

/// Run `args` on the fixed state; the output with the state dir's path replaced.
fn cli(state: &Path, args: &[&str]) -> (i32, String) {
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.extend(["--state-dir".to_string(), state.display().to_string()]);
    cli_only(state, &all.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Run `args` as given; the output with the state dir's path replaced.
fn cli_only(state: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(BIN)
        .args(args)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("BYOC_RUNNER_CONFIG", config_file())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text.replace(&state.display().to_string(), "<STATE>"))
}

/// Times, digests and roots that come from the clock (the audit log's records and
/// checkpoints are timed as written), and machine figures (free disk), made stable.
fn stable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let rest: String = chars[i..chars.len().min(i + 40)].iter().collect();
        // An RFC 3339 time of today (the fixture's own are 2026-11-27 and 2100).
        if rest.len() >= 20
            && rest.as_bytes()[4] == b'-'
            && rest.as_bytes()[10] == b'T'
            && rest[..4].chars().all(|c| c.is_ascii_digit())
            && !rest.starts_with("2026-11-27")
            && !rest.starts_with("2100-01-01")
        {
            let end = rest.find('Z').map_or(rest.len(), |z| z + 1);
            out.push_str("<TIME>");
            i += end;
            continue;
        }
        let run: String = chars[i..].iter().take_while(|c| c.is_ascii_alphanumeric()).collect();
        let boundary = i == 0 || !chars[i - 1].is_ascii_alphanumeric();
        if boundary
            && run.len() == 13
            && run.chars().all(|c| c.is_ascii_digit())
            && !run.starts_with("17957")
            && !run.starts_with("41024")
        {
            out.push_str("<MS>");
            i += run.len();
            continue;
        }
        if boundary && run.len() >= 32 && run.chars().all(|c| c.is_ascii_hexdigit()) {
            out.push_str("<HEX>");
            i += run.len();
            continue;
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

#[test]
fn the_inspection_commands_print_what_customers_expect() {
    let dir = tempfile::tempdir().unwrap();
    fixed_state(dir.path(), true);
    std::fs::create_dir_all(dir.path().join("policies")).unwrap();
    let bless = std::env::var_os("BYOC_BLESS").is_some();
    let policies = format!("{}/policies", dir.path().display());
    let root = format!("{}/root", dir.path().display());
    let config = config_file();
    let config = config.display().to_string();
    // (file, arguments, whether --state-dir is added)
    let cases: &[(&str, &[&str], bool)] = &[
        ("jobs-list.txt", &["jobs", "list"], true),
        ("jobs-list.json", &["jobs", "list", "-o", "json"], true),
        ("jobs-list-options-first.json", &["-o", "json", "jobs", "list"], true),
        ("jobs-list-failed.txt", &["jobs", "list", "--status", "failed"], true),
        ("jobs-list-bad-status.txt", &["jobs", "list", "--status", "refused"], true),
        ("jobs-list-bad-since.txt", &["jobs", "list", "--since", "yesterday"], true),
        ("jobs-show.txt", &["jobs", "show", "job-0000000000000001"], true),
        ("jobs-show.json", &["jobs", "show", "job-0000000000000001", "-o", "json"], true),
        ("jobs-show-unknown.txt", &["jobs", "show", "job-nope"], true),
        ("jobs-show-ambiguous.txt", &["jobs", "show", "job-000"], true),
        ("jobs-show-rejected.txt", &["jobs", "show", "job-0000000000000003"], true),
        ("jobs-show-rejected.json", &["jobs", "show", "job-0000000000000003", "-o", "json"], true),
        ("jobs-logs.txt", &["jobs", "logs", "job-0000000000000001"], true),
        ("jobs-logs.json", &["jobs", "logs", "job-0000000000000001", "-o", "json"], true),
        (
            "jobs-logs-tail-timestamps.txt",
            &["jobs", "logs", "job-0000000000000001", "--tail", "1", "--timestamps"],
            true,
        ),
        ("jobs-logs-held.txt", &["jobs", "logs", "job-0000000000000002"], true),
        ("jobs-rejections.txt", &["jobs", "rejections"], true),
        ("jobs-rejections.json", &["jobs", "rejections", "-o", "json"], true),
        ("jobs-rejections-bad-reason.txt", &["jobs", "rejections", "--reason", "nonsense"], true),
        ("approvals.txt", &["approvals"], true),
        ("approvals.json", &["approvals", "-o", "json"], true),
        ("approvals-show.txt", &["approvals", "show", "job-0000000000000002"], true),
        ("approvals-show.json", &["approvals", "show", "job-0000000000000002", "-o", "json"], true),
        ("deny-no-reason.txt", &["deny", "job-0000000000000002", "--reason", " "], true),
        ("roles.txt", &["roles"], true),
        ("roles.json", &["roles", "-o", "json"], true),
        ("roles-enable.txt", &["roles", "enable", "inst-1-maintenance"], true),
        ("drift.txt", &["drift"], true),
        ("drift.json", &["drift", "-o", "json"], true),
        ("drift-targets.txt", &["drift", "targets"], true),
        ("drift-targets.json", &["drift", "targets", "-o", "json"], true),
        ("secrets.txt", &["secrets"], true),
        ("secrets.json", &["secrets", "-o", "json"], true),
        ("state-list.txt", &["state", "list"], true),
        ("state-list.json", &["state", "list", "-o", "json"], true),
        ("state-show-bad-name.txt", &["state", "show", "Bad/Name"], true),
        ("update-status.txt", &["update", "status", "--root", &root], true),
        ("update-status.json", &["update", "status", "--root", &root, "-o", "json"], true),
        ("update-pin-garbage.txt", &["update", "pin", "garbage"], true),
        ("audit-verify.txt", &["audit", "verify"], true),
        ("audit-verify.json", &["audit", "verify", "-o", "json"], true),
        ("audit-tail.txt", &["audit", "tail"], true),
        ("audit-tail.json", &["audit", "tail", "-o", "json"], true),
        ("audit-tail-bad-event.txt", &["audit", "tail", "--event", "nonsense"], true),
        ("audit-show.txt", &["audit", "show", "1"], true),
        ("audit-show.json", &["audit", "show", "1", "-o", "json"], true),
        ("audit-key.txt", &["audit", "key"], true),
        ("audit-key.json", &["audit", "key", "-o", "json"], true),
        ("audit-export.jsonl", &["audit", "export", "--event", "job_started"], true),
        ("policy-list.txt", &["policy", "list", "--policies", &policies], false),
        ("policy-list.json", &["policy", "list", "--policies", &policies, "-o", "json"], false),
        ("config-validate.txt", &["config", "validate", "--config", &config], false),
        ("config-validate.json", &["config", "validate", "--config", &config, "-o", "json"], false),
        ("status-missing-config.txt", &["status", "--config", "/nonexistent/runner.toml"], true),
        ("status-missing-state-dir.txt", &["status", "--state-dir", "/nonexistent/state"], false),
    ];
    let mut differ = Vec::new();
    for (file, args, with_state) in cases {
        let (code, out) = if *with_state { cli(dir.path(), args) } else { cli_only(dir.path(), args) };
        let shown: Vec<String> =
            args.iter().map(|a| a.replace(&dir.path().display().to_string(), "<STATE>")).collect();
        let out = stable(&out.replace(&config, "<CONFIG>"));
        let got =
            format!("$ byoc-runner {}\n[exit {code}]\n{out}", shown.join(" ").replace(&config, "<CONFIG>"));
        let path = golden_dir().join(file);
        if bless {
            std::fs::write(&path, &got).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&path).unwrap_or_default();
        if want != got {
            differ.push(format!("--- {file} (kept)\n{want}+++ {file} (now)\n{got}"));
        }
    }
    assert!(
        differ.is_empty(),
        "outputs differ from tests/golden (BYOC_BLESS=1 to accept):\n{}",
        differ.join("\n")
    );
}

/// Every listing command, piped into a reader that has gone, ends quietly as `ls` does.
#[test]
fn every_listing_command_ends_quietly_when_its_reader_goes() {
    let dir = tempfile::tempdir().unwrap();
    fixed_state(dir.path(), true);
    for args in [
        "jobs list",
        "jobs rejections",
        "jobs show job-0000000000000001",
        "jobs logs job-0000000000000001",
        "approvals",
        "approvals show job-0000000000000002",
        "audit export",
        "audit tail -n 3",
        "audit show 1",
        "status",
        "metrics",
        "roles",
        "secrets",
        "drift",
        "state list",
        "completions bash",
        "man",
        "journal-catalog",
        "policy list --policies /nonexistent/policies",
        "config check --config /nonexistent/runner.toml",
        "config validate --config /nonexistent/runner.toml",
        "--help",
    ] {
        let stateless = ["completions", "man", "journal-catalog", "policy", "config", "--help"];
        let state = if stateless.iter().any(|c| args.starts_with(c)) {
            String::new()
        } else {
            format!(" --state-dir {}", dir.path().display())
        };
        // The reader closes before the command writes: every write meets a closed pipe.
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("exec 3>&1; {{ {BIN} {args}{state}; echo \"exit $?\" >&3; }} | true"))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{args}: {stderr}");
        let code: i32 = said.trim().trim_start_matches("exit ").parse().unwrap();
        // status says "not running" with 3 (no daemon here), a missing config is 64 or a
        // failed check 1; the others 0; or SIGPIPE's 141.
        let ok = match args {
            "status" => [3, 141].contains(&code),
            a if a.starts_with("config") => [1, 64, 141].contains(&code),
            _ => [0, 141].contains(&code),
        };
        assert!(ok, "{args}: exit {code}, {stderr}");
    }
}

/// `jobs logs -f` of a job refused before it ran ends at once: it will never finish.
#[test]
fn following_a_refused_job_ends() {
    let dir = tempfile::tempdir().unwrap();
    fixed_state(dir.path(), false);
    let mut journal =
        std::fs::read_to_string(byoc_runner::state_dir::StateDir::of(dir.path()).journal()).unwrap();
    for event in [
        Event::Received {
            job_id: "job-0000000000000004".into(),
            delivery_id: "d-4".into(),
            nonce: "n-4".into(),
            expires_at: 4_102_444_800,
            kind: "action.script".into(),
            operation: "trigger".into(),
            entity: "action".into(),
            payload_sha256: "cd".repeat(32),
            timeout_secs: 600,
            effect: Some("run".into()),
            component: None,
            local: false,
        },
        Event::Refused {
            job_id: "job-0000000000000004".into(),
            delivery_id: "d-4".into(),
            reason: RejectReason::RoleDisabled,
            detail: "role switched off".into(),
            role: Some("inst-1-maintenance".into()),
        },
    ] {
        journal.push_str(&(serde_json::to_string(&Line { ts: T0 + 180_000, event }).unwrap() + "\n"));
    }
    std::fs::write(byoc_runner::state_dir::StateDir::of(dir.path()).journal(), journal).unwrap();
    // `timeout` stands guard: a follower that never ends exits 124.
    let out = Command::new("timeout")
        .args(["20", BIN, "jobs", "logs", "-f", "job-0000000000000004", "--state-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

/// The state dir every command reads, as a typo, as a directory the runner never used,
/// and as one the user may not read: an error saying which, never "nothing here".
#[test]
fn a_missing_or_unreadable_state_dir_is_an_error_never_an_empty_answer() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-state");
    let empty = dir.path().join("never-used");
    std::fs::create_dir(&empty).unwrap();
    let reading = [
        "status",
        "metrics",
        "jobs list",
        "jobs rejections",
        "jobs show job-1",
        "jobs logs job-1",
        "roles",
        "drift",
        "drift targets",
        "secrets",
        "state list",
        "update status",
        "audit tail",
        "audit export",
    ];
    let controls = [
        "approvals",
        "approvals show job-1",
        "pause --reason x",
        "resume",
        "approve job-1",
        "deny job-1 --reason x",
    ];
    let run = |args: &str, state: &Path| {
        let mut all: Vec<String> = args.split(' ').map(str::to_string).collect();
        all.extend(["--state-dir".into(), state.display().to_string()]);
        cli_only(dir.path(), &all.iter().map(String::as_str).collect::<Vec<_>>())
    };
    for args in reading.iter().chain(&controls) {
        let (code, out) = run(args, &missing);
        assert_eq!(code, 1, "{args}: {out}");
        assert!(out.contains("does not exist"), "{args}: {out}");
    }
    for args in controls {
        let (code, out) = run(args, &empty);
        assert_eq!(code, 1, "{args}: {out}");
        assert!(out.contains("has never run with it"), "{args}: {out}");
    }
    // `audit verify`: nothing was verified, which is not a log that failed (1).
    let (code, out) = run("audit verify", &missing);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("nothing was verified"), "{out}");
    // Unreadable: as a user who may not read it (root reads everything, so as nobody).
    let locked = dir.path().join("locked");
    std::fs::create_dir(&locked).unwrap();
    fixed_state(&locked, false);
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_nobody = nix::unistd::geteuid().is_root();
    if !as_nobody {
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
    }
    for args in ["jobs list", "approvals", "secrets", "drift", "roles", "update status"] {
        let mut cmd = if as_nobody {
            let mut c = Command::new("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN]);
            c
        } else {
            Command::new(BIN)
        };
        let out = cmd
            .args(args.split(' '))
            .arg("--state-dir")
            .arg(&locked)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("BYOC_RUNNER_CONFIG", config_file())
            .output()
            .expect("setpriv (util-linux) runs the command as nobody");
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(1), "{args}: {text}");
        assert!(text.contains("permission denied") && text.contains("run as root"), "{args}: {text}");
    }
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o700)).unwrap();
}

/// OPERATIONS.md's exit code table is the manual's (`EXIT_CODES`), and each code a
/// command of this suite can give is given where the table says.
#[test]
fn the_exit_codes_are_one_documented_table_and_hold() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/OPERATIONS.md")).unwrap();
    let table = doc.split("## Exit codes").nth(1).expect("OPERATIONS.md has an Exit codes section");
    let rows: Vec<(String, String)> = table
        .lines()
        .skip_while(|l| !l.starts_with("| code"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            (cells[0].to_string(), cells.get(1).copied().unwrap_or("").to_string())
        })
        .collect();
    let codes: Vec<&str> = byoc_runner::cli::EXIT_CODES.iter().map(|(c, _)| *c).collect();
    let documented: Vec<&str> = rows.iter().map(|(c, _)| c.as_str()).collect();
    for code in &codes {
        assert!(
            documented.contains(code),
            "exit code {code} is not in OPERATIONS.md's table: {documented:?}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    fixed_state(dir.path(), true);
    let cases: &[(&[&str], i32)] = &[
        (&["jobs", "list"], 0),
        (&["jobs", "show", "job-nope"], 1),
        (&["status"], 3),
        (&["jobs", "list", "--since", "yesterday"], 64),
        (&["jobs", "list", "--status", "nonsense"], 64),
        (&["deny", "job-0000000000000002", "--reason", ""], 64),
        (&["update", "pin", "garbage"], 64),
        (&["audit", "tail", "--event", "nonsense"], 64),
        (&["jobs", "list", "--no-such-option"], 64),
    ];
    for (args, want) in cases {
        let (code, out) = cli(dir.path(), args);
        assert_eq!(code, *want, "{args:?}: {out}");
    }
    for (args, want) in [
        (vec!["audit", "verify", "--dir", "/nonexistent/audit"], 2),
        (vec!["audit", "verify", "--from", "/nonexistent/copy"], 2),
        (vec!["status", "--config", "/nonexistent/runner.toml", "--state-dir", "/nonexistent"], 64),
    ] {
        let (code, out) = cli_only(dir.path(), &args);
        assert_eq!(code, want, "{args:?}: {out}");
    }
    // A log that does not hold: 1.
    let log = byoc_runner::state_dir::StateDir::of(dir.path()).audit().join(byoc_audit::log::LOG);
    let text = std::fs::read_to_string(&log).unwrap().replace("job_started", "job_stopped");
    std::fs::write(&log, text).unwrap();
    let (code, out) = cli(dir.path(), &["audit", "verify"]);
    assert_eq!(code, 1, "{out}");
}

/// A job id may be shortened to a prefix that names one job, as docker's may.
#[test]
fn a_unique_prefix_names_a_job() {
    let dir = tempfile::tempdir().unwrap();
    fixed_state(dir.path(), false);
    let (code, out) = cli(dir.path(), &["jobs", "show", "job-0000000000000001"]);
    assert_eq!(code, 0, "{out}");
    let mut journal =
        std::fs::read_to_string(byoc_runner::state_dir::StateDir::of(dir.path()).journal()).unwrap();
    let line = Line {
        ts: T0 + 200_000,
        event: Event::Received {
            job_id: "job-7f3a000000000009".into(),
            delivery_id: "d-9".into(),
            nonce: "n-9".into(),
            expires_at: 4_102_444_800,
            kind: "terraform".into(),
            operation: "deploy".into(),
            entity: "component".into(),
            payload_sha256: "ef".repeat(32),
            timeout_secs: 600,
            effect: Some("change".into()),
            component: None,
            local: false,
        },
    };
    journal.push_str(&(serde_json::to_string(&line).unwrap() + "\n"));
    std::fs::write(byoc_runner::state_dir::StateDir::of(dir.path()).journal(), journal).unwrap();
    let (code, out) = cli(dir.path(), &["jobs", "show", "job-7f3a"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("job:        job-7f3a000000000009"), "{out}");
    let (code, out) = cli(dir.path(), &["jobs", "logs", "job-7f"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("job job-7f3a000000000009 has no log yet: it has not started"), "{out}");
    let (code, out) = cli(dir.path(), &["jobs", "show", "job-0"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("names more than one job"), "{out}");
}

/// `jobs logs -f` of a held job says what it waits for, at once, and keeps following.
#[test]
fn following_a_held_job_says_what_it_waits_for() {
    use std::io::BufRead as _;
    let dir = tempfile::tempdir().unwrap();
    fixed_state(dir.path(), false);
    let mut child = Command::new(BIN)
        .args(["jobs", "logs", "-f", "job-0000000000000002", "--state-dir"])
        .arg(dir.path())
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("BYOC_RUNNER_CONFIG", config_file())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stderr.take().unwrap()).read_line(&mut first).unwrap();
    let still_following = child.try_wait().unwrap().is_none();
    child.kill().unwrap();
    let _ = child.wait();
    assert!(
        first.contains("job job-0000000000000002 waits for a local approval")
            && first.contains("byoc-runner approve job-0000000000000002"),
        "{first}"
    );
    assert!(still_following, "a held job's log is followed until it ends");
}
