//! The customer's local pause: `byoc-runner pause` writes a small file in the state
//! dir's `control/` directory (durably: temp file, fsync, rename, fsync of the
//! directory); the daemon reads it before every job and refuses new jobs with reason
//! `paused` while it exists. It survives restarts because it is just a file.

use std::path::{Path, PathBuf};

use crate::state_dir::StateDir;
use serde::{Deserialize, Serialize};

pub const PAUSE_FILE: &str = "paused.json";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pause {
    pub paused_at_ms: u64,
    #[serde(default)]
    pub reason: Option<String>,
    /// Who paused (user name or uid).
    pub by: String,
}

#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("pausing and resuming need root{}", group.as_ref().map(|g| format!(" or membership of group {g:?} (roles.admin_group)")).unwrap_or_else(|| " (or set roles.admin_group to allow a group)".into()))]
    NotAllowed { group: Option<String> },
    #[error("reason is longer than 500 characters")]
    ReasonTooLong,
}

pub fn pause_path(state_dir: &Path) -> PathBuf {
    StateDir::of(state_dir).control().join(PAUSE_FILE)
}

/// The pause in force, if any. An unreadable or damaged file counts as paused: the
/// customer meant to stop the runner, and guessing otherwise would run jobs.
/// Who paused is the file's owner as the kernel says (the name in it counts only when
/// root wrote it); the file is read without following a link.
pub fn read(state_dir: &Path) -> Option<Pause> {
    use std::io::Read as _;
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let path = pause_path(state_dir);
    let unreadable = |e: std::io::Error| Pause {
        paused_at_ms: 0,
        reason: Some(format!("pause file unreadable: {e}")),
        by: "unknown".into(),
    };
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits() | nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open(&path)
    {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(unreadable(e)),
        Ok(f) => f,
    };
    let owner = match file.metadata() {
        Ok(m) if m.is_file() => m.uid(),
        Ok(_) => return Some(unreadable(std::io::Error::other("not a regular file"))),
        Err(e) => return Some(unreadable(e)),
    };
    let mut bytes = Vec::new();
    if let Err(e) = file.take(64 << 10).read_to_end(&mut bytes) {
        return Some(unreadable(e));
    }
    Some(match serde_json::from_slice::<Pause>(&bytes) {
        Ok(p) if owner == 0 => p,
        Ok(p) => Pause { by: super::allowance::writer(owner, &p.by), ..p },
        Err(_) => Pause {
            paused_at_ms: 0,
            reason: Some("pause file damaged; treated as paused".into()),
            by: "unknown".into(),
        },
    })
}

fn sync_dir(dir: &Path) -> Result<(), PauseError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| PauseError::Io {
        op: "syncing",
        path: dir.into(),
        source: e,
    })
}

pub fn pause(state_dir: &Path, reason: Option<String>, by: String) -> Result<Pause, PauseError> {
    let p = Pause { paused_at_ms: crate::clock::now_ms(), reason, by };
    write(state_dir, &p)?;
    Ok(p)
}

/// Put `p` in force, durably.
pub fn write(state_dir: &Path, p: &Pause) -> Result<(), PauseError> {
    if p.reason.as_ref().is_some_and(|r| r.chars().count() > 500) {
        return Err(PauseError::ReasonTooLong);
    }
    let dir = StateDir::of(state_dir).control();
    std::fs::create_dir_all(&dir).map_err(|e| PauseError::Io {
        op: "creating",
        path: dir.clone(),
        source: e,
    })?;
    let path = pause_path(state_dir);
    crate::state_dir::write(
        &path,
        &serde_json::to_vec_pretty(p).unwrap_or_default(),
        // Readable by the daemon's user whoever writes it (`control/` keeps others out).
        0o644,
    )
    .map_err(|e| PauseError::Io { op: "writing", path: path.clone(), source: e })
}

/// Returns whether the runner was paused.
pub fn resume(state_dir: &Path) -> Result<bool, PauseError> {
    let path = pause_path(state_dir);
    match std::fs::remove_file(&path) {
        Ok(()) => {
            sync_dir(&StateDir::of(state_dir).control())?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(PauseError::Io { op: "removing", path, source: e }),
    }
}

/// Root, or a member of the configured admin group. Returns who is asking.
pub fn authorize(admin_group: Option<&str>) -> Result<String, PauseError> {
    use nix::unistd::{Group, User, getegid, geteuid, getgroups};
    let uid = geteuid();
    let who = User::from_uid(uid).ok().flatten().map(|u| u.name).unwrap_or_else(|| format!("uid {uid}"));
    if uid.is_root() {
        return Ok(who);
    }
    let allowed = admin_group
        .and_then(|g| Group::from_name(g).ok().flatten())
        .is_some_and(|g| getegid() == g.gid || getgroups().map(|gs| gs.contains(&g.gid)).unwrap_or(false));
    if allowed { Ok(who) } else { Err(PauseError::NotAllowed { group: admin_group.map(str::to_string) }) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_persists_until_resumed_and_damage_counts_as_paused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()), None);
        let p = pause(dir.path(), Some("change freeze".into()), "alice".into()).unwrap();
        assert_eq!(read(dir.path()), Some(p));
        assert!(resume(dir.path()).unwrap());
        assert!(!resume(dir.path()).unwrap());
        assert_eq!(read(dir.path()), None);
        std::fs::write(pause_path(dir.path()), b"{not json").unwrap();
        assert!(read(dir.path()).unwrap().reason.unwrap().contains("damaged"));
        assert!(matches!(
            pause(dir.path(), Some("x".repeat(501)), "a".into()),
            Err(PauseError::ReasonTooLong)
        ));
    }
}
