//! Components by digest from the install's own registry, on the real terraform (1.11
//! on these machines; `terraform_data` needs no provider, so it all runs offline): a
//! module is published as an OCI artifact to the vendor's registry (in token mode: each
//! sync exchanges a one-time grant the control plane mints), synced into the
//! install's ECR (moto, its registry host mapped to a second local registry) by an
//! `oci.sync` job, then applied by digest under the job's role, with its state kept
//! by the runner between jobs. Helm charts and kubernetes bundles by digest too.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::moto::MotoServer;
use byoc_control_plane::registry::{LocalRegistry, Pushed};
use byoc_protocol::JobStatus;
use common::roles::*;
use common::*;

const USER: &str = "vendor-sync";
const TOKEN: &str = "otk-5e2b9c1d7a8f403e9b6c";
const ECR_HOST: &str = "123456789012.dkr.ecr.us-east-1.amazonaws.com";
const MODULE_TYPE: &str = "application/vnd.opentofu.modulepkg";

struct CEnv {
    env: Env,
    moto: MotoServer,
    vendor: LocalRegistry,
    ecr: LocalRegistry,
    /// The runner's options, for a second runner of the same install.
    opts: byoc_control_plane::harness::RunnerOptions,
    _policies: tempfile::TempDir,
    _tools: Option<tempfile::TempDir>,
}

fn terraform() -> std::path::PathBuf {
    let out = std::process::Command::new("sh").args(["-c", "command -v terraform"]).output().unwrap();
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(!path.is_empty(), "terraform is required on PATH (terraform 1.11 on these machines)");
    std::path::PathBuf::from(path)
}

async fn components_env(extra: &str) -> CEnv {
    components_env_with(extra, "", |_| String::new()).await
}

/// With `sandbox_extra` for `[sandbox]`, and config made from moto's URL (a state bucket).
async fn components_env_with(
    extra: &str,
    sandbox_extra: &str,
    with_moto: impl FnOnce(&MotoServer) -> String,
) -> CEnv {
    components_env_tf("", extra, sandbox_extra, with_moto).await
}

/// [`components_env_with`], with `terraform_extra` in `[terraform]`.
async fn components_env_tf(
    terraform_extra: &str,
    extra: &str,
    sandbox_extra: &str,
    with_moto: impl FnOnce(&MotoServer) -> String,
) -> CEnv {
    let params = base_params();
    // The vendor's registry in token mode: each sync's one-time grant, minted by the
    // control plane, is exchanged once at its token service.
    let tokens = byoc_control_plane::grants::RegistryTokens::start("vendor-registry").await;
    let (moto, vendor, ecr) = tokio::join!(
        moto_with_stack(&params),
        LocalRegistry::start_token(&tokens),
        LocalRegistry::start(None)
    );
    let realm = tokens.addr.to_string();
    let extra = format!("{extra}\n{}", with_moto(&moto));
    let policies = tempfile::tempdir().unwrap();
    let (tools, helm) = stand_in("helm");
    let mut opts = role_options(&moto, "");
    opts.extra.push_str(&format!(
        "\n[oci]\nregistry_endpoints = {{ \"{ECR_HOST}\" = \"{}\", \"{}\" = \"{}\", \"{realm}\" = \"http://{realm}\" }}\n\n[terraform]\nbinary = \"{}\"\n{terraform_extra}\n\n[helm]\nbinary = \"{}\"\n\n[policy]\ndir = \"{}\"\n{extra}\n",
        ecr.url(),
        vendor.host(),
        vendor.url(),
        terraform().display(),
        helm.display(),
        policies.path().display()
    ));
    opts.sandbox_ro_paths.push(tools.path().to_path_buf());
    opts.sandbox_extra = sandbox_extra.into();
    let env = env_with(opts.clone()).await;
    env.cp.use_registry_tokens(tokens);
    CEnv { env, moto, vendor, ecr, opts, _policies: policies, _tools: Some(tools) }
}

fn module(resources: usize, sleep: Option<u32>) -> Vec<(String, String)> {
    let mut main = String::from("variable \"label\" {\n  type = string\n}\n");
    for i in 0..resources {
        main.push_str(&format!(
            "resource \"terraform_data\" \"r{i}\" {{\n  input = \"${{var.label}}-{i}\"\n"
        ));
        if let (0, Some(secs)) = (i, sleep) {
            main.push_str(&format!(
                "  provisioner \"local-exec\" {{\n    command = \"echo slow-create-started; sleep {secs}\"\n  }}\n"
            ));
        }
        main.push_str("}\n");
    }
    main.push_str("output \"first\" {\n  value = terraform_data.r0.output\n}\n");
    main.push_str("output \"token\" {\n  value = \"${var.label}-t0ken\"\n  sensitive = true\n}\n");
    vec![("./".into(), String::new()), ("main.tf".into(), main)]
}

/// Publish `files` to the vendor's registry and sync it into the install's ECR.
async fn publish(e: &CEnv, repo: &str, artifact_type: &str, files: &[(String, String)]) -> Pushed {
    let files: Vec<(&str, &str)> = files.iter().map(|(p, c)| (p.as_str(), c.as_str())).collect();
    let pushed = e.vendor.push_tar_artifact(repo, Some("1.0.0"), artifact_type, &files).await;
    let sync = EnqueueRequest {
        entity: "artifact".into(),
        operation: "sync".into(),
        requested_role: Some("inst-demo-maintenance".into()),
        app_config: Some(app_config()),
        role_request: Some(named("api-image")),
        ..EnqueueRequest::new(
            "oci.sync",
            serde_json::json!({
                "source": format!("{}/{repo}:1.0.0@{}", e.vendor.host(), pushed.digest),
                "source_grant": {"ttl_secs": 300},
                "destination": {"repository": format!("inst-demo/{repo}"), "tags": ["1.0.0"]},
            }),
        )
    };
    let id = e.env.cp.enqueue(sync).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "sync: {:?}\n{}", r.error, e.env.output(&id));
    pushed
}

fn deploy(kind: &str, spec: serde_json::Value) -> EnqueueRequest {
    let mut req = EnqueueRequest {
        timeout_secs: 300,
        ..role_job("component", "deploy", "inst-demo-maintenance", named("api"), "")
    };
    req.kind = kind.into();
    req.spec = spec;
    req
}

fn tf(mode: &str, module_ref: &str) -> EnqueueRequest {
    let mut req = deploy(
        "terraform",
        serde_json::json!({"mode": mode, "module": module_ref, "workspace": "network", "vars": {"label": "net"}}),
    );
    if mode == "destroy" {
        req.operation = "teardown".into();
    }
    req
}

async fn run(e: &CEnv, req: EnqueueRequest) -> (String, byoc_protocol::JobResult, String) {
    let id = e.env.cp.enqueue(req).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    let log = e.env.output(&id);
    (id, r, log)
}

