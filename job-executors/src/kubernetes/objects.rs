//! Object identities (what inventories record and prune deletes), how each reaches
//! the API (its resource, its namespace or none), and when an applied object is ready.

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};

/// Kinds that live outside namespaces (the ones a component plausibly ships).
pub(super) const CLUSTER_SCOPED: [&str; 12] = [
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

/// One object's identity: what the inventory records and prune deletes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct ObjRef {
    pub(super) api_version: String,
    pub(super) kind: String,
    pub(super) namespace: Option<String>,
    pub(super) name: String,
}

impl ObjRef {
    pub(super) fn encode(&self) -> String {
        format!(
            "{}|{}|{}|{}",
            self.api_version,
            self.kind,
            self.namespace.as_deref().unwrap_or(""),
            self.name
        )
    }
    pub(super) fn decode(s: &str) -> Option<ObjRef> {
        let mut p = s.split('|');
        let (v, k, ns, n) = (p.next()?, p.next()?, p.next()?, p.next()?);
        Some(ObjRef {
            api_version: v.into(),
            kind: k.into(),
            namespace: (!ns.is_empty()).then(|| ns.to_string()),
            name: n.into(),
        })
    }
    pub(crate) fn display(&self) -> String {
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

pub(super) fn api(client: &kube::Client, r: &ObjRef) -> Api<DynamicObject> {
    let ar = r.api_resource();
    match &r.namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    }
}

pub(super) fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// Ready, not yet, or failed (with why).
pub(super) fn readiness(kind: &str, o: &DynamicObject) -> Result<bool, String> {
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
