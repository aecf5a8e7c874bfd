//! The vendor's policy declarations, as the modelled system's app configs write them
//! (`policies.toml`), and which of them apply to a job.
//!
//! ```toml
//! [[policy]]
//! type = "terraform_module"          # terraform_module, helm_chart, kubernetes_manifest,
//!                                    # sandbox, kubernetes_cluster
//! engine = "opa"                     # opa, or kyverno (the default when absent)
//! contents = "./policies/no-eip-delete.rego"
//! components = ["api", "db"]         # or ["*"], or "*"
//! ```
//!
//! `opa` policies of the three component types are evaluated on the plans and manifests
//! of the components they name; `sandbox` ones on the sandbox's provision, reprovision
//! and deprovision plans; `kubernetes_cluster` (Kyverno) policies are not evaluated by
//! the runner: they are objects it applies into the cluster. A declaration that could
//! never apply to anything is an error when the app config is loaded, with every other
//! problem at once: nothing is skipped silently.

use byoc_protocol::AppConfig;
use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyType {
    TerraformModule,
    HelmChart,
    KubernetesManifest,
    Sandbox,
    KubernetesCluster,
    /// Build-time policies (the vendor's image builds): accepted, never evaluated by
    /// the runner, which builds nothing.
    DockerBuild,
    ContainerImage,
}

impl PolicyType {
    const ALL: [(&'static str, PolicyType); 7] = [
        ("terraform_module", PolicyType::TerraformModule),
        ("helm_chart", PolicyType::HelmChart),
        ("kubernetes_manifest", PolicyType::KubernetesManifest),
        ("sandbox", PolicyType::Sandbox),
        ("kubernetes_cluster", PolicyType::KubernetesCluster),
        ("docker_build", PolicyType::DockerBuild),
        ("container_image", PolicyType::ContainerImage),
    ];

    pub fn as_str(self) -> &'static str {
        Self::ALL.iter().find(|(_, t)| *t == self).map(|(n, _)| *n).unwrap_or("")
    }

    /// Whether its policies are scoped to components.
    fn per_component(self) -> bool {
        matches!(self, PolicyType::TerraformModule | PolicyType::HelmChart | PolicyType::KubernetesManifest)
    }

    /// Whether the runner evaluates policies of this type (build-time ones it never sees).
    pub fn evaluated_here(self) -> bool {
        !matches!(self, PolicyType::DockerBuild | PolicyType::ContainerImage)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Opa,
    Kyverno,
}

/// Which components a declaration names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Components {
    All,
    Named(Vec<String>),
}

/// One `[[policy]]` of `policies.toml`, checked.
#[derive(Debug, Clone)]
pub struct Declared {
    pub kind: PolicyType,
    pub engine: Engine,
    /// The `contents` path as written, and the file's text.
    pub path: String,
    pub text: String,
    pub components: Option<Components>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    policy: Vec<toml::Table>,
}

/// `./a/b` and `a/b` name the same file.
fn normalize(path: &str) -> String {
    path.trim_start_matches("./").to_string()
}