#[tokio::test]
async fn a_module_by_digest_applies_once_then_finds_no_changes_then_destroys() {
    let e = components_env("").await;
    let pushed = publish(&e, "tf-network", MODULE_TYPE, &module(3, None)).await;
    let reference = format!("{ECR_HOST}/inst-demo/tf-network@{}", pushed.digest);

    let (id, r, log) = run(&e, tf("apply", &reference)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("fetched and verified"), "{log}");
    assert!(log.contains("Apply complete! Resources: 3 added"), "{log}");
    assert_eq!(r.outputs["outputs"]["first"], "net-0");
    // Read from the local state, a sensitive output still reaches nobody.
    assert_eq!(r.outputs["outputs"]["token"], "***", "{}", r.outputs);
    assert!(!log.contains("net-t0ken"), "{log}");
    let serial = r.outputs["state_serial"].as_u64().unwrap();
    assert!(serial >= 1, "{}", r.outputs);
    // The decision names the artifact it was about.
    let decisions = audit_events(&e.env.runner.state_dir, "policy_decision");
    let d = decisions.iter().find(|d| d["job"] == id.as_str()).unwrap();
    assert_eq!(d["digests"]["artifact"], pushed.digest.as_str(), "{d}");

    // A second job with the same module: the state survived the first job's directory.
    let (_, r, log) = run(&e, tf("apply", &reference)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("(cached)"), "served from the cache: {log}");
    assert!(log.contains("No changes."), "{log}");
    assert_eq!(r.outputs["summary"]["counts"], serde_json::json!({}), "{}", r.outputs);
    assert_eq!(r.outputs["state_serial"].as_u64(), Some(serial), "no change, no new state version");

    // The customer sees addresses and serials, never values.
    let shown = e.env.cli_json(&["state", "show", "network"]);
    assert_eq!(
        shown["resources"],
        serde_json::json!(["terraform_data.r0", "terraform_data.r1", "terraform_data.r2"])
    );
    assert!(!shown.to_string().contains("net-1"), "{shown}");
    // Local state is locked only while a job holds it; a hostile name is no path.
    for (args, code) in [
        (&["state", "unlock", "network", "any-id"][..], "state_not_locked"),
        (&["state", "show", "../audit"][..], "invalid_request"),
        (&["state", "show", "nowhere"][..], "state_not_found"),
        (&["state", "unlock", "nowhere", "any-id"][..], "state_not_found"),
    ] {
        let out = e.env.runner.cli(&[args, &["--output", "json"]].concat());
        assert!(!out.status.success(), "{args:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["code"], code, "{args:?}: {v}");
    }

    let (_, r, log) = run(&e, tf("destroy", &reference)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("0 added, 0 changed, 3 destroyed"), "{log}");
    let shown = e.env.cli_json(&["state", "show", "network"]);
    assert_eq!(shown["resources"], serde_json::json!([]));
    assert!(shown["previous_versions"].as_u64().unwrap() >= 1, "{shown}");
}

#[tokio::test]
async fn a_tampered_artifact_is_refused_before_terraform_runs() {
    let e = components_env("").await;
    let pushed = publish(&e, "tf-tampered", MODULE_TYPE, &module(1, None)).await;
    // One byte of the layer, changed in the install's registry behind its back.
    let manifest: serde_json::Value = serde_json::from_slice(&pushed.bytes).unwrap();
    let layer = manifest["layers"][0]["digest"].as_str().unwrap();
    let path = e.ecr.blob_path(layer);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    let reference = format!("{ECR_HOST}/inst-demo/tf-tampered@{}", pushed.digest);
    let (_, r, log) = run(&e, tf("apply", &reference)).await;
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "artifact_digest_mismatch", "{}\n{log}", r.outputs);
    assert!(!log.contains("[terraform] init"), "terraform never ran: {log}");

    // A reference outside the install's registry, even one the runner could reach.
    let elsewhere = format!("{}/tf-tampered@{}", e.vendor.host(), pushed.digest);
    let (_, r, _) = run(&e, tf("apply", &elsewhere)).await;
    assert_eq!(r.outputs["reason"], "artifact_not_in_install_registry", "{}", r.outputs);
}

#[tokio::test]
async fn a_job_may_not_choose_its_own_backend_unless_the_customer_allows_it() {
    let e = components_env("").await;
    let spec = serde_json::json!({
        "mode": "apply", "workspace": "db",
        "files": {"main.tf": "resource \"terraform_data\" \"x\" {}\n"},
        "backend_config": {"bucket": "vendor-bucket", "key": "elsewhere"},
    });
    let (_, r, log) = run(&e, deploy("terraform", spec)).await;
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "backend_not_allowed", "{}\n{log}", r.outputs);
    assert!(!log.contains("[terraform] init"), "{log}");
}

#[tokio::test]
async fn cancelling_mid_apply_keeps_what_was_made_and_releases_the_workspace() {
    let e = components_env("").await;
    let pushed = publish(&e, "tf-slow", MODULE_TYPE, &module(2, Some(60))).await;
    let reference = format!("{ECR_HOST}/inst-demo/tf-slow@{}", pushed.digest);
    let id = e.env.cp.enqueue(tf("apply", &reference)).unwrap();
    e.env.log_contains(&id, "slow-create-started").await;
    e.env.cp.cancel(&id).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Cancelled, "{:?}\n{}", r.error, e.env.output(&id));
    // The next job takes the workspace and finishes what the first one started.
    let fast = publish(&e, "tf-fast", MODULE_TYPE, &module(2, None)).await;
    let reference = format!("{ECR_HOST}/inst-demo/tf-fast@{}", fast.digest);
    let (_, r, log) = run(&e, tf("apply", &reference)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(!log.contains("state_locked"), "{log}");
}

#[tokio::test]
async fn a_chart_by_digest_reaches_helm_as_a_local_path_without_credentials() {
    let e = components_env("").await;
    let chart = vec![
        ("api/".to_string(), String::new()),
        ("api/Chart.yaml".to_string(), "apiVersion: v2\nname: api\nversion: 1.0.0\n".to_string()),
        (
            "api/templates/cm.yaml".to_string(),
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: api\ndata:\n  a: b\n".to_string(),
        ),
        // What the stand-in "renders".
        (
            "api/fake-rendered.yaml".to_string(),
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: api\n  namespace: acme\ndata:\n  a: b\n"
                .to_string(),
        ),
    ];
    let pushed = publish(&e, "charts-api", "application/vnd.cncf.helm.config.v1+json", &chart).await;
    let spec = serde_json::json!({
        "action": "upgrade", "release": "api", "namespace": "acme",
        "chart": format!("{ECR_HOST}/inst-demo/charts-api@{}", pushed.digest),
        "kubeconfig": byoc_control_plane::kube_api::unreached_kubeconfig(),
    });
    let (_, r, log) = run(&e, deploy("helm", spec)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("[helm] chart") && log.contains("fetched and verified"), "{log}");
    // The stand-in reports its argv (and refuses a remote chart or a credential in it).
    assert!(log.contains("fake-helm: upgrade") && log.contains("./chart"), "{log}");
    assert!(!log.contains("refusing"), "{log}");
}

/// `byoc-runner run-local JOB_FILE ARGS…` in `dir`: (exit code, stdout + stderr).
fn run_local(dir: &std::path::Path, job: &serde_json::Value, args: &[&str]) -> (i32, String) {
    run_local_with(dir, job, args, &[])
}

