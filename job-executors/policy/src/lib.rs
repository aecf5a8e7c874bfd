//! Policy decisions: Rego evaluated in-process with `regorus` over one normalized
//! input, pure (input in, decision out, no I/O).
//!
//! Two conventions of policy authors run unchanged, told apart by the module's package:
//!
//! - **conftest** (`package main`): `deny`, `violation` and `warn` rules whose values are
//!   strings or objects with `msg`. A terraform plan is their `input` as
//!   `terraform show -json` prints it; for helm and kubernetes each manifest is `input`
//!   on its own (conftest's default).
//! - **nuon** (`package nuon`, the convention of the system this product is modelled
//!   on): `deny` (mandatory) and `warn` (advisory), sets or arrays of strings or of
//!   objects with a non-empty string `msg`. A plan arrives as `input.plan`; each
//!   kubernetes object as a Gatekeeper-style admission review, `input.review`
//!   (`kind`, `operation`, `object`).
//!
//! The built-in pack (`src/pack/`) sees `input.resource_changes` for plans and
//! `input.manifests` for manifests, and `input.byoc` (source, phase, operation,
//! install) in both. Nothing is silently ignored: a module in a package no convention
//! queries, one that defines none of its convention's rules, one that does not parse
//! and one that fails to evaluate each deny, with a reason code. Any limit denies too.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::Digest as _;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Terraform,
    /// A sandbox's terraform run (provision, reprovision, deprovision): a plan.
    Sandbox,
    Helm,
    Kubernetes,
}

impl Source {
    pub fn parse(s: &str) -> Result<Source, String> {
        match s {
            "terraform" => Ok(Source::Terraform),
            "sandbox" => Ok(Source::Sandbox),
            "helm" => Ok(Source::Helm),
            "kubernetes" => Ok(Source::Kubernetes),
            other => Err(format!("source {other:?} must be terraform, sandbox, helm or kubernetes")),
        }
    }

    /// Whether the document is a terraform plan (else manifests).
    pub fn is_plan(self) -> bool {
        matches!(self, Source::Terraform | Source::Sandbox)
    }
}

/// The admission operation a manifest is reviewed under (`input.review.operation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "UPPERCASE")]
pub enum Admission {
    /// A first install.
    Create,
    /// An upgrade or an apply.
    #[default]
    Update,
    /// An uninstall, a teardown, a prune.
    Delete,
}

impl Admission {
    pub fn parse(s: &str) -> Result<Admission, String> {
        match s.to_ascii_uppercase().as_str() {
            "CREATE" => Ok(Admission::Create),
            "UPDATE" => Ok(Admission::Update),
            "DELETE" => Ok(Admission::Delete),
            _ => Err(format!("operation {s:?} must be CREATE, UPDATE or DELETE")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Admission::Create => "CREATE",
            Admission::Update => "UPDATE",
            Admission::Delete => "DELETE",
        }
    }
}

/// Which rule-naming convention a policy module follows (from its package).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Convention {
    /// The built-in pack (`package byoc.builtin.*`, `deny`).
    Builtin,
    /// `package main`: `deny`, `violation`, `warn`; input = the document.
    Conftest,
    /// `package nuon`: `deny`, `warn`; input = `{plan}` or `{review}`.
    Nuon,
}

impl Convention {
    /// The rules queried, and whether each denies.
    fn rules(self) -> &'static [(&'static str, bool)] {
        match self {
            Convention::Builtin => &[("deny", true)],
            Convention::Conftest => &[("deny", true), ("violation", true), ("warn", false)],
            Convention::Nuon => &[("deny", true), ("warn", false)],
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Convention::Builtin => "builtin",
            Convention::Conftest => "conftest",
            Convention::Nuon => "nuon",
        }
    }
}

