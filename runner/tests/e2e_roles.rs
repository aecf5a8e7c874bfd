//! Lifecycle roles end to end: the real runner binary, the reference control plane and
//! a moto server standing in for STS and CloudFormation. moto assumes any role and
//! checks no trust policy, so every refusal here is proven by the AWS calls that never
//! arrived (moto's request recorder), not by moto saying no.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::moto::{AwsCall, MotoServer};
use byoc_control_plane::state::JobState;
use byoc_protocol::{JobStatus, RejectReason, RoleRequest};
use common::roles::*;
use common::*;

/// Prints which role the job got and whether the credential endpoint is there.
const SHOW_ROLE: &str = "echo \"role=$BYOC_ROLE endpoint=${AWS_CONTAINER_CREDENTIALS_FULL_URI:+yes}\"";

struct RolesEnv {
    env: Env,
    moto: MotoServer,
    params: BTreeMap<&'static str, &'static str>,
}

async fn roles_env(roles_extra: &str) -> RolesEnv {
    let moto = MotoServer::start().await;
    let params = base_params();
    moto.put_stack("CreateStack", STACK, &template(), &stack_params(&params)).await;
    let env = env_with(role_options(&moto, roles_extra)).await;
    RolesEnv { env, moto, params }
}

impl RolesEnv {
    async fn set(&mut self, param: &'static str, value: &'static str) {
        self.params.insert(param, value);
        self.moto.put_stack("UpdateStack", STACK, &template(), &stack_params(&self.params)).await;
    }

    async fn assumed(&self) -> Vec<AwsCall> {
        self.moto.calls_of("AssumeRole").await
    }

    async fn assumed_for(&self, job_id: &str) -> Vec<AwsCall> {
        self.assumed()
            .await
            .into_iter()
            .filter(|c| c.params.get("SourceIdentity").map(String::as_str) == Some(job_id))
            .collect()
    }

    async fn succeeds(&self, req: EnqueueRequest) -> (String, String) {
        let id = self.env.cp.enqueue(req).unwrap();
        let v = self.env.finished(&id).await;
        let r = v.result.unwrap();
        assert_eq!(r.status, JobStatus::Succeeded, "{id}: {:?}\n{}", r.error, self.env.output(&id));
        let out = self.env.output(&id);
        (id, out)
    }

    async fn refused(&self, req: EnqueueRequest, reason: RejectReason) -> (String, String) {
        let id = self.env.cp.enqueue(req).unwrap();
        let v = self.env.rejected(&id).await;
        let (got, detail) = v.rejections[0].clone();
        assert_eq!(got, reason, "{id}: {detail}");
        assert_eq!(v.state, JobState::Rejected);
        assert!(v.result.is_none());
        (id, detail)
    }
}