fn run_local_with(
    dir: &std::path::Path,
    job: &serde_json::Value,
    args: &[&str],
    env: &[(&str, &str)],
) -> (i32, String) {
    let file = dir.join(format!("job-{}.json", rand_suffix()));
    std::fs::write(&file, job.to_string()).unwrap();
    let out = std::process::Command::new(BIN)
        .current_dir(dir)
        .envs(env.iter().copied())
        .arg("run-local")
        .arg(&file)
        .args(["--policies", "/nonexistent-policies", "--terraform"])
        .arg(terraform())
        .args(args)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

fn rand_suffix() -> String {
    byoc_protocol::random_hex(4)
}

#[test]
fn run_local_applies_a_component_keeps_its_state_and_stops_at_the_decision_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let job = serde_json::json!({"kind": "terraform", "timeout_secs": 120, "spec": {
        "mode": "apply", "workspace": "local-demo",
        "files": {"main.tf": "resource \"terraform_data\" \"a\" {\n  input = \"x\"\n}\n"},
    }});
    let (code, out) = run_local(dir.path(), &job, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("[policy] ALLOW plan") && out.contains("1 added"), "{out}");
    let (code, out) = run_local(dir.path(), &job, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("No changes."), "the state was kept between runs: {out}");
    assert!(dir.path().join(".byoc-run-local/tfstate/local-demo/terraform.tfstate").is_file());

    // --plan-only: decided, nothing applied.
    let more = serde_json::json!({"kind": "terraform", "timeout_secs": 120, "spec": {
        "mode": "apply", "workspace": "local-demo",
        "files": {"main.tf": "resource \"terraform_data\" \"a\" {\n  input = \"x\"\n}\nresource \"terraform_data\" \"b\" {}\n"},
    }});
    let (code, out) = run_local(dir.path(), &more, &["--plan-only"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("stopping after the decision") && !out.contains("Apply complete"), "{out}");
}

#[tokio::test]
async fn run_local_fetches_a_component_by_digest_from_the_vendors_registry() {
    let registry = LocalRegistry::start(Some((USER, TOKEN))).await;
    let files = module(2, None);
    let files: Vec<(&str, &str)> = files.iter().map(|(p, c)| (p.as_str(), c.as_str())).collect();
    let pushed = registry.push_tar_artifact("vendor/tf-local", Some("1.0.0"), MODULE_TYPE, &files).await;
    let dir = tempfile::tempdir().unwrap();
    let job = |digest: &str| {
        serde_json::json!({"kind": "terraform", "timeout_secs": 120, "spec": {
            "mode": "apply", "workspace": "by-digest", "vars": {"label": "loc"},
            "module": format!("{}/vendor/tf-local@{digest}", registry.host()),
        }})
    };
    // A registry on this machine's loopback is reached only when named (--endpoint).
    let (code, out) = run_local(dir.path(), &job(&pushed.digest), &[]);
    assert_eq!(code, 125, "{out}");
    assert!(out.contains("module: 127.0.0.1") && out.contains("loopback"), "{out}");
    let endpoint = format!("{}={}", registry.host(), registry.url());
    // No credential: the registry says no, and nothing runs.
    let (code, out) = run_local(dir.path(), &job(&pushed.digest), &["--endpoint", &endpoint]);
    assert_eq!(code, 125, "{out}");
    assert!(out.contains("HTTP 401") && !out.contains("Initializing"), "{out}");
    // With the vendor's credential (the token from the environment, never argv).
    let auth = ["--registry-user", USER, "--endpoint", &endpoint];
    let token = [("BYOC_REGISTRY_TOKEN", TOKEN)];
    let (code, out) = run_local_with(dir.path(), &job(&pushed.digest), &auth, &token);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&pushed.digest) && out.contains("2 added"), "{out}");
    assert!(!out.contains(TOKEN), "{out}");
    // Again: served from the cache, the state kept.
    let (code, out) = run_local_with(dir.path(), &job(&pushed.digest), &auth, &token);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("No changes."), "{out}");
    assert!(
        dir.path()
            .join(".byoc-run-local/artifacts")
            .join(pushed.digest.trim_start_matches("sha256:"))
            .is_dir()
    );
    // A digest the repository does not hold is refused before terraform runs.
    let missing = format!("sha256:{}", "0".repeat(64));
    let (code, out) = run_local_with(dir.path(), &job(&missing), &auth, &token);
    assert_eq!(code, 125, "{out}");
    assert!(out.contains("artifact_not_found") || out.contains("not found"), "{out}");
}

