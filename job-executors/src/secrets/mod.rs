//! The customer's secrets (docs/SECRETS.md): a job names a secret, never carries its
//! value. The runner reads it from the install's Secrets Manager under the job's role,
//! feeds it to the masker before anything else sees it, writes it only where the app
//! config declares it, and reports the name, the version id and a keyed digest.
//!
//! The app config's declarations are parsed by the runner (templates need the install);
//! here are what they become ([`Declared`]), the check of a job's uses against them, the
//! read ([`fetch`]) and the Kubernetes writer shared by `secrets.sync` and `kubernetes`
//! jobs.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::ExecContext;

pub mod store;
pub mod sync;

/// Digests are `hmac-sha256:<hex>` under the install's own key: equal values give equal
/// digests on one install (so a rotation shows), and nobody without the key can test a
/// guess against them.
pub const DIGEST_PREFIX: &str = "hmac-sha256:";
/// Our field manager for the Secrets we write.
pub const FIELD_MANAGER: &str = "byoc-runner-secrets";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// Text, written as is.
    Plain,
    /// The value is base64 of the bytes meant (a Kubernetes Secret gets those bytes).
    Base64,
}

/// A key of a Kubernetes Secret a secret is written to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubeTarget {
    pub namespace: String,
    pub name: String,
    pub key: String,
}

impl std::fmt::Display for KubeTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kubernetes:{}/{}#{}", self.namespace, self.name, self.key)
    }
}

/// A secret as the app config declares it, templates resolved for this install.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Declared {
    pub name: String,
    pub required: bool,
    /// Whether the install stack asks the customer for it (else generated or defaulted).
    #[serde(default = "asked_of_the_customer")]
    pub user_configurable: bool,
    pub format: Format,
    /// `kubernetes_sync` targets (the single legacy one with key `value`, or
    /// `kubernetes_sync_targets` fanned out over their namespaces).
    pub kubernetes: Vec<KubeTarget>,
    /// Our addition: the terraform variable a `terraform` job may pass it as.
    pub terraform_variable: Option<String>,
    /// Our addition: the helm value path (`a.b.c`) a `helm` job may set it at.
    pub helm_value: Option<String>,
    /// Our addition: role types or names that may read it (default provision and
    /// maintenance); the install stack grants read to these roles only.
    pub read_by: Vec<String>,
}

fn asked_of_the_customer() -> bool {
    true
}

/// Where a job would put a secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The declared Kubernetes targets, or the one the job names (which must be among them).
    Kubernetes(Option<KubeTarget>),
    TerraformVariable,
    HelmValue,
}

/// A secret a job names, and where it would put it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretUse {
    pub name: String,
    pub target: Target,
}

/// A secret's name (`[A-Za-z0-9_-]`, 1-128): part of its Secrets Manager name.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The uses of a job that names `names`, each for `target`.
pub fn uses(names: &[String], target: Target) -> Vec<SecretUse> {
    names.iter().map(|name| SecretUse { name: name.clone(), target: target.clone() }).collect()
}

/// A job that would send a secret somewhere the app config does not declare.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotDeclared(pub String);

/// Every use must name a declared secret and a target declared for it.
pub fn check_uses(declared: &[Declared], uses: &[SecretUse]) -> Result<(), NotDeclared> {
    for u in uses {
        let Some(d) = declared.iter().find(|d| d.name == u.name) else {
            return Err(NotDeclared(format!(
                "secret {:?} is not declared in the app config (secrets.toml or secrets/)",
                u.name
            )));
        };
        let declared_here = match &u.target {
            Target::Kubernetes(None) => !d.kubernetes.is_empty(),
            Target::Kubernetes(Some(t)) => d.kubernetes.contains(t),
            Target::TerraformVariable => d.terraform_variable.is_some(),
            Target::HelmValue => d.helm_value.is_some(),
        };
        if !declared_here {
            let to = match &u.target {
                Target::Kubernetes(None) => "a Kubernetes Secret (kubernetes_sync)".to_string(),
                Target::Kubernetes(Some(t)) => t.to_string(),
                Target::TerraformVariable => "a terraform variable (terraform_variable)".into(),
                Target::HelmValue => "a helm value (helm_value)".into(),
            };
            return Err(NotDeclared(format!(
                "secret {:?}: the app config does not declare {to} as a target of it",
                u.name
            )));
        }
    }
    Ok(())
}

/// What the runner gives jobs that use secrets.
#[derive(Clone)]
pub struct SecretSettings {
    pub declared: Vec<Declared>,
    pub store: store::Store,
    /// The per-install digest key (the runner's state dir, never sent anywhere).
    pub digest_key: Arc<Vec<u8>>,
    /// The job's role: (type, name). `None`: no role, so no secret can be read.
    pub role: Option<(String, String)>,
}

