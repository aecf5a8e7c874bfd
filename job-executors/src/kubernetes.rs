//! `kubernetes`: decide, then server-side apply with our own field manager, prune what
//! a previous apply of the same component created and this one no longer has (an
//! inventory ConfigMap per component), wait for readiness (Deployments, StatefulSets,
//! Jobs), delete on teardown. Policy sees the manifests before anything is sent.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams};
use serde::Deserialize;

use crate::{ExecContext, ExecFuture, ExecOutcome, Executor, JobStatus};

/// Our field manager: what we apply is ours, and conflicts with other managers are
/// taken over (`force`), as `kubectl apply --server-side --force-conflicts` does.
pub const FIELD_MANAGER: &str = "byoc-runner";
const INVENTORY_PREFIX: &str = "byoc-inventory-";
const POLL: Duration = Duration::from_millis(500);

/// Kinds that live outside namespaces (the ones a component plausibly ships).
const CLUSTER_SCOPED: [&str; 12] = [
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "StorageClass",
    "PersistentVolume",
    "PriorityClass",
    "IngressClass",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
    // Kyverno's cluster-wide policies (the app's `kubernetes_cluster` policies).
    "ClusterPolicy",
    "ClusterCleanupPolicy",
];

/// Where the inventory of the app's cluster policies lives (they are cluster-scoped;
/// the inventory ConfigMap needs a namespace every cluster has).
const CLUSTER_POLICY_INVENTORY: &str = "byoc-inventory-cluster-policies";
const CLUSTER_POLICY_NAMESPACE: &str = "kube-system";
const DIGEST_ANNOTATION: &str = "byoc-runner/policies-digest";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Action {
    Apply,
    Delete,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    action: Action,
    /// Names the inventory (`[a-z0-9-]`).
    component: String,
    /// Default namespace for namespaced objects that name none.
    namespace: String,
    /// Manifests as objects, or as multi-document YAML.
    #[serde(default)]
    manifests: Vec<serde_json::Value>,
    #[serde(default)]
    manifests_yaml: Option<String>,
    /// A kubeconfig (secret), or `eks` to derive the credentials from the job's role.
    #[serde(default)]
    kubeconfig: Option<String>,
    #[serde(default)]
    eks: Option<Eks>,
    #[serde(default = "default_wait")]
    wait_secs: u64,
}

fn default_wait() -> u64 {
    300
}

/// An EKS cluster reached with a token signed by the job's role session.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Eks {
    cluster: String,
    /// The cluster's API endpoint.
    server: String,
    /// Base64 PEM of the cluster's CA (as `DescribeCluster` gives it).
    #[serde(default)]
    certificate_authority_data: Option<String>,
}

/// One object's identity: what the inventory records and prune deletes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct ObjRef {
    api_version: String,
    kind: String,
    namespace: Option<String>,
    name: String,
}

impl ObjRef {
    fn encode(&self) -> String {
        format!(
            "{}|{}|{}|{}",
            self.api_version,
            self.kind,
            self.namespace.as_deref().unwrap_or(""),
            self.name
        )
    }
    fn decode(s: &str) -> Option<ObjRef> {
        let mut p = s.split('|');
        let (v, k, ns, n) = (p.next()?, p.next()?, p.next()?, p.next()?);
        Some(ObjRef {
            api_version: v.into(),
            kind: k.into(),
            namespace: (!ns.is_empty()).then(|| ns.to_string()),
            name: n.into(),
        })
    }
    fn display(&self) -> String {
        format!("{}/{}/{}", self.kind, self.namespace.as_deref().unwrap_or("-"), self.name)
    }
    fn api_resource(&self) -> ApiResource {
        let (group, version) = self.api_version.rsplit_once('/').unwrap_or(("", &self.api_version));
        let gvk = GroupVersionKind::gvk(group, version, &self.kind);
        ApiResource::from_gvk_with_plural(&gvk, &plural(&self.kind))
    }
}