#[test]
fn run_local_decides_with_the_vendor_policies_and_the_app_config() {
    let dir = tempfile::tempdir().unwrap();
    let examples = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/policy");
    let deny_all = dir.path().join("deny-all.rego");
    std::fs::write(&deny_all, "package main\n\ndeny contains msg if {\n  some rc in input.resource_changes\n  msg := sprintf(\"%s: no new resources today\", [rc.address])\n}\n").unwrap();
    let job = serde_json::json!({"kind": "terraform", "timeout_secs": 120, "spec": {
        "mode": "apply", "workspace": "denied",
        "files": {"main.tf": "resource \"terraform_data\" \"a\" {}\n"},
    }});
    let (code, out) = run_local(dir.path(), &job, &["--vendor-policy", deny_all.to_str().unwrap()]);
    assert_eq!(code, 125, "{out}");
    assert!(out.contains("DENY") && out.contains("no new resources today"), "{out}");
    assert!(!out.contains("Apply complete"), "{out}");
    // An app config's declarations for the component are loaded (and a broken one refused).
    let policies = |out: &str| -> usize {
        let at = out.find(" policies)").unwrap_or_else(|| panic!("no decision line: {out}"));
        out[..at].rsplit('(').next().unwrap().parse().unwrap()
    };
    let (code, out) = run_local(dir.path(), &job, &["--plan-only"]);
    assert_eq!(code, 0, "{out}");
    let without = policies(&out);
    let (code, out) = run_local(
        dir.path(),
        &job,
        &["--app-config", examples.join("app").to_str().unwrap(), "--component", "api", "--plan-only"],
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(policies(&out), without + 1, "the app's terraform_module policy was decided with: {out}");
    let (code, out) = run_local(dir.path(), &job, &["--app-config", "/nonexistent-app"]);
    assert_eq!(code, 125, "{out}");
}

#[test]
fn run_local_reviews_kubernetes_manifests_without_a_cluster_when_planning() {
    let dir = tempfile::tempdir().unwrap();
    let job = serde_json::json!({"kind": "kubernetes", "timeout_secs": 60, "spec": {
        "action": "apply", "component": "api", "namespace": "acme",
        "kubeconfig": byoc_control_plane::kube_api::unreached_kubeconfig(),
        "manifests": [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api"}, "spec": {"type": "LoadBalancer"}}],
    }});
    let (code, out) = run_local(dir.path(), &job, &["--plan-only"]);
    // The built-in pack refuses a new public LoadBalancer; nothing reaches a cluster.
    assert_eq!(code, 125, "{out}");
    assert!(out.contains("DENY") && out.contains("public_ingress"), "{out}");
}

#[tokio::test]
async fn a_manifests_bundle_by_digest_is_decided_and_applied_to_the_cluster() {
    let api = byoc_control_plane::kube_api::FakeKubeApi::start().await;
    let e = components_env(&api.runner_config()).await;
    let bundle = vec![
        ("manifests/".to_string(), String::new()),
        (
            "manifests/10-config.yaml".to_string(),
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: api-config\ndata:\n  mode: prod\n---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: api-flags\ndata:\n  beta: \"false\"\n".to_string(),
        ),
        (
            "manifests/20-more.json".to_string(),
            r#"[{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "api-extra"}, "data": {"k": "v"}}]"#.to_string(),
        ),
        ("README.md".to_string(), "not a manifest: skipped".to_string()),
    ];
    let pushed = publish(&e, "manifests-api", "application/vnd.byoc.manifests.v1", &bundle).await;
    let spec = serde_json::json!({
        "action": "apply", "component": "api", "namespace": "acme", "wait_secs": 30,
        "bundle": format!("{ECR_HOST}/inst-demo/manifests-api@{}", pushed.digest),
        "kubeconfig": api.kubeconfig("cluster-token-9d8e7f6a5b4c3d2e"),
    });
    let (id, r, log) = run(&e, deploy("kubernetes", spec)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("3 objects") && log.contains("fetched and verified"), "{log}");
    for name in ["api-config", "api-flags", "api-extra"] {
        assert!(api.object(&format!("/api/v1/namespaces/acme/configmaps/{name}")).is_some(), "{name}");
    }
    let decisions = audit_events(&e.env.runner.state_dir, "policy_decision");
    let d = decisions.iter().find(|d| d["job"] == id.as_str()).unwrap();
    assert_eq!(d["digests"]["artifact"], pushed.digest.as_str(), "{d}");
}

#[tokio::test]
async fn state_goes_to_the_install_bucket_under_the_jobs_role() {
    // The job must reach moto's S3 on this host's loopback, which its sandbox refuses
    // (as it should): this suite runs the job unsandboxed; the backend settings are the
    // same either way.
    let e = components_env_with("", "enabled = false", |moto| {
        format!("\n[terraform.state]\nbucket = \"inst-demo-state\"\nendpoint = \"{}\"\n", moto.url())
    })
    .await;
    e.moto.create_bucket("inst-demo-state").await;
    let pushed = publish(&e, "tf-bucket", MODULE_TYPE, &module(2, None)).await;
    let reference = format!("{ECR_HOST}/inst-demo/tf-bucket@{}", pushed.digest);
    let (_, r, log) = run(&e, tf("apply", &reference)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("s3://inst-demo-state/inst-demo/network/terraform.tfstate"), "{log}");
    // It planned under the role narrowed to read-only plus this workspace's lock object.
    let assumed = e.moto.calls_of("AssumeRole").await;
    let narrowed = assumed.iter().find(|c| c.params.contains_key("Policy")).expect("a narrowed session");
    assert_eq!(narrowed.params["PolicyArns.member.1.arn"], "arn:aws:iam::aws:policy/ReadOnlyAccess");
    assert!(
        narrowed.params["Policy"]
            .contains("arn:aws:s3:::inst-demo-state/inst-demo/network/terraform.tfstate.tflock"),
        "{:?}",
        narrowed.params
    );
    assert!(log.contains("Successfully configured the backend \"s3\""), "{log}");
    // State elsewhere: the outputs come from `terraform output -json`.
    assert_eq!(r.outputs["outputs"]["first"], "net-0", "{}", r.outputs);
    assert_eq!(r.outputs["outputs"]["token"], "***", "{}", r.outputs);
    // One key per workspace, under the install's prefix; no lock left behind.
    assert_eq!(e.moto.s3_keys("inst-demo-state").await, ["inst-demo/network/terraform.tfstate"]);
    let state = e.moto.s3_object("inst-demo-state", "inst-demo/network/terraform.tfstate").await.unwrap();
    assert!(String::from_utf8_lossy(&state).contains("terraform_data"));
    // Nothing on the runner's disk: the bucket is the state.
    assert!(!e.env.runner.state_dir.join("tfstate/network/terraform.tfstate").exists());
    let (_, r, log) = run(&e, tf("apply", &reference)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("No changes."), "{log}");

    // A lock a killed runner left in the bucket: the next job says so, and what to do.
    let stale = br#"{"ID":"5b1f2c3d-dead-beef","Operation":"OperationTypeApply","Who":"killed-runner"}"#;
    e.moto.s3_put("inst-demo-state", "inst-demo/network/terraform.tfstate.tflock", stale.to_vec()).await;
    let (_, r, log) = run(&e, tf("apply", &reference)).await;
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "state_locked", "{}\n{log}", r.outputs);
    assert!(r.error.as_deref().unwrap_or("").contains("state unlock"), "{:?}", r.error);

    // The customer sees the workspace and its lock in the bucket, read under the
    // maintenance role: addresses and serials, never values.
    let listed = e.env.cli_json(&["state", "list"]);
    assert_eq!(listed[0]["workspace"], "network", "{listed}");
    assert_eq!(listed[0]["resources"].as_array().map(Vec::len), Some(2), "{listed}");
    assert_eq!(listed[0]["lock"]["ID"], "5b1f2c3d-dead-beef", "{listed}");
    let shown = e.env.cli_json(&["state", "show", "network"]);
    assert_eq!(shown["resources"], serde_json::json!(["terraform_data.r0", "terraform_data.r1"]), "{shown}");
    assert!(!shown.to_string().contains("net-0"), "a value reached the CLI: {shown}");
    let text = e.env.runner.cli(&["state", "show", "network"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("s3://inst-demo-state/inst-demo/network/terraform.tfstate"), "{text}");
    assert!(text.contains("state unlock network 5b1f2c3d-dead-beef"), "{text}");
    // A role switched off is refused, never bypassed.
    let out = e.env.runner.cli(&["state", "list", "--role", "deprovision", "--output", "json"]);
    assert!(!out.status.success());
    let refused: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(refused["code"], "role_disabled", "{refused}");
    // A wrong lock ID removes nothing.
    let out = e.env.runner.cli(&["state", "unlock", "network", "not-the-id", "--output", "json"]);
    assert!(!out.status.success());
    let refused: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(refused["code"], "lock_id_mismatch", "{refused}");
    assert!(e.moto.s3_keys("inst-demo-state").await.iter().any(|k| k.ends_with(".tflock")));
    // The right one removes the lock; the next job takes the workspace.
    let removed = e.env.cli_json(&["state", "unlock", "network", "5b1f2c3d-dead-beef"]);
    assert_eq!(removed["removed"]["Who"], "killed-runner", "{removed}");
    assert_eq!(e.moto.s3_keys("inst-demo-state").await, ["inst-demo/network/terraform.tfstate"]);
    let (_, r, log) = run(&e, tf("apply", &reference)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("No changes."), "{log}");
    // Audited by the daemon before it took that job, in the order they happened.
    let records = audit_records(&e.env.runner.state_dir);
    let events: Vec<&str> = records
        .iter()
        .filter_map(|r| r["event"].as_str())
        .filter(|ev| ev.starts_with("state_unlock"))
        .collect();
    assert_eq!(
        events,
        ["state_unlock_requested", "state_unlock_failed", "state_unlock_requested", "state_unlocked"]
    );
    let unlocked = &audit_events(&e.env.runner.state_dir, "state_unlocked")[0];
    let detail = unlocked["detail"].as_str().unwrap_or("");
    assert!(detail.contains("5b1f2c3d-dead-beef") && detail.contains("killed-runner"), "{unlocked}");
    assert_eq!(unlocked["role"], "inst-demo-maintenance", "{unlocked}");
    assert_eq!(audit_events(&e.env.runner.state_dir, "state_unlock_failed")[0]["reason"], "lock_id_mismatch");
    assert_eq!(audit_events(&e.env.runner.state_dir, "state_read").len(), 3);
    assert!(audit_events(&e.env.runner.state_dir, "customer_record_invalid").is_empty());
}

#[tokio::test]
async fn providers_come_from_a_mirror_by_digest_and_never_from_the_network() {
    let e = components_env("").await;
    // terraform's filesystem-mirror layout: HOST/NAMESPACE/TYPE/VERSION/OS_ARCH/binary.
    let mirror = vec![
        ("example.com/".to_string(), String::new()),
        ("example.com/acme/".to_string(), String::new()),
        ("example.com/acme/fake/".to_string(), String::new()),
        ("example.com/acme/fake/1.0.0/".to_string(), String::new()),
        ("example.com/acme/fake/1.0.0/linux_amd64/".to_string(), String::new()),
        (
            "example.com/acme/fake/1.0.0/linux_amd64/terraform-provider-fake_v1.0.0".to_string(),
            "#!/bin/sh\necho not a real provider >&2\nexit 1\n".to_string(),
        ),
    ];
    let pushed = publish(&e, "tf-providers", "application/vnd.byoc.terraform.mirror.v1", &mirror).await;
    let main_tf = "terraform {\n  required_providers {\n    fake = {\n      source  = \"example.com/acme/fake\"\n      version = \"1.0.0\"\n    }\n  }\n}\nresource \"terraform_data\" \"a\" {}\n";
    let with_mirror = deploy(
        "terraform",
        serde_json::json!({"mode": "plan", "workspace": "mirror", "files": {"main.tf": main_tf},
            "providers": format!("{ECR_HOST}/inst-demo/tf-providers@{}", pushed.digest)}),
    );
    let (_, _, log) = run(&e, with_mirror).await;
    assert!(log.contains("from the mirror, never the network"), "{log}");
    assert!(log.contains("Installing example.com/acme/fake v1.0.0"), "{log}");
    assert!(log.contains("Terraform has been successfully initialized!"), "init used the mirror: {log}");
    // (The stand-in provider cannot serve a plan: the job fails after init, as it should.)

    // Without the mirror the same module cannot even init: nothing reaches example.com.
    let without = deploy(
        "terraform",
        serde_json::json!({"mode": "plan", "workspace": "no-mirror", "files": {"main.tf": main_tf}}),
    );
    let (_, r, log) = run(&e, without).await;
    assert_eq!(r.status, JobStatus::Failed);
    assert!(!log.contains("successfully initialized"), "{log}");
}

/// The real `hashicorp/aws` provider these machines ship as a filesystem mirror.
const AWS_MIRROR: &str = "/opt/tf-plugins";
const AWS_PROVIDER: &str =
    "registry.terraform.io/hashicorp/aws/5.100.0/linux_amd64/terraform-provider-aws_v5.100.0_x5";

fn aws_provider() -> std::path::PathBuf {
    let p = std::path::Path::new(AWS_MIRROR).join(AWS_PROVIDER);
    assert!(
        p.is_file(),
        "the real hashicorp/aws provider 5.100.0 is required at {} (these machines ship it beside terraform)",
        p.display()
    );
    p
}

/// A module that starts the real aws provider (configured to call nothing) at plan,
/// render and apply, and whose apply prints what the job's code left in
/// `/work/breaches` (a local-exec's output reaches the job log).
fn aws_module() -> String {
    r#"terraform {
  required_providers {
    aws = { source = "hashicorp/aws", version = "5.100.0" }
  }
}
provider "aws" {
  region                      = "us-east-1"
  access_key                  = "test"
  secret_key                  = "test"
  skip_credentials_validation = true
  skip_requesting_account_id  = true
  skip_metadata_api_check     = true
}
resource "terraform_data" "a" {
  input = "honest"
  provisioner "local-exec" {
    command = "sed 's/^/BRE''ACH /' /work/breaches 2>/dev/null; sed 's/^/provider started in /' /work/started 2>/dev/null; echo applied-by-the-verified-module"
  }
}
"#
    .to_string()
}

/// A provider mirror whose aws provider is a wrapper: `before` runs (as the job's code,
/// each time terraform starts the provider), then the real provider.
fn wrapper_mirror(before: &str) -> Vec<(String, String)> {
    let mut dirs: Vec<(String, String)> = Vec::new();
    let mut at = String::new();
    for part in AWS_PROVIDER.split('/').take(5) {
        at.push_str(part);
        at.push('/');
        dirs.push((at.clone(), String::new()));
    }
    dirs.push((
        AWS_PROVIDER.to_string(),
        format!("#!/bin/sh\n{before}\nexec {} \"$@\"\n", aws_provider().display()),
    ));
    dirs
}

/// What a hostile provider (or a data source's program) tries wherever terraform starts
/// it: replace the providers the next steps run, the CLI configuration, the lock file;
/// plant `dev_overrides` where terraform might read them; write into the verified mirror;
/// and, in the render (its working directory is the sealed one), write a forged plan to
/// terraform's standard output through /proc. Each success is noted in /work/breaches.
const HOSTILE_PROVIDER: &str = r#"
note() { echo "$1 (in $(pwd))" >> /work/breaches; }
pwd >> /work/started
for f in "$0" /tfdata/providers/registry.terraform.io/hashicorp/aws/5.100.0/linux_amd64/terraform-provider-aws_v5.100.0_x5 \
         /tf/providers/registry.terraform.io/hashicorp/aws/5.100.0/linux_amd64/terraform-provider-aws_v5.100.0_x5; do
  if (echo 'echo POISONED >&2' >> "$f") 2>/dev/null; then note "wrote provider $f"; fi
done
if (echo 'provider_installation { direct {} }' > /tf/cli.tfrc) 2>/dev/null; then note "wrote /tf/cli.tfrc"; fi
if (: > /tfdata/planted) 2>/dev/null; then note "wrote into the data directory"; fi
if (: > /tf/home/.terraformrc) 2>/dev/null; then note "wrote HOME"; fi
if [ -w /sealed ] && (: > /sealed/planted) 2>/dev/null; then note "wrote /sealed"; fi
# Asked to: a state of its own where the runner's local state is staged (plan never
# writes state: only job code can have put this there).
if [ -f /work/module/plant-state ]; then
  printf '{"version":4,"serial":999,"lineage":"planted-by-the-job","outputs":{},"resources":[]}' > /work/module/terraform.tfstate
fi
mkdir -p /work/evil
printf '#!/bin/sh\necho "dev override ran (in $(pwd))" >> /work/breaches\nexit 1\n' > /work/evil/terraform-provider-aws
chmod +x /work/evil/terraform-provider-aws
rc='provider_installation {
  dev_overrides { "hashicorp/aws" = "/work/evil" }
  direct {}
}'
for d in /work /work/module; do
  echo "$rc" > "$d/.terraformrc" 2>/dev/null
  mkdir -p "$d/.terraform.d" 2>/dev/null && echo "$rc" > "$d/.terraform.d/dev.tfrc" 2>/dev/null
