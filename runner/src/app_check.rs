//! `byoc-runner app check DIR`: an app config directory loaded as the runner loads the
//! one a job carries and as the install stack generator reads it — roles (either
//! layout), the files role policies and boundaries name, the vendor's policies, the
//! secrets and the stack parameters they become — with every problem reported at once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use byoc_protocol::AppConfig;
use serde::Serialize;

use crate::roles::model::{AppRoles, switch_key};
use crate::roles::template::InstallState;

/// What an app config holds, and everything wrong with it.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub roles: Vec<RoleLine>,
    pub policies: Vec<PolicyLine>,
    pub secrets: Vec<String>,
    /// The install stack's parameters the app adds (role switches, secrets, template values).
    pub stack_parameters: Vec<String>,
    pub problems: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct RoleLine {
    pub name: String,
    pub role_type: String,
    pub switch: String,
}

#[derive(Debug, Serialize)]
pub struct PolicyLine {
    pub name: String,
    /// nuon, conftest; or the reason code it would deny with.
    pub convention: String,
}

/// Values the install stack or the install link provides: role names render with them
/// (placeholders here; only their presence matters).
fn sample_install() -> InstallState {
    InstallState::new("inst-check", Some("install-name"), Some("us-east-1"), Some("123456789012"))
        .with("org.id", Some("org-id"))
        .with("app.id", Some("app-id"))
}

/// The cloud an app targets when it is not AWS (stack.toml `type`, runner.toml
/// `runner_type`), with where it says so.
pub fn other_cloud(dir: &Path) -> Option<(&'static str, String)> {
    for (file, key) in [("stack.toml", "type"), ("runner.toml", "runner_type")] {
        let Ok(text) = std::fs::read_to_string(dir.join(file)) else { continue };
        let Ok(doc) = toml::from_str::<toml::Table>(&text) else { continue };
        let Some(value) = doc.get(key).and_then(|v| v.as_str()) else { continue };
        let low = value.to_ascii_lowercase();
        let cloud = if low.starts_with("azure") {
            "Azure"
        } else if low.starts_with("gcp") || low.starts_with("google") {
            "Google Cloud"
        } else {
            continue;
        };
        return Some((cloud, format!("{file} {key} = {value:?}")));
    }
    None
}

pub fn check(dir: &Path) -> Report {
    let mut report = Report::default();
    if let Some((cloud, why)) = other_cloud(dir) {
        report.problems.push(format!(
            "this app targets {cloud} ({why}); byoc-runner installs only into AWS accounts \
             (a CloudFormation stack, IAM roles, Secrets Manager, ECR)"
        ));
        return report;
    }
    let app = match byoc_protocol::app_dir::load(dir) {
        Ok(app) => app,
        Err(problems) => {
            report.problems = problems;
            return report;
        }
    };
    let install = sample_install();
    check_roles(&app, &install, &mut report);
    check_policies(&app, &mut report);
    check_secrets(&app, &install, &mut report);
    report.problems.dedup();
    report
}