impl std::fmt::Debug for SecretSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretSettings")
            .field("declared", &self.declared.len())
            .field("store", &self.store)
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

/// The role session a secret is read with.
pub struct SessionKeys {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
    pub region: String,
}

/// A secret read for a job. `value` is `None` for an optional secret the customer left
/// unset (nothing is written for it).
pub struct Fetched {
    pub declared: Declared,
    pub value: Option<String>,
    pub version_id: Option<String>,
    pub digest: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("{0}")]
    NotDeclared(#[from] NotDeclared),
    #[error("secret {name:?}: {why}")]
    Forbidden { name: String, why: String },
    #[error(
        "secret {name:?} is required and has no value in the install's Secrets Manager ({id}): the customer sets it through the install stack's parameter"
    )]
    Missing { name: String, id: String },
    #[error("secret {name:?}: {why}")]
    Format { name: String, why: String },
    #[error("secret {name:?}: reading it from Secrets Manager failed: {why}")]
    Store { name: String, why: String },
    #[error("{0}")]
    Unavailable(String),
}

impl SecretError {
    pub fn code(&self) -> &'static str {
        match self {
            SecretError::NotDeclared(_) => "secret_target_not_declared",
            SecretError::Forbidden { .. } => "secret_forbidden",
            SecretError::Missing { .. } => "secret_missing",
            SecretError::Format { .. } => "secret_format_invalid",
            SecretError::Store { .. } => "secret_store_error",
            SecretError::Unavailable(_) => "secret_unavailable",
        }
    }
}

