//! The customer's side of policy: their own Rego files and settings on the VM
//! (`/etc/byoc-runner/policies/`), which the vendor cannot switch off, assembled with
//! the built-in pack and the vendor's policies into one set for `byoc-policy`.
//!
//! `policies.toml` (optional):
//!
//! ```toml
//! [params]                 # data.byoc.params for every policy
//! approved_registries = ["123456789012.dkr.ecr.eu-west-1.amazonaws.com/"]
//! required_tags = ["owner", "cost-center"]
//!
//! [builtin]                # built-in rules: mandatory (default), advisory or off
//! required_tags = "advisory"
//!
//! [enforcement]            # the customer's own files: mandatory (default) or advisory
//! "replicas.rego" = "advisory"
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use byoc_policy::{BUILTIN_RULES, Enforcement, Origin, Policy};
use serde::Deserialize;

pub const DEFAULT_POLICY_DIR: &str = "/etc/byoc-runner/policies";
pub const SETTINGS_FILE: &str = "policies.toml";
/// Larger policy files are refused (a policy is source code, not data).
const MAX_POLICY_BYTES: u64 = 1 << 20;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Settings {
    #[serde(default)]
    params: toml::Table,
    #[serde(default)]
    builtin: BTreeMap<String, String>,
    #[serde(default)]
    enforcement: BTreeMap<String, String>,
}

/// What the customer configured: their policies, the built-in pack as they set it, and
/// the parameters.
#[derive(Debug, Clone)]
pub struct CustomerPolicies {
    pub dir: PathBuf,
    /// The built-in pack at the customer's levels (rules set `off` are absent).
    pub builtin: Vec<Policy>,
    pub own: Vec<Policy>,
    pub params: serde_json::Value,
    /// Built-in rules the customer switched off.
    pub off: Vec<String>,
}

impl CustomerPolicies {
    /// The scope a job's (or a local run's, or `policy test`'s) decisions are made in:
    /// these policies with the vendor's, evaluated by this very binary as
    /// `policy-eval` under an address-space limit.
    pub fn scope(
        &self,
        vendor: Vec<Policy>,
        decision: Decision,
        limits: byoc_policy::Limits,
        memory_mib: u64,
    ) -> byoc_job_executors::JobPolicies {
        byoc_job_executors::JobPolicies {
            policies: self.with_vendor(vendor),
            params: self.params.clone(),
            phase: decision.phase,
            operation: decision.operation,
            install: decision.install,
            limits,
            cluster_policies: decision.cluster_policies,
            context: serde_json::Value::Null,
            evaluator: std::env::current_exe().ok().map(|program| byoc_job_executors::Evaluator {
                program,
                args: vec!["policy-eval".into()],
                memory_mib,
            }),
        }
    }

    /// Everything that applies to a decision: built-ins, the vendor's, the customer's.
    pub fn with_vendor(&self, vendor: Vec<Policy>) -> Vec<Policy> {
        let mut all = self.builtin.clone();
        all.extend(vendor);
        all.extend(self.own.iter().cloned());
        all
    }
}

/// What a decision is about: the lifecycle phase (the role's type), the operation
/// (`component.deploy`), the install, and the app's cluster policies.
#[derive(Debug, Clone, Default)]
pub struct Decision {
    pub phase: String,
    pub operation: String,
    pub install: String,
    pub cluster_policies: Vec<(String, String)>,
}

fn level(s: &str) -> Option<Enforcement> {
    match s {
        "mandatory" => Some(Enforcement::Mandatory),
        "advisory" => Some(Enforcement::Advisory),
        _ => None,
    }
}

