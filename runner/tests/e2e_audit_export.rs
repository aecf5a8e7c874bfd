//! The customer's own copies of the audit log, end to end: moto's S3 (Object Lock on)
//! and CloudWatch Logs, and an OTLP collector written for the test (TLS with its own
//! CA, an API-key header). Every record and checkpoint arrives in each; outages of each
//! sink and a restart in the middle leave no gap and no duplicate; jobs are never held
//! up; `audit verify --from` checks the S3 copy and a downloaded one, and names the
//! object that was altered or removed; no secret reaches a copy.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;

use byoc_control_plane::gate::Gate;
use byoc_control_plane::harness::RunnerOptions;
use byoc_control_plane::moto::MotoServer;
use byoc_control_plane::otlp::{OtlpReceiver, attribute};
use byoc_protocol::JobStatus;
use common::*;

const BUCKET: &str = "acme-audit";
const GROUP: &str = "/acme/byoc-audit";
const OTLP_TOKEN: &str = "otlp-api-key-3f9c1b7e";
const AWS_SECRET: &str = "runner-instance-secret-9d2e";
const JOB_SECRET: &str = "job-printed-secret-51ab";

struct Sinks {
    moto: MotoServer,
    otlp: OtlpReceiver,
    /// Between the runner and moto, and the runner and the collector: outages.
    aws_gate: Gate,
    otlp_gate: Gate,
    files: tempfile::TempDir,
}

async fn sinks(locked: bool) -> Sinks {
    let moto = MotoServer::start().await;
    if locked {
        moto.create_locked_bucket(BUCKET).await;
    } else {
        moto.create_bucket(BUCKET).await;
    }
    moto.json_call("logs", "Logs_20140328.CreateLogGroup", serde_json::json!({ "logGroupName": GROUP }))
        .await;
    let otlp = OtlpReceiver::start().await.unwrap();
    let aws_gate = Gate::start(format!("127.0.0.1:{}", moto.port).parse().unwrap()).await.unwrap();
    let otlp_addr = otlp.url.trim_start_matches("https://").parse().unwrap();
    let otlp_gate = Gate::start(otlp_addr).await.unwrap();
    let files = tempfile::tempdir().unwrap();
    std::fs::write(files.path().join("otel-ca.pem"), &otlp.ca_pem).unwrap();
    std::fs::write(files.path().join("otel-headers"), format!("Authorization: Bearer {OTLP_TOKEN}\n"))
        .unwrap();
    // It holds the collector's key: the runner reads it only when no one else can.
    std::fs::set_permissions(
        files.path().join("otel-headers"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    Sinks { moto, otlp, aws_gate, otlp_gate, files }
}

fn export_config(s: &Sinks, otlp: bool) -> String {
    let mut text = format!(
        "\n[aws]\nregion = \"us-east-1\"\nendpoint_url = \"{}\"\n\n[audit.export]\nretry_max_secs = 1\n\n\
         [audit.export.s3]\nbucket = \"{BUCKET}\"\nprefix = \"byoc-audit\"\n\n\
         [audit.export.cloudwatch]\nlog_group = \"{GROUP}\"\n",
        s.aws_gate.url()
    );
    if otlp {
        text += &format!(
            "\n[audit.export.otlp]\nendpoint = \"https://{}\"\nca_file = \"{}\"\nheaders_file = \"{}\"\n",
            s.otlp_gate.addr,
            s.files.path().join("otel-ca.pem").display(),
            s.files.path().join("otel-headers").display()
        );
    }
    text
}

fn options(s: &Sinks, otlp: bool) -> RunnerOptions {
    RunnerOptions {
        extra: export_config(s, otlp),
        // The runner's own identity (its instance role on EC2).
        env: vec![
            ("AWS_ACCESS_KEY_ID".into(), "runner-instance-identity".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), AWS_SECRET.into()),
            ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
        ],
        ..Default::default()
    }
}

fn runner_id(e: &Env) -> String {
    e.cp.runners()[0].runner_id.clone()
}

fn local_lines(e: &Env) -> Vec<String> {
    byoc_audit::log::read_lines(&e.runner.state_dir.join("audit"), 0, u64::MAX).unwrap()
}

fn sink_status(e: &Env) -> BTreeMap<String, serde_json::Value> {
    let st = e.cli_json(&["status"]);
    st["audit_export"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["sink"].as_str().unwrap().to_string(), s.clone()))
        .collect()
}

