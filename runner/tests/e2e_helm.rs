//! `helm` jobs end to end: the real runner (sandboxed), the reference control plane,
//! moto for the job's role, and a stand-in `helm` (`tests/fixtures/helm/helm`) that
//! follows the CLI contract and reports every call in the job log.
#![allow(clippy::unwrap_used)]

mod common;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::moto::MotoServer;
use byoc_protocol::JobStatus;
use common::roles::*;
use common::*;

struct HelmEnv {
    env: Env,
    _moto: MotoServer,
    _tools: tempfile::TempDir,
    _policies: tempfile::TempDir,
}

async fn helm_env() -> HelmEnv {
    helm_env_with("").await
}

async fn helm_env_with(extra: &str) -> HelmEnv {
    let moto = moto_with_stack(&base_params()).await;
    let policies = tempfile::tempdir().unwrap();
    std::fs::write(
        policies.path().join("policies.toml"),
        "[params]\napproved_registries = [\"123456789012.dkr.ecr.us-east-1.amazonaws.com/\"]\n",
    )
    .unwrap();
    let (tools, helm) = stand_in("helm");
    let mut opts = role_options(&moto, "");
    opts.extra.push_str(&format!(
        "\n[helm]\nbinary = \"{}\"\n\n[policy]\ndir = \"{}\"\n{extra}\n",
        helm.display(),
        policies.path().display()
    ));
    opts.sandbox_ro_paths.push(tools.path().to_path_buf());
    HelmEnv { env: env_with(opts).await, _moto: moto, _tools: tools, _policies: policies }
}

const IMAGE: &str = "123456789012.dkr.ecr.us-east-1.amazonaws.com/acme/api@sha256:c47e51d395243e4e9f3eba53a895914fb027ed030c37670b9bb7aaa4a0cb57b1";

fn rendered(image: &str, service_type: &str) -> String {
    format!(
        "---\n# Source: api/templates/deployment.yaml\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: api\n  namespace: acme\nspec:\n  replicas: 2\n  template:\n    spec:\n      containers:\n        - name: api\n          image: {image}\n          resources:\n            limits: {{cpu: 500m, memory: 256Mi}}\n---\n# Source: api/templates/service.yaml\napiVersion: v1\nkind: Service\nmetadata:\n  name: api\n  namespace: acme\nspec:\n  type: {service_type}\n"
    )
}

fn job(action: &str, files: &[(&str, String)], extra: serde_json::Value) -> EnqueueRequest {
    let mut spec = serde_json::json!({"action": action, "release": "api", "namespace": "acme",
        "values": {"replicas": 2}, "secret_values": {"dbPassword": "pg-secret-7f3a9c"}});
    if !files.is_empty() {
        spec["files"] = files
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(v.clone())))
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
    for (k, v) in extra.as_object().into_iter().flatten() {
        spec[k] = v.clone();
    }
    // The operation each action's effect runs as.
    let operation = match action {
        "uninstall" => "teardown",
        "drift" => "drift",
        _ => "deploy",
    };
    let mut req = role_job("component", operation, "inst-demo-maintenance", named("api"), "");
    req.kind = "helm".into();
    req.spec = spec;
    req.timeout_secs = 300;
    req
}

fn chart(rendered: String) -> Vec<(&'static str, String)> {
    vec![
        ("Chart.yaml", "apiVersion: v2\nname: api\nversion: 1.2.3\n".into()),
        ("fake-rendered.yaml", rendered),
    ]
}

async fn run(e: &HelmEnv, req: EnqueueRequest) -> (byoc_protocol::JobResult, String) {
    let id = e.env.cp.enqueue(req).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    let log = e.env.output(&id);
    (r, log)
}

fn audit(e: &HelmEnv, event: &str) -> Vec<serde_json::Value> {
    audit_events(&e.env.runner.state_dir, event)
}

