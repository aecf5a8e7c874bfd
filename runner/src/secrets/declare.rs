//! The app config's secrets, as the modelled system's app configs declare them:
//! `[[secret]]` tables in `secrets.toml`, or one secret per file under
//! `secrets/<name>.toml` or `secrets/<group>/<name>.toml`. Its fields are loaded unchanged (`name`,
//! `display_name`, `description`, `required`, `auto_generate`, `user_configurable`,
//! `format`, `default`, `kubernetes_sync`, `kubernetes_secret_namespace`, `kubernetes_secret_name`,
//! `kubernetes_sync_targets`); ours are `terraform_variable`, `helm_value` and
//! `read_by` (docs/SECRETS.md). Every problem is reported at once.

use byoc_job_executors::secrets::{Declared, Format, KubeTarget, valid_name};
use byoc_protocol::AppConfig;

use crate::roles::template::InstallState;

/// Who reads a secret when the app config does not say.
pub const DEFAULT_READ_BY: &[&str] = &["provision", "maintenance"];

const FIELDS: &[&str] = &[
    "name",
    "display_name",
    "description",
    "required",
    "auto_generate",
    "user_configurable",
    "format",
    "default",
    "kubernetes_sync",
    "kubernetes_secret_namespace",
    "kubernetes_secret_name",
    "kubernetes_sync_targets",
    "terraform_variable",
    "helm_value",
    "read_by",
];
const TARGET_FIELDS: &[&str] = &["namespaces", "name", "key"];

/// Every secret the app config declares, templates resolved; or every problem.
pub fn declared(app: &AppConfig, install: &InstallState) -> Result<Vec<Declared>, Vec<String>> {
    let mut problems = Vec::new();
    let mut tables: Vec<(String, toml::Table)> = Vec::new();
    if let Some(text) = &app.secrets {
        match toml::from_str::<toml::Table>(text) {
            Err(e) => problems.push(format!("secrets.toml: {}", e.message())),
            Ok(mut t) => {
                let entries = t.remove("secret");
                for k in t.keys() {
                    problems.push(if k == "kubernetes_sync_targets" {
                        // The per-file form's top-level targets, written in secrets.toml.
                        "secrets.toml: [[kubernetes_sync_targets]] at the top level belongs to no secret: \
                         write [[secret.kubernetes_sync_targets]] after its [[secret]]"
                            .to_string()
                    } else {
                        format!("secrets.toml: unknown key {k:?} (secrets are [[secret]] tables)")
                    });
                }
                match entries {
                    None => {}
                    Some(toml::Value::Array(a)) => {
                        for (i, v) in a.into_iter().enumerate() {
                            match v {
                                toml::Value::Table(t) => {
                                    tables.push((format!("secrets.toml secret[{i}]"), t))
                                }
                                _ => problems.push(format!("secrets.toml secret[{i}]: not a table")),
                            }
                        }
                    }
                    Some(_) => {
                        problems.push("secrets.toml: secret must be an array of tables ([[secret]])".into())
                    }
                }
            }
        }
    }
    for (path, text) in &app.secret_files {
        let parts: Vec<&str> = path.split('/').collect();
        let toml_file = |f: &str| f.len() > ".toml".len() && f.ends_with(".toml");
        let shaped = match parts.as_slice() {
            ["secrets", file] => toml_file(file),
            ["secrets", group, file] => !group.is_empty() && toml_file(file),
            _ => false,
        };
        if !shaped {
            problems
                .push(format!("{path}: secret files are secrets/<name>.toml or secrets/<group>/<name>.toml"));
            continue;
        }
        match toml::from_str::<toml::Table>(text) {
            // The file is the secret; a file of `[[secret]]` tables is read as such.
            Ok(mut t) if t.len() == 1 && t.get("secret").is_some_and(|s| s.is_array()) => {
                let Some(toml::Value::Array(entries)) = t.remove("secret") else { continue };
                for (i, v) in entries.into_iter().enumerate() {
                    match v {
                        toml::Value::Table(t) => tables.push((format!("{path} secret[{i}]"), t)),
                        _ => problems.push(format!("{path} secret[{i}]: not a table")),
                    }
                }
            }
            Ok(t) => tables.push((path.clone(), t)),
            Err(e) => problems.push(format!("{path}: {}", e.message())),
        }
    }
    let mut out: Vec<Declared> = Vec::new();
    let mut names = std::collections::BTreeSet::new();
    for (at, table) in tables {
        if let Some(name) = table.get("name").and_then(|n| n.as_str())
            && !names.insert(name.to_string())
        {
            problems.push(format!("{at}: secret {name:?} is declared more than once"));
            continue;
        }
        if let Some(d) = one(&at, table, install, &mut problems) {
            // Two secrets writing one key would overwrite each other.
            for t in &d.kubernetes {
                if let Some(o) = out.iter().find(|o| o.kubernetes.contains(t)) {
                    problems.push(format!("{at}: {t} is also the target of secret {:?}", o.name));
                }
            }
            out.push(d);
        }
    }
    if problems.is_empty() { Ok(out) } else { Err(problems) }
}

