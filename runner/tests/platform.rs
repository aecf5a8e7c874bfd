//! The runner against the host's real plumbing: the systemd unit (verified and scored
//! by systemd-analyze) and journald (a private systemd-journald in its own mount
//! namespace, read back with journalctl). These need root and systemd's tools; the
//! README's test command installs them. Missing tools fail the test, loudly.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use byoc_control_plane::harness::{RunnerOptions, RunnerProcess, wait_polling};
use byoc_protocol::JobStatus;
use common::*;

fn unit_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/byoc-runner.service")
}

/// The unit with ExecStart pointing at the binary under test (verify checks it exists),
/// beside the metadata firewall's unit it requires (its script from the repository).
fn unit_for_test(dir: &Path) -> PathBuf {
    let systemd = Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/imds-firewall");
    let imds = std::fs::read_to_string(systemd.join("byoc-runner-imds.service"))
        .expect("firewall unit")
        .replace("/usr/lib/byoc-runner/imds-firewall", script.canonicalize().unwrap().to_str().unwrap());
    std::fs::write(dir.join("byoc-runner-imds.service"), imds).unwrap();
    let text = std::fs::read_to_string(unit_path()).expect("unit file");
    let text = text.replace("/usr/bin/byoc-runner", BIN);
    let path = dir.join("byoc-runner.service");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn systemd_unit_verifies_clean() {
    let dir = tempfile::tempdir().unwrap();
    let unit = unit_for_test(dir.path());
    // --man=no: the unit's man:byoc-runner(8) comes with the package (install.rs holds
    // that the package has it); this host has no package installed.
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit)
        .arg(dir.path().join("byoc-runner-imds.service"))
        .output()
        .expect("systemd-analyze is required (apt-get install systemd)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "systemd-analyze verify failed:\n{stderr}");
    assert!(stderr.trim().is_empty(), "systemd-analyze verify warned:\n{stderr}");
}

#[test]
fn systemd_unit_exposure_is_at_most_3_0() {
    let dir = tempfile::tempdir().unwrap();
    let unit = unit_for_test(dir.path());
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze is required (apt-get install systemd)");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| panic!("no exposure line in:\n{text}"));
    let score: f64 = line
        .split(':')
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("cannot parse score from {line:?}"));
    println!("systemd-analyze security exposure: {score}");
    // 3.0 before the job network boundary; +0.2 for it: /dev/net/tun through
    // DevicePolicy=closed + DeviceAllow instead of PrivateDevices (whose /dev lacks the
    // device; binding it in broke with systemd 255), and AF_NETLINK; +0.1 without
    // ProtectHostname (its seccomp filter breaks every sandbox); -0.3 for @resources
    // and ProtectProc=invisible. The running unit on a VM (runner/tests/vm.rs) must
    // rate at most 3.0 as well.
    assert!(score <= 3.0, "exposure {score} > 3.0:\n{text}");
}

#[test]
fn unit_stop_timeout_covers_the_default_drain_grace() {
    let text = std::fs::read_to_string(unit_path()).unwrap();
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("{k} missing"))
            .to_string()
    };
    assert_eq!(get("KillMode"), "mixed", "SIGTERM must reach only the runner so it can drain");
    assert_eq!(get("Type"), "notify");
    let stop: u64 = get("TimeoutStopSec").trim_end_matches('s').parse().unwrap();
    let default_drain = 300;
    assert!(stop > default_drain, "TimeoutStopSec {stop} must exceed the default drain grace");
}