/// Kubernetes' resource names: lower-case kind, pluralised the way the built-in
/// resources are (Ingress → ingresses, NetworkPolicy → networkpolicies).
fn plural(kind: &str) -> String {
    let k = kind.to_ascii_lowercase();
    if k.ends_with('s') || k.ends_with("ch") || k.ends_with("sh") || k.ends_with('x') {
        format!("{k}es")
    } else if let Some(stem) = k.strip_suffix('y').filter(|s| !s.ends_with(['a', 'e', 'i', 'o', 'u'])) {
        format!("{stem}ies")
    } else {
        format!("{k}s")
    }
}

pub struct Kubernetes {
    spec: Spec,
    objects: Vec<(ObjRef, serde_json::Value)>,
}

impl Kubernetes {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, String> {
        let s: Spec = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
        let label = |v: &str| {
            !v.is_empty()
                && v.len() <= 63
                && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        };
        if !label(&s.component) || !label(&s.namespace) {
            return Err("component and namespace: DNS labels ([a-z0-9-], 1-63)".into());
        }
        match (&s.kubeconfig, &s.eks) {
            (Some(_), None) => {}
            (None, Some(e)) if !e.cluster.is_empty() && e.server.starts_with("http") => {}
            (None, Some(_)) => return Err("eks: cluster and an https:// server are required".into()),
            _ => return Err("exactly one of kubeconfig or eks".into()),
        }
        let mut manifests = s.manifests.clone();
        if let Some(y) = &s.manifests_yaml {
            manifests.extend(crate::helm::parse_manifests(y)?);
        }
        if manifests.is_empty() && s.action == Action::Apply {
            return Err("apply needs manifests".into());
        }
        let mut objects = Vec::new();
        for (i, m) in manifests.into_iter().enumerate() {
            let get = |k: &str| m.get(k).and_then(|v| v.as_str()).map(str::to_string);
            let (Some(api_version), Some(kind)) = (get("apiVersion"), get("kind")) else {
                return Err(format!("manifest {}: apiVersion and kind are required", i + 1));
            };
            let Some(name) = m["metadata"]["name"].as_str().map(str::to_string) else {
                return Err(format!("manifest {} ({kind}): metadata.name is required", i + 1));
            };
            let namespace = if CLUSTER_SCOPED.contains(&kind.as_str()) {
                None
            } else {
                Some(m["metadata"]["namespace"].as_str().unwrap_or(&s.namespace).to_string())
            };
            let r = ObjRef { api_version, kind, namespace, name };
            if objects.iter().any(|(o, _)| *o == r) {
                return Err(format!("{} appears twice", r.display()));
            }
            // The namespace it will land in, before policy sees it (addresses match).
            let mut m = m;
            if let Some(ns) = &r.namespace {
                m["metadata"]["namespace"] = ns.clone().into();
            }
            objects.push((r, m));
        }
        Ok(Kubernetes { spec: s, objects })
    }

    /// The job's kubeconfig, or one for the EKS cluster with a token signed by the
    /// job's role session (`aws eks get-token`).
    fn kubeconfig(&self, ctx: &ExecContext<'_>) -> Result<String, String> {
        if let Some(k) = &self.spec.kubeconfig {
            return Ok(k.clone());
        }
        let Some(eks) = &self.spec.eks else { return Err("no cluster credentials".into()) };
        let env =
            &ctx.credentials.as_ref().ok_or("eks needs the job's role (set requested_role)")?.static_env;
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let (Some(ak), Some(sk), Some(region)) =
            (get("AWS_ACCESS_KEY_ID"), get("AWS_SECRET_ACCESS_KEY"), get("AWS_REGION"))
        else {
            return Err("the job's role session has no keys or region".into());
        };
        let keys = crate::eks::Keys {
            access_key_id: ak,
            secret_access_key: sk,
            session_token: get("AWS_SESSION_TOKEN"),
        };
        let token = crate::eks::token(&keys, region, &eks.cluster, std::time::SystemTime::now())?;
        let ca = eks
            .certificate_authority_data
            .as_ref()
            .map(|c| format!("    certificate-authority-data: {c}\n"))
            .unwrap_or_default();
        Ok(format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: eks\n  cluster:\n    server: {}\n{ca}contexts:\n- name: eks\n  context:\n    cluster: eks\n    user: role\ncurrent-context: eks\nusers:\n- name: role\n  user:\n    token: {token}\n",
            eks.server
        ))
    }

    fn inventory_name(&self) -> String {
        format!("{INVENTORY_PREFIX}{}", self.spec.component)
    }
}

