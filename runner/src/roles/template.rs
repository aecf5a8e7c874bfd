//! Go-template role names (`{{.install.id}}-maintenance`), resolved against install
//! state. Only field references are supported (`{{ .a.b }}`, with optional `-` trim
//! markers); anything else (pipes, functions) is refused rather than guessed at.
//! `.nuon.` is accepted as an alias prefix so app configs written for that system load
//! unchanged.

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("template {template:?}: {{{{ without a closing }}}}")]
    Unclosed { template: String },
    #[error(
        "template {template:?}: {expr:?} is not supported (only field references like {{{{.install.id}}}})"
    )]
    Unsupported { template: String, expr: String },
    #[error("template {template:?}: no install value .{path} (known: {known})")]
    UnknownValue { template: String, path: String, known: String },
}

/// The values a role-name template may read, by dotted path (`install.id`).
#[derive(Debug, Clone, Default)]
pub struct InstallState {
    values: BTreeMap<String, String>,
}

impl InstallState {
    pub fn new(
        install_id: &str,
        install_name: Option<&str>,
        region: Option<&str>,
        account_id: Option<&str>,
    ) -> Self {
        let mut values = BTreeMap::new();
        values.insert("install.id".to_string(), install_id.to_string());
        if let Some(n) = install_name {
            values.insert("install.name".into(), n.into());
        }
        if let Some(r) = region {
            values.insert("cloud_account.aws.region".into(), r.into());
        }
        if let Some(a) = account_id {
            values.insert("cloud_account.aws.account_id".into(), a.into());
        }
        InstallState { values }
    }

    /// Another value templates may read (`org.id`, `app.id`), when it is known.
    pub fn with(mut self, path: &str, value: Option<&str>) -> Self {
        if let Some(v) = value {
            self.values.insert(path.into(), v.into());
        }
        self
    }

    pub fn render(&self, template: &str) -> Result<String, TemplateError> {
        let mut out = String::with_capacity(template.len());
        let mut rest = template;
        while let Some(start) = rest.find("{{") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let end =
                after.find("}}").ok_or_else(|| TemplateError::Unclosed { template: template.into() })?;
            let raw = &after[..end];
            let expr = raw.strip_prefix('-').unwrap_or(raw);
            let expr = expr.strip_suffix('-').unwrap_or(expr).trim();
            let path = expr.strip_prefix('.').filter(|p| {
                !p.is_empty()
                    && p.split('.').all(|seg| {
                        !seg.is_empty() && seg.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    })
            });
            let Some(path) = path else {
                return Err(TemplateError::Unsupported {
                    template: template.into(),
                    expr: raw.trim().into(),
                });
            };
            let path = path.strip_prefix("nuon.").unwrap_or(path);
            let value = self.values.get(path).ok_or_else(|| TemplateError::UnknownValue {
                template: template.into(),
                path: path.into(),
                known: self.values.keys().map(|k| format!(".{k}")).collect::<Vec<_>>().join(", "),
            })?;
            out.push_str(value);
            rest = &after[end + 2..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> InstallState {
        InstallState::new("inst-1", Some("acme"), Some("eu-west-1"), None)
    }

    #[test]
    fn renders_field_references_in_both_namespaces() {
        let s = state();
        assert_eq!(s.render("{{.install.id}}-maintenance").unwrap(), "inst-1-maintenance");
        assert_eq!(s.render("{{ .nuon.install.id }}-maintenance").unwrap(), "inst-1-maintenance");
        assert_eq!(
            s.render("{{- .install.name -}}-{{.cloud_account.aws.region}}").unwrap(),
            "acme-eu-west-1"
        );
        assert_eq!(s.render("plain-name").unwrap(), "plain-name");
        let s = state().with("org.id", Some("org-9")).with("app.id", Some("app-3")).with("x", None);
        assert_eq!(s.render("{{.nuon.org.id}}-{{ .nuon.app.id }}-ops").unwrap(), "org-9-app-3-ops");
        assert!(s.render("{{.x}}").is_err(), "a value not given stays unknown");
    }

    #[test]
    fn refuses_what_it_cannot_resolve() {
        let s = state();
        assert!(matches!(s.render("{{.install.id"), Err(TemplateError::Unclosed { .. })));
        assert!(matches!(s.render("{{ .install.id | upper }}"), Err(TemplateError::Unsupported { .. })));
        assert!(matches!(s.render("{{ printf \"x\" }}"), Err(TemplateError::Unsupported { .. })));
        assert!(matches!(s.render("{{.}}"), Err(TemplateError::Unsupported { .. })));
        let e = s.render("{{.cloud_account.aws.account_id}}-x").unwrap_err();
        assert!(
            matches!(&e, TemplateError::UnknownValue { path, .. } if path == "cloud_account.aws.account_id")
        );
        assert!(e.to_string().contains(".install.id"), "{e}");
    }
}