/// Reason codes of policy errors (each denies).
pub mod codes {
    /// The file does not parse (as Rego v1, nor as v0).
    pub const LOAD_ERROR: &str = "policy_load_error";
    /// Its package or rules match no convention the runner queries.
    pub const UNRECOGNISED: &str = "policy_unrecognised";
    /// It failed while evaluating, produced a value of the wrong shape, or ran out of time.
    pub const EVAL_ERROR: &str = "policy_eval_error";
    /// The document could not be read, or the evaluator failed.
    pub const INPUT_ERROR: &str = "policy_input_error";
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
    /// What the manifests are reviewed as (nuon's `input.review.operation`).
    #[serde(default)]
    pub admission: Admission,
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
    /// The rule id (built-in pack), or the policy's name for conftest/nuon messages.
    pub rule: String,
    /// Resource address or `Kind/namespace/name`; empty when the policy gave none.
    pub address: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub convention: Option<Convention>,
    /// The rule that produced it (`deny`, `violation`, `warn`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub from_rule: String,
    /// A finding object's fields other than `msg`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PolicyError {
    pub policy: String,
    pub origin: Origin,
    pub reason: String,
    /// One of [`codes`].
    #[serde(default)]
    pub code: String,
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
    /// What denied, one item each: `rule@address` (or `rule (message)`) per violation,
    /// then `<policy> failed` per error (for job errors and audit details).
    pub fn denials(&self) -> Vec<String> {
        self.violations
            .iter()
            .map(|v| {
                if v.address.is_empty() {
                    // A conftest or nuon message about a plan names what it found.
                    format!("{} ({})", v.rule, v.message.chars().take(120).collect::<String>())
                } else {
                    format!("{}@{}", v.rule, v.address)
                }
            })
            .chain(self.errors.iter().map(|e| format!("{} failed ({})", e.policy, e.code)))
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
        errors: vec![PolicyError {
            policy: what.into(),
            origin: Origin::Builtin,
            reason,
            code: codes::INPUT_ERROR.into(),
        }],
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
        Source::Terraform | Source::Sandbox => {
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

/// What each convention is given: the built-in pack one input for the whole document;
/// conftest the plan, or each manifest; nuon `{plan}`, or one admission review per
/// object. Each item carries the object's identity (`Kind/namespace/name`; empty for a
/// plan).
struct Inputs {
    builtin: regorus::Value,
    conftest: Vec<(regorus::Value, String)>,
    nuon: Vec<(regorus::Value, String)>,
}

fn key(k: &str) -> regorus::Value {
    regorus::Value::from(k)
}

fn get<'a>(v: &'a regorus::Value, k: &str) -> Option<&'a regorus::Value> {
    v.as_object().ok()?.get(&key(k))
}

fn get_str(v: &regorus::Value, k: &str) -> Option<String> {
    get(v, k)?.as_string().ok().map(|s| s.to_string())
}

/// `Kind/namespace/name`, the namespace `default` when the object names none.
pub fn object_identity(obj: &regorus::Value) -> String {
    let meta = get(obj, "metadata");
    let field = |k: &str| meta.and_then(|m| get_str(m, k));
    format!(
        "{}/{}/{}",
        get_str(obj, "kind").unwrap_or_default(),
        field("namespace").filter(|n| !n.is_empty()).unwrap_or_else(|| "default".into()),
        field("name").unwrap_or_default()
    )
}

/// The admission review of one object, as Gatekeeper builds it: `group` absent for the
/// core API (`apiVersion: v1`).
fn review(obj: &regorus::Value, admission: Admission) -> regorus::Value {
    let api_version = get_str(obj, "apiVersion").unwrap_or_default();
    let (group, version) = match api_version.split_once('/') {
        Some((g, v)) => (Some(g.to_string()), v.to_string()),
        None => (None, api_version),
    };
    let mut kind = std::collections::BTreeMap::new();
    kind.insert(key("kind"), regorus::Value::from(get_str(obj, "kind").unwrap_or_default()));
    if let Some(g) = group {
        kind.insert(key("group"), regorus::Value::from(g));
    }
    kind.insert(key("version"), regorus::Value::from(version));
    let mut r = std::collections::BTreeMap::new();
    r.insert(key("kind"), regorus::Value::from(kind));
    r.insert(key("operation"), regorus::Value::from(admission.as_str()));
    r.insert(key("object"), obj.clone());
    let mut input = std::collections::BTreeMap::new();
    input.insert(key("review"), regorus::Value::from(r));
    regorus::Value::from(input)
}

impl Inputs {
    fn new(doc: &Document, ctx: &Context) -> Inputs {
        let byoc = regorus::Value::from(serde_json::to_value(ctx).unwrap_or_default());
        match doc {
            Document::Plan(plan) => {
                let mut with_byoc = plan.clone();
                if let Ok(o) = with_byoc.as_object_mut() {
                    o.insert(key("byoc"), byoc);
                }
                // The plan exactly as terraform printed it, under `plan`.
                let mut nuon = std::collections::BTreeMap::new();
                nuon.insert(key("plan"), plan.clone());
                Inputs {
                    builtin: with_byoc.clone(),
                    conftest: vec![(with_byoc, String::new())],
                    nuon: vec![(regorus::Value::from(nuon), String::new())],
                }
            }
            Document::Manifests(ms) => {
                let mut o = std::collections::BTreeMap::new();
                o.insert(key("byoc"), byoc);
                o.insert(key("manifests"), regorus::Value::from(ms.clone()));
                Inputs {
                    builtin: regorus::Value::from(o),
                    conftest: ms.iter().map(|m| (m.clone(), object_identity(m))).collect(),
                    nuon: ms.iter().map(|m| (review(m, ctx.admission), object_identity(m))).collect(),
                }
            }
        }
    }
}

/// The inputs a policy of `convention` is evaluated over for `doc`, as JSON, each with
/// the identity of the object it reviews (empty for a plan). For tests and tools that
/// compare with another engine.
pub fn inputs_for(convention: Convention, doc: &Document, ctx: &Context) -> Vec<(serde_json::Value, String)> {
    let inputs = Inputs::new(doc, ctx);
    let json = |v: &regorus::Value| {
        v.to_json_str().ok().and_then(|s| serde_json::from_str(&s).ok()).unwrap_or(serde_json::Value::Null)
    };
    match convention {
        Convention::Builtin => vec![(json(&inputs.builtin), String::new())],
        Convention::Conftest => inputs.conftest.iter().map(|(v, id)| (json(v), id.clone())).collect(),
        Convention::Nuon => inputs.nuon.iter().map(|(v, id)| (json(v), id.clone())).collect(),
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
    let inputs = Inputs::new(doc, ctx);
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
    let is_plan = matches!(doc, Document::Plan(_));
    let results: Vec<Result<Findings, PolicyError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (inputs, data, next) = (&inputs, &data, &next);
                scope.spawn(move || {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(p) = policies.get(i) else { break };
                        done.push((i, eval_policy(p, data, inputs, is_plan, ctx.admission, limits)));
                    }
                    done
                })
            })
            .collect();
        let mut all: Vec<(usize, Result<Findings, PolicyError>)> =
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
            code: codes::EVAL_ERROR.into(),
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
            Err(e) => d.errors.push(e),
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