/// Every declaration of the app config, or every problem with them.
pub fn parse(app: &AppConfig) -> Result<Vec<Declared>, Vec<String>> {
    let Some(text) = &app.policies_toml else { return Ok(vec![]) };
    let file: File = toml::from_str(text).map_err(|e| vec![format!("policies.toml: {e}")])?;
    let files: std::collections::BTreeMap<String, &String> =
        app.files.iter().map(|(p, t)| (normalize(p), t)).collect();
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (i, mut t) in file.policy.into_iter().enumerate() {
        let at = |what: String| format!("policies.toml [[policy]] #{}: {what}", i + 1);
        let mut take_str = |key: &str, problems: &mut Vec<String>| match t.remove(key) {
            None => None,
            Some(toml::Value::String(s)) => Some(s),
            Some(other) => {
                problems.push(at(format!("{key} must be a string, not {}", other.type_str())));
                None
            }
        };
        let kind_s = take_str("type", &mut problems);
        let engine_s = take_str("engine", &mut problems);
        let contents = take_str("contents", &mut problems);
        let components = components_of(t.remove("components")).unwrap_or_else(|e| {
            problems.push(at(e));
            None
        });
        // `sandbox = true`: a terraform policy evaluated only for the sandbox's runs.
        let sandbox = match t.remove("sandbox") {
            None => false,
            Some(toml::Value::Boolean(b)) => b,
            Some(other) => {
                problems.push(at(format!("sandbox must be true or false, not {}", other.type_str())));
                false
            }
        };
        for key in t.keys() {
            problems.push(at(format!(
                "unknown field {key:?} (known: type, engine, contents, components, sandbox)"
            )));
        }
        let kind = kind_of(kind_s.as_deref()).map_err(|e| problems.push(at(e))).ok();
        let kind = match kind {
            Some(PolicyType::TerraformModule | PolicyType::Sandbox) if sandbox => Some(PolicyType::Sandbox),
            Some(k) if sandbox => {
                problems.push(at(format!(
                    "sandbox = true applies to the sandbox's terraform runs, not to {} policies",
                    k.as_str()
                )));
                None
            }
            k => k,
        };
        let engine = engine_of(engine_s.as_deref()).map_err(|e| problems.push(at(e))).ok();
        let text = match &contents {
            None => {
                problems.push(at("contents (the policy file's path in the app config) is required".into()));
                None
            }
            Some(p) if p.contains("://") || p.starts_with("git::") => {
                problems.push(at(format!(
                    "contents {p:?} is fetched from elsewhere: the runner judges only what the signed job \
                     carries, so the policy must be a file of the app config"
                )));
                None
            }
            Some(p) => match files.get(&normalize(p)) {
                Some(t) => Some((*t).clone()),
                None => {
                    problems.push(at(format!("contents {p:?} is not a file of the app config")));
                    None
                }
            },
        };
        let (Some(kind), Some(engine), Some(path), Some(text)) = (kind, engine, contents, text) else {
            continue;
        };
        // The modelled system: no components (or an empty list) means every component.
        let components = match components {
            None | Some(Components::Named(_)) if kind.per_component() && components_empty(&components) => {
                Some(Components::All)
            }
            c => c,
        };
        if let Err(e) = applies(kind, engine, components.is_some()) {
            problems.push(at(e));
            continue;
        }
        out.push(Declared { kind, engine, path, text, components });
    }
    if problems.is_empty() { Ok(out) } else { Err(problems) }
}

fn components_empty(c: &Option<Components>) -> bool {
    match c {
        None => true,
        Some(Components::Named(n)) => n.is_empty(),
        Some(Components::All) => false,
    }
}

/// `components`: component names, or `"*"` (alone, or as the only name) for all.
fn components_of(value: Option<toml::Value>) -> Result<Option<Components>, String> {
    match value {
        None => Ok(None),
        Some(toml::Value::String(s)) if s == "*" => Ok(Some(Components::All)),
        Some(toml::Value::Array(a)) => {
            let names: Vec<String> = a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect();
            if names.len() != a.len() || names.iter().any(|n| n.is_empty()) {
                Err("components must be component names, or [\"*\"]".into())
            } else if names.iter().any(|n| n == "*") && names.len() > 1 {
                Err("components: \"*\" names every component and must stand alone".into())
            } else if names == ["*"] {
                Ok(Some(Components::All))
            } else {
                Ok(Some(Components::Named(names)))
            }
        }
        Some(other) => Err(format!("components must be a list of names or \"*\", not {}", other.type_str())),
    }
}

fn kind_of(kind: Option<&str>) -> Result<PolicyType, String> {
    let k = kind.ok_or_else(|| "type is required".to_string())?;
    match PolicyType::ALL.iter().find(|(n, _)| *n == k) {
        Some((_, t)) => Ok(*t),
        None => {
            let known: Vec<&str> = PolicyType::ALL.iter().map(|(n, _)| *n).collect();
            Err(format!("type {k:?} is not one of {}", known.join(", ")))
        }
    }
}