fn one(at: &str, mut t: toml::Table, install: &InstallState, problems: &mut Vec<String>) -> Option<Declared> {
    let before = problems.len();
    for k in t.keys().filter(|k| !FIELDS.contains(&k.as_str())) {
        problems.push(format!("{at}: unknown field {k:?} (known: {})", FIELDS.join(", ")));
    }
    let mut text = |key: &str, problems: &mut Vec<String>| -> Option<String> {
        match t.remove(key) {
            None => None,
            Some(toml::Value::String(s)) => Some(s),
            Some(_) => {
                problems.push(format!("{at}: {key} must be a string"));
                None
            }
        }
    };
    let name = text("name", problems).unwrap_or_default();
    let format = text("format", problems).unwrap_or_default();
    let default = text("default", problems).unwrap_or_default();
    let namespace = text("kubernetes_secret_namespace", problems).unwrap_or_default();
    let secret_name = text("kubernetes_secret_name", problems).unwrap_or_default();
    let terraform_variable = text("terraform_variable", problems);
    let helm_value = text("helm_value", problems);
    for key in ["display_name", "description"] {
        text(key, problems);
    }
    let mut flag = |key: &str, problems: &mut Vec<String>| -> Option<bool> {
        match t.remove(key) {
            None => None,
            Some(toml::Value::Boolean(b)) => Some(b),
            Some(_) => {
                problems.push(format!("{at}: {key} must be true or false"));
                None
            }
        }
    };
    let required = flag("required", problems).unwrap_or(false);
    let auto_generate = flag("auto_generate", problems).unwrap_or(false);
    // Whether the install stack asks the customer for the value (the default).
    let user_configurable = flag("user_configurable", problems).unwrap_or(true);
    let kubernetes_sync = flag("kubernetes_sync", problems);
    let at = if name.is_empty() { at.to_string() } else { format!("{at} ({name})") };
    if name.is_empty() {
        problems.push(format!("{at}: name is required"));
    } else if !valid_name(&name) {
        problems.push(format!("{at}: name {name:?} must be 1-128 of [A-Za-z0-9_-]"));
    }
    // The modelled system's combinations, all reported.
    if auto_generate && required {
        problems.push(format!("{at}: auto_generate and required cannot both be set"));
    }
    if !default.is_empty() && required {
        problems.push(format!("{at}: required and default cannot both be set"));
    }
    if !default.is_empty() && auto_generate {
        problems.push(format!("{at}: auto_generate and default cannot both be set"));
    }
    if !user_configurable && required {
        problems.push(format!(
            "{at}: required with user_configurable = false: the customer must give a value the stack does not ask for"
        ));
    }
    if !user_configurable && !auto_generate && default.is_empty() {
        problems.push(format!(
            "{at}: user_configurable = false needs auto_generate or a default, or the secret never has a value"
        ));
    }
    let format = match format.as_str() {
        "" => Format::Plain,
        "base64" => Format::Base64,
        other => {
            problems.push(format!("{at}: format {other:?} is not \"base64\" or empty (plain text)"));
            Format::Plain
        }
    };
    let single = (kubernetes_sync == Some(true)).then_some((namespace.as_str(), secret_name.as_str()));
    let kubernetes = kubernetes_targets(&at, &mut t, single, install, problems);
    check_value_names(&at, terraform_variable.as_deref(), helm_value.as_deref(), problems);
    let read_by = read_by(&at, &mut t, install, problems);
    if problems.len() > before {
        return None;
    }
    Some(Declared {
        name,
        required,
        user_configurable,
        format,
        kubernetes,
        terraform_variable,
        helm_value,
        read_by,
    })
}

/// A template rendered for the install; a failure is a problem and leaves it as written.
fn render(install: &InstallState, at: &str, what: &str, s: &str, problems: &mut Vec<String>) -> String {
    install.render(s).unwrap_or_else(|e| {
        problems.push(format!("{at}: {what}: {e}"));
        s.to_string()
    })
}

