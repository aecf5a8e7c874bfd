//! `kubernetes` jobs end to end: the real runner and control plane, moto for the job's
//! role, and a fake Kubernetes API server (no real one can be had offline) whose
//! recorded requests show what the executor sent: server-side apply patches with our
//! field manager, prune deletes, readiness reads.
#![allow(clippy::unwrap_used)]

mod common;

use byoc_control_plane::EnqueueRequest;
use byoc_control_plane::kube_api::FakeKubeApi;
use byoc_control_plane::moto::MotoServer;
use byoc_protocol::JobStatus;
use common::roles::*;
use common::*;

const TOKEN: &str = "cluster-token-9d8e7f6a5b4c3d2e";

struct KubeEnv {
    env: Env,
    _moto: MotoServer,
    api: FakeKubeApi,
    _policies: tempfile::TempDir,
}

async fn kube_env() -> KubeEnv {
    kube_env_with("").await
}

async fn kube_env_with(extra: &str) -> KubeEnv {
    let (moto, api) = tokio::join!(moto_with_stack_owned(), FakeKubeApi::start());
    let mut opts = role_options(&moto, "");
    let policies = tempfile::tempdir().unwrap();
    opts.extra.push_str(&format!("\n[policy]\ndir = \"{}\"\n{extra}\n", policies.path().display()));
    opts.extra.push_str(&api.runner_config());
    KubeEnv { env: env_with(opts).await, _moto: moto, api, _policies: policies }
}

async fn moto_with_stack_owned() -> MotoServer {
    moto_with_stack(&base_params()).await
}

fn deployment(name: &str) -> serde_json::Value {
    serde_json::json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": 2, "template": {"spec": {"containers": [
            {"name": name, "image": "registry.example/acme/api:1", "resources": {"limits": {"cpu": "1", "memory": "256Mi"}}}]}}}})
}

fn service(ty: &str) -> serde_json::Value {
    serde_json::json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api"}, "spec": {"type": ty}})
}

fn config_map(name: &str) -> serde_json::Value {
    serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": "v"}})
}

fn job(api: &FakeKubeApi, action: &str, manifests: Vec<serde_json::Value>, wait: u64) -> EnqueueRequest {
    // The operation each action's effect runs as.
    let operation = match action {
        "delete" => "teardown",
        "drift" => "drift",
        _ => "deploy",
    };
    let mut req = role_job("component", operation, "inst-demo-maintenance", named("api"), "");
    req.kind = "kubernetes".into();
    req.spec = serde_json::json!({"action": action, "component": "api", "namespace": "acme",
        "manifests": manifests, "kubeconfig": api.kubeconfig(TOKEN), "wait_secs": wait});
    req.timeout_secs = 120;
    req
}

async fn run(e: &KubeEnv, req: EnqueueRequest) -> (byoc_protocol::JobResult, String) {
    let id = e.env.cp.enqueue(req).unwrap();
    let r = e.env.finished(&id).await.result.unwrap();
    (r, e.env.output(&id))
}

const DEPLOY: &str = "/apis/apps/v1/namespaces/acme/deployments/api";
const SVC: &str = "/api/v1/namespaces/acme/services/api";
const EXTRA: &str = "/api/v1/namespaces/acme/configmaps/extra";
const INVENTORY: &str = "/api/v1/namespaces/acme/configmaps/byoc-inventory-api";