#[tokio::test]
async fn every_step_of_the_precedence_chain_decides_the_role() {
    let e = roles_env("").await;
    // Default role for the operation.
    let (default_job, out) =
        e.succeeds(role_job("component", "deploy", "inst-demo-maintenance", named("api"), SHOW_ROLE)).await;
    assert!(out.contains("role=inst-demo-maintenance endpoint=yes"), "{out}");
    // `jobs show` says which role it ran under, with the job's audit trail.
    let shown = e.env.cli_json(&["jobs", "show", &default_job]);
    assert_eq!(shown["role"], "inst-demo-maintenance", "{shown}");
    // What it does and for which component, as the runner derived and recorded them.
    assert_eq!(shown["component"], "api", "{shown}");
    assert_eq!(shown["effect"], "run", "{shown}");
    let trail = shown["audit"].as_array().unwrap();
    assert!(trail.iter().any(|r| r["event"] == "role_assumed"), "{trail:?}");
    assert!(trail.iter().all(|r| r["job"] == default_job.as_str()), "{trail:?}");
    let text =
        String::from_utf8_lossy(&e.env.runner.cli(&["jobs", "show", &default_job]).stdout).into_owned();
    assert!(text.contains("role:       inst-demo-maintenance") && text.contains("role_assumed"), "{text}");
    assert!(text.contains("component:  api") && text.contains("effect:     run"), "{text}");
    // Matrix rule (operation_roles.toml).
    let (matrix_job, out) = e
        .succeeds(role_job("component", "deploy", "inst-demo-eks-upgrade-role", named("cluster"), SHOW_ROLE))
        .await;
    assert!(out.contains("role=inst-demo-eks-upgrade-role"), "{out}");
    // The entity's own role beats the matrix.
    let entity = RoleRequest { entity_role: Some("provision".into()), ..named("cluster") };
    let (entity_job, out) =
        e.succeeds(role_job("component", "deploy", "inst-demo-provision", entity, SHOW_ROLE)).await;
    assert!(out.contains("role=inst-demo-provision"), "{out}");
    // A runtime override (templated) beats everything, for a role the customer enabled.
    let over = RoleRequest {
        runtime_override: Some("{{.install.id}}-eks-upgrade-role".into()),
        ..named("healthcheck")
    };
    let (override_job, out) =
        e.succeeds(role_job("action", "trigger", "inst-demo-eks-upgrade-role", over, SHOW_ROLE)).await;
    assert!(out.contains("role=inst-demo-eks-upgrade-role"), "{out}");
    // ... and is refused for one the customer did not.
    let off = RoleRequest { runtime_override: Some("deprovision".into()), ..named("healthcheck") };
    let (off_job, detail) = e
        .refused(
            role_job("action", "trigger", "inst-demo-deprovision", off, SHOW_ROLE),
            RejectReason::RoleDisabled,
        )
        .await;
    assert!(detail.contains("EnableDeprovisionRole"), "{detail}");
    // The control plane's proposal must be what the chain yields.
    let (mismatch_job, detail) = e
        .refused(
            role_job("component", "deploy", "inst-demo-provision", named("api"), SHOW_ROLE),
            RejectReason::RoleMismatch,
        )
        .await;
    assert!(detail.contains("inst-demo-maintenance"), "{detail}");
    // A role the app does not define.
    let ghost = RoleRequest { entity_role: Some("ghost-role".into()), ..named("api") };
    e.refused(role_job("component", "deploy", "ghost-role", ghost, SHOW_ROLE), RejectReason::RoleUnknown)
        .await;
    // No role asked for: no AWS credentials at all.
    let id = e.env.cp.enqueue(script("env | grep -c '^AWS_' || true")).unwrap();
    e.env.finished(&id).await;
    assert_eq!(e.env.output(&id).trim(), "0");

    for (job, role) in [
        (&default_job, "maintenance"),
        (&matrix_job, "eks-upgrade-role"),
        (&entity_job, "provision"),
        (&override_job, "eks-upgrade-role"),
    ] {
        let calls = e.assumed_for(job).await;
        assert_eq!(calls.len(), 1, "{job}");
        assert_eq!(calls[0].params["RoleArn"], arn(role), "{job}");
    }
    for job in [&off_job, &mismatch_job] {
        assert!(e.assumed_for(job).await.is_empty(), "{job} must not reach STS");
    }
    let all = e.assumed().await;
    assert_eq!(all.len(), 4, "{all:#?}");
    // The audit log says which step chose each role.
    let records = audit_records(&e.env.runner.state_dir);
    let resolved = |job: &str| {
        records.iter().find(|r| r["event"] == "role_resolved" && r["job"] == job).cloned().unwrap_or_default()
    };
    assert!(resolved(&default_job)["detail"].as_str().unwrap().contains("by default"));
    assert!(resolved(&matrix_job)["detail"].as_str().unwrap().contains("by matrix_rule"));
    assert!(resolved(&entity_job)["detail"].as_str().unwrap().contains("by entity_role"));
    assert!(resolved(&override_job)["detail"].as_str().unwrap().contains("by runtime_override"));
    assert!(records.iter().any(|r| r["event"] == "role_assumed" && r["job"] == default_job.as_str()));
}

