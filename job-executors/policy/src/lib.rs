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
//!   on): `deny` (mandatory), `warn` (advisory) and `pass` (informational: a check
//!   that passed, shown and audited, never deciding), sets or arrays of strings or of
//!   objects with a non-empty string `msg`. A plan arrives as `input.plan`; each
//!   kubernetes object as a Gatekeeper-style admission review, `input.review`
//!   (`kind`, `operation`, `object`).
//!
//! The built-in pack (`src/pack/`) sees `input.resource_changes` for plans and
//! `input.manifests` for manifests, and `input.byoc` (source, phase, operation,
//! install) in both. Nothing is silently ignored: a module in a package no convention
//! queries, one that defines none of its convention's rules, one that does not parse
//! and one that fails to evaluate each deny, with a reason code. Any limit denies too.

mod eval;
mod input;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::Digest as _;

pub use eval::{Loaded, evaluate, load};
pub use input::{inputs_for, object_identity, parse_document};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Terraform,
    /// A sandbox's terraform run (provision, reprovision, deprovision): a plan.
    Sandbox,
    Helm,
    Kubernetes,
}

/// An input, source or operation the engine cannot take as given: what is wrong with it.
/// (Evaluating over it would be deciding about something other than what was asked:
/// every caller denies.)
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InputError(pub String);

impl From<String> for InputError {
    fn from(s: String) -> Self {
        InputError(s)
    }
}

impl Source {
    pub fn parse(s: &str) -> Result<Source, InputError> {
        match s {
            "terraform" => Ok(Source::Terraform),
            "sandbox" => Ok(Source::Sandbox),
            "helm" => Ok(Source::Helm),
            "kubernetes" => Ok(Source::Kubernetes),
            other => {
                Err(InputError(format!("source {other:?} must be terraform, sandbox, helm or kubernetes")))
            }
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
    pub fn parse(s: &str) -> Result<Admission, InputError> {
        match s.to_ascii_uppercase().as_str() {
            "CREATE" => Ok(Admission::Create),
            "UPDATE" => Ok(Admission::Update),
            "DELETE" => Ok(Admission::Delete),
            _ => Err(InputError(format!("operation {s:?} must be CREATE, UPDATE or DELETE"))),
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

/// What a queried rule's findings do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleKind {
    /// Denies (or, in an advisory policy, warns).
    Deny,
    Warn,
    /// Informational: a check that passed (nuon's `pass`); never changes the verdict.
    Pass,
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
    /// The rules queried, and what each one's findings do.
    fn rules(self) -> &'static [(&'static str, RuleKind)] {
        use RuleKind::*;
        match self {
            Convention::Builtin => &[("deny", Deny)],
            Convention::Conftest => &[("deny", Deny), ("violation", Deny), ("warn", Warn)],
            Convention::Nuon => &[("deny", Deny), ("warn", Warn), ("pass", Pass)],
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
    /// The customer's guardrails when the job was admitted (`input.byoc.context`, and
    /// `input.context` for Gatekeeper-shaped inputs): `now`, the maintenance `window`
    /// open for the job or null, the `role`. Null outside a job.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub context: serde_json::Value,
    /// A drift check (`input.byoc.drift`): the document is the refreshed state's
    /// changes made outside terraform, not a plan anyone proposed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drift: bool,
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
    /// The rule that produced it (`deny`, `violation`, `warn`, `pass`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub from_rule: String,
    /// A finding object's fields other than `msg`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<serde_json::Value>,
}

impl Finding {
    /// What a job's result names of it: rule, address, policy (never the message).
    pub fn reference(&self) -> serde_json::Value {
        serde_json::json!({"rule": self.rule, "address": self.address, "policy": self.policy})
    }

    /// `rule@address`, or `rule (message)` when the policy named no address.
    pub fn label(&self) -> String {
        if self.address.is_empty() {
            // A conftest or nuon message about a plan names what it found.
            format!("{} ({})", self.rule, self.message.chars().take(120).collect::<String>())
        } else {
            format!("{}@{}", self.rule, self.address)
        }
    }
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
    /// `pass` rules: checks that passed, for the record (they never decide).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub passes: Vec<Finding>,
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
            .map(Finding::label)
            .chain(self.errors.iter().map(|e| format!("{} failed ({})", e.policy, e.code)))
            .collect()
    }

    /// The checks that passed (`pass` rules), one item each as in [`Decision::denials`].
    pub fn passed(&self) -> Vec<String> {
        self.passes.iter().map(Finding::label).collect()
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
            Err(e) => denied(&self.policies, self.input.as_bytes(), "(input)", e.0),
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
        passes: vec![],
        errors: vec![PolicyError {
            policy: what.into(),
            origin: Origin::Builtin,
            reason,
            code: codes::INPUT_ERROR.into(),
        }],
        elapsed_ms: 0,
    }
}