fn check_roles(app: &AppConfig, install: &InstallState, report: &mut Report) {
    if app.permissions.is_empty() && app.permissions_toml.is_none() {
        report.problems.push("no roles: permissions.toml, or permissions/*.toml".into());
    }
    match AppRoles::parse(app, install) {
        Ok(roles) => {
            for r in &roles.roles {
                report.roles.push(RoleLine {
                    name: r.name_template.clone(),
                    role_type: r.role_type.as_str().into(),
                    switch: format!("Enable{}Role", r.key),
                });
                report.stack_parameters.push(format!("Enable{}Role", r.key));
            }
        }
        Err(e) => report.problems.extend(e.problems),
    }
    let fields = template_fields(app);
    for (field, parameter) in [("install.name", "InstallName"), ("org.id", "OrgId"), ("app.id", "AppId")] {
        if fields.contains(field) {
            report.stack_parameters.push(parameter.into());
        }
    }
    // The files role policies and boundaries name: present, and JSON.
    let role_files = app
        .permissions
        .iter()
        .map(|(n, t)| (format!("permissions/{n}"), t))
        .chain(app.permissions_toml.iter().map(|t| ("permissions.toml".to_string(), t)))
        .chain(app.break_glass.iter().map(|t| ("break_glass.toml".to_string(), t)));
    for (at, text) in role_files {
        let Ok(doc) = toml::from_str::<toml::Table>(text) else { continue };
        let dir_of = at.rsplit_once('/').map(|(d, _)| d.to_string()).unwrap_or_default();
        for role in byoc_protocol::app_dir::role_tables(&doc) {
            let name = role.get("name").and_then(|n| n.as_str()).unwrap_or("?");
            let policies = role.get("policies").and_then(|p| p.as_array()).into_iter().flatten();
            for (i, p) in policies.enumerate() {
                let Some(contents) = p.get("contents").and_then(|c| c.as_str()) else { continue };
                if byoc_protocol::app_dir::is_path(contents) {
                    let what = format!("{at} ({name}): policies[{i}].contents");
                    json_file(app, &[""], contents, &what, &mut report.problems);
                }
            }
            if let Some(b) = role.get("permissions_boundary").and_then(|b| b.as_str())
                && !b.trim().is_empty()
            {
                let what = format!("{at} ({name}): permissions_boundary");
                json_file(app, &[dir_of.as_str(), ""], b.trim(), &what, &mut report.problems);
            }
        }
    }
}

/// The template fields the app's role files use (`install.name`, `org.id`, …).
fn template_fields(app: &AppConfig) -> BTreeSet<String> {
    let texts = app.permissions.values().chain(&app.permissions_toml).chain(&app.break_glass);
    let mut out = BTreeSet::new();
    for text in texts {
        for part in text.split("{{").skip(1) {
            let expr =
                part.split("}}").next().unwrap_or("").trim_matches(|c: char| c == '-' || c.is_whitespace());
            let path = expr.trim_start_matches('.');
            out.insert(path.strip_prefix("nuon.").unwrap_or(path).to_string());
        }
    }
    out
}

/// A file of the app (tried under each base, relative to the app's root) that must
/// hold a JSON document.
fn json_file(app: &AppConfig, bases: &[&str], path: &str, what: &str, problems: &mut Vec<String>) {
    let found = bases.iter().find_map(|base| {
        let joined = if base.is_empty() { path.to_string() } else { format!("{base}/{path}") };
        byoc_protocol::app_dir::normalize(&joined).and_then(|rel| app.files.get(&rel))
    });
    match found {
        None => problems.push(format!("{what}: {path:?} is not a file of the app")),
        Some(text) => {
            if let Err(e) = serde_json::from_str::<serde_json::Value>(text) {
                problems.push(format!("{what}: {path:?} is not JSON: {e}"));
            }
        }
    }
}

fn check_policies(app: &AppConfig, report: &mut Report) {
    let limits = byoc_policy::Limits::default();
    let mut policies: Vec<byoc_policy::Policy> = app
        .policies
        .iter()
        .map(|(name, p)| byoc_policy::Policy {
            name: format!("vendor/{name}"),
            origin: byoc_policy::Origin::Vendor,
            enforcement: byoc_policy::Enforcement::Mandatory,
            text: p.rego.clone(),
        })
        .collect();
    match crate::app_policies::parse(app) {
        Ok(declared) => policies.extend(
            declared.iter().filter(|d| d.engine == crate::app_policies::Engine::Opa).map(|d| d.policy()),
        ),
        Err(problems) => report.problems.extend(problems),
    }
    for p in policies {
        match byoc_policy::load(&p, &limits) {
            Ok(l) => {
                report.policies.push(PolicyLine { name: p.name, convention: l.convention.as_str().into() })
            }
            Err(e) => {
                report.problems.push(format!("{} [{}]: {}", p.name, e.code, e.reason));
                report.policies.push(PolicyLine { name: p.name, convention: e.code });
            }
        }
    }
}