/// Load the customer's directory (a missing directory is no customer policies). Every
/// problem is reported at once.
pub fn load(dir: &Path) -> Result<CustomerPolicies, Vec<String>> {
    let mut problems = Vec::new();
    let settings: Settings = match std::fs::read_to_string(dir.join(SETTINGS_FILE)) {
        Ok(t) => toml::from_str(&t).unwrap_or_else(|e| {
            problems.push(format!("{}: {e}", dir.join(SETTINGS_FILE).display()));
            Settings::default()
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Settings::default(),
        Err(e) => {
            problems.push(format!("{}: {e}", dir.join(SETTINGS_FILE).display()));
            Settings::default()
        }
    };
    let mut builtin = Vec::new();
    let mut off = Vec::new();
    for name in settings.builtin.keys() {
        if !BUILTIN_RULES.contains(&name.as_str()) {
            problems.push(format!(
                "{SETTINGS_FILE} [builtin]: no built-in rule {name:?} (rules: {})",
                BUILTIN_RULES.join(", ")
            ));
        }
    }
    for mut p in byoc_policy::builtin_pack() {
        let id = p.name.trim_start_matches("builtin/").to_string();
        match settings.builtin.get(&id).map(String::as_str) {
            None => builtin.push(p),
            Some("off") => off.push(id),
            Some(l) => match level(l) {
                Some(e) => {
                    p.enforcement = e;
                    builtin.push(p);
                }
                None => problems
                    .push(format!("{SETTINGS_FILE} [builtin] {id} = {l:?}: mandatory, advisory or off")),
            },
        }
    }
    let mut own = Vec::new();
    let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "rego"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => vec![],
        Err(e) => {
            problems.push(format!("{}: {e}", dir.display()));
            vec![]
        }
    };
    files.sort();
    for path in &files {
        let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        if size > MAX_POLICY_BYTES {
            problems.push(format!("{}: larger than {MAX_POLICY_BYTES} bytes", path.display()));
            continue;
        }
        let enforcement = match settings.enforcement.get(&file).map(String::as_str) {
            None => Enforcement::Mandatory,
            Some(l) => match level(l) {
                Some(e) => e,
                None => {
                    problems.push(format!(
                        "{SETTINGS_FILE} [enforcement] {file:?} = {l:?}: mandatory or advisory"
                    ));
                    continue;
                }
            },
        };
        match std::fs::read_to_string(path) {
            Ok(text) => own.push(Policy {
                name: format!("customer/{file}"),
                origin: Origin::Customer,
                enforcement,
                text,
            }),
            Err(e) => problems.push(format!("{}: {e}", path.display())),
        }
    }
    for file in settings.enforcement.keys() {
        if !files.iter().any(|p| p.file_name().is_some_and(|f| f.to_string_lossy() == *file)) {
            problems
                .push(format!("{SETTINGS_FILE} [enforcement]: no policy file {file:?} in {}", dir.display()));
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    let params = serde_json::to_value(&settings.params).unwrap_or_default();
    Ok(CustomerPolicies { dir: dir.to_path_buf(), builtin, own, params, off })
}

/// A policy file that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct ReadPolicyError {
    pub path: PathBuf,
    pub source: std::io::Error,
}

/// Policies from files given on the command line (vendors testing theirs).
pub fn load_files(paths: &[PathBuf], origin: Origin) -> Result<Vec<Policy>, ReadPolicyError> {
    paths
        .iter()
        .map(|p| {
            let text =
                std::fs::read_to_string(p).map_err(|source| ReadPolicyError { path: p.clone(), source })?;
            let file = p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            let prefix = match origin {
                Origin::Vendor => "vendor",
                Origin::Customer => "customer",
                Origin::Builtin => "builtin",
            };
            Ok(Policy { name: format!("{prefix}/{file}"), origin, enforcement: Enforcement::Mandatory, text })
        })
        .collect()
}

/// One line of the description at the top of a built-in rule (its first comment).
pub fn description(p: &Policy) -> String {
    p.text
        .lines()
        .take_while(|l| l.starts_with('#'))
        .map(|l| l.trim_start_matches('#').trim())
        .collect::<Vec<_>>()
        .join(" ")
}
