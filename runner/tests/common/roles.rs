//! Shared set-up for suites with lifecycle roles: the example install stack in a moto
//! server, the example app's role config, and a job's credentials learned the way the
//! job learns them.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::harness::RunnerOptions;
use byoc_control_plane::moto::MotoServer;
use byoc_protocol::{AppConfig, RoleRequest};

pub const STACK: &str = "byoc-install";
pub const EXTERNAL_ID: &str = "ext-7f3a91";
pub const ACCOUNT: &str = "123456789012";

/// The example install stack (`examples/install-stack.json`): one switch parameter per
/// role, each role created (and its ARN output) only when switched on.
pub fn template() -> serde_json::Value {
    let path = byoc_control_plane::app_config::examples_dir().join("install-stack.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn arn(suffix: &str) -> String {
    format!("arn:aws:iam::{ACCOUNT}:role/inst-demo-{suffix}")
}

/// The example app's role config (`examples/app/`), in the format of the system this
/// product is modelled on.
pub fn app_config() -> AppConfig {
    byoc_control_plane::app_config::load(&byoc_control_plane::app_config::examples_dir().join("app")).unwrap()
}

pub fn role_job(
    entity: &str,
    operation: &str,
    requested: &str,
    request: RoleRequest,
    script: &str,
) -> EnqueueRequest {
    EnqueueRequest {
        entity: entity.into(),
        operation: operation.into(),
        requested_role: Some(requested.into()),
        app_config: Some(app_config()),
        role_request: Some(request),
        ..EnqueueRequest::new("action.script", serde_json::json!({ "script": script }))
    }
}

pub fn named(name: &str) -> RoleRequest {
    RoleRequest { entity_name: name.into(), ..Default::default() }
}

pub fn base_params() -> BTreeMap<&'static str, &'static str> {
    [
        ("EnableProvisionRole", "true"),
        ("EnableMaintenanceRole", "true"),
        ("EnableDeprovisionRole", "false"),
        ("EnableEksUpgradeRole", "true"),
        ("EnableS3ObjectBreakGlassRole", "false"),
        ("InstallId", "inst-demo"),
        ("RunnerInstanceRoleArn", "arn:aws:iam::123456789012:role/byoc-runner-instance"),
        ("ExternalId", EXTERNAL_ID),
    ]
    .into_iter()
    .collect()
}

pub fn stack_params(p: &BTreeMap<&'static str, &'static str>) -> Vec<(&'static str, &'static str)> {
    p.iter().map(|(k, v)| (*k, *v)).collect()
}

/// Runner options for an install whose AWS side is `moto` and whose switches are the
/// example stack.
pub fn role_options(moto: &MotoServer, roles_extra: &str) -> RunnerOptions {
    RunnerOptions {
        extra: format!(
            "\n[aws]\nregion = \"us-east-1\"\nendpoint_url = \"{}\"\naccount_id = \"{ACCOUNT}\"\n\n[roles]\nstack_name = \"{STACK}\"\nexternal_id = \"{EXTERNAL_ID}\"\ncontainer_credentials_dir = \"@RUNNER_DIR@/credentials\"\n{roles_extra}\n",
            moto.url()
        ),
        // The runner's own identity (its instance role on EC2).
        env: vec![
            ("AWS_ACCESS_KEY_ID".into(), "runner-instance-identity".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "runner-instance-secret".into()),
            ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
        ],
        ..Default::default()
    }
}

/// A moto server with the example install stack created from `params`.
pub async fn moto_with_stack(params: &BTreeMap<&'static str, &'static str>) -> MotoServer {
    let moto = MotoServer::start().await;
    moto.put_stack("CreateStack", STACK, &template(), &stack_params(params)).await;
    moto
}

/// The environment of the running process whose `BYOC_JOB_ID` is `job_id`.
pub fn job_environ(job_id: &str) -> Option<BTreeMap<String, String>> {
    job_process(job_id).map(|(_, vars)| vars)
}

/// The pid and environment of the running process whose `BYOC_JOB_ID` is `job_id`.
pub fn job_process(job_id: &str) -> Option<(i32, BTreeMap<String, String>)> {
    let needle = format!("BYOC_JOB_ID={job_id}");
    for entry in std::fs::read_dir("/proc").ok()? {
        let Ok(entry) = entry else { continue };
        let Ok(raw) = std::fs::read(entry.path().join("environ")) else { continue };
        let vars: BTreeMap<String, String> = raw
            .split(|b| *b == 0)
            .filter_map(|kv| std::str::from_utf8(kv).ok()?.split_once('=').map(|(k, v)| (k.into(), v.into())))
            .collect();
        if vars.get("BYOC_JOB_ID").is_some_and(|v| format!("BYOC_JOB_ID={v}") == needle) {
            let pid = entry.file_name().to_str()?.parse().ok()?;
            return Some((pid, vars));
        }
    }
    None
}

pub fn every_file_under(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(every_file_under(&p));
        } else if let Ok(bytes) = std::fs::read(&p) {
            out.push((p.display().to_string(), bytes));
        }
    }
    out
}