/// The Kubernetes Secrets a secret is written to: `kubernetes_sync_targets`, or the
/// modelled system's single target (`single`: its namespace and name, when
/// `kubernetes_sync` is on), each checked as Kubernetes names it.
fn kubernetes_targets(
    at: &str,
    t: &mut toml::Table,
    single: Option<(&str, &str)>,
    install: &InstallState,
    problems: &mut Vec<String>,
) -> Vec<KubeTarget> {
    let render = |what: &str, s: &str, problems: &mut Vec<String>| render(install, at, what, s, problems);
    let mut kubernetes = Vec::new();
    let targets = match t.remove("kubernetes_sync_targets") {
        None => Vec::new(),
        Some(toml::Value::Array(a)) => a,
        Some(_) => {
            problems.push(format!("{at}: kubernetes_sync_targets must be an array of tables"));
            Vec::new()
        }
    };
    for (i, target) in targets.into_iter().enumerate() {
        let here = format!("{at}: kubernetes_sync_targets[{i}]");
        let toml::Value::Table(mut target) = target else {
            problems.push(format!("{here}: not a table"));
            continue;
        };
        for k in target.keys().filter(|k| !TARGET_FIELDS.contains(&k.as_str())) {
            problems.push(format!("{here}: unknown field {k:?} (known: {})", TARGET_FIELDS.join(", ")));
        }
        let field = |target: &mut toml::Table, key: &str, problems: &mut Vec<String>| match target.remove(key)
        {
            Some(toml::Value::String(s)) if !s.is_empty() => Some(s),
            _ => {
                problems.push(format!("{here}: {key} must be set"));
                None
            }
        };
        let (secret, key) = (field(&mut target, "name", problems), field(&mut target, "key", problems));
        let namespaces: Vec<String> = match target.remove("namespaces") {
            Some(toml::Value::Array(a)) if !a.is_empty() => {
                a.into_iter().filter_map(|v| v.as_str().map(str::to_string)).collect()
            }
            _ => {
                problems.push(format!("{here}: namespaces must list at least one namespace"));
                Vec::new()
            }
        };
        let (Some(secret), Some(key)) = (secret, key) else { continue };
        for ns in namespaces {
            kubernetes.push(KubeTarget {
                namespace: render("namespace", &ns, problems),
                name: render("name", &secret, problems),
                key: render("key", &key, problems),
            });
        }
    }
    if let Some((namespace, secret_name)) = single
        && kubernetes.is_empty()
    {
        if secret_name.is_empty() {
            problems.push(format!("{at}: kubernetes_secret_name must be set when kubernetes_sync is true"));
        }
        if namespace.is_empty() {
            problems
                .push(format!("{at}: kubernetes_secret_namespace must be set when kubernetes_sync is true"));
        }
        if !secret_name.is_empty() && !namespace.is_empty() {
            // The modelled system's single target writes the key `value`.
            kubernetes.push(KubeTarget {
                namespace: render("kubernetes_secret_namespace", namespace, problems),
                name: render("kubernetes_secret_name", secret_name, problems),
                key: "value".into(),
            });
        }
    }
    for k in &kubernetes {
        for (what, v) in [("namespace", &k.namespace), ("name", &k.name)] {
            if !rfc1123(v) {
                problems.push(format!("{at}: Kubernetes {what} {v:?} is not a valid RFC 1123 name"));
            }
        }
        let key_ok = !k.key.is_empty()
            && k.key.len() <= 253
            && k.key.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b));
        if !key_ok {
            problems.push(format!("{at}: Kubernetes Secret key {:?} is not valid ([-._a-zA-Z0-9]+)", k.key));
        }
    }
    kubernetes
}

/// The terraform variable and helm value a secret is passed as must be names of theirs.
fn check_value_names(
    at: &str,
    terraform_variable: Option<&str>,
    helm_value: Option<&str>,
    problems: &mut Vec<String>,
) {
    if let Some(v) = terraform_variable {
        let ok = !v.is_empty()
            && !v.starts_with(|c: char| c.is_ascii_digit())
            && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !ok {
            problems.push(format!("{at}: terraform_variable {v:?} is not a terraform variable name"));
        }
    }
    if let Some(p) = helm_value {
        let ok = p
            .split('.')
            .all(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b)));
        if !ok {
            problems.push(format!("{at}: helm_value {p:?} is not a value path (a.b.c of [A-Za-z0-9_-])"));
        }
    }
}

/// Who may read the secret: role types or (templated) role names.
fn read_by(at: &str, t: &mut toml::Table, install: &InstallState, problems: &mut Vec<String>) -> Vec<String> {
    match t.remove("read_by") {
        None => DEFAULT_READ_BY.iter().map(|s| s.to_string()).collect(),
        // Role names may be templates, as in the role files.
        Some(toml::Value::Array(a))
            if !a.is_empty() && a.iter().all(|v| v.as_str().is_some_and(|s| !s.is_empty())) =>
        {
            a.iter().filter_map(|v| v.as_str()).map(|r| render(install, at, "read_by", r, problems)).collect()
        }
        Some(_) => {
            problems.push(format!("{at}: read_by must list role types or role names"));
            Vec::new()
        }
    }
}