#[tokio::test]
async fn a_stack_update_that_disables_maintenance_refuses_the_next_deploy_before_any_assume_role() {
    let mut e = roles_env("").await;
    let deploy = || EnqueueRequest {
        timeout_secs: 1200,
        ..role_job("component", "deploy", "inst-demo-maintenance", named("api"), SHOW_ROLE)
    };
    let (first, _) = e.succeeds(deploy()).await;
    // The session as AWS received it.
    let calls = e.assumed_for(&first).await;
    assert_eq!(calls.len(), 1);
    let p = &calls[0].params;
    assert_eq!(p["RoleArn"], arn("maintenance"));
    assert_eq!(p["ExternalId"], EXTERNAL_ID);
    assert_eq!(p["SourceIdentity"], first);
    assert_eq!(p["RoleSessionName"], format!("byoc-{first}"));
    assert_eq!(p["DurationSeconds"], "1200", "bounded by the job's timeout");
    let tags: BTreeMap<&str, &str> = (1..=3)
        .map(|i| (p[&format!("Tags.member.{i}.Key")].as_str(), p[&format!("Tags.member.{i}.Value")].as_str()))
        .collect();
    assert_eq!(tags["install"], "inst-demo");
    assert_eq!(tags["operation"], "component.deploy");
    assert_eq!(tags["job"], first);

    let reads_before = e.moto.calls_of("DescribeStacks").await.len();
    e.set("EnableMaintenanceRole", "false").await;
    let (second, detail) = e.refused(deploy(), RejectReason::RoleDisabled).await;
    assert!(
        detail.contains("inst-demo-maintenance") && detail.contains("EnableMaintenanceRole=true"),
        "{detail}"
    );
    // The switch was read afresh, and STS never heard of the second job.
    assert!(e.moto.calls_of("DescribeStacks").await.len() > reads_before);
    assert!(e.assumed_for(&second).await.is_empty());
    assert_eq!(e.assumed().await.len(), 1);

    let records = audit_records(&e.env.runner.state_dir);
    let refusal =
        records.iter().find(|r| r["event"] == "job_rejected" && r["job"] == second.as_str()).unwrap();
    assert_eq!(refusal["reason"], "role_disabled");
    assert_eq!(refusal["role"], "inst-demo-maintenance");
    let jobs = e.env.cli_json(&["jobs", "show", &second]);
    assert_eq!(jobs["phase"], "rejected", "one name for a rejected job, as in the audit log");

    // The customer's view: the switch, where it came from, and the last use.
    let roles = e.env.cli_json(&["roles"]);
    let m = roles["roles"].as_array().unwrap().iter().find(|r| r["name"] == "inst-demo-maintenance").unwrap();
    assert_eq!(m["enabled"], false);
    assert!(m["source"].as_str().unwrap().contains("EnableMaintenanceRole=false"), "{m}");
    assert_eq!(m["last_job"], first.as_str());
    let bg = roles["roles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "inst-demo-s3-object-break-glass")
        .unwrap();
    assert_eq!(bg["enabled"], false);
    // Switched back on: `roles --refresh` reads the stack now.
    e.set("EnableMaintenanceRole", "true").await;
    let refreshed = e.env.cli_json(&["roles", "--refresh"]);
    let m =
        refreshed["roles"].as_array().unwrap().iter().find(|r| r["name"] == "inst-demo-maintenance").unwrap();
    assert_eq!(m["enabled"], true, "{m}");
    assert_eq!(m["arn"], arn("maintenance"));
}

#[tokio::test]
async fn break_glass_is_refused_until_enabled_then_allowed_then_refused_again() {
    let mut e = roles_env("").await;
    let bg = || {
        let req = RoleRequest {
            break_glass_role: Some("{{.nuon.install.id}}-s3-object-break-glass".into()),
            ..named("empty_bucket")
        };
        role_job("action", "trigger", "inst-demo-s3-object-break-glass", req, SHOW_ROLE)
    };
    let (first, detail) = e.refused(bg(), RejectReason::RoleDisabled).await;
    assert!(
        detail.contains("break-glass") && detail.contains("EnableS3ObjectBreakGlassRole=true"),
        "{detail}"
    );
    e.set("EnableS3ObjectBreakGlassRole", "true").await;
    // Switched on in the stack, but a break-glass role also needs the customer's local
    // allowance (roles.require_local_allow), checked before any call to STS.
    let (no_allowance, detail) = e.refused(bg(), RejectReason::RoleDisabled).await;
    assert!(detail.contains("local allowance") && detail.contains("roles allow"), "{detail}");
    let role = "inst-demo-s3-object-break-glass";
    let granted = e.env.cli_json(&["roles", "allow", role, "--for", "1h", "--reason", "incident 42"]);
    assert_eq!(granted["allowance"]["reason"], "incident 42", "{granted}");
    let listed = e.env.cli_json(&["roles"]);
    assert!(listed["local_allowance"][role].as_str().unwrap_or("").starts_with("allowed until"), "{listed}");
    let (allowed, out) = e.succeeds(bg()).await;
    assert!(out.contains("role=inst-demo-s3-object-break-glass"), "{out}");
    // Revoked: refused again, with the switch still on.
    e.env.cli_json(&["roles", "revoke", role]);
    let (revoked, _) = e.refused(bg(), RejectReason::RoleDisabled).await;
    // An allowance that ran out: refused, saying so.
    let short = e.env.cli_json(&["roles", "allow", role, "--for", "1s", "--reason", "brief"]);
    let until = short["allowance"]["until_ms"].as_u64().unwrap();
    // The condition under test is the wall clock passing the allowance's end.
    let now_ms =
        || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    while now_ms() <= until {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (expired, detail) = e.refused(bg(), RejectReason::RoleDisabled).await;
    assert!(detail.contains("expired"), "{detail}");
    // Written by hand by someone of the admin group, naming someone else and a month:
    // honoured only as audited, named by the file's owner, capped at seven days.
    let file = e.env.runner.state_dir.join("control/allowances.json");
    let month = serde_json::json!({role: {"granted_ms": now_ms(), "until_ms": now_ms() + 30 * 86_400_000u64,
        "by": "the-ceo", "reason": "hand-written"}});
    std::fs::write(&file, month.to_string()).unwrap();
    std::os::unix::fs::chown(&file, Some(65534), None).unwrap();
    let (by_hand, out) = e.succeeds(bg()).await;
    assert!(out.contains("role=inst-demo-s3-object-break-glass"), "{out}");
    let seen = audit_events(&e.env.runner.state_dir, "allowance_seen");
    let hand = seen.iter().find(|s| s["detail"].as_str().unwrap_or("").contains("hand-written")).unwrap();
    let detail = hand["detail"].as_str().unwrap();
    assert!(detail.contains("uid 65534") && !detail.contains("the-ceo"), "{detail}");
    assert!(detail.contains("capped at 7 days"), "{detail}");
    e.env.cli_json(&["roles", "revoke", role]);
    // Unknown roles and bad durations are refused by the CLI.
    for args in [
        &["roles", "allow", "no-such-role", "--for", "1h", "--reason", "x"][..],
        &["roles", "allow", role, "--for", "8d", "--reason", "x"][..],
        &["roles", "allow", role, "--for", "1h", "--reason", ""][..],
    ] {
        assert!(!e.env.runner.cli(args).status.success(), "{args:?}");
    }
    // A role that needs no allowance gets none: the CLI says so and grants nothing.
    let noop = e.env.runner.cli(&["roles", "allow", "inst-demo-maintenance", "--for", "1h", "--reason", "x"]);
    let said = String::from_utf8_lossy(&noop.stderr).into_owned();
    assert!(!noop.status.success() && said.contains("needs no local allowance"), "{said}");
    e.set("EnableS3ObjectBreakGlassRole", "false").await;
    let (third, _) = e.refused(bg(), RejectReason::RoleDisabled).await;
    for refused in [&first, &no_allowance, &revoked, &expired, &third] {
        assert!(e.assumed_for(refused).await.is_empty(), "{refused} reached STS");
    }
    // Granted and revoked on the record, by whom and why.
    let state = &e.env.runner.state_dir;
    let granted = audit_events(state, "allowance_granted");
    assert_eq!(granted.len(), 2, "{granted:?}");
    assert!(granted[0]["detail"].as_str().unwrap().contains("incident 42"), "{granted:?}");
    assert_eq!(granted[0]["role"], role);
    assert_eq!(audit_events(state, "allowance_revoked").len(), 2);
    // The one that ran out, once, before the job it refused.
    let expired_events = audit_events(state, "allowance_expired");
    assert_eq!(expired_events.len(), 1, "{expired_events:?}");
    assert_eq!(expired_events[0]["role"], role);
    assert!(expired_events[0]["detail"].as_str().unwrap().contains("brief"), "{expired_events:?}");
    assert!(audit_events(state, "customer_record_invalid").is_empty());
    let calls = e.assumed_for(&allowed).await;
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].params["RoleArn"], arn("s3-object-break-glass"));
    assert_eq!(e.assumed_for(&by_hand).await.len(), 1);
}