fn check_secrets(app: &AppConfig, install: &InstallState, report: &mut Report) {
    let declared = match crate::secrets::declare::declared(app, install) {
        Ok(d) => d,
        Err(problems) => {
            report.problems.extend(problems);
            return;
        }
    };
    let roles = AppRoles::parse(app, install).ok();
    let mut keys: BTreeMap<String, String> = BTreeMap::new();
    for s in &declared {
        report.secrets.push(s.name.clone());
        for reader in &s.read_by {
            let known = ["provision", "maintenance", "deprovision", "custom", "break_glass"]
                .contains(&reader.as_str())
                || roles.as_ref().is_some_and(|r| r.roles.iter().any(|role| &role.name == reader));
            if !known {
                report.problems.push(format!(
                    "secret {:?}: read_by {reader:?} is neither a role type nor the name of one of the app's roles",
                    s.name
                ));
            }
        }
        // A secret the stack asks for becomes its parameter Secret<Key>: two names with
        // one key would be one parameter.
        if s.user_configurable {
            let key = format!("Secret{}", switch_key(&s.name));
            if let Some(other) = keys.insert(key.clone(), s.name.clone()) {
                report
                    .problems
                    .push(format!("secrets {other:?} and {:?} would both be stack parameter {key}", s.name));
            }
        }
    }
    report.stack_parameters.extend(keys.into_keys());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn app_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        for (p, t) in files {
            let path = d.path().join(p);
            std::fs::create_dir_all(path.parent().unwrap_or(d.path())).unwrap_or_else(|e| panic!("{e}"));
            std::fs::write(path, t).unwrap_or_else(|e| panic!("{e}"));
        }
        d
    }

    #[test]
    fn a_good_app_is_ok_and_every_problem_of_a_bad_one_is_named() {
        let good = app_dir(&[
            (
                "permissions.toml",
                "[maintenance_role]\nname = \"{{.nuon.app.id}}-ops\"\npermissions_boundary = \"./boundary.json\"\n[[maintenance_role.policies]]\nname = \"s3\"\ncontents = \"./policies/s3.json\"\n",
            ),
            ("boundary.json", "{}"),
            ("policies/s3.json", "{\"Version\": \"2012-10-17\", \"Statement\": []}"),
            (
                "policies.toml",
                "[[policy]]\ntype = \"terraform_module\"\nengine = \"opa\"\ncontents = \"./policies/checks.rego\"\ncomponents = [\"*\"]\n",
            ),
            ("policies/checks.rego", "package nuon\nimport rego.v1\npass contains \"checked\" if true\n"),
            ("secrets.toml", "[[secret]]\nname = \"db\"\nrequired = true\nuser_configurable = true\n"),
        ]);
        let r = check(good.path());
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!(r.roles.len(), 1);
        assert_eq!(r.policies[0].convention, "nuon");
        assert_eq!(r.stack_parameters, ["EnableOpsRole", "AppId", "SecretDb"]);

        let bad = app_dir(&[
            (
                "permissions/m.toml",
                "type = \"maintenance\"\nname = \"{{.install.public_domain}}-m\"\n[[policies]]\nname = \"p\"\ncontents = \"./missing.json\"\n",
            ),
            ("permissions/c.toml", "type = \"custom\"\nname = \"c\"\npermissions_boundary = \"./b.json\"\n"),
            ("b.json", "not json"),
            (
                "policies/calls.rego",
                "package nuon\nimport rego.v1\nx := http.send({})\ndeny contains \"x\" if x\n",
            ),
            ("secrets.toml", "[[secret]]\nname = \"db\"\nread_by = [\"operator\"]\n"),
        ]);
        let all = check(bad.path()).problems.join("\n");
        for needle in [
            "no install value .install.public_domain",
            "policies[0].contents: \"./missing.json\" is not a file of the app",
            "permissions_boundary: \"./b.json\" is not JSON",
            "vendor/calls.rego [policy_load_error]: calls http.send",
            "read_by \"operator\" is neither a role type",
        ] {
            assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
        }
    }

    #[test]
    fn an_app_for_another_cloud_is_refused_in_one_sentence() {
        let d = app_dir(&[
            ("stack.toml", "type = \"azure-bicep\"\n"),
            ("permissions/m.toml", "type = \"maintenance\"\nname = \"m\"\n"),
        ]);
        let r = check(d.path());
        assert_eq!(
            r.problems,
            [
                "this app targets Azure (stack.toml type = \"azure-bicep\"); byoc-runner installs only into AWS accounts (a CloudFormation stack, IAM roles, Secrets Manager, ECR)"
            ]
        );
    }
}
