//! `control/`: where the customer's side (root, and members of `roles.admin_group`) and
//! the daemon meet: the pause file, allowances, approvals (`approvals/`) and the CLI's
//! records for the audit log (`audit-inbox/`).
//!
//! The daemon's user owns the directories, so it can read and remove what others leave.
//! Without an admin group they are 0700 (root reaches them anyway). With one they belong
//! to that group: `control/` 2770 (the set-group-ID bit keeps what is made in it the
//! group's, so members read the daemon's approval requests; a member may lift root's
//! pause), `audit-inbox/` and `approvals/` 3770 (also sticky: a member may add records
//! and answers but never rename or remove another's, so nobody can hold back, or replay
//! later, what someone else put on record). The state directory is 0711, so members
//! reach them and nothing else. The install sets the group as root; a daemon that is
//! not root cannot, and says what to fix.

use crate::state_dir::StateDir;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// The directories the admin group writes to.
pub fn dirs(state_dir: &Path) -> [PathBuf; 3] {
    [StateDir::of(state_dir).control(), super::inbox::inbox_dir(state_dir), crate::approvals::dir(state_dir)]
}

/// A shared directory's mode: sticky where records and answers are left (see above).
pub fn shared_mode(state_dir: &Path, dir: &Path) -> u32 {
    if dir == StateDir::of(state_dir).control() { 0o2770 } else { 0o3770 }
}

/// Make the directories (0700) and, with an admin group, give them to it. Returns what
/// could not be set, each with the command that sets it.
pub fn prepare(state_dir: &Path, admin_group: Option<&str>) -> std::io::Result<Vec<String>> {
    for d in dirs(state_dir) {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&d)?;
    }
    let Some(name) = admin_group else { return Ok(Vec::new()) };
    let Some(group) = nix::unistd::Group::from_name(name).ok().flatten() else {
        return Ok(vec![format!("group {name:?} (roles.admin_group) does not exist: groupadd {name}")]);
    };
    let mut problems = Vec::new();
    // Members pass through the state directory to control/ only.
    let top = std::fs::metadata(state_dir)?.mode() & 0o7777;
    if top & 0o011 != 0o011 {
        let wanted = top | 0o011;
        if let Err(e) = std::fs::set_permissions(state_dir, std::fs::Permissions::from_mode(wanted)) {
            problems.push(format!("{}: {e}: chmod {wanted:o} {}", state_dir.display(), state_dir.display()));
        }
    }
    for d in dirs(state_dir) {
        let mode = shared_mode(state_dir, &d);
        if shared_with(&d, group.gid.as_raw(), mode) {
            continue;
        }
        let set = std::os::unix::fs::chown(&d, None, Some(group.gid.as_raw()))
            .and_then(|()| std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode)));
        if let Err(e) = set {
            problems.push(format!("{0}: {e}: chgrp {name} {0} && chmod {mode:o} {0}", d.display()));
        }
    }
    Ok(problems)
}

/// What keeps members of `name` from using `control/`, each with its fix.
pub fn problems(state_dir: &Path, name: &str) -> Vec<String> {
    let Some(group) = nix::unistd::Group::from_name(name).ok().flatten() else {
        return vec![format!("group {name:?} (roles.admin_group) does not exist: groupadd {name}")];
    };
    let mut out = Vec::new();
    match std::fs::metadata(state_dir) {
        Ok(m) if m.mode() & 0o011 == 0o011 => {}
        Ok(_) => out.push(format!(
            "{} cannot be passed through by the group (the runner sets 0711 when it starts)",
            state_dir.display()
        )),
        Err(e) => out.push(format!("{}: {e}", state_dir.display())),
    }
    for d in dirs(state_dir) {
        let mode = shared_mode(state_dir, &d);
        if !shared_with(&d, group.gid.as_raw(), mode) {
            out.push(format!(
                "{0} is not the group's ({mode:o}): chgrp {name} {0} && chmod {mode:o} {0}",
                d.display()
            ));
        }
    }
    out
}

fn shared_with(dir: &Path, gid: u32, mode: u32) -> bool {
    std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir() && m.gid() == gid && m.mode() & mode == mode)
}

/// The admin group as the kernel shows it: the group `control/` is shared with. For a
/// member who cannot read `runner.toml` (it is the runner's).
pub fn shared_group(state_dir: &Path) -> Option<String> {
    let m = std::fs::symlink_metadata(StateDir::of(state_dir).control()).ok()?;
    if !m.is_dir() || m.mode() & 0o2070 != 0o2070 {
        return None;
    }
    let group = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(m.gid())).ok().flatten()?;
    Some(group.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_group_the_directories_are_private_and_nothing_is_shared() {
        let dir = tempfile::tempdir().unwrap();
        assert!(prepare(dir.path(), None).unwrap().is_empty());
        for d in dirs(dir.path()) {
            assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o7777, 0o700, "{}", d.display());
        }
        assert_eq!(shared_group(dir.path()), None);
        assert!(problems(dir.path(), "no-such-group-byoc")[0].contains("groupadd no-such-group-byoc"));
    }

    #[test]
    fn with_a_group_the_directories_become_its_and_the_state_dir_passable() {
        // This process's own primary group: a group it may give its directories to.
        let gid = nix::unistd::getegid();
        let name = nix::unistd::Group::from_gid(gid).unwrap().unwrap().name;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(!problems(dir.path(), &name).is_empty());
        assert_eq!(prepare(dir.path(), Some(&name)).unwrap(), Vec::<String>::new());
        assert!(problems(dir.path(), &name).is_empty(), "{:?}", problems(dir.path(), &name));
        assert_eq!(std::fs::metadata(dir.path()).unwrap().mode() & 0o777, 0o711);
        for d in dirs(dir.path()) {
            let m = std::fs::metadata(&d).unwrap();
            let want = if d.ends_with("control") { 0o2770 } else { 0o3770 };
            assert_eq!((m.mode() & 0o7777, m.gid()), (want, gid.as_raw()), "{}", d.display());
        }
        assert_eq!(shared_group(dir.path()), Some(name));
    }
}
