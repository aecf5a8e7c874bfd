//! `terraform` jobs end to end: the real runner (sandboxed), the reference control
//! plane, moto for the job's role, and a stand-in `terraform`
//! (`tests/fixtures/terraform/terraform`) that follows the CLI contract and reports
//! every call in the job log, so a test proves what ran and what never did.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::moto::MotoServer;
use byoc_protocol::{JobStatus, VendorPolicy};
use common::roles::*;
use common::*;

fn example(name: &str) -> String {
    std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/policy").join(name))
        .unwrap()
}

struct TfEnv {
    env: Env,
    moto: MotoServer,
    policies: tempfile::TempDir,
    _tools: tempfile::TempDir,
}

async fn tf_env() -> TfEnv {
    tf_env_with("").await
}

async fn tf_env_with(policy_extra: &str) -> TfEnv {
    let moto = moto_with_stack(&base_params()).await;
    let policies = tempfile::tempdir().unwrap();
    let (tools, terraform) = stand_in("terraform");
    let mut opts = role_options(&moto, "");
    opts.extra.push_str(&format!(
        "\n[terraform]\nbinary = \"{}\"\n\n[policy]\ndir = \"{}\"\n{policy_extra}\n",
        terraform.display(),
        policies.path().display()
    ));
    opts.sandbox_ro_paths.push(tools.path().to_path_buf());
    let env = env_with(opts).await;
    TfEnv { env, moto, policies, _tools: tools }
}

const OUTPUTS: &str = r#"{"endpoint": {"sensitive": false, "type": "string", "value": "assets.example"}, "admin_password": {"sensitive": true, "type": "string", "value": "s3cr3t-admin-pass"}}"#;

fn job(mode: &str, plan: &str, extra_files: &[(&str, &str)], extra: serde_json::Value) -> EnqueueRequest {
    let mut files = serde_json::json!({
        "main.tf": "resource \"aws_s3_bucket\" \"assets\" {}\n",
        "fake-plan.json": plan,
        "fake-outputs.json": OUTPUTS,
    });
    for (k, v) in extra_files {
        files[*k] = (*v).into();
    }
    let mut spec = serde_json::json!({"mode": mode, "files": files, "workspace": "api"});
    for (k, v) in extra.as_object().into_iter().flatten() {
        spec[k] = v.clone();
    }
    // The operation the mode's effect runs as.
    let operation = match mode {
        "destroy" => "teardown",
        "drift" => "drift",
        _ => "deploy",
    };
    EnqueueRequest {
        timeout_secs: 300,
        ..role_job("component", operation, "inst-demo-maintenance", named("api"), "")
    }
    .with_kind("terraform", spec)
}

trait WithKind {
    fn with_kind(self, kind: &str, spec: serde_json::Value) -> EnqueueRequest;
}

impl WithKind for EnqueueRequest {
    fn with_kind(mut self, kind: &str, spec: serde_json::Value) -> EnqueueRequest {
        self.kind = kind.into();
        self.spec = spec;
        self
    }
}

fn audit(e: &TfEnv, event: &str) -> Vec<serde_json::Value> {
    audit_events(&e.env.runner.state_dir, event)
}

async fn run(e: &TfEnv, req: EnqueueRequest) -> (String, byoc_protocol::JobResult, String) {
    let id = e.env.cp.enqueue(req).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    let log = e.env.output(&id);
    (id, r, log)
}

