//! `[control_plane]`: where the runner polls, the pinned job-signing keys, TLS.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use ed25519_dalek::VerifyingKey;

use super::fields::{Fields, validate_url};

#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    pub url: reqwest::Url,
    /// Pinned control-plane job-signing keys, by key id.
    pub public_keys: BTreeMap<String, VerifyingKey>,
    pub ca_bundle: Option<PathBuf>,
    /// Dev only: allow plain http:// when the host is loopback.
    pub allow_insecure_loopback: bool,
    pub request_timeout: Duration,
}

impl ControlPlaneConfig {
    /// `None` when a required setting is missing or unusable (the problem is recorded).
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Option<Self> {
        let mut f = Fields::new("control_plane", table, problems);
        let url_s: Option<String> = f.required("url");
        let keys_s: Vec<String> = f.get("public_keys").unwrap_or_default();
        let ca_bundle: Option<PathBuf> = f.get::<String>("ca_bundle").map(PathBuf::from);
        let allow_insecure_loopback = f.get("allow_insecure_loopback").unwrap_or(false);
        let request_timeout = f.secs("request_timeout_secs", 30, 1..=600);
        let problems = f.finish();
        let url = url_s.and_then(|u| match validate_url(&u, allow_insecure_loopback) {
            Ok(url) => Some(url),
            Err(e) => {
                problems.push(format!("control_plane.url: {e}"));
                None
            }
        });
        let mut public_keys = BTreeMap::new();
        if keys_s.is_empty() {
            problems.push(
                "control_plane.public_keys: at least one pinned control-plane key is required \
                 (base64 Ed25519 public key from the install stack)"
                    .into(),
            );
        }
        for (i, k) in keys_s.iter().enumerate() {
            match byoc_protocol::parse_public_key(k) {
                Ok(key) => {
                    public_keys.insert(byoc_protocol::key_id(&key), key);
                }
                Err(e) => problems.push(format!("control_plane.public_keys[{i}]: {e}")),
            }
        }
        if let Some(ca) = &ca_bundle
            && !ca.is_file()
        {
            problems.push(format!("control_plane.ca_bundle: {} is not a readable file", ca.display()));
        }
        Some(ControlPlaneConfig {
            url: url?,
            public_keys,
            ca_bundle,
            allow_insecure_loopback,
            request_timeout,
        })
    }
}