#[tokio::test]
async fn role_credentials_reach_only_the_job() {
    use base64::Engine as _;
    let e = roles_env("").await;
    let go = e.env.dir.path().join("go");
    let id = e.env.cp.enqueue(leaky_role_job(&go)).unwrap();
    e.env.log_contains(&id, "waiting").await;
    // Learn the job's credentials the way the job does: its token, from its environment.
    let (vars, secrets) = job_credentials(&id).await;
    assert!(!vars.contains_key("AWS_SECRET_ACCESS_KEY"), "process jobs get the endpoint, not static keys");
    let token = secrets[3].clone();
    std::fs::write(&go, b"").unwrap();
    let view = e.env.finished(&id).await;
    let result = view.result.clone().unwrap();
    assert_eq!(result.status, JobStatus::Failed);
    let log = String::from_utf8_lossy(&e.env.cp.log(&id).unwrap()).into_owned();
    assert!(log.contains("creds: {") && log.contains("***"), "{log}");

    let mut places: Vec<(String, Vec<u8>)> = vec![
        ("uploaded log".into(), log.into_bytes()),
        ("result".into(), serde_json::to_vec(&result).unwrap()),
        ("runner log (what journald gets)".into(), e.env.runner.log().into_bytes()),
    ];
    places.extend(every_file_under(&e.env.runner.state_dir));
    for secret in &secrets {
        let encoded = base64::engine::general_purpose::STANDARD.encode(secret);
        for (place, bytes) in &places {
            let text = String::from_utf8_lossy(bytes);
            assert!(!text.contains(secret.as_str()), "a credential leaked into {place}");
            assert!(!text.contains(&encoded[..encoded.len() - 4]), "a base64 credential leaked into {place}");
        }
    }
    // The endpoint was the job's alone: in its own namespace, gone with it; on the
    // runner's loopback there is none.
    assert_eq!(vars["AWS_CONTAINER_CREDENTIALS_FULL_URI"], "http://127.0.0.1:80/v1/credentials");
    let from_host = reqwest::Client::new()
        .get(&vars["AWS_CONTAINER_CREDENTIALS_FULL_URI"])
        .header("Authorization", &token)
        .send()
        .await;
    assert!(from_host.is_err(), "an endpoint answered on the host: {from_host:?}");
}