#[test]
fn unit_leaves_the_sandbox_what_it_needs() {
    let text = std::fs::read_to_string(unit_path()).unwrap();
    let settings: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    // These overmount /proc, and the kernel then refuses each sandbox's own /proc
    // (ProtectProc=invisible mounts a /proc of its own and does not: the VM suite).
    for forbidden in ["ProtectKernelTunables=", "ProtectKernelLogs=", "ProcSubset="] {
        assert!(!settings.iter().any(|l| l.starts_with(forbidden)), "{forbidden} breaks the job sandbox");
    }
    // Its seccomp filter refuses sethostname even in the sandbox's own UTS namespace.
    assert!(
        !settings.iter().any(|l| l.starts_with("ProtectHostname=")),
        "ProtectHostname= breaks the job sandbox"
    );
    let ns = settings.iter().find_map(|l| l.strip_prefix("RestrictNamespaces=")).unwrap();
    for needed in ["user", "mnt", "pid", "ipc", "uts", "net"] {
        assert!(ns.split_whitespace().any(|n| n == needed), "RestrictNamespaces must allow {needed}");
    }
    let allow = settings.iter().find(|l| l.starts_with("SystemCallFilter=") && !l.contains('~')).unwrap();
    for needed in ["@mount", "sethostname", "setresuid", "seccomp", "landlock_restrict_self"] {
        assert!(allow.contains(needed), "the system-call allow list lacks {needed}");
    }
    assert!(settings.contains(&"Delegate=yes"), "per-job cgroups need a delegated subtree");
}

