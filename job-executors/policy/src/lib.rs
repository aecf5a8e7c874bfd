//! Policy decisions: Rego evaluated in-process with `regorus` over one normalized
//! input, pure (input in, decision out, no I/O).
//!
//! Policies written for conftest work unchanged: `package main` (any package), `deny`,
//! `violation` and `warn` rules whose values are strings or objects with `msg`. A
//! terraform plan is their `input` as `terraform show -json` prints it; for helm and
//! kubernetes each manifest is evaluated as `input` on its own (conftest's default).
//! The built-in pack (`src/pack/`) sees `input.resource_changes` for plans and
//! `input.manifests` for manifests, and `input.byoc` (source, phase, operation,
//! install) in both. Any error or limit denies.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::Digest as _;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Terraform,
    Helm,
    Kubernetes,
}

impl Source {
    pub fn parse(s: &str) -> Result<Source, String> {
        match s {
            "terraform" => Ok(Source::Terraform),
            "helm" => Ok(Source::Helm),
            "kubernetes" => Ok(Source::Kubernetes),
            other => Err(format!("source {other:?} must be terraform, helm or kubernetes")),
        }
    }
}

/// Who wrote a policy. The vendor's arrive in the signed app config; the customer's live
/// on the VM and the vendor cannot switch them (or the built-in pack) off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    Builtin,
    Vendor,
    Customer,
}

/// Mandatory policies deny; advisory ones only warn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Enforcement {
    Advisory,
    #[default]
    Mandatory,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Policy {
    pub name: String,
    pub origin: Origin,
    pub enforcement: Enforcement,
    pub text: String,
}

impl Policy {
    pub fn digest(&self) -> String {
        format!("sha256:{}", hex::encode(sha2::Sha256::digest(self.text.as_bytes())))
    }
}

/// The built-in pack's rule ids, in a stable order.
pub const BUILTIN_RULES: [&str; 7] = [
    "database_protection",
    "public_ingress",
    "container_limits",
    "storage_encryption",
    "approved_registries",
    "required_tags",
    "iam_in_maintenance",
];

/// The built-in pack, every rule mandatory.
pub fn builtin_pack() -> Vec<Policy> {
    let texts = [
        include_str!("pack/database_protection.rego"),
        include_str!("pack/public_ingress.rego"),
        include_str!("pack/container_limits.rego"),
        include_str!("pack/storage_encryption.rego"),
        include_str!("pack/approved_registries.rego"),
        include_str!("pack/required_tags.rego"),
        include_str!("pack/iam_in_maintenance.rego"),
    ];
    BUILTIN_RULES
        .iter()
        .zip(texts)
        .map(|(name, text)| Policy {
            name: format!("builtin/{name}"),
            origin: Origin::Builtin,
            enforcement: Enforcement::Mandatory,
            text: text.to_string(),
        })
        .collect()
}

/// What the decision is about (goes into `input.byoc`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Context {
    pub source: Source,
    /// Lifecycle phase: provision, maintenance, deprovision, break_glass, custom.
    pub phase: String,
    /// `entity.operation`, e.g. `component.deploy`.
    pub operation: String,
    pub install: String,
}

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Wall-clock budget for each policy's evaluation.
    pub time_per_policy: Duration,
    /// Inputs larger than this are refused before parsing (a memory bound).
    pub max_input_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { time_per_policy: Duration::from_secs(5), max_input_bytes: 64 << 20 }
    }
}

/// What the policies are asked about, parsed once into the evaluator's values.
#[derive(Debug, Clone)]
pub enum Document {
    /// `terraform show -json` of a saved plan.
    Plan(regorus::Value),
    /// Rendered manifests (helm template, kubectl manifests), one object each.
    Manifests(Vec<regorus::Value>),
}

impl Document {
    pub fn plan(v: serde_json::Value) -> Document {
        Document::Plan(regorus::Value::from(v))
    }