/// The keyed digest of a value.
pub fn digest(key: &[u8], value: &[u8]) -> String {
    // RFC 2104 over SHA-256 (block size 64).
    use sha2::Digest as _;
    let mut block = [0u8; 64];
    if key.len() > block.len() {
        block[..32].copy_from_slice(&sha2::Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.iter().map(|b| b ^ byte).collect::<Vec<u8>>();
    let inner = sha2::Sha256::new().chain_update(pad(0x36)).chain_update(value).finalize();
    let outer = sha2::Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize();
    format!("{DIGEST_PREFIX}{}", hex::encode(outer))
}

fn session_keys(ctx: &ExecContext<'_>) -> Option<SessionKeys> {
    let env = &ctx.settings.credentials.as_ref()?.static_env;
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    Some(SessionKeys {
        access_key_id: get("AWS_ACCESS_KEY_ID")?,
        secret_access_key: get("AWS_SECRET_ACCESS_KEY")?,
        session_token: get("AWS_SESSION_TOKEN"),
        region: get("AWS_REGION").or_else(|| get("AWS_DEFAULT_REGION"))?,
    })
}

/// Read the secrets `uses` name (each once), in the order named. Each value goes to
/// the job's masker before anything else sees it; each read is audited (name, version,
/// digest). Nothing is written here: a job writes only once every read succeeded.
pub async fn fetch(ctx: &mut ExecContext<'_>, uses: &[SecretUse]) -> Result<Vec<Fetched>, SecretError> {
    if uses.is_empty() {
        return Ok(Vec::new());
    }
    let Some(settings) = ctx.settings.secrets.clone() else {
        return Err(SecretError::Unavailable(
            "this job names the customer's secrets, which only a runner's jobs read, under a lifecycle role of the install (run-local reads none)".into(),
        ));
    };
    check_uses(&settings.declared, uses)?;
    let mut names: Vec<&str> = Vec::new();
    for u in uses {
        if !names.contains(&u.name.as_str()) {
            names.push(&u.name);
        }
    }
    let declared: Vec<&Declared> =
        names.iter().filter_map(|n| settings.declared.iter().find(|d| d.name == *n)).collect();
    let Some((role_type, role_name)) = &settings.role else {
        return Err(SecretError::Forbidden {
            name: names.first().copied().unwrap_or_default().to_string(),
            why: "the job has no role: secrets are read under a lifecycle role of the install".into(),
        });
    };
    // The app config says which roles may read each secret (the stack grants the same).
    if let Some(d) = declared.iter().find(|d| !d.read_by.iter().any(|r| r == role_type || r == role_name)) {
        return Err(SecretError::Forbidden {
            name: d.name.clone(),
            why: format!(
                "role {role_name} ({role_type}) may not read it: the app config lets {} read it",
                d.read_by.join(", ")
            ),
        });
    }
    let Some(keys) = session_keys(ctx) else {
        return Err(SecretError::Unavailable("the job's role session has no keys or region".into()));
    };
    let feed = ctx.settings.credentials.as_ref().map(|c| c.feed.clone()).unwrap_or_default();
    let mut out = Vec::new();
    for d in declared {
        let read = settings.store.get(&keys, &d.name).await;
        let fetched = match read {
            Ok(v) => {
                // Masked before any other use, whatever follows (a value too short to
                // be masked is refused, unused, before it would break the masker).
                check_length(d, &v.value)?;
                feed.add(v.value.as_bytes().to_vec());
                check_format(d, &v.value, &feed)?;
                let digest = digest(&settings.digest_key, v.value.as_bytes());
                Fetched {
                    declared: d.clone(),
                    value: Some(v.value),
                    version_id: Some(v.version_id),
                    digest: Some(digest),
                }
            }
            Err(store::ReadError::NotFound) if !d.required => {
                Fetched { declared: d.clone(), value: None, version_id: None, digest: None }
            }
            Err(store::ReadError::NotFound) => {
                return Err(SecretError::Missing {
                    name: d.name.clone(),
                    id: settings.store.secret_id(&d.name),
                });
            }
            Err(store::ReadError::Forbidden(why)) => {
                return Err(SecretError::Forbidden {
                    name: d.name.clone(),
                    why: format!("the job's role may not read it ({})", why.trim()),
                });
            }
            Err(store::ReadError::Store(why)) => {
                return Err(SecretError::Store { name: d.name.clone(), why });
            }
        };
        if let Some(audit) = &ctx.settings.audit {
            let detail = match &fetched.version_id {
                Some(v) => format!("secret {} version {v} read", d.name),
                None => format!("secret {} is not set (optional): nothing read", d.name),
            };
            let digests: BTreeMap<String, String> =
                fetched.digest.iter().map(|g| ("value".to_string(), g.clone())).collect();
            audit.record("secret_read", detail, digests).map_err(|e| SecretError::Unavailable(e.0))?;
        }
        out.push(fetched);
    }
    Ok(out)
}

fn check_length(d: &Declared, value: &str) -> Result<(), SecretError> {
    if value.len() < crate::mask::MIN_SECRET_LEN {
        return Err(SecretError::Format {
            name: d.name.clone(),
            why: format!(
                "its value is shorter than {} bytes and could not be masked reliably",
                crate::mask::MIN_SECRET_LEN
            ),
        });
    }
    Ok(())
}

fn check_format(d: &Declared, value: &str, feed: &crate::mask::SecretFeed) -> Result<(), SecretError> {
    use base64::Engine as _;
    let format = |why: String| SecretError::Format { name: d.name.clone(), why };
    if d.format == Format::Base64 {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(value.trim())
            .map_err(|_| format("format = \"base64\", and its value is not base64".into()))?;
        // What it decodes to is as secret as the text.
        if bytes.len() >= crate::mask::MIN_SECRET_LEN {
            feed.add(bytes);
        }
    }
    Ok(())
}

/// Whether any string in `value` contains, in any encoding the masker knows, a secret
/// the job has learned (a customer secret or its role session's keys).
pub fn carries_secret(ctx: &ExecContext<'_>, value: &serde_json::Value) -> bool {
    let learned = ctx.settings.credentials.as_ref().map(|c| c.feed.secrets()).unwrap_or_default();
    if learned.is_empty() {
        return false;
    }
    // A masker that cannot be built is a yes: nothing unchecked is reported.
    let Ok(masker) = crate::mask::Masker::new(&learned) else { return true };
    fn walk(m: &crate::mask::Masker, v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(s) => m.mask_str(s) != *s,
            serde_json::Value::Array(a) => a.iter().any(|v| walk(m, v)),
            serde_json::Value::Object(o) => o.iter().any(|(k, v)| m.mask_str(k) != *k || walk(m, v)),
            _ => false,
        }
    }
    walk(&masker, value)
}

/// The policy input with every secret the job has learned masked: policies judge
/// plans and manifests, not secret values, and their messages and the audit log
/// cannot repeat what they never saw.
pub fn mask_policy_input<'i>(ctx: &ExecContext<'_>, input: &'i [u8]) -> std::borrow::Cow<'i, [u8]> {
    let learned = ctx.settings.credentials.as_ref().map(|c| c.feed.secrets()).unwrap_or_default();
    let (false, Ok(text)) = (learned.is_empty(), std::str::from_utf8(input)) else {
        return std::borrow::Cow::Borrowed(input);
    };
    match crate::mask::Masker::new(&learned) {
        Ok(m) => std::borrow::Cow::Owned(m.mask_str(text).into_bytes()),
        // Unmaskable values never reach a job (fetch refuses them), so this is unreachable
        // in practice; an empty input makes the decision fail closed.
        Err(_) => std::borrow::Cow::Owned(Vec::new()),
    }
}

/// What the control plane learns of the secrets a job used: names, versions, digests
/// and where each went. Never a value.
pub fn report(fetched: &[Fetched], written: &BTreeMap<String, Vec<String>>) -> serde_json::Value {
    serde_json::Value::Array(
        fetched
            .iter()
            .map(|f| {
                serde_json::json!({
                    "name": f.declared.name,
                    "version_id": f.version_id,
                    "digest": f.digest,
                    "written_to": written.get(&f.declared.name).cloned().unwrap_or_default(),
                })
            })
            .collect(),
    )
}

/// Write each fetched secret into the Kubernetes Secrets `targets` picks for it (by
/// server-side apply, our own field manager; one object per Secret, only our keys).
/// Returns where each secret went.
pub async fn write_kubernetes(
    client: &kube::Client,
    fetched: &[Fetched],
    targets: impl Fn(&Declared) -> Vec<KubeTarget>,
) -> Result<BTreeMap<String, Vec<String>>, (&'static str, String)> {
    use base64::Engine as _;
    use kube::api::{Api, DynamicObject, Patch, PatchParams};
    let mut objects: BTreeMap<(String, String), BTreeMap<String, String>> = BTreeMap::new();
    let mut written: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for f in fetched {
        let Some(value) = &f.value else { continue };
        let data = match f.declared.format {
            Format::Base64 => value.trim().to_string(),
            Format::Plain => base64::engine::general_purpose::STANDARD.encode(value),
        };
        for t in targets(&f.declared) {
            objects
                .entry((t.namespace.clone(), t.name.clone()))
                .or_default()
                .insert(t.key.clone(), data.clone());
            written.entry(f.declared.name.clone()).or_default().push(t.to_string());
        }
    }
    let resource = kube::discovery::ApiResource::erase::<k8s_openapi::api::core::v1::Secret>(&());
    for ((namespace, name), data) in objects {
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &resource);
        let object = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/managed-by": "byoc-runner"},
            },
            "type": "Opaque",
            "data": data,
        });
        api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&object))
            .await
            // The error is the API server's; the masker sees it before anyone else.
            .map_err(|e| ("cluster_error", format!("writing Secret {namespace}/{name}: {e}")))?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declared() -> Declared {
        Declared {
            name: "db_password".into(),
            required: true,
            user_configurable: true,
            format: Format::Plain,
            kubernetes: vec![KubeTarget {
                namespace: "app".into(),
                name: "db".into(),
                key: "password".into(),
            }],
            terraform_variable: Some("db_password".into()),
            helm_value: None,
            read_by: vec!["maintenance".into()],
        }
    }

    #[test]
    fn uses_must_name_a_declared_secret_and_a_declared_target() {
        let d = [declared()];
        let ok = |target| check_uses(&d, &[SecretUse { name: "db_password".into(), target }]);
        assert!(ok(Target::Kubernetes(None)).is_ok());
        assert!(ok(Target::TerraformVariable).is_ok());
        assert!(ok(Target::Kubernetes(Some(d[0].kubernetes[0].clone()))).is_ok());
        let elsewhere =
            KubeTarget { namespace: "vendor".into(), name: "exfil".into(), key: "password".into() };
        let e = ok(Target::Kubernetes(Some(elsewhere))).unwrap_err();
        assert!(e.0.contains("kubernetes:vendor/exfil#password"), "{e}");
        assert!(ok(Target::HelmValue).is_err());
        let unknown = check_uses(&d, &[SecretUse { name: "other".into(), target: Target::HelmValue }]);
        assert!(unknown.unwrap_err().0.contains("not declared"));
    }

    #[test]
    fn the_digest_is_hmac_sha256() {
        // RFC 4231, test case 2.
        assert_eq!(
            digest(b"Jefe", b"what do ya want for nothing?"),
            format!("{DIGEST_PREFIX}5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")
        );
    }

    #[test]
    fn digests_are_keyed() {
        let a = digest(b"install-one-key", b"s3cr3t-value");
        assert_eq!(a, digest(b"install-one-key", b"s3cr3t-value"));
        assert_ne!(a, digest(b"install-two-key", b"s3cr3t-value"));
        assert!(a.starts_with(DIGEST_PREFIX) && a.len() == DIGEST_PREFIX.len() + 64);
        // Not the plain SHA-256 of the value, which anyone could test a guess against.
        use sha2::Digest as _;
        assert!(!a.contains(&hex::encode(sha2::Sha256::digest(b"s3cr3t-value"))));
    }

    #[test]
    fn a_base64_secret_must_decode_and_its_bytes_are_masked_too() {
        let feed = crate::mask::SecretFeed::default();
        let d = Declared { format: Format::Base64, ..declared() };
        let e = check_format(&d, "not base64 !!", &feed).unwrap_err();
        assert_eq!(e.code(), "secret_format_invalid");
        assert!(!e.to_string().contains("not base64 !!"), "{e}");
        check_format(&d, "aHVudGVyMi1wYXNzd29yZA==", &feed).unwrap();
        assert_eq!(feed.secrets(), vec![b"hunter2-password".to_vec()]);
        assert_eq!(check_length(&declared(), "abc").unwrap_err().code(), "secret_format_invalid");
    }
}
