//! The one way the updater reads what the runner's user (or an admin) could have
//! written: every path component opened beneath a directory descriptor with
//! `O_NOFOLLOW` (a planted link is an error, never followed), a file read only if it is
//! a regular file, once, up to a size cap. Nothing here writes, chowns or removes
//! anything in those directories.

use std::io::Read as _;
use std::os::fd::{AsFd as _, OwnedFd};
use std::path::{Component, Path};

use nix::fcntl::{OFlag, openat};
use nix::sys::stat::{Mode, SFlag, fstat};

/// Open `dir` as a directory, following no link at any of its components after the
/// first (`/` or the current directory): each is opened beneath the one before.
pub fn open_dir(dir: &Path) -> std::io::Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let start = if dir.is_absolute() { "/" } else { "." };
    let mut fd = nix::fcntl::open(start, flags, Mode::empty()).map_err(std::io::Error::from)?;
    for part in dir.components() {
        match part {
            Component::Normal(name) => {
                fd = openat(fd.as_fd(), name, flags, Mode::empty()).map_err(|e| named(e, dir))?;
            }
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(std::io::Error::other(format!("{}: `..` is not followed", dir.display())));
            }
        }
    }
    Ok(fd)
}

/// Open the directory `name` beneath `dir`, following no link.
pub fn open_subdir(dir: &OwnedFd, name: &str) -> std::io::Result<OwnedFd> {
    plain_name(name)?;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    openat(dir.as_fd(), name, flags, Mode::empty()).map_err(|e| named(e, Path::new(name)))
}

/// Open the regular file `name` beneath `dir`: not a link, not a FIFO or device (opened
/// non-blocking so a FIFO cannot hold the updater), no larger than `max` bytes.
pub fn open_file(dir: &OwnedFd, name: &str, max: u64) -> std::io::Result<std::fs::File> {
    plain_name(name)?;
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
    let fd = openat(dir.as_fd(), name, flags, Mode::empty()).map_err(|e| named(e, Path::new(name)))?;
    let stat = fstat(&fd).map_err(std::io::Error::from)?;
    if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return Err(std::io::Error::other(format!("{name} is not a regular file")));
    }
    if stat.st_size as u64 > max {
        return Err(std::io::Error::other(format!("{name} is larger than {max} bytes")));
    }
    Ok(std::fs::File::from(fd))
}

/// The whole of the regular file `name` beneath `dir` (see [`open_file`]).
pub fn read(dir: &OwnedFd, name: &str, max: u64) -> std::io::Result<Vec<u8>> {
    let file = open_file(dir, name, max)?;
    let mut bytes = Vec::new();
    // The size was checked when opened; a file that grows since is cut at the cap + 1
    // and refused.
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::other(format!("{name} is larger than {max} bytes")));
    }
    Ok(bytes)
}

/// The file at `path` (every component checked as [`open_dir`] does), or `None` if it
/// does not exist.
pub fn read_path(path: &Path, max: u64) -> std::io::Result<Option<Vec<u8>>> {
    Ok(read_owned(path, max)?.map(|(bytes, _)| bytes))
}

/// [`read_path`], with the file's owner as the kernel reports it.
pub fn read_owned(path: &Path, max: u64) -> std::io::Result<Option<(Vec<u8>, u32)>> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return Err(std::io::Error::other(format!("{}: not a file path", path.display())));
    };
    let dir = match open_dir(parent) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let file = match open_file(&dir, name, max) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let owner = std::os::unix::fs::MetadataExt::uid(&file.metadata()?);
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::other(format!("{name} is larger than {max} bytes")));
    }
    Ok(Some((bytes, owner)))
}

/// The owner of the directory at `path` (no link followed): the runner's user for its
/// state directory.
pub fn dir_owner(path: &Path) -> std::io::Result<u32> {
    let fd = open_dir(path)?;
    Ok(fstat(&fd).map_err(std::io::Error::from)?.st_uid)
}

/// Copy the regular file `name` beneath `from` to `to` (a path in the updater's own
/// directory, created exclusively, fsynced), reading it through one descriptor.
pub fn copy_out(from: &OwnedFd, name: &str, to: &Path, max: u64) -> std::io::Result<u64> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let source = open_file(from, name, max)?;
    let mut target = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(to)?;
    let copied = std::io::copy(&mut source.take(max + 1), &mut target)?;
    if copied > max {
        return Err(std::io::Error::other(format!("{name} is larger than {max} bytes")));
    }
    target.sync_all()?;
    Ok(copied)
}

fn plain_name(name: &str) -> std::io::Result<()> {
    let plain =
        !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0');
    if plain { Ok(()) } else { Err(std::io::Error::other(format!("{name:?} is not a plain file name"))) }
}

fn named(e: nix::errno::Errno, what: &Path) -> std::io::Error {
    let kind = std::io::Error::from(e);
    let why = match e {
        nix::errno::Errno::ELOOP => "a link, not followed".to_string(),
        nix::errno::Errno::ENOTDIR => "not a directory (a link or a file), not followed".to_string(),
        other => other.desc().to_string(),
    };
    std::io::Error::new(kind.kind(), format!("{}: {why}", what.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_is_never_followed_at_any_component() {
        let d = tempfile::tempdir().unwrap();
        let secret = d.path().join("secret");
        std::fs::write(&secret, b"root's").unwrap();
        std::fs::create_dir(d.path().join("real")).unwrap();
        std::os::unix::fs::symlink(&secret, d.path().join("real/file")).unwrap();
        std::os::unix::fs::symlink(d.path().join("real"), d.path().join("linked")).unwrap();
        let real = open_dir(&d.path().join("real")).unwrap();
        let err = read(&real, "file", 100).unwrap_err();
        assert!(err.to_string().contains("a link, not followed"), "{err}");
        let err = open_dir(&d.path().join("linked")).unwrap_err();
        assert!(err.to_string().contains("not followed"), "{err}");
        assert!(read_path(&d.path().join("linked/file"), 100).is_err());
        assert!(open_dir(&d.path().join("real/../real")).is_err(), "`..` is refused");
    }

    #[test]
    fn only_a_regular_file_within_the_cap_is_read() {
        let d = tempfile::tempdir().unwrap();
        nix::unistd::mkfifo(&d.path().join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        std::fs::create_dir(d.path().join("dir")).unwrap();
        std::fs::write(d.path().join("big"), vec![0u8; 11]).unwrap();
        std::fs::write(d.path().join("ok"), b"ok").unwrap();
        let dir = open_dir(d.path()).unwrap();
        // A FIFO would block a plain open until a writer came: refused at once.
        assert!(read(&dir, "fifo", 10).unwrap_err().to_string().contains("not a regular file"));
        assert!(read(&dir, "dir", 10).is_err());
        assert!(read(&dir, "big", 10).unwrap_err().to_string().contains("larger than 10"));
        assert!(read(&dir, "../ok", 10).is_err());
        assert_eq!(read(&dir, "ok", 10).unwrap(), b"ok");
        assert_eq!(read_path(&d.path().join("missing"), 10).unwrap(), None);
    }

    #[test]
    fn a_copy_is_made_from_one_descriptor_into_a_new_file() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("pkg"), b"package").unwrap();
        let dir = open_dir(d.path()).unwrap();
        let to = d.path().join("copy");
        assert_eq!(copy_out(&dir, "pkg", &to, 100).unwrap(), 7);
        assert_eq!(std::fs::read(&to).unwrap(), b"package");
        // Never through an existing name (a link planted there would be written through).
        assert!(copy_out(&dir, "pkg", &to, 100).is_err());
    }
}