    pub fn manifests(v: Vec<serde_json::Value>) -> Document {
        Document::Manifests(v.into_iter().map(regorus::Value::from).collect())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Allow,
    Deny,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Finding {
    pub policy: String,
    pub origin: Origin,
    pub enforcement: Enforcement,
    /// The rule id (built-in pack), or the policy's name for conftest-style messages.
    pub rule: String,
    /// Resource address or `Kind/namespace/name`; empty when the policy gave none.
    pub address: String,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PolicyError {
    pub policy: String,
    pub origin: Origin,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PolicyRef {
    pub name: String,
    pub origin: Origin,
    pub enforcement: Enforcement,
    pub digest: String,
}

impl PolicyRef {
    pub fn of(p: &Policy) -> PolicyRef {
        PolicyRef { name: p.name.clone(), origin: p.origin, enforcement: p.enforcement, digest: p.digest() }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Decision {
    pub verdict: Verdict,
    /// SHA-256 of the input document's bytes as given.
    pub input_digest: String,
    pub policies: Vec<PolicyRef>,
    /// Mandatory denials: any one denies.
    pub violations: Vec<Finding>,
    /// `warn` rules, and denials of advisory policies.
    pub warnings: Vec<Finding>,
    /// Policies that failed to load or evaluate, or ran out of time: each denies.
    pub errors: Vec<PolicyError>,
    pub elapsed_ms: u64,
}

impl Decision {
    /// What denied, one item each: `rule@address` per violation, then `<policy> failed`
    /// per error (for job errors and audit details).
    pub fn denials(&self) -> Vec<String> {
        self.violations
            .iter()
            .map(|v| format!("{}@{}", v.rule, v.address))
            .chain(self.errors.iter().map(|e| format!("{} failed", e.policy)))
            .collect()
    }
}

/// One evaluation as a self-contained request: what a separate, memory-limited
/// evaluator process (`byoc-runner policy-eval`) reads on stdin.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalRequest {
    pub policies: Vec<Policy>,
    pub params: serde_json::Value,
    pub context: Context,
    /// The document's bytes (a plan's JSON, or manifests as JSON).
    pub input: String,
    pub time_per_policy_ms: u64,
    pub max_input_bytes: usize,
}

impl EvalRequest {
    /// Evaluate here. A document that does not parse is a denial with the reason.
    pub fn evaluate(&self) -> Decision {
        let limits = Limits {
            time_per_policy: Duration::from_millis(self.time_per_policy_ms),
            max_input_bytes: self.max_input_bytes,
        };
        match parse_document(self.context.source, self.input.as_bytes(), &limits) {
            Ok(doc) => {
                evaluate(&self.policies, &self.params, &self.context, &doc, self.input.as_bytes(), &limits)
            }
            Err(reason) => denied(&self.policies, self.input.as_bytes(), "(input)", reason),
        }
    }
}

/// A decision that denies without evaluating: the input or the evaluator failed.
pub fn denied(policies: &[Policy], input: &[u8], what: &str, reason: String) -> Decision {
    Decision {
        verdict: Verdict::Deny,
        input_digest: format!("sha256:{}", hex::encode(sha2::Sha256::digest(input))),
        policies: policies.iter().map(PolicyRef::of).collect(),
        violations: vec![],
        warnings: vec![],
        errors: vec![PolicyError { policy: what.into(), origin: Origin::Builtin, reason }],
        elapsed_ms: 0,
    }
}

/// Parse `bytes` as `source` expects: a plan (JSON object) or manifests (a JSON array
/// of objects, one object, or a `{"items": [...]}` list). One parse, straight into the
/// evaluator's values.
pub fn parse_document(source: Source, bytes: &[u8], limits: &Limits) -> Result<Document, String> {
    if bytes.len() > limits.max_input_bytes {
        return Err(format!(
            "input is {} bytes, over the {} byte limit",
            bytes.len(),
            limits.max_input_bytes
        ));
    }
    let v: regorus::Value = serde_json::from_slice(bytes).map_err(|e| format!("input is not JSON: {e}"))?;
    let key = |v: &regorus::Value, k: &str| {
        v.as_object().ok().and_then(|o| o.get(&regorus::Value::from(k)).cloned())
    };
    match source {
        Source::Terraform => {
            let changes_ok = key(&v, "resource_changes").is_some_and(|r| r.as_array().is_ok());
            if !changes_ok && key(&v, "format_version").is_none() {
                return Err("input is not a terraform plan (no format_version or resource_changes)".into());
            }
            Ok(Document::Plan(v))
        }
        Source::Helm | Source::Kubernetes => {
            let items: Vec<regorus::Value> = if let Ok(a) = v.as_array() {
                a.iter().cloned().collect()
            } else if let Some(items) = key(&v, "items").filter(|i| i.as_array().is_ok()) {
                items.as_array().map(|a| a.iter().cloned().collect()).unwrap_or_default()
            } else if v.as_object().is_ok() {
                vec![v]
            } else {
                return Err("manifests must be a JSON object or array of objects".into());
            };
            if items.iter().any(|m| key(m, "kind").is_none()) {
                return Err("every manifest must be an object with a kind".into());
            }
            Ok(Document::Manifests(items))
        }
    }
}

/// Evaluate every policy over the document. `params` become `data.byoc.params`.
pub fn evaluate(
    policies: &[Policy],
    params: &serde_json::Value,
    ctx: &Context,
    doc: &Document,
    input_bytes: &[u8],
    limits: &Limits,
) -> Decision {
    let started = Instant::now();
    let byoc = regorus::Value::from(serde_json::to_value(ctx).unwrap_or_default());
    // Built-ins see one input; conftest-style policies see the plan (the same value,
    // with `byoc` added), or each manifest on its own.
    let (pack_input, conftest_inputs) = match doc {
        Document::Plan(plan) => {
            let mut p = plan.clone();
            if let Ok(o) = p.as_object_mut() {
                o.insert(regorus::Value::from("byoc"), byoc);
            }
            (p.clone(), vec![p])
        }
        Document::Manifests(ms) => {
            let mut o = std::collections::BTreeMap::new();
            o.insert(regorus::Value::from("byoc"), byoc);
            o.insert(regorus::Value::from("manifests"), regorus::Value::from(ms.clone()));
            (regorus::Value::from(o), ms.clone())
        }
    };
    let data = serde_json::json!({"byoc": {"params": params}});

    let mut d = Decision {
        verdict: Verdict::Allow,
        input_digest: format!("sha256:{}", hex::encode(sha2::Sha256::digest(input_bytes))),
        policies: policies.iter().map(PolicyRef::of).collect(),
        violations: vec![],
        warnings: vec![],
        errors: vec![],
        elapsed_ms: 0,
    };
    // Policies are independent (one engine each): evaluate them on every core, then
    // collect the results in policy order so the decision does not depend on timing.
    let threads =
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(policies.len()).max(1);
    // Each thread takes the next policy not yet taken, so one slow policy does not hold
    // up a fixed share of the others.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<Result<Findings, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (pack_input, conftest_inputs, data, next) = (&pack_input, &conftest_inputs, &data, &next);
                scope.spawn(move || {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(p) = policies.get(i) else { break };
                        let scoped;
                        let inputs: Vec<&regorus::Value> = match (p.origin, type_scope(p)) {
                            (Origin::Builtin, Some(types)) if matches!(doc, Document::Plan(_)) => {
                                scoped = only_types(pack_input, &types);
                                vec![&scoped]
                            }
                            (Origin::Builtin, _) => vec![pack_input],
                            _ => conftest_inputs.iter().collect(),
                        };
                        done.push((i, eval_policy(p, data, &inputs, limits)));
                    }
                    done
                })
            })
            .collect();
        let mut all: Vec<(usize, Result<Findings, String>)> =
            handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|_| vec![])).collect();
        all.sort_by_key(|(i, _)| *i);
        all.into_iter().map(|(_, r)| r).collect()
    });
    if results.len() != policies.len() {
        // A panicking evaluation thread: deny rather than decide on a partial set.
        d.errors.push(PolicyError {
            policy: "(evaluator)".into(),
            origin: Origin::Builtin,
            reason: "a policy evaluation thread failed".into(),
        });
    }
    for (p, result) in policies.iter().zip(results) {
        match result {
            Ok((denials, warns)) => {
                for f in denials {
                    match p.enforcement {
                        Enforcement::Mandatory => d.violations.push(f),
                        Enforcement::Advisory => d.warnings.push(f),
                    }
                }
                d.warnings.extend(warns);
            }
            Err(reason) => d.errors.push(PolicyError { policy: p.name.clone(), origin: p.origin, reason }),
        }
    }
    if !d.violations.is_empty() || !d.errors.is_empty() {
        d.verdict = Verdict::Deny;
    }
    d.elapsed_ms = started.elapsed().as_millis() as u64;
    d
}