/// A policy loaded into an engine of its own (no module can read another's rules or
/// data), with its convention and the queried rules it declares.
pub struct Loaded {
    engine: regorus::Engine,
    /// `data.<package>`.
    pub package: String,
    pub convention: Convention,
    /// The rules queried, in order, and whether each denies.
    pub rules: Vec<(String, bool)>,
}

fn policy_error(p: &Policy, code: &str, reason: String) -> PolicyError {
    PolicyError { policy: p.name.clone(), origin: p.origin, reason, code: code.into() }
}

/// Parse `p` (Rego v1, or v0 as conftest's older policies are written), tell its
/// convention from its package and check it defines a rule that convention queries.
/// Anything else is an error: a policy that would never be evaluated must not pass
/// for one that allows.
pub fn load(p: &Policy, limits: &Limits) -> Result<Loaded, PolicyError> {
    let new_engine = |v0: bool| {
        let mut e = regorus::Engine::new();
        e.set_rego_v0(v0);
        e.set_execution_timer_config(regorus::utils::limits::ExecutionTimerConfig {
            limit: limits.time_per_policy,
            check_interval: NonZeroU32::new(256).unwrap_or(NonZeroU32::MIN),
        });
        e
    };
    let mut engine = new_engine(false);
    let package = match engine.add_policy(p.name.clone(), p.text.clone()) {
        Ok(pkg) => pkg,
        Err(v1_error) => {
            engine = new_engine(true);
            engine.add_policy(p.name.clone(), p.text.clone()).map_err(|_| {
                policy_error(p, codes::LOAD_ERROR, format!("does not load (not valid Rego): {v1_error}"))
            })?
        }
    };
    let convention = match (p.origin, package.as_str()) {
        (Origin::Builtin, _) => Convention::Builtin,
        (_, "data.main") => Convention::Conftest,
        (_, "data.nuon") => Convention::Nuon,
        (_, other) => {
            return Err(policy_error(
                p,
                codes::UNRECOGNISED,
                format!(
                    "package {} is not one the runner queries, so nothing in it would be evaluated: \
                     use `package nuon` (deny, warn) or `package main` (conftest: deny, violation, warn)",
                    other.trim_start_matches("data.")
                ),
            ));
        }
    };
    let declared = |r: &str| engine.has_declared_rule_rooted_at(&p.name, r).unwrap_or(false);
    let mut rules: Vec<(String, bool)> =
        convention.rules().iter().filter(|(r, _)| declared(r)).map(|(r, d)| (r.to_string(), *d)).collect();
    if convention == Convention::Conftest {
        // conftest also queries rules named with a suffix: deny_public_bucket,
        // violation_x, warn_y. Candidates come from the text, the engine confirms each.
        for name in suffixed_rule_candidates(&p.text) {
            if !rules.iter().any(|(r, _)| *r == name) && declared(&name) {
                let denying = !name.starts_with("warn_");
                rules.push((name, denying));
            }
        }
    }
    if rules.is_empty() {
        let wanted: Vec<&str> = convention.rules().iter().map(|(r, _)| *r).collect();
        return Err(policy_error(
            p,
            codes::UNRECOGNISED,
            format!(
                "package {} defines none of {}, so nothing in it would be evaluated",
                package.trim_start_matches("data."),
                wanted.join(", ")
            ),
        ));
    }
    Ok(Loaded { engine, package, convention, rules })
}

