//! Time-boxed local allowances: a second key, held on the VM, for the roles the
//! customer marks `[roles] require_local_allow` (break-glass roles by default). Such a
//! role is usable only while its stack switch is on *and* a local allowance,
//! granted with `byoc-runner roles allow ROLE --for 2h --reason …`, has not expired.
//!
//! Kept in `control/allowances.json` beside the pause (written the state directory's
//! one way, `byoc_statefs`). A file that cannot be read allows nothing.
//!
//! `control/` is writable by `roles.admin_group`, so the file's content is a claim: the
//! daemon honours only what it has seen and audited (`sync`: `allowance_seen`, naming the
//! writer the kernel reports as the file's owner, never the `by` a non-root writer put
//! in it), each allowance capped at `MAX_ALLOWANCE_MS` from when the daemon first saw
//! it, however long it claims to be.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::model::RoleDef;
use crate::state_dir::StateDir;

pub const ALLOWANCES_FILE: &str = "allowances.json";
/// The longest an allowance holds, however it was written (the CLI refuses longer).
pub const MAX_ALLOWANCE_MS: u64 = 7 * 24 * 3600 * 1000;
/// The daemon's own record of what it honours (state dir, not `control/`).
const HONOURED_FILE: &str = "allowances-honoured.json";
const MAX_FILE_BYTES: u64 = 1 << 20;
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Allowance {
    pub granted_ms: u64,
    pub until_ms: u64,
    /// Who granted it (user name or uid).
    pub by: String,
    pub reason: String,
}

pub fn path(state_dir: &Path) -> PathBuf {
    StateDir::of(state_dir).control().join(ALLOWANCES_FILE)
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
    byoc_statefs::create_dir(&StateDir::of(state_dir).control(), 0o700)?;
    let bytes = serde_json::to_vec_pretty(all).map_err(std::io::Error::other)?;
    // Readable by the daemon's user whoever writes it (`control/` keeps others out).
    crate::state_dir::write(&path(state_dir), &bytes, 0o644)
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

/// One allowance as the file claimed it and as the daemon honours it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Seen {
    claimed: Allowance,
    honoured: Allowance,
}

/// `allowances.json` with what the kernel says of it: who owns it.
struct Written {
    all: BTreeMap<String, Allowance>,
    owner: u32,
}

fn read_written(state_dir: &Path) -> Result<Option<Written>, AllowancesError> {
    use std::io::Read as _;
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let path = path(state_dir);
    let read_err = |source| AllowancesError::Read { path: path.clone(), source };
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits() | nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open(&path)
    {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(read_err(e)),
        Ok(f) => f,
    };
    let meta = file.metadata().map_err(read_err)?;
    if !meta.is_file() {
        return Err(read_err(std::io::Error::other("not a regular file")));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES).read_to_end(&mut bytes).map_err(read_err)?;
    let all = serde_json::from_slice(&bytes)
        .map_err(|source| AllowancesError::Damaged { path: path.clone(), source })?;
    Ok(Some(Written { all, owner: meta.uid() }))
}

/// Who wrote a file owned by `uid`: root's CLI names the person (`SUDO_USER`) in the
/// file; anyone else is who the kernel says.
pub fn writer(uid: u32, claimed: &str) -> String {
    if uid == 0 {
        return claimed.to_string();
    }
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(u)) => format!("{} (uid {uid})", u.name),
        _ => format!("uid {uid}"),
    }
}

/// Audits one allowance about to be honoured: its role, the allowance as honoured, a
/// note when it was capped.
pub type AuditSeen<'a> = dyn FnMut(&str, &Allowance, Option<String>) -> Result<(), String> + 'a;