#[tokio::test]
async fn a_job_outliving_its_session_still_has_valid_credentials_at_its_end() {
    // Sessions of 3 s, renewed when less than 1 s is left; the job runs 4 s.
    let e = roles_env("session_min_secs = 1\nsession_max_secs = 3\nrefresh_before_secs = 1").await;
    let script = r#"get() { curl -s -H "Authorization: $AWS_CONTAINER_AUTHORIZATION_TOKEN" "$AWS_CONTAINER_CREDENTIALS_FULL_URI"; }
exp() { printf '%s' "$1" | sed 's/.*"Expiration":"\([^"]*\)".*/\1/'; }
kid() { printf '%s' "$1" | sed 's/.*"AccessKeyId":"\([^"]*\)".*/\1/' | sha256sum | cut -c1-16; }
a=$(get)
sleep 4
b=$(get)
{ echo "START_EXP=$(exp "$a")"; echo "END_EXP=$(exp "$b")"; echo "START_KEY=$(kid "$a")"; echo "END_KEY=$(kid "$b")"; echo "END_NOW=$(date -u +%Y-%m-%dT%H:%M:%SZ)"; } >> "$BYOC_OUTPUT""#;
    let (id, _) =
        e.succeeds(role_job("component", "deploy", "inst-demo-maintenance", named("api"), script)).await;
    let out = e.env.cp.job(&id).unwrap().result.unwrap().outputs;
    let get = |k: &str| out[k].as_str().unwrap_or_default().to_string();
    assert!(get("END_EXP") > get("END_NOW"), "credentials at the end are still valid: {out}");
    assert!(get("START_EXP") < get("END_NOW"), "the first session expired during the job: {out}");
    assert_ne!(get("START_KEY"), get("END_KEY"), "a new session was issued: {out}");
    let calls = e.assumed_for(&id).await;
    assert!(calls.len() >= 2, "{calls:#?}");
    assert!(calls.iter().all(|c| c.params["DurationSeconds"] == "3"));
    let records = audit_records(&e.env.runner.state_dir);
    assert!(records.iter().any(|r| r["event"] == "role_session_refreshed" && r["job"] == id.as_str()));
}

