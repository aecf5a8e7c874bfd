//! The customer's secrets on the runner's side (docs/SECRETS.md): the app config's
//! declarations (`declare`), the check of a job's uses before it is claimed, the
//! settings an executor reads them with, the per-install digest key, and the ledger of
//! where each secret was last written that `byoc-runner secrets` shows. No value is
//! ever kept here: names, version ids and keyed digests only.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use byoc_job_executors::Executor;
use byoc_job_executors::secrets::{Declared, SecretSettings, check_uses, store::Store};
use byoc_protocol::JobPayload;
use serde::{Deserialize, Serialize};

use crate::roles::template::InstallState;
use crate::state_dir::StateDir;

pub mod declare;

const DIGEST_KEY_FILE: &str = "digest.key";
const LEDGER_FILE: &str = "ledger.json";

/// Read-modify-write of the ledger and first creation of the key, one at a time.
static LOCK: Mutex<()> = Mutex::new(());

/// Why a job's use of secrets is refused before it is claimed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UseRefused {
    /// The app config's secrets cannot be read: `invalid_spec`.
    #[error("app config secrets: {}", .0.join("; "))]
    Declarations(Vec<String>),
    /// `secret_target_not_declared`.
    #[error("{0}")]
    NotDeclared(String),
}

/// The job's uses against the app config it carries: every secret it names declared,
/// with the target it would write. Returns the declarations (empty without uses).
pub fn check_job(
    payload: &JobPayload,
    executor: &dyn Executor,
    install: &InstallState,
) -> Result<Vec<Declared>, UseRefused> {
    let uses = executor.secret_uses();
    let declared = match &payload.app_config {
        Some(app) if app.secrets.is_some() || !app.secret_files.is_empty() => {
            declare::declared(app, install).map_err(UseRefused::Declarations)?
        }
        _ => Vec::new(),
    };
    check_uses(&declared, &uses).map_err(|e| UseRefused::NotDeclared(e.0))?;
    Ok(declared)
}

/// The install's secrets in Secrets Manager: `<install id>/secrets/<name>`.
pub fn store_prefix(install_id: &str) -> String {
    format!("{install_id}/secrets/")
}

/// What a job reads secrets with.
pub fn settings(
    state_dir: &Path,
    install_id: &str,
    endpoint: Option<&str>,
    declared: Vec<Declared>,
    role: Option<(String, String)>,
) -> std::io::Result<SecretSettings> {
    Ok(SecretSettings {
        declared,
        store: Store { endpoint: endpoint.map(str::to_string), prefix: store_prefix(install_id) },
        digest_key: Arc::new(digest_key(state_dir)?),
        role,
    })
}

/// The install's digest key: 32 random bytes made on first use, 0600, never sent.
pub fn digest_key(state_dir: &Path) -> std::io::Result<Vec<u8>> {
    let _held = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let path = StateDir::of(state_dir).secrets().join(DIGEST_KEY_FILE);
    match std::fs::read(&path) {
        Ok(k) if k.len() == 32 => return Ok(k),
        Ok(_) => {
            return Err(std::io::Error::other(format!(
                "{} is not 32 bytes: restore it from a backup (digests made with it cannot be compared otherwise)",
                path.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    make_dir(state_dir)?;
    let key = hex::decode(byoc_protocol::random_hex(32)).map_err(std::io::Error::other)?;
    crate::state_dir::write(&path, &key, 0o600)?;
    Ok(key)
}

fn make_dir(state_dir: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt as _;
    let dir = StateDir::of(state_dir).secrets();
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
    Ok(dir)
}

/// Where a secret was last written, by which job, at which version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LedgerEntry {
    pub name: String,
    pub version_id: Option<String>,
    pub digest: Option<String>,
    pub written_to: Vec<String>,
    pub job_id: String,
    pub at_ms: u64,
}

/// Keep what a succeeded job's result says of the secrets it wrote (its `secrets`
/// output: names, versions, digests, targets). Entries it did not write stay.
pub fn record(
    state_dir: &Path,
    job_id: &str,
    at_ms: u64,
    outputs: &serde_json::Value,
) -> std::io::Result<usize> {
    let Some(reported) = outputs["secrets"].as_array() else { return Ok(0) };
    let _held = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut ledger: BTreeMap<String, LedgerEntry> =
        ledger(state_dir).into_iter().map(|e| (e.name.clone(), e)).collect();
    let mut n = 0;
    for r in reported {
        let Some(name) = r["name"].as_str().filter(|n| byoc_job_executors::secrets::valid_name(n)) else {
            continue;
        };
        let written_to: Vec<String> = r["written_to"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect();
        ledger.insert(
            name.to_string(),
            LedgerEntry {
                name: name.to_string(),
                version_id: r["version_id"].as_str().map(str::to_string),
                digest: r["digest"].as_str().map(str::to_string),
                written_to,
                job_id: job_id.to_string(),
                at_ms,
            },
        );
        n += 1;
    }
    let dir = make_dir(state_dir)?;
    let entries: Vec<&LedgerEntry> = ledger.values().collect();
    let bytes = serde_json::to_vec_pretty(&entries).map_err(std::io::Error::other)?;
    crate::state_dir::write(&dir.join(LEDGER_FILE), &bytes, 0o600)?;
    Ok(n)
}

/// Every secret a job has written on this runner, by name.
pub fn ledger(state_dir: &Path) -> Vec<LedgerEntry> {
    std::fs::read(StateDir::of(state_dir).secrets().join(LEDGER_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_key_is_made_once_0600() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let k = digest_key(dir.path()).unwrap();
        assert_eq!(k, digest_key(dir.path()).unwrap());
        let mode = std::fs::metadata(dir.path().join("secrets/digest.key")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(dir.path().join("secrets/digest.key"), b"short").unwrap();
        assert!(digest_key(dir.path()).is_err());
    }

    #[test]
    fn the_ledger_keeps_the_latest_write_of_each_secret() {
        let dir = tempfile::tempdir().unwrap();
        let out = |v: &str| {
            serde_json::json!({"secrets": [
                {"name": "db", "version_id": v, "digest": "hmac-sha256:aa", "written_to": ["terraform:var.db"]},
                {"name": "../evil", "version_id": v},
            ]})
        };
        assert_eq!(record(dir.path(), "job-1", 1, &out("v1")).unwrap(), 1);
        assert_eq!(record(dir.path(), "job-2", 2, &out("v2")).unwrap(), 1);
        let l = ledger(dir.path());
        assert_eq!(l.len(), 1);
        assert_eq!((l[0].version_id.as_deref(), l[0].job_id.as_str()), (Some("v2"), "job-2"));
        assert_eq!(record(dir.path(), "job-3", 3, &serde_json::json!({})).unwrap(), 0);
    }
}