/// A role job that waits for `go` to exist, then prints its credentials (raw, base64,
/// in its outputs and its error) and fails.
pub fn leaky_role_job(go: &std::path::Path) -> EnqueueRequest {
    let script = format!(
        r#"echo waiting
while [ ! -e {go} ]; do sleep 0.05; done
creds=$(curl -s -H "Authorization: $AWS_CONTAINER_AUTHORIZATION_TOKEN" "$AWS_CONTAINER_CREDENTIALS_FULL_URI")
echo "creds: $creds"
echo "token: $AWS_CONTAINER_AUTHORIZATION_TOKEN"
printf '%s' "$creds" | base64 -w0; echo
key=$(printf '%s' "$creds" | sed 's/.*"SecretAccessKey":"\([^"]*\)".*/\1/')
printf '%s' "$key" | base64
echo "SECRET=$key" >> "$BYOC_OUTPUT"
echo "failing with $key" >&2
exit 3"#,
        go = go.display()
    );
    role_job("component", "deploy", "inst-demo-maintenance", named("api"), &script)
}

/// While the job runs: its endpoint token (from its environment), the endpoint URL and
/// the credentials the endpoint hands out. Returns (vars, [key id, secret, session
/// token, endpoint token]).
pub async fn job_credentials(job_id: &str) -> (BTreeMap<String, String>, Vec<String>) {
    let (pid, vars) = job_process(job_id).expect("the job's process");
    let token = vars["AWS_CONTAINER_AUTHORIZATION_TOKEN"].clone();
    // The endpoint exists only inside the job's network namespace: ask from there.
    let (url, t) = (vars["AWS_CONTAINER_CREDENTIALS_FULL_URI"].clone(), token.clone());
    let creds: serde_json::Value = std::thread::spawn(move || {
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            reqwest::Client::new()
                .get(&url)
                .header("Authorization", &t)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap()
        })
    })
    .join()
    .unwrap();
    let secrets = ["AccessKeyId", "SecretAccessKey", "Token"]
        .iter()
        .map(|k| creds[k].as_str().unwrap().to_string())
        .chain([token])
        .collect();
    (vars, secrets)
}

/// A program of the project's .venv (scripts/setup).
pub fn venv_bin(name: &str) -> std::path::PathBuf {
    byoc_control_plane::moto::moto_binary().with_file_name(name)
}

/// A YAML template as JSON (it uses no YAML tags, so a plain YAML load is exact).
pub fn template_at(path: &std::path::Path) -> serde_json::Value {
    let out = std::process::Command::new(venv_bin("python"))
        .args(["-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))"])
        .arg(path)
        .output()
        .expect("the project's .venv (scripts/setup)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Create `template` as `stack` in moto with the vendor's parameters for `install_id`
/// plus `switches`; DescribeStacks' answer.
pub async fn create_stack(
    moto: &MotoServer,
    stack: &str,
    template: &serde_json::Value,
    install_id: &str,
    switches: &[(&str, &str)],
) -> String {
    let image = moto
        .query("ec2", &[("Action".into(), "DescribeImages".into()), ("Version".into(), "2016-11-15".into())])
        .await;
    let image_id = image.split("<imageId>").nth(1).and_then(|s| s.split('<').next()).unwrap().to_string();
    let mut params = vec![
        ("InstallId", install_id),
        ("ControlPlaneUrl", "https://cp.vendor.example"),
        ("ControlPlanePublicKeys", "11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo="),
        ("ReleasePublicKey", "RWQf6LRCGA9i53mlYecO4IzT51TGPpvWucNSCh1CBM0QTaLn73Y7GFO3"),
        ("ImageId", image_id.as_str()),
        ("BootstrapToken", "one-time-bootstrap-token-0123"),
        ("ExternalId", EXTERNAL_ID),
    ];
    params.extend_from_slice(switches);
    moto.put_stack("CreateStack", stack, template, &params).await;
    moto.query(
        "cloudformation",
        &[("Action".into(), "DescribeStacks".into()), ("StackName".into(), stack.into())],
    )
    .await
}