fn engine_of(engine: Option<&str>) -> Result<Engine, String> {
    match engine {
        None | Some("kyverno") => Ok(Engine::Kyverno),
        Some("opa") => Ok(Engine::Opa),
        Some(other) => Err(format!("engine {other:?} is not opa or kyverno")),
    }
}

/// A declaration that could never apply to anything is refused.
fn applies(kind: PolicyType, engine: Engine, names_components: bool) -> Result<(), String> {
    match (kind, engine) {
        (PolicyType::KubernetesCluster, Engine::Opa) => {
            return Err(
                "kubernetes_cluster policies are admission policies the runner applies into the cluster: \
                 engine must be kyverno"
                    .into(),
            );
        }
        (PolicyType::KubernetesCluster, Engine::Kyverno) | (_, Engine::Opa) => {}
        // Build-time policies run where images are built, whatever their engine.
        (k, Engine::Kyverno) if !k.evaluated_here() => {}
        (k, Engine::Kyverno) => {
            return Err(format!(
                "a {} policy is Rego evaluated by the runner: set engine = \"opa\" (kyverno, the default, \
                 applies only to kubernetes_cluster)",
                k.as_str()
            ));
        }
    }
    if kind.per_component() && !names_components {
        return Err(format!(
            "a {} policy applies to the components it names: set components = [\"name\", …] or [\"*\"]",
            kind.as_str()
        ));
    }
    if !kind.per_component() && kind.evaluated_here() && names_components {
        return Err(format!("components has no meaning for {} policies", kind.as_str()));
    }
    Ok(())
}

/// The policy type a job's decisions use: from its kind and entity.
pub fn job_type(kind: &str, entity: &str) -> Option<PolicyType> {
    match (kind, entity) {
        ("terraform", "sandbox") => Some(PolicyType::Sandbox),
        ("terraform", _) => Some(PolicyType::TerraformModule),
        ("helm", _) => Some(PolicyType::HelmChart),
        ("kubernetes", _) => Some(PolicyType::KubernetesManifest),
        _ => None,
    }
}

impl Declared {
    /// Whether it is evaluated for a job of `kind` on `component`.
    pub fn applies(&self, kind: PolicyType, component: &str) -> bool {
        self.engine == Engine::Opa
            && self.kind == kind
            && match &self.components {
                None => !kind.per_component(),
                Some(Components::All) => true,
                Some(Components::Named(names)) => names.iter().any(|n| n == component),
            }
    }

    /// As a vendor policy for the engine (mandatory: nuon's `warn` is the advisory part).
    pub fn policy(&self) -> byoc_policy::Policy {
        byoc_policy::Policy {
            name: format!("vendor/{}", normalize(&self.path)),
            origin: byoc_policy::Origin::Vendor,
            enforcement: byoc_policy::Enforcement::Mandatory,
            text: self.text.clone(),
        }
    }

    pub fn components_str(&self) -> String {
        match &self.components {
            None => "-".into(),
            Some(Components::All) => "*".into(),
            Some(Components::Named(n)) => n.join(","),
        }
    }
}

/// The vendor's policies for a job: the app config's blanket `policies` (every decided
/// job) and the declarations that apply to its type and component.
pub fn for_job(
    app: &AppConfig,
    kind: &str,
    entity: &str,
    component: &str,
) -> Result<Vec<byoc_policy::Policy>, Vec<String>> {
    let mut out: Vec<byoc_policy::Policy> = app
        .policies
        .iter()
        .map(|(name, v)| byoc_policy::Policy {
            name: format!("vendor/{name}"),
            origin: byoc_policy::Origin::Vendor,
            // Anything but an explicit "advisory" is mandatory.
            enforcement: match v.enforcement.as_deref() {
                Some("advisory") => byoc_policy::Enforcement::Advisory,
                _ => byoc_policy::Enforcement::Mandatory,
            },
            text: v.rego.clone(),
        })
        .collect();
    let declared = parse(app)?;
    if let Some(t) = job_type(kind, entity) {
        out.extend(declared.iter().filter(|d| d.applies(t, component)).map(Declared::policy));
    }
    Ok(out)
}