#[tokio::test]
async fn an_allowed_plan_is_applied_exactly_and_its_outputs_masked() {
    let e = tf_env().await;
    let (id, r, log) =
        run(&e, job("apply", &example("plan-tags-only.json"), &[], serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let digest = r.outputs["plan_digest"].as_str().unwrap().to_string();
    for step in
        ["fake-terraform: init", "fake-terraform: plan -out=plan.tfplan", "fake-terraform: show -json"]
    {
        assert!(log.contains(step), "{step} missing:\n{log}");
    }
    // With local state the outputs are read from the state: no terraform run for them.
    assert!(!log.contains("fake-terraform: output -json"), "{log}");
    // The file applied is the file the policies saw.
    assert!(
        log.contains(&format!("fake-terraform: apply /sealed/plan.tfplan sha256={}", &digest[7..])),
        "{log}"
    );
    assert_eq!(r.outputs["verdict"], "allow");
    assert_eq!(r.outputs["summary"]["counts"]["update"], 1);
    assert_eq!(r.outputs["summary"]["addresses"]["update"][0], "aws_s3_bucket.assets");
    assert_eq!(r.outputs["outputs"]["endpoint"], "assets.example");
    assert_eq!(r.outputs["outputs"]["admin_password"], "***");
    // The plan's contents never leave the VM: the summary has addresses, not values.
    let result = serde_json::to_string(&r).unwrap();
    assert!(!result.contains("acme-assets") && !result.contains("s3cr3t-admin-pass"), "{result}");
    assert!(!log.contains("acme-assets"), "the plan JSON must not reach the job log:\n{log}");
    let decisions = audit(&e, "policy_decision");
    assert_eq!(decisions.len(), 1);
    assert_eq!(decisions[0]["job"], id.as_str());
    assert_eq!(decisions[0]["digests"]["plan"], digest.as_str());
    assert!(
        decisions[0]["digests"]["policy:builtin/public_ingress"].as_str().unwrap().starts_with("sha256:")
    );
    assert!(decisions[0]["detail"].as_str().unwrap().starts_with("allow"));
}

#[tokio::test]
async fn a_denied_plan_is_never_applied() {
    let e = tf_env().await;
    let (_, r, log) =
        run(&e, job("apply", &example("plan-open-ingress.json"), &[], serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "policy_denied");
    let err = r.error.unwrap();
    assert!(
        err.contains("public_ingress@aws_security_group.web")
            && err.contains("database_protection@aws_db_instance.main"),
        "{err}"
    );
    assert!(log.contains("fake-terraform: show -json"), "{log}");
    assert!(!log.contains("fake-terraform: apply"), "apply must not run:\n{log}");
    // Plan and apply share one sandbox (one step), whose gate before apply stayed closed.
    assert!(log.contains("[terraform] init, plan, apply: "), "{log}");
    let d = &audit(&e, "policy_decision")[0];
    let detail = d["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("deny") && detail.contains("public_ingress@aws_security_group.web"),
        "{detail}"
    );
}

#[tokio::test]
async fn the_customers_policy_wins_over_the_vendors() {
    let e = tf_env().await;
    std::fs::write(
        e.policies.path().join("no-cost-center-42.rego"),
        "package main\nimport rego.v1\ndeny contains msg if {\n  rc := input.resource_changes[_]\n  rc.change.after.tags[\"cost-center\"] == \"42\"\n  msg := sprintf(\"%s: cost center 42 is closed\", [rc.address])\n}\n",
    )
    .unwrap();
    let mut req = job("apply", &example("plan-tags-only.json"), &[], serde_json::json!({}));
    // The vendor's policy allows everything (and is mandatory).
    req.app_config.as_mut().unwrap().policies = BTreeMap::from([(
        "allow-all.rego".to_string(),
        VendorPolicy {
            rego: "package main\nimport rego.v1\ndeny contains msg if { false; msg := \"never\" }\n".into(),
            enforcement: None,
        },
    )]);
    let (_, r, log) = run(&e, req).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["violations"][0]["policy"], "customer/no-cost-center-42.rego");
    assert!(!log.contains("fake-terraform: apply"), "{log}");
}

/// show (and the providers it starts) runs in a sandbox of the runner's own: it reads
/// the sealed copy of the plan, which nothing there can change, and starts with nothing
/// plan left running.
#[tokio::test]
async fn show_reads_a_sealed_plan_that_nothing_of_the_job_can_change() {
    let e = tf_env().await;
    let (_, r, log) = run(
        &e,
        job(
            "apply",
            &example("plan-tags-only.json"),
            &[("fake-tamper-after-show", ""), ("fake-linger-after-plan", "")],
            serde_json::json!({}),
        ),
    )
    .await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("fake-terraform: show -json /sealed/plan.tfplan"), "{log}");
    assert!(log.contains("could not tamper with /sealed/plan.tfplan"), "{log}");
    assert!(log.contains("nothing plan left is running"), "{log}");
    let digest = r.outputs["plan_digest"].as_str().unwrap();
    assert!(
        log.contains(&format!("fake-terraform: apply /sealed/plan.tfplan sha256={}", &digest[7..])),
        "{log}"
    );
    assert_eq!(audit(&e, "plan_tampered").len(), 0);
}

/// What the policies judge is the runner's rendering of the sealed plan, never a file of
/// the job's: job code that keeps a harmless plan where show's JSON used to go (a
/// program run during plan, a provider show starts) changes nothing. The rendering ran
/// offline, without the role's credentials or the job's variables; the destructive plan
/// is denied and never applied.
#[tokio::test]
async fn the_plan_judged_is_rendered_by_the_runner_not_written_by_the_job() {
    let e = tf_env().await;
    let harmless = example("plan-tags-only.json");
    let (_, r, log) = run(
        &e,
        job(
            "apply",
            &example("plan-open-ingress.json"),
            &[("fake-forge-plan-json", &harmless), ("fake-linger-after-plan", "")],
            serde_json::json!({"secret_vars": {"db_password": "correct-horse-battery"}}),
        ),
    )
    .await;
    assert!(
        log.contains("forging plan.json during plan") && log.contains("forging plan.json after show"),
        "{log}"
    );
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "policy_denied", "{:?}", r.error);
    assert!(
        r.error.as_deref().unwrap_or("").contains("database_protection@aws_db_instance.main"),
        "{:?}",
        r.error
    );
    assert!(!log.contains("fake-terraform: apply"), "{log}");
    // Rendered with neither the role's session nor the job's variables.
    assert!(log.contains("show env: credentials=none variables=0"), "{log}");
    assert!(log.contains("rendered by the runner (offline, no credentials)"), "{log}");
    let d = &audit(&e, "policy_decision")[0];
    assert_eq!(d["digests"]["plan"], r.outputs["plan_digest"]);
    assert_eq!(d["digests"]["plan_json"], r.outputs["input_digest"]);
}

