//! The one way the runner reads (or removes) what a job left in its working directory.
//!
//! Job code can write anything there: a symbolic link where the runner expects the plan
//! JSON, a FIFO where it expects outputs, a directory link in place of the module. Every
//! such read therefore resolves the name beneath the job's directory from a descriptor of
//! that directory, follows no symbolic link in any component (`openat2` with
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`; a component-by-component
//! walk with `O_NOFOLLOW` where the kernel has no `openat2`), opens regular files only,
//! and reads at most a cap. Nothing here writes into the job's tree; a removal unlinks
//! one name in a directory opened the same way.

use std::io::Read as _;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

/// Why a file of the job's could not be read.
#[derive(Debug, thiserror::Error)]
pub enum JobFileError {
    #[error("{path}: not there")]
    Missing { path: PathBuf },
    #[error(
        "{path}: a symbolic link or a name outside the job's directory; the runner reads only regular files beneath it"
    )]
    NotBeneath { path: PathBuf },
    #[error("{path}: a {kind}, not a regular file")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{path}: larger than {max} bytes")]
    TooLarge { path: PathBuf, max: u64 },
    #[error("{path}: a name the runner does not read (relative, no `..`)")]
    BadName { path: PathBuf },
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
}

impl JobFileError {
    /// The reason code a job fails with when the runner cannot take a file it needs.
    pub fn code(&self) -> &'static str {
        match self {
            JobFileError::Missing { .. } => "job_file_missing",
            JobFileError::NotBeneath { .. }
            | JobFileError::NotRegular { .. }
            | JobFileError::BadName { .. } => "job_file_refused",
            JobFileError::TooLarge { .. } => "job_file_too_large",
            JobFileError::Io { .. } => "job_file_unreadable",
        }
    }
}

/// A job's working directory, held open by descriptor.
pub struct JobTree {
    dir: OwnedFd,
    root: PathBuf,
}

impl JobTree {
    /// Open the job's directory itself. Its path is the runner's own
    /// (`<state dir>/work/<job>`); only what lies beneath it is the job's.
    pub fn open(root: &Path) -> Result<JobTree, JobFileError> {
        let dir = nix::fcntl::open(
            root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| JobFileError::Io {
            op: "opening",
            path: root.to_path_buf(),
            source: e.into(),
        })?;
        Ok(JobTree { dir, root: root.to_path_buf() })
    }

    /// The whole of a regular file beneath the tree, at most `max` bytes.
    pub fn read(&self, rel: impl AsRef<Path>, max: u64) -> Result<Vec<u8>, JobFileError> {
        let rel = rel.as_ref();
        let (mut file, len) = self.open_regular(rel)?;
        if len > max {
            return Err(JobFileError::TooLarge { path: self.shown(rel), max });
        }
        let mut bytes = Vec::with_capacity(len as usize);
        // The file may grow after the fstat (a process of the job still writing).
        (&mut file)
            .take(max.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(|source| JobFileError::Io { op: "reading", path: self.shown(rel), source })?;
        if bytes.len() as u64 > max {
            return Err(JobFileError::TooLarge { path: self.shown(rel), max });
        }
        Ok(bytes)
    }

    /// As [`read`](Self::read); `None` when nothing has that name.
    pub fn read_if_exists(&self, rel: impl AsRef<Path>, max: u64) -> Result<Option<Vec<u8>>, JobFileError> {
        match self.read(rel, max) {
            Ok(b) => Ok(Some(b)),
            Err(JobFileError::Missing { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A regular file's SHA-256 (`sha256:<hex>`), streamed: plan files can be large.
    pub fn sha256(&self, rel: impl AsRef<Path>) -> Result<String, JobFileError> {
        use sha2::Digest as _;
        let rel = rel.as_ref();
        let (mut file, _) = self.open_regular(rel)?;
        let mut h = sha2::Sha256::new();
        std::io::copy(&mut file, &mut h).map_err(|source| JobFileError::Io {
            op: "reading",
            path: self.shown(rel),
            source,
        })?;
        Ok(format!("sha256:{}", hex::encode(h.finalize())))
    }

    /// Copy a regular file beneath the tree to `dest` (a new file of the runner's, synced),
    /// streamed, at most `max` bytes.
    pub fn copy_out(&self, rel: impl AsRef<Path>, dest: &Path, max: u64) -> Result<(), JobFileError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let rel = rel.as_ref();
        let (file, len) = self.open_regular(rel)?;
        if len > max {
            return Err(JobFileError::TooLarge { path: self.shown(rel), max });
        }
        let io = |op: &'static str, path: PathBuf| move |source| JobFileError::Io { op, path, source };
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(OFlag::O_NOFOLLOW.bits())
            .open(dest)
            .map_err(io("creating", dest.to_path_buf()))?;
        let copied = std::io::copy(&mut file.take(max.saturating_add(1)), &mut out)
            .map_err(io("copying", self.shown(rel)))?;
        if copied > max {
            drop(out);
            let _ = std::fs::remove_file(dest);
            return Err(JobFileError::TooLarge { path: self.shown(rel), max });
        }
        out.sync_all().map_err(io("syncing", dest.to_path_buf()))
    }

    /// Unlink one name (never a directory) beneath the tree; nothing there is fine.
    pub fn remove(&self, rel: impl AsRef<Path>) -> Result<(), JobFileError> {
        let rel = rel.as_ref();
        let (parent, name) = match (rel.parent(), rel.file_name()) {
            (Some(p), Some(n)) => (p, n),
            _ => return Err(JobFileError::BadName { path: self.shown(rel) }),
        };
        let dir = if parent.as_os_str().is_empty() {
            None
        } else {
            match self.open_beneath(parent, OFlag::O_PATH | OFlag::O_DIRECTORY) {
                Ok(d) => Some(d),
                Err(JobFileError::Missing { .. }) => return Ok(()),
                Err(e) => return Err(e),
            }
        };
        let at = dir.as_ref().unwrap_or(&self.dir);
        match nix::unistd::unlinkat(at, name, nix::unistd::UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(JobFileError::Io { op: "removing", path: self.shown(rel), source: e.into() }),
        }
    }

    fn shown(&self, rel: &Path) -> PathBuf {
        self.root.join(rel)
    }

    fn open_regular(&self, rel: &Path) -> Result<(std::fs::File, u64), JobFileError> {
        // O_NONBLOCK: opening a FIFO the job left must not hang the runner.
        let fd = self.open_beneath(rel, OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY)?;
        let file = std::fs::File::from(fd);
        let meta = file.metadata().map_err(|source| JobFileError::Io {
            op: "inspecting",
            path: self.shown(rel),
            source,
        })?;
        let ft = meta.file_type();
        if !ft.is_file() {
            use std::os::unix::fs::FileTypeExt as _;
            let kind = if ft.is_dir() {
                "directory"
            } else if ft.is_fifo() {
                "FIFO"
            } else if ft.is_socket() {
                "socket"
            } else if ft.is_block_device() || ft.is_char_device() {
                "device"
            } else {
                "special file"
            };
            return Err(JobFileError::NotRegular { path: self.shown(rel), kind });
        }
        Ok((file, meta.len()))
    }

    /// `rel` opened beneath the tree with `flags`, no symbolic link followed anywhere.
    fn open_beneath(&self, rel: &Path, flags: OFlag) -> Result<OwnedFd, JobFileError> {
        let plain =
            !rel.as_os_str().is_empty() && rel.components().all(|c| matches!(c, Component::Normal(_)));
        if !plain {
            return Err(JobFileError::BadName { path: self.shown(rel) });
        }
        let flags = flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
        let how = OpenHow::new().flags(flags).resolve(
            ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_XDEV,
        );
        let opened = loop {
            match nix::fcntl::openat2(&self.dir, rel, how) {
                Err(Errno::EAGAIN | Errno::EINTR) => continue,
                Err(Errno::ENOSYS | Errno::E2BIG) => break self.walk(rel, flags),
                other => break other,
            }
        };
        opened.map_err(|e| self.refusal(rel, e))
    }

    /// Without `openat2`: one component at a time, each a directory opened with
    /// `O_NOFOLLOW` from the one before (`rel` has no `..`, so nothing climbs out).
    fn walk(&self, rel: &Path, flags: OFlag) -> nix::Result<OwnedFd> {
        let parts: Vec<&std::ffi::OsStr> = rel.iter().collect();
        let Some((last, dirs)) = parts.split_last() else { return Err(Errno::EINVAL) };
        let mut cur: Option<OwnedFd> = None;
        for d in dirs {
            let at = cur.as_ref().unwrap_or(&self.dir);
            let next = nix::fcntl::openat(
                at,
                *d,
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )?;
            cur = Some(next);
        }
        nix::fcntl::openat(cur.as_ref().unwrap_or(&self.dir), *last, flags, Mode::empty())
    }

    fn refusal(&self, rel: &Path, e: Errno) -> JobFileError {
        let path = self.shown(rel);
        match e {
            Errno::ENOENT => JobFileError::Missing { path },
            // A symbolic link in some component (ELOOP; ENOTDIR for a link where a
            // directory was expected in the walk), or a step out of the tree (EXDEV).
            Errno::ELOOP | Errno::EXDEV | Errno::ENOTDIR => JobFileError::NotBeneath { path },
            e => JobFileError::Io { op: "opening", path, source: e.into() },
        }
    }
}

/// One file of the job's, read as [`JobTree::read`] does (the tree opened for it).
pub fn read(root: &Path, rel: impl AsRef<Path>, max: u64) -> Result<Vec<u8>, JobFileError> {
    JobTree::open(root)?.read(rel, max)
}

/// As [`read`]; `None` when nothing has that name.
pub fn read_if_exists(root: &Path, rel: impl AsRef<Path>, max: u64) -> Result<Option<Vec<u8>>, JobFileError> {
    JobTree::open(root)?.read_if_exists(rel, max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn tree() -> (tempfile::TempDir, tempfile::TempDir) {
        let job = tempfile::tempdir().expect("job dir");
        let outside = tempfile::tempdir().expect("outside");
        std::fs::write(outside.path().join("secret"), b"identity key").expect("secret");
        std::fs::create_dir(job.path().join("module")).expect("module");
        std::fs::write(job.path().join("module/plan.json"), b"{}").expect("plan");
        (job, outside)
    }

    #[test]
    fn regular_files_beneath_the_tree_are_read() {
        let (job, _outside) = tree();
        let t = JobTree::open(job.path()).expect("open");
        assert_eq!(t.read("module/plan.json", 16).expect("read"), b"{}");
        assert_eq!(t.read_if_exists("module/none.json", 16).expect("absent"), None);
        assert_eq!(
            t.sha256("module/plan.json").expect("hash"),
            "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
        assert_eq!(t.read("module/none.json", 16).unwrap_err().code(), "job_file_missing");
    }

    #[test]
    fn a_copy_out_is_of_a_regular_file_only_and_capped() {
        let (job, outside) = tree();
        let t = JobTree::open(job.path()).expect("open");
        let sealed = tempfile::tempdir().expect("sealed");
        t.copy_out("module/plan.json", &sealed.path().join("plan.json"), 16).expect("copy");
        assert_eq!(std::fs::read(sealed.path().join("plan.json")).expect("copied"), b"{}");
        symlink(outside.path().join("secret"), job.path().join("module/plan.tfplan")).expect("link");
        let e = t.copy_out("module/plan.tfplan", &sealed.path().join("plan.tfplan"), 1024).unwrap_err();
        assert_eq!(e.code(), "job_file_refused");
        assert!(!sealed.path().join("plan.tfplan").exists());
        let e = t.copy_out("module/plan.json", &sealed.path().join("small"), 1).unwrap_err();
        assert_eq!(e.code(), "job_file_too_large");
        assert!(!sealed.path().join("small").exists());
        // Never over something already there (a link planted at the name, say).
        symlink(outside.path().join("secret"), sealed.path().join("planted")).expect("planted");
        assert!(t.copy_out("module/plan.json", &sealed.path().join("planted"), 16).is_err());
        assert_eq!(std::fs::read(outside.path().join("secret")).expect("secret"), b"identity key");
    }

    #[test]
    fn a_symbolic_link_anywhere_in_the_name_is_refused() {
        let (job, outside) = tree();
        let t = JobTree::open(job.path()).expect("open");
        // The file itself a link to a file outside.
        symlink(outside.path().join("secret"), job.path().join("module/outputs.json")).expect("link");
        // A directory component a link to a directory outside.
        symlink(outside.path(), job.path().join("elsewhere")).expect("dir link");
        // A link to a file inside the tree: refused as well (no link is followed).
        symlink("plan.json", job.path().join("module/alias.json")).expect("inner link");
        for rel in ["module/outputs.json", "elsewhere/secret", "module/alias.json"] {
            let e = t.read(rel, 1024).unwrap_err();
            assert!(matches!(e, JobFileError::NotBeneath { .. }), "{rel}: {e}");
            assert_eq!(e.code(), "job_file_refused");
            assert!(t.sha256(rel).is_err(), "{rel} hashed");
        }
        // The fallback walk refuses the same.
        for rel in ["module/outputs.json", "elsewhere/secret"] {
            assert!(t.walk(Path::new(rel), OFlag::O_RDONLY | OFlag::O_NOFOLLOW).is_err(), "{rel}");
        }
        assert_eq!(t.walk(Path::new("module/plan.json"), OFlag::O_RDONLY).map(|_| ()), Ok(()));
    }

    #[test]
    fn traversal_and_absolute_names_are_refused_before_any_open() {
        let (job, outside) = tree();
        let t = JobTree::open(job.path()).expect("open");
        let abs = outside.path().join("secret");
        for rel in [Path::new("../secret"), Path::new("module/../../secret"), abs.as_path(), Path::new("")] {
            let e = t.read(rel, 1024).unwrap_err();
            assert!(matches!(e, JobFileError::BadName { .. }), "{}: {e}", rel.display());
        }
    }

    #[test]
    fn fifos_directories_and_oversized_files_are_refused_without_blocking() {
        let (job, _outside) = tree();
        nix::unistd::mkfifo(&job.path().join("fifo"), Mode::from_bits_truncate(0o600)).expect("fifo");
        std::fs::write(job.path().join("big"), vec![b'x'; 100]).expect("big");
        let t = JobTree::open(job.path()).expect("open");
        assert!(matches!(t.read("fifo", 10).unwrap_err(), JobFileError::NotRegular { kind: "FIFO", .. }));
        assert!(matches!(
            t.read("module", 10).unwrap_err(),
            JobFileError::NotRegular { kind: "directory", .. }
        ));
        let e = t.read("big", 99).unwrap_err();
        assert!(matches!(e, JobFileError::TooLarge { max: 99, .. }), "{e}");
        assert_eq!(t.read("big", 100).expect("at the cap").len(), 100);
    }

    #[test]
    fn removal_never_reaches_through_a_linked_directory() {
        let (job, outside) = tree();
        symlink(outside.path(), job.path().join("elsewhere")).expect("dir link");
        let t = JobTree::open(job.path()).expect("open");
        assert!(t.remove("elsewhere/secret").is_err());
        assert!(outside.path().join("secret").exists(), "the file outside is still there");
        // A link itself is unlinked, not what it names.
        symlink(outside.path().join("secret"), job.path().join("module/link")).expect("link");
        t.remove("module/link").expect("unlink the link");
        assert!(outside.path().join("secret").exists());
        t.remove("module/plan.json").expect("remove");
        assert!(!job.path().join("module/plan.json").exists());
        t.remove("module/plan.json").expect("already gone is fine");
    }

    #[test]
    fn a_tree_that_is_itself_a_link_is_not_opened() {
        let (job, outside) = tree();
        let link = job.path().join("linked-tree");
        symlink(outside.path(), &link).expect("link");
        assert!(JobTree::open(&link).is_err());
    }
}