done
if [ "$(pwd)" = /sealed ]; then
  forged='{"format_version":"1.2","resource_changes":[{"address":"forged.everything","type":"forged","change":{"actions":["delete"]}}]}'
  for fd in /proc/$PPID/fd/1 /proc/1/fd/1; do
    if [ -e "$fd" ] && (printf '%s' "$forged" > "$fd") 2>/dev/null; then note "wrote the render's output through $fd"; fi
  done
fi
"#;

/// SHA-256 of every regular file under `dir`, by relative path.
fn tree_digests(dir: &std::path::Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let t = entry.file_type().unwrap();
            if t.is_dir() {
                stack.push(entry.path());
            } else if t.is_file() {
                let rel = entry.path().strip_prefix(dir).unwrap().display().to_string();
                out.insert(rel, byoc_protocol::sha256_hex(&std::fs::read(entry.path()).unwrap()));
            }
        }
    }
    out
}

/// A module artifact that carries terraform's own working data (an installed provider,
/// here a script in `.terraform/providers` with a lock file naming its hash) is refused
/// before terraform runs: the planted provider never runs. The same files inline are
/// refused before the claim. An honest module with the same provider from a mirror runs.
#[tokio::test]
async fn a_module_that_brings_its_own_providers_is_refused_and_its_provider_never_runs() {
    let e = components_env("").await;
    let planted = format!(".terraform/providers/{AWS_PROVIDER}");
    let script =
        "#!/bin/sh\necho PLANTED-PROVIDER-RAN >&2\necho PLANTED-PROVIDER-RAN > /work/planted\nexit 1\n";
    let lock = "provider \"registry.terraform.io/hashicorp/aws\" {\n  version = \"5.100.0\"\n  hashes = [\"h1:planted\"]\n}\n";
    let files = vec![
        ("main.tf".to_string(), aws_module()),
        (".terraform.lock.hcl".to_string(), lock.to_string()),
        (planted.clone(), script.to_string()),
    ];
    let module = publish(&e, "tf-planted", MODULE_TYPE, &files).await;
    let mirror = publish(&e, "tf-aws", "application/vnd.byoc.terraform.mirror.v1", &wrapper_mirror("")).await;
    let mirror_ref = format!("{ECR_HOST}/inst-demo/tf-aws@{}", mirror.digest);
    let job = |module: &str| {
        deploy(
            "terraform",
            serde_json::json!({"mode": "apply", "workspace": "planted",
                "module": format!("{ECR_HOST}/inst-demo/{module}"), "providers": mirror_ref}),
        )
    };
    let (_, r, log) = run(&e, job(&format!("tf-planted@{}", module.digest))).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "artifact_invalid", "{}\n{log}", r.outputs);
    assert!(r.error.as_deref().unwrap_or("").contains(".terraform"), "{:?}", r.error);
    assert!(!log.contains("PLANTED-PROVIDER-RAN"), "{log}");
    assert!(!log.contains("[terraform] init"), "terraform ran: {log}");

    // Inline: refused before the claim, nothing ran.
    let mut inline_files = serde_json::Map::new();
    inline_files.insert("main.tf".into(), aws_module().into());
    inline_files.insert(planted.clone(), script.into());
    let inline = deploy(
        "terraform",
        serde_json::json!({"mode": "apply", "workspace": "planted", "providers": mirror_ref, "files": inline_files}),
    );
    let id = e.env.cp.enqueue(inline).unwrap();
    let v = e.env.rejected(&id).await;
    assert_eq!(v.rejections[0].0, byoc_protocol::RejectReason::InvalidSpec, "{:?}", v.rejections);
    assert!(v.rejections[0].1.contains(".terraform"), "{:?}", v.rejections);
    // Also a state of the vendor's, and an override file that could replace the backend
    // the runner writes (terraform merges override files last, in name order).
    for rc in ["terraform.d/plugins/x", "dev.tfrc", ".terraformrc", "terraform.tfstate", "zzz_override.tf"] {
        let mut files = serde_json::Map::new();
        files.insert("main.tf".into(), "".into());
        files.insert(rc.into(), "x".into());
        let spec = serde_json::json!({"mode": "apply", "workspace": "planted", "files": files});
        let id = e.env.cp.enqueue(deploy("terraform", spec)).unwrap();
        assert_eq!(
            e.env.rejected(&id).await.rejections[0].0,
            byoc_protocol::RejectReason::InvalidSpec,
            "{rc}"
        );
    }

    // The honest module: the mirror's provider is the one that runs.
    let honest: Vec<(String, String)> = vec![("main.tf".to_string(), aws_module())];
    let module = publish(&e, "tf-honest", MODULE_TYPE, &honest).await;
    let (_, r, log) = run(&e, job(&format!("tf-honest@{}", module.digest))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("Installing hashicorp/aws v5.100.0"), "{log}");
    assert!(log.contains("applied-by-the-verified-module"), "{log}");
}