/// A plan whose JSON is larger than the policies take is refused before any decision.
#[tokio::test]
async fn a_rendered_plan_larger_than_the_policies_take_is_refused() {
    let e = tf_env_with("max_input_mib = 1\n").await;
    let two_mib = (2 << 20).to_string();
    let (_, r, log) = run(
        &e,
        job(
            "apply",
            &example("plan-tags-only.json"),
            &[("fake-show-padding", &two_mib)],
            serde_json::json!({}),
        ),
    )
    .await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "plan_too_large", "{:?}", r.error);
    assert!(!log.contains("fake-terraform: apply"), "{log}");
    assert_eq!(audit(&e, "policy_decision").len(), 0);
}

/// The AssumeRole calls the runner made for job `id`.
async fn assumed_for(e: &TfEnv, id: &str) -> Vec<BTreeMap<String, String>> {
    let calls = e.moto.calls_of("AssumeRole").await;
    calls
        .into_iter()
        .map(|c| c.params)
        .filter(|p| p.get("SourceIdentity").is_some_and(|s| s.contains(id)))
        .collect()
}

fn session_policies(params: &BTreeMap<String, String>) -> Vec<&String> {
    params.iter().filter(|(k, _)| k.starts_with("PolicyArns") || *k == "Policy").map(|(_, v)| v).collect()
}