#[tokio::test]
async fn an_allowed_release_is_deployed_atomically_with_its_status_and_diff() {
    let e = helm_env().await;
    let mut files = chart(rendered(IMAGE, "ClusterIP"));
    // What the previous release deployed: the service was a NodePort, and a ConfigMap.
    files.push((
        "fake-deployed.yaml",
        format!(
            "{}---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: old, namespace: acme}}\n",
            rendered(IMAGE, "NodePort")
        ),
    ));
    let (r, log) = run(&e, job("upgrade", &files, serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    // Rendered with the cluster's view, with the job's values...
    let dry = log.lines().find(|l| l.starts_with("fake-helm: upgrade --dry-run=server")).unwrap_or_default();
    for flag in ["--install api ./chart", "-f values.json", "-f secret-values.json", "--namespace acme"] {
        assert!(dry.contains(flag), "{flag} missing: {dry}");
    }
    // ... and what was judged installed: the runner's chart, nothing left to render.
    let up = log.lines().find(|l| l.starts_with("fake-helm: upgrade --install")).unwrap_or_default();
    for flag in
        ["api /sealed/chart", "--reset-values", "--atomic", "--wait", "--timeout 300s", "--namespace acme"]
    {
        assert!(up.contains(flag), "{flag} missing: {up}");
    }
    assert!(!up.contains("values.json"), "{up}");
    assert_eq!(r.outputs["verdict"], "allow");
    assert_eq!(r.outputs["status"]["revision"], 1);
    assert_eq!(r.outputs["status"]["status"], "deployed");
    assert_eq!(r.outputs["diff"]["changed"], serde_json::json!(["Service/acme/api"]));
    assert_eq!(r.outputs["diff"]["removed"], serde_json::json!(["ConfigMap/acme/old"]));
    assert_eq!(r.outputs["diff"]["unchanged"], 1);
    // Secret values and the release's values never reach the result or the log.
    let result = serde_json::to_string(&r).unwrap();
    assert!(!result.contains("pg-secret-7f3a9c") && !result.contains("values-are-not-reported"), "{result}");
    assert!(!log.contains("pg-secret-7f3a9c"), "{log}");
    let d = &audit(&e, "policy_decision")[0];
    assert!(d["detail"].as_str().unwrap().starts_with("allow"));
    assert!(d["digests"]["manifests"].as_str().unwrap().starts_with("sha256:"));
}

#[tokio::test]
async fn a_denied_release_is_never_deployed() {
    let e = helm_env().await;
    let (r, log) = run(
        &e,
        job(
            "upgrade",
            &chart(rendered("docker.io/library/nginx:1.27", "LoadBalancer")),
            serde_json::json!({}),
        ),
    )
    .await;
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "policy_denied");
    let err = r.error.unwrap();
    assert!(
        err.contains("public_ingress@Service/acme/api")
            && err.contains("approved_registries@Deployment/acme/api"),
        "{err}"
    );
    assert!(log.contains("fake-helm: upgrade --dry-run=server"), "{log}");
    assert!(!log.contains("fake-helm: upgrade --install"), "upgrade must not run:\n{log}");
}

/// A release that has lived two revisions, the first with an internet-facing service.
fn history() -> Vec<(&'static str, String)> {
    vec![
        ("fake-state/revision", "2\n".into()),
        ("fake-state/rev-1.yaml", rendered(IMAGE, "LoadBalancer")),
        ("fake-state/rev-2.yaml", rendered(IMAGE, "ClusterIP")),
        ("fake-state/deployed.yaml", rendered(IMAGE, "ClusterIP")),
    ]
}

#[tokio::test]
async fn uninstall_and_rollback() {
    let e = helm_env().await;
    let (r, log) = run(&e, job("uninstall", &[], serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{log}");
    assert!(log.contains("fake-helm: uninstall api --wait --timeout 300s --namespace acme"), "{log}");
    assert_eq!(r.outputs["uninstalled"], true);
    let (r, log) = run(&e, job("rollback", &history(), serde_json::json!({"revision": 2}))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("fake-helm: get manifest api --revision 2"), "{log}");
    assert!(log.contains("fake-helm: rollback api 2 --wait"), "{log}");
    assert_eq!(r.outputs["revision_restored"], 2);
    assert_eq!(r.outputs["status"]["revision"], 3);
}

/// A rollback restores a revision's stored manifests: judged first, and denied, never
/// run. Revision 0 is the one before the latest, from the release's history.
#[tokio::test]
async fn a_rollback_is_judged_on_what_it_restores() {
    let e = helm_env().await;
    let (r, log) = run(&e, job("rollback", &history(), serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "policy_denied", "{:?}", r.error);
    assert!(log.contains("fake-helm: history api"), "{log}");
    assert!(log.contains("fake-helm: get manifest api --revision 1"), "{log}");
    assert!(r.error.as_deref().unwrap_or("").contains("public_ingress@Service/acme/api"), "{:?}", r.error);
    assert!(!log.contains("fake-helm: rollback"), "{log}");
    // A release with nothing before its latest revision: refused, nothing run.
    let mut first_only = history();
    first_only.retain(|(k, _)| !k.ends_with("rev-2.yaml"));
    first_only[0].1 = "1\n".into();
    let (r, log) = run(&e, job("rollback", &first_only, serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert!(r.error.as_deref().unwrap_or("").contains("no revision before"), "{:?}", r.error);
}

/// What helm renders with the cluster's view is what is judged, and exactly that is
/// installed: a chart whose `lookup` turns a private service public in the cluster is
/// denied though `helm template` would look harmless; a chart that would render
/// differently at apply time (rand, now, lookup again) gets the judged bytes installed.
#[tokio::test]
async fn the_cluster_view_is_judged_and_exactly_the_judged_bytes_are_installed() {
    let e = helm_env().await;
    // helm template says ClusterIP; with the cluster's answers it is a LoadBalancer.
    let mut files = chart(rendered(IMAGE, "ClusterIP"));
    files.push(("fake-server-rendered.yaml", rendered(IMAGE, "LoadBalancer")));
    let (r, log) = run(&e, job("upgrade", &files, serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert!(r.error.as_deref().unwrap_or("").contains("public_ingress@Service/acme/api"), "{:?}", r.error);
    assert!(!log.contains("fake-helm: upgrade --install"), "{log}");
    // Judged ClusterIP; a second render at apply time would make it a LoadBalancer.
    let mut files = chart(rendered(IMAGE, "ClusterIP"));
    files.push(("fake-apply-rendered.yaml", rendered(IMAGE, "LoadBalancer")));
    let (r, log) = run(&e, job("upgrade", &files, serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let deployed = log
        .lines()
        .find(|l| l.starts_with("fake-helm: deployed objects:"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(deployed.contains("type: ClusterIP") && !deployed.contains("LoadBalancer"), "{deployed}");
}

/// A chart's `crds/` are judged with its manifests and installed from the judged chart;
/// a policy that refuses them stops the release.
#[tokio::test]
async fn a_charts_crds_are_judged_and_installed_as_judged() {
    let e = helm_env().await;
    const CRD: &str = "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata:\n  name: widgets.example.com\nspec:\n  group: example.com\n";
    let mut files = chart(rendered(IMAGE, "ClusterIP"));
    files.push(("crds/widgets.yaml", CRD.into()));
    let (r, log) = run(&e, job("upgrade", &files, serde_json::json!({}))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(
        r.outputs["diff"]["added"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "CustomResourceDefinition/-/widgets.example.com"),
        "{}",
        r.outputs
    );
    assert!(log.contains("fake-helm: installed CRDs: widgets.yaml"), "{log}");
    let no_crds = "package nuon\nimport rego.v1\n\ndeny contains msg if {\n  input.review.kind.kind == \"CustomResourceDefinition\"\n  msg := sprintf(\"%s: no new APIs\", [input.review.object.metadata.name])\n}\n";
    let mut req = job("upgrade", &files, serde_json::json!({}));
    req.app_config.as_mut().unwrap().policies.insert(
        "no-crds.rego".into(),
        byoc_protocol::VendorPolicy { rego: no_crds.into(), enforcement: None },
    );
    let (r, log) = run(&e, req).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert!(log.contains("widgets.example.com: no new APIs"), "{log}");
    assert!(!log.contains("fake-helm: upgrade --install"), "{log}");
}

/// An uninstall deletes what the release deployed: reviewed as DELETE first by the
/// policies that know the operation (nuon), and denied, it is never run.
#[tokio::test]
async fn an_uninstall_is_reviewed_before_it_runs() {
    let e = helm_env().await;
    let keep_public = "package nuon\nimport rego.v1\n\ndeny contains msg if {\n  input.review.operation == \"DELETE\"\n  input.review.kind.kind == \"Service\"\n  input.review.object.spec.type == \"LoadBalancer\"\n  msg := sprintf(\"%s serves customers: remove it in a window\", [input.review.object.metadata.name])\n}\n";
    let mut req =
        job("uninstall", &[("fake-deployed.yaml", rendered(IMAGE, "LoadBalancer"))], serde_json::json!({}));
    req.app_config.as_mut().unwrap().policies.insert(
        "keep-public.rego".into(),
        byoc_protocol::VendorPolicy { rego: keep_public.into(), enforcement: None },
    );
    let (r, log) = run(&e, req).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "policy_denied");
    assert!(
        log.contains(
            "[policy] DENY vendor/keep-public.rego [keep-public] Service/acme/api: api serves customers"
        ),
        "{log}"
    );
    assert!(!log.contains("fake-helm: uninstall"), "uninstall must not run:\n{log}");
    // The same release with an internal service: the built-in pack does not judge
    // deletions, the vendor's policy has nothing to say, the uninstall runs.
    let (r, log) = run(
        &e,
        job("uninstall", &[("fake-deployed.yaml", rendered(IMAGE, "ClusterIP"))], serde_json::json!({})),
    )
    .await;
    assert_eq!(r.status, JobStatus::Succeeded, "{log}");
    assert!(log.contains("fake-helm: uninstall api"), "{log}");
}

/// `on = "plan"` approvals for helm: the release's rendered manifests wait for the
/// customer between the ALLOW decision and `helm upgrade`, bound to their digest.
#[tokio::test]
async fn an_upgrade_waits_for_approval_of_its_manifests_then_runs() {
    let e = helm_env_with(
        "[[guardrails.approval_rule]]\nname = \"releases\"\nkinds = [\"helm\"]\non = \"plan\"\n",
    )
    .await;
    let id = e
        .env
        .cp
        .enqueue(job("upgrade", &chart(rendered(IMAGE, "ClusterIP")), serde_json::json!({})))
        .unwrap();
    let r = e.env.awaiting_approval(&id).await;
    assert_eq!(r["summary"]["counts"]["add"], 2, "{r}");
    assert!(!r["plan_digest"].as_str().unwrap().is_empty(), "{r}");
    assert!(!e.env.output(&id).contains("fake-helm: upgrade --install"), "upgraded before the approval");
    let out = e.env.runner.cli(&["approve", &id, "--reason", "release train 12"]);
    assert!(out.status.success(), "{out:?}");
    let r = e.env.finished(&id).await.result.unwrap();
    let log = e.env.output(&id);
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert!(log.contains("[approval]") && log.contains("approved by"), "{log}");
}

/// A drift check of a release: what `helm get manifest` says it deployed against the
/// live objects of a fake API server (the stand-in helm reaches no cluster, so the
/// test puts there what a real upgrade would have created), edited by hand in between.
#[tokio::test]
async fn a_drift_check_finds_live_edits_against_the_releases_manifest() {
    use byoc_control_plane::kube_api::FakeKubeApi;
    let api = FakeKubeApi::start().await;
    let e = helm_env_with(&api.runner_config()).await;
    const DEPLOY: &str = "/apis/apps/v1/namespaces/acme/deployments/api";
    const SVC: &str = "/api/v1/namespaces/acme/services/api";
    let drift = |deployed: Option<String>| {
        let files: Vec<(&str, String)> = deployed.into_iter().map(|d| ("fake-deployed.yaml", d)).collect();
        let mut req =
            job("drift", &files, serde_json::json!({"kubeconfig": api.kubeconfig("helm-token-5e6f7a8b")}));
        req.operation = "drift".into();
        req
    };
    // No release: never deployed.
    let (r, log) = run(&e, drift(None)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert_eq!(r.outputs["drift"]["verdict"], "not_deployed", "{}\n{log}", r.outputs);

    // What the release deployed, live in the cluster with the server's additions.
    let manifest = rendered(IMAGE, "ClusterIP");
    let docs = [
        serde_json::json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "api", "namespace": "acme"},
            "spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "api", "image": IMAGE,
                "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}}}]}}}}),
        serde_json::json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api", "namespace": "acme"},
            "spec": {"type": "ClusterIP"}}),
    ];
    let mut live_deploy = docs[0].clone();
    live_deploy["metadata"]["uid"] = "u-1".into();
    live_deploy["status"] = serde_json::json!({"readyReplicas": 2});
    api.put(DEPLOY, live_deploy);
    api.put(SVC, docs[1].clone());
    let (r, log) = run(&e, drift(Some(manifest.clone()))).await;
    assert_eq!(r.outputs["drift"]["verdict"], "clean", "{}\n{log}", r.outputs);
    assert!(log.contains("get manifest"), "{log}");

    // Edited by hand: the image swapped, the service opened to the internet.
    let sent = api.requests().len();
    assert!(api.edit(DEPLOY, |d| d["spec"]["template"]["spec"]["containers"][0]["image"] =
        "evil.example/x:1".into()));
    assert!(api.edit(SVC, |s| s["spec"]["type"] = "LoadBalancer".into()));
    let (r, log) = run(&e, drift(Some(manifest))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let d = &r.outputs["drift"];
    assert_eq!(
        (d["kind"].as_str(), d["verdict"].as_str()),
        (Some("helm"), Some("violating")),
        "{}",
        r.outputs
    );
    let paths: Vec<&serde_json::Value> =
        d["drifted"].as_array().unwrap().iter().map(|x| &x["paths"]).collect();
    assert_eq!(
        paths,
        [&serde_json::json!(["spec.template.spec.containers[0].image"]), &serde_json::json!(["spec.type"])]
    );
    assert!(r.outputs["violations"].to_string().contains("public_ingress"), "{}", r.outputs);
    assert!(!r.outputs.to_string().contains("evil.example"), "a value reached the result");
    assert!(api.requests().iter().skip(sent).all(|q| q.method == "GET"));
    assert!(!log.contains("upgrade"), "{log}");
    assert_eq!(audit(&e, "drift_checked").len(), 3);
    let listed = e.env.cli_json(&["drift"]);
    assert!(
        listed.as_array().unwrap().iter().any(|c| c["kind"] == "helm" && c["workspace"] == "api"),
        "{listed}"
    );
}