/// Bring what the daemon honours up to date with `allowances.json`: each allowance that
/// is new or changed there is audited through `audit` (`role`, the allowance as
/// honoured, a note when it was capped) before it is honoured, with its writer from the
/// kernel and its end at most `MAX_ALLOWANCE_MS` after `now_ms`, when it is first seen;
/// one the audit did not take is not honoured; one gone from the file is no longer
/// honoured. Returns what is honoured now. An unreadable file honours nothing.
pub fn sync(
    state_dir: &Path,
    now_ms: u64,
    audit: &mut AuditSeen<'_>,
) -> Result<BTreeMap<String, Allowance>, AllowancesError> {
    let record = state_dir.join(HONOURED_FILE);
    let seen: BTreeMap<String, Seen> =
        std::fs::read(&record).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    // Nothing is honoured while the file cannot be read; nothing is forgotten either.
    let written = read_written(state_dir)?;
    let mut now_seen = BTreeMap::new();
    if let Some(w) = written {
        for (role, claimed) in w.all {
            if let Some(s) = seen.get(&role).filter(|s| s.claimed == claimed) {
                now_seen.insert(role, s.clone());
                continue;
            }
            let cap = now_ms.saturating_add(MAX_ALLOWANCE_MS);
            let honoured = Allowance {
                granted_ms: claimed.granted_ms.min(now_ms),
                until_ms: claimed.until_ms.min(cap),
                by: writer(w.owner, &claimed.by),
                reason: claimed.reason.clone(),
            };
            let note = (claimed.until_ms > cap).then(|| {
                format!(
                    "claimed until {}, capped at {} days after it was first seen",
                    crate::clock::rfc3339((claimed.until_ms / 1000) as i64),
                    MAX_ALLOWANCE_MS / 86_400_000
                )
            });
            match audit(&role, &honoured, note) {
                Ok(()) => {
                    now_seen.insert(role, Seen { claimed, honoured });
                }
                Err(e) => {
                    tracing::error!(role = %role, error = %e, "An allowance could not be audited, so it is not honoured: {e}.")
                }
            }
        }
    }
    if now_seen != seen {
        let bytes = serde_json::to_vec(&now_seen)
            .map_err(|e| AllowancesError::Read { path: record.clone(), source: std::io::Error::other(e) })?;
        crate::state_dir::write(&record, &bytes, 0o600)
            .map_err(|source| AllowancesError::Read { path: record.clone(), source })?;
    }
    Ok(now_seen.into_iter().map(|(role, s)| (role, s.honoured)).collect())
}

/// The daemon's own record of which expiries it audited (`role` → `until_ms`). The
/// CLI writes `allowances.json`; the daemon never rewrites it (a write racing a grant
/// could lose the grant), so it keeps what it has audited here.
const EXPIRED_AUDITED_FILE: &str = "allowances-expired-audited.json";

