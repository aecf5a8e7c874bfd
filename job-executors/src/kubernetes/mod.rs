//! `kubernetes`: decide, then server-side apply with our own field manager, prune what
//! a previous apply of the same component created and this one no longer has (an
//! inventory ConfigMap per component), wait for readiness (Deployments, StatefulSets,
//! Jobs), delete on teardown. Policy sees the manifests before anything is sent.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

mod cluster_policies;
pub(crate) mod drift;
mod objects;

use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use serde::Deserialize;

use self::cluster_policies::sync_cluster_policies;
use self::objects::{CLUSTER_SCOPED, ObjRef, api, is_not_found, readiness};
use crate::cluster::{ClusterSource, Eks};
use crate::{ExecContext, ExecFuture, ExecOutcome, Executor, JobStatus};

/// Our field manager: what we apply is ours, and conflicts with other managers are
/// taken over (`force`), as `kubectl apply --server-side --force-conflicts` does.
pub const FIELD_MANAGER: &str = "byoc-runner";
const INVENTORY_PREFIX: &str = "byoc-inventory-";
const POLL: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Action {
    Apply,
    Delete,
    /// Compare the live objects with the manifests; change nothing (`drift.rs`).
    Drift,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    action: Action,
    /// Names the inventory (`[a-z0-9-]`).
    component: String,
    /// Default namespace for namespaced objects that name none.
    namespace: String,
    /// A manifests bundle from the install's registry, by digest:
    /// `<registry>/<repo>@sha256:…` (one tar.gz layer of `.yaml`, `.yml` and `.json`
    /// files, applied in path order), synced there first.
    #[serde(default)]
    bundle: Option<String>,
    /// Or inline: manifests as objects, or as multi-document YAML.
    #[serde(default)]
    manifests: Vec<serde_json::Value>,
    #[serde(default)]
    manifests_yaml: Option<String>,
    /// A kubeconfig of data only (secret: `cluster.rs`), or `eks` to derive the
    /// credentials from the job's role.
    #[serde(default)]
    kubeconfig: Option<String>,
    #[serde(default)]
    eks: Option<Eks>,
    #[serde(default = "default_wait")]
    wait_secs: u64,
    /// The customer's secrets, by name: written (before the manifests) into the
    /// Kubernetes Secrets the app config declares for them (docs/SECRETS.md).
    #[serde(default)]
    secrets: Vec<String>,
}

fn default_wait() -> u64 {
    300
}

pub struct Kubernetes {
    spec: Spec,
    cluster: ClusterSource,
    objects: Vec<(ObjRef, serde_json::Value)>,
    bundle: Option<byoc_oci_sync::Reference>,
    /// The spec as signed, for the drift check of what it deploys.
    raw: serde_json::Value,
}

impl Kubernetes {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, crate::InvalidSpec> {
        let s: Spec = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
        let label = |v: &str| {
            !v.is_empty()
                && v.len() <= 63
                && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        };
        if !label(&s.component) || !label(&s.namespace) {
            return Err(crate::InvalidSpec::from("component and namespace: DNS labels ([a-z0-9-], 1-63)"));
        }
        let cluster = crate::cluster::source(s.kubeconfig.as_ref(), s.eks.as_ref())?;
        let mut manifests = s.manifests.clone();
        if let Some(y) = &s.manifests_yaml {
            manifests.extend(crate::tool::parse_manifests(y)?);
        }
        let bundle = match &s.bundle {
            Some(_) if !manifests.is_empty() => {
                return Err(crate::InvalidSpec::from(
                    "name the manifests by digest (bundle) or inline (manifests), not both",
                ));
            }
            Some(b) => Some(crate::artifact::parse_reference("bundle", b)?),
            None => None,
        };
        if manifests.is_empty() && bundle.is_none() && s.action != Action::Delete {
            return Err(crate::InvalidSpec::from(
                "apply and drift need manifests (bundle, manifests or manifests_yaml)",
            ));
        }
        if let Some(bad) = s.secrets.iter().find(|n| !crate::secrets::valid_name(n)) {
            return Err(crate::InvalidSpec::from(format!("secret name {bad:?}: 1-128 of [A-Za-z0-9_-]")));
        }
        if !s.secrets.is_empty() && s.action != Action::Apply {
            return Err(crate::InvalidSpec::from("secrets are written by action = \"apply\" only"));
        }
        let objects = objects_of(manifests, &s.namespace)?;
        Ok(Kubernetes { spec: s, cluster, objects, bundle, raw: spec.clone() })
    }

