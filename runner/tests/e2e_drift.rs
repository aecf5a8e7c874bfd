//! Drift checks (`terraform` jobs with `mode = "drift"`, docs/DRIFT.md) end to end:
//! the real terraform against the state the runner keeps (clean, then drifted by an
//! edit made outside any job, nothing ever applied), and the tests' stand-in for a
//! refreshed `aws_*` resource the policies judge (a console edit that opened a
//! security group to the internet).
#![allow(clippy::unwrap_used)]

mod common;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::harness::RunnerOptions;
use byoc_protocol::JobStatus;
use common::*;

fn real_terraform() -> String {
    let out = std::process::Command::new("sh").args(["-c", "command -v terraform"]).output().unwrap();
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(!path.is_empty(), "terraform is required on PATH (terraform 1.11 on these machines)");
    path
}

fn module() -> String {
    (0..2).map(|i| format!("resource \"terraform_data\" \"r{i}\" {{\n  input = \"v{i}\"\n}}\n")).collect()
}

fn tf(mode: &str, files: serde_json::Value) -> EnqueueRequest {
    EnqueueRequest {
        entity: "component".into(),
        operation: if mode == "drift" { "drift" } else { "deploy" }.into(),
        timeout_secs: 300,
        ..EnqueueRequest::new(
            "terraform",
            serde_json::json!({"mode": mode, "workspace": "network", "files": files}),
        )
    }
}

async fn done(e: &Env, req: EnqueueRequest) -> (String, byoc_protocol::JobResult, String) {
    let id = e.cp.enqueue(req).unwrap();
    let r = e.finished(&id).await.result.unwrap();
    let log = e.output(&id);
    (id, r, log)
}

#[tokio::test]
async fn a_drift_check_finds_an_edit_made_outside_terraform_and_changes_nothing() {
    let policies = tempfile::tempdir().unwrap();
    let extra = format!(
        "\n[terraform]\nbinary = \"{}\"\n\n[policy]\ndir = \"{}\"\n",
        real_terraform(),
        policies.path().display()
    );
    let e = env_with(RunnerOptions { extra, ..Default::default() }).await;
    let files = serde_json::json!({"main.tf": module()});
    // Before any deploy there is no state: said so, not reported as drift.
    let (_, r, log) = done(&e, tf("drift", files.clone())).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert_eq!(r.outputs["drift"]["verdict"], "not_deployed", "{}\n{log}", r.outputs);
    let (_, r, log) = done(&e, tf("apply", files.clone())).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);

    // Nothing changed: clean.
    let (id, r, log) = done(&e, tf("drift", files.clone())).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert_eq!(r.outputs["drift"]["verdict"], "clean", "{}\n{log}", r.outputs);
    assert!(log.contains("plan -refresh-only"), "{log}");
    assert!(!log.contains("Apply complete"), "{log}");
    let listed = e.cli_json(&["drift"]);
    assert_eq!(listed[0]["workspace"], "network");
    assert_eq!(listed[0]["verdict"], "clean");
    assert_eq!(listed[0]["job_id"], id.as_str());

    // Someone edits the infrastructure's record outside any job (as a console edit
    // leaves the real thing differing from the contract).
    let state_file = e.dir.path().join("state/tfstate/network/terraform.tfstate");
    let state = std::fs::read_to_string(&state_file).unwrap();
    assert!(state.contains("\"v0\""), "{state}");
    let edited = state.replacen("\"v0\"", "\"edited-by-hand\"", 1);
    std::fs::write(&state_file, &edited).unwrap();
    let (id, r, log) = done(&e, tf("drift", files.clone())).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let d = &r.outputs["drift"];
    assert_eq!(d["verdict"], "drifted", "{}\n{log}", r.outputs);
    assert!(d["would_change"]["addresses"].to_string().contains("terraform_data.r0"), "{d}");
    assert!(!d["would_change"]["addresses"].to_string().contains("terraform_data.r1"), "{d}");
    // Values never leave the runner.
    assert!(!r.outputs.to_string().contains("edited-by-hand"), "{}", r.outputs);
    // Nothing was changed by the check: the state is byte for byte as it was.
    assert_eq!(std::fs::read_to_string(&state_file).unwrap(), edited);
    let checked = audit_events(&e.dir.path().join("state"), "drift_checked");
    assert_eq!(checked.len(), 3, "{checked:?}");
    assert!(checked[2]["detail"].as_str().unwrap().contains("drifted"), "{checked:?}");
    assert_eq!(checked[2]["job"], id.as_str());
    let status = e.cli_json(&["status"]);
    assert_eq!(status["drift"][0]["verdict"], "drifted", "{status}");
}