#[tokio::test]
async fn a_pause_refuses_jobs_survives_a_restart_and_is_audited() {
    let mut e = env().await;
    // Not root and not in roles.admin_group: refused.
    let denied = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN, "pause", "--state-dir"])
        .arg(&e.runner.state_dir)
        .output()
        .expect("setpriv (util-linux)");
    assert_eq!(denied.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&denied.stderr).contains("need root"), "{denied:?}");

    let out = e.runner.cli(&["pause", "--reason", "change freeze"]);
    assert!(out.status.success(), "{out:?}");
    let (id, detail) = {
        let id = e.cp.enqueue(script("echo should not run")).unwrap();
        let v = e.rejected(&id).await;
        (id, v.rejections[0].clone())
    };
    assert_eq!(detail.0, RejectReason::Paused);
    assert!(detail.1.contains("change freeze"), "{}", detail.1);
    assert_eq!(started_count(&e.runner.state_dir, &id), 0);
    // Heartbeats say so.
    assert!(
        e.cp.wait_until(WAIT, |cp| cp.runners().iter().any(|r| r
            .last_poll
            .as_ref()
            .is_some_and(|p| p.paused && p.pause_reason.as_deref() == Some("change freeze"))))
            .await
    );

    // A restart keeps the pause.
    e.runner.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(e.runner.wait_exit(WAIT).await.is_some());
    e.runner.spawn(None).unwrap();
    let id = e.cp.enqueue(script("echo should not run either")).unwrap();
    assert_eq!(e.rejected(&id).await.rejections[0].0, RejectReason::Paused);
    let status = e.cli_json(&["status"]);
    assert_eq!(status["paused"]["reason"], "change freeze");
    // Pausing again changes nothing, and says so.
    let again = e.runner.cli(&["pause", "--reason", "another"]);
    let said = String::from_utf8_lossy(&again.stdout).into_owned();
    assert!(again.status.success() && said.contains("already paused by"), "{said}");
    assert_eq!(e.cli_json(&["status"])["paused"]["reason"], "change freeze");

    let out = e.runner.cli(&["resume"]);
    assert!(out.status.success(), "{out:?}");
    let id = e.cp.enqueue(script("echo running again")).unwrap();
    e.finished(&id).await;
    assert_eq!(e.output(&id), "running again\n");
    let records = audit_records(&e.runner.state_dir);
    let events: Vec<&str> = records.iter().filter_map(|r| r["event"].as_str()).collect();
    let paused = events.iter().position(|e| *e == "runner_paused").expect("pause audited");
    let resumed = events.iter().rposition(|e| *e == "runner_resumed").expect("resume audited");
    assert!(paused < resumed);
    // Each names who, as the kernel says (root here), with the reason.
    assert!(
        records[paused]["detail"]
            .as_str()
            .is_some_and(|d| d.contains("by root (uid 0)") && d.contains("change freeze")),
        "{records:?}"
    );
    assert!(
        records[resumed]["detail"].as_str().is_some_and(|d| d.contains("by root (uid 0)")),
        "{records:?}"
    );

    // A freeze lifted within a second, between two of the daemon's looks: both are on
    // record, with who, once each.
    let before = records.len();
    assert!(e.runner.cli(&["pause", "--reason", "quick freeze"]).status.success());
    assert!(e.runner.cli(&["resume"]).status.success());
    let state_dir = e.runner.state_dir.clone();
    eventually("the quick pause and resume audited", async || {
        let events: Vec<String> = audit_records(&state_dir)[before..]
            .iter()
            .filter_map(|r| r["event"].as_str().map(str::to_string))
            .collect();
        events.iter().any(|e| e == "runner_resumed")
    })
    .await;
    // A job after it runs: the daemon has looked at the controls since.
    let id = e.cp.enqueue(script("echo after the quick freeze")).unwrap();
    e.finished(&id).await;
    let after = audit_records(&e.runner.state_dir);
    let quick: Vec<&serde_json::Value> = after[before..]
        .iter()
        .filter(|r| ["runner_paused", "runner_resumed"].contains(&r["event"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(quick.len(), 2, "one record each: {quick:#?}");
    assert_eq!(quick[0]["event"], "runner_paused");
    assert!(
        quick[0]["detail"].as_str().unwrap().contains("by root (uid 0)")
            && quick[0]["detail"].as_str().unwrap().contains("quick freeze")
    );
    assert_eq!(quick[1]["event"], "runner_resumed");
    assert!(quick[1]["detail"].as_str().unwrap().contains("by root (uid 0)"), "{quick:#?}");
}

/// Containers cannot reach the loopback endpoint: they get an AWS config whose
/// `credential_process` prints a file the runner renews. With sessions of 3 s, a
/// container running past its first session reads a fresh, valid one at its end; a real
/// SDK (botocore) reads the runner's files; the keys are masked, never static variables,
/// and gone from the host when the job ends.
#[tokio::test]
async fn a_container_outliving_its_session_renews_through_credential_process() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = roles_env("session_min_secs = 1\nsession_max_secs = 3\nrefresh_before_secs = 1").await;
    let script = r#"echo "config=$AWS_CONFIG_FILE static=${AWS_SECRET_ACCESS_KEY:-none} endpoint=${AWS_CONTAINER_CREDENTIALS_FULL_URI:-none} role=$BYOC_ROLE"
get() { /byoc-aws-bin/busybox cat /byoc-aws/credentials.json; }
exp() { printf '%s' "$1" | sed 's/.*"Expiration":"\([^"]*\)".*/\1/'; }
kid() { printf '%s' "$1" | sed 's/.*"AccessKeyId":"\([^"]*\)".*/\1/' | sha256sum | cut -c1-16; }
a=$(get)
echo "first: $a"
echo waiting
until [ -e /work/go ]; do sleep 0.1; done
sleep 4
b=$(get)
{ echo "START_EXP=$(exp "$a")"; echo "END_EXP=$(exp "$b")"; echo "START_KEY=$(kid "$a")"; echo "END_KEY=$(kid "$b")"; echo "END_NOW=$(date -u +%Y-%m-%dT%H:%M:%SZ)"; } >> "$BYOC_OUTPUT""#;
    let req = EnqueueRequest {
        kind: "action.container".into(),
        spec: serde_json::json!({"image": image, "command": ["/bin/sh", "-c", script]}),
        ..role_job("action", "trigger", "inst-demo-maintenance", named("report"), "")
    };
    let id = e.env.cp.enqueue(req).unwrap();
    e.env.log_contains(&id, "waiting").await;

    // While it runs: the runner's files, as a real SDK reads them.
    let host_dir = e.env.runner.dir.join("credentials").join(&id);
    let config = std::fs::read_to_string(host_dir.join("config")).unwrap();
    assert!(
        config.contains("credential_process = /byoc-aws-bin/busybox cat /byoc-aws/credentials.json"),
        "{config}"
    );
    let file: serde_json::Value =
        serde_json::from_slice(&std::fs::read(host_dir.join("credentials.json")).unwrap()).unwrap();
    let host_config = e.env.dir.path().join("aws-config");
    std::fs::write(
        &host_config,
        config
            .replace("/byoc-aws-bin/busybox", "/bin/busybox")
            .replace("/byoc-aws/", &format!("{}/", host_dir.display())),
    )
    .unwrap();
    // Sessions last 3 s here: the runner may renew the file (more than once on a loaded
    // machine) while the SDK starts. Every key the file held meanwhile is noted; the SDK
    // must have read one of them.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (stop, path) = (stop.clone(), host_dir.join("credentials.json"));
        let first = file["AccessKeyId"].as_str().unwrap().to_string();
        std::thread::spawn(move || {
            let mut seen = std::collections::BTreeSet::from([first]);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Ok(v) = std::fs::read(&path).map(|b| serde_json::from_slice::<serde_json::Value>(&b))
                    && let Ok(v) = v
                    && let Some(k) = v["AccessKeyId"].as_str()
                {
                    seen.insert(k.to_string());
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            seen
        })
    };
    let sdk = std::process::Command::new(byoc_control_plane::moto::moto_binary().with_file_name("python"))
        .args(["-c", "import botocore.session; c = botocore.session.get_session().get_credentials(); print(c.method, c.get_frozen_credentials().access_key)"])
        .env_clear()
        .env("AWS_CONFIG_FILE", &host_config)
        .env("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .output()
        .unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = watcher.join().unwrap();
    let sdk_out = String::from_utf8_lossy(&sdk.stdout);
    assert!(sdk.status.success(), "{}", String::from_utf8_lossy(&sdk.stderr));
    let (method, key) = sdk_out.trim().split_once(' ').unwrap_or_default();
    assert_eq!(method, "custom-process", "{sdk_out}");
    assert!(seen.contains(key), "{key} is not a key the runner's file held: {seen:?}");
    std::fs::write(e.env.runner.state_dir.join("work").join(&id).join("go"), b"").unwrap();

    let v = e.env.finished(&id).await;
    let result = v.result.unwrap();
    let out = e.env.output(&id);
    assert_eq!(result.status, JobStatus::Succeeded, "{:?}\n{out}", result.error);
    assert!(
        out.contains("config=/byoc-aws/config static=none endpoint=none role=inst-demo-maintenance"),
        "no static keys, no endpoint: {out}"
    );
    assert!(out.contains(r#""AccessKeyId":"***""#) && out.contains(r#""SecretAccessKey":"***""#), "{out}");
    assert!(!out.contains(file["SecretAccessKey"].as_str().unwrap()));
    let outputs = result.outputs;
    let get = |k: &str| outputs[k].as_str().unwrap_or_default().to_string();
    assert!(get("END_EXP") > get("END_NOW"), "credentials at the end are still valid: {outputs}");
    assert!(get("START_EXP") < get("END_NOW"), "the first session expired during the job: {outputs}");
    assert_ne!(get("START_KEY"), get("END_KEY"), "a new session was written: {outputs}");
    assert!(e.assumed_for(&id).await.len() >= 2);
    let records = audit_records(&e.env.runner.state_dir);
    assert!(records.iter().any(|r| r["event"] == "role_session_refreshed" && r["job"] == id.as_str()));
    // The keys are gone from the host with the job, and never reached the state dir.
    assert!(!host_dir.exists(), "the job's credentials directory is removed");
    for (place, bytes) in every_file_under(&e.env.runner.state_dir) {
        assert!(
            !String::from_utf8_lossy(&bytes).contains(file["SecretAccessKey"].as_str().unwrap()),
            "a key leaked into {place}"
        );
    }
}

/// Without a static busybox (`roles.busybox`), a networked container's boundary cannot
/// be built and no container's output can be relayed: both are refused before any
/// AssumeRole, saying what to install.
#[tokio::test]
async fn without_a_static_busybox_containers_are_refused_before_any_assume_role() {
    let image = import_image("byoc-test/busybox:basic", &[]);
    let e = roles_env("busybox = \"/bin/ls\"").await;
    let script = r#"echo "key=$AWS_ACCESS_KEY_ID secret=$AWS_SECRET_ACCESS_KEY config=${AWS_CONFIG_FILE:-none} role=$BYOC_ROLE""#;
    let req = |network: bool| EnqueueRequest {
        kind: "action.container".into(),
        spec: serde_json::json!({"image": image, "command": ["/bin/sh", "-c", script], "network": network}),
        ..role_job("action", "trigger", "inst-demo-maintenance", named("report"), "")
    };
    let (id, detail) = e.refused(req(true), RejectReason::SandboxNetworkUnavailable).await;
    assert!(detail.contains("apt-get install busybox-static"), "{detail}");
    assert!(e.assumed_for(&id).await.is_empty(), "refused before any call to STS");
    let (id, detail) = e.refused(req(false), RejectReason::ContainerOutputUnavailable).await;
    assert!(detail.contains("apt-get install busybox-static"), "{detail}");
    assert!(e.assumed_for(&id).await.is_empty(), "refused before any call to STS");
}

/// A runner killed while a container ran leaves that job's credentials file behind; the
/// next start removes it (the job is reported interrupted, its session must go too).
#[tokio::test]
async fn a_restart_removes_credential_files_left_by_a_killed_runner() {
    let mut e = roles_env("").await;
    let stale = e.env.runner.dir.join("credentials").join("job-of-a-killed-runner");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("credentials.json"), br#"{"Version":1}"#).unwrap();
    // Only job directories go: anything else in a misconfigured directory stays.
    let unrelated = e.env.runner.dir.join("credentials").join("unrelated.txt");
    std::fs::write(&unrelated, b"not the runner's").unwrap();
    e.env.runner.signal(nix::sys::signal::Signal::SIGKILL);
    assert!(e.env.runner.wait_exit(WAIT).await.is_some());
    e.env.runner.spawn(None).unwrap();
    // Ready once a job runs again; by then the roles machinery has started.
    let id = e.env.cp.enqueue(script("echo up")).unwrap();
    e.env.finished(&id).await;
    assert!(!stale.exists(), "stale credentials removed at start");
    assert!(unrelated.exists(), "nothing else is removed");
}

/// The runner's own AWS calls (the install stack's switches, AssumeRole) go through the
/// customer's proxy (`HTTP_PROXY`/`HTTPS_PROXY`, as the AWS SDK's default client reads
/// them), like its control-plane traffic.
#[tokio::test]
async fn the_runners_aws_calls_go_through_the_proxy() {
    let proxy = byoc_control_plane::proxy::ConnectProxy::start().await.unwrap();
    let moto = MotoServer::start().await;
    moto.put_stack("CreateStack", STACK, &template(), &stack_params(&base_params())).await;
    let mut opts = role_options(&moto, "");
    opts.env.extend([
        ("HTTP_PROXY".to_string(), proxy.url()),
        ("HTTPS_PROXY".to_string(), proxy.url()),
        ("NO_PROXY".to_string(), String::new()),
    ]);
    let env = env_with(opts).await;
    let id = env
        .cp
        .enqueue(role_job("component", "deploy", "inst-demo-maintenance", named("api"), SHOW_ROLE))
        .unwrap();
    let v = env.finished(&id).await;
    assert_eq!(v.result.unwrap().status, JobStatus::Succeeded, "{}", env.output(&id));
    assert!(env.output(&id).contains("role=inst-demo-maintenance endpoint=yes"));
    let moto_authority = moto.url().trim_start_matches("http://").trim_end_matches('/').to_string();
    let through = proxy.targets();
    assert!(
        through.contains(&moto_authority),
        "AWS calls bypassed the proxy: {through:?} (moto at {moto_authority})"
    );
    assert_eq!(moto.calls_of("AssumeRole").await.len(), 1);
    assert!(!moto.calls_of("DescribeStacks").await.is_empty());
}

/// What a job does is the runner's finding, not the vendor's label: a terraform apply
/// labelled `action.trigger`, an uninstall labelled as a deploy and a deploy asking for
/// the deprovision role (through an entity role the signed app config allows) are
/// refused `operation_mismatch` before any call to AWS; a window rule on the effect
/// holds an apply whatever component it names. An honest deploy beside them runs.
#[tokio::test]
async fn a_job_is_held_to_what_it_does_not_to_its_labels() {
    let rules = r#"
[[guardrails.window]]
name = "never-now"
once = ["2001-01-01T00:00Z/1h"]

[[guardrails.window_rule]]
name = "changes"
windows = ["never-now"]
effects = ["change", "destroy"]
outside = "refuse"
"#;
    let moto = MotoServer::start().await;
    let mut params = base_params();
    params.insert("EnableDeprovisionRole", "true");
    moto.put_stack("CreateStack", STACK, &template(), &stack_params(&params)).await;
    let mut opts = role_options(&moto, "");
    opts.extra.push_str(rules);
    let e = RolesEnv { env: env_with(opts).await, moto, params };
    let apply = serde_json::json!({"mode": "apply", "workspace": "db", "files": {"main.tf": ""}});
    let kind = |mut req: EnqueueRequest, kind: &str, spec: serde_json::Value| {
        req.kind = kind.into();
        req.spec = spec;
        req
    };
    let (_, detail) = e
        .refused(
            kind(
                role_job("action", "trigger", "inst-demo-maintenance", named("x"), ""),
                "terraform",
                apply.clone(),
            ),
            RejectReason::OperationMismatch,
        )
        .await;
    assert!(detail.contains("effect is change cannot run as action.trigger"), "{detail}");
    let uninstall = serde_json::json!({"action": "uninstall", "release": "api", "namespace": "acme"});
    e.refused(
        kind(role_job("component", "deploy", "inst-demo-maintenance", named("api"), ""), "helm", uninstall),
        RejectReason::OperationMismatch,
    )
    .await;
    let as_deprovision = RoleRequest { entity_role: Some("deprovision".into()), ..named("db") };
    let (_, detail) = e
        .refused(
            kind(
                role_job("component", "deploy", "inst-demo-deprovision", as_deprovision, ""),
                "terraform",
                apply.clone(),
            ),
            RejectReason::OperationMismatch,
        )
        .await;
    assert!(detail.contains("deprovision-type role"), "{detail}");
    // A rule on the effect: the apply names a component no rule lists, and is held.
    let (_, detail) = e
        .refused(
            kind(
                role_job("component", "deploy", "inst-demo-maintenance", named("not-db"), ""),
                "terraform",
                apply,
            ),
            RejectReason::OutsideWindow,
        )
        .await;
    assert!(detail.contains("changes"), "{detail}");
    assert!(e.assumed().await.is_empty(), "no role was assumed for a refused job");
    // A script under the maintenance role is no change the runner can see: it runs.
    e.succeeds(role_job("component", "deploy", "inst-demo-maintenance", named("api"), SHOW_ROLE)).await;
}