    /// The cluster client (`cluster.rs`): `Err((code, why))`.
    fn client(
        &self,
        ctx: &ExecContext<'_>,
    ) -> impl std::future::Future<Output = Result<kube::Client, (&'static str, String)>> + Send + 'static
    {
        let access = self.cluster.access(ctx);
        let reach = ctx.settings.cluster_reach.clone();
        async move {
            let access = access.map_err(|e| ("cluster_credentials", e.0))?;
            access.client(&reach).await.map_err(|e| (e.code(), e.to_string()))
        }
    }

    fn inventory_name(&self) -> String {
        format!("{INVENTORY_PREFIX}{}", self.spec.component)
    }
}

impl Kubernetes {
    /// A bundle by digest is fetched, verified and read first; then the deploy.
    async fn go(&self, ctx: &mut ExecContext<'_>) -> ExecOutcome {
        let Some(reference) = &self.bundle else { return self.deploy(ctx).await };
        let failed = |code: &str, why: String| {
            crate::tool::failed(code, why, serde_json::json!({"bundle": reference.to_string()}))
        };
        let fetched = match crate::artifact::fetch(&ctx.settings, reference).await {
            Ok(f) => f,
            Err(e) => {
                let _ = ctx.output.write(format!("[kubernetes] bundle {reference}: {e}\n").as_bytes());
                return failed(&e.code(), e.to_string());
            }
        };
        let manifests = match read_bundle(&fetched.tree) {
            Ok(m) => m,
            Err(e) => return failed("artifact_invalid", format!("bundle {reference}: {e}")),
        };
        let objects = match objects_of(manifests, &self.spec.namespace) {
            Ok(o) if !o.is_empty() || self.spec.action == Action::Delete => o,
            Ok(_) => return failed("artifact_invalid", format!("bundle {reference}: no manifests in it")),
            Err(e) => return failed("invalid_spec", format!("bundle {reference}: {e}")),
        };
        let _ = ctx.output.write(
            format!(
                "[kubernetes] bundle {reference}: {} objects{}\n",
                objects.len(),
                if fetched.cached { " (cached)" } else { ", fetched and verified" }
            )
            .as_bytes(),
        );
        ctx.settings.artifact = Some(fetched.digest.to_string());
        let resolved = Kubernetes {
            spec: self.spec.clone(),
            cluster: self.cluster.clone(),
            objects,
            bundle: None,
            raw: self.raw.clone(),
        };
        resolved.deploy(ctx).await
    }

    /// The policies' decision over the manifests to apply, then the customer's approval
    /// of exactly these, if asked for (the readiness deadline is taken after it).
    async fn decide_apply(&self, ctx: &mut ExecContext<'_>) -> Result<serde_json::Value, ExecOutcome> {
        let failed = crate::tool::failed;
        let manifests: Vec<&serde_json::Value> = self.objects.iter().map(|(_, m)| m).collect();
        let bytes = serde_json::to_vec(&manifests).unwrap_or_default();
        let subject = crate::policy_gate::Subject {
            source: byoc_policy::Source::Kubernetes,
            // An apply (server-side apply creates or updates).
            admission: byoc_policy::Admission::Update,
            name: "manifests",
            digest: None,
        };
        let d = crate::policy_gate::decide(ctx, subject, &bytes)
            .await
            .map_err(|e| failed(crate::policy_gate::UNAVAILABLE, e.to_string(), serde_json::Value::Null))?;
        let decided = serde_json::json!({"verdict": d.verdict, "manifests_digest": d.input_digest});
        if d.verdict == byoc_policy::Verdict::Deny {
            return Err(failed(
                "policy_denied",
                format!("policy denied the manifests: {}", d.denials().join(", ")),
                decided,
            ));
        }
        if !ctx.settings.decide_only {
            // The customer's approval of exactly these manifests, if asked for; the
            // readiness deadline is taken after it.
            let names: Vec<String> = self
                .objects
                .iter()
                .map(|(o, _)| match &o.namespace {
                    Some(ns) => format!("{}/{ns}/{}", o.kind, o.name),
                    None => format!("{}/{}", o.kind, o.name),
                })
                .collect();
            let summary =
                serde_json::json!({"counts": {"apply": names.len()}, "addresses": {"apply": names}});
            crate::policy_gate::approve_apply(ctx, "kubernetes", &d.input_digest, &summary, &d, &decided)
                .await?;
        }
        Ok(decided)
    }