fn eval_policy(
    p: &Policy,
    data: &serde_json::Value,
    inputs: &Inputs,
    is_plan: bool,
    admission: Admission,
    limits: &Limits,
) -> Result<Findings, PolicyError> {
    let Loaded { mut engine, package, convention, rules } = load(p, limits)?;
    // Deleting objects is reviewed by policies that know the operation (nuon's
    // `input.review.operation`): the built-in pack and conftest's convention judge what
    // is deployed (limits, ingress, registries), which a deletion does not deploy.
    if !is_plan && admission == Admission::Delete && convention != Convention::Nuon {
        return Ok((vec![], vec![]));
    }
    let eval_error = |reason: String| policy_error(p, codes::EVAL_ERROR, reason);
    engine.add_data_json(&data.to_string()).map_err(|e| eval_error(format!("parameters: {e}")))?;
    let scoped;
    let items: Vec<(&regorus::Value, &str)> = match convention {
        Convention::Builtin => match type_scope(p) {
            Some(types) if is_plan => {
                scoped = only_types(&inputs.builtin, &types);
                vec![(&scoped, "")]
            }
            _ => vec![(&inputs.builtin, "")],
        },
        Convention::Conftest => inputs.conftest.iter().map(|(v, id)| (v, id.as_str())).collect(),
        Convention::Nuon => inputs.nuon.iter().map(|(v, id)| (v, id.as_str())).collect(),
    };
    let mut denials = Vec::new();
    let mut warns = Vec::new();
    for (input, object) in items {
        engine.set_input(input.clone());
        for (rule, denying) in &rules {
            let (rule, denying) = (rule.as_str(), *denying);
            let results = engine
                .eval_query(format!("{package}.{rule}"), false)
                .map_err(|e| eval_error(format!("evaluating {rule}{}: {e}", on(object))))?;
            let Some(value) =
                results.result.into_iter().next().and_then(|r| r.expressions.into_iter().next())
            else {
                continue;
            };
            let json: serde_json::Value = match value.value {
                regorus::Value::Undefined => continue,
                v => serde_json::from_str(&v.to_json_str().map_err(|e| eval_error(format!("{rule}: {e}")))?)
                    .map_err(|e| eval_error(format!("{rule}: {e}")))?,
            };
            let found = match convention {
                Convention::Nuon => {
                    nuon_items(json).map_err(|why| eval_error(format!("{rule}{}: {why}", on(object))))?
                }
                _ => as_items(json),
            };
            for item in found {
                let f = finding(p, convention, rule, item, object);
                if denying { denials.push(f) } else { warns.push(f) }
            }
        }
    }
    Ok((denials, warns))
}