/// The app's Kyverno policies for the cluster (`kubernetes_cluster`).
pub fn cluster_policies(app: &AppConfig) -> Result<Vec<Declared>, Vec<String>> {
    Ok(parse(app)?.into_iter().filter(|d| d.kind == PolicyType::KubernetesCluster).collect())
}

/// Why an app config directory could not be read as a job would carry it.
#[derive(Debug, thiserror::Error)]
pub enum AppDirError {
    #[error("{path}: {source}")]
    Read { path: std::path::PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Parse { path: std::path::PathBuf, source: toml::de::Error },
    #[error("{path}: contents {contents:?} must stay inside the app config")]
    Outside { path: std::path::PathBuf, contents: String },
}

/// An app config directory's policy declarations, as a job would carry them:
/// `policies.toml` and the files its `contents` name (relative to the directory).
pub fn load_dir(dir: &std::path::Path) -> Result<AppConfig, AppDirError> {
    let toml_path = dir.join("policies.toml");
    let text = std::fs::read_to_string(&toml_path)
        .map_err(|source| AppDirError::Read { path: toml_path.clone(), source })?;
    let file: File =
        toml::from_str(&text).map_err(|source| AppDirError::Parse { path: toml_path.clone(), source })?;
    let mut files = std::collections::BTreeMap::new();
    for entry in &file.policy {
        if let Some(path) = entry.get("contents").and_then(|v| v.as_str()) {
            let rel = normalize(path);
            if std::path::Path::new(&rel).components().any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                return Err(AppDirError::Outside { path: toml_path, contents: path.to_string() });
            }
            // A file that is missing is reported by the declaration that names it.
            if let Ok(t) = std::fs::read_to_string(dir.join(&rel)) {
                files.insert(rel, t);
            }
        }
    }
    Ok(AppConfig { policies_toml: Some(text), files, ..Default::default() })
}