/// Read-only until decided: the job's processes plan with the role narrowed to
/// ReadOnlyAccess by a session policy; only after the decision does the credential
/// endpoint serve the role's own session, which apply gets.
#[tokio::test]
async fn planning_gets_a_read_only_session_and_only_apply_gets_the_roles_own() {
    let e = tf_env().await;
    let (id, r, log) = run(
        &e,
        job(
            "apply",
            &example("plan-tags-only.json"),
            &[("fake-fetch-credentials", "")],
            serde_json::json!({}),
        ),
    )
    .await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let calls = assumed_for(&e, &id).await;
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0]["PolicyArns.member.1.arn"], "arn:aws:iam::aws:policy/ReadOnlyAccess");
    assert!(session_policies(&calls[1]).is_empty(), "apply's session is the role's own: {:?}", calls[1]);
    let session = |at: &str| {
        let line = log
            .lines()
            .find(|l| l.contains(&format!("session at {at}: ")))
            .unwrap_or_else(|| panic!("{log}"));
        line.rsplit(' ').next().unwrap().to_string()
    };
    assert_ne!(session("plan"), session("apply"), "{log}");
    // The widening came after the decision, and is in the audit log.
    let events: Vec<String> = audit_records(&e.env.runner.state_dir)
        .iter()
        .filter(|r| r["job"] == id.as_str())
        .map(|r| r["event"].as_str().unwrap_or("").to_string())
        .collect();
    let at = |ev: &str| events.iter().position(|x| x == ev).unwrap_or_else(|| panic!("{ev}: {events:?}"));
    assert!(
        at("role_assumed") < at("policy_decision") && at("policy_decision") < at("role_session_opened"),
        "{events:?}"
    );
    assert!(log.contains("read-only until its plan is allowed (ReadOnlyAccess)"), "{log}");
}

/// A denied plan, and a plan-only job, never get more than the read-only session.
#[tokio::test]
async fn a_plan_that_is_not_applied_never_gets_more_than_read_only() {
    let e = tf_env().await;
    for (mode, plan) in [("apply", "plan-open-ingress.json"), ("plan", "plan-tags-only.json")] {
        let (id, r, log) =
            run(&e, job(mode, &example(plan), &[("fake-fetch-credentials", "")], serde_json::json!({})))
                .await;
        assert!(log.contains("session at plan: "), "{log}");
        let calls = assumed_for(&e, &id).await;
        assert_eq!(calls.len(), 1, "{mode}: {calls:?}");
        assert_eq!(calls[0]["PolicyArns.member.1.arn"], "arn:aws:iam::aws:policy/ReadOnlyAccess");
        assert!(
            audit(&e, "role_session_opened").iter().all(|a| a["job"] != id.as_str()),
            "{mode}: {:?}",
            r.status
        );
    }
}

/// The plan-time actions an app declares for a role join the read-only session's inline
/// policy, and are shown by `roles` and named in the audit record.
#[tokio::test]
async fn the_apps_plan_actions_join_the_read_only_session_and_are_shown_and_audited() {
    let e = tf_env().await;
    let mut req = job("plan", &example("plan-tags-only.json"), &[], serde_json::json!({}));
    let permissions = &mut req.app_config.as_mut().unwrap().permissions;
    let maintenance = permissions.get_mut("maintenance.toml").unwrap();
    *maintenance = format!("plan_actions = [\"ec2:CreateNetworkInterface\"]\n{maintenance}");
    let (id, r, log) = run(&e, req).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let calls = assumed_for(&e, &id).await;
    assert_eq!(calls.len(), 1, "{calls:?}");
    let policy: serde_json::Value = serde_json::from_str(&calls[0]["Policy"]).unwrap();
    assert_eq!(policy["Statement"][0]["Action"][0], "ec2:CreateNetworkInterface", "{policy}");
    let assumed = audit(&e, "role_assumed");
    let detail =
        assumed.iter().find(|a| a["job"] == id.as_str()).unwrap()["detail"].as_str().unwrap().to_string();
    assert!(detail.contains("plan_actions ec2:CreateNetworkInterface"), "{detail}");
    let roles = e.env.cli_json(&["roles"]);
    let maintenance =
        roles["roles"].as_array().unwrap().iter().find(|r| r["role_type"] == "maintenance").unwrap();
    assert_eq!(maintenance["plan_actions"], serde_json::json!(["ec2:CreateNetworkInterface"]), "{roles}");
    // A wildcard for a whole service is refused with the app config, before the claim.
    let mut req = job("plan", &example("plan-tags-only.json"), &[], serde_json::json!({}));
    let maintenance = req.app_config.as_mut().unwrap().permissions.get_mut("maintenance.toml").unwrap();
    *maintenance = format!("plan_actions = [\"ec2:*\"]\n{maintenance}");
    let id = e.env.cp.enqueue(req).unwrap();
    let (reason, detail) = e.env.rejected(&id).await.rejections[0].clone();
    assert_eq!(reason, byoc_protocol::RejectReason::InvalidSpec, "{detail}");
    assert!(detail.contains("plan_actions \"ec2:*\""), "{detail}");
}