fn api(client: &kube::Client, r: &ObjRef) -> Api<DynamicObject> {
    let ar = r.api_resource();
    match &r.namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    }
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

impl Kubernetes {
    async fn go(&self, ctx: &mut ExecContext<'_>) -> ExecOutcome {
        let failed = crate::terraform::failed;
        // Policy first: nothing reaches the cluster before the decision.
        let mut decided = serde_json::Value::Null;
        if self.spec.action == Action::Apply {
            let manifests: Vec<&serde_json::Value> = self.objects.iter().map(|(_, m)| m).collect();
            let bytes = serde_json::to_vec(&manifests).unwrap_or_default();
            let subject = crate::policy_gate::Subject {
                source: byoc_policy::Source::Kubernetes,
                // An apply (server-side apply creates or updates).
                admission: byoc_policy::Admission::Update,
                name: "manifests",
                digest: None,
            };
            let d = match crate::policy_gate::decide(ctx, subject, &bytes).await {
                Ok(d) => d,
                Err(e) => return failed(crate::policy_gate::UNAVAILABLE, e, serde_json::Value::Null),
            };
            decided = serde_json::json!({"verdict": d.verdict, "manifests_digest": d.input_digest});
            if d.verdict == byoc_policy::Verdict::Deny {
                return failed(
                    "policy_denied",
                    format!("policy denied the manifests: {}", d.denials().join(", ")),
                    decided,
                );
            }
        }
        let kubeconfig = match self.kubeconfig(ctx) {
            Ok(k) => k,
            Err(e) => return failed("cluster_credentials", e, decided),
        };
        let client = match client(&kubeconfig).await {
            Ok(c) => c,
            Err(e) => return failed("cluster_unreachable", e, decided),
        };
        // Readiness is waited for up to wait_secs (and never past the job's timeout).
        let deadline = Instant::now() + ctx.timeout.min(Duration::from_secs(self.spec.wait_secs));
        let cancel = ctx.cancel.clone();
        // The app's cluster policies: kept in step by every apply, removed when the
        // sandbox is deprovisioned.
        let cluster = ctx.policy.as_ref().map(|p| (p.cluster_policies.clone(), p.operation.clone()));
        let work = async {
            let mut out = match self.spec.action {
                Action::Apply => self.apply(ctx, &client, deadline).await?,
                Action::Delete => self.delete(ctx, &client).await?,
            };
            if let Some((policies, operation)) = &cluster {
                let remove = self.spec.action == Action::Delete && operation == "sandbox.deprovision";
                if self.spec.action == Action::Apply || remove {
                    let synced = sync_cluster_policies(ctx, &client, policies, remove).await?;
                    if let Some(o) = out.as_object_mut() {
                        o.insert("cluster_policies".into(), synced);
                    }
                }
            }
            Ok(out)
        };
        let result = tokio::select! {
            r = work => r,
            _ = cancel.cancelled() => return ExecOutcome { status: JobStatus::Cancelled, exit_code: None, error: Some("job was cancelled".into()), outputs: decided },
        };
        match result {
            Ok(mut out) => {
                if let (Some(o), Some(d)) = (out.as_object_mut(), decided.as_object()) {
                    o.extend(d.clone());
                }
                ExecOutcome { status: JobStatus::Succeeded, exit_code: Some(0), error: None, outputs: out }
            }
            Err((reason, e)) => failed(reason, e, decided),
        }
    }