/// Until every configured sink holds every record the log's last checkpoint covers and
/// no sink is failing.
async fn all_delivered(e: &Env, sinks: &[&str]) {
    eventually("every sink holds the whole log", async || {
        let latest = byoc_runner::audit_export::latest_checkpoint_size(&e.runner.state_dir.join("audit"));
        let st = sink_status(e);
        sinks.iter().all(|k| {
            st.get(*k).is_some_and(|s| {
                s["failing_since_ms"].is_null() && Some(s["delivered_records"].as_u64().unwrap()) == latest
            })
        }) && latest == Some(local_lines(e).len() as u64)
    })
    .await;
}

/// The record lines a CloudWatch stream holds (the checkpoint and key events aside).
async fn cloudwatch_records(s: &Sinks, stream: &str) -> Vec<String> {
    // Checkpoint, cosignature and key events carry a `stream` field; records do not.
    let is_record =
        |m: &String| serde_json::from_str::<serde_json::Value>(m).is_ok_and(|v| v["stream"].is_null());
    s.moto.log_messages(GROUP, stream).await.into_iter().filter(is_record).collect()
}

fn otlp_records(s: &Sinks) -> Vec<String> {
    s.otlp
        .records()
        .into_iter()
        .filter(|r| {
            attribute(r, "byoc.audit.stream").and_then(|v| v["stringValue"].as_str()) == Some("records")
        })
        .map(|r| r["body"]["stringValue"].as_str().unwrap().to_string())
        .collect()
}

/// Every object of the S3 copy, by name under `prefix`.
async fn s3_copy(s: &Sinks, prefix: &str) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for key in s.moto.s3_keys(BUCKET).await {
        if let Some(name) = key.strip_prefix(&format!("{prefix}/")) {
            out.insert(name.to_string(), s.moto.s3_object(BUCKET, &key).await.unwrap());
        }
    }
    out
}

fn verify_from(e: &Env, s: &Sinks, from: &str) -> std::process::Output {
    e.runner.cli(&[
        "audit",
        "verify",
        "--from",
        from,
        "--region",
        "us-east-1",
        "--endpoint-url",
        &s.moto.url(),
    ])
}

