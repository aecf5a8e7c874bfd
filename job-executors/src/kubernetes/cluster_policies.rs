//! The app's `kubernetes_cluster` policies (Kyverno objects): applied into the cluster
//! with our field manager, recorded with their digest in an inventory ConfigMap,
//! skipped while unchanged, pruned when no longer declared, removed on deprovision.

use std::collections::BTreeSet;

use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};

use super::FIELD_MANAGER;
use super::objects::{CLUSTER_SCOPED, ObjRef, api, is_not_found};
use crate::ExecContext;

/// Where the inventory of the app's cluster policies lives (they are cluster-scoped;
/// the inventory ConfigMap needs a namespace every cluster has).
const CLUSTER_POLICY_INVENTORY: &str = "byoc-inventory-cluster-policies";
const CLUSTER_POLICY_NAMESPACE: &str = "kube-system";
const DIGEST_ANNOTATION: &str = "byoc-runner/policies-digest";

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
pub(super) async fn sync_cluster_policies(
    ctx: &mut ExecContext<'_>,
    client: &kube::Client,
    policies: &[(String, String)],
    remove: bool,
) -> Result<serde_json::Value, (&'static str, String)> {
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
    // Removing: nothing is declared any more.
    let (objects, digests, digest) =
        if remove { (Vec::new(), Default::default(), String::new()) } else { declared_objects(policies)? };
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
    if let Some(audit) = &ctx.settings.audit {
        let event = if remove { "cluster_policies_removed" } else { "cluster_policies_applied" };
        let detail = format!("applied [{}], removed [{}]", applied.join(", "), pruned.join(", "));
        if let Err(e) = audit.record(event, detail, digests) {
            tracing::error!(error = %e, "Could not audit the cluster policies: {e}.");
        }
    }
    Ok(serde_json::json!({"applied": applied, "pruned": pruned}))
}

type Declared = (Vec<(ObjRef, serde_json::Value)>, std::collections::BTreeMap<String, String>, String);

/// The objects of the declared policies, each policy's digest, and the digest of them
/// all (over names and digests, in order).
fn declared_objects(policies: &[(String, String)]) -> Result<Declared, (&'static str, String)> {
    use sha2::Digest as _;
    let mut objects: Vec<(ObjRef, serde_json::Value)> = Vec::new();
    let mut digests = std::collections::BTreeMap::new();
    let mut all = sha2::Sha256::new();
    for (name, yaml) in policies {
        let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(yaml.as_bytes())));
        all.update(name.as_bytes());
        all.update(digest.as_bytes());
        digests.insert(format!("policy:{name}"), digest);
        for m in crate::tool::parse_manifests(yaml).map_err(|e| ("invalid_spec", format!("{name}: {e}")))? {
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
    Ok((objects, digests, format!("sha256:{}", hex::encode(all.finalize()))))
}