    async fn inventory(&self, client: &kube::Client) -> Result<Vec<ObjRef>, (&'static str, String)> {
        let cms: Api<DynamicObject> = api(client, &self.inventory_ref());
        match cms.get_opt(&self.inventory_name()).await {
            Ok(Some(cm)) => Ok(cm.data["data"]["objects"]
                .as_str()
                .unwrap_or("")
                .lines()
                .filter_map(ObjRef::decode)
                .collect()),
            Ok(None) => Ok(vec![]),
            Err(e) => Err(("cluster_error", format!("reading the inventory {}: {e}", self.inventory_name()))),
        }
    }

    fn inventory_ref(&self) -> ObjRef {
        ObjRef {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            namespace: Some(self.spec.namespace.clone()),
            name: self.inventory_name(),
        }
    }

    async fn apply(
        &self,
        ctx: &mut ExecContext<'_>,
        client: &kube::Client,
        deadline: Instant,
    ) -> Result<serde_json::Value, (&'static str, String)> {
        let previous = self.inventory(client).await?;
        // What this apply would prune is deleted: decided as DELETE reviews first, so a
        // denial leaves the cluster untouched.
        let current: BTreeSet<&ObjRef> = self.objects.iter().map(|(r, _)| r).collect();
        let to_prune: Vec<ObjRef> = previous.iter().filter(|r| !current.contains(r)).cloned().collect();
        review_deletions(ctx, client, &to_prune, &[]).await?;
        let pp = PatchParams::apply(FIELD_MANAGER).force();
        let mut applied = Vec::new();
        for (r, m) in &self.objects {
            api(client, r)
                .patch(&r.name, &pp, &Patch::Apply(m))
                .await
                .map_err(|e| ("apply_failed", format!("applying {}: {e}", r.display())))?;
            let _ = ctx.output.write(format!("[kubernetes] applied {}\n", r.display()).as_bytes());
            applied.push(r.display());
        }
        // What the previous apply created and this one no longer has.
        let mut pruned = Vec::new();
        for r in &to_prune {
            match api(client, r).delete(&r.name, &DeleteParams::background()).await {
                Ok(_) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(("prune_failed", format!("pruning {}: {e}", r.display()))),
            }
            let _ = ctx.output.write(format!("[kubernetes] pruned {}\n", r.display()).as_bytes());
            pruned.push(r.display());
        }
        self.write_inventory(client, &pp).await?;
        let ready = self.wait_ready(ctx, client, deadline).await?;
        Ok(
            serde_json::json!({"applied": applied, "pruned": pruned, "ready": ready, "field_manager": FIELD_MANAGER}),
        )
    }

    async fn write_inventory(
        &self,
        client: &kube::Client,
        pp: &PatchParams,
    ) -> Result<(), (&'static str, String)> {
        let lines: Vec<String> = self.objects.iter().map(|(r, _)| r.encode()).collect();
        let cm = serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": self.inventory_name(), "namespace": self.spec.namespace,
                         "labels": {"app.kubernetes.io/managed-by": FIELD_MANAGER}},
            "data": {"objects": lines.join("\n")}
        });
        api(client, &self.inventory_ref())
            .patch(&self.inventory_name(), pp, &Patch::Apply(&cm))
            .await
            .map(|_| ())
            .map_err(|e| ("apply_failed", format!("writing the inventory: {e}")))
    }

    /// Deployments, StatefulSets and Jobs until ready (or failed, or the deadline).
    async fn wait_ready(
        &self,
        ctx: &mut ExecContext<'_>,
        client: &kube::Client,
        deadline: Instant,
    ) -> Result<Vec<String>, (&'static str, String)> {
        let mut ready = Vec::new();
        for (r, _) in self
            .objects
            .iter()
            .filter(|(r, _)| matches!(r.kind.as_str(), "Deployment" | "StatefulSet" | "Job"))
        {
            loop {
                let obj = api(client, r)
                    .get_opt(&r.name)
                    .await
                    .map_err(|e| ("cluster_error", format!("reading {}: {e}", r.display())))?;
                match obj.as_ref().map(|o| readiness(&r.kind, o)) {
                    Some(Ok(true)) => break,
                    Some(Err(why)) => return Err(("not_ready", format!("{} failed: {why}", r.display()))),
                    _ => {}
                }
                if Instant::now() >= deadline {
                    return Err((
                        "not_ready",
                        format!("{} was not ready within {}s", r.display(), self.spec.wait_secs),
                    ));
                }
                tokio::time::sleep(POLL).await;
            }
            let _ = ctx.output.write(format!("[kubernetes] ready {}\n", r.display()).as_bytes());
            ready.push(r.display());
        }
        Ok(ready)
    }

    async fn delete(
        &self,
        ctx: &mut ExecContext<'_>,
        client: &kube::Client,
    ) -> Result<serde_json::Value, (&'static str, String)> {
        let mut targets = self.inventory(client).await?;
        for (r, _) in &self.objects {
            if !targets.contains(r) {
                targets.push(r.clone());
            }
        }
        // Every object about to be deleted, reviewed as DELETE before any is.
        review_deletions(ctx, client, &targets, &self.objects).await?;
        let mut deleted = Vec::new();
        for r in targets.iter().rev() {
            match api(client, r).delete(&r.name, &DeleteParams::background()).await {
                Ok(_) => deleted.push(r.display()),
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(("delete_failed", format!("deleting {}: {e}", r.display()))),
            }
            let _ = ctx.output.write(format!("[kubernetes] deleted {}\n", r.display()).as_bytes());
        }
        match api(client, &self.inventory_ref())
            .delete(&self.inventory_name(), &DeleteParams::background())
            .await
        {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(("delete_failed", format!("deleting the inventory: {e}"))),
        }
        Ok(serde_json::json!({"deleted": deleted}))
    }
}

