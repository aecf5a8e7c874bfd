//! The audit log end to end: every job transition is a signed, checkpointed record;
//! the control plane acknowledges by cosignature (also after an outage); `audit verify`
//! works offline, on a copy, with pinned keys, and proves truncation; proofs check out.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::time::Duration;

use byoc_control_plane::{EnqueueRequest, Faults, Tamper};
use byoc_protocol::JobStatus;
use common::*;

fn runner_id(e: &Env) -> String {
    e.cp.runners()[0].runner_id.clone()
}

fn local_size(e: &Env) -> u64 {
    byoc_audit::log::read_lines(&e.runner.state_dir.join("audit"), 0, u64::MAX).unwrap().len() as u64
}

/// Wait (woken by the runner's uploads) until the local log contains `needle`.
async fn local_has(e: &Env, needle: &str) {
    let dir = e.runner.state_dir.join("audit");
    let has = || byoc_audit::log::read_lines(&dir, 0, u64::MAX).unwrap().iter().any(|l| l.contains(needle));
    assert!(e.cp.wait_until(WAIT, |_| has()).await, "the audit log never got {needle}");
}

async fn all_acknowledged(e: &Env) {
    let id = runner_id(e);
    let ok = e.cp.wait_until(WAIT, |cp| cp.audit_size(&id) > 0 && cp.audit_size(&id) == local_size(e)).await;
    assert!(ok, "control plane acknowledged {} of {} records", e.cp.audit_size(&id), local_size(e));
}

fn audit_cli(e: &Env, args: &[&str]) -> std::process::Output {
    let mut all = vec!["audit"];
    all.extend_from_slice(args);
    e.runner.cli(&all)
}