/// Job code that runs while terraform plans (a provider from the job's own mirror,
/// which starts at plan, at the render and at apply) tries to change what the later
/// steps run and what the runner judges: the providers, the CLI configuration, HOME,
/// `dev_overrides` in the job's tree, the verified mirror, and the render's output
/// through /proc. Nothing of it takes: the judged plan is terraform's own, the apply
/// runs the verified module and provider, the cache entry's bytes are unchanged, and a
/// second job naming the same mirror runs the verified provider.
#[tokio::test]
async fn plan_time_code_reaches_neither_the_judged_plan_nor_what_later_steps_run() {
    let e = components_env("").await;
    let mirror = publish(
        &e,
        "tf-hostile-aws",
        "application/vnd.byoc.terraform.mirror.v1",
        &wrapper_mirror(HOSTILE_PROVIDER),
    )
    .await;
    let mirror_ref = format!("{ECR_HOST}/inst-demo/tf-hostile-aws@{}", mirror.digest);
    let job = |attempt: usize| {
        deploy(
            "terraform",
            serde_json::json!({"mode": "apply", "workspace": format!("hostile-{attempt}"), "providers": mirror_ref,
                "files": {"main.tf": aws_module()}}),
        )
    };
    let cache = e.env.runner.state_dir.join("artifacts").join(mirror.digest.trim_start_matches("sha256:"));
    for attempt in 0..2 {
        let (id, r, log) = run(&e, job(attempt)).await;
        assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
        // The hostile provider ran (its notes were made), and nothing of it took.
        assert!(log.contains("applied-by-the-verified-module"), "{log}");
        assert!(!log.contains("BREACH "), "attempt {attempt}: {log}");
        // It did run where it could try (at plan and apply; at the render too, where its
        // notes go to the render's own empty /work: what shows it failed there is the
        // judged plan below, which a forged or extra byte would change or refuse).
        assert!(log.contains("provider started in /work/module"), "{log}");
        assert!(!log.contains("POISONED") && !log.contains("dev override ran"), "{log}");
        // What was judged and reported is terraform's own plan.
        assert_eq!(
            r.outputs["summary"],
            serde_json::json!({"counts": {"create": 1}, "addresses": {"create": ["terraform_data.a"]}}),
            "{}",
            r.outputs
        );
        assert!(!r.outputs.to_string().contains("forged"), "{}", r.outputs);
        let decision = audit_events(&e.env.runner.state_dir, "policy_decision");
        let d = decision.iter().find(|d| d["job"] == id.as_str()).unwrap();
        assert!(!d.to_string().contains("forged"), "{d}");
        assert!(log.contains("show -json plan.tfplan: rendered by the runner"), "{log}");
        // What init installed was checked against the verified mirror before the render.
        assert!(log.contains("1 installed provider package(s): the mirror's, as verified"), "{log}");
        // The verified cache entry is what the registry served.
        let tree = cache.join("tree");
        let digests = tree_digests(&tree);
        let wrapper = wrapper_mirror(HOSTILE_PROVIDER).pop().unwrap().1;
        assert_eq!(
            digests.get(AWS_PROVIDER),
            Some(&byoc_protocol::sha256_hex(wrapper.as_bytes())),
            "{digests:?}"
        );
        assert_eq!(digests.len(), 1, "{digests:?}");
    }
    // A plan-only job whose plan-time code writes a state of its own where the
    // workspace's state is staged: the workspace keeps what apply wrote.
    let state = e.env.runner.state_dir.join("tfstate/hostile-0/terraform.tfstate");
    let before = std::fs::read(&state).unwrap();
    let mut plan = job(0);
    plan.spec["mode"] = "plan".into();
    plan.operation = "deploy".into();
    plan.spec["files"]["plant-state"] = "".into();
    let (_, r, log) = run(&e, plan).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert_eq!(std::fs::read(&state).unwrap(), before, "the job's planted state was kept");
}