/// Decide about deleting `refs` (their bodies from `known`, else as the cluster has
/// them; gone ones need no decision): one DELETE admission review per object, audited.
async fn review_deletions(
    ctx: &mut ExecContext<'_>,
    client: &kube::Client,
    refs: &[ObjRef],
    known: &[(ObjRef, serde_json::Value)],
) -> Result<(), (&'static str, String)> {
    let mut bodies = Vec::new();
    for r in refs {
        if let Some((_, m)) = known.iter().find(|(k, _)| k == r) {
            bodies.push(m.clone());
            continue;
        }
        match api(client, r).get_opt(&r.name).await {
            Ok(Some(obj)) => {
                let mut v = serde_json::to_value(&obj).unwrap_or_default();
                if let Some(o) = v.as_object_mut() {
                    o.insert("apiVersion".into(), r.api_version.clone().into());
                    o.insert("kind".into(), r.kind.clone().into());
                }
                bodies.push(v);
            }
            Ok(None) => {}
            Err(e) => {
                return Err(("cluster_error", format!("reading {} before deleting it: {e}", r.display())));
            }
        }
    }
    if bodies.is_empty() {
        return Ok(());
    }
    let bytes = serde_json::to_vec(&bodies).unwrap_or_default();
    let subject = crate::policy_gate::Subject {
        source: byoc_policy::Source::Kubernetes,
        admission: byoc_policy::Admission::Delete,
        name: "deletions",
        digest: None,
    };
    let d = crate::policy_gate::decide(ctx, subject, &bytes)
        .await
        .map_err(|e| (crate::policy_gate::UNAVAILABLE, e))?;
    if d.verdict == byoc_policy::Verdict::Deny {
        return Err(("policy_denied", format!("policy denied deleting: {}", d.denials().join(", "))));
    }
    Ok(())
}

/// The inventory ConfigMap of the app's cluster policies.
fn cluster_inventory_ref() -> ObjRef {
    ObjRef {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        namespace: Some(CLUSTER_POLICY_NAMESPACE.into()),
        name: CLUSTER_POLICY_INVENTORY.into(),
    }
}