    async fn deploy(&self, ctx: &mut ExecContext<'_>) -> ExecOutcome {
        if self.spec.action == Action::Drift {
            return self.drift(ctx).await;
        }
        let failed = crate::tool::failed;
        // Policy first: nothing reaches the cluster before the decision.
        let decided = if self.spec.action == Action::Apply {
            match self.decide_apply(ctx).await {
                Ok(decided) => decided,
                Err(outcome) => return outcome,
            }
        } else {
            serde_json::Value::Null
        };
        if ctx.settings.decide_only {
            let _ =
                ctx.output.write(b"[kubernetes] stopping after the decision: nothing sent to the cluster\n");
            return ExecOutcome {
                status: JobStatus::Succeeded,
                exit_code: Some(0),
                error: None,
                outputs: decided,
            };
        }
        let client = match self.client(ctx).await {
            Ok(c) => c,
            Err((code, why)) => return failed(code, why, decided),
        };
        // Readiness is waited for up to wait_secs (and never past the job's timeout).
        let deadline = Instant::now() + ctx.settings.timeout.min(Duration::from_secs(self.spec.wait_secs));
        let cancel = ctx.settings.cancel.clone();
        // The app's cluster policies: kept in step by every apply, removed when the
        // sandbox is deprovisioned.
        let cluster = ctx.settings.policy.as_ref().map(|p| (p.cluster_policies.clone(), p.operation.clone()));
        let uses = self.secret_uses();
        let fetched = match crate::secrets::fetch(ctx, &uses).await {
            Ok(f) => f,
            Err(e) => return failed(e.code(), e.to_string(), decided),
        };
        let work = async {
            let written =
                crate::secrets::write_kubernetes(&client, &fetched, |d| d.kubernetes.clone()).await?;
            let mut out = match self.spec.action {
                Action::Apply => self.apply(ctx, &client, deadline).await?,
                Action::Delete => self.delete(ctx, &client).await?,
                // Answered by `drift` before anything here runs.
                Action::Drift => return Err(("invalid_spec", "a drift check deploys nothing".to_string())),
            };
            if !fetched.is_empty()
                && let Some(o) = out.as_object_mut()
            {
                o.insert("secrets".into(), crate::secrets::report(&fetched, &written));
            }
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
        .map_err(|e| (crate::policy_gate::UNAVAILABLE, e.to_string()))?;
    if d.verdict == byoc_policy::Verdict::Deny {
        return Err(("policy_denied", format!("policy denied deleting: {}", d.denials().join(", "))));
    }
    Ok(())
}

/// Every manifest's identity (namespaced ones in `namespace` unless they name their
/// own, so policy sees the addresses they will have); no object twice.
pub(crate) fn objects_of(
    manifests: Vec<serde_json::Value>,
    namespace: &str,
) -> Result<Vec<(ObjRef, serde_json::Value)>, crate::InvalidSpec> {
    let mut objects = Vec::new();
    for (i, m) in manifests.into_iter().enumerate() {
        let get = |k: &str| m.get(k).and_then(|v| v.as_str()).map(str::to_string);
        let (Some(api_version), Some(kind)) = (get("apiVersion"), get("kind")) else {
            return Err(crate::InvalidSpec::from(format!(
                "manifest {}: apiVersion and kind are required",
                i + 1
            )));
        };
        let Some(name) = m["metadata"]["name"].as_str().map(str::to_string) else {
            return Err(crate::InvalidSpec::from(format!(
                "manifest {} ({kind}): metadata.name is required",
                i + 1
            )));
        };
        let namespace = if CLUSTER_SCOPED.contains(&kind.as_str()) {
            None
        } else {
            Some(m["metadata"]["namespace"].as_str().unwrap_or(namespace).to_string())
        };
        let r = ObjRef { api_version, kind, namespace, name };
        if objects.iter().any(|(o, _)| *o == r) {
            return Err(crate::InvalidSpec::from(format!("{} appears twice", r.display())));
        }
        // The namespace it will land in, before policy sees it (addresses match).
        let mut m = m;
        if let Some(ns) = &r.namespace {
            m["metadata"]["namespace"] = ns.clone().into();
        }
        objects.push((r, m));
    }
    Ok(objects)
}

/// Every `.yaml`, `.yml` and `.json` file of an unpacked bundle, in path order, as
/// manifests (several YAML documents to a file, a JSON object, array or List).
fn read_bundle(tree: &std::path::Path) -> Result<Vec<serde_json::Value>, crate::tool::InvalidManifests> {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) -> std::io::Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                walk(&entry.path(), out)?;
            } else if kind.is_file() {
                out.push(entry.path());
            }
        }
        Ok(())
    }
    let mut files = Vec::new();
    let bad = crate::tool::InvalidManifests;
    walk(tree, &mut files).map_err(|e| bad(format!("reading the bundle: {e}")))?;
    files.retain(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml" || e == "json"));
    files.sort();
    let mut manifests = Vec::new();
    for f in files {
        let rel = f.strip_prefix(tree).unwrap_or(&f).display().to_string();
        let text = std::fs::read_to_string(&f).map_err(|e| bad(format!("{rel}: {e}")))?;
        let docs = match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(serde_json::Value::Array(items)) => items,
            Ok(one @ serde_json::Value::Object(_)) => vec![one],
            _ => crate::tool::parse_manifests(&text).map_err(|e| bad(format!("{rel}: {e}")))?,
        };
        for m in docs {
            match m.get("items").and_then(|i| i.as_array()) {
                Some(items) if m["kind"].as_str().is_some_and(|k| k.ends_with("List")) => {
                    manifests.extend(items.iter().cloned())
                }
                _ => manifests.push(m),
            }
        }
    }
    Ok(manifests)
}