/// A Kubernetes object name or namespace: lower-case alphanumerics, `-` and `.`.
fn rfc1123(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.'])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn install() -> InstallState {
        InstallState::new("inst-1", None, Some("us-east-1"), None)
    }

    fn app(secrets: &str, files: &[(&str, &str)]) -> AppConfig {
        AppConfig {
            secrets: Some(secrets.into()),
            secret_files: files.iter().map(|(p, t)| (p.to_string(), t.to_string())).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_modelled_systems_fields_load_unchanged_with_ours() {
        let a = app(
            r#"
[[secret]]
name = "db_password"
display_name = "Database password"
description = "Master password of the app's database"
required = true
user_configurable = true
kubernetes_sync = true
kubernetes_secret_namespace = "{{.nuon.install.id}}-app"
kubernetes_secret_name = "db"
terraform_variable = "db_password"

[[secret]]
name = "signing_key"
description = "generated"
auto_generate = true
user_configurable = false
format = "base64"
helm_value = "auth.signingKey"
read_by = ["maintenance"]
[[secret.kubernetes_sync_targets]]
namespaces = ["a", "b"]
name = "signing"
key = "key"
"#,
            &[
                (
                    "secrets/vendor/api_key.toml",
                    "name = \"api_key\"\ndescription = \"x\"\ndefault = \"none-given\"\n",
                ),
                ("secrets/vendor/more.toml", "[[secret]]\nname = \"webhook\"\n"),
                ("secrets/zz_license.toml", "name = \"license\"\ndescription = \"flat\"\nrequired = true\n"),
            ],
        );
        let d = declared(&a, &install()).unwrap();
        assert_eq!(d.len(), 5);
        assert!(d.iter().any(|s| s.name == "license" && s.required), "a file directly under secrets/");
        assert_eq!(
            d[0].kubernetes,
            vec![KubeTarget { namespace: "inst-1-app".into(), name: "db".into(), key: "value".into() }]
        );
        assert_eq!(d[0].read_by, vec!["provision", "maintenance"]);
        assert!(d[0].required);
        assert_eq!(d[1].format, Format::Base64);
        assert_eq!(d[1].kubernetes.len(), 2);
        assert_eq!(d[1].helm_value.as_deref(), Some("auth.signingKey"));
        assert_eq!(d[1].read_by, vec!["maintenance"]);
        assert_eq!(d[2].name, "api_key");
        assert!(d[2].kubernetes.is_empty() && d[2].terraform_variable.is_none());
        assert_eq!(d[3].name, "webhook");
    }

    #[test]
    fn unknown_fields_and_bad_combinations_are_reported_all_at_once() {
        let a = app(
            r#"
[[secret]]
name = "a"
required = true
auto_generate = true
default = "x"
valu = "typo"

[[secret]]
name = "b"
kubernetes_sync = true
format = "hex"

[[secret]]
name = "a"

[[secret]]
name = "c"
terraform_variable = "1bad"
helm_value = "a..b"
read_by = []
[[secret.kubernetes_sync_targets]]
namespaces = ["Bad_NS"]
name = "s"

[[secret]]
name = "e"
required = true
user_configurable = false

[[secret]]
name = "f"
user_configurable = false

[[secret]]
name = "g"
user_configurable = "yes"

[[kubernetes_sync_targets]]
namespaces = ["app"]
name = "x"
key = "y"
"#,
            &[("secrets/a/b/x.toml", "name = \"d\"")],
        );
        let problems = declared(&a, &install()).unwrap_err();
        let all = problems.join("\n");
        for needle in [
            "unknown field \"valu\"",
            "auto_generate and required",
            "required and default",
            "auto_generate and default",
            "kubernetes_secret_name must be set",
            "kubernetes_secret_namespace must be set",
            "format \"hex\"",
            "declared more than once",
            "terraform_variable \"1bad\"",
            "helm_value \"a..b\"",
            "read_by must list",
            "key must be set",
            "secrets/a/b/x.toml: secret files are secrets/<name>.toml or secrets/<group>/<name>.toml",
            "(e): required with user_configurable = false",
            "(f): user_configurable = false needs auto_generate or a default",
            "secret[6]: user_configurable must be true or false",
            "[[kubernetes_sync_targets]] at the top level belongs to no secret",
        ] {
            assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
        }
    }

    #[test]
    fn two_secrets_may_not_write_one_key() {
        let a = app(
            "[[secret]]\nname = \"a\"\nkubernetes_sync = true\nkubernetes_secret_namespace = \"n\"\nkubernetes_secret_name = \"s\"\n\n[[secret]]\nname = \"b\"\n[[secret.kubernetes_sync_targets]]\nnamespaces = [\"n\"]\nname = \"s\"\nkey = \"value\"\n",
            &[],
        );
        let problems = declared(&a, &install()).unwrap_err();
        assert!(
            problems[0].contains("kubernetes:n/s#value is also the target of secret \"a\""),
            "{problems:?}"
        );
    }
}
