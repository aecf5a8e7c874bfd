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
