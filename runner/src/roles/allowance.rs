//! Time-boxed local allowances: a second key, held on the VM, for the roles the
//! customer marks `[roles] require_local_allow` (break-glass roles by default). Such a
//! role is usable only while its stack switch is on *and* a local allowance,
//! granted with `byoc-runner roles allow ROLE --for 2h --reason …`, has not expired.
//!
//! Kept in `control/allowances.json` beside the pause (written durably: temp file,
//! fsync, rename, fsync of the directory). A file that cannot be read allows nothing.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::model::RoleDef;
use super::pause::CONTROL_DIR;

pub const ALLOWANCES_FILE: &str = "allowances.json";
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Allowance {
    pub granted_ms: u64,
    pub until_ms: u64,
    /// Who granted it (user name or uid).
    pub by: String,
    pub reason: String,
}

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(CONTROL_DIR).join(ALLOWANCES_FILE)
}

/// Every allowance on record, by role name (expired ones included until replaced).
pub fn read(state_dir: &Path) -> Result<BTreeMap<String, Allowance>, AllowancesError> {
    let path = path(state_dir);
    match std::fs::read(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(source) => Err(AllowancesError::Read { path, source }),
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map_err(|source| AllowancesError::Damaged { path, source })
        }
    }
}

/// The allowances file cannot be used: nothing it holds is allowed.
#[derive(Debug, thiserror::Error)]
pub enum AllowancesError {
    #[error("reading {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{} is damaged: {source}", path.display())]
    Damaged { path: PathBuf, source: serde_json::Error },
}

fn write(state_dir: &Path, all: &BTreeMap<String, Allowance>) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    let dir = state_dir.join(CONTROL_DIR);
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
    let tmp = dir.join(format!(".{ALLOWANCES_FILE}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec_pretty(all).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path(state_dir))?;
    std::fs::File::open(&dir)?.sync_all()
}

/// Grant (or replace) `role`'s allowance. A damaged file is replaced: the customer is
/// granting, and what it held allowed nothing.
pub fn grant(state_dir: &Path, role: &str, allowance: Allowance) -> std::io::Result<()> {
    let mut all = read(state_dir).unwrap_or_default();
    all.insert(role.to_string(), allowance);
    write(state_dir, &all)
}

/// Returns the allowance removed, if there was one.
pub fn revoke(state_dir: &Path, role: &str) -> std::io::Result<Option<Allowance>> {
    let mut all = read(state_dir).unwrap_or_default();
    let removed = all.remove(role);
    write(state_dir, &all)?;
    Ok(removed)
}

/// The daemon's own record of which expiries it audited (`role` → `until_ms`). The
/// CLI writes `allowances.json`; the daemon never rewrites it (a write racing a grant
/// could lose the grant), so it keeps what it has audited here.
const EXPIRED_AUDITED_FILE: &str = "allowances-expired-audited.json";

/// Allowances that ran out by `now_ms` and were not yet audited as expired.
pub fn newly_expired(state_dir: &Path, now_ms: u64) -> Vec<(String, Allowance)> {
    let Ok(all) = read(state_dir) else { return Vec::new() };
    let audited: BTreeMap<String, u64> =
        std::fs::read(state_dir.join(CONTROL_DIR).join(EXPIRED_AUDITED_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
    all.into_iter()
        .filter(|(role, a)| a.until_ms <= now_ms && audited.get(role) != Some(&a.until_ms))
        .collect()
}

/// Note these expiries as audited (durably), forgetting roles no longer on record.
pub fn mark_expired_audited(state_dir: &Path, done: &[(String, Allowance)]) -> std::io::Result<()> {
    let dir = state_dir.join(CONTROL_DIR);
    let file = dir.join(EXPIRED_AUDITED_FILE);
    let mut audited: BTreeMap<String, u64> =
        std::fs::read(&file).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    let current = read(state_dir).unwrap_or_default();
    audited.retain(|role, _| current.contains_key(role));
    audited.extend(done.iter().map(|(role, a)| (role.clone(), a.until_ms)));
    let tmp = dir.join(format!(".{EXPIRED_AUDITED_FILE}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec(&audited).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &file)?;
    std::fs::File::open(&dir)?.sync_all()
}

/// Whether `role` needs a local allowance: `require` names roles by name or by type
/// (`break_glass`, `maintenance`, …).
pub fn required(require: &[String], role: &RoleDef) -> bool {
    require.iter().any(|r| *r == role.name || r == role.role_type.as_str())
}

/// Why `role` may not be used now, or `None` if its allowance holds at `now_ms`.
pub fn refusal(state_dir: &Path, role: &str, now_ms: u64) -> Option<String> {
    let how = format!("`byoc-runner roles allow {role} --for 1h --reason …` on the runner");
    match read(state_dir) {
        Err(e) => Some(format!("its local allowances cannot be read ({e}), so none holds; {how}")),
        Ok(all) => match all.get(role) {
            None => Some(format!("it needs a local allowance (roles.require_local_allow): {how}")),
            Some(a) if a.until_ms <= now_ms => Some(format!(
                "its local allowance (granted by {}) expired at {}; {how}",
                a.by,
                crate::roles::creds::rfc3339((a.until_ms / 1000) as i64)
            )),
            Some(_) => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowance(until_ms: u64) -> Allowance {
        Allowance { granted_ms: 1, until_ms, by: "alice".into(), reason: "incident 42".into() }
    }

    #[test]
    fn an_allowance_holds_until_it_expires_or_is_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let role = "inst-demo-s3-object-break-glass";
        assert!(refusal(dir.path(), role, 10).unwrap().contains("roles allow"));
        grant(dir.path(), role, allowance(1_000)).unwrap();
        assert_eq!(refusal(dir.path(), role, 999), None);
        assert!(refusal(dir.path(), role, 1_000).unwrap().contains("expired"));
        assert_eq!(revoke(dir.path(), role).unwrap(), Some(allowance(1_000)));
        assert!(refusal(dir.path(), role, 10).is_some());
        assert_eq!(revoke(dir.path(), role).unwrap(), None);
    }

    #[test]
    fn each_expiry_is_reported_once_and_a_new_grant_expires_anew() {
        let dir = tempfile::tempdir().unwrap();
        grant(dir.path(), "a", allowance(1_000)).unwrap();
        grant(dir.path(), "b", allowance(5_000)).unwrap();
        assert!(newly_expired(dir.path(), 999).is_empty());
        let first = newly_expired(dir.path(), 1_000);
        assert_eq!(first, vec![("a".to_string(), allowance(1_000))]);
        mark_expired_audited(dir.path(), &first).unwrap();
        assert!(newly_expired(dir.path(), 2_000).is_empty(), "reported once");
        // Granted again and run out again: a new expiry.
        grant(dir.path(), "a", allowance(3_000)).unwrap();
        let both: Vec<String> = newly_expired(dir.path(), 6_000).into_iter().map(|(r, _)| r).collect();
        assert_eq!(both, ["a", "b"]);
    }

    #[test]
    fn a_damaged_file_allows_nothing() {
        let dir = tempfile::tempdir().unwrap();
        grant(dir.path(), "r", allowance(u64::MAX)).unwrap();
        std::fs::write(path(dir.path()), b"{not json").unwrap();
        assert!(refusal(dir.path(), "r", 10).unwrap().contains("cannot be read"));
    }
}