/// Apply the app's cluster policies (Kyverno objects) with our field manager, prune the
/// ones no longer declared, and record them in their inventory with the digest of what
/// was applied; skip all of it when nothing changed. With `remove`, delete every one
/// the inventory records. Audited with each policy's digest.
async fn sync_cluster_policies(
    ctx: &mut ExecContext<'_>,
    client: &kube::Client,
    policies: &[(String, String)],
    remove: bool,
) -> Result<serde_json::Value, (&'static str, String)> {
    use sha2::Digest as _;
    let inv = cluster_inventory_ref();
    let cms: Api<DynamicObject> = api(client, &inv);
    let existing = cms
        .get_opt(CLUSTER_POLICY_INVENTORY)
        .await
        .map_err(|e| ("cluster_error", format!("reading the cluster policies' inventory: {e}")))?;
    if existing.is_none() && policies.is_empty() {
        return Ok(serde_json::json!({"applied": [], "pruned": []}));
    }
    let previous: Vec<ObjRef> = existing
        .as_ref()
        .map(|cm| {
            cm.data["data"]["objects"].as_str().unwrap_or("").lines().filter_map(ObjRef::decode).collect()
        })
        .unwrap_or_default();
    let stored_digest = existing
        .as_ref()
        .and_then(|cm| cm.metadata.annotations.as_ref()?.get(DIGEST_ANNOTATION).cloned())
        .unwrap_or_default();
    let mut objects: Vec<(ObjRef, serde_json::Value)> = Vec::new();
    let mut digests = std::collections::BTreeMap::new();
    let mut all = sha2::Sha256::new();
    if !remove {
        for (name, yaml) in policies {
            let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(yaml.as_bytes())));
            all.update(name.as_bytes());
            all.update(digest.as_bytes());
            digests.insert(format!("policy:{name}"), digest);
            for m in
                crate::helm::parse_manifests(yaml).map_err(|e| ("invalid_spec", format!("{name}: {e}")))?
            {
                let get = |k: &str| m.get(k).and_then(|v| v.as_str()).map(str::to_string);
                let (Some(api_version), Some(kind), Some(obj_name)) =
                    (get("apiVersion"), get("kind"), m["metadata"]["name"].as_str().map(str::to_string))
                else {
                    return Err((
                        "invalid_spec",
                        format!("{name}: every object needs apiVersion, kind and metadata.name"),
                    ));
                };
                let namespace = (!CLUSTER_SCOPED.contains(&kind.as_str()))
                    .then(|| m["metadata"]["namespace"].as_str().unwrap_or("default").to_string());
                objects.push((ObjRef { api_version, kind, namespace, name: obj_name }, m));
            }
        }
    }
    let digest = format!("sha256:{}", hex::encode(all.finalize()));
    let current: BTreeSet<&ObjRef> = objects.iter().map(|(r, _)| r).collect();
    if !remove && digest == stored_digest && previous.iter().collect::<BTreeSet<_>>() == current {
        return Ok(serde_json::json!({"unchanged": digest}));
    }
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let mut applied = Vec::new();
    for (r, m) in &objects {
        api(client, r)
            .patch(&r.name, &pp, &Patch::Apply(m))
            .await
            .map_err(|e| ("apply_failed", format!("applying cluster policy {}: {e}", r.display())))?;
        let _ = ctx.output.write(format!("[kubernetes] applied cluster policy {}\n", r.display()).as_bytes());
        applied.push(r.display());
    }
    let mut pruned = Vec::new();
    for r in previous.iter().filter(|r| !current.contains(r)) {
        match api(client, r).delete(&r.name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(("prune_failed", format!("removing cluster policy {}: {e}", r.display()))),
        }
        let _ = ctx.output.write(format!("[kubernetes] removed cluster policy {}\n", r.display()).as_bytes());
        pruned.push(r.display());
    }
    if remove {
        match cms.delete(CLUSTER_POLICY_INVENTORY, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => {
                return Err(("delete_failed", format!("deleting the cluster policies' inventory: {e}")));
            }
        }
    } else {
        let lines: Vec<String> = objects.iter().map(|(r, _)| r.encode()).collect();
        let cm = serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": CLUSTER_POLICY_INVENTORY, "namespace": CLUSTER_POLICY_NAMESPACE,
                         "labels": {"app.kubernetes.io/managed-by": FIELD_MANAGER},
                         "annotations": {DIGEST_ANNOTATION: digest}},
            "data": {"objects": lines.join("\n")}
        });
        cms.patch(CLUSTER_POLICY_INVENTORY, &pp, &Patch::Apply(&cm))
            .await
            .map_err(|e| ("apply_failed", format!("writing the cluster policies' inventory: {e}")))?;
    }
    if let Some(audit) = &ctx.audit {
        let event = if remove { "cluster_policies_removed" } else { "cluster_policies_applied" };
        let detail = format!("applied [{}], removed [{}]", applied.join(", "), pruned.join(", "));
        if let Err(e) = audit.record(event, detail, digests) {
            tracing::error!(error = %e, "could not audit the cluster policies");
        }
    }
    Ok(serde_json::json!({"applied": applied, "pruned": pruned}))
}