/// A refreshed security group that someone opened to the internet: the built-in
/// `public_ingress` policy judges what drifted, though nobody deployed it.
const REFRESH_OPENED: &str = r#"{"format_version": "1.2", "terraform_version": "1.11.0",
 "resource_drift": [{"address": "aws_security_group.web", "mode": "managed", "type": "aws_security_group", "name": "web",
   "provider_name": "registry.terraform.io/hashicorp/aws",
   "change": {"actions": ["update"],
     "before": {"name": "web", "ingress": [{"cidr_blocks": ["10.0.0.0/8"], "from_port": 443, "ipv6_cidr_blocks": [], "protocol": "tcp", "to_port": 443}], "tags": {"owner": "platform"}},
     "after": {"name": "web", "ingress": [{"cidr_blocks": ["0.0.0.0/0"], "from_port": 443, "ipv6_cidr_blocks": [], "protocol": "tcp", "to_port": 443}], "tags": {"owner": "platform"}},
     "before_sensitive": {}, "after_sensitive": {}}}],
 "prior_state": {"values": {"root_module": {"resources": [{"address": "aws_security_group.web", "mode": "managed",
   "type": "aws_security_group", "name": "web", "values": {"name": "web"}}]}}},
 "resource_changes": []}"#;

const CONTRACT_NO_CHANGES: &str =
    r#"{"format_version": "1.2", "terraform_version": "1.11.0", "resource_changes": []}"#;

