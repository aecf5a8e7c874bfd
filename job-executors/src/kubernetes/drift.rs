//! Drift checks of a kubernetes component (`action = "drift"`, docs/DRIFT.md): the
//! live objects read back and compared with the manifests the component deploys, the
//! objects the inventory records but the manifests no longer have, and the policies
//! over the live objects. Nothing is sent but GETs.
//!
//! Only the fields a manifest sets are compared: the API server adds defaults, status
//! and metadata of its own, and those are not drift. Paths are reported, never values.

use std::collections::{BTreeMap, BTreeSet};

use kube::api::DynamicObject;
use serde_json::Value;
use sha2::Digest as _;

use super::Kubernetes;
use super::objects::{ObjRef, api};
use crate::{ExecContext, ExecOutcome, JobStatus};

/// Changed paths reported per object, at most.
const MAX_PATHS: usize = 50;

/// Paths under `at` where `live` differs from what `want` sets. Objects compare the
/// keys `want` has; arrays element by element (a different length is a change of the
/// whole array); numbers by value.
pub(super) fn differs(want: &Value, live: &Value, at: &str, out: &mut Vec<String>) {
    if out.len() >= MAX_PATHS {
        return;
    }
    let join = |k: &str| if at.is_empty() { k.to_string() } else { format!("{at}.{k}") };
    match (want, live) {
        (Value::Object(w), Value::Object(l)) => {
            for (k, wv) in w {
                match l.get(k) {
                    Some(lv) => differs(wv, lv, &join(k), out),
                    None if wv.is_null() => {}
                    None => out.push(join(k)),
                }
            }
        }
        (Value::Array(w), Value::Array(l)) if w.len() == l.len() => {
            for (i, (wv, lv)) in w.iter().zip(l).enumerate() {
                differs(wv, lv, &format!("{at}[{i}]"), out);
            }
        }
        (Value::Number(w), Value::Number(l)) if w.as_f64() == l.as_f64() => {}
        _ if want == live => {}
        _ => out.push(if at.is_empty() { "(whole object)".into() } else { at.to_string() }),
    }
}

/// What of a manifest is the component's to compare: its body and its labels and
/// annotations (the rest of `metadata` and `status` are the server's).
fn compared_part(manifest: &Value) -> Value {
    let mut m = manifest.as_object().cloned().unwrap_or_default();
    for k in ["apiVersion", "kind", "status"] {
        m.remove(k);
    }
    if let Some(meta) = m.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.retain(|k, _| k == "labels" || k == "annotations");
    }
    Value::Object(m)
}

/// A live object as the policies see it: without the server's bookkeeping, and
/// without a Secret's values (the cluster's, not what the vendor sent).
fn for_policy(live: &Value) -> Value {
    let mut o = live.clone();
    if let Some(meta) = o.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("managedFields");
    }
    if o["kind"] == "Secret"
        && let Some(m) = o.as_object_mut()
    {
        m.remove("data");
        m.remove("stringData");
    }
    o
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

/// The live objects read back and compared with the manifests that deployed them.
pub(crate) struct LiveComparison {
    /// Address, actions (`update`: edited; `delete`: gone) and changed paths.
    pub drifted: Vec<Value>,
    /// Every object found, as the policies see it.
    pub live: Vec<Value>,
}

/// GET each object `objects` names and compare it with its manifest. Reads only.
pub(crate) async fn compare_live(
    client: &kube::Client,
    objects: &[(ObjRef, Value)],
) -> Result<LiveComparison, (&'static str, String)> {
    let mut out = LiveComparison { drifted: Vec::new(), live: Vec::new() };
    for (obj, manifest) in objects {
        let got: Option<DynamicObject> = api(client, obj)
            .get_opt(&obj.name)
            .await
            .map_err(|e| ("cluster_error", format!("reading {}: {e}", obj.display())))?;
        match got.map(|o| serde_json::to_value(o).unwrap_or_default()) {
            None => out
                .drifted
                .push(serde_json::json!({"address": obj.display(), "actions": ["delete"], "paths": []})),
            Some(l) => {
                let mut paths = Vec::new();
                differs(&compared_part(manifest), &l, "", &mut paths);
                if !paths.is_empty() {
                    out.drifted.push(
                        serde_json::json!({"address": obj.display(), "actions": ["update"], "paths": paths}),
                    );
                }
                out.live.push(for_policy(&l));
            }
        }
    }
    Ok(out)
}

