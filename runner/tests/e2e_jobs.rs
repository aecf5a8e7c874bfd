//! End to end against the reference control plane: the happy path, every envelope
//! rejection, cancellation, and the inspection CLI.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use byoc_control_plane::harness::RunnerOptions;
use byoc_control_plane::{EnqueueRequest, Tamper};
use byoc_protocol::{JobStatus, RejectReason};
use common::*;

#[tokio::test]
async fn happy_path_runs_jobs_and_delivers_log_and_result() {
    let e = env().await;
    let noop =
        e.cp.enqueue(EnqueueRequest::new("runner.noop", serde_json::json!({"message": "hello"}))).unwrap();
    let s = e.cp.enqueue(script("echo out; echo err >&2; echo \"JOB=$BYOC_JOB_ID\"")).unwrap();

    let v = e.finished(&noop).await;
    assert_eq!(v.result.as_ref().unwrap().status, JobStatus::Succeeded);
    // The job's output, then the runner's line of how it ended.
    assert_eq!(
        String::from_utf8_lossy(&e.cp.log(&noop).unwrap()),
        "hello\n[runner] job succeeded, exit code 0\n"
    );

    let v = e.finished(&s).await;
    let r = v.result.clone().unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{v:?}");
    assert_eq!(r.exit_code, Some(0));
    let log = String::from_utf8(e.cp.log(&s).unwrap()).unwrap();
    assert!(log.contains("out") && log.contains("err") && log.contains(&format!("JOB={s}")), "{log}");
    assert_eq!(r.log_size, log.len() as u64);
    assert_eq!(r.log_sha256, byoc_protocol::sha256_hex(log.as_bytes()));
    assert!(v.pickup_ms.is_some());

    // The customer's CLI sees the same, from the state dir alone.
    let jobs = e.cli_json(&["jobs", "list"]);
    let ids: Vec<&str> = jobs.as_array().unwrap().iter().map(|j| j["job_id"].as_str().unwrap()).collect();
    assert!(ids.contains(&noop.as_str()) && ids.contains(&s.as_str()));
    let show = e.cli_json(&["jobs", "show", &s]);
    assert_eq!(show["finished"]["status"], "succeeded");
    let logs = e.cli_json(&["jobs", "logs", &s]);
    assert_eq!(logs["log"].as_str().unwrap(), log);
    let status = e.cli_json(&["status"]);
    assert_eq!(status["enrolled"], true);
    assert_eq!(status["daemon_running"], true);
    assert_eq!(status["jobs_by_status"]["succeeded"], 2);

    // The enrollment token was used once and is not in the state dir.
    let token_like = std::fs::read_dir(&e.runner.state_dir)
        .unwrap()
        .filter_map(|f| std::fs::read(f.unwrap().path()).ok())
        .any(|bytes| String::from_utf8_lossy(&bytes).contains("bt-"));
    assert!(!token_like, "bootstrap token persisted in the state dir");
}