#[tokio::test]
async fn apply_is_server_side_with_our_field_manager_then_prunes_what_is_gone() {
    let e = kube_env().await;
    let (r, log) =
        run(&e, job(&e.api, "apply", vec![deployment("api"), service("ClusterIP"), config_map("extra")], 30))
            .await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let patches: Vec<_> = e.api.requests().into_iter().filter(|q| q.method == "PATCH").collect();
    let paths: Vec<&str> = patches.iter().map(|q| q.path.as_str()).collect();
    assert_eq!(paths, vec![DEPLOY, SVC, EXTRA, INVENTORY]);
    for p in &patches {
        assert_eq!(p.content_type, "application/apply-patch+yaml", "{}", p.path);
        assert!(
            p.query.contains("fieldManager=byoc-runner") && p.query.contains("force=true"),
            "{}",
            p.query
        );
        assert_eq!(p.authorization, format!("Bearer {TOKEN}"));
    }
    // Namespaced objects that named no namespace got the job's.
    assert_eq!(patches[0].body["metadata"]["namespace"], "acme");
    assert!(e.api.requests().iter().any(|q| q.method == "GET" && q.path == DEPLOY), "readiness was read");
    assert_eq!(r.outputs["ready"], serde_json::json!(["Deployment/acme/api"]));
    assert_eq!(r.outputs["verdict"], "allow");
    let inventory = e.api.object(INVENTORY).unwrap();
    assert!(inventory["data"]["objects"].as_str().unwrap().contains("v1|ConfigMap|acme|extra"));
    assert!(!log.contains(TOKEN) && !serde_json::to_string(&r).unwrap().contains(TOKEN));

    // Again without the ConfigMap: it is pruned (deleted), the rest re-applied.
    let before = e.api.requests().len();
    let (r, log) = run(&e, job(&e.api, "apply", vec![deployment("api"), service("ClusterIP")], 30)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let later = &e.api.requests()[before..];
    let deletes: Vec<&str> = later.iter().filter(|q| q.method == "DELETE").map(|q| q.path.as_str()).collect();
    assert_eq!(deletes, vec![EXTRA]);
    assert_eq!(r.outputs["pruned"], serde_json::json!(["ConfigMap/acme/extra"]));
    assert!(e.api.object(EXTRA).is_none());
    assert!(!e.api.object(INVENTORY).unwrap()["data"]["objects"].as_str().unwrap().contains("extra"));
}

#[tokio::test]
async fn denied_manifests_never_reach_the_cluster() {
    let e = kube_env().await;
    let (r, log) = run(&e, job(&e.api, "apply", vec![deployment("api"), service("LoadBalancer")], 30)).await;
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "policy_denied", "{log}");
    assert!(r.error.unwrap().contains("public_ingress@Service/acme/api"));
    assert!(e.api.requests().is_empty(), "nothing may be sent: {:?}", e.api.requests());
}

#[tokio::test]
async fn teardown_deletes_everything_applied_and_the_inventory() {
    let e = kube_env().await;
    let (r, _) = run(&e, job(&e.api, "apply", vec![deployment("api"), config_map("extra")], 30)).await;
    assert_eq!(r.status, JobStatus::Succeeded);
    let (r, log) = run(&e, job(&e.api, "delete", vec![], 30)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let deletes: Vec<String> =
        e.api.requests().into_iter().filter(|q| q.method == "DELETE").map(|q| q.path).collect();
    assert_eq!(deletes, vec![EXTRA.to_string(), DEPLOY.to_string(), INVENTORY.to_string()]);
    assert!(e.api.object(DEPLOY).is_none() && e.api.object(INVENTORY).is_none());
}

#[tokio::test]
async fn a_workload_that_never_becomes_ready_fails_the_job() {
    let e = kube_env().await;
    e.api.hold_back("api");
    let (r, log) = run(&e, job(&e.api, "apply", vec![deployment("api")], 2)).await;
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "not_ready", "{:?}\n{log}", r.error);
    assert!(r.error.unwrap().contains("Deployment/acme/api was not ready within 2s"));
}

#[tokio::test]
async fn an_eks_cluster_is_reached_with_a_token_signed_by_the_jobs_role() {
    use base64::Engine as _;
    let e = kube_env().await;
    let mut req = job(&e.api, "apply", vec![config_map("settings")], 30);
    req.spec.as_object_mut().unwrap().remove("kubeconfig");
    let ca = base64::engine::general_purpose::STANDARD.encode(&e.api.ca_pem);
    req.spec["eks"] =
        serde_json::json!({"cluster": "acme-prod", "server": e.api.url(), "certificate_authority_data": ca});
    let (r, log) = run(&e, req).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let auth = e.api.requests()[0].authorization.clone();
    let b64 = auth.strip_prefix("Bearer k8s-aws-v1.").unwrap_or_else(|| panic!("not an EKS token: {auth}"));
    let url =
        String::from_utf8(base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(b64).unwrap()).unwrap();
    assert!(url.starts_with("https://sts.us-east-1.amazonaws.com/?Action=GetCallerIdentity"), "{url}");
    assert!(
        url.contains("X-Amz-SignedHeaders=host%3Bx-k8s-aws-id") && url.contains("X-Amz-Security-Token="),
        "{url}"
    );
    assert!(!log.contains(b64) && !serde_json::to_string(&r).unwrap().contains(b64));
    // Without a role there are no credentials to sign with.
    let mut req = job(&e.api, "apply", vec![config_map("settings")], 30);
    req.spec.as_object_mut().unwrap().remove("kubeconfig");
    req.spec["eks"] = serde_json::json!({"cluster": "acme-prod", "server": e.api.url()});
    req.requested_role = None;
    req.app_config = None;
    req.role_request = None;
    let (r, _) = run(&e, req).await;
    assert_eq!(r.outputs["reason"], "cluster_credentials", "{:?}", r.error);
}