/// Ready, not yet, or failed (with why).
fn readiness(kind: &str, o: &DynamicObject) -> Result<bool, String> {
    let s = &o.data["status"];
    let spec = &o.data["spec"];
    let n = |v: &serde_json::Value| v.as_i64().unwrap_or(0);
    let generation = o.metadata.generation.unwrap_or(0);
    match kind {
        "Deployment" => {
            let want = spec["replicas"].as_i64().unwrap_or(1);
            Ok(n(&s["observedGeneration"]) >= generation
                && n(&s["updatedReplicas"]) >= want
                && n(&s["availableReplicas"]) >= want)
        }
        "StatefulSet" => {
            let want = spec["replicas"].as_i64().unwrap_or(1);
            Ok(n(&s["observedGeneration"]) >= generation
                && n(&s["readyReplicas"]) >= want
                && n(&s["updatedReplicas"]) >= want)
        }
        "Job" => {
            if n(&s["failed"]) > spec["backoffLimit"].as_i64().unwrap_or(6) {
                return Err(format!("{} pods failed", n(&s["failed"])));
            }
            Ok(n(&s["succeeded"]) >= spec["completions"].as_i64().unwrap_or(1))
        }
        _ => Ok(true),
    }
}

async fn client(kubeconfig: &str) -> Result<kube::Client, String> {
    let kc = kube::config::Kubeconfig::from_yaml(kubeconfig).map_err(|e| format!("kubeconfig: {e}"))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|e| format!("kubeconfig: {e}"))?;
    kube::Client::try_from(config).map_err(|e| format!("cluster client: {e}"))
}

impl Executor for Kubernetes {
    fn run<'a>(&'a self, mut ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move { self.go(&mut ctx).await })
    }

    fn secrets(&self) -> Vec<Vec<u8>> {
        // Tokens and keys in the kubeconfig (an EKS token is derived from the role's
        // session, whose keys are masked already; the token itself is never logged).
        self.spec
            .kubeconfig
            .as_deref()
            .unwrap_or("")
            .lines()
            .filter_map(|l| l.split_once(':').map(|(_, v)| v.trim().trim_matches('"')))
            .filter(|v| v.len() >= 16 && !v.starts_with("http"))
            .map(|v| v.as_bytes().to_vec())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plurals_follow_the_built_in_resources() {
        for (k, p) in [
            ("Deployment", "deployments"),
            ("Ingress", "ingresses"),
            ("NetworkPolicy", "networkpolicies"),
            ("ConfigMap", "configmaps"),
            ("Gateway", "gateways"),
            ("StorageClass", "storageclasses"),
        ] {
            assert_eq!(plural(k), p);
        }
    }

    #[test]
    fn inventory_entries_round_trip() {
        let r = ObjRef {
            api_version: "apps/v1".into(),
            kind: "Deployment".into(),
            namespace: Some("acme".into()),
            name: "api".into(),
        };
        assert_eq!(ObjRef::decode(&r.encode()), Some(r));
        let c = ObjRef {
            api_version: "v1".into(),
            kind: "Namespace".into(),
            namespace: None,
            name: "acme".into(),
        };
        assert_eq!(ObjRef::decode(&c.encode()), Some(c));
    }
}
