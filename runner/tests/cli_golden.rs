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
    let path = std::env::temp_dir().join(format!("byoc-cli-golden-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[control_plane]\nurl = \"https://cp.vendor.example\"\npublic_keys = [\"11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=\"]\n\n[runner]\ninstall_id = \"inst-1\"\n",
    )
    .unwrap();
    path
}

/// Run `args` on the fixed state; the output with the state dir's path replaced.
fn cli(state: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(BIN)
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("BYOC_RUNNER_CONFIG", config_file())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text.replace(&state.display().to_string(), "<STATE>"))
}

#[test]
fn the_inspection_commands_print_what_customers_expect() {
    let dir = tempfile::tempdir().unwrap();
    fixed_state(dir.path(), false);
    let bless = std::env::var_os("BYOC_BLESS").is_some();
    let cases: &[(&str, &[&str])] = &[
        ("jobs-list.txt", &["jobs", "list"]),
        ("jobs-list.json", &["jobs", "list", "-o", "json"]),
        ("jobs-list-options-first.json", &["-o", "json", "jobs", "list"]),
        ("jobs-list-failed.txt", &["jobs", "list", "--status", "failed"]),
        ("jobs-show.txt", &["jobs", "show", "job-0000000000000001"]),
        ("jobs-show.json", &["jobs", "show", "job-0000000000000001", "-o", "json"]),
        ("jobs-show-unknown.txt", &["jobs", "show", "job-nope"]),
        ("jobs-logs.txt", &["jobs", "logs", "job-0000000000000001"]),
        ("jobs-rejections.txt", &["jobs", "rejections"]),
        ("jobs-rejections.json", &["jobs", "rejections", "-o", "json"]),
        ("approvals.txt", &["approvals"]),
        ("approvals.json", &["approvals", "-o", "json"]),
        ("approvals-show.txt", &["approvals", "show", "job-0000000000000002"]),
        ("roles-enable.txt", &["roles", "enable", "inst-1-maintenance"]),
    ];
    let mut differ = Vec::new();
    for (file, args) in cases {
        let (code, out) = cli(dir.path(), args);
        let got = format!("$ byoc-runner {}\n[exit {code}]\n{out}", args.join(" "));
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
        "completions bash",
        "man",
        "journal-catalog",
    ] {
        let state = if args.starts_with("completions") || args == "man" || args == "journal-catalog" {
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
        // status says "not running" with 3 (no daemon here); the others 0, or SIGPIPE's 141.
        let ok = if args == "status" { [3, 141].contains(&code) } else { [0, 141].contains(&code) };
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