#[tokio::test]
async fn jobs_are_audited_acknowledged_and_verifiable_offline() {
    let e = env().await;
    let ok = e.cp.enqueue(script("echo audited")).unwrap();
    let bad =
        e.cp.enqueue(EnqueueRequest {
            tamper: Tamper { bad_signature: true, ..Default::default() },
            ..EnqueueRequest::new("runner.noop", serde_json::Value::Null)
        })
        .unwrap();
    assert_eq!(e.finished(&ok).await.result.unwrap().status, JobStatus::Succeeded);
    e.rejected(&bad).await;
    local_has(&e, "\"job_reported\"").await;
    all_acknowledged(&e).await;

    let dir = e.runner.state_dir.join("audit");
    let lines = byoc_audit::log::read_lines(&dir, 0, u64::MAX).unwrap();
    let records: Vec<byoc_audit::log::Record> =
        lines.iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let events: Vec<&str> = records.iter().map(|r| r.event.as_str()).collect();
    for want in [
        "runner_started",
        "key_created",
        "job_received",
        "job_claimed",
        "job_started",
        "job_finished",
        "job_reported",
        "job_rejected",
    ] {
        assert!(events.contains(&want), "no {want} in {events:?}");
    }
    let rejected = records.iter().find(|r| r.event == "job_rejected").unwrap();
    assert_eq!(rejected.reason.as_deref(), Some("bad_signature"));
    let finished = records.iter().find(|r| r.event == "job_finished").unwrap();
    assert_eq!(finished.job.as_deref(), Some(ok.as_str()));
    assert_eq!(finished.digests["log_sha256"], e.cp.job(&ok).unwrap().log_sha256);
    let loaded = records.iter().find(|r| r.event == "config_loaded").unwrap();
    assert_eq!(loaded.digests["config_sha256"].len(), 64);
    // Never secrets or tokens: nothing resembling the bootstrap or access tokens.
    assert!(!lines.iter().any(|l| l.contains("bt-") || l.contains("at-")), "a token reached the audit log");

    // Verify offline, as the customer would.
    let out = audit_cli(&e, &["verify", "-o", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["report"]["records"], lines.len() as u64);
    assert_eq!(v["report"]["acknowledged_size"], lines.len() as u64);

    // The tail for people (ISO 8601 times), and as stored with -o json.
    let out = audit_cli(&e, &["tail", "-n", "2"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(text.lines().count(), 2, "{text}");
    assert!(text.lines().all(|l| l.contains("T") && l.contains("Z  ")), "no ISO times: {text}");
    let out = audit_cli(&e, &["tail", "-n", "2", "-o", "json"]);
    let json: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(json.len(), 2);
    assert_eq!(json[0]["seq"].as_u64().map(|n| n + 1), json[1]["seq"].as_u64(), "{json:?}");

    // Filters: one job's records, one event, a time; export with a filter has only those.
    let records = |args: &[&str]| -> Vec<serde_json::Value> {
        let out = audit_cli(&e, args);
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let of_job = records(&["tail", "-n", "100", "-o", "json", "--job", &ok]);
    assert!(of_job.len() >= 3 && of_job.iter().all(|r| r["job"] == ok.as_str()), "{of_job:?}");
    let finished = records(&["tail", "-n", "100", "-o", "json", "--event", "job_finished", "--job", &ok]);
    assert_eq!(finished.len(), 1, "{finished:?}");
    assert!(records(&["tail", "-o", "json", "--since", "2099-01-01"]).is_empty());
    let exported = records(&["export", "--event", "job_received"]);
    assert!(!exported.is_empty(), "{exported:?}");
    assert!(
        exported.iter().all(|x| x["type"] == "record" && x["record"]["event"] == "job_received"),
        "{exported:?}"
    );
    let bad = audit_cli(&e, &["export", "--since", "last tuesday"]);
    assert_eq!(bad.status.code(), Some(64), "{bad:?}");

    // An inclusion proof a third party can check.
    let out = audit_cli(&e, &["prove", "2", "-o", "json"]);
    let p: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let h = |s: &serde_json::Value| -> byoc_audit::merkle::Hash {
        hex::decode(s.as_str().unwrap()).unwrap().try_into().unwrap()
    };
    let proof: Vec<_> = p["proof"].as_array().unwrap().iter().map(h).collect();
    assert!(byoc_audit::merkle::verify_inclusion(
        2,
        p["tree_size"].as_u64().unwrap(),
        &h(&p["leaf_hash"]),
        &proof,
        &h(&p["root"])
    ));
    assert_eq!(h(&p["leaf_hash"]), byoc_audit::merkle::leaf_hash(lines[2].as_bytes()));

    // On a copy elsewhere, with pinned keys; then a cut log is provably truncated.
    let copy = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&dir).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), copy.path().join(f.file_name())).unwrap();
    }
    let trust = copy.path().join("trust");
    std::fs::write(
        &trust,
        format!(
            "runner {}control-plane {}\n",
            std::fs::read_to_string(dir.join("runner.pub")).unwrap(),
            e.cp.public_key_b64()
        ),
    )
    .unwrap();
    let copy_dir = copy.path().display().to_string();
    let trust_s = trust.display().to_string();
    let out = audit_cli(&e, &["verify", "--dir", &copy_dir, "--trust", &trust_s]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let log = copy.path().join("log.jsonl");
    let text = std::fs::read_to_string(&log).unwrap();
    let kept: String = text.lines().take(lines.len() - 1).map(|l| format!("{l}\n")).collect();
    std::fs::write(&log, kept).unwrap();
    let out = audit_cli(&e, &["verify", "--dir", &copy_dir, "--trust", &trust_s]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("provable truncation"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A control-plane key the log was not cosigned with fails too.
    std::fs::write(
        &trust,
        format!(
            "runner {}control-plane {}\n",
            std::fs::read_to_string(dir.join("runner.pub")).unwrap(),
            byoc_protocol::b64(byoc_protocol::generate_signing_key().verifying_key().as_bytes())
        ),
    )
    .unwrap();
    let out = audit_cli(&e, &["verify", "--dir", &dir.display().to_string(), "--trust", &trust_s]);
    assert_eq!(out.status.code(), Some(1));
}

#[tokio::test]
async fn records_made_during_an_outage_are_acknowledged_after_it() {
    let e = env().await;
    let go = e.dir.path().join("go");
    let id =
        e.cp.enqueue(script(&format!(
            "echo waiting; while [ ! -f {} ]; do sleep 0.05; done; echo done",
            go.display()
        )))
        .unwrap();
    e.log_contains(&id, "waiting").await;
    all_acknowledged(&e).await;
    e.cp.set_faults(Faults { down: true, ..Default::default() }).await.unwrap();
    std::fs::write(&go, "1").unwrap();
    // The job finishes during the outage: its records exist locally, unacknowledged.
    let deadline = tokio::time::Instant::now() + WAIT;
    while !byoc_audit::log::read_lines(&e.runner.state_dir.join("audit"), 0, u64::MAX)
        .unwrap()
        .iter()
        .any(|l| l.contains("\"job_finished\""))
    {
        assert!(tokio::time::Instant::now() < deadline, "no job_finished record during the outage");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(e.cp.audit_size(&runner_id(&e)) < local_size(&e));
    e.cp.set_faults(Faults::default()).await.unwrap();
    e.finished(&id).await;
    all_acknowledged(&e).await;
    assert!(audit_cli(&e, &["verify"]).status.success());
}

#[tokio::test]
async fn kill_9_during_heavy_appends_then_restart_and_verify() {
    let mut e = env().await;
    let ids: Vec<String> = (0..60)
        .map(|_| e.cp.enqueue(EnqueueRequest::new("runner.noop", serde_json::Value::Null)).unwrap())
        .collect();
    // Kill once a good part of the work is done, while records are being appended.
    let id0 = ids[20].clone();
    assert!(e.cp.wait_until(WAIT, |cp| cp.job(&id0).is_some_and(|v| v.result.is_some())).await);
    e.runner.kill9().await;
    e.runner.spawn(None).unwrap();
    for id in &ids {
        let v = e.finished(id).await;
        let s = v.result.unwrap().status;
        assert!(matches!(s, JobStatus::Succeeded | JobStatus::Interrupted), "{s:?}");
    }
    all_acknowledged(&e).await;
    let out = audit_cli(&e, &["verify"]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = byoc_audit::log::read_lines(&e.runner.state_dir.join("audit"), 0, u64::MAX).unwrap();
    assert_eq!(lines.iter().filter(|l| l.contains("\"runner_started\"")).count(), 2);
}

/// `audit key` publishes the verifier keys a third party needs, in the signed-note
/// format (`name+hash+base64(0x01||key)`), named as the checkpoints' origin; checked here
/// as Go's `sumdb/note` would, without the runner's own code: the key hash, then every
/// acknowledged checkpoint's runner and control-plane signatures.
#[tokio::test]
async fn the_published_verifier_keys_open_every_acknowledged_checkpoint() {
    use base64::Engine as _;
    use ed25519_dalek::Verifier as _;
    use sha2::Digest as _;
    let e = env().await;
    let ok = e.cp.enqueue(script("echo keyed")).unwrap();
    assert_eq!(e.finished(&ok).await.result.unwrap().status, JobStatus::Succeeded);
    local_has(&e, "\"job_reported\"").await;
    all_acknowledged(&e).await;

    let out = audit_cli(&e, &["key", "-o", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let keys: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let origin = keys["origin"].as_str().unwrap().to_string();
    assert_eq!(origin, format!("byoc-runner/{}/{}", e.cp.install_id(), runner_id(&e)));
    let b64 = base64::engine::general_purpose::STANDARD;
    let parse = |vkey: &str| {
        let mut parts = vkey.splitn(3, '+');
        let (name, hash, key) = (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
        let alg_key = b64.decode(key).unwrap();
        assert_eq!((alg_key.len(), alg_key[0]), (33, 1), "Ed25519");
        let mut h = sha2::Sha256::new();
        h.update(name.as_bytes());
        h.update(b"\n");
        h.update(&alg_key);
        assert_eq!(hash, hex::encode(&h.finalize()[..4]), "the key hash of {vkey}");
        let key = ed25519_dalek::VerifyingKey::from_bytes(alg_key[1..].try_into().unwrap()).unwrap();
        (name.to_string(), hex::decode(hash).unwrap(), key)
    };
    let runner = parse(keys["runner"].as_str().unwrap());
    assert_eq!(runner.0, origin, "the key is named as the origin (C2SP)");
    let cp = parse(keys["control_plane"][0].as_str().unwrap());
    let text = std::fs::read_to_string(e.runner.state_dir.join("audit/cosigned.jsonl")).unwrap();
    let mut opened = 0;
    for line in text.lines() {
        let note =
            serde_json::from_str::<serde_json::Value>(line).unwrap()["note"].as_str().unwrap().to_string();
        let (body, sigs) = note.split_once("\n\n").unwrap();
        let body = format!("{body}\n");
        assert!(body.starts_with(&format!("{origin}\n")));
        for (name, hash, key) in [&runner, &cp] {
            let verified = sigs.lines().any(|l| {
                let Some((n, sig)) = l.strip_prefix("\u{2014} ").and_then(|r| r.rsplit_once(' ')) else {
                    return false;
                };
                let blob = b64.decode(sig).unwrap();
                n == name
                    && blob[..4] == hash[..]
                    && key
                        .verify(body.as_bytes(), &ed25519_dalek::Signature::from_slice(&blob[4..]).unwrap())
                        .is_ok()
            });
            assert!(verified, "{name} did not sign {note}");
        }
        opened += 1;
    }
    assert!(opened > 0);

    // And with the Go team's transparency-log packages (Debian's golang-golang-x-mod-dev):
    // the published keys open every checkpoint, roots, consistency and inclusion hold.
    let cache = tempfile::tempdir().unwrap();
    let go = std::process::Command::new("go")
        .arg("run")
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/go/verify_audit.go"))
        .arg(e.runner.state_dir.join("audit"))
        .arg(keys["runner"].as_str().unwrap())
        .arg(keys["control_plane"][0].as_str().unwrap())
        .env("GO111MODULE", "off")
        .env("GOPATH", "/usr/share/gocode")
        .env("GOCACHE", cache.path())
        .env("GOFLAGS", "")
        .output()
        .expect("go is required (scripts/setup installs golang-go and golang-golang-x-mod-dev)");
    let said = String::from_utf8_lossy(&go.stdout);
    assert!(go.status.success(), "{said}{}", String::from_utf8_lossy(&go.stderr));
    assert!(said.starts_with("ok: "), "{said}");
}
