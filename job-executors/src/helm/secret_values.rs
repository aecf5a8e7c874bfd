//! The secret values file a `helm` job hands helm (`-f secret-values.json`, 0600): the
//! job's own `secret_values` and the customer's secrets it names, each at the value path
//! the app config declares (docs/SECRETS.md).

use std::collections::BTreeMap;

/// The secret values file's content: the job's own `secret_values` (top-level keys),
/// and each customer secret at its declared path (`a.b.c`, nested), with where each went.
pub(super) fn secret_values(
    flat: &BTreeMap<String, String>,
    fetched: &[crate::secrets::Fetched],
) -> Result<(serde_json::Value, BTreeMap<String, Vec<String>>), crate::InvalidSpec> {
    let mut file = serde_json::json!(flat);
    let mut written: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for f in fetched {
        let (Some(path), Some(value)) = (&f.declared.helm_value, &f.value) else { continue };
        let mut at = &mut file;
        for part in path.split('.') {
            let Some(object) = at.as_object_mut() else {
                return Err(crate::InvalidSpec::from(format!(
                    "helm value {path} (of secret {}) crosses another value",
                    f.declared.name
                )));
            };
            at = object.entry(part).or_insert(serde_json::json!({}));
        }
        if !(at.is_object() && at.as_object().is_some_and(|o| o.is_empty())) {
            return Err(crate::InvalidSpec::from(format!(
                "helm value {path} (of secret {}) is set twice",
                f.declared.name
            )));
        }
        *at = serde_json::Value::String(value.clone());
        written.entry(f.declared.name.clone()).or_default().push(format!("helm:{path}"));
    }
    Ok((file, written))
}

#[cfg(test)]
mod tests {
    use super::*;
    fn fetched(name: &str, path: &str, value: Option<&str>) -> crate::secrets::Fetched {
        crate::secrets::Fetched {
            declared: crate::secrets::Declared {
                name: name.into(),
                required: false,
                user_configurable: true,
                format: crate::secrets::Format::Plain,
                kubernetes: vec![],
                terraform_variable: None,
                helm_value: Some(path.into()),
                read_by: vec!["maintenance".into()],
            },
            value: value.map(str::to_string),
            version_id: value.map(|_| "v1".to_string()),
            digest: None,
        }
    }

    #[test]
    fn customer_secrets_go_to_their_declared_value_paths() {
        let flat = BTreeMap::from([("apiToken".to_string(), "vendor-known-token".to_string())]);
        let (file, written) = secret_values(
            &flat,
            &[
                fetched("session_key", "auth.sessionKey", Some("s3ss10n-key")),
                fetched("db_password", "db.auth.password", Some("db-pa55")),
                fetched("unset", "x.y", None),
            ],
        )
        .unwrap();
        assert_eq!(
            file,
            serde_json::json!({"apiToken": "vendor-known-token", "auth": {"sessionKey": "s3ss10n-key"},
                "db": {"auth": {"password": "db-pa55"}}})
        );
        assert_eq!(written["session_key"], ["helm:auth.sessionKey"]);
        assert!(!written.contains_key("unset"), "an unset optional secret is not written");
        // Two values at one path, or a path through a value, is an error, not an overwrite.
        let clash = secret_values(&flat, &[fetched("a", "apiToken.inner", Some("aaaa"))]).unwrap_err();
        assert!(clash.0.contains("crosses another value"), "{clash}");
        let twice = secret_values(
            &BTreeMap::new(),
            &[fetched("a", "auth.key", Some("aaaa")), fetched("b", "auth.key", Some("bbbb"))],
        )
        .unwrap_err();
        assert!(twice.0.contains("set twice") && !twice.0.contains("bbbb"), "{twice}");
    }
}
