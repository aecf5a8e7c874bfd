//! The one way the runner (daemon and CLI) writes a file it must not lose and must not
//! be made to write elsewhere: under the state directory, `control/` (which an admin
//! group can write to), the audit log's directory, the terraform state.
//!
//! - The directory is opened without following a link and must belong to this
//!   process's user, to root, or to the runner's service user (`byoc-runner`, whose
//!   `control/` root and the admin group write into): a directory someone else owns is
//!   not ours to trust.
//! - The temporary file has a random name and is created exclusively, never through a
//!   link (`O_CREAT | O_EXCL | O_NOFOLLOW`, relative to the directory's descriptor): a
//!   link or file planted at a name we might use is never written through.
//! - Its mode is set exactly (the service's umask does not apply), its content fsynced,
//!   it is renamed over the target (a link at the target is replaced, not followed),
//!   and the directory is fsynced: after a crash the file is the old content or the new.

use std::fs::File;
use std::io::Write as _;
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use nix::fcntl::{OFlag, open, openat, renameat};
use nix::sys::stat::{Mode, fchmod};
use nix::unistd::{UnlinkatFlags, unlinkat};

/// Attempts at a free temporary name before giving up (each name is 64 random bits).
const NAME_ATTEMPTS: usize = 8;

/// How a file is written: the defaults are the state directory's rules.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub mode: u32,
    /// Refuse a directory that is neither this process's user's nor root's. Off only for
    /// a directory the customer names outside the state directory (node_exporter's
    /// textfile directory), where the exclusive create still holds.
    pub check_owner: bool,
}

impl Options {
    pub fn mode(mode: u32) -> Options {
        Options { mode, check_owner: true }
    }
}

/// Replace `path` with `bytes` (see the module's rules).
pub fn write(path: &Path, bytes: &[u8], options: Options) -> std::io::Result<()> {
    write_with(path, options, |f| f.write_all(bytes))
}

/// Replace `path` with what `fill` writes into the temporary file (a stream too large
/// to hold, a compressor).
pub fn write_with(
    path: &Path,
    options: Options,
    fill: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let (dir, name) = split(path)?;
    let dir_fd = open_dir(dir, options.check_owner)?;
    let (tmp_name, mut file) = create_temporary(&dir_fd, name)?;
    let written = (|| {
        fchmod(file.as_fd(), Mode::from_bits_truncate(options.mode)).map_err(std::io::Error::from)?;
        fill(&mut file)?;
        file.sync_all()?;
        renameat(&dir_fd, tmp_name.as_str(), &dir_fd, name).map_err(std::io::Error::from)
    })();
    if let Err(e) = written {
        let _ = unlinkat(&dir_fd, tmp_name.as_str(), UnlinkatFlags::NoRemoveDir);
        return Err(with_path(e, path));
    }
    nix::unistd::fsync(&dir_fd).map_err(|e| with_path(e.into(), dir))
}

/// Make `path` a directory (if it is not one yet) with `mode`, its missing parents too,
/// and fsync its parent: a directory a durable file goes into must itself survive.
pub fn create_dir(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(mode).create(path)?;
    if let Some(parent) = path.parent() {
        File::open(parent)?.sync_all()?;
    }
    Ok(())
}

fn split(path: &Path) -> std::io::Result<(&Path, &str)> {
    let name = path.file_name().and_then(|n| n.to_str());
    match (path.parent(), name) {
        (Some(dir), Some(name)) => Ok((if dir.as_os_str().is_empty() { Path::new(".") } else { dir }, name)),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{}: not a file name in a directory", path.display()),
        )),
    }
}

fn open_dir(dir: &Path, check_owner: bool) -> std::io::Result<OwnedFd> {
    let fd =
        open(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| with_path(e.into(), dir))?;
    if check_owner {
        let owner = File::from(fd.try_clone()?).metadata()?.uid();
        let me = nix::unistd::geteuid().as_raw();
        if owner != me && owner != 0 && Some(owner) != service_uid() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "{} belongs to uid {owner}, neither this process's user ({me}), root nor {SERVICE_USER}: \
                     not written to",
                    dir.display()
                ),
            ));
        }
    }
    Ok(fd)
}