#[tokio::test]
async fn every_envelope_rejection_has_its_reason_code() {
    let e = env().await;
    let first = e.cp.enqueue(EnqueueRequest::new("runner.noop", serde_json::Value::Null)).unwrap();
    let done = e.finished(&first).await;

    let tamper = |t: Tamper| EnqueueRequest {
        tamper: t,
        ..EnqueueRequest::new("runner.noop", serde_json::Value::Null)
    };
    let cases: Vec<(RejectReason, EnqueueRequest)> = vec![
        (RejectReason::MalformedEnvelope, tamper(Tamper { malformed: true, ..Default::default() })),
        (RejectReason::OversizePayload, tamper(Tamper { oversize: true, ..Default::default() })),
        (RejectReason::UnknownKey, tamper(Tamper { unknown_key: true, ..Default::default() })),
        (RejectReason::BadSignature, tamper(Tamper { bad_signature: true, ..Default::default() })),
        (
            RejectReason::WrongRunner,
            tamper(Tamper { payload_runner_id: Some("rn-other".into()), ..Default::default() }),
        ),
        (
            RejectReason::WrongInstall,
            tamper(Tamper { payload_install_id: Some("inst-other".into()), ..Default::default() }),
        ),
        (RejectReason::Expired, tamper(Tamper { expires_offset_secs: Some(-3600), ..Default::default() })),
        (RejectReason::NotYetValid, tamper(Tamper { issued_offset_secs: Some(3600), ..Default::default() })),
        (
            RejectReason::ReplayedNonce,
            tamper(Tamper { nonce: Some(done.nonce.clone()), ..Default::default() }),
        ),
        (RejectReason::UnknownKind, EnqueueRequest::new("quantum.teleport", serde_json::Value::Null)),
        (RejectReason::InvalidSpec, EnqueueRequest::new("action.script", serde_json::json!({"script": 42}))),
    ];
    let mut expected = Vec::new();
    for (reason, req) in cases {
        expected.push((reason, e.cp.enqueue(req).unwrap()));
    }
    // A byte-for-byte replay of a finished job's envelope.
    e.cp.redeliver(&first).unwrap();

    for (reason, id) in &expected {
        let v = e.rejected(id).await;
        assert_eq!(v.rejections[0].0, *reason, "job {id}: {:?}", v.rejections);
        assert!(v.result.is_none(), "a rejected job must not run");
    }
    let replay = e.cp.wait_for(&first, WAIT, |v| !v.rejections.is_empty()).await.expect("replay rejected");
    assert_eq!(replay.rejections[0].0, RejectReason::AlreadyFinished);
    assert_eq!(replay.result_posts, 1, "the finished job was not run again");

    // Each rejection is on the runner's record too, with its reason code.
    let local = e.cli_json(&["jobs", "rejections", "--limit", "100"]);
    let mut codes: Vec<String> =
        local.as_array().unwrap().iter().map(|r| r["reason"].as_str().unwrap().to_string()).collect();
    codes.sort();
    // Role and pause refusals have their own suite (e2e_roles), the sandbox's theirs
    // (e2e_network, e2e_sandbox, e2e_container), the disk's (e2e_disk), the guardrails' theirs
    // (e2e_guardrails), the secrets' theirs (e2e_secrets), a job held to its effect
    // (e2e_roles), the customer's update terms theirs (`update::pipeline_tests` and the
    // VM suite, where the updater's unit runs), a job's provider mirror (e2e_components).
    let not_here = [
        RejectReason::RoleMismatch,
        RejectReason::RoleDisabled,
        RejectReason::RoleUnknown,
        RejectReason::Paused,
        RejectReason::SandboxNetworkUnavailable,
        RejectReason::SandboxLimitsUnavailable,
        RejectReason::ContainerOutputUnavailable,
        RejectReason::DiskLow,
        RejectReason::OutsideWindow,
        RejectReason::ApprovalDenied,
        RejectReason::ApprovalExpired,
        RejectReason::SecretTargetNotDeclared,
        RejectReason::OperationMismatch,
        RejectReason::UpdateDisabled,
        RejectReason::UpdatePinned,
        RejectReason::UpdateNotNewer,
        RejectReason::ProviderMirrorNotAllowed,
    ];
    let mut want: Vec<String> =
        RejectReason::ALL.iter().filter(|r| !not_here.contains(r)).map(|r| r.code().to_string()).collect();
    want.sort();
    assert_eq!(codes, want);
    let log = e.runner.log();
    assert!(log.contains("already_finished"), "runner log lacks the reason code:\n{log}");
}

#[tokio::test]
async fn cancel_kills_the_whole_tree_and_reports_cancelled() {
    let e = env().await;
    // One child in the job's process group, one that left it with setsid, and a shell
    // that ignores SIGINT: all must be gone after the cancel.
    let id =
        e.cp.enqueue(script("sleep 3101 & setsid sleep 3102 & echo ready; trap '' INT; wait; wait")).unwrap();
    e.log_contains(&id, "ready").await;
    assert_eq!(processes_matching("sleep 310").len(), 2, "both children should be running");
    e.cp.cancel(&id).unwrap();
    let v = e.finished(&id).await;
    assert_eq!(v.result.unwrap().status, JobStatus::Cancelled);
    assert_eq!(gone("sleep 310").await, Vec::<i32>::new(), "processes outlived the cancelled job");
}

#[tokio::test]
async fn job_timeout_is_enforced() {
    let e = env().await;
    let mut req = script("echo start; sleep 300");
    req.timeout_secs = 1;
    let id = e.cp.enqueue(req).unwrap();
    let v = e.finished(&id).await;
    let r = v.result.unwrap();
    assert_eq!(r.status, JobStatus::TimedOut);
    assert!(String::from_utf8_lossy(&e.cp.log(&id).unwrap()).contains("start"));
}

#[tokio::test]
async fn log_upload_recovers_from_416() {
    let e = env().await;
    e.cp.set_faults(byoc_control_plane::Faults { lose_log_acks: 2, ..Default::default() }).await.unwrap();
    let id = e.cp.enqueue(script("for i in $(seq 1 2000); do echo \"line $i\"; done")).unwrap();
    let v = e.finished(&id).await;
    let expected: String = (1..=2000).map(|i| format!("line {i}\n")).collect();
    assert_eq!(e.output(&id), expected);
    assert!(v.log_416s >= 1, "the lost acknowledgements should have caused a 416: {v:?}");
    assert_eq!(v.result.unwrap().log_size, e.cp.log(&id).unwrap().len() as u64);
}