/// The wrapper puts the runner in a private mount namespace with its own journald,
/// whose journal lands in `journal_dir` for journalctl to read.
fn journald_wrapper(dir: &Path, journal_dir: &Path) -> PathBuf {
    let script = format!(
        r#"#!/bin/bash
set -e
exec unshare --mount --propagation private /bin/bash -c '
  set -e
  mount -t tmpfs tmpfs /run
  mkdir -p /run/systemd/journal /run/log/journal
  mount --bind {journal} /run/log/journal
  /lib/systemd/systemd-journald &
  echo $! > {dir}/journald.pid
  for i in $(seq 1 200); do [ -S /run/systemd/journal/socket ] && break; sleep 0.05; done
  exec {bin} "$@"
' runner "$@"
"#,
        journal = journal_dir.display(),
        dir = dir.display(),
        bin = BIN
    );
    let path = dir.join("runner-in-journald-ns");
    std::fs::write(&path, script).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[tokio::test]
async fn logs_reach_journald_as_sentences_with_byoc_fields_and_message_ids() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (mount namespace for a private journald)"
    );
    assert!(
        Path::new("/lib/systemd/systemd-journald").exists(),
        "systemd-journald is required (apt-get install systemd)"
    );
    let cp = start_cp().await;
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal");
    std::fs::create_dir(&journal).unwrap();
    let wrapper = journald_wrapper(dir.path(), &journal);
    let opts = RunnerOptions::default();
    let mut runner = RunnerProcess::prepare(&wrapper, dir.path(), &cp, &opts).unwrap();
    let cfg = std::fs::read_to_string(&runner.config_path)
        .unwrap()
        .replace("target = \"stderr\"", "target = \"journald\"");
    std::fs::write(&runner.config_path, cfg).unwrap();
    runner.spawn(Some(cp.bootstrap_token())).unwrap();
    assert!(wait_polling(&cp, WAIT).await, "runner never polled:\n{}", runner.log());

    // A job that prints its secret and fails mentioning it: the journal must not see it.
    let secret = "journald-secret-9Xq7";
    let leaky = cp
        .enqueue(byoc_control_plane::EnqueueRequest::new(
            "action.script",
            serde_json::json!({"script": "echo \"$S\"; echo \"bad $S\" >&2; exit 3", "secret_env": {"S": secret}}),
        ))
        .unwrap();
    let v = cp.wait_for(&leaky, WAIT, |v| v.result.is_some()).await.expect("job finished");
    assert_eq!(v.result.unwrap().status, JobStatus::Failed);
    let id = cp.enqueue(script("echo hi")).unwrap();
    let v = cp.wait_for(&id, WAIT, |v| v.result.is_some()).await.expect("job finished");
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded);
    // The runner audits job_reported (its one journal entry) after the server stored
    // the result.
    let deadline = tokio::time::Instant::now() + WAIT;
    let records = loop {
        let out = Command::new("journalctl")
            .arg("--directory")
            .arg(&journal)
            .args(["-o", "json", "--no-pager"])
            .arg(format!("BYOC_JOB_ID={id}"))
            .output()
            .expect("journalctl is required (apt-get install systemd)");
        let records: Vec<serde_json::Value> = out
            .stdout
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .filter_map(|l| serde_json::from_slice(l).ok())
            .collect();
        if records.iter().any(|r| r["BYOC_AUDIT_EVENT"] == "job_reported")
            || tokio::time::Instant::now() > deadline
        {
            break records;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let everything = Command::new("journalctl")
        .arg("--directory")
        .arg(&journal)
        .args(["-o", "json", "--no-pager"])
        .output()
        .unwrap();
    for p in byoc_job_executors::mask::patterns_for(secret.as_bytes()) {
        assert!(
            !everything.stdout.windows(p.len()).any(|w| w == p.as_slice()),
            "the journal holds a secret encoding"
        );
    }
    assert!(String::from_utf8_lossy(&everything.stdout).contains(&leaky), "the failed job is in the journal");
    // Audit records are mirrored with AUDIT_* fields: `journalctl AUDIT_EVENT=…` finds them.
    let audit = Command::new("journalctl")
        .arg("--directory")
        .arg(&journal)
        .args(["-o", "json", "--no-pager", "BYOC_AUDIT_EVENT=job_finished"])
        .output()
        .unwrap();
    let audit: Vec<serde_json::Value> = audit
        .stdout
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| serde_json::from_slice(l).ok())
        .collect();
    let rec = audit
        .iter()
        .find(|r| {
            r["BYOC_JOB_ID"] == leaky
                || r["BYOC_JOB_ID"].as_array().is_some_and(|a| a.contains(&serde_json::json!(leaky)))
        })
        .expect("a BYOC_AUDIT_EVENT=job_finished record for the job");
    assert!(rec["BYOC_AUDIT_SEQ"].as_str().is_some_and(|s| s.parse::<u64>().is_ok()), "{rec}");
    assert_eq!(rec["BYOC_STATUS"], "failed");
    // A sentence, the event's catalogued MESSAGE_ID, priority 4: the job failed
    // (`journalctl -p warning` shows it, with its job and status).
    assert_eq!(rec["MESSAGE_ID"], byoc_runner::logging::audit_message_id("job_finished"), "{rec}");
    assert_eq!(rec["PRIORITY"], "4", "{rec}");
    let message = rec["MESSAGE"].as_str().unwrap();
    assert!(
        message.starts_with("Audit record ")
            && message.contains(&format!("job_finished: job {leaky}"))
            && message.contains("status failed, exit code 3"),
        "{message}"
    );
    runner.kill9().await;
    if let Ok(pid) = std::fs::read_to_string(dir.path().join("journald.pid")) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid.trim().parse().unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(!records.is_empty(), "no journal records with BYOC_JOB_ID={id}");
    // One entry per step: the audit record's, with the job's fields.
    let started =
        records.iter().find(|r| r["BYOC_AUDIT_EVENT"] == "job_started").expect("a job_started entry");
    assert!(
        !records.iter().any(|r| r["MESSAGE"] == "Job started." || r["MESSAGE"] == "Job finished."),
        "a step is one entry, not a log line and an audit line: {records:?}"
    );
    assert_eq!(started["BYOC_INSTALL_ID"], cp.install_id());
    assert_eq!(started["BYOC_KIND"], "action.script");
    assert_eq!(started["BYOC_OPERATION"], "trigger");
    assert_eq!(started["PRIORITY"], "6", "INFO is informational: {started}");
    assert_eq!(started["SYSLOG_IDENTIFIER"], "byoc-runner");
    assert!(
        started.get("JOB_ID").is_none() && started.get("F_JOB_ID").is_none(),
        "fields carry the BYOC_ prefix"
    );
    assert!(records.iter().any(|r| r["BYOC_AUDIT_EVENT"] == "job_reported"));
    assert!(!records.iter().any(|r| r["MESSAGE"] == "Result acknowledged."), "one entry per step");
    // The job's whole path: every entry carries the job's fields, and each audit event
    // on it is a sentence with its MESSAGE_ID at priority 6.
    for r in &records {
        for (field, want) in [
            ("BYOC_INSTALL_ID", cp.install_id()),
            ("BYOC_KIND", "action.script".to_string()),
            ("BYOC_OPERATION", "trigger".to_string()),
            ("BYOC_ROLE", "none".to_string()),
        ] {
            assert_eq!(r[field], want.as_str(), "{field} on {r}");
        }
        assert!(r["MESSAGE"].as_str().is_some_and(|m| !m.is_empty() && !m.contains("Some(")), "{r}");
    }
    for event in ["job_received", "job_claimed", "job_started", "job_finished"] {
        let entry = records
            .iter()
            .find(|r| r["BYOC_AUDIT_EVENT"] == event)
            .unwrap_or_else(|| panic!("no {event} entry for {id}: {records:?}"));
        assert_eq!(entry["MESSAGE_ID"], byoc_runner::logging::audit_message_id(event), "{entry}");
        assert_eq!(entry["PRIORITY"], "6", "{entry}");
        let message = entry["MESSAGE"].as_str().unwrap();
        assert!(
            message.starts_with("Audit record ") && message.contains(&format!("{event}: job {id}")),
            "{message}"
        );
    }
}