/// Without an approval to wait for, apply runs in the sandbox that planned: its init
/// stops before apply until the runner has decided, with nothing of the job running.
#[tokio::test]
async fn apply_shares_the_plans_sandbox_and_starts_only_after_the_decision() {
    let e = tf_env().await;
    let (_, r, log) = run(
        &e,
        job(
            "apply",
            &example("plan-tags-only.json"),
            &[("fake-linger-after-plan", "")],
            serde_json::json!({}),
        ),
    )
    .await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    // One step, so one sandbox: no apply step of its own.
    assert!(log.contains("[terraform] init, plan, apply: "), "{log}");
    assert!(!log.contains("[terraform] apply: "), "{log}");
    let at = |needle: &str| log.find(needle).unwrap_or_else(|| panic!("{needle} missing:\n{log}"));
    assert!(at("fake-terraform: show -json") < at("[policy] ALLOW plan"), "{log}");
    assert!(at("[policy] ALLOW plan") < at("fake-terraform: apply /sealed/plan.tfplan"), "{log}");
    let digest = r.outputs["plan_digest"].as_str().unwrap();
    assert!(log.contains(&format!("apply /sealed/plan.tfplan sha256={}", &digest[7..])), "{log}");
    // What plan left running was gone before show (and so before apply).
    assert!(log.contains("nothing plan left is running"), "{log}");
}

/// The sealed plan changed on the host between the decision and apply (here while the
/// plan waits for the customer's approval): refused, audited, nothing applied.
#[tokio::test]
async fn a_plan_changed_after_the_decision_is_not_applied() {
    let e = tf_env_with(
        "\n[[guardrails.approval_rule]]\nname = \"plans\"\nkinds = [\"terraform\"]\non = \"plan\"\n",
    )
    .await;
    let id =
        e.env.cp.enqueue(job("apply", &example("plan-tags-only.json"), &[], serde_json::json!({}))).unwrap();
    e.env.awaiting_approval(&id).await;
    let sealed = e.env.runner.state_dir.join("work").join(format!("{id}.sealed")).join("plan.tfplan");
    let mut plan = std::fs::read(&sealed).unwrap();
    plan.push(b' ');
    std::fs::write(&sealed, plan).unwrap();
    let out = e.env.runner.cli(&["approve", &id, "--reason", "CHG-9"]);
    assert!(out.status.success(), "{out:?}");
    let r = e.env.finished(&id).await.result.unwrap();
    let log = e.env.output(&id);
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "plan_tampered", "{:?}", r.error);
    assert!(!log.contains("fake-terraform: apply"), "{log}");
    assert_eq!(audit(&e, "plan_tampered").len(), 1);
    // The sealed copy goes with the job.
    assert!(!sealed.parent().unwrap().exists());
}

#[tokio::test]
async fn cancelling_an_apply_sends_sigint_first() {
    let e = tf_env().await;
    let req =
        job("apply", &example("plan-tags-only.json"), &[("fake-apply-seconds", "60")], serde_json::json!({}));
    let id = e.env.cp.enqueue(req).unwrap();
    e.env.log_contains(&id, "applying (slowly)").await;
    e.env.cp.cancel(&id).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Cancelled);
    let log = e.env.output(&id);
    assert!(
        log.contains("fake-terraform: received SIGINT: stopping gracefully, releasing the state lock"),
        "{log}"
    );
}