/// The user the packaged service runs as.
pub const SERVICE_USER: &str = "byoc-runner";

fn service_uid() -> Option<u32> {
    static UID: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *UID.get_or_init(|| nix::unistd::User::from_name(SERVICE_USER).ok().flatten().map(|u| u.uid.as_raw()))
}

fn create_temporary(dir: &OwnedFd, name: &str) -> std::io::Result<(String, File)> {
    let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut last = None;
    for _ in 0..NAME_ATTEMPTS {
        let mut random = [0u8; 8];
        getrandom::fill(&mut random).map_err(|e| std::io::Error::other(e.to_string()))?;
        let tmp = format!(".{name}.{}.tmp", hex::encode(random));
        match openat(dir, tmp.as_str(), flags, Mode::from_bits_truncate(0o600)) {
            Ok(fd) => return Ok((tmp, File::from(fd))),
            // Taken (planted, or another writer's): another name.
            Err(nix::errno::Errno::EEXIST) => last = Some(nix::errno::Errno::EEXIST),
            Err(e) => return Err(e.into()),
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AlreadyExists,
        format!("no free temporary name for {name} after {NAME_ATTEMPTS} attempts ({last:?})"),
    ))
}

fn with_path(e: std::io::Error, path: &Path) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt as _, symlink};

    #[test]
    fn a_file_is_replaced_whole_with_exactly_its_mode() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.json");
        write(&path, b"one", Options::mode(0o640)).expect("first");
        write(&path, b"two", Options::mode(0o600)).expect("second");
        assert_eq!(std::fs::read(&path).expect("read"), b"two");
        assert_eq!(std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777, 0o600);
        let left: Vec<_> =
            std::fs::read_dir(dir.path()).expect("ls").flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, [std::ffi::OsString::from("state.json")], "no temporary file left");
    }

    #[test]
    fn a_link_at_the_target_is_replaced_not_followed() {
        let dir = tempfile::tempdir().expect("dir");
        let outside = tempfile::tempdir().expect("outside");
        let victim = outside.path().join("ld.so.preload");
        std::fs::write(&victim, b"untouched").expect("victim");
        let path = dir.path().join("allowances.json");
        symlink(&victim, &path).expect("link");
        write(&path, b"{}", Options::mode(0o600)).expect("write");
        assert_eq!(std::fs::read(&victim).expect("victim"), b"untouched");
        assert!(std::fs::symlink_metadata(&path).expect("meta").is_file());
    }

    #[test]
    fn a_directory_that_is_a_link_is_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let outside = tempfile::tempdir().expect("outside");
        let control = dir.path().join("control");
        symlink(outside.path(), &control).expect("link");
        assert!(write(&control.join("pause.json"), b"{}", Options::mode(0o600)).is_err());
        assert_eq!(std::fs::read_dir(outside.path()).expect("ls").count(), 0);
    }

    #[test]
    fn a_failed_fill_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("journal.jsonl");
        write(&path, b"old", Options::mode(0o600)).expect("old");
        let e = write_with(&path, Options::mode(0o600), |f| {
            f.write_all(b"half")?;
            Err(std::io::Error::other("disk full"))
        });
        assert!(e.is_err());
        assert_eq!(std::fs::read(&path).expect("read"), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 1);
    }

    #[test]
    fn a_directory_of_another_user_is_refused_unless_asked() {
        if !nix::unistd::geteuid().is_root() {
            // Only root can make a directory another user owns; the fast tier runs as
            // any user: the check itself is the same code either way.
            let dir = tempfile::tempdir().expect("dir");
            assert!(write(&dir.path().join("x"), b"x", Options::mode(0o600)).is_ok());
            return;
        }
        let dir = tempfile::tempdir().expect("dir");
        std::os::unix::fs::chown(dir.path(), Some(65534), Some(65534)).expect("chown");
        let e = write(&dir.path().join("x"), b"x", Options::mode(0o600)).expect_err("refused");
        assert!(e.to_string().contains("uid 65534"), "{e}");
        write(&dir.path().join("x"), b"x", Options { mode: 0o644, check_owner: false }).expect("allowed");
    }
}