/// Names at the start of a line that look like conftest's suffixed rules
/// (`deny_x`, `violation_x`, `warn_x`), each once.
fn suffixed_rule_candidates(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        let name: String = line.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let suffixed =
            ["deny_", "violation_", "warn_"].iter().any(|p| name.len() > p.len() && name.starts_with(p));
        if suffixed && !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

fn on(object: &str) -> String {
    if object.is_empty() { String::new() } else { format!(" on {object}") }
}

/// `deny`/`warn` of a nuon policy: a set or array of strings or of objects with a
/// non-empty string `msg`. Anything else is an error (which denies): a policy whose
/// findings cannot be read must not pass for one that found nothing.
fn nuon_items(v: serde_json::Value) -> Result<Vec<serde_json::Value>, String> {
    let items = match v {
        serde_json::Value::Array(a) => a,
        other => return Err(format!("must be a set or an array of messages, not {}", kind_of(&other))),
    };
    for item in &items {
        match item {
            serde_json::Value::String(_) => {}
            serde_json::Value::Object(o)
                if o.get("msg").and_then(|m| m.as_str()).is_some_and(|m| !m.is_empty()) => {}
            serde_json::Value::Object(_) => return Err("an object item has no non-empty string `msg`".into()),
            other => {
                return Err(format!("an item is {}, not a string or an object with `msg`", kind_of(other)));
            }
        }
    }
    Ok(items)
}

fn kind_of(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
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

fn finding(
    p: &Policy,
    convention: Convention,
    from_rule: &str,
    item: serde_json::Value,
    object: &str,
) -> Finding {
    let default_rule = p.name.rsplit('/').next().unwrap_or(&p.name).trim_end_matches(".rego").to_string();
    let get = |k: &str| item.get(k).and_then(|v| v.as_str()).map(str::to_string);
    let (rule, address, message, details) = match &item {
        serde_json::Value::String(s) => (default_rule, object.to_string(), s.clone(), None),
        serde_json::Value::Object(o) => {
            let rest: serde_json::Map<String, serde_json::Value> =
                o.iter().filter(|(k, _)| k.as_str() != "msg").map(|(k, v)| (k.clone(), v.clone())).collect();
            (
                get("rule").unwrap_or(default_rule),
                get("address").or_else(|| get("resource")).unwrap_or_else(|| object.to_string()),
                get("msg").or_else(|| get("message")).unwrap_or_else(|| item.to_string()),
                (!rest.is_empty() && convention != Convention::Builtin)
                    .then_some(serde_json::Value::Object(rest)),
            )
        }
        other => (default_rule, object.to_string(), other.to_string(), None),
    };
    Finding {
        policy: p.name.clone(),
        origin: p.origin,
        enforcement: p.enforcement,
        rule,
        address,
        message,
        convention: (convention != Convention::Builtin).then_some(convention),
        from_rule: if convention == Convention::Builtin { String::new() } else { from_rule.to_string() },
        details,
    }
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