/// What a drift check of a component that was never deployed here says.
pub(crate) fn not_deployed(
    ctx: &mut ExecContext<'_>,
    kind: &str,
    name: &str,
    manifests_digest: &str,
) -> ExecOutcome {
    let _ = ctx.output.write(format!("[drift] {kind} {name} was never deployed here\n").as_bytes());
    if let Some(a) = &ctx.settings.audit {
        let _ = a.record(
            "drift_checked",
            format!("{kind} {name}: not_deployed"),
            BTreeMap::from([("manifests".to_string(), manifests_digest.to_string())]),
        );
    }
    ExecOutcome {
        status: JobStatus::Succeeded,
        exit_code: Some(0),
        error: None,
        outputs: serde_json::json!({"drift": {
            "kind": kind, "workspace": name, "verdict": "not_deployed",
            "drifted": [], "would_change": {"counts": {}, "addresses": {}},
            "refresh_plan_digest": "", "plan_digest": manifests_digest,
        }, "violations": []}),
    }
}

/// The policies over the live objects, the verdict, the audit record and the result.
/// `removed`: objects a deploy now would delete (the inventory's, no longer declared).
pub(crate) async fn judge(
    ctx: &mut ExecContext<'_>,
    source: byoc_policy::Source,
    kind: &str,
    name: &str,
    seen: LiveComparison,
    removed: Vec<String>,
    manifests_digest: &str,
) -> ExecOutcome {
    let LiveComparison { drifted, live } = seen;
    // What an apply now would do: recreate or restore what drifted, prune what the
    // manifests no longer have.
    let mut addresses: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for d in &drifted {
        let action = if d["actions"][0] == "delete" { "create" } else { "update" };
        addresses.entry(action).or_default().push(d["address"].as_str().unwrap_or("").to_string());
    }
    if !removed.is_empty() {
        addresses.insert("delete", removed);
    }
    let counts: BTreeMap<&str, usize> = addresses.iter().map(|(k, v)| (*k, v.len())).collect();
    let would_change = serde_json::json!({"counts": counts, "addresses": addresses});
    let live_bytes = serde_json::to_vec(&live).unwrap_or_default();
    let live_digest = sha256(&live_bytes);
    let subject = crate::policy_gate::Subject {
        source,
        admission: byoc_policy::Admission::Update,
        name: crate::policy_gate::DRIFT_SUBJECT,
        digest: Some(&live_digest),
    };
    let decision = match crate::policy_gate::decide(ctx, subject, &live_bytes).await {
        Ok(d) => d,
        Err(e) => return crate::tool::failed(crate::policy_gate::UNAVAILABLE, e.to_string(), Value::Null),
    };
    let verdict = if decision.verdict == byoc_policy::Verdict::Deny {
        "violating"
    } else if !drifted.is_empty() || !counts.is_empty() {
        "drifted"
    } else {
        "clean"
    };
    let _ = ctx.output.write(
        format!(
            "[drift] {verdict}: {} object(s) changed or gone outside the runner, a deploy would change {}\n",
            drifted.len(),
            if counts.is_empty() { "nothing".to_string() } else { serde_json::json!(counts).to_string() }
        )
        .as_bytes(),
    );
    if let Some(a) = &ctx.settings.audit {
        let _ = a.record(
            "drift_checked",
            format!("{kind} {name}: {verdict}; {} drifted, policy {:?}", drifted.len(), decision.verdict),
            BTreeMap::from([
                ("live".to_string(), live_digest.clone()),
                ("manifests".to_string(), manifests_digest.to_string()),
                ("input".to_string(), decision.input_digest.clone()),
            ]),
        );
    }
    ExecOutcome {
        status: JobStatus::Succeeded,
        exit_code: Some(0),
        error: None,
        outputs: serde_json::json!({
            "drift": {
                "kind": kind,
                "workspace": name,
                "verdict": verdict,
                "drifted": drifted,
                "would_change": would_change,
                "refresh_plan_digest": live_digest,
                "plan_digest": manifests_digest,
            },
            "verdict": decision.verdict,
            "input_digest": decision.input_digest,
            "violations": decision.violations.iter().map(byoc_policy::Finding::reference).collect::<Vec<_>>(),
        }),
    }
}

