//! Root's writes into a directory the runner's user owns, for user-data (which runs as
//! root, and is run again by customers): a directory or a file put in place by
//! descriptor, never through a link the runner's user planted. Owner and mode are set on
//! the descriptor of what was made, so no name can be swapped under them.
//!
//! `byoc-runner-updater put-dir PATH --mode 2770 --owner UID:GID`
//! `byoc-runner-updater put-file PATH --mode 0600 --owner UID:GID < content`

use std::io::Write as _;
use std::os::fd::{AsFd as _, OwnedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{OFlag, openat, renameat};
use nix::sys::stat::{Mode, fchmod, mkdirat};
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, unlinkat};

/// Largest file `put-file` writes.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

fn split(path: &Path) -> std::io::Result<(&Path, &str)> {
    match (path.parent(), path.file_name().and_then(|n| n.to_str())) {
        (Some(parent), Some(name)) if path.is_absolute() => Ok((parent, name)),
        _ => Err(std::io::Error::other(format!("{}: not an absolute file path", path.display()))),
    }
}

fn owner(fd: &OwnedFd, uid: u32, gid: u32, mode: u32) -> std::io::Result<()> {
    // Owner first: a change of owner may clear the set-group-ID bit the mode sets.
    fchown(fd.as_fd(), Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))?;
    fchmod(fd.as_fd(), Mode::from_bits_truncate(mode))?;
    Ok(())
}

/// Make `path` a directory of `uid:gid` with `mode`. Created if missing; whatever else is
/// at its name (a link, a file) is removed first, never followed. Its parent is opened
/// without following a link at any component.
pub fn put_dir(path: &Path, mode: u32, uid: u32, gid: u32) -> std::io::Result<()> {
    let (parent, name) = split(path)?;
    let dir = crate::hostile::open_dir(parent)?;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = match openat(dir.as_fd(), name, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => {
            mkdirat(dir.as_fd(), name, Mode::from_bits_truncate(0o700))?;
            openat(dir.as_fd(), name, flags, Mode::empty())?
        }
        Err(Errno::ELOOP | Errno::ENOTDIR) => {
            unlinkat(dir.as_fd(), name, UnlinkatFlags::NoRemoveDir)?;
            mkdirat(dir.as_fd(), name, Mode::from_bits_truncate(0o700))?;
            openat(dir.as_fd(), name, flags, Mode::empty())?
        }
        Err(e) => return Err(e.into()),
    };
    owner(&fd, uid, gid, mode)?;
    nix::unistd::fsync(dir.as_fd())?;
    Ok(())
}

/// Put `bytes` at `path` as a new file of `uid:gid` with `mode`: an exclusively created
/// temporary file beside it (never through a link), owner and mode set on it, fsynced,
/// renamed over the name (a link there is replaced, not followed).
pub fn put_file(path: &Path, bytes: &[u8], mode: u32, uid: u32, gid: u32) -> std::io::Result<()> {
    let (parent, name) = split(path)?;
    let dir = crate::hostile::open_dir(parent)?;
    let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut random = [0u8; 8];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random))?;
    let tmp = format!(".{name}.{}.tmp", hex::encode(random));
    let fd = openat(dir.as_fd(), tmp.as_str(), flags, Mode::from_bits_truncate(0o600))?;
    let written = (|| {
        owner(&fd, uid, gid, mode)?;
        let mut file = std::fs::File::from(fd);
        file.write_all(bytes)?;
        file.sync_all()?;
        renameat(dir.as_fd(), tmp.as_str(), dir.as_fd(), name)?;
        nix::unistd::fsync(dir.as_fd()).map_err(std::io::Error::from)
    })();
    if written.is_err() {
        let _ = unlinkat(dir.as_fd(), tmp.as_str(), UnlinkatFlags::NoRemoveDir);
    }
    written
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt as _;

    use super::*;

    fn me() -> (u32, u32) {
        (nix::unistd::getuid().as_raw(), nix::unistd::getgid().as_raw())
    }

    #[test]
    fn a_link_at_the_name_is_replaced_and_its_target_untouched() {
        let d = tempfile::tempdir().unwrap();
        let (uid, gid) = me();
        let target_dir = d.path().join("elsewhere");
        std::fs::create_dir(&target_dir).unwrap();
        std::fs::set_permissions(&target_dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let target_file = d.path().join("secret");
        std::fs::write(&target_file, b"root's").unwrap();
        std::os::unix::fs::symlink(&target_dir, d.path().join("control")).unwrap();
        std::os::unix::fs::symlink(&target_file, d.path().join("token")).unwrap();

        put_dir(&d.path().join("control"), 0o2770, uid, gid).unwrap();
        put_file(&d.path().join("token"), b"bootstrap", 0o600, uid, gid).unwrap();

        let control = std::fs::symlink_metadata(d.path().join("control")).unwrap();
        assert!(control.is_dir(), "a real directory now");
        assert_eq!(control.mode() & 0o7777, 0o2770);
        assert_eq!(
            std::fs::metadata(&target_dir).unwrap().mode() & 0o7777,
            0o755,
            "the link's target kept its mode"
        );
        let token = std::fs::symlink_metadata(d.path().join("token")).unwrap();
        assert!(token.is_file());
        assert_eq!(token.mode() & 0o7777, 0o600);
        assert_eq!(std::fs::read(d.path().join("token")).unwrap(), b"bootstrap");
        assert_eq!(std::fs::read(&target_file).unwrap(), b"root's", "the link's target was not written");
        // Again over what is there now: idempotent.
        put_dir(&d.path().join("control"), 0o2770, uid, gid).unwrap();
        put_file(&d.path().join("token"), b"again", 0o600, uid, gid).unwrap();
        assert_eq!(std::fs::read(d.path().join("token")).unwrap(), b"again");
    }

    #[test]
    fn a_parent_reached_through_a_link_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let (uid, gid) = me();
        std::fs::create_dir(d.path().join("real")).unwrap();
        std::os::unix::fs::symlink(d.path().join("real"), d.path().join("state")).unwrap();
        assert!(put_dir(&d.path().join("state/control"), 0o2770, uid, gid).is_err());
        assert!(put_file(&d.path().join("state/token"), b"x", 0o600, uid, gid).is_err());
        assert_eq!(std::fs::read_dir(d.path().join("real")).unwrap().count(), 0);
        assert!(put_dir(Path::new("relative"), 0o700, uid, gid).is_err());
    }
}
