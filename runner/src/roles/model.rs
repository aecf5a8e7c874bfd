//! The app's role model, parsed from the signed app config: role files
//! (`permissions/*.toml`), break-glass roles (`break_glass.toml`) and the
//! operation-role matrix (`operation_roles.toml`). Formats: docs/ROLES.md.
//!
//! Parsing is strict (unknown keys are errors) and reports every problem at once.

use std::collections::BTreeMap;

use byoc_protocol::AppConfig;
use serde::{Deserialize, Serialize};

use super::template::InstallState;

pub use byoc_protocol::{OPERATIONS, known_operation};

/// The default role type of each operation, used when the app's matrix has no
/// `[defaults]` entry for it.
pub const BUILT_IN_DEFAULTS: &[(&str, &str)] = &[
    ("sandbox.provision", "provision"),
    ("sandbox.reprovision", "provision"),
    ("sandbox.deprovision", "deprovision"),
    ("component.deploy", "maintenance"),
    ("component.teardown", "maintenance"),
    ("component.drift", "maintenance"),
    ("action.trigger", "maintenance"),
    ("artifact.sync", "maintenance"),
    ("secret.sync", "maintenance"),
    ("runner.update", "maintenance"),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoleType {
    Provision,
    Maintenance,
    Deprovision,
    Custom,
    BreakGlass,
}

impl RoleType {
    pub fn as_str(self) -> &'static str {
        match self {
            RoleType::Provision => "provision",
            RoleType::Maintenance => "maintenance",
            RoleType::Deprovision => "deprovision",
            RoleType::Custom => "custom",
            RoleType::BreakGlass => "break_glass",
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RoleFile {
    #[serde(rename = "type")]
    role_type: String,
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    display_name: Option<String>,
    #[serde(default)]
    permissions_boundary: Option<String>,
    #[serde(default)]
    policies: Vec<PolicyDef>,
    /// Actions a provider needs while terraform plans, beyond read-only (docs/ROLES.md).
    #[serde(default)]
    plan_actions: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BreakGlassFile {
    #[serde(default)]
    role: Vec<BreakGlassRole>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BreakGlassRole {
    name: String,
    /// Accepted for symmetry with role files; must be `break_glass` if present.
    #[serde(default, rename = "type")]
    role_type: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    display_name: Option<String>,
    #[serde(default)]
    permissions_boundary: Option<String>,
    #[serde(default)]
    policies: Vec<PolicyDef>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyDef {
    #[serde(default)]
    managed_policy_name: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    contents: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MatrixFile {
    #[serde(default)]
    defaults: BTreeMap<String, String>,
    #[serde(default)]
    rule: Vec<MatrixRuleDef>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MatrixRuleDef {
    principal: String,
    operation: String,
    role: String,
}

/// One role the app defines, with its name resolved for this install.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoleDef {
    /// The IAM role name for this install (template resolved).
    pub name: String,
    pub name_template: String,
    pub role_type: RoleType,
    /// `Enable<Key>Role` is its switch parameter in the install stack.
    pub key: String,
    pub display_name: Option<String>,
    pub description: Option<String>,
    /// Where it was defined (`permissions/maintenance.toml`, `break_glass.toml`).
    pub defined_in: String,
    pub policies: usize,
    /// IAM actions the role's terraform plans may use beyond read-only (`service:Action`).
    #[serde(default)]
    pub plan_actions: Vec<String>,
}

/// A plan-time action: `service:Action`, the action part possibly with `*` (never the
/// whole service, never everything).
pub fn valid_plan_action(a: &str) -> bool {
    let Some((service, action)) = a.split_once(':') else { return false };
    !service.is_empty()
        && service.len() <= 64
        && service.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !action.is_empty()
        && action.len() <= 128
        && action.bytes().any(|b| b.is_ascii_alphabetic())
        && action.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'*')
}

/// A rule of the operation-role matrix: first match wins.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MatrixRule {
    /// `entity:name`, `entity:*` or `*`.
    pub principal: String,
    /// An operation of that entity, or `*`.
    pub operation: String,
    /// A role type (`maintenance`) or a role name (template allowed).
    pub role: String,
}

impl MatrixRule {
    pub fn matches(&self, entity: &str, entity_name: &str, operation: &str) -> bool {
        let principal = match self.principal.split_once(':') {
            None => self.principal == "*",
            Some((e, n)) => e == entity && (n == "*" || n == entity_name),
        };
        principal && (self.operation == "*" || self.operation == operation)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct AppRoles {
    pub roles: Vec<RoleDef>,
    /// `entity.operation` → role reference.
    pub defaults: BTreeMap<String, String>,
    pub rules: Vec<MatrixRule>,
}

/// Every problem found in an app config, one line each.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("app config: {}", problems.join("; "))]
pub struct ModelError {
    pub problems: Vec<String>,
}

/// `Enable<Key>Role`'s key: the role name template without template expressions,
/// CamelCased (`{{.install.id}}-s3-object-break-glass` → `S3ObjectBreakGlass`).
pub fn switch_key(name_template: &str) -> String {
    let mut plain = String::new();
    let mut rest = name_template;
    while let Some(start) = rest.find("{{") {
        plain.push_str(&rest[..start]);
        plain.push('-');
        rest = rest[start..].find("}}").map(|e| &rest[start + e + 2..]).unwrap_or("");
    }
    plain.push_str(rest);
    let key: String = plain
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut c = w.chars();
            c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
        })
        .collect();
    match key.strip_suffix("Role") {
        Some(k) if !k.is_empty() => k.to_string(),
        _ => key,
    }
}

fn check_policies(policies: &[PolicyDef], at: &str, problems: &mut Vec<String>) {
    for (i, p) in policies.iter().enumerate() {
        match (&p.managed_policy_name, &p.name, &p.contents) {
            (Some(_), None, None) => {}
            (None, Some(_), Some(contents)) => {
                // The document, or a file of the app config by its path (`app check` and
                // the stack read it). Templates inside strings stay valid JSON.
                let path = byoc_protocol::app_dir::is_path(contents);
                if path && byoc_protocol::app_dir::normalize(contents).is_none() {
                    problems.push(format!(
                        "{at}: policies[{i}].contents {contents:?} leaves the app's directory"
                    ));
                } else if !path && serde_json::from_str::<serde_json::Value>(contents).is_err() {
                    problems.push(format!("{at}: policies[{i}].contents is neither JSON nor a file's path"));
                }
            }
            _ => problems
                .push(format!("{at}: policies[{i}] needs either managed_policy_name, or name and contents")),
        }
    }
}

/// A role joins the app's unless its name or switch key is taken.
fn add_role(roles: &mut Vec<RoleDef>, def: RoleDef, problems: &mut Vec<String>) {
    if let Some(other) = roles.iter().find(|r| r.name == def.name) {
        problems.push(format!(
            "{}: role name {:?} is also defined in {}",
            def.defined_in, def.name, other.defined_in
        ));
    } else if let Some(other) = roles.iter().find(|r| r.key == def.key) {
        problems.push(format!(
            "{}: switch key {:?} (stack parameter Enable{}Role) is also used by {}",
            def.defined_in, def.key, def.key, other.defined_in
        ));
    } else {
        roles.push(def);
    }
}

/// One `permissions/*.toml` role.
fn role_file(at: &str, text: &str, install: &InstallState, problems: &mut Vec<String>) -> Option<RoleDef> {
    match toml::from_str(text) {
        Ok(parsed) => role_def(at, parsed, install, problems),
        Err(e) => {
            problems.push(format!("{at}: {}", e.message()));
            None
        }
    }
}

/// The single-file layout, `permissions.toml`: `[provision_role]`,
/// `[maintenance_role]`, `[deprovision_role]` (their type given by the key),
/// `[[custom_roles]]` and `[[roles]]` (a `type` each).
fn permissions_toml(text: &str, install: &InstallState, problems: &mut Vec<String>) -> Vec<RoleDef> {
    let doc = match toml::from_str::<toml::Table>(text) {
        Ok(d) => d,
        Err(e) => {
            problems.push(format!("permissions.toml: {}", e.message()));
            return Vec::new();
        }
    };
    let mut entries: Vec<(String, Option<&str>, &toml::Value)> = Vec::new();
    for (key, value) in &doc {
        match key.as_str() {
            "provision_role" | "maintenance_role" | "deprovision_role" => {
                entries.push((key.clone(), key.strip_suffix("_role"), value));
            }
            "custom_roles" | "roles" => match value.as_array() {
                Some(a) => entries.extend(a.iter().enumerate().map(|(i, v)| {
                    (format!("{key}[{i}]"), (key == "custom_roles").then_some("custom"), v)
                })),
                None => problems.push(format!("permissions.toml: {key} must be an array of tables ([[{key}]])")),
            },
            other => problems.push(format!(
                "permissions.toml: unknown key {other:?} (provision_role, maintenance_role, deprovision_role, custom_roles, roles)"
            )),
        }
    }
    let mut roles = Vec::new();
    for (key, implied, value) in entries {
        let at = format!("permissions.toml {key}");
        let Some(table) = value.as_table() else {
            problems.push(format!("{at}: not a table"));
            continue;
        };
        let mut table = table.clone();
        match (implied, table.get("type").and_then(|t| t.as_str())) {
            (Some(t), Some(given)) if t != given => {
                problems.push(format!("{at}: type {given:?} contradicts its key ({t})"));
                continue;
            }
            (Some(t), None) => {
                table.insert("type".into(), toml::Value::String(t.into()));
            }
            _ => {}
        }
        match toml::Value::Table(table).try_into::<RoleFile>() {
            Ok(parsed) => roles.extend(role_def(&at, parsed, install, problems)),
            Err(e) => problems.push(format!("{at}: {}", e.message())),
        }
    }
    roles
}

fn role_def(
    at: &str,
    parsed: RoleFile,
    install: &InstallState,
    problems: &mut Vec<String>,
) -> Option<RoleDef> {
    let role_type = match parsed.role_type.as_str() {
        "provision" => RoleType::Provision,
        "maintenance" => RoleType::Maintenance,
        "deprovision" => RoleType::Deprovision,
        "custom" => RoleType::Custom,
        other => {
            problems.push(format!(
                "{at}: type {other:?} is not one of provision, maintenance, deprovision, custom (break-glass roles go in break_glass.toml)"
            ));
            return None;
        }
    };
    check_policies(&parsed.policies, at, problems);
    if let Some(bad) = parsed.plan_actions.iter().find(|a| !valid_plan_action(a)) {
        problems.push(format!(
            "{at}: plan_actions {bad:?} is not service:Action (a wildcard may complete an action, never stand for a whole service)"
        ));
    }
    let _ = parsed.permissions_boundary;
    match install.render(&parsed.name) {
        Ok(name) => Some(RoleDef {
            name,
            key: switch_key(&parsed.name),
            name_template: parsed.name,
            role_type,
            display_name: parsed.display_name,
            description: parsed.description,
            defined_in: at.to_string(),
            policies: parsed.policies.len(),
            plan_actions: parsed.plan_actions,
        }),
        Err(e) => {
            problems.push(format!("{at}: {e}"));
            None
        }
    }
}

/// The roles of `break_glass.toml`.
fn break_glass_roles(text: &str, install: &InstallState, problems: &mut Vec<String>) -> Vec<RoleDef> {
    let at = "break_glass.toml";
    let file = match toml::from_str::<BreakGlassFile>(text) {
        Ok(file) => file,
        Err(e) => {
            problems.push(format!("{at}: {}", e.message()));
            return Vec::new();
        }
    };
    let mut roles = Vec::new();
    for (i, r) in file.role.into_iter().enumerate() {
        let at = format!("{at} role[{i}]");
        if r.role_type.as_deref().is_some_and(|t| t != "break_glass") {
            problems.push(format!("{at}: type must be break_glass if given"));
            continue;
        }
        check_policies(&r.policies, &at, problems);
        let _ = r.permissions_boundary;
        match install.render(&r.name) {
            Ok(name) => roles.push(RoleDef {
                name,
                key: switch_key(&r.name),
                name_template: r.name,
                role_type: RoleType::BreakGlass,
                display_name: r.display_name,
                description: r.description,
                defined_in: at,
                policies: r.policies.len(),
                plan_actions: Vec::new(),
            }),
            Err(e) => problems.push(format!("{at}: {e}")),
        }
    }
    roles
}

/// `operation_roles.toml`: the defaults per operation (over the built-in ones) and the
/// rules, each naming a known entity and operation.
fn operation_roles(
    text: Option<&str>,
    problems: &mut Vec<String>,
) -> (BTreeMap<String, String>, Vec<MatrixRule>) {
    let matrix = match text {
        None => MatrixFile::default(),
        Some(text) => toml::from_str::<MatrixFile>(text).unwrap_or_else(|e| {
            problems.push(format!("operation_roles.toml: {}", e.message()));
            MatrixFile::default()
        }),
    };
    let mut defaults: BTreeMap<String, String> =
        BUILT_IN_DEFAULTS.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    for (op, role) in matrix.defaults {
        let known = op.split_once('.').is_some_and(|(e, o)| known_operation(e, o));
        if !known {
            problems.push(format!(
                "operation_roles.toml: defaults key {op:?} is not an entity.operation ({})",
                BUILT_IN_DEFAULTS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
            ));
        } else {
            defaults.insert(op, role);
        }
    }
    let mut rules = Vec::new();
    for (i, r) in matrix.rule.into_iter().enumerate() {
        let at = format!("operation_roles.toml rule[{i}]");
        let entity = r.principal.split_once(':').map(|(e, _)| e);
        match entity {
            None if r.principal != "*" => {
                problems.push(format!("{at}: principal {:?} is not entity:name, entity:* or *", r.principal));
                continue;
            }
            Some(e) if !OPERATIONS.iter().any(|(k, _)| *k == e) => {
                problems.push(format!("{at}: unknown entity {e:?}"));
                continue;
            }
            Some(e) if r.operation != "*" && !known_operation(e, &r.operation) => {
                problems.push(format!("{at}: {e} has no operation {:?}", r.operation));
                continue;
            }
            _ => {}
        }
        rules.push(MatrixRule { principal: r.principal, operation: r.operation, role: r.role });
    }
    (defaults, rules)
}

impl AppRoles {
    pub fn parse(app: &AppConfig, install: &InstallState) -> Result<AppRoles, ModelError> {
        let mut problems = Vec::new();
        let mut roles: Vec<RoleDef> = Vec::new();
        for (file, text) in &app.permissions {
            if let Some(def) = role_file(&format!("permissions/{file}"), text, install, &mut problems) {
                add_role(&mut roles, def, &mut problems);
            }
        }
        if let Some(text) = &app.permissions_toml {
            if !app.permissions.is_empty() {
                problems.push("permissions.toml and permissions/*.toml: use one layout, not both".into());
            }
            for def in permissions_toml(text, install, &mut problems) {
                add_role(&mut roles, def, &mut problems);
            }
        }
        if let Some(text) = &app.break_glass {
            for def in break_glass_roles(text, install, &mut problems) {
                add_role(&mut roles, def, &mut problems);
            }
        }
        for t in [RoleType::Provision, RoleType::Maintenance, RoleType::Deprovision] {
            let n = roles.iter().filter(|r| r.role_type == t).count();
            if n > 1 {
                problems.push(format!("{n} roles have type {}; at most one may", t.as_str()));
            }
        }
        let (defaults, rules) = operation_roles(app.operation_roles.as_deref(), &mut problems);
        let app = AppRoles { roles, defaults, rules };
        app.check_references(install, &mut problems);
        if problems.is_empty() { Ok(app) } else { Err(ModelError { problems }) }
    }

    /// Every reference must name a defined, non-break-glass role; checked up front so a
    /// bad matrix fails every job the same way, not only the ones it matches.
    fn check_references(&self, install: &InstallState, problems: &mut Vec<String>) {
        let refs = self
            .defaults
            .iter()
            .map(|(op, r)| (format!("operation_roles.toml defaults {op:?}"), r.clone()))
            .chain(
                self.rules
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (format!("operation_roles.toml rule[{i}]"), r.role.clone())),
            );
        for (at, reference) in refs {
            match self.lookup(&reference, install) {
                Ok(role) if role.role_type == RoleType::BreakGlass => problems.push(format!(
                    "{at}: {reference:?} is a break-glass role; those are reached only through an action's break_glass_role or a runtime override"
                )),
                Ok(_) => {}
                // A built-in default for a role type the app does not define only
                // matters for jobs of that operation: refused then, with a reason.
                Err(_) if BUILT_IN_DEFAULTS.iter().any(|(_, t)| *t == reference) => {}
                Err(e) => problems.push(format!("{at}: {e}")),
            }
        }
    }

    /// A role reference: a role type (`maintenance`), or a role name (template allowed).
    pub fn lookup(&self, reference: &str, install: &InstallState) -> Result<&RoleDef, String> {
        let by_type = match reference {
            "provision" => Some(RoleType::Provision),
            "maintenance" => Some(RoleType::Maintenance),
            "deprovision" => Some(RoleType::Deprovision),
            _ => None,
        };
        if let Some(t) = by_type {
            return self.roles.iter().find(|r| r.role_type == t).ok_or_else(|| {
                format!(
                    "the app defines no {} role (permissions/*.toml with type = {:?})",
                    t.as_str(),
                    t.as_str()
                )
            });
        }
        let name = install.render(reference).map_err(|e| e.to_string())?;
        self.roles
            .iter()
            .find(|r| r.name == name)
            .ok_or_else(|| format!("no role named {name:?} in the app's permissions or break_glass.toml"))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn install() -> InstallState {
        InstallState::new("inst-1", None, Some("us-east-1"), None)
    }

    pub fn role_file(role_type: &str, name: &str) -> String {
        format!(
            "type = \"{role_type}\"\nname = \"{name}\"\ndescription = \"d\"\ndisplay_name = \"D\"\npermissions_boundary = \"./b.json\"\n\n[[policies]]\nmanaged_policy_name = \"ReadOnlyAccess\"\n\n[[policies]]\nname = \"inline\"\ncontents = \"\"\"\n{{\"Version\": \"2012-10-17\", \"Statement\": []}}\n\"\"\"\n"
        )
    }

    /// The example app: three default roles, one custom, two break-glass roles.
    pub fn app() -> AppConfig {
        AppConfig {
            permissions: [
                ("provision.toml", role_file("provision", "{{ .nuon.install.id }}-provision")),
                ("maintenance.toml", role_file("maintenance", "{{.install.id}}-maintenance")),
                ("deprovision.toml", role_file("deprovision", "{{.install.id}}-deprovision")),
                ("eks_upgrade.toml", role_file("custom", "{{.install.id}}-eks-upgrade-role")),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
            break_glass: Some(
                "[[role]]\nname = \"{{.nuon.install.id}}-s3-object-break-glass\"\ndescription = \"x\"\ndisplay_name = \"x\"\npermissions_boundary = \"\"\n\n[[role.policies]]\nmanaged_policy_name = \"AdministratorAccess\"\n"
                    .into(),
            ),
            operation_roles: Some(
                "[defaults]\n\"component.teardown\" = \"deprovision\"\n\n[[rule]]\nprincipal = \"component:cluster\"\noperation = \"deploy\"\nrole = \"{{.install.id}}-eks-upgrade-role\"\n\n[[rule]]\nprincipal = \"action:*\"\noperation = \"*\"\nrole = \"maintenance\"\n"
                    .into(),
            ),
            policies: Default::default(),
            policies_toml: None,
            files: Default::default(),
            ..Default::default()
        }
    }

    #[test]
    fn plan_actions_name_actions_never_whole_services() {
        for ok in
            ["ec2:CreateNetworkInterface", "ec2:Describe*", "kms:Decrypt", "elasticloadbalancing:Describe*"]
        {
            assert!(valid_plan_action(ok), "{ok}");
        }
        for bad in ["*", "ec2:*", "ec2", ":Describe", "ec2:Describe Instances", "EC2:Describe", "ec2:**", ""]
        {
            assert!(!valid_plan_action(bad), "{bad}");
        }
    }

    #[test]
    fn parses_the_app_format_with_both_template_namespaces() {
        let a = AppRoles::parse(&app(), &install()).unwrap();
        let names: Vec<(&str, RoleType, &str)> =
            a.roles.iter().map(|r| (r.name.as_str(), r.role_type, r.key.as_str())).collect();
        assert!(names.contains(&("inst-1-provision", RoleType::Provision, "Provision")));
        assert!(names.contains(&("inst-1-maintenance", RoleType::Maintenance, "Maintenance")));
        assert!(names.contains(&("inst-1-eks-upgrade-role", RoleType::Custom, "EksUpgrade")));
        assert!(names.contains(&(
            "inst-1-s3-object-break-glass",
            RoleType::BreakGlass,
            "S3ObjectBreakGlass"
        )));
        assert_eq!(a.defaults["component.teardown"], "deprovision");
        assert_eq!(a.defaults["component.deploy"], "maintenance");
        assert_eq!(a.rules.len(), 2);
        assert_eq!(a.roles.iter().find(|r| r.role_type == RoleType::Maintenance).unwrap().policies, 2);
    }

    #[test]
    fn reports_every_problem_at_once() {
        let mut bad = app();
        bad.permissions.insert("x.toml".into(), "type = \"superuser\"\nname = \"x\"\n".into());
        bad.permissions
            .insert("y.toml".into(), "type = \"custom\"\nname = \"{{.install.id}}-maintenance\"\n".into());
        bad.permissions.insert("z.toml".into(), "type = \"custom\"\nname = \"z\"\nsurprise = 1\n".into());
        bad.permissions
            .insert("p.toml".into(), "type = \"custom\"\nname = \"p\"\n[[policies]]\nname = \"n\"\n".into());
        bad.permissions.insert("m2.toml".into(), role_file("maintenance", "other-maintenance"));
        bad.operation_roles = Some(
            "[defaults]\n\"component.explode\" = \"maintenance\"\n[[rule]]\nprincipal = \"component:api\"\noperation = \"deploy\"\nrole = \"nope\"\n[[rule]]\nprincipal = \"action:x\"\noperation = \"*\"\nrole = \"{{.install.id}}-s3-object-break-glass\"\n"
                .into(),
        );
        let e = AppRoles::parse(&bad, &install()).unwrap_err();
        let all = e.problems.join("\n");
        for needle in [
            "\"superuser\"",
            "also defined in",
            "surprise",
            "policies[0] needs either",
            "2 roles have type maintenance",
            "component.explode",
            "no role named \"nope\"",
            "is a break-glass role",
        ] {
            assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
        }
    }

    #[test]
    fn the_single_file_layout_defines_the_same_roles() {
        let single = AppConfig {
            permissions_toml: Some(
                "[provision_role]\nname = \"{{.install.id}}-provision\"\n\n[maintenance_role]\nname = \"{{.install.id}}-maintenance\"\n\n[[maintenance_role.policies]]\nname = \"s3\"\ncontents = \"./policies/s3.json\"\n\n[deprovision_role]\ntype = \"deprovision\"\nname = \"{{.install.id}}-deprovision\"\n\n[[custom_roles]]\nname = \"{{.install.id}}-eks-upgrade-role\"\n\n[[roles]]\ntype = \"custom\"\nname = \"ops-{{.install.id}}\"\n"
                    .into(),
            ),
            ..Default::default()
        };
        let a = AppRoles::parse(&single, &install()).unwrap();
        let mut names: Vec<(&str, RoleType)> =
            a.roles.iter().map(|r| (r.name.as_str(), r.role_type)).collect();
        names.sort_by_key(|(n, _)| *n);
        assert_eq!(
            names,
            [
                ("inst-1-deprovision", RoleType::Deprovision),
                ("inst-1-eks-upgrade-role", RoleType::Custom),
                ("inst-1-maintenance", RoleType::Maintenance),
                ("inst-1-provision", RoleType::Provision),
                ("ops-inst-1", RoleType::Custom),
            ]
        );
        assert_eq!(a.lookup("maintenance", &install()).unwrap().policies, 1);

        let bad = AppConfig {
            permissions_toml: Some(
                "[maintenance_role]\ntype = \"custom\"\nname = \"m\"\n\n[[roles]]\nname = \"no-type\"\n\n[admin_role]\nname = \"a\"\n\n[[custom_roles]]\nname = \"c\"\n[[custom_roles.policies]]\nname = \"p\"\ncontents = \"../../etc/x.json\"\n"
                    .into(),
            ),
            ..app()
        };
        let all = AppRoles::parse(&bad, &install()).unwrap_err().problems.join("\n");
        for needle in [
            "use one layout, not both",
            "maintenance_role: type \"custom\" contradicts its key (maintenance)",
            "roles[0]: missing field `type`",
            "unknown key \"admin_role\"",
            "contents \"../../etc/x.json\" leaves the app's directory",
        ] {
            assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
        }
    }

    #[test]
    fn switch_keys_are_camel_case_without_templates() {
        assert_eq!(switch_key("{{ .nuon.install.id }}-maintenance"), "Maintenance");
        assert_eq!(switch_key("{{.install.id}}-eks-upgrade-role"), "EksUpgrade");
        assert_eq!(switch_key("{{.nuon.install.id}}-s3-object-break-glass"), "S3ObjectBreakGlass");
        assert_eq!(switch_key("db_admin"), "DbAdmin");
        assert_eq!(switch_key("role"), "Role");
    }

    #[test]
    fn matrix_rules_match_principals_and_operations() {
        let r =
            MatrixRule { principal: "component:api".into(), operation: "deploy".into(), role: "x".into() };
        assert!(r.matches("component", "api", "deploy"));
        assert!(!r.matches("component", "web", "deploy"));
        assert!(!r.matches("component", "api", "teardown"));
        let any = MatrixRule { principal: "component:*".into(), operation: "*".into(), role: "x".into() };
        assert!(any.matches("component", "web", "teardown"));
        assert!(!any.matches("action", "web", "trigger"));
        let all = MatrixRule { principal: "*".into(), operation: "*".into(), role: "x".into() };
        assert!(all.matches("sandbox", "", "provision"));
    }
}