fn journal_json(journal: &Path, filter: &[&str]) -> Vec<u8> {
    Command::new("journalctl")
        .arg("--directory")
        .arg(journal)
        .args(["-o", "json", "--no-pager"])
        .args(filter)
        .output()
        .expect("journalctl is required (apt-get install systemd)")
        .stdout
}

#[tokio::test]
async fn role_credentials_never_reach_journald() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (mount namespace for a private journald)"
    );
    let cp = start_cp().await;
    let moto = common::roles::moto_with_stack(&common::roles::base_params()).await;
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal");
    std::fs::create_dir(&journal).unwrap();
    let wrapper = journald_wrapper(dir.path(), &journal);
    // The job reads its `go` file from the test's directory.
    let opts = RunnerOptions {
        sandbox_ro_paths: test_options(dir.path()).sandbox_ro_paths,
        ..common::roles::role_options(&moto, "")
    };
    let mut runner = RunnerProcess::prepare(&wrapper, dir.path(), &cp, &opts).unwrap();
    let cfg = std::fs::read_to_string(&runner.config_path)
        .unwrap()
        .replace("target = \"stderr\"", "target = \"journald\"");
    std::fs::write(&runner.config_path, cfg).unwrap();
    runner.spawn(Some(cp.bootstrap_token())).unwrap();
    assert!(wait_polling(&cp, WAIT).await, "runner never polled:\n{}", runner.log());

    let go = dir.path().join("go");
    let id = cp.enqueue(common::roles::leaky_role_job(&go)).unwrap();
    let waiting = cp
        .wait_until(WAIT, |cp| cp.log(&id).is_some_and(|l| String::from_utf8_lossy(&l).contains("waiting")))
        .await;
    assert!(waiting, "the job never started:\n{}", runner.log());
    let (_, secrets) = common::roles::job_credentials(&id).await;
    std::fs::write(&go, b"").unwrap();
    let v = cp.wait_for(&id, WAIT, |v| v.result.is_some()).await.expect("job finished");
    assert_eq!(v.result.unwrap().status, JobStatus::Failed);
    // The role's audit records are mirrored: the assumption is in the journal...
    let deadline = tokio::time::Instant::now() + WAIT;
    while journal_json(&journal, &["BYOC_AUDIT_EVENT=job_reported"]).is_empty()
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let assumed =
        String::from_utf8_lossy(&journal_json(&journal, &["BYOC_AUDIT_EVENT=role_assumed"])).into_owned();
    assert!(assumed.contains(&id) && assumed.contains("inst-demo-maintenance"), "{assumed}");
    // ... and none of its credentials, in any encoding the masker knows.
    let everything = journal_json(&journal, &[]);
    for secret in &secrets {
        for p in byoc_job_executors::mask::patterns_for(secret.as_bytes()) {
            assert!(
                !everything.windows(p.len()).any(|w| w == p.as_slice()),
                "the journal holds an encoding of a role credential"
            );
        }
    }
    runner.kill9().await;
    if let Ok(pid) = std::fs::read_to_string(dir.path().join("journald.pid")) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid.trim().parse().unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