const CLUSTER_POLICY: &str = "/apis/kyverno.io/v1/clusterpolicies/require-requests";
const CLUSTER_POLICY_INVENTORY: &str =
    "/api/v1/namespaces/kube-system/configmaps/byoc-inventory-cluster-policies";

/// The app's `kubernetes_cluster` (Kyverno) policies are applied into the cluster with
/// our field manager and recorded in their inventory (audited with their digest),
/// left alone while unchanged, and removed when the sandbox is deprovisioned.
#[tokio::test]
async fn cluster_policies_land_in_the_cluster_and_leave_with_the_sandbox() {
    // The customer switched deprovision on for this install.
    let mut params = base_params();
    params.insert("EnableDeprovisionRole", "true");
    let (moto, api) = tokio::join!(moto_with_stack(&params), FakeKubeApi::start());
    let mut opts = role_options(&moto, "");
    let policies = tempfile::tempdir().unwrap();
    opts.extra.push_str(&format!("\n[policy]\ndir = \"{}\"\n", policies.path().display()));
    opts.extra.push_str(&api.runner_config());
    let e = KubeEnv { env: env_with(opts).await, _moto: moto, api, _policies: policies };
    let kyverno = "apiVersion: kyverno.io/v1\nkind: ClusterPolicy\nmetadata:\n  name: require-requests\nspec:\n  validationFailureAction: Enforce\n  rules: []\n";
    let with_cluster_policies = |mut req: EnqueueRequest| {
        let app = req.app_config.as_mut().unwrap();
        app.policies_toml = Some(
            "[[policy]]\ntype = \"kubernetes_cluster\"\ncontents = \"./policies/require-requests.yaml\"\n"
                .into(),
        );
        app.files = [("policies/require-requests.yaml".to_string(), kyverno.to_string())].into();
        req
    };
    // A sandbox provision: the cluster policies are applied.
    let mut provision = with_cluster_policies(job(&e.api, "apply", vec![config_map("sandbox-settings")], 30));
    provision.entity = "sandbox".into();
    provision.operation = "provision".into();
    provision.requested_role = Some("inst-demo-provision".into());
    provision.role_request = Some(named("sandbox"));
    let (r, log) = run(&e, provision).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let patch =
        e.api.requests().into_iter().find(|q| q.method == "PATCH" && q.path == CLUSTER_POLICY).unwrap();
    assert!(patch.query.contains("fieldManager=byoc-runner"), "{}", patch.query);
    assert_eq!(e.api.object(CLUSTER_POLICY).unwrap()["spec"]["validationFailureAction"], "Enforce");
    let inv = e.api.object(CLUSTER_POLICY_INVENTORY).unwrap();
    assert!(inv["data"]["objects"].as_str().unwrap().contains("ClusterPolicy||require-requests"), "{inv}");
    let audited = audit_events(&e.env.runner.state_dir, "cluster_policies_applied");
    let digest = format!("sha256:{}", byoc_protocol::sha256_hex(kyverno.as_bytes()));
    assert_eq!(audited[0]["digests"]["policy:vendor/policies/require-requests.yaml"], digest.as_str());

    // A component deploy with the same policies: nothing to do for them.
    let before = e.api.requests().len();
    let (r, _) = run(&e, with_cluster_policies(job(&e.api, "apply", vec![config_map("extra")], 30))).await;
    assert_eq!(r.status, JobStatus::Succeeded);
    assert_eq!(
        r.outputs["cluster_policies"]["unchanged"].as_str().map(|d| d.starts_with("sha256:")),
        Some(true)
    );
    assert!(
        !e.api.requests()[before..].iter().any(|q| q.path == CLUSTER_POLICY),
        "an unchanged policy is not re-sent"
    );

    // The sandbox's deprovision removes them.
    let mut deprovision = with_cluster_policies(job(&e.api, "delete", vec![], 30));
    deprovision.entity = "sandbox".into();
    deprovision.operation = "deprovision".into();
    deprovision.requested_role = Some("inst-demo-deprovision".into());
    deprovision.role_request = Some(named("sandbox"));
    deprovision.spec["component"] = "sandbox".into();
    let id = e.env.cp.enqueue(deprovision).unwrap();
    let v = e.env.cp.wait_for(&id, WAIT, |v| v.result.is_some() || !v.rejections.is_empty()).await.unwrap();
    assert!(v.rejections.is_empty(), "deprovision refused: {:?}", v.rejections);
    let r = v.result.unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{}", r.error, e.env.output(&id));
    assert!(e.api.requests().iter().any(|q| q.method == "DELETE" && q.path == CLUSTER_POLICY));
    assert!(e.api.object(CLUSTER_POLICY).is_none());
    assert!(e.api.object(CLUSTER_POLICY_INVENTORY).is_none());
    assert_eq!(audit_events(&e.env.runner.state_dir, "cluster_policies_removed").len(), 1);
}