#[tokio::test]
async fn a_saved_plan_is_applied_by_digest_and_only_by_its_digest() {
    let mut e = tf_env().await;
    let (_, r, log) = run(&e, job("plan", &example("plan-tags-only.json"), &[], serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(!log.contains("fake-terraform: apply"), "{log}");
    let digest = r.outputs["plan_digest"].as_str().unwrap().to_string();

    // A later job applies exactly that plan (the fixture it carries would plan differently).
    let req =
        job("apply", &example("plan-open-ingress.json"), &[], serde_json::json!({"plan_digest": digest}));
    let (_, r, log) = run(&e, req).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(!log.contains("fake-terraform: plan"), "no new plan:\n{log}");
    assert!(log.contains(&format!("applying saved plan {digest}")), "{log}");
    assert!(
        log.contains(&format!("fake-terraform: apply /sealed/plan.tfplan sha256={}", &digest[7..])),
        "{log}"
    );

    // Once older than plan_max_age_secs (3600 by default), the saved plan is stale.
    let saved = e.env.runner.state_dir.join("plans/api").join(format!("{}.tfplan", &digest[7..]));
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
    std::fs::File::options().write(true).open(&saved).unwrap().set_modified(old).unwrap();
    let req = job("apply", &example("plan-tags-only.json"), &[], serde_json::json!({"plan_digest": digest}));
    let (_, r, log) = run(&e, req).await;
    assert_eq!(r.outputs["reason"], "plan_stale", "{:?}", r.error);
    assert!(!log.contains("fake-terraform: apply"), "{log}");

    // A day past that, the daemon's sweep (at its start, then hourly) removes it.
    let gone = std::time::SystemTime::now() - std::time::Duration::from_secs(3600 + 86_400 + 60);
    std::fs::File::options().write(true).open(&saved).unwrap().set_modified(gone).unwrap();
    e.env.runner.kill9().await;
    e.env.runner.spawn(None).unwrap();
    assert!(
        wait_log(&e.env.runner, "Removed saved plans past their use.", std::time::Duration::from_secs(30))
            .await,
        "{}",
        e.env.runner.log()
    );
    assert!(!saved.exists());
    let removed = audit_events(&e.env.runner.state_dir, "plans_removed");
    assert_eq!(removed.len(), 1, "{removed:?}");
    let req = job("apply", &example("plan-tags-only.json"), &[], serde_json::json!({"plan_digest": digest}));
    let (_, r, _) = run(&e, req).await;
    assert_eq!(r.outputs["reason"], "plan_unknown", "{:?}", r.error);

    let other = format!("sha256:{}", "0".repeat(64));
    let (_, r, log) = run(
        &e,
        job("apply", &example("plan-tags-only.json"), &[], serde_json::json!({"plan_digest": other})),
    )
    .await;
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "plan_unknown", "{:?}", r.error);
    assert!(!log.contains("fake-terraform: apply"), "{log}");
}

#[tokio::test]
async fn destroy_goes_through_the_same_gate() {
    let e = tf_env().await;
    let destroy = r#"{"format_version": "1.2", "resource_changes": [
        {"address": "aws_s3_bucket.assets", "type": "aws_s3_bucket", "name": "assets",
         "change": {"actions": ["delete"], "before": {"bucket": "acme-assets"}, "after": null, "after_unknown": {}}},
        {"address": "aws_db_instance.main", "type": "aws_db_instance", "name": "main",
         "change": {"actions": ["delete"], "before": {"identifier": "main"}, "after": null, "after_unknown": {}}}
    ]}"#;
    // Deleting a database outside deprovision is denied.
    let (_, r, log) = run(
        &e,
        job(
            "destroy",
            &example("plan-tags-only.json"),
            &[("fake-destroy-plan.json", destroy)],
            serde_json::json!({}),
        ),
    )
    .await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert!(log.contains("fake-terraform: plan -destroy"), "{log}");
    assert!(r.error.unwrap().contains("database_protection@aws_db_instance.main"));
    assert!(!log.contains("fake-terraform: apply"), "{log}");
}