impl Executor for Kubernetes {
    fn effect(&self) -> byoc_protocol::Effect {
        use byoc_protocol::Effect;
        match self.spec.action {
            Action::Drift => Effect::Read,
            Action::Apply => Effect::Change,
            Action::Delete => Effect::Destroy,
        }
    }

    fn run<'a>(&'a self, mut ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move { self.go(&mut ctx).await })
    }

    fn is_drift_check(&self) -> bool {
        self.spec.action == Action::Drift
    }

    fn secret_uses(&self) -> Vec<crate::secrets::SecretUse> {
        crate::secrets::uses(&self.spec.secrets, crate::secrets::Target::Kubernetes(None))
    }

    fn drift_spec(&self) -> Option<serde_json::Value> {
        (self.spec.action == Action::Apply).then(|| {
            let mut spec = self.raw.clone();
            if let Some(o) = spec.as_object_mut() {
                o.insert("action".into(), "drift".into());
                // A check reads; the secrets were written by the deploy.
                o.remove("secrets");
            }
            spec
        })
    }

    fn secrets(&self) -> Vec<Vec<u8>> {
        // The kubeconfig's token or key (an EKS token is derived from the role's
        // session, whose keys are masked already; the token itself is never logged).
        self.cluster.secrets()
    }

    fn endpoints(&self) -> Vec<crate::Endpoint> {
        let mut e = vec![crate::Endpoint::Cluster {
            field: self.cluster.server_field(),
            url: self.cluster.server().clone(),
        }];
        if let Some(b) = &self.bundle {
            e.push(crate::Endpoint::Registry { field: "bundle", name: b.registry.clone() });
        }
        e
    }
}