/// A vendor policy (nuon convention) that keeps volume claims: a teardown and a prune
/// that would delete one are reviewed as DELETE first, denied, and delete nothing.
#[tokio::test]
async fn deletions_are_reviewed_before_anything_is_deleted() {
    let e = kube_env().await;
    let keep_volumes = "package nuon\nimport rego.v1\n\ndeny contains msg if {\n  input.review.operation == \"DELETE\"\n  input.review.kind.kind == \"PersistentVolumeClaim\"\n  msg := sprintf(\"%s holds data: not deleted by a deploy\", [input.review.object.metadata.name])\n}\n";
    let with_policy = |mut req: EnqueueRequest| {
        req.app_config.as_mut().unwrap().policies.insert(
            "keep-volumes.rego".into(),
            byoc_protocol::VendorPolicy { rego: keep_volumes.into(), enforcement: None },
        );
        req
    };
    let pvc = serde_json::json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}});
    let (r, log) = run(&e, with_policy(job(&e.api, "apply", vec![config_map("extra"), pvc], 30))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    const PVC: &str = "/api/v1/namespaces/acme/persistentvolumeclaims/data";
    assert!(e.api.object(PVC).is_some());

    // An apply without the claim would prune it: denied before anything is applied.
    let before = e.api.requests().len();
    let (r, log) = run(&e, with_policy(job(&e.api, "apply", vec![config_map("extra")], 30))).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "policy_denied");
    assert!(log.contains("data holds data: not deleted by a deploy"), "{log}");
    let after: Vec<_> =
        e.api.requests()[before..].iter().filter(|q| q.method != "GET").map(|q| q.path.clone()).collect();
    assert!(after.is_empty(), "nothing may change: {after:?}");

    // A teardown: denied, nothing deleted.
    let (r, log) = run(&e, with_policy(job(&e.api, "delete", vec![], 30))).await;
    assert_eq!(r.status, JobStatus::Failed, "{log}");
    assert_eq!(r.outputs["reason"], "policy_denied");
    assert!(!e.api.requests().iter().any(|q| q.method == "DELETE"), "nothing deleted");
    assert!(e.api.object(PVC).is_some() && e.api.object(EXTRA).is_some());
    let decisions = audit_events(&e.env.runner.state_dir, "policy_decision");
    assert!(decisions.iter().any(|d| d["digests"].get("deletions").is_some()), "deletion decisions audited");
}

/// `on = "plan"` approvals for kubernetes: nothing reaches the cluster until the
/// customer approves the decided manifests; a denial sends nothing at all.
#[tokio::test]
async fn manifests_wait_for_approval_and_a_denial_sends_nothing() {
    let e = kube_env_with(
        "[[guardrails.approval_rule]]\nname = \"cluster\"\nkinds = [\"kubernetes\"]\non = \"plan\"\n",
    )
    .await;
    let id =
        e.env.cp.enqueue(job(&e.api, "apply", vec![deployment("api"), service("ClusterIP")], 30)).unwrap();
    let r = e.env.awaiting_approval(&id).await;
    assert_eq!(
        r["summary"]["addresses"]["apply"],
        serde_json::json!(["Deployment/acme/api", "Service/acme/api"]),
        "{r}"
    );
    assert!(e.api.requests().is_empty(), "sent before the approval: {:?}", e.api.requests());
    let out = e.env.runner.cli(&["deny", &id, "--reason", "freeze"]);
    assert!(out.status.success(), "{out:?}");
    let r = e.env.finished(&id).await.result.unwrap();
    assert_eq!(r.status, JobStatus::Failed);
    assert_eq!(r.outputs["reason"], "approval_denied", "{}", r.outputs);
    assert!(e.api.requests().is_empty(), "nothing may be sent: {:?}", e.api.requests());
}

