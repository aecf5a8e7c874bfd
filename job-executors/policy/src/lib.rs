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

#[derive(Debug, Clone)]
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
#[derive(Debug, Clone, Serialize)]
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

/// What the policies are asked about, as parsed JSON.
#[derive(Debug, Clone)]
pub enum Document {
    /// `terraform show -json` of a saved plan.
    Plan(serde_json::Value),
    /// Rendered manifests (helm template, kubectl manifests), one object each.
    Manifests(Vec<serde_json::Value>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Allow,
    Deny,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
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

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PolicyError {
    pub policy: String,
    pub origin: Origin,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct PolicyRef {
    pub name: String,
    pub origin: Origin,
    pub enforcement: Enforcement,
    pub digest: String,
}

#[derive(Debug, Clone, Serialize)]
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

/// Parse `bytes` as `source` expects: a plan (JSON object) or manifests (a JSON array
/// of objects, one object, or a `{"items": [...]}` list).
pub fn parse_document(source: Source, bytes: &[u8], limits: &Limits) -> Result<Document, String> {
    if bytes.len() > limits.max_input_bytes {
        return Err(format!(
            "input is {} bytes, over the {} byte limit",
            bytes.len(),
            limits.max_input_bytes
        ));
    }
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("input is not JSON: {e}"))?;
    match source {
        Source::Terraform => {
            if !v.get("resource_changes").is_some_and(|r| r.is_array()) && v.get("format_version").is_none() {
                return Err("input is not a terraform plan (no format_version or resource_changes)".into());
            }
            Ok(Document::Plan(v))
        }
        Source::Helm | Source::Kubernetes => {
            let items = match v {
                serde_json::Value::Array(a) => a,
                serde_json::Value::Object(ref o) if o.get("items").is_some_and(|i| i.is_array()) => {
                    o["items"].as_array().cloned().unwrap_or_default()
                }
                o @ serde_json::Value::Object(_) => vec![o],
                _ => return Err("manifests must be a JSON object or array of objects".into()),
            };
            if items.iter().any(|m| !m.is_object() || m.get("kind").is_none()) {
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
    let byoc = serde_json::to_value(ctx).unwrap_or_default();
    // Built-ins see one input; conftest-style policies see the plan, or each manifest.
    let (pack_input, conftest_inputs) = match doc {
        Document::Plan(plan) => {
            let mut p = plan.clone();
            if let Some(o) = p.as_object_mut() {
                o.insert("byoc".into(), byoc.clone());
            }
            (p.clone(), vec![p])
        }
        Document::Manifests(ms) => (serde_json::json!({"byoc": byoc, "manifests": ms}), ms.clone()),
    };
    let to_value =
        |v: &serde_json::Value| regorus::Value::from_json_str(&v.to_string()).map_err(|e| e.to_string());
    let pack_input = to_value(&pack_input);
    let conftest_inputs: Vec<_> = conftest_inputs.iter().map(to_value).collect();
    let data = serde_json::json!({"byoc": {"params": params}});

    let mut d = Decision {
        verdict: Verdict::Allow,
        input_digest: format!("sha256:{}", hex::encode(sha2::Sha256::digest(input_bytes))),
        policies: policies
            .iter()
            .map(|p| PolicyRef {
                name: p.name.clone(),
                origin: p.origin,
                enforcement: p.enforcement,
                digest: p.digest(),
            })
            .collect(),
        violations: vec![],
        warnings: vec![],
        errors: vec![],
        elapsed_ms: 0,
    };
    for p in policies {
        let inputs: Vec<&Result<regorus::Value, String>> = match p.origin {
            Origin::Builtin => vec![&pack_input],
            _ => conftest_inputs.iter().collect(),
        };
        match eval_policy(p, &data, &inputs, limits) {
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

fn eval_policy(
    p: &Policy,
    data: &serde_json::Value,
    inputs: &[&Result<regorus::Value, String>],
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
    for input in inputs {
        let input = match input {
            Ok(v) => v.clone(),
            Err(e) => return Err(format!("input: {e}")),
        };
        engine.set_input(input);
        for (rule, denying) in [("deny", true), ("violation", true), ("warn", false)] {
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
