//! `secrets.sync`: the customer's secrets into the Kubernetes Secrets the app config
//! declares for them. Every named secret is read (and masked) before anything is
//! written; then one server-side apply per Secret. The result names each secret's
//! version, keyed digest and where it went.

use serde::Deserialize;

use super::{KubeTarget, SecretUse, Target};
use crate::cluster::{ClusterSource, Eks};
use crate::{ExecContext, ExecFuture, ExecOutcome, Executor, JobStatus};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    /// Secrets by name (each to every Kubernetes target the app config declares for it),
    /// or `{name, kubernetes = {namespace, name, key}}` for one of those targets. Empty:
    /// every declared secret with Kubernetes targets.
    #[serde(default)]
    secrets: Vec<Named>,
    /// A kubeconfig of data only (secret: `cluster.rs`), or `eks` to derive the
    /// credentials from the job's role.
    #[serde(default)]
    kubeconfig: Option<String>,
    #[serde(default)]
    eks: Option<Eks>,
}

#[derive(Clone, Deserialize)]
#[serde(untagged)]
enum Named {
    Name(String),
    Target(NamedTarget),
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct NamedTarget {
    name: String,
    kubernetes: KubeTarget,
}

pub struct SecretsSync {
    spec: Spec,
    cluster: ClusterSource,
}

impl SecretsSync {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, crate::InvalidSpec> {
        let s: Spec = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
        let cluster = crate::cluster::source(s.kubeconfig.as_ref(), s.eks.as_ref())?;
        for n in &s.secrets {
            let name = match n {
                Named::Name(n) | Named::Target(NamedTarget { name: n, .. }) => n,
            };
            if !super::valid_name(name) {
                return Err(crate::InvalidSpec::from(format!(
                    "secret name {name:?}: 1-128 of [A-Za-z0-9_-]"
                )));
            }
        }
        Ok(SecretsSync { spec: s, cluster })
    }

    fn uses(&self) -> Vec<SecretUse> {
        self.spec
            .secrets
            .iter()
            .map(|n| match n {
                Named::Name(name) => SecretUse { name: name.clone(), target: Target::Kubernetes(None) },
                Named::Target(t) => {
                    SecretUse { name: t.name.clone(), target: Target::Kubernetes(Some(t.kubernetes.clone())) }
                }
            })
            .collect()
    }

    async fn go(&self, ctx: &mut ExecContext<'_>) -> ExecOutcome {
        let failed = crate::tool::failed;
        let mut uses = self.uses();
        if uses.is_empty() {
            let declared = ctx.settings.secrets.as_ref().map(|s| s.declared.clone()).unwrap_or_default();
            uses = declared
                .iter()
                .filter(|d| !d.kubernetes.is_empty())
                .map(|d| SecretUse { name: d.name.clone(), target: Target::Kubernetes(None) })
                .collect();
            if uses.is_empty() {
                return failed(
                    "secret_target_not_declared",
                    "the app config declares no secret with a Kubernetes target (kubernetes_sync)".into(),
                    serde_json::Value::Null,
                );
            }
        }
        let fetched = match super::fetch(ctx, &uses).await {
            Ok(f) => f,
            Err(e) => return failed(e.code(), e.to_string(), serde_json::Value::Null),
        };
        for f in &fetched {
            let line = match &f.version_id {
                Some(v) => format!("[secrets] {}: version {v} read\n", f.declared.name),
                None => format!("[secrets] {}: not set (optional), nothing to write\n", f.declared.name),
            };
            let _ = ctx.output.write(line.as_bytes());
        }
        let access = match self.cluster.access(ctx) {
            Ok(a) => a,
            Err(e) => return failed("cluster_credentials", e.0, serde_json::Value::Null),
        };
        let client = match access.client(&ctx.settings.cluster_reach).await {
            Ok(c) => c,
            Err(e) => return failed(e.code(), e.to_string(), serde_json::Value::Null),
        };
        // A use that names one target writes that one; a bare name, every declared one.
        let chosen = |d: &super::Declared| -> Vec<KubeTarget> {
            let named: Vec<KubeTarget> = uses
                .iter()
                .filter(|u| u.name == d.name)
                .filter_map(|u| match &u.target {
                    Target::Kubernetes(Some(t)) => Some(t.clone()),
                    _ => None,
                })
                .collect();
            let all = uses.iter().any(|u| u.name == d.name && u.target == Target::Kubernetes(None));
            if all || named.is_empty() { d.kubernetes.clone() } else { named }
        };
        let cancel = ctx.settings.cancel.clone();
        let written = tokio::select! {
            w = super::write_kubernetes(&client, &fetched, chosen) => w,
            _ = cancel.cancelled() => return ExecOutcome { status: JobStatus::Cancelled, exit_code: None, error: Some("job was cancelled".into()), outputs: serde_json::Value::Null },
        };
        let written = match written {
            Ok(w) => w,
            Err((code, why)) => return failed(code, why, serde_json::Value::Null),
        };
        for (name, to) in &written {
            let _ = ctx.output.write(format!("[secrets] {name}: written to {}\n", to.join(", ")).as_bytes());
        }
        ExecOutcome {
            status: JobStatus::Succeeded,
            exit_code: Some(0),
            error: None,
            outputs: serde_json::json!({ "secrets": super::report(&fetched, &written) }),
        }
    }
}

impl Executor for SecretsSync {
    fn effect(&self) -> byoc_protocol::Effect {
        byoc_protocol::Effect::Change
    }

    fn run<'a>(&'a self, mut ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move { self.go(&mut ctx).await })
    }

    fn secrets(&self) -> Vec<Vec<u8>> {
        self.cluster.secrets()
    }

    fn endpoints(&self) -> Vec<crate::Endpoint> {
        vec![crate::Endpoint::Cluster {
            field: self.cluster.server_field(),
            url: self.cluster.server().clone(),
        }]
    }

    fn secret_uses(&self) -> Vec<SecretUse> {
        self.uses()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: &str = "clusters: [{name: c, cluster: {server: 'https://api.example.com'}}]\nusers: [{name: u, user: {token: t}}]\n";

    #[test]
    fn specs_name_secrets_or_one_of_their_targets() {
        let s = SecretsSync::from_spec(&serde_json::json!({
            "kubeconfig": K,
            "secrets": ["db_password", {"name": "api_key", "kubernetes": {"namespace": "a", "name": "b", "key": "c"}}],
        }))
        .unwrap();
        let uses = s.uses();
        assert_eq!(uses[0].target, Target::Kubernetes(None));
        assert_eq!(
            uses[1].target,
            Target::Kubernetes(Some(KubeTarget { namespace: "a".into(), name: "b".into(), key: "c".into() }))
        );
        for bad in [
            serde_json::json!({"secrets": []}),
            serde_json::json!({"kubeconfig": K, "secrets": ["../x"]}),
            serde_json::json!({"kubeconfig": K, "secrets": [{"name": "x", "value": "inline"}]}),
            serde_json::json!({"kubeconfig": K, "values": {"x": "inline"}}),
            serde_json::json!({"kubeconfig": "k", "secrets": ["x"]}),
        ] {
            assert!(SecretsSync::from_spec(&bad).is_err(), "{bad}");
        }
    }
}