#[tokio::test]
async fn a_drifted_resource_that_breaks_a_policy_is_violating() {
    let policies = tempfile::tempdir().unwrap();
    let (tools, terraform) = stand_in("terraform");
    let extra = format!(
        "\n[terraform]\nbinary = \"{}\"\n\n[policy]\ndir = \"{}\"\n",
        terraform.display(),
        policies.path().display()
    );
    let mut opts = RunnerOptions { extra, ..Default::default() };
    opts.sandbox_ro_paths.push(tools.path().to_path_buf());
    let e = env_with(opts).await;
    let files = serde_json::json!({
        "main.tf": "resource \"aws_security_group\" \"web\" {}\n",
        "fake-refresh-plan.json": REFRESH_OPENED,
        "fake-plan.json": CONTRACT_NO_CHANGES,
    });
    let (_, r, log) = done(&e, tf("drift", files)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let d = &r.outputs["drift"];
    assert_eq!(d["verdict"], "violating", "{}\n{log}", r.outputs);
    assert_eq!(d["drifted"][0]["address"], "aws_security_group.web");
    assert_eq!(d["drifted"][0]["paths"], serde_json::json!(["ingress[0].cidr_blocks[0]"]), "{d}");
    assert!(r.outputs["violations"].to_string().contains("public_ingress"), "{}", r.outputs);
    assert!(log.contains("[policy] DENY"), "{log}");
    // Never applied: the stand-in reports every call it gets.
    assert!(log.contains("fake-terraform: plan -refresh-only"), "{log}");
    assert!(!log.contains("fake-terraform: apply"), "{log}");
    let listed = e.cli_json(&["drift"]);
    assert_eq!(listed[0]["verdict"], "violating");
}

/// The runner's own checks (docs/DRIFT.md): a deploy without secrets leaves its
/// component; `drift run` checks it with no job from the control plane, which learns
/// of the check from the audit log; a pause stops it, said why; all audited.
#[tokio::test]
async fn the_runner_checks_a_deployed_component_when_asked_and_not_while_paused() {
    let policies = tempfile::tempdir().unwrap();
    let extra = format!(
        "\n[terraform]\nbinary = \"{}\"\n\n[policy]\ndir = \"{}\"\n",
        real_terraform(),
        policies.path().display()
    );
    // Short polls: requests are looked at before each.
    let e = env_with(RunnerOptions { extra, poll_wait_secs: 2, ..Default::default() }).await;
    let state = e.dir.path().join("state");
    let files = serde_json::json!({"main.tf": module()});
    // Nothing deployed yet: nothing to check, said at once.
    let out = e.runner.cli(&["drift", "run", "network"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no deploy of \"network\""), "{out:?}");

    let (deploy, r, log) = done(&e, tf("apply", files)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let targets = e.cli_json(&["drift", "targets"]);
    assert_eq!(
        (targets[0]["name"].as_str(), targets[0]["kind"].as_str()),
        (Some("network"), Some("terraform"))
    );
    assert_eq!(targets[0]["from_job"], deploy.as_str());

    let out = e.runner.cli(&["drift", "run", "network"]);
    assert!(out.status.success(), "{out:?}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let checked = loop {
        let listed = e.cli_json(&["drift"]);
        if let Some(c) = listed.as_array().unwrap().iter().find(|c| c["workspace"] == "network") {
            break c.clone();
        }
        assert!(std::time::Instant::now() < deadline, "no local check:\n{}", e.runner.log());
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    let local = checked["job_id"].as_str().unwrap().to_string();
    assert!(local.starts_with("local-drift-terraform-network-"), "{checked}");
    assert_eq!(checked["verdict"], "clean", "{checked}");
    // Run as any job: journaled and settled on the VM, never a job of the control plane's.
    assert!(e.cp.job(&local).is_none());
    let ok =
        e.cp.wait_until(std::time::Duration::from_secs(30), |_| {
            e.cli_json(&["jobs", "show", &local])["phase"] == "reported"
        })
        .await;
    assert!(ok, "{}", e.cli_json(&["jobs", "show", &local]));
    // Audited from the request to the verdict, and the control plane gets those records.
    let requested = audit_events(&state, "drift_requested");
    assert!(requested[0]["detail"].as_str().unwrap().starts_with("terraform network by "), "{requested:?}");
    let started = audit_events(&state, "drift_check_started");
    assert_eq!(started[0]["job"], local.as_str());
    assert!(started[0]["detail"].as_str().unwrap().contains(&format!("from deploy {deploy}")), "{started:?}");
    let verdict =
        audit_events(&state, "drift_checked").into_iter().find(|r| r["job"] == local.as_str()).unwrap();
    let seq = verdict["seq"].as_u64().unwrap();
    let runner = e.cp.runners()[0].runner_id.clone();
    assert!(e.cp.wait_until(std::time::Duration::from_secs(60), |cp| cp.audit_size(&runner) > seq).await);

    // Paused: the request is taken, the check not started, and the audit log says why.
    assert!(e.runner.cli(&["pause", "--reason", "freeze"]).status.success());
    assert!(e.runner.cli(&["drift", "run", "network"]).status.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while audit_events(&state, "drift_skipped").is_empty() {
        assert!(std::time::Instant::now() < deadline, "not skipped:\n{}", e.runner.log());
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let skipped = &audit_events(&state, "drift_skipped")[0];
    assert_eq!(skipped["reason"], "paused", "{skipped}");
    let locals = e.cli_json(&["jobs", "list"]);
    let n = locals
        .as_array()
        .unwrap()
        .iter()
        .filter(|j| j["job_id"].as_str().unwrap().starts_with("local-"))
        .count();
    assert_eq!(n, 1, "{locals}");
    let out = e.runner.cli(&["audit", "verify"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
}