/// A drift check of the deployed component: the fake cluster's objects edited and
/// deleted by hand in between; paths reported, never values; GETs only.
#[tokio::test]
async fn a_drift_check_finds_live_edits_and_deletions_and_changes_nothing() {
    let e = kube_env().await;
    let manifests = vec![deployment("api"), service("ClusterIP"), config_map("extra")];
    let drift = |api: &FakeKubeApi| {
        let mut req = job(api, "drift", manifests.clone(), 30);
        req.operation = "drift".into();
        req
    };
    // Never deployed: said so.
    let (r, log) = run(&e, drift(&e.api)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    assert_eq!(r.outputs["drift"]["verdict"], "not_deployed", "{}", r.outputs);
    let (r, log) = run(&e, job(&e.api, "apply", manifests.clone(), 30)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);

    // As deployed (the server's status and generation are not drift): clean.
    let (r, log) = run(&e, drift(&e.api)).await;
    assert_eq!(r.outputs["drift"]["verdict"], "clean", "{}\n{log}", r.outputs);

    // Someone scales the deployment, swaps its image and deletes the config map.
    let sent = e.api.requests().len();
    assert!(e.api.edit(DEPLOY, |d| {
        d["spec"]["replicas"] = 9.into();
        d["spec"]["template"]["spec"]["containers"][0]["image"] = "evil.example/miner:latest".into();
    }));
    assert!(e.api.remove(EXTRA).is_some());
    let (r, log) = run(&e, drift(&e.api)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{:?}\n{log}", r.error);
    let d = &r.outputs["drift"];
    assert_eq!(d["verdict"], "drifted", "{}\n{log}", r.outputs);
    assert_eq!(d["kind"], "kubernetes");
    let drifted = d["drifted"].as_array().unwrap();
    assert_eq!(drifted.len(), 2, "{drifted:?}");
    assert_eq!(drifted[0]["address"], "Deployment/acme/api");
    assert_eq!(
        drifted[0]["paths"],
        serde_json::json!(["spec.replicas", "spec.template.spec.containers[0].image"])
    );
    assert_eq!(drifted[1]["address"], "ConfigMap/acme/extra");
    assert_eq!(drifted[1]["actions"], serde_json::json!(["delete"]));
    assert_eq!(d["would_change"]["counts"], serde_json::json!({"create": 1, "update": 1}));
    assert!(!r.outputs.to_string().contains("miner"), "a value reached the result: {}", r.outputs);
    // Reads only: nothing was written to the cluster, and the edit is still there.
    let after: Vec<_> = e.api.requests().into_iter().skip(sent).collect();
    assert!(after.iter().all(|q| q.method == "GET"), "{after:?}");
    assert_eq!(e.api.object(DEPLOY).unwrap()["spec"]["replicas"], 9);

    // An edit the policies forbid: the service opened to the internet by hand.
    assert!(e.api.edit(SVC, |s| s["spec"]["type"] = "LoadBalancer".into()));
    let (r, log) = run(&e, drift(&e.api)).await;
    assert_eq!(r.outputs["drift"]["verdict"], "violating", "{}\n{log}", r.outputs);
    assert!(r.outputs["violations"].to_string().contains("public_ingress"), "{}", r.outputs);

    // The customer sees the latest check; every check audited; a drift action under
    // another operation is refused.
    let listed = e.env.cli_json(&["drift"]);
    let api = listed.as_array().unwrap().iter().find(|c| c["workspace"] == "api").expect("listed");
    assert_eq!((api["verdict"].as_str(), api["kind"].as_str()), (Some("violating"), Some("kubernetes")));
    let checked = audit_events(&e.env.dir.path().join("state"), "drift_checked");
    assert_eq!(checked.len(), 4, "{checked:?}");
    let mut under_deploy = job(&e.api, "drift", manifests.clone(), 30);
    under_deploy.operation = "deploy".into();
    let id = e.env.cp.enqueue(under_deploy).unwrap();
    let v = e.env.rejected(&id).await;
    assert_eq!(v.rejections[0].0, byoc_protocol::RejectReason::InvalidSpec, "{:?}", v.rejections);
}