#[tokio::test]
async fn a_policy_that_exhausts_its_memory_limit_denies() {
    let e = tf_env_with("memory_mib = 256").await;
    std::fs::write(
        e.policies.path().join("hungry.rego"),
        "package main\nimport rego.v1\ndeny contains msg if {\n  xs := [sprintf(\"%d-padding-padding-padding\", [i]) | some i in numbers.range(1, 50000000)]\n  count(xs) < 0\n  msg := \"never\"\n}\n",
    )
    .unwrap();
    let (_, r, log) =
        run(&e, job("apply", &example("plan-tags-only.json"), &[], serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "policy_denied");
    assert!(log.contains("256 MiB memory limit"), "{log}");
    assert!(!log.contains("fake-terraform: apply"), "{log}");
    let d = &audit(&e, "policy_decision")[0];
    assert!(d["detail"].as_str().unwrap().contains("(evaluator) failed"), "{d}");
}

/// The app config's `policies.toml`, as the modelled system's app configs write it,
/// with its files.
fn with_app_policies(mut req: EnqueueRequest, toml: &str, files: &[(&str, &str)]) -> EnqueueRequest {
    let app = req.app_config.as_mut().unwrap();
    app.policies_toml = Some(toml.into());
    app.files = files.iter().map(|(p, t)| (p.to_string(), t.to_string())).collect();
    req
}

/// A vendor policy in the `nuon` convention (package nuon, deny over input.plan).
const NUON_NO_BUCKET_UPDATES: &str = r#"package nuon

deny contains msg if {
	some rc in input.plan.resource_changes
	rc.type == "aws_s3_bucket"
	"update" in rc.change.actions
	msg := sprintf("%s: buckets change only in a maintenance window", [rc.address])
}
"#;

#[tokio::test]
async fn a_plan_denied_by_a_nuon_vendor_policy_is_never_applied() {
    let e = tf_env().await;
    let toml = "[[policy]]\ntype = \"terraform_module\"\nengine = \"opa\"\ncontents = \"./policies/buckets.rego\"\ncomponents = [\"api\"]\n";
    let req = with_app_policies(
        job("apply", &example("plan-tags-only.json"), &[], serde_json::json!({})),
        toml,
        &[("policies/buckets.rego", NUON_NO_BUCKET_UPDATES)],
    );
    let (id, r, log) = run(&e, req).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "policy_denied");
    assert!(r.error.unwrap().contains("aws_s3_bucket.assets"));
    assert!(log.contains("buckets change only in a maintenance window"), "{log}");
    assert!(!log.contains("fake-terraform: apply"), "apply must not run:\n{log}");
    let decision = audit(&e, "policy_decision").into_iter().find(|d| d["job"] == id.as_str()).unwrap();
    let digest = format!("sha256:{}", byoc_protocol::sha256_hex(NUON_NO_BUCKET_UPDATES.as_bytes()));
    assert_eq!(decision["digests"]["policy:vendor/policies/buckets.rego"], digest.as_str());
}

/// Only `pass` rules: informational checks an app config may carry on their own.
const NUON_PASS_ONLY: &str = r#"package nuon

pass contains msg if {
	some rc in input.plan.resource_changes
	rc.type == "aws_s3_bucket"
	msg := sprintf("%s is a bucket the app expects", [rc.address])
}
"#;

#[tokio::test]
async fn an_app_policy_of_pass_rules_only_is_recorded_and_lets_the_plan_apply() {
    let e = tf_env().await;
    let toml = "[[policy]]\ntype = \"terraform_module\"\nengine = \"opa\"\ncontents = \"./policies/checks.rego\"\ncomponents = [\"api\"]\n";
    let req = with_app_policies(
        job("apply", &example("plan-tags-only.json"), &[], serde_json::json!({})),
        toml,
        &[("policies/checks.rego", NUON_PASS_ONLY)],
    );
    let (id, r, log) = run(&e, req).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{log}");
    assert!(
        log.contains("[policy] PASS vendor/policies/checks.rego [checks] -: aws_s3_bucket.assets is a bucket the app expects"),
        "{log}"
    );
    assert!(log.contains("fake-terraform: apply"), "{log}");
    assert_eq!(
        r.outputs["passed"],
        serde_json::json!([{"rule": "checks", "address": "", "policy": "vendor/policies/checks.rego"}])
    );
    let decision = audit(&e, "policy_decision").into_iter().find(|d| d["job"] == id.as_str()).unwrap();
    let detail = decision["detail"].as_str().unwrap();
    assert!(detail.starts_with("allow: 0 violations, 0 warnings, 1 passed, 0 errors"), "{detail}");
    assert!(
        detail.contains("passed [checks (aws_s3_bucket.assets is a bucket the app expects)]"),
        "{detail}"
    );
}