#[tokio::test]
async fn tells_systemd_ready_watchdog_and_stopping() {
    let cp = start_cp().await;
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("notify.sock");
    let sock = tokio::net::UnixDatagram::bind(&sock_path).unwrap();
    let opts = RunnerOptions {
        env: vec![
            ("NOTIFY_SOCKET".into(), sock_path.display().to_string()),
            ("WATCHDOG_USEC".into(), "1000000".into()),
        ],
        ..Default::default()
    };
    let mut runner = RunnerProcess::start(Path::new(BIN), dir.path(), &cp, &opts).unwrap();
    let mut buf = vec![0u8; 4096];
    let mut recv = async || -> String {
        let n = tokio::time::timeout(WAIT, sock.recv(&mut buf)).await.expect("a notification").unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let first = recv().await;
    assert!(first.contains("READY=1") && first.contains("STATUS=polling"), "{first}");
    assert_eq!(cp.runners().len(), 1, "READY=1 came before enrollment");
    // The watchdog interval is 1 s, so pings come every 0.5 s while the loop is healthy.
    let mut pings = 0;
    while pings < 3 {
        if recv().await.contains("WATCHDOG=1") {
            pings += 1;
        }
    }
    runner.signal(nix::sys::signal::Signal::SIGTERM);
    loop {
        let msg = recv().await;
        if msg.contains("STOPPING=1") {
            break;
        }
        assert!(msg.contains("WATCHDOG=1"), "unexpected notification {msg}");
    }
    assert!(runner.wait_exit(WAIT).await.unwrap().success());
}

/// The unit lets the runner build the job network boundary, and nothing more: the TUN
/// device (the user-mode stack's interface) as the only device beyond the
/// pseudo-devices, and netlink (the job namespace's routes and rules).
#[test]
fn unit_allows_what_the_network_boundary_needs() {
    let text = std::fs::read_to_string(unit_path()).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert!(lines.contains(&"DevicePolicy=closed"), "{text}");
    let allowed: Vec<&&str> = lines.iter().filter(|l| l.starts_with("DeviceAllow=")).collect();
    assert_eq!(allowed, [&"DeviceAllow=/dev/net/tun rw"]);
    let families = lines.iter().find_map(|l| l.strip_prefix("RestrictAddressFamilies=")).unwrap();
    assert_eq!(
        families.split_whitespace().collect::<Vec<_>>(),
        ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]
    );
    let ns = lines.iter().find_map(|l| l.strip_prefix("RestrictNamespaces=")).unwrap();
    assert!(ns.split_whitespace().any(|n| n == "net"), "{ns}");
    let control =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/deb/control.in")).unwrap();
    let depends = control.lines().find_map(|l| l.strip_prefix("Depends: ")).unwrap();
    for pkg in ["slirp4netns", "busybox-static"] {
        assert!(depends.split(", ").any(|d| d == pkg), "the package must depend on {pkg}: {depends}");
    }
    // The libc the package asks for is at least what the binary needs (every GLIBC_2.x
    // symbol version; packed relocations need 2.36).
    let libc: Vec<u32> = depends
        .split(", ")
        .find_map(|d| d.strip_prefix("libc6 (>= 2.")?.strip_suffix(')'))
        .map(|v| v.split('.').map(|n| n.parse().unwrap()).collect())
        .expect("a libc6 (>= 2.x) dependency");
    let versions = std::process::Command::new("readelf")
        .args(["-V", env!("CARGO_BIN_EXE_byoc-runner")])
        .output()
        .unwrap();
    let versions = String::from_utf8_lossy(&versions.stdout);
    let mut needed: Vec<u32> = versions
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("GLIBC_2."))
        .map(|v| v.split('.').next().unwrap().parse().unwrap())
        .collect();
    if versions.contains("GLIBC_ABI_DT_RELR") {
        needed.push(36);
    }
    let highest = needed.into_iter().max().expect("readelf lists the binary's glibc versions");
    assert!(libc[0] >= highest, "the binary needs glibc 2.{highest}, the package asks for {depends}");
}
