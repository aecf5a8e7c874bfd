//! `config write`: the install's `runner.toml` from the install stack's values (the
//! `BYOC_*` variables user-data reads from the stack's parameters), written with TOML's
//! own escaping, never by pasting values into text. A value that does not come back
//! unchanged when the written file is read again, or a file the runner would not load,
//! is refused and nothing is written.

use std::path::Path;

use toml::{Table, Value};

/// The header every written file starts with.
const HEADER: &str = "# Written by the install stack's user-data (`byoc-runner config write`); re-running it\n\
                      # rewrites this file.\n";

/// The stack's values, by the names user-data uses.
pub(super) trait Values {
    fn get(&self, name: &str) -> Option<String>;
}

/// The process environment: empty counts as unset.
pub(super) struct Environment;

impl Values for Environment {
    fn get(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|v| !v.is_empty())
    }
}

impl Values for Vec<(&str, &str)> {
    fn get(&self, name: &str) -> Option<String> {
        self.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()).filter(|v| !v.is_empty())
    }
}

fn string(v: String) -> Value {
    Value::String(v)
}

/// The document for `values`; every problem at once.
pub(super) fn document(values: &dyn Values) -> Result<Table, Vec<String>> {
    let mut problems = Vec::new();
    let mut required = |name: &str| {
        values.get(name).unwrap_or_else(|| {
            problems.push(format!("{name} is not set"));
            String::new()
        })
    };
    let (url, keys, install_id, region, release_key) = (
        required("BYOC_CONTROL_PLANE_URL"),
        required("BYOC_CONTROL_PLANE_KEYS"),
        required("BYOC_INSTALL_ID"),
        required("BYOC_REGION"),
        required("BYOC_RELEASE_PUBKEY"),
    );
    let mut doc = Table::new();
    let mut section = |name: &str, entries: Vec<(&str, Option<Value>)>| {
        let table: Table = entries.into_iter().filter_map(|(k, v)| v.map(|v| (k.to_string(), v))).collect();
        if !table.is_empty() {
            doc.insert(name.to_string(), Value::Table(table));
        }
    };
    let keys: Vec<Value> =
        keys.split(',').map(str::trim).filter(|k| !k.is_empty()).map(|k| string(k.into())).collect();
    section("control_plane", vec![("url", Some(string(url))), ("public_keys", Some(Value::Array(keys)))]);
    section(
        "runner",
        vec![
            ("install_id", Some(string(install_id))),
            ("bootstrap_token_file", Some(string("/var/lib/byoc-runner/bootstrap-token".into()))),
        ],
    );
    let opt = |name: &str| values.get(name).map(string);
    section("aws", vec![("region", Some(string(region))), ("account_id", opt("BYOC_ACCOUNT_ID"))]);
    section(
        "roles",
        vec![
            ("stack_name", opt("BYOC_STACK_NAME")),
            ("external_id", opt("BYOC_EXTERNAL_ID")),
            ("admin_group", opt("BYOC_ADMIN_GROUP")),
            ("install_name", opt("BYOC_INSTALL_NAME")),
            ("org_id", opt("BYOC_ORG_ID")),
            ("app_id", opt("BYOC_APP_ID")),
        ],
    );
    let hook = match (values.get("BYOC_AUTOSCALING_GROUP"), values.get("BYOC_LIFECYCLE_HOOK")) {
        (Some(group), Some(hook)) => {
            vec![("autoscaling_group", Some(string(group))), ("lifecycle_hook", Some(string(hook)))]
        }
        _ => Vec::new(),
    };
    section("lifecycle", [vec![("watch", Some(Value::Boolean(true)))], hook].concat());
    let mode = values.get("BYOC_UPDATE_MODE").unwrap_or_else(|| "approve".into());
    section("update", vec![("mode", Some(string(mode))), ("release_public_key", Some(string(release_key)))]);
    if let Some(bucket) = opt("BYOC_STATE_BUCKET") {
        doc.insert(
            "terraform".into(),
            Value::Table(Table::from_iter([(
                "state".to_string(),
                Value::Table(Table::from_iter([("bucket".to_string(), bucket)])),
            )])),
        );
    }
    let mut export = Table::new();
    if let Some(bucket) = opt("BYOC_AUDIT_BUCKET") {
        let mut s3 = Table::from_iter([("bucket".to_string(), bucket)]);
        if let Some(prefix) = opt("BYOC_AUDIT_S3_PREFIX") {
            s3.insert("prefix".into(), prefix);
        }
        export.insert("s3".into(), Value::Table(s3));
    }
    if let Some(group) = opt("BYOC_AUDIT_LOG_GROUP") {
        export
            .insert("cloudwatch".into(), Value::Table(Table::from_iter([("log_group".to_string(), group)])));
    }
    if let Some(endpoint) = opt("BYOC_AUDIT_OTLP_ENDPOINT") {
        let mut otlp = Table::from_iter([("endpoint".to_string(), endpoint)]);
        if let Some(ca) = opt("BYOC_AUDIT_OTLP_CA_FILE") {
            otlp.insert("ca_file".into(), ca);
        }
        export.insert("otlp".into(), Value::Table(otlp));
    }
    if !export.is_empty() {
        doc.insert(
            "audit".into(),
            Value::Table(Table::from_iter([("export".to_string(), Value::Table(export))])),
        );
    }
    // Control characters are never part of a value the stack can give.
    for (name, value) in control_characters(&doc) {
        problems.push(format!("{name}: {value:?} holds a control character"));
    }
    if problems.is_empty() { Ok(doc) } else { Err(problems) }
}