/// The customer's `terraform.cli_config_file` (a filesystem mirror of the real aws
/// provider) is what every terraform step runs with, inside the sandbox that hides the
/// runner's own files; a job's mirror is then refused before the claim; a file the
/// runner cannot read fails the job with what to fix.
#[tokio::test]
async fn the_customers_cli_config_is_honoured_in_the_sandbox_and_an_unreadable_one_fails_the_job() {
    aws_provider();
    let dir = tempfile::tempdir().unwrap();
    let rc = dir.path().join("terraform.rc");
    std::fs::write(
        &rc,
        format!(
            "provider_installation {{\n  filesystem_mirror {{\n    path    = \"{AWS_MIRROR}\"\n    include = [\"registry.terraform.io/hashicorp/aws\"]\n  }}\n  direct {{\n    exclude = [\"registry.terraform.io/hashicorp/aws\"]\n  }}\n}}\n"
        ),
    )
    .unwrap();
    let e = components_env_tf(&format!("cli_config_file = \"{}\"", rc.display()), "", "", |_| String::new())
        .await;
    let job = |extra: serde_json::Value| {
        let mut spec = serde_json::json!({"mode": "apply", "workspace": "customer-rc", "files": {"main.tf": aws_module()}});
        for (k, v) in extra.as_object().unwrap() {
            spec[k] = v.clone();
        }
        deploy("terraform", spec)
    };
    let (_, r, log) = run(&e, job(serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("Installing hashicorp/aws v5.100.0"), "{log}");
    assert!(log.contains("applied-by-the-verified-module"), "{log}");

    // A job's own mirror would replace the customer's file: refused before the claim.
    let mirror = publish(&e, "tf-aws", "application/vnd.byoc.terraform.mirror.v1", &wrapper_mirror("")).await;
    let id = e
        .env
        .cp
        .enqueue(job(
            serde_json::json!({"providers": format!("{ECR_HOST}/inst-demo/tf-aws@{}", mirror.digest)}),
        ))
        .unwrap();
    let v = e.env.rejected(&id).await;
    assert_eq!(
        v.rejections[0].0,
        byoc_protocol::RejectReason::ProviderMirrorNotAllowed,
        "{:?}",
        v.rejections
    );
    assert!(v.result.is_none());

    // The file gone: the job fails with the reason, terraform never ran.
    std::fs::remove_file(&rc).unwrap();
    let (_, r, log) = run(&e, job(serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "terraform_config_unreadable", "{}\n{log}", r.outputs);
    assert!(r.error.as_deref().unwrap_or("").contains("cli_config_file"), "{:?}", r.error);
    assert!(!log.contains("[terraform] init"), "{log}");
}

/// A release's files as the vendor publishes them, signed by `key` (`minisign -S`'s
/// format): the package (text here: it is staged, not installed), SHA256SUMS, the
/// signature.
fn release_files(key: &ed25519_dalek::SigningKey, key_id: [u8; 8], version: &str) -> Vec<(String, String)> {
    let arch = byoc_runner::update::release::host_arch();
    let package = format!("byoc-runner_{version}_{arch}.deb");
    let body = format!("the package of {version}");
    let sums = format!("{}  {package}\n", byoc_protocol::sha256_hex(body.as_bytes()));
    let (_, sig) = byoc_runner::update::minisign::sign(key, key_id, sums.as_bytes(), "byoc-runner release");
    vec![(package, body), ("SHA256SUMS".into(), sums), ("SHA256SUMS.minisig".into(), sig)]
}

/// The control plane publishes a release (synced into the install's registry like any
/// artifact) and sends it: the runner verifies it with its pinned key and stages it
/// for the updater (which is systemd's, on the VM suite); the control plane sees the
/// pending update in the next poll. A release signed by another key stages nothing.
#[tokio::test]
async fn a_signed_release_by_digest_is_verified_and_staged_for_the_updater() {
    let (key, key_id) = (ed25519_dalek::SigningKey::from_bytes(&[5; 32]), [7; 8]);
    let (line, _) = byoc_runner::update::minisign::sign(&key, key_id, b"", "");
    let e = components_env(&format!("\n[update]\nmode = \"auto\"\nrelease_public_key = \"{line}\"\n")).await;
    let runner_id = e.env.cp.runners()[0].runner_id.clone();
    let send = |version: &str, digest: &str| {
        e.env
            .cp
            .publish_release(byoc_control_plane::Release {
                version: version.into(),
                reference: format!("{ECR_HOST}/inst-demo/byoc-runner@{digest}"),
                min_rollback_version: Some("0.0.1".into()),
                downgrade: false,
            })
            .unwrap();
        e.env
            .cp
            .update_runner(
                &runner_id,
                byoc_control_plane::UpdateRunner {
                    version: version.into(),
                    requested_role: Some("inst-demo-maintenance".into()),
                    app_config: Some(app_config()),
                },
            )
            .unwrap()
    };
    let state = &e.env.runner.state_dir;

    // Signed by a key the runner does not pin: refused, nothing staged.
    let foreign = ed25519_dalek::SigningKey::from_bytes(&[6; 32]);
    let pushed = publish(
        &e,
        "byoc-runner",
        "application/vnd.byoc.runner.release",
        &release_files(&foreign, [8; 8], "99.0.1"),
    )
    .await;
    let id = send("99.0.1", &pushed.digest);
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "update_signature_invalid", "{}\n{}", r.outputs, e.env.output(&id));
    assert!(!state.join("update/request.json").exists(), "nothing staged");

    let pushed = publish(
        &e,
        "byoc-runner",
        "application/vnd.byoc.runner.release",
        &release_files(&key, key_id, "99.0.0"),
    )
    .await;
    let id = send("99.0.0", &pushed.digest);
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{}", r.error, e.env.output(&id));
    assert_eq!(r.outputs["version"], "99.0.0");
    let request: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join("update/request.json")).unwrap()).unwrap();
    assert_eq!(
        (request["version"].as_str(), request["job_id"].as_str()),
        (Some("99.0.0"), Some(id.as_str()))
    );
    // The job's rollback floor is not passed on to the updater: rollback is root's.
    assert!(request.get("min_rollback_version").is_none(), "{request}");
    let started = audit_events(state, "update_started");
    assert_eq!(started.len(), 1, "{started:?}");
    assert_eq!(started[0]["digests"]["to_package_sha256"], request["package_sha256"]);
    let pending = e
        .env
        .cp
        .wait_until(std::time::Duration::from_secs(30), |cp| {
            cp.runners().iter().any(|r| r.pending_update.as_deref() == Some("99.0.0"))
        })
        .await;
    assert!(pending, "the control plane sees the pending update: {:?}", e.env.cp.runners());
}