#[tokio::test]
async fn responses_cut_mid_body_are_retried_without_duplicates() {
    let e = env().await;
    e.cp.set_faults(byoc_control_plane::Faults { cut_rate: 0.3, ..Default::default() }).await.unwrap();
    let ids: Vec<String> = (0..6).map(|i| e.cp.enqueue(script(&format!("echo job {i}"))).unwrap()).collect();
    for (i, id) in ids.iter().enumerate() {
        let v = e.finished(id).await;
        assert_eq!(v.result.unwrap().status, JobStatus::Succeeded);
        assert_eq!(e.output(id), format!("job {i}\n"));
    }
    for id in &ids {
        assert_eq!(started_count(&e.runner.state_dir, id), 1, "job {id} did not run exactly once");
    }
}

fn run_local(job: &serde_json::Value, json: bool) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.json");
    std::fs::write(&path, job.to_string()).unwrap();
    let mut cmd = std::process::Command::new(BIN);
    cmd.arg("run-local").arg(&path);
    if json {
        cmd.args(["--output", "json"]);
    }
    cmd.output().unwrap()
}

#[test]
fn run_local_runs_a_job_file_without_a_control_plane() {
    let ok = run_local(
        &serde_json::json!({"kind": "action.script", "spec": {"script": "echo \"hi $WHO\"", "env": {"WHO": "vendor"}}}),
        false,
    );
    assert_eq!(ok.status.code(), Some(0));
    assert_eq!(job_output(&ok.stdout), "hi vendor\n");

    let failing =
        run_local(&serde_json::json!({"kind": "action.script", "spec": {"script": "echo no; exit 7"}}), true);
    assert_eq!(failing.status.code(), Some(7));
    let v: serde_json::Value = serde_json::from_slice(&failing.stdout).unwrap();
    assert_eq!(v["status"], "failed");
    assert_eq!(v["exit_code"], 7);
    assert_eq!(job_output(v["log"].as_str().unwrap().as_bytes()), "no\n");

    let timeout = run_local(
        &serde_json::json!({"kind": "action.script", "spec": {"script": "sleep 300"}, "timeout_secs": 1}),
        false,
    );
    assert_eq!(timeout.status.code(), Some(124));

    // The tool's own failures exit 125; a job's codes, the tool's old ones among them,
    // pass through unchanged (as with `docker run`).
    let bad = run_local(&serde_json::json!({"kind": "action.script", "spec": {}}), false);
    assert_eq!(bad.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("missing field `script`"));
    let unknown = run_local(&serde_json::json!({"kind": "nope"}), false);
    assert_eq!(unknown.status.code(), Some(125));
    let no_file = std::process::Command::new(BIN).arg("run-local").output().unwrap();
    assert_eq!(no_file.status.code(), Some(125), "{no_file:?}");
    for code in [1, 64, 65] {
        let job = run_local(
            &serde_json::json!({"kind": "action.script", "spec": {"script": format!("exit {code}")}}),
            false,
        );
        assert_eq!(job.status.code(), Some(code), "{job:?}");
    }
}

/// The customer's secrets are read only by a runner's jobs under an install role:
/// run-local says so and writes nothing (docs/SECRETS.md).
#[test]
fn run_local_reads_no_customer_secret() {
    let job = serde_json::json!({"kind": "secrets.sync", "spec": {"kubeconfig": byoc_control_plane::kube_api::unreached_kubeconfig(), "secrets": ["db_password"]}});
    let out = run_local(&job, true);
    assert_eq!(out.status.code(), Some(125));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(v["outputs"]["reason"], "secret_unavailable", "{v}");
    assert!(v["error"].as_str().unwrap().contains("run-local reads none"), "{v}");
}

/// Piped into a reader that has gone (`byoc-runner jobs list | head -1`): the CLI ends
/// as `ls` does, killed by SIGPIPE, with no panic.
#[test]
fn inspection_cli_output_into_a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt as _;
    let dir = tempfile::tempdir().unwrap();
    // A state dir the runner has used (it has `control/`), with nothing in it yet.
    std::fs::create_dir(dir.path().join("control")).unwrap();
    // Both print at once, even with nothing to show.
    for args in [&["roles"][..], &["jobs", "list"][..]] {
        let mut child = std::process::Command::new(BIN)
            .args(args)
            .arg("--state-dir")
            .arg(dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader is gone before the CLI writes anything.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_eq!(out.status.signal(), Some(13), "{args:?}: {:?} {stderr}", out.status);
    }
}