#[tokio::test]
async fn a_jobs_whole_trail_reaches_every_sink_and_verifies_from_the_copy_alone() {
    let s = sinks(true).await;
    let e = env_with(options(&s, true)).await;
    let job = e.cp.enqueue(script(&format!("echo {JOB_SECRET}"))).unwrap();
    assert_eq!(e.finished(&job).await.result.unwrap().status, JobStatus::Succeeded);
    local_has_event(&e, "job_reported").await;
    all_delivered(&e, &["s3", "cloudwatch", "otlp"]).await;

    let local = local_lines(&e);
    let id = runner_id(&e);
    // CloudWatch and OTLP: every record, its exact line, once, in order.
    assert_eq!(cloudwatch_records(&s, &id).await, local);
    assert_eq!(otlp_records(&s), local);
    let finished = s
        .otlp
        .records()
        .into_iter()
        .find(|r| {
            attribute(r, "byoc.audit.event").and_then(|v| v["stringValue"].as_str()) == Some("job_finished")
        })
        .unwrap();
    assert_eq!(attribute(&finished, "byoc.audit.job").unwrap()["stringValue"], job.as_str());
    assert!(attribute(&finished, "byoc.audit.digest.log_sha256").is_some());
    let resource = &finished["resource"]["attributes"];
    assert!(resource.to_string().contains(&id), "{resource}");
    // The collector got the customer's header; its value is nowhere else.
    assert!(s.otlp.headers().iter().all(|h| h["authorization"] == format!("Bearer {OTLP_TOKEN}").as_str()));
    // Checkpoints too: their count in each copy is the local one.
    let checkpoints = std::fs::read_to_string(e.runner.state_dir.join("audit/checkpoints.jsonl")).unwrap();
    let otlp_checkpoints = s
        .otlp
        .records()
        .into_iter()
        .filter(|r| {
            attribute(r, "byoc.audit.stream").and_then(|v| v["stringValue"].as_str()) == Some("checkpoints")
        })
        .count();
    assert!(otlp_checkpoints >= 1 && otlp_checkpoints <= checkpoints.lines().count());

    // S3 (Object Lock: every object carried its checksum, or moto would have refused it).
    let prefix = format!("byoc-audit/{id}");
    let copy = s3_copy(&s, &prefix).await;
    assert!(copy.contains_key("runner.pub") && copy.contains_key("runner.vkey"), "{:?}", copy.keys());
    let vkey = String::from_utf8(copy["runner.vkey"].clone()).unwrap();
    assert!(vkey.starts_with(&format!("byoc-runner/{}/{id}+", e.cp.install_id())), "{vkey}");
    let out = verify_from(&e, &s, &format!("s3://{BUCKET}/{prefix}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with(&format!("ok: s3://{BUCKET}/{prefix}: {} records", local.len())), "{stdout}");
    // The install's prefix: every runner's copy under it is verified, each named.
    let out = verify_from(&e, &s, &format!("s3://{BUCKET}/byoc-audit"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with(&format!("ok: s3://{BUCKET}/byoc-audit/{id}: ")), "{stdout}");
    // With a pinned key, one runner's copy must be named (the key is that runner's).
    let trust = s.files.path().join("trust");
    std::fs::write(&trust, format!("runner {}", String::from_utf8_lossy(&copy["runner.pub"]).trim()))
        .unwrap();
    let out = e.runner.cli(&[
        "audit",
        "verify",
        "--from",
        &format!("s3://{BUCKET}/byoc-audit"),
        "--trust",
        trust.to_str().unwrap(),
        "--region",
        "us-east-1",
        "--endpoint-url",
        &s.moto.url(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("it holds the copies of: {id}")));

    // No secret in any copy, nor in the runner's own log.
    let everything = format!(
        "{:?}{:?}{:?}{}",
        copy.values().map(|v| String::from_utf8_lossy(v).to_string()).collect::<Vec<_>>(),
        s.moto.log_messages(GROUP, &id).await,
        s.otlp.records(),
        e.runner.log()
    );
    for secret in [OTLP_TOKEN, AWS_SECRET, JOB_SECRET] {
        assert!(!everything.contains(secret), "{secret} leaked into a copy or the log");
    }
}

async fn local_has_event(e: &Env, event: &str) {
    let needle = format!("\"event\":\"{event}\"");
    eventually(event, async || local_lines(e).iter().any(|l| l.contains(&needle))).await;
}

#[tokio::test]
async fn outages_of_every_sink_and_a_restart_leave_no_gap_and_no_duplicate() {
    let s = sinks(true).await;
    let mut e = env_with(options(&s, true)).await;
    let first = e.cp.enqueue(script("echo one")).unwrap();
    assert_eq!(e.finished(&first).await.result.unwrap().status, JobStatus::Succeeded);
    all_delivered(&e, &["s3", "cloudwatch", "otlp"]).await;

    // Every sink goes away; jobs go on.
    s.aws_gate.shut();
    s.otlp_gate.shut();
    let during = e.cp.enqueue(script("echo two")).unwrap();
    assert_eq!(e.finished(&during).await.result.unwrap().status, JobStatus::Succeeded);
    eventually("every sink reports the outage", async || {
        sink_status(&e).values().filter(|s| !s["failing_since_ms"].is_null()).count() == 3
    })
    .await;
    let st = sink_status(&e);
    assert!(st["s3"]["lag_records"].as_u64().unwrap() > 0, "{st:?}");
    assert!(st["otlp"]["last_error"].as_str().unwrap().contains(&s.otlp_gate.addr.to_string()));
    let metrics = String::from_utf8(e.runner.cli(&["metrics"]).stdout).unwrap();
    for sink in ["s3", "cloudwatch", "otlp"] {
        assert!(
            metrics.contains(&format!("byoc_runner_audit_export_failing{{sink=\"{sink}\"}} 1")),
            "{metrics}"
        );
    }
    let failed = audit_events(&e.runner.state_dir, "audit_export_failed");
    assert_eq!(failed.len(), 3, "one record per sink's outage: {failed:?}");

    // A restart in the middle of the outage: the cursors hold.
    e.runner.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(e.runner.wait_exit(WAIT).await.is_some_and(|s| s.success()));
    e.runner.spawn(None).unwrap();
    let after = e.cp.enqueue(script("echo three")).unwrap();
    assert_eq!(e.finished(&after).await.result.unwrap().status, JobStatus::Succeeded);

    s.aws_gate.open();
    s.otlp_gate.open();
    local_has_event(&e, "audit_export_resumed").await;
    all_delivered(&e, &["s3", "cloudwatch", "otlp"]).await;
    let resumed = audit_events(&e.runner.state_dir, "audit_export_resumed");
    assert_eq!(resumed.len(), 3, "{resumed:?}");

    // Every record exactly once, in order, in each copy.
    let local = local_lines(&e);
    let id = runner_id(&e);
    assert_eq!(cloudwatch_records(&s, &id).await, local);
    assert_eq!(otlp_records(&s), local);
    let prefix = format!("byoc-audit/{id}");
    let copy = s3_copy(&s, &prefix).await;
    let mut next = 0;
    for name in copy.keys().filter(|k| k.starts_with("records/")) {
        let (_, from, to) = byoc_audit::export::parse_object_name(name).unwrap();
        assert_eq!(from, next, "objects overlap or leave a gap: {:?}", copy.keys());
        next = to;
    }
    assert_eq!(next, local.len() as u64);
    let out = verify_from(&e, &s, &format!("s3://{BUCKET}/{prefix}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test]
async fn an_altered_or_removed_object_fails_verification_by_name_and_a_removed_sink_stops() {
    // A bucket without Object Lock: what someone with write access could do to it.
    let s = sinks(false).await;
    let mut e = env_with(options(&s, true)).await;
    let job = e.cp.enqueue(script("echo hello")).unwrap();
    assert_eq!(e.finished(&job).await.result.unwrap().status, JobStatus::Succeeded);
    all_delivered(&e, &["s3", "cloudwatch", "otlp"]).await;
    let id = runner_id(&e);
    let prefix = format!("byoc-audit/{id}");

    // A downloaded copy verifies as a directory, with the customer's pinned key.
    let copy = s3_copy(&s, &prefix).await;
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in &copy {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
    let trust = dir.path().join("../pinned-trust");
    // The customer's pinned keys: the runner's and the control plane's.
    let pinned = format!(
        "runner {}\ncontrol-plane {}\n",
        String::from_utf8_lossy(&copy["runner.pub"]).trim(),
        String::from_utf8_lossy(&copy["control-plane.pub"]).trim()
    );
    std::fs::write(&trust, &pinned).unwrap();
    let out = e.runner.cli(&[
        "audit",
        "verify",
        "--from",
        dir.path().to_str().unwrap(),
        "--trust",
        trust.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("keys taken from the copy"));
    // Another runner's key pinned: refused.
    let other = byoc_protocol::generate_signing_key();
    let foreign = pinned.replace(
        String::from_utf8_lossy(&copy["runner.pub"]).trim(),
        &byoc_protocol::b64(other.verifying_key().as_bytes()),
    );
    std::fs::write(&trust, foreign).unwrap();
    let out = e.runner.cli(&[
        "audit",
        "verify",
        "--from",
        dir.path().to_str().unwrap(),
        "--trust",
        trust.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));

    // One record altered in its object: the object is named.
    let victim = copy.keys().find(|k| k.starts_with("records/")).unwrap().clone();
    let original = copy[&victim].clone();
    let altered =
        String::from_utf8(original.clone()).unwrap().replacen("runner_started", "runner_stopped", 1);
    assert_ne!(altered.as_bytes(), original.as_slice());
    s.moto.s3_put(BUCKET, &format!("{prefix}/{victim}"), altered.into_bytes()).await;
    let out = verify_from(&e, &s, &format!("s3://{BUCKET}/{prefix}"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&victim), "{err}");

    // Restored, then one object removed: the gap is named.
    s.moto.s3_put(BUCKET, &format!("{prefix}/{victim}"), original).await;
    assert!(verify_from(&e, &s, &format!("s3://{BUCKET}/{prefix}")).status.success());
    // (The first: the last one removed would read as a shorter log, which the
    // checkpoints prove truncated.)
    let (_, from, to) = byoc_audit::export::parse_object_name(&victim).unwrap();
    assert_eq!(s.moto.s3_delete(BUCKET, &format!("{prefix}/{victim}")).await, 204);
    let out = verify_from(&e, &s, &format!("s3://{BUCKET}/{prefix}"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("records {from}..{to} are missing")), "{err}");

    // The customer removes the OTLP sink: the copy there stops, audited, the others go on.
    e.runner.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(e.runner.wait_exit(WAIT).await.is_some_and(|s| s.success()));
    let config = std::fs::read_to_string(&e.runner.config_path).unwrap();
    let cut = config.find("\n[audit.export.otlp]").unwrap();
    std::fs::write(&e.runner.config_path, &config[..cut]).unwrap();
    let received = s.otlp.records().len();
    e.runner.spawn(None).unwrap();
    local_has_event(&e, "audit_export_stopped").await;
    all_delivered(&e, &["s3", "cloudwatch"]).await;
    assert!(!sink_status(&e).contains_key("otlp"));
    assert_eq!(s.otlp.records().len(), received, "nothing more went to the removed sink");
    let stopped = audit_events(&e.runner.state_dir, "audit_export_stopped");
    assert_eq!(stopped[0]["kind"], "otlp");
}

#[tokio::test]
async fn a_sink_that_cannot_be_built_stops_the_start_with_the_reason() {
    let s = sinks(false).await;
    let mut opts = options(&s, true);
    opts.extra = opts.extra.replace("otel-ca.pem", "missing-ca.pem");
    let cp = start_cp().await;
    let dir = tempfile::tempdir().unwrap();
    let mut runner =
        byoc_control_plane::harness::RunnerProcess::start(std::path::Path::new(BIN), dir.path(), &cp, &opts)
            .unwrap();
    let status = runner.wait_exit(WAIT).await.expect("the runner exits");
    assert!(!status.success());
    let log = runner.log();
    assert!(log.contains("the audit export cannot start") && log.contains("missing-ca.pem"), "{log}");
    // `config check` says so before a start would.
    let out = runner.cli(&["config", "check", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let check = v["checks"].as_array().unwrap().iter().find(|c| c["name"] == "audit_export").unwrap().clone();
    assert_eq!(check["status"], "fail", "{check}");
    assert!(check["detail"].as_str().unwrap().contains("missing-ca.pem"), "{check}");
    std::fs::write(
        &runner.config_path,
        std::fs::read_to_string(&runner.config_path).unwrap().replace("missing-ca.pem", "otel-ca.pem"),
    )
    .unwrap();
    let out = runner.cli(&["config", "check", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let check = v["checks"].as_array().unwrap().iter().find(|c| c["name"] == "audit_export").unwrap().clone();
    assert_eq!(check["status"], "ok", "{check}");
    assert!(check["detail"].as_str().unwrap().contains(&format!("s3://{BUCKET}/byoc-audit/")), "{check}");
}