/// Of the allowances honoured (`sync`), those that ran out by `now_ms` and were not yet
/// audited as expired.
pub fn newly_expired(
    state_dir: &Path,
    honoured: &BTreeMap<String, Allowance>,
    now_ms: u64,
) -> Vec<(String, Allowance)> {
    let all = honoured.clone();
    let audited: BTreeMap<String, u64> =
        std::fs::read(StateDir::of(state_dir).control().join(EXPIRED_AUDITED_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
    all.into_iter()
        .filter(|(role, a)| a.until_ms <= now_ms && audited.get(role) != Some(&a.until_ms))
        .collect()
}

/// Note these expiries as audited (durably), forgetting roles no longer on record.
pub fn mark_expired_audited(
    state_dir: &Path,
    honoured: &BTreeMap<String, Allowance>,
    done: &[(String, Allowance)],
) -> std::io::Result<()> {
    let dir = StateDir::of(state_dir).control();
    let file = dir.join(EXPIRED_AUDITED_FILE);
    let mut audited: BTreeMap<String, u64> =
        std::fs::read(&file).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    audited.retain(|role, _| honoured.contains_key(role));
    audited.extend(done.iter().map(|(role, a)| (role.clone(), a.until_ms)));
    crate::state_dir::write(&file, &serde_json::to_vec(&audited).map_err(std::io::Error::other)?, 0o600)
}

/// Whether `role` needs a local allowance: `require` names roles by name or by type
/// (`break_glass`, `maintenance`, …).
pub fn required(require: &[String], role: &RoleDef) -> bool {
    require.iter().any(|r| *r == role.name || r == role.role_type.as_str())
}

/// Why `role` may not be used now, or `None` if its honoured allowance (`sync`) holds at
/// `now_ms`.
pub fn refusal(
    honoured: &Result<BTreeMap<String, Allowance>, AllowancesError>,
    role: &str,
    now_ms: u64,
) -> Option<String> {
    let how = format!("`byoc-runner roles allow {role} --for 1h --reason …` on the runner");
    match honoured {
        Err(e) => Some(format!("its local allowances cannot be read ({e}), so none holds; {how}")),
        Ok(all) => match all.get(role) {
            None => Some(format!("it needs a local allowance (roles.require_local_allow): {how}")),
            Some(a) if a.until_ms <= now_ms => Some(format!(
                "its local allowance (granted by {}) expired at {}; {how}",
                a.by,
                crate::clock::rfc3339((a.until_ms / 1000) as i64)
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

    /// Every allowance seen is audited once; the audit log's entries.
    fn synced(
        dir: &Path,
        seen: &mut Vec<(String, Allowance, Option<String>)>,
    ) -> Result<BTreeMap<String, Allowance>, AllowancesError> {
        sync(dir, now_ms(), &mut |role, a, note| {
            seen.push((role.to_string(), a.clone(), note));
            Ok(())
        })
    }

    fn now_ms() -> u64 {
        crate::clock::now_ms()
    }

    #[test]
    fn an_allowance_holds_until_it_expires_or_is_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let role = "inst-demo-s3-object-break-glass";
        let mut seen = Vec::new();
        assert!(refusal(&synced(dir.path(), &mut seen), role, 10).unwrap().contains("roles allow"));
        grant(dir.path(), role, allowance(1_000)).unwrap();
        let honoured = synced(dir.path(), &mut seen);
        assert_eq!(refusal(&honoured, role, 999), None);
        assert!(refusal(&honoured, role, 1_000).unwrap().contains("expired"));
        assert_eq!(revoke(dir.path(), role).unwrap(), Some(allowance(1_000)));
        assert!(refusal(&synced(dir.path(), &mut seen), role, 10).is_some());
        assert_eq!(revoke(dir.path(), role).unwrap(), None);
        assert_eq!(seen.len(), 1, "audited once: {seen:?}");
    }

    #[test]
    fn each_expiry_is_reported_once_and_a_new_grant_expires_anew() {
        let dir = tempfile::tempdir().unwrap();
        let mut seen = Vec::new();
        grant(dir.path(), "a", allowance(1_000)).unwrap();
        grant(dir.path(), "b", allowance(5_000)).unwrap();
        let honoured = synced(dir.path(), &mut seen).unwrap();
        assert!(newly_expired(dir.path(), &honoured, 999).is_empty());
        let first = newly_expired(dir.path(), &honoured, 1_000);
        let ends: Vec<(&str, u64)> = first.iter().map(|(r, a)| (r.as_str(), a.until_ms)).collect();
        assert_eq!(ends, [("a", 1_000)]);
        mark_expired_audited(dir.path(), &honoured, &first).unwrap();
        assert!(newly_expired(dir.path(), &honoured, 2_000).is_empty(), "reported once");
        // Granted again and run out again: a new expiry.
        grant(dir.path(), "a", allowance(3_000)).unwrap();
        let honoured = synced(dir.path(), &mut seen).unwrap();
        let both: Vec<String> =
            newly_expired(dir.path(), &honoured, 6_000).into_iter().map(|(r, _)| r).collect();
        assert_eq!(both, ["a", "b"]);
    }

    #[test]
    fn a_damaged_file_allows_nothing() {
        let dir = tempfile::tempdir().unwrap();
        grant(dir.path(), "r", allowance(u64::MAX)).unwrap();
        std::fs::write(path(dir.path()), b"{not json").unwrap();
        assert!(refusal(&synced(dir.path(), &mut Vec::new()), "r", 10).unwrap().contains("cannot be read"));
    }

    /// A group member writes `allowances.json` by hand, naming someone else and a month:
    /// the daemon audits it once, names the file's owner, and caps it at seven days from
    /// when it was written.
    #[test]
    fn an_allowance_written_by_hand_is_audited_capped_and_named_by_its_owner() {
        let dir = tempfile::tempdir().unwrap();
        let now = now_ms();
        let month = Allowance {
            granted_ms: now,
            until_ms: now + 30 * 86_400_000,
            by: "the-ceo".into(),
            reason: "trust me".into(),
        };
        grant(dir.path(), "break-glass", month.clone()).unwrap();
        let owner = if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(path(dir.path()), Some(65534), None).unwrap();
            65534
        } else {
            nix::unistd::geteuid().as_raw()
        };
        let mut seen = Vec::new();
        let honoured = synced(dir.path(), &mut seen).unwrap();
        let a = &honoured["break-glass"];
        assert!(
            a.until_ms <= now_ms() + MAX_ALLOWANCE_MS && a.until_ms >= now + MAX_ALLOWANCE_MS - 60_000,
            "{a:?}"
        );
        assert!(a.by.contains(&format!("uid {owner}")) && !a.by.contains("the-ceo"), "{a:?}");
        assert_eq!(seen.len(), 1);
        assert!(seen[0].2.as_deref().unwrap_or("").contains("capped at 7 days"), "{seen:?}");
        // Seen once: not audited again while it is unchanged.
        synced(dir.path(), &mut seen).unwrap();
        assert_eq!(seen.len(), 1);
    }

    /// Links planted in `control/` where its writers once put their temporary files, and
    /// at the files themselves: every writer (allowances, pause, the inbox, approvals)
    /// writes its own file and never through a link; the links' targets are unchanged.
    #[test]
    fn control_writes_never_go_through_a_planted_link() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("ld.so.preload");
        std::fs::write(&victim, b"untouched").unwrap();
        let control = StateDir::of(dir.path()).control();
        let approvals = crate::approvals::dir(dir.path());
        std::fs::create_dir_all(&approvals).unwrap();
        std::fs::create_dir_all(crate::roles::inbox::inbox_dir(dir.path())).unwrap();
        for name in [
            ".allowances.json.tmp",
            "allowances.json",
            ".paused.json.tmp",
            "paused.json",
            "approvals/.job-1.request.json.tmp",
            "approvals/job-1.request.json",
        ] {
            std::os::unix::fs::symlink(&victim, control.join(name)).unwrap();
        }
        grant(dir.path(), "r", allowance(5)).unwrap();
        super::super::pause::pause(dir.path(), Some("incident".into()), "root".into()).unwrap();
        crate::roles::inbox::submit(
            dir.path(),
            &byoc_audit::log::Record { event: "x".into(), ..Default::default() },
        )
        .unwrap();
        let request = crate::approvals::Request {
            job_id: "job-1".into(),
            kind: "action.script".into(),
            operation: "action.trigger".into(),
            role: None,
            component: None,
            rule: "all".into(),
            requested_at_ms: 1,
            expires_at_ms: u64::MAX,
            plan_digest: None,
            judged_digest: None,
            summary: None,
            findings: vec![],
            passed: vec![],
            update_version: None,
        };
        crate::approvals::write_request(dir.path(), &request).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"untouched");
        for name in ["allowances.json", "paused.json", "approvals/job-1.request.json"] {
            assert!(std::fs::symlink_metadata(control.join(name)).unwrap().is_file(), "{name}");
        }
    }

    /// An allowance the audit log did not take is not honoured.
    #[test]
    fn an_allowance_that_could_not_be_audited_is_not_honoured() {
        let dir = tempfile::tempdir().unwrap();
        grant(dir.path(), "r", allowance(u64::MAX / 2)).unwrap();
        let honoured = sync(dir.path(), now_ms(), &mut |_, _, _| Err("disk full".into())).unwrap();
        assert!(honoured.is_empty());
        assert!(refusal(&Ok(honoured), "r", 10).is_some());
    }
}