/// `status` with no daemon running says so and exits 3 (systemctl's "not running"),
/// naming the version; with the daemon running it exits 0.
#[test]
fn status_exits_3_when_the_daemon_is_down() {
    let dir = tempfile::tempdir().unwrap();
    let out =
        std::process::Command::new(BIN).args(["status", "--state-dir"]).arg(dir.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("daemon:         not running"), "{text}");
    assert!(text.contains(&format!("version:        {}", env!("CARGO_PKG_VERSION"))), "{text}");
    let out = std::process::Command::new(BIN)
        .args(["status", "--output", "json", "--state-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
}

#[test]
fn inspection_cli_explains_a_missing_state_dir_and_unknown_job() {
    let out =
        std::process::Command::new(BIN).args(["status", "--state-dir", "/nonexistent/x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(BIN)
        .args(["jobs", "show", "job-x", "--state-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no job \"job-x\""));
    let out = std::process::Command::new(BIN).args(["jobs", "frobnicate"]).output().unwrap();
    assert_eq!(out.status.code(), Some(64));
}

#[tokio::test]
async fn slow_control_plane_answers_do_not_break_jobs() {
    let e = env().await;
    e.cp.set_faults(byoc_control_plane::Faults { slow_ms: 1500, ..Default::default() }).await.unwrap();
    let id = e.cp.enqueue(script("echo slow but fine")).unwrap();
    let v = e.finished(&id).await;
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded);
    assert_eq!(e.output(&id), "slow but fine\n");
    assert_eq!(v.claims, 1);
}

/// The job's output goes to the spool, not to the control plane: with every request
/// taking 3 s (one 256 KiB upload every few seconds at best), a job printing 16 MiB
/// gets all of it through masking into the spool while the server holds a fraction.
#[tokio::test]
async fn a_slow_control_plane_does_not_hold_back_the_jobs_output() {
    let e = env().await;
    let go = e.dir.path().join("go");
    e.cp.set_faults(byoc_control_plane::Faults { slow_ms: 3000, ..Default::default() }).await.unwrap();
    let id = e
        .cp
        .enqueue(script(&format!(
            "head -c 16777216 /dev/zero | tr '\\0' y | fold -w 64; echo; echo flood-done; while [ ! -f {} ]; do sleep 0.05; done",
            go.display()
        )))
        .unwrap();
    let spool = e.runner.state_dir.join("spool").join(format!("{id}.log"));
    let deadline = std::time::Instant::now() + WAIT;
    // Polls the spool for the job's last line (condition polling, not a timed sleep).
    while !std::fs::read(&spool).is_ok_and(|l| l.ends_with(b"flood-done\n")) {
        assert!(std::time::Instant::now() < deadline, "the job's output never reached the spool");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let held = e.cp.log(&id).map(|l| l.len()).unwrap_or(0);
    assert!(held < 8 << 20, "the server already holds {held} bytes: output waited for uploads");
    e.cp.set_faults(byoc_control_plane::Faults::default()).await.unwrap();
    std::fs::write(&go, "1").unwrap();
    let v = e.finished(&id).await;
    let result = v.result.unwrap();
    assert_eq!(result.status, JobStatus::Succeeded, "{:?}", result.error);
    assert_eq!(result.log_omitted_bytes, 0);
    assert_eq!(e.cp.log(&id).unwrap(), std::fs::read(&spool).unwrap());
}

#[tokio::test]
async fn a_job_re_offered_while_its_claim_is_retried_runs_once() {
    let e = env().await;
    // Claims fail for longer than the control plane's offer timeout (3 s here), so the
    // same envelope is offered again while the first claim is still being retried.
    e.cp.set_faults(byoc_control_plane::Faults { fail_claims: 8, ..Default::default() }).await.unwrap();
    // The job lasts long enough that a second claim would land while it runs.
    let id = e.cp.enqueue(script("echo run; sleep 4")).unwrap();
    let v = e.finished(&id).await;
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded);
    assert_eq!(started_count(&e.runner.state_dir, &id), 1, "the job ran more than once");
    assert_eq!(e.output(&id), "run\n");
    let show = e.cli_json(&["jobs", "show", &id]);
    assert_eq!(show["phase"], "reported");
    assert!(e.runner.log().contains("Duplicate delivery"), "the re-offer never arrived:\n{}", e.runner.log());
    assert!(v.rejections.is_empty(), "{:?}", v.rejections);
}

#[tokio::test]
async fn a_secret_never_reaches_spool_upload_result_or_runner_log() {
    let e = env().await;
    let secret = "sk-live-7Hq2ZpX9wLm4";
    let id = e
        .cp
        .enqueue(EnqueueRequest::new(
            "action.script",
            serde_json::json!({
                "script": "echo \"raw $API_KEY\"; printf '%s' \"$API_KEY\" | base64; printf '{\"k\":\"%s\"}\\n' \"$API_KEY\"; \
                           echo \"key=$API_KEY\" >> \"$BYOC_OUTPUT\"; echo \"failing with $API_KEY\" >&2; exit 1",
                "secret_env": {"API_KEY": secret}
            }),
        ))
        .unwrap();
    let v = e.finished(&id).await;
    let result = v.result.clone().unwrap();
    assert_eq!(result.status, JobStatus::Failed);
    let encodings = byoc_job_executors::mask::patterns_for(secret.as_bytes());
    let leaks = |what: &str, bytes: &[u8]| {
        for p in &encodings {
            assert!(
                !bytes.windows(p.len()).any(|w| w == p.as_slice()),
                "{what} leaks {:?}",
                String::from_utf8_lossy(p)
            );
        }
    };
    let uploaded = e.cp.log(&id).unwrap();
    assert!(String::from_utf8_lossy(&uploaded).contains("raw ***"));
    leaks("uploaded log", &uploaded);
    leaks("spool", &std::fs::read(e.runner.state_dir.join("spool").join(format!("{id}.log"))).unwrap());
    leaks("result", serde_json::to_string(&result).unwrap().as_bytes());
    assert_eq!(result.outputs["key"], "***");
    leaks("runner log", e.runner.log().as_bytes());
    for entry in std::fs::read_dir(&e.runner.state_dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            leaks(&path.display().to_string(), &std::fs::read(&path).unwrap());
        }
    }
}

/// The encodings real tools print that a list of whole encoded forms missed (issue 21):
/// `/` left as is by `urllib.parse.quote` and `encodeURI`, lower-case hex, JSON's `\/`.
#[tokio::test]
async fn partly_escaped_secrets_never_reach_log_result_or_outputs() {
    let e = env().await;
    let secret = "s3cr3t-T0ken/with+chars==";
    let printer = r#"import json, os, re, sys, urllib.parse
k = os.environ["API_KEY"]
quoted = urllib.parse.quote(k)
lower = re.sub("%[0-9A-F]{2}", lambda m: m.group().lower(), quoted)
slashed = json.dumps(k).replace("/", "\\/")
print("quote", quoted)
print("lower", lower)
print("json", slashed)
with open(os.environ["BYOC_OUTPUT"], "a") as f:
    f.write("token=" + lower + "\n")
print("failing with", slashed, file=sys.stderr)
sys.exit(3)
"#;
    let id =
        e.cp.enqueue(EnqueueRequest::new(
            "action.script",
            serde_json::json!({
                "script": format!("python3 - <<'PY'\n{printer}PY"),
                "secret_env": {"API_KEY": secret}
            }),
        ))
        .unwrap();
    let v = e.finished(&id).await;
    let result = v.result.clone().unwrap();
    assert_eq!(result.status, JobStatus::Failed);
    let forms =
        ["s3cr3t-T0ken/with%2Bchars%3D%3D", "s3cr3t-T0ken/with%2bchars%3d%3d", "s3cr3t-T0ken\\/with+chars=="];
    let leaks = |what: &str, bytes: &[u8]| {
        let text = String::from_utf8_lossy(bytes);
        for form in forms.iter().chain([&secret]) {
            assert!(!text.contains(form), "{what} leaks {form:?}:\n{text}");
        }
    };
    let uploaded = e.cp.log(&id).unwrap();
    let text = String::from_utf8_lossy(&uploaded);
    for line in ["quote ***\n", "lower ***\n", "json \"***\"\n"] {
        assert!(text.contains(line), "{line:?} missing from the log:\n{text}");
    }
    leaks("uploaded log", &uploaded);
    leaks("spool", &std::fs::read(e.runner.state_dir.join("spool").join(format!("{id}.log"))).unwrap());
    leaks("result", serde_json::to_string(&result).unwrap().as_bytes());
    assert_eq!(result.outputs["token"], "***");
    leaks("runner log", e.runner.log().as_bytes());
}

/// A runaway job's log is capped on disk; the job keeps running to its end, and the
/// result says what was dropped and digests what was kept.
#[tokio::test]
async fn a_log_past_its_cap_keeps_head_and_tail_and_the_job_runs_on() {
    let e = env_with(byoc_control_plane::harness::RunnerOptions {
        env: vec![("BYOC_RUNNER__JOBS__LOG_MAX_MIB".into(), "1".into())],
        ..Default::default()
    })
    .await;
    let id = e
        .cp
        .enqueue(script(
            "echo first-line; head -c 6000000 /dev/zero | tr '\\0' x | fold -w 100; echo last-line; echo ran=yes >> \"$BYOC_OUTPUT\"",
        ))
        .unwrap();
    let v = e.finished(&id).await;
    let result = v.result.clone().unwrap();
    assert_eq!(result.status, JobStatus::Succeeded, "{:?}", result.error);
    assert_eq!(result.outputs["ran"], "yes", "the job did not run to its end");
    let uploaded = e.cp.log(&id).unwrap();
    let text = String::from_utf8_lossy(&uploaded);
    // The log opens with the runner's own lines (the job's network), then the job's.
    let first = text.find("first-line\n").expect("the head is gone") + "first-line\n".len();
    assert!(first < 1024, "the head is not at the start");
    assert!(
        text.contains("last-line\n[runner] log truncated: "),
        "the tail is gone: {:?}",
        &text[text.len().saturating_sub(300)..]
    );
    // Everything up to the first line, 6,000,000 x's folded into lines of 100 (the last
    // without a newline), the last line.
    let produced = first + 6_059_999 + "last-line\n".len();
    let kept_output = produced as u64 - result.log_omitted_bytes;
    assert_eq!(kept_output, 1 << 20, "head and tail together are not the cap");
    assert!(text.contains(&format!("… {} bytes omitted …", result.log_omitted_bytes)));
    assert_eq!(result.log_size, uploaded.len() as u64);
    assert_eq!(result.log_sha256, byoc_protocol::sha256_hex(&uploaded), "the digest is not of what was kept");
    assert!(uploaded.len() < (1 << 20) + 1024, "{} bytes kept", uploaded.len());
    let spool = std::fs::read(e.runner.state_dir.join("spool").join(format!("{id}.log"))).unwrap();
    assert_eq!(spool, uploaded);
    assert!(!e.runner.state_dir.join("spool").join(format!("{id}.tail")).exists());
    let show = e.cli_json(&["jobs", "show", &id]);
    assert_eq!(show["finished"]["log_omitted"], result.log_omitted_bytes);
}

#[tokio::test]
async fn a_slot_freed_during_a_held_poll_is_used_at_once() {
    // One action at a time, polls held the full 30 s.
    let e =
        env_with(byoc_control_plane::harness::RunnerOptions { actions_limit: 1, ..Default::default() }).await;
    let go = e.dir.path().join("go");
    let first =
        e.cp.enqueue(script(&format!("echo waiting; while [ ! -f {} ]; do sleep 0.05; done", go.display())))
            .unwrap();
    e.log_contains(&first, "waiting").await;
    // The runner now polls for the other groups only; this action job must wait...
    let second = e.cp.enqueue(script("echo second")).unwrap();
    std::fs::write(&go, "1").unwrap();
    e.finished(&first).await;
    // ...but not for the 30 s hold of the poll in flight when the slot freed.
    let v = e.cp.wait_for(&second, std::time::Duration::from_secs(20), |v| v.result.is_some()).await;
    assert!(v.is_some(), "the freed slot was not used until the held poll ended");
}

#[tokio::test]
async fn settled_jobs_past_the_journal_keep_move_to_the_archive_and_stay_visible() {
    // Envelopes valid for 3 s and no skew allowance: their nonces expire soon after.
    let opts = RunnerOptions {
        jobs_extra: "journal_keep = 10\nmax_clock_skew_secs = 0".into(),
        ..Default::default()
    };
    let mut e = env_with(opts).await;
    let mut ids = Vec::new();
    for i in 0..14 {
        let req = EnqueueRequest {
            ttl_secs: 3,
            ..EnqueueRequest::new("runner.noop", serde_json::json!({ "message": format!("job {i}") }))
        };
        let id = e.cp.enqueue(req).unwrap();
        assert_eq!(e.finished(&id).await.result.unwrap().status, JobStatus::Succeeded);
        ids.push(id);
    }
    // The daemon compacts on its 10 s tick once the nonces have expired.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(40);
    while audit_events(&e.runner.state_dir, "journal_compacted").is_empty() {
        assert!(std::time::Instant::now() < deadline, "no compaction:\n{}", e.runner.log());
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let compacted = &audit_events(&e.runner.state_dir, "journal_compacted")[0];
    assert!(compacted["detail"].as_str().unwrap().starts_with("4 settled jobs"), "{compacted}");
    // The journal keeps the newest 10; `--all` and `jobs show` still find the oldest.
    let listed = e.cli_json(&["jobs", "list"]);
    assert_eq!(listed.as_array().unwrap().len(), 10, "{listed}");
    let all = e.cli_json(&["jobs", "list", "--all"]);
    let all_ids: Vec<&str> = all.as_array().unwrap().iter().map(|j| j["job_id"].as_str().unwrap()).collect();
    assert_eq!(all_ids.len(), 14);
    assert_eq!(all_ids.last(), Some(&ids[0].as_str()), "newest first");
    let oldest = e.cli_json(&["jobs", "show", &ids[0]]);
    assert_eq!(oldest["phase"], "reported", "{oldest}");
    let journal = std::fs::read_to_string(e.runner.state_dir.join("journal.jsonl")).unwrap();
    assert!(!journal.contains(&ids[0]) && journal.contains(&ids[13]));
    // An archive whose newest job settled long ago (named as the runner names them,
    // with 1970's timestamps) goes at the first retention sweep, which a start runs;
    // the recent one stays.
    let archive_dir = e.runner.state_dir.join("journal-archive");
    let recent: Vec<_> = std::fs::read_dir(&archive_dir).unwrap().map(|d| d.unwrap().path()).collect();
    assert_eq!(recent.len(), 1, "{recent:?}");
    let ancient = archive_dir.join("0000000000001-0000086400000-0badc0de.jsonl.gz");
    std::fs::copy(&recent[0], &ancient).unwrap();
    e.runner.kill9().await;
    e.runner.spawn(None).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(40);
    while audit_events(&e.runner.state_dir, "journal_archives_removed").is_empty() {
        assert!(std::time::Instant::now() < deadline, "no archive sweep:\n{}", e.runner.log());
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let removed = &audit_events(&e.runner.state_dir, "journal_archives_removed")[0];
    assert!(removed["detail"].as_str().unwrap().starts_with("1 journal archives"), "{removed}");
    assert!(!ancient.exists() && recent[0].exists());
    assert_eq!(e.cli_json(&["jobs", "show", &ids[0]])["phase"], "reported");
    // The restarted runner replays the shorter journal and runs jobs as before.
    let stopped = e.cp.enqueue(EnqueueRequest::new("runner.noop", serde_json::Value::Null)).unwrap();
    e.finished(&stopped).await;
    let out = e.runner.cli(&["audit", "verify"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `jobs logs -f` prints what a running job wrote, keeps printing, and ends when the
/// job does.
#[tokio::test]
async fn jobs_logs_follow_a_running_job_until_it_ends() {
    use std::io::BufRead as _;
    let e = env().await;
    let id = e.cp.enqueue(script("echo first; sleep 3201 & wait")).unwrap();
    e.log_contains(&id, "first").await;
    let mut follower = std::process::Command::new(BIN)
        .args(["jobs", "logs", "-f", &id, "--state-dir"])
        .arg(e.dir.path().join("state"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(follower.stdout.take().unwrap()).lines();
    let first = lines.by_ref().map(|l| l.unwrap()).find(|l| l == "first");
    assert!(first.is_some(), "the follower never printed the job's first line");
    assert!(e.cp.job(&id).unwrap().result.is_none(), "printed only after the job ended");
    e.cp.cancel(&id).unwrap();
    e.finished(&id).await;
    // It ends by itself once the job has; nothing it printed is repeated.
    let rest: Vec<String> =
        tokio::task::spawn_blocking(move || lines.map(|l| l.unwrap()).collect()).await.unwrap();
    let status = follower.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!rest.iter().any(|l| l == "first"), "{rest:?}");
    let json = e.runner.cli(&["jobs", "logs", "-f", &id, "-o", "json"]);
    assert_eq!(json.status.code(), Some(64), "{json:?}");
}

/// `jobs list` and `jobs rejections` filter by status, kind, reason and time.
#[tokio::test]
async fn jobs_and_rejections_can_be_filtered() {
    let e = env().await;
    let ok = e.cp.enqueue(script("echo fine")).unwrap();
    let bad = e.cp.enqueue(script("exit 3")).unwrap();
    e.finished(&ok).await;
    e.finished(&bad).await;
    let expired =
        e.cp.enqueue(EnqueueRequest {
            tamper: Tamper { expires_offset_secs: Some(-3600), ..Default::default() },
            ..script("echo never")
        })
        .unwrap();
    e.rejected(&expired).await;
    let ids = |args: &[&str]| -> Vec<String> {
        let v = e.cli_json(args);
        v.as_array().unwrap().iter().map(|j| j["job_id"].as_str().unwrap_or("").to_string()).collect()
    };
    assert_eq!(ids(&["jobs", "list", "--status", "failed"]), std::slice::from_ref(&bad));
    assert_eq!(
        ids(&["jobs", "list", "--status", "succeeded", "--kind", "action.script"]),
        std::slice::from_ref(&ok)
    );
    assert!(ids(&["jobs", "list", "--kind", "terraform"]).is_empty());
    assert!(ids(&["jobs", "list", "--since", "2099-01-01"]).is_empty());
    let recent = ids(&["jobs", "list", "--since", "1h"]);
    assert!(recent.contains(&ok) && recent.contains(&bad), "{recent:?}");
    assert_eq!(ids(&["jobs", "rejections", "--reason", "expired"]), std::slice::from_ref(&expired));
    assert!(ids(&["jobs", "rejections", "--reason", "bad_signature"]).is_empty());
    let wrong = e.runner.cli(&["jobs", "list", "--since", "yesterday"]);
    assert_eq!(wrong.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("--since"), "{wrong:?}");
}

/// `status` says when the control plane last answered a poll and acknowledged a
/// result, and that polls fail once it is down.
#[tokio::test]
async fn status_says_when_the_control_plane_last_answered() {
    let e = env().await;
    let id = e.cp.enqueue(script("echo hi")).unwrap();
    e.finished(&id).await;
    let contact = status_until(&e, |c| c["last_result_job"] == id.as_str()).await;
    let now = byoc_control_plane::state::unix_ms();
    assert!(now - contact["last_poll_ms"].as_u64().unwrap() < 60_000, "{contact}");
    assert!(contact["poll_error"].is_null(), "{contact}");
    let text = String::from_utf8_lossy(&e.runner.cli(&["status"]).stdout).into_owned();
    assert!(text.contains(&format!("last result:    {id} acknowledged")), "{text}");
    assert!(text.contains("last poll:      20"), "{text}");
    e.cp.set_faults(byoc_control_plane::Faults { down: true, ..Default::default() }).await.unwrap();
    let contact = status_until(&e, |c| c["poll_error"]["error"].is_string()).await;
    assert_eq!(contact["last_result_job"], id.as_str(), "{contact}");
    let text = String::from_utf8_lossy(&e.runner.cli(&["status"]).stdout).into_owned();
    assert!(text.contains("poll failed:"), "{text}");
}

/// `status`'s `contact` once `pred` holds (the daemon writes it after each poll).
async fn status_until(e: &Env, pred: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let v = e.cli_json(&["status"]);
        if pred(&v["contact"]) {
            return v["contact"].clone();
        }
        assert!(std::time::Instant::now() < deadline, "status never showed it: {v}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Every example job file runs with `run-local`, or says in its `about` why it cannot
/// or how it ends: a job that ends on purpose with a code, exits with that code; one
/// that cannot run here is refused or fails, never succeeds quietly.
#[test]
fn every_example_job_runs_with_run_local_or_says_why_not() {
    use std::io::BufRead as _;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/jobs");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert!(files.len() >= 10, "{files:?}");
    for file in files {
        let job: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let about = job["about"].as_str().unwrap_or_default().to_string();
        let mut cmd = std::process::Command::new(BIN);
        cmd.arg("run-local")
            .arg(&file)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if about.contains("Ctrl-C") {
            // Runs until stopped: started, then interrupted as a person would.
            let mut child = cmd.spawn().unwrap();
            let first = std::io::BufReader::new(child.stdout.take().unwrap()).lines().next();
            assert!(first.is_some(), "{}: printed nothing", file.display());
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGINT,
            )
            .unwrap();
            assert_eq!(child.wait().unwrap().code(), Some(130), "{}", file.display());
            continue;
        }
        let out = cmd.output().unwrap();
        let said =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let code = out.status.code();
        if about.is_empty() {
            assert_eq!(
                code,
                Some(0),
                "{} has no `about` saying why it would not run:\n{said}",
                file.display()
            );
        } else if let Some(n) =
            about.split("exits ").nth(1).and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
        {
            assert_eq!(code, Some(n.parse().unwrap()), "{}: {about}\n{said}", file.display());
            assert!(said.contains(&format!("about this job: {about}")), "{said}");
        } else {
            assert!(
                about.contains("run-local cannot") || about.contains("run-local refuses"),
                "{}: {about}",
                file.display()
            );
            assert_ne!(code, Some(0), "{}: {about}\n{said}", file.display());
            assert!(said.contains(&about), "{} does not say why: {said}", file.display());
        }
    }
}