type Findings = (Vec<Finding>, Vec<Finding>);

/// Built-in rules that only look at resources of the types they name: they are given
/// only those resource changes (most of a large plan is other types), which keeps a
/// 10,000-change plan well inside its time budget.
const SCOPED_BY_TYPE: [&str; 4] =
    ["database_protection", "public_ingress", "storage_encryption", "iam_in_maintenance"];

/// The `"aws_…"` type names a scoped built-in rule's source mentions.
fn type_scope(p: &Policy) -> Option<std::collections::BTreeSet<String>> {
    let id = p.name.strip_prefix("builtin/")?;
    if !SCOPED_BY_TYPE.contains(&id) {
        return None;
    }
    Some(
        p.text
            .split('"')
            .skip(1)
            .step_by(2)
            .filter(|lit| {
                lit.starts_with("aws_")
                    && lit.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            })
            .map(str::to_string)
            .collect(),
    )
}

/// The plan with only the resource changes of `types` (everything else shared).
fn only_types(plan: &regorus::Value, types: &std::collections::BTreeSet<String>) -> regorus::Value {
    let key = regorus::Value::from("resource_changes");
    let ty = regorus::Value::from("type");
    let mut out = plan.clone();
    let Ok(o) = out.as_object_mut() else { return out };
    let Some(changes) = o.get(&key).and_then(|c| c.as_array().ok()) else { return out };
    let kept: Vec<regorus::Value> = changes
        .iter()
        .filter(|rc| {
            rc.as_object()
                .ok()
                .and_then(|m| m.get(&ty))
                .and_then(|t| t.as_string().ok())
                .is_some_and(|t| types.contains(t.as_ref()))
        })
        .cloned()
        .collect();
    o.insert(key, regorus::Value::from(kept));
    out
}