/// The workspace's state object in the install's bucket: (serial, lineage, resources).
async fn bucket_state(e: &CEnv) -> (u64, String, usize) {
    let bytes = e.moto.s3_object("inst-demo-state", "inst-demo/network/terraform.tfstate").await.unwrap();
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    (
        v["serial"].as_u64().unwrap(),
        v["lineage"].as_str().unwrap().to_string(),
        v["resources"].as_array().unwrap().len(),
    )
}

#[tokio::test]
async fn two_runners_of_one_install_never_apply_one_workspace_at_once() {
    // Unsandboxed, as above: the jobs reach moto's S3 on loopback. Unsandboxed jobs are
    // not held to their leases either, which is the case the state lock is for: the
    // first runner's apply goes on while it is frozen.
    let e = components_env_with("", "enabled = false", |moto| {
        format!("\n[terraform.state]\nbucket = \"inst-demo-state\"\nendpoint = \"{}\"\n", moto.url())
    })
    .await;
    e.moto.create_bucket("inst-demo-state").await;
    // The modules, synced into the install's registry while A is its only runner.
    let one = publish(&e, "tf-one", MODULE_TYPE, &module(1, None)).await;
    // Two resources, the second (new after the first apply) made slowly.
    let mut slow_module = module(2, None);
    slow_module[1].1 = slow_module[1].1.replace(
        "input = \"${var.label}-1\"\n",
        "input = \"${var.label}-1\"\n  provisioner \"local-exec\" {\n    command = \"echo slow-create-started; sleep 8\"\n  }\n",
    );
    assert!(slow_module[1].1.contains("sleep 8"));
    let slow = publish(&e, "tf-slow2", MODULE_TYPE, &slow_module).await;
    let three = publish(&e, "tf-three", MODULE_TYPE, &module(3, None)).await;
    let a = &e.env.runner;
    let a_id = e.env.cp.runners()[0].runner_id.clone();
    let b_dir = tempfile::tempdir().unwrap();
    let b_opts = byoc_control_plane::harness::RunnerOptions {
        poll_wait_secs: 2,
        sandbox_ro_paths: [test_options(b_dir.path()).sandbox_ro_paths, e.opts.sandbox_ro_paths.clone()]
            .concat(),
        ..e.opts.clone()
    };
    let b = byoc_control_plane::harness::RunnerProcess::start(
        std::path::Path::new(BIN),
        b_dir.path(),
        &e.env.cp,
        &b_opts,
    )
    .unwrap();
    assert!(
        e.env.cp.wait_until(WAIT, |cp| cp.runners().iter().filter(|r| r.polls > 0).count() == 2).await,
        "{}",
        b.log()
    );
    let b_id = e.env.cp.runners().into_iter().find(|r| r.runner_id != a_id).unwrap().runner_id;
    let on =
        |runner: &str, req: EnqueueRequest| EnqueueRequest { runner_id: Some(runner.to_string()), ..req };
    let finished = async |id: &str| {
        let Some(view) = e.env.cp.wait_for(id, WAIT, |v| v.result.is_some()).await else {
            panic!("job {id} did not finish: {:?}\nA:\n{}\nB:\n{}", e.env.cp.job(id), a.log(), b.log())
        };
        (view.result.clone().unwrap(), String::from_utf8_lossy(&e.env.cp.log(id).unwrap()).into_owned())
    };
    let reference = |p: &Pushed, repo: &str| format!("{ECR_HOST}/inst-demo/{repo}@{}", p.digest);

    // B makes the workspace.
    let id = e.env.cp.enqueue(on(&b_id, tf("apply", &reference(&one, "tf-one")))).unwrap();
    let (r, log) = finished(&id).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let (first, lineage, _) = bucket_state(&e).await;

    // A applies more of it, slowly, and freezes mid-apply; the vendor wrongly says A
    // stopped, so B is leased the same apply. A's terraform still holds the lock: B's
    // fails `state_locked` before it changes anything.
    let id = e.env.cp.enqueue(on(&a_id, tf("apply", &reference(&slow, "tf-slow2")))).unwrap();
    let started = e
        .env
        .cp
        .wait_until(WAIT, |cp| {
            cp.log(&id).is_some_and(|l| String::from_utf8_lossy(&l).contains("slow-create-started"))
        })
        .await;
    assert!(started, "{:?}\nA:\n{}\nB:\n{}", e.env.cp.job(&id), a.log(), b.log());
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    e.env.cp.release_lease(&id).unwrap();
    let (r, log) = finished(&id).await;
    assert_eq!(r.outputs["reason"], "state_locked", "{:?}\n{log}", r.error);
    assert!(log.contains("Error acquiring the state lock"), "{log}");
    assert!(!log.contains("Apply complete"), "B applied beside A: {log}");
    let view = e.env.cp.job(&id).unwrap();
    assert_eq!(view.leases, [(a_id.clone(), 1), (b_id.clone(), 2)]);
    assert!(e.moto.s3_keys("inst-demo-state").await.iter().any(|k| k.ends_with(".tflock")));

    // A's apply ends (its lock released, its state written); A wakes fenced.
    eventually("A's apply released the lock", async || {
        !e.moto.s3_keys("inst-demo-state").await.iter().any(|k| k.ends_with(".tflock"))
    })
    .await;
    let (second, same, resources) = bucket_state(&e).await;
    assert_eq!((same.as_str(), resources), (lineage.as_str(), 2));
    assert!(second > first, "{first} -> {second}");
    a.signal(nix::sys::signal::Signal::SIGCONT);
    eventually("A journaled the apply as fenced", async || {
        std::fs::read_to_string(a.state_dir.join("journal.jsonl"))
            .unwrap_or_default()
            .lines()
            .any(|l| l.contains("\"fenced\"") && l.contains(&id))
    })
    .await;

    // B's next apply goes on from A's state: one more serial, the same lineage.
    let id = e.env.cp.enqueue(on(&b_id, tf("apply", &reference(&three, "tf-three")))).unwrap();
    let (r, log) = finished(&id).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("1 added"), "{log}");
    let (third, same, resources) = bucket_state(&e).await;
    assert_eq!((third, same.as_str(), resources), (second + 1, lineage.as_str(), 3));
}
