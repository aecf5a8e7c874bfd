//! The shared collector every section parses with: typed reads that record a problem
//! instead of stopping at the first, unknown keys reported when a section is finished,
//! and the environment overrides applied before any section is read.

use std::net::IpAddr;
use std::time::Duration;

use super::ENV_PREFIX;

/// Reads typed fields from one table, collecting problems instead of stopping at the
/// first, and reports every key that was never read as unknown.
pub(super) struct Fields<'p> {
    section: &'static str,
    table: toml::Table,
    problems: &'p mut Vec<String>,
}

impl<'p> Fields<'p> {
    pub(super) fn new(section: &'static str, table: toml::Table, problems: &'p mut Vec<String>) -> Self {
        Fields { section, table, problems }
    }

    fn name(&self, key: &str) -> String {
        if self.section.is_empty() { key.to_string() } else { format!("{}.{key}", self.section) }
    }

    pub(super) fn problem(&mut self, p: String) {
        self.problems.push(p);
    }

    pub(super) fn get<T: serde::de::DeserializeOwned>(&mut self, key: &str) -> Option<T> {
        let v = self.table.remove(key)?;
        match v.clone().try_into::<T>() {
            Ok(t) => Some(t),
            Err(e) => {
                let name = self.name(key);
                let msg = e.to_string();
                self.problems.push(format!("{name}: {} (got {v})", msg.trim()));
                None
            }
        }
    }

    pub(super) fn required<T: serde::de::DeserializeOwned>(&mut self, key: &str) -> Option<T> {
        let present = self.table.contains_key(key);
        let v = self.get(key);
        if !present {
            let name = self.name(key);
            self.problems.push(format!("{name}: required setting is missing"));
        }
        v
    }

    pub(super) fn ranged(&mut self, key: &str, default: u64, range: std::ops::RangeInclusive<u64>) -> u64 {
        match self.get::<u64>(key) {
            None => default,
            Some(v) if range.contains(&v) => v,
            Some(v) => {
                let name = self.name(key);
                self.problems.push(format!(
                    "{name}: {v} is out of range {}..={}",
                    range.start(),
                    range.end()
                ));
                default
            }
        }
    }

    pub(super) fn secs(&mut self, key: &str, default: u64, range: std::ops::RangeInclusive<u64>) -> Duration {
        Duration::from_secs(self.ranged(key, default, range))
    }

    /// A path setting with a default; a relative path is a problem.
    pub(super) fn absolute_path(&mut self, key: &str, default: &str) -> std::path::PathBuf {
        let path = std::path::PathBuf::from(self.get::<String>(key).unwrap_or_else(|| default.into()));
        self.require_absolute(key, &path);
        path
    }

    /// Records a problem if `path` (the value of `key`) is relative.
    pub(super) fn require_absolute(&mut self, key: &str, path: &std::path::Path) {
        if !path.is_absolute() {
            let name = self.name(key);
            self.problems.push(format!("{name}: {} must be an absolute path", path.display()));
        }
    }

    pub(super) fn table(&mut self, key: &str) -> toml::Table {
        match self.table.remove(key) {
            None => toml::Table::new(),
            Some(toml::Value::Table(t)) => t,
            Some(_) => {
                let name = self.name(key);
                self.problems.push(format!("{name}: must be a table"));
                toml::Table::new()
            }
        }
    }

    /// Every key left unread is unknown. The section's own checks follow on `problems`.
    pub(super) fn finish(self) -> &'p mut Vec<String> {
        for key in self.table.keys() {
            let name = self.name(key);
            self.problems.push(format!("{name}: unknown setting"));
        }
        self.problems
    }
}

/// An https URL, or plain http to a loopback address when the dev flag allows it; never
/// with credentials in it.
pub(super) fn validate_url(s: &str, allow_insecure_loopback: bool) -> Result<reqwest::Url, String> {
    let url = reqwest::Url::parse(s).map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err("credentials must not be embedded in the URL".into());
    }
    match url.scheme() {
        "https" => Ok(url),
        "http" => {
            let loopback = match url.host() {
                Some(url::Host::Domain(d)) => d == "localhost",
                Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip).is_loopback(),
                Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip).is_loopback(),
                None => false,
            };
            if !loopback {
                Err("plain http:// is only allowed to a loopback address; use https://".into())
            } else if !allow_insecure_loopback {
                Err("plain http:// needs control_plane.allow_insecure_loopback = true (development only)"
                    .into())
            } else {
                Ok(url)
            }
        }
        other => Err(format!("scheme {other:?} is not supported; use https://")),
    }
}

/// `BYOC_RUNNER__POLL__WAIT_SECS=10` sets `[poll] wait_secs = 10`. Values are parsed as
/// TOML when they can be (numbers, booleans, arrays), else taken as strings.
pub(super) fn apply_env_overrides(
    root: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
    problems: &mut Vec<String>,
) {
    for (name, value) in env {
        let Some(path) = name.strip_prefix(ENV_PREFIX) else { continue };
        let parts: Vec<String> = path.split("__").map(|p| p.to_ascii_lowercase()).collect();
        if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
            problems.push(format!("{name}: expected {ENV_PREFIX}SECTION__KEY"));
            continue;
        }
        let parsed = format!("v = {value}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or(toml::Value::String(value));
        if let Err(e) = insert_path(root, &parts, parsed) {
            problems.push(format!("{name}: {e}"));
        }
    }
}

fn insert_path(table: &mut toml::Table, parts: &[String], value: toml::Value) -> Result<(), String> {
    let Some((first, rest)) = parts.split_first() else { return Err("empty setting name".into()) };
    if rest.is_empty() {
        table.insert(first.clone(), value);
        return Ok(());
    }
    match table.entry(first.clone()).or_insert_with(|| toml::Value::Table(Default::default())) {
        toml::Value::Table(t) => insert_path(t, rest, value),
        _ => Err(format!("{first} is not a table")),
    }
}