fn eval_policy(
    p: &Policy,
    data: &serde_json::Value,
    inputs: &[&regorus::Value],
    limits: &Limits,
) -> Result<Findings, String> {
    let new_engine = |v0: bool| {
        let mut e = regorus::Engine::new();
        e.set_rego_v0(v0);
        e.set_execution_timer_config(regorus::utils::limits::ExecutionTimerConfig {
            limit: limits.time_per_policy,
            check_interval: NonZeroU32::new(256).unwrap_or(NonZeroU32::MIN),
        });
        e
    };
    // Rego v1 first; a policy in the older syntax (`deny[msg] { … }`, most conftest
    // policies written before OPA 1.0) loads as v0, as `conftest --rego-version v0` would.
    let mut engine = new_engine(false);
    let package = match engine.add_policy(p.name.clone(), p.text.clone()) {
        Ok(pkg) => pkg,
        Err(v1_error) => {
            engine = new_engine(true);
            engine
                .add_policy(p.name.clone(), p.text.clone())
                .map_err(|_| format!("does not load: {v1_error}"))?
        }
    };
    engine.add_data_json(&data.to_string()).map_err(|e| format!("parameters: {e}"))?;
    let mut denials = Vec::new();
    let mut warns = Vec::new();
    // The built-in pack defines only `deny`; conftest policies may use all three.
    let rules: &[(&str, bool)] = match p.origin {
        Origin::Builtin => &[("deny", true)],
        _ => &[("deny", true), ("violation", true), ("warn", false)],
    };
    for input in inputs {
        engine.set_input((*input).clone());
        for &(rule, denying) in rules {
            // A query, not eval_rule: a rule the policy does not define is simply
            // undefined (no result), not an error.
            let results = engine
                .eval_query(format!("{package}.{rule}"), false)
                .map_err(|e| format!("evaluating {rule}: {e}"))?;
            let Some(value) =
                results.result.into_iter().next().and_then(|r| r.expressions.into_iter().next())
            else {
                continue;
            };
            let json: serde_json::Value = match value.value {
                regorus::Value::Undefined => continue,
                v => serde_json::from_str(&v.to_json_str().map_err(|e| format!("{rule}: {e}"))?)
                    .map_err(|e| format!("{rule}: {e}"))?,
            };
            for item in as_items(json) {
                let f = finding(p, item);
                if denying { denials.push(f) } else { warns.push(f) }
            }
        }
    }
    Ok((denials, warns))
}

fn as_items(v: serde_json::Value) -> Vec<serde_json::Value> {
    match v {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Null | serde_json::Value::Bool(false) => vec![],
        // A boolean `deny` (`deny if …`): a denial without a message.
        serde_json::Value::Bool(true) => vec![serde_json::Value::String(String::new())],
        other => vec![other],
    }
}

fn finding(p: &Policy, item: serde_json::Value) -> Finding {
    let default_rule = p.name.rsplit('/').next().unwrap_or(&p.name).trim_end_matches(".rego").to_string();
    let get = |k: &str| item.get(k).and_then(|v| v.as_str()).map(str::to_string);
    let (rule, address, message) = match &item {
        serde_json::Value::String(s) => (default_rule, String::new(), s.clone()),
        serde_json::Value::Object(_) => (
            get("rule").unwrap_or(default_rule),
            get("address").or_else(|| get("resource")).unwrap_or_default(),
            get("msg").or_else(|| get("message")).unwrap_or_else(|| item.to_string()),
        ),
        other => (default_rule, String::new(), other.to_string()),
    };
    Finding { policy: p.name.clone(), origin: p.origin, enforcement: p.enforcement, rule, address, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scoped_rules_name_their_types_and_others_see_everything() {
        let pack = builtin_pack();
        let scope = |id: &str| {
            type_scope(pack.iter().find(|p| p.name == format!("builtin/{id}")).unwrap_or(&pack[0]))
        };
        let db = scope("database_protection").unwrap_or_default();
        assert!(
            db.contains("aws_db_instance")
                && db.contains("aws_dynamodb_table")
                && !db.contains("aws_s3_bucket")
        );
        let storage = scope("storage_encryption").unwrap_or_default();
        assert!(storage.contains("aws_s3_bucket_server_side_encryption_configuration"));
        assert!(scope("required_tags").is_none());
        assert!(scope("container_limits").is_none());
    }
}