/// What a policy's text is, for listings: its convention, or why it would deny.
pub fn convention_of(p: &byoc_policy::Policy) -> String {
    match byoc_policy::load(p, &byoc_policy::Limits::default()) {
        Ok(l) => l.convention.as_str().to_string(),
        Err(e) => e.code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn app(toml: &str, files: &[(&str, &str)]) -> AppConfig {
        AppConfig {
            policies_toml: Some(toml.into()),
            files: files.iter().map(|(p, t)| (p.to_string(), t.to_string())).collect(),
            ..Default::default()
        }
    }

    const ALL_TYPES: &str = r#"
[[policy]]
type = "terraform_module"
engine = "opa"
contents = "./policies/tf-api.rego"
components = ["api"]

[[policy]]
type = "terraform_module"
engine = "opa"
contents = "policies/tf-all.rego"
components = ["*"]

[[policy]]
type = "helm_chart"
engine = "opa"
contents = "./policies/helm.rego"
components = "*"

[[policy]]
type = "kubernetes_manifest"
engine = "opa"
contents = "./policies/k8s.rego"
components = ["web", "api"]

[[policy]]
type = "sandbox"
engine = "opa"
contents = "./policies/sandbox.rego"

[[policy]]
type = "kubernetes_cluster"
contents = "./policies/kyverno.yaml"
"#;

    fn files() -> Vec<(&'static str, &'static str)> {
        vec![
            ("policies/tf-api.rego", "package nuon\n# api"),
            ("./policies/tf-all.rego", "package nuon\n# all"),
            ("policies/helm.rego", "package nuon\n# helm"),
            ("policies/k8s.rego", "package nuon\n# k8s"),
            ("policies/sandbox.rego", "package nuon\n# sandbox"),
            ("policies/kyverno.yaml", "kind: ClusterPolicy"),
        ]
    }

    fn names(ps: &[byoc_policy::Policy]) -> Vec<String> {
        ps.iter().map(|p| p.name.clone()).collect()
    }

    #[test]
    fn each_job_gets_exactly_the_declarations_for_its_type_and_component() {
        let a = app(ALL_TYPES, &files());
        assert_eq!(
            names(&for_job(&a, "terraform", "component", "api").unwrap()),
            ["vendor/policies/tf-api.rego", "vendor/policies/tf-all.rego"]
        );
        assert_eq!(
            names(&for_job(&a, "terraform", "component", "db").unwrap()),
            ["vendor/policies/tf-all.rego"]
        );
        assert_eq!(
            names(&for_job(&a, "terraform", "sandbox", "").unwrap()),
            ["vendor/policies/sandbox.rego"]
        );
        assert_eq!(names(&for_job(&a, "helm", "component", "db").unwrap()), ["vendor/policies/helm.rego"]);
        assert_eq!(
            names(&for_job(&a, "kubernetes", "component", "web").unwrap()),
            ["vendor/policies/k8s.rego"]
        );
        assert!(for_job(&a, "kubernetes", "component", "db").unwrap().is_empty());
        assert!(for_job(&a, "action.script", "action", "x").unwrap().is_empty());
        let cluster = cluster_policies(&a).unwrap();
        assert_eq!(cluster.len(), 1);
        assert_eq!(cluster[0].engine, Engine::Kyverno, "kyverno is the default engine");
    }

    #[test]
    fn the_modelled_systems_defaults_and_build_time_types_load() {
        let toml = r#"
[[policy]]
type = "terraform_module"
engine = "opa"
contents = "./policies/tf-api.rego"

[[policy]]
type = "terraform_module"
engine = "opa"
contents = "./policies/sandbox.rego"
sandbox = true

[[policy]]
type = "container_image"
contents = "./policies/helm.rego"
components = ["api"]
"#;
        let a = app(toml, &files());
        let d = parse(&a).unwrap();
        assert_eq!(d[0].components_str(), "*", "no components: every component");
        assert_eq!(d[1].kind, PolicyType::Sandbox);
        assert!(!d[2].kind.evaluated_here());
        let names = |kind, entity, component| -> Vec<String> {
            for_job(&a, kind, entity, component).unwrap().into_iter().map(|p| p.name).collect()
        };
        assert_eq!(names("terraform", "component", "anything"), ["vendor/policies/tf-api.rego"]);
        assert_eq!(names("terraform", "sandbox", "sandbox"), ["vendor/policies/sandbox.rego"]);
        assert!(names("helm", "component", "api").is_empty(), "build-time policies never decide a job");
    }

    #[test]
    fn declarations_that_cannot_apply_are_reported_all_at_once() {
        let bad = r#"
[[policy]]
type = "helm_chart"
engine = "opa"
contents = "https://policies.example.com/tf.rego"
sandbox = true

[[policy]]
type = "helm_chart"
contents = "./policies/helm.rego"
components = ["*"]

[[policy]]
type = "kubernetes_cluster"
engine = "opa"
contents = "./policies/kyverno.yaml"

[[policy]]
type = "terraform"
engine = "opa"
contents = "./policies/missing.rego"
components = ["*", "api"]
severity = "high"

[[policy]]
type = "sandbox"
engine = "gatekeeper"
contents = "./policies/sandbox.rego"
"#;
        let problems = parse(&app(bad, &files())).unwrap_err();
        let all = problems.join("\n");
        for needle in [
            "#1: contents \"https://policies.example.com/tf.rego\" is fetched from elsewhere",
            "#1: sandbox = true applies to the sandbox's terraform runs, not to helm_chart policies",
            "#2: a helm_chart policy is Rego evaluated by the runner: set engine = \"opa\"",
            "#3: kubernetes_cluster policies are admission policies",
            "#4: unknown field \"severity\"",
            "#4: type \"terraform\" is not one of",
            "#4: contents \"./policies/missing.rego\" is not a file of the app config",
            "#4: components: \"*\" names every component and must stand alone",
            "#5: engine \"gatekeeper\" is not opa or kyverno",
        ] {
            assert!(all.contains(needle), "{needle} not reported:\n{all}");
        }
        assert!(parse(&app("[[policy]]\ntype = 3\n", &[])).unwrap_err()[0].contains("type must be a string"));
        assert!(parse(&app("not toml [", &[])).is_err());
    }
}