fn control_characters(doc: &Table) -> Vec<(String, String)> {
    fn walk(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
        match v {
            Value::String(s) if s.chars().any(char::is_control) => out.push((prefix.to_string(), s.clone())),
            Value::Array(a) => a.iter().for_each(|v| walk(prefix, v, out)),
            Value::Table(t) => t.iter().for_each(|(k, v)| walk(&format!("{prefix}.{k}"), v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    doc.iter().for_each(|(k, v)| walk(k, v, &mut out));
    out
}

/// The text for `doc`: TOML's escaping, checked by reading it back (it must be the
/// same document) and by the runner's own config parser (it must load, with no
/// environment overrides).
pub(super) fn render(doc: &Table) -> Result<String, Vec<String>> {
    let body = toml::to_string(doc).map_err(|e| vec![format!("writing TOML: {e}")])?;
    let text = format!("{HEADER}{body}");
    let back: Table =
        text.parse().map_err(|e: toml::de::Error| vec![format!("the written file does not parse: {e}")])?;
    if &back != doc {
        return Err(vec!["a value does not read back as itself".into()]);
    }
    crate::config::Config::parse(&text, "runner.toml", std::iter::empty()).map_err(|e| e.problems)?;
    Ok(text)
}

/// `config write --out PATH`: the file, mode 0640, written whole (temporary file, fsync,
/// rename); an exit code.
pub(super) fn write(out: &Path) -> i32 {
    match document(&Environment).and_then(|doc| render(&doc)) {
        Ok(text) => match byoc_statefs::write(out, text.as_bytes(), byoc_statefs::Options::mode(0o640)) {
            Ok(()) => {
                println!("{}: written", out.display());
                0
            }
            Err(e) => {
                eprintln!("error: writing {}: {e}", out.display());
                1
            }
        },
        Err(problems) => {
            eprintln!("error: nothing written to {}:", out.display());
            for p in problems {
                eprintln!("  - {p}");
            }
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: [(&str, &str); 5] = [
        ("BYOC_CONTROL_PLANE_URL", "https://cp.vendor.example"),
        ("BYOC_CONTROL_PLANE_KEYS", "11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo="),
        ("BYOC_INSTALL_ID", "inst-demo"),
        ("BYOC_REGION", "eu-west-1"),
        ("BYOC_RELEASE_PUBKEY", "RWQf6LRCGA9i53mlYecO4IzT51TGPpvWucNSCh1CBM0QTaLn73Y7GFO3"),
    ];

    fn with(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut v = BASE.to_vec();
        v.extend_from_slice(extra);
        v
    }

    #[test]
    fn the_stacks_values_become_a_config_the_runner_loads() {
        let values = with(&[("BYOC_EXTERNAL_ID", "ext-123"), ("BYOC_STATE_BUCKET", "inst-demo-state")]);
        let text = render(&document(&values).unwrap()).unwrap();
        let c = crate::config::Config::parse(&text, "t", std::iter::empty()).unwrap();
        assert_eq!(c.control_plane.url.as_str(), "https://cp.vendor.example/");
        assert!(text.starts_with("# Written by the install stack's user-data"), "{text}");
        assert!(text.contains("external_id = \"ext-123\""), "{text}");
        assert!(text.contains("[terraform.state]\nbucket = \"inst-demo-state\""), "{text}");
    }

    /// A quote, a newline, a `$(…)` in a value: it stays the value (escaped) or is
    /// refused; it never becomes a key or a section of its own.
    #[test]
    fn a_hostile_value_never_becomes_configuration() {
        let values = with(&[("BYOC_EXTERNAL_ID", "x\"\n[sandbox]\nenabled = false\n#")]);
        let problems = document(&values).unwrap_err();
        assert!(problems[0].contains("control character"), "{problems:?}");
        let values = with(&[("BYOC_EXTERNAL_ID", "a\"b'$(id)`c\\")]);
        let text = render(&document(&values).unwrap()).unwrap();
        let back: Table = text.parse().unwrap();
        assert_eq!(back["roles"]["external_id"].as_str(), Some("a\"b'$(id)`c\\"));
        assert!(back.get("sandbox").is_none());
        // The runner's own checks apply: a URL it would not use is refused.
        let mut values = with(&[]);
        values[0] = ("BYOC_CONTROL_PLANE_URL", "http://cp.vendor.example");
        assert!(render(&document(&values).unwrap()).is_err());
        assert_eq!(document(&Vec::new()).unwrap_err().len(), 5, "every missing value named");
    }
}