/// The digest of the manifests a check compares against.
pub(crate) fn manifests_digest(objects: &[(ObjRef, Value)]) -> String {
    let manifests: Vec<&Value> = objects.iter().map(|(_, m)| m).collect();
    sha256(&serde_json::to_vec(&manifests).unwrap_or_default())
}

impl Kubernetes {
    pub(super) async fn drift(&self, ctx: &mut ExecContext<'_>) -> ExecOutcome {
        let failed = crate::tool::failed;
        let component = self.spec.component.clone();
        let client = match self.client(ctx).await {
            Ok(c) => c,
            Err((code, why)) => return failed(code, why, Value::Null),
        };
        let _ = ctx.output.write(
            format!("[kubernetes] drift check of {component}: live objects against the manifests; nothing is changed\n")
                .as_bytes(),
        );
        let digest = manifests_digest(&self.objects);
        let cancel = ctx.settings.cancel.clone();
        let read = async {
            let inventory = self.inventory(&client).await?;
            if inventory.is_empty() {
                return Ok(None);
            }
            Ok::<_, (&'static str, String)>(Some((compare_live(&client, &self.objects).await?, inventory)))
        };
        let (seen, inventory) = tokio::select! {
            r = read => match r {
                Ok(Some(v)) => v,
                Ok(None) => return not_deployed(ctx, "kubernetes", &component, &digest),
                Err((reason, e)) => return failed(reason, e, Value::Null),
            },
            _ = cancel.cancelled() => return ExecOutcome { status: JobStatus::Cancelled, exit_code: None, error: Some("job was cancelled".into()), outputs: Value::Null },
        };
        let declared: BTreeSet<&ObjRef> = self.objects.iter().map(|(o, _)| o).collect();
        let removed = inventory.iter().filter(|o| !declared.contains(o)).map(ObjRef::display).collect();
        judge(ctx, byoc_policy::Source::Kubernetes, "kubernetes", &component, seen, removed, &digest).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(want: Value, live: Value) -> Vec<String> {
        let mut out = Vec::new();
        differs(&compared_part(&want), &live, "", &mut out);
        out
    }

    #[test]
    fn only_what_the_manifest_sets_is_compared() {
        let want = serde_json::json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "labels": {"app": "web"}},
            "spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "web", "image": "web:1"}]}}},
        });
        // The server's defaults, status and bookkeeping are not drift.
        let mut live = want.clone();
        live["metadata"]["uid"] = "u-1".into();
        live["metadata"]["generation"] = 3.into();
        live["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent".into();
        live["status"] = serde_json::json!({"readyReplicas": 2});
        live["spec"]["replicas"] = serde_json::json!(2.0);
        assert!(paths(want.clone(), live.clone()).is_empty());
        // An edit of a field it sets is, by path, never by value.
        live["spec"]["replicas"] = 5.into();
        live["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest".into();
        live["metadata"]["labels"] = serde_json::json!({"app": "other"});
        let p = paths(want.clone(), live.clone());
        assert_eq!(p, ["metadata.labels.app", "spec.replicas", "spec.template.spec.containers[0].image"]);
        assert!(!p.iter().any(|x| x.contains("evil")));
        // A container added live changes the array.
        live["spec"]["template"]["spec"]["containers"] =
            serde_json::json!([{"name": "web", "image": "web:1"}, {"name": "miner", "image": "x"}]);
        assert!(paths(want, live).contains(&"spec.template.spec.containers".to_string()));
    }

    #[test]
    fn a_secret_reaches_the_policies_without_its_values() {
        let live = serde_json::json!({"kind": "Secret", "metadata": {"name": "s", "managedFields": [{}]},
            "data": {"password": "aHVudGVyMg=="}, "type": "Opaque"});
        let seen = for_policy(&live);
        assert!(seen.get("data").is_none() && seen["metadata"].get("managedFields").is_none());
        assert_eq!(seen["type"], "Opaque");
    }
}