#[tokio::test]
async fn each_job_evaluates_exactly_the_app_policies_for_its_type_and_component() {
    let e = tf_env().await;
    let toml = r#"
[[policy]]
type = "terraform_module"
engine = "opa"
contents = "./policies/api-only.rego"
components = ["api"]

[[policy]]
type = "terraform_module"
engine = "opa"
contents = "./policies/every-component.rego"
components = ["*"]

[[policy]]
type = "helm_chart"
engine = "opa"
contents = "./policies/charts.rego"
components = ["*"]

[[policy]]
type = "kubernetes_manifest"
engine = "opa"
contents = "./policies/manifests.rego"
components = ["api"]

[[policy]]
type = "sandbox"
engine = "opa"
contents = "./policies/sandbox.rego"

[[policy]]
type = "kubernetes_cluster"
contents = "./policies/cluster.yaml"
"#;
    let allow = |what: &str| {
        format!("package nuon\n\n# {what}\ndeny contains msg if {{\n\tfalse\n\tmsg := \"never\"\n}}\n")
    };
    let files: Vec<(String, String)> = ["api-only", "every-component", "charts", "manifests", "sandbox"]
        .iter()
        .map(|n| (format!("policies/{n}.rego"), allow(n)))
        .chain([(
            "policies/cluster.yaml".to_string(),
            "apiVersion: kyverno.io/v1\nkind: ClusterPolicy\nmetadata:\n  name: x\n".to_string(),
        )])
        .collect();
    let files: Vec<(&str, &str)> = files.iter().map(|(p, t)| (p.as_str(), t.as_str())).collect();
    let plan = example("plan-tags-only.json");
    let api = with_app_policies(job("plan", &plan, &[], serde_json::json!({})), toml, &files);
    let mut db = with_app_policies(job("plan", &plan, &[], serde_json::json!({})), toml, &files);
    db.role_request = Some(named("db"));
    let mut sandbox = with_app_policies(job("plan", &plan, &[], serde_json::json!({})), toml, &files);
    sandbox.entity = "sandbox".into();
    sandbox.operation = "provision".into();
    sandbox.requested_role = Some("inst-demo-provision".into());
    sandbox.role_request = Some(named("sandbox"));
    let mut expected = Vec::new();
    for (req, want) in [
        (api, vec!["vendor/policies/api-only.rego", "vendor/policies/every-component.rego"]),
        (db, vec!["vendor/policies/every-component.rego"]),
        (sandbox, vec!["vendor/policies/sandbox.rego"]),
    ] {
        let (id, r, log) = run(&e, req).await;
        assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
        expected.push((id, want));
    }
    let decisions = audit(&e, "policy_decision");
    for (id, want) in expected {
        let d = decisions.iter().find(|d| d["job"] == id.as_str()).unwrap();
        let vendor: Vec<&str> = d["digests"]
            .as_object()
            .unwrap()
            .keys()
            .filter_map(|k| k.strip_prefix("policy:"))
            .filter(|k| k.starts_with("vendor/"))
            .collect();
        assert_eq!(vendor, want, "{id}");
    }
}

#[tokio::test]
async fn an_app_policy_that_cannot_apply_to_anything_refuses_the_job() {
    let e = tf_env().await;
    // A helm policy marked for the sandbox's terraform runs: it would never be evaluated.
    let toml = "[[policy]]\ntype = \"helm_chart\"\nengine = \"opa\"\ncontents = \"./policies/buckets.rego\"\nsandbox = true\n";
    let req = with_app_policies(
        job("apply", &example("plan-tags-only.json"), &[], serde_json::json!({})),
        toml,
        &[("policies/buckets.rego", NUON_NO_BUCKET_UPDATES)],
    );
    let id = e.env.cp.enqueue(req).unwrap();
    let v = e.env.rejected(&id).await;
    assert_eq!(v.rejections[0].0, byoc_protocol::RejectReason::InvalidSpec);
    assert!(
        v.rejections[0].1.contains("sandbox = true applies to the sandbox's terraform runs"),
        "{:?}",
        v.rejections
    );
    assert_eq!(started_count(&e.env.runner.state_dir, &id), 0);
}
