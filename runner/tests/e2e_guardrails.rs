//! End to end against the reference control plane: the customer's maintenance windows
//! (docs/GUARDRAILS.md). A real runner, a real clock: the window opens a few seconds
//! after the job arrives.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

mod common;

use std::time::Duration;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::harness::RunnerOptions;
use byoc_protocol::{JobStatus, RejectReason};
use common::*;

fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64
}

fn rfc3339(unix: i64) -> String {
    byoc_runner::clock::rfc3339(unix)
}

/// Actions wait for a window opening at `opens`; sandbox provisioning is refused
/// outside a window that opened and closed long ago.
fn guardrails(opens: i64) -> String {
    format!(
        r#"
[[guardrails.window]]
name = "soon"
once = ["{}/1h"]

[[guardrails.window]]
name = "past"
time_zone = "Europe/Berlin"
once = ["2020-01-01T00:00/1h"]

[[guardrails.window_rule]]
name = "actions-wait"
windows = ["soon"]
operations = ["action.trigger"]

[[guardrails.window_rule]]
name = "provisioning-refused"
windows = ["past"]
operations = ["sandbox.provision"]
outside = "refuse"
"#,
        rfc3339(opens)
    )
}

#[tokio::test]
async fn a_job_waits_for_its_window_is_reported_waiting_then_runs_and_others_are_refused() {
    let opens = unix_now() + 8;
    // One action at a time: the job that waits must give its slot back.
    let e =
        env_with(RunnerOptions { extra: guardrails(opens), actions_limit: 1, ..Default::default() }).await;

    // Refused outside its window, before any claim.
    let refused =
        e.cp.enqueue(EnqueueRequest {
            entity: "sandbox".into(),
            operation: "provision".into(),
            ..script("echo never")
        })
        .unwrap();
    let v = e.rejected(&refused).await;
    assert_eq!(v.rejections[0].0, RejectReason::OutsideWindow, "{:?}", v.rejections);
    assert!(v.rejections[0].1.contains("provisioning-refused"), "{:?}", v.rejections);
    assert_eq!(v.claims, 0);

    // Held: claimed, reported waiting with the window's start, not run.
    let held = e.cp.enqueue(script("echo ran in the window")).unwrap();
    let v =
        e.cp.wait_for(&held, Duration::from_secs(30), |v| v.waiting.is_some() || v.result.is_some())
            .await
            .unwrap();
    let waiting = v.waiting.clone().expect("reported waiting before it ran");
    assert_eq!(waiting.state, "waiting_window");
    assert_eq!(waiting.until, Some(opens));
    assert!(waiting.detail.contains("actions-wait"), "{waiting:?}");
    assert_eq!(v.claims, 1);
    // The customer sees it too, from the state dir alone.
    let show = e.cli_json(&["jobs", "show", &held]);
    assert_eq!(show["phase"], "waiting_window", "{show}");
    let status = e.cli_json(&["status"]);
    assert_eq!(status["jobs_waiting"][0], held.as_str(), "{status}");

    // Another action no rule names runs meanwhile: the waiting job holds no slot.
    let free =
        e.cp.enqueue(EnqueueRequest {
            entity: "artifact".into(),
            operation: "sync".into(),
            ..EnqueueRequest::new("runner.noop", serde_json::json!({}))
        })
        .unwrap();
    let free_v = e.finished(&free).await;
    assert!(e.cp.job(&held).unwrap().result.is_none(), "the held job ran before its window");
    assert_eq!(free_v.result.unwrap().status, JobStatus::Succeeded);

    // The window opens: it runs, once.
    let v = e.finished(&held).await;
    let r = v.result.clone().unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert!(r.started_at_ms.unwrap() >= opens as u64 * 1000, "started before the window opened");
    assert!(e.output(&held).contains("ran in the window"));
    assert_eq!(v.waiting, None);
    assert_eq!(v.waited.len(), 1, "{:?}", v.waited);
    assert_eq!(started_count(&e.dir.path().join("state"), &held), 1);

    // Audited, and the log verifies.
    let waits = audit_events(&e.dir.path().join("state"), "window_wait");
    assert_eq!(waits.len(), 1);
    assert_eq!(waits[0]["job"], held.as_str());
    let rejected = audit_events(&e.dir.path().join("state"), "job_rejected");
    assert!(rejected.iter().any(|r| r["reason"] == "outside_window"), "{rejected:?}");
    let out = e.runner.cli(&["audit", "verify"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
}

#[tokio::test]
async fn a_job_that_expires_while_it_waits_is_rejected_expired_and_never_runs() {
    // The window opens an hour from now; the envelope lives 3 s.
    let e = env_with(RunnerOptions { extra: guardrails(unix_now() + 3600), ..Default::default() }).await;
    let id = e.cp.enqueue(EnqueueRequest { ttl_secs: 3, ..script("echo never") }).unwrap();
    let v = e.rejected(&id).await;
    assert_eq!(v.rejections[0].0, RejectReason::Expired, "{:?}", v.rejections);
    assert!(v.rejections[0].1.contains("waiting for its maintenance window"), "{:?}", v.rejections);
    assert_eq!(v.waited.len(), 1, "it was reported waiting first");
    assert!(v.result.is_none());
    assert_eq!(started_count(&e.dir.path().join("state"), &id), 0);
}

#[tokio::test]
async fn a_bad_guardrails_config_is_refused_with_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runner.toml");
    let key = byoc_protocol::b64(byoc_protocol::generate_signing_key().verifying_key().as_bytes());
    std::fs::write(
        &config,
        format!(
            "[control_plane]\nurl = \"https://cp.example.com\"\npublic_keys = [\"{key}\"]\n\
             [runner]\ninstall_id = \"inst-1\"\n\
             [[guardrails.window]]\nname = \"w\"\ntime_zone = \"Mars/Olympus\"\nweekly = [\"caturday 01:00-02:00\"]\n\
             [[guardrails.window_rule]]\nname = \"r\"\nwindows = [\"nope\"]\n"
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_byoc-runner"))
        .args(["config", "validate", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    for needle in ["Mars/Olympus", "caturday", "window \"nope\" is not defined"] {
        assert!(text.contains(needle), "missing {needle:?}:\n{text}");
    }
}

/// Every action needs a local approval; requests stay open 10 minutes.
const APPROVALS: &str = r#"
[[guardrails.approval_rule]]
name = "actions-need-approval"
operations = ["action.trigger"]
expires = "10m"
"#;

#[tokio::test]
async fn approvals_hold_jobs_until_an_admin_answers_and_every_answer_is_audited() {
    let e = env_with(RunnerOptions { extra: APPROVALS.into(), ..Default::default() }).await;
    let state = e.dir.path().join("state");

    // Approved: it runs, once.
    let yes = e.cp.enqueue(script("echo approved and ran")).unwrap();
    let listed = e.awaiting_approval(&yes).await;
    assert_eq!(listed["kind"], "action.script");
    assert_eq!(listed["operation"], "action.trigger");
    assert_eq!(listed["rule"], "actions-need-approval");
    assert!(e.cp.job(&yes).unwrap().result.is_none(), "ran before it was approved");
    // `approvals show`: what it will run, from the signed job the runner keeps.
    let shown = e.cli_json(&["approvals", "show", &yes]);
    assert_eq!(shown["runs"]["script"], "echo approved and ran", "{shown}");
    assert_eq!(shown["request"]["rule"], "actions-need-approval", "{shown}");
    assert!(shown["decision"].is_null(), "{shown}");
    let text = e.runner.cli(&["approvals", "show", &yes]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("script: echo approved and ran") && text.contains("decided:    not yet"), "{text}");
    let missing = e.runner.cli(&["approvals", "show", "job-nope"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no approval request"), "{missing:?}");
    // Not root and not in roles.admin_group: refused, nothing written.
    let denied = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN, "approve", &yes, "--state-dir"])
        .arg(&state)
        .output()
        .expect("setpriv (util-linux)");
    assert_eq!(denied.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&denied.stderr).contains("need root"), "{denied:?}");
    let out = e.runner.cli(&["approve", &yes, "--reason", "CHG-1"]);
    assert!(out.status.success(), "{out:?}");
    let v = e.finished(&yes).await;
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded);
    assert!(e.output(&yes).contains("approved and ran"));
    // Answering it again: an error, no second record.
    let again = e.runner.cli(&["approve", &yes]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("is awaiting approval"), "{again:?}");

    // Denied: refused with the reason, never run.
    let no = e.cp.enqueue(script("echo never")).unwrap();
    e.awaiting_approval(&no).await;
    let out = e.runner.cli(&["deny", &no, "--reason", "not during the audit"]);
    assert!(out.status.success(), "{out:?}");
    let v = e.rejected(&no).await;
    assert_eq!(v.rejections[0].0, RejectReason::ApprovalDenied, "{:?}", v.rejections);
    assert!(v.rejections[0].1.contains("not during the audit"), "{:?}", v.rejections);
    assert_eq!(started_count(&state, &no), 0);

    // An unknown job: an error.
    let unknown = e.runner.cli(&["deny", "job-nope", "--reason", "x"]);
    assert_eq!(unknown.status.code(), Some(1));

    // Audited: the request, who answered and why; the log verifies.
    let requested = audit_events(&state, "approval_requested");
    assert_eq!(requested.len(), 2, "{requested:?}");
    let approved = audit_events(&state, "approved");
    assert_eq!(approved.len(), 1, "{approved:?}");
    assert_eq!(approved[0]["job"], yes.as_str());
    assert!(approved[0]["detail"].as_str().unwrap().contains("CHG-1"), "{approved:?}");
    let denied = audit_events(&state, "denied");
    assert_eq!(denied.len(), 1, "{denied:?}");
    // Every record of a job that names its operation names the same one, the entity in
    // its own field: filtering on the operation finds the decision too.
    let records = audit_records(&state);
    for job in [yes.as_str(), denied[0]["job"].as_str().unwrap()] {
        let of_job: Vec<&serde_json::Value> =
            records.iter().filter(|r| r["job"] == job && r.get("operation").is_some()).collect();
        let operations: std::collections::BTreeSet<&str> =
            of_job.iter().filter_map(|r| r["operation"].as_str()).collect();
        assert_eq!(operations.len(), 1, "{job}: {of_job:#?}");
        assert!(!operations.iter().next().unwrap().contains('.'), "{operations:?}");
        let decision = of_job.iter().find(|r| ["approved", "denied"].contains(&r["event"].as_str().unwrap()));
        let received = of_job.iter().find(|r| r["event"] == "job_received");
        assert_eq!(decision.unwrap()["entity"], received.unwrap()["entity"], "{of_job:#?}");
        assert!(decision.unwrap()["entity"].is_string(), "{of_job:#?}");
    }
    let out = e.runner.cli(&["audit", "verify"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
}

/// A runner killed while jobs are held keeps their envelopes: the next start verifies
/// them again and holds them again; each then runs once, when its gate opens.
#[tokio::test]
async fn held_jobs_survive_a_runner_restart_and_run_once_when_their_gate_opens() {
    let opens = unix_now() + 15;
    let config = format!(
        "{}\n[[guardrails.approval_rule]]\nname = \"deploys\"\noperations = [\"component.deploy\"]\n",
        guardrails(opens)
    );
    let mut e = env_with(RunnerOptions { extra: config, ..Default::default() }).await;
    let state = e.dir.path().join("state");
    let windowed = e.cp.enqueue(script("echo windowed ran")).unwrap();
    let approved =
        e.cp.enqueue(EnqueueRequest {
            entity: "component".into(),
            operation: "deploy".into(),
            ..script("echo approved ran")
        })
        .unwrap();
    for id in [&windowed, &approved] {
        e.cp.wait_for(id, Duration::from_secs(30), |v| v.waiting.is_some()).await.expect("held");
        assert!(state.join("held").join(format!("{id}.json")).exists(), "envelope of {id} not kept");
    }
    e.runner.kill9().await;
    e.runner.spawn(None).unwrap();
    // Answered after the restart: the request the first run left still stands.
    e.awaiting_approval(&approved).await;
    let out = e.runner.cli(&["approve", &approved, "--reason", "after restart"]);
    assert!(out.status.success(), "{out:?}");
    for (id, said) in [(&approved, "approved ran"), (&windowed, "windowed ran")] {
        let v = e.finished(id).await;
        assert_eq!(v.result.as_ref().unwrap().status, JobStatus::Succeeded, "{v:?}\n{}", e.runner.log());
        assert!(e.output(id).contains(said));
        assert_eq!(started_count(&state, id), 1, "{id} ran more than once");
        assert!(!state.join("held").join(format!("{id}.json")).exists(), "envelope of {id} left behind");
    }
    let r = e.cp.job(&windowed).unwrap().result.unwrap();
    assert!(r.started_at_ms.unwrap() >= opens as u64 * 1000, "ran before its window");
}

#[tokio::test]
async fn an_unanswered_approval_request_expires_and_the_job_never_runs() {
    let config = "[[guardrails.approval_rule]]\nname = \"quick\"\noperations = [\"action.trigger\"]\nexpires = \"2s\"\n";
    let e = env_with(RunnerOptions { extra: config.into(), ..Default::default() }).await;
    let id = e.cp.enqueue(script("echo never")).unwrap();
    let v = e.rejected(&id).await;
    assert_eq!(v.rejections[0].0, RejectReason::ApprovalExpired, "{:?}", v.rejections);
    assert!(v.rejections[0].1.contains("quick"), "{:?}", v.rejections);
    assert_eq!(started_count(&e.dir.path().join("state"), &id), 0);
    // Too late to answer now.
    let late = e.runner.cli(&["approve", &id]);
    assert_eq!(late.status.code(), Some(1));
}

fn tf_module(resources: usize) -> String {
    (0..resources)
        .map(|i| format!("resource \"terraform_data\" \"r{i}\" {{\n  input = \"v{i}\"\n}}\n"))
        .collect()
}

fn tf_job(workspace: &str, resources: usize, timeout_secs: u64) -> EnqueueRequest {
    EnqueueRequest {
        timeout_secs,
        entity: "component".into(),
        operation: "deploy".into(),
        ..EnqueueRequest::new(
            "terraform",
            serde_json::json!({"mode": "apply", "workspace": workspace, "files": {"main.tf": tf_module(resources)}}),
        )
    }
}

/// Approval of the plan itself (`on = "plan"`), with the real terraform: the job plans,
/// the policies allow, and the plan waits for the customer; the approval binds to that
/// plan's digest; the wait is not the job's time.
#[tokio::test]
async fn a_plan_waits_for_approval_between_decision_and_apply_bound_to_its_digest() {
    let terraform = {
        let out = std::process::Command::new("sh").args(["-c", "command -v terraform"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert!(!terraform.is_empty(), "terraform is required on PATH (terraform 1.11 on these machines)");
    let policies = tempfile::tempdir().unwrap();
    let extra = format!(
        "\n[terraform]\nbinary = \"{terraform}\"\n\n[policy]\ndir = \"{}\"\n\n\
         [[guardrails.approval_rule]]\nname = \"plans\"\nkinds = [\"terraform\"]\non = \"plan\"\n",
        policies.path().display()
    );
    let e = env_with(RunnerOptions { extra, ..Default::default() }).await;

    // Approved, after longer than the job's own timeout: applied.
    let first = e.cp.enqueue(tf_job("approvals", 2, 12)).unwrap();
    let listed = e.awaiting_approval(&first).await;
    let digest = listed["plan_digest"].as_str().expect("plan digest in the request").to_string();
    assert!(digest.starts_with("sha256:") || digest.len() == 64, "{listed}");
    assert_eq!(listed["summary"]["counts"]["create"], 2, "{listed}");
    let judged_json = listed["judged_digest"].as_str().expect("the judged JSON's digest").to_string();
    assert_ne!(judged_json, digest, "{listed}");
    let shown = e.runner.cli(&["approvals"]);
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains(&format!("plan {digest}")) && shown.contains(&judged_json), "{shown}");
    assert!(e.cp.job(&first).unwrap().result.is_none());
    tokio::time::sleep(Duration::from_secs(13)).await;
    let out = e.runner.cli(&["approve", &first, "--reason", "CHG-7"]);
    assert!(out.status.success(), "{out:?}");
    let v = e.finished(&first).await;
    let r = v.result.unwrap();
    let log = e.output(&first);
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains(&format!("[approval] plan {digest} approved by")), "{log}");
    assert!(log.contains("Apply complete! Resources: 2 added"), "{log}");
    // `jobs show` names what was judged: the plan and the JSON the policies read.
    let show = e.cli_json(&["jobs", "show", &first]);
    assert_eq!(show["judged"][0]["subject"], "plan", "{show}");
    assert_eq!(show["effect"], "change", "{show}");
    assert_eq!(show["judged"][0]["digest"], digest.as_str(), "{show}");
    assert_eq!(show["judged"][0]["json_digest"], judged_json.as_str(), "{show}");
    let text = e.runner.cli(&["jobs", "show", &first]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains(&format!("judged:     plan {digest}, as JSON {judged_json}: allow")), "{text}");
    assert!(text.contains("effect:     change"), "{text}");

    // A changed module is a different plan: a new request, with its own digest.
    let second = e.cp.enqueue(tf_job("approvals", 3, 120)).unwrap();
    let listed = e.awaiting_approval(&second).await;
    assert_ne!(listed["plan_digest"].as_str(), Some(digest.as_str()), "{listed}");
    assert_eq!(listed["summary"]["counts"]["create"], 1, "{listed}");
    let out = e.runner.cli(&["deny", &second, "--reason", "not this one"]);
    assert!(out.status.success(), "{out:?}");
    let v = e.finished(&second).await;
    let r = v.result.unwrap();
    let log = e.output(&second);
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "approval_denied", "{}", r.outputs);
    assert!(!log.contains("Apply complete"), "{log}");
    let approved = audit_events(&e.dir.path().join("state"), "approved");
    assert!(approved[0]["detail"].as_str().unwrap().contains(&digest), "{approved:?}");
}

/// `on_close = "cancel"`: a job still running when its window closes is cancelled, and
/// its result says which window closed.
#[tokio::test]
async fn a_window_that_cancels_on_close_stops_a_job_still_running() {
    let now = unix_now();
    // Opened ten seconds ago, closes in five.
    let config = format!(
        "[[guardrails.window]]\nname = \"short\"\nonce = [\"{}/15s\"]\n\
         [[guardrails.window_rule]]\nname = \"strict\"\nwindows = [\"short\"]\noperations = [\"action.trigger\"]\non_close = \"cancel\"\n",
        rfc3339(now - 10)
    );
    let e = env_with(RunnerOptions { extra: config, ..Default::default() }).await;
    let id =
        e.cp.enqueue(EnqueueRequest { timeout_secs: 120, ..script("echo started; sleep 60; echo finished") })
            .unwrap();
    let v = e.finished(&id).await;
    let r = v.result.unwrap();
    assert_eq!(r.status, JobStatus::Cancelled, "{r:?}");
    let error = r.error.unwrap_or_default();
    assert!(error.contains("\"short\"") && error.contains("on_close"), "{error}");
    let out = e.output(&id);
    assert!(out.contains("started") && !out.contains("finished"), "{out}");
    assert!(r.finished_at_ms.unwrap() < (now as u64 + 60) * 1000, "it ran to the end");
}
