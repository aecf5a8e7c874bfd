//! Unpacking an artifact's archive (tar, optionally gzip-compressed) into a fresh
//! directory, refusing anything that could reach outside it or exhaust the disk: no
//! absolute paths, no `..`, no links that lead out of the tree (nor entries written
//! through a link), no devices, fifos or sockets, a bounded number of entries and
//! bounded bytes, counted as they are decompressed (so a zip bomb stops at the limit,
//! not at the end of the disk). Every refusal names the entry and has a reason code.

use std::collections::BTreeSet;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Component, Path, PathBuf};

/// Bounds on what one archive may unpack to.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Entries of any kind (files, directories, links).
    pub max_entries: usize,
    /// Bytes read out of the (decompressed) archive, headers included.
    pub max_bytes: u64,
    /// Path components below the root.
    pub max_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_entries: 10_000, max_bytes: 512 << 20, max_depth: 32 }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("archive entry {path:?} is an absolute path")]
    Absolute { path: String },
    #[error("archive entry {path:?} leaves the artifact's tree")]
    Traversal { path: String },
    #[error("archive entry {path:?} is a link to {target:?}, which leads outside the artifact's tree")]
    LinkOutside { path: String, target: String },
    #[error("archive entry {path:?} would be written through the link {link:?}")]
    ThroughLink { path: String, link: String },
    #[error(
        "archive entry {path:?} is a {kind}: only files, directories and links inside the tree are allowed"
    )]
    Special { path: String, kind: &'static str },
    #[error("archive entry {path:?} appears twice")]
    Duplicate { path: String },
    #[error("archive has more than {max} entries")]
    TooManyEntries { max: usize },
    #[error("archive unpacks to more than {max} bytes")]
    TooLarge { max: u64 },
    #[error("archive entry {path:?} is nested deeper than {max} directories")]
    TooDeep { path: String, max: usize },
    #[error("not a tar archive (optionally gzip-compressed): {0}")]
    Format(String),
    #[error("unpacking {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

impl UnpackError {
    /// The reason code a refused job carries.
    pub fn code(&self) -> &'static str {
        match self {
            UnpackError::Absolute { .. } => "artifact_path_absolute",
            UnpackError::Traversal { .. } => "artifact_path_traversal",
            UnpackError::LinkOutside { .. } | UnpackError::ThroughLink { .. } => "artifact_link_outside",
            UnpackError::Special { .. } => "artifact_special_file",
            UnpackError::Duplicate { .. } => "artifact_duplicate_entry",
            UnpackError::TooManyEntries { .. } => "artifact_too_many_files",
            UnpackError::TooLarge { .. } | UnpackError::TooDeep { .. } => "artifact_too_large",
            UnpackError::Format(_) => "artifact_invalid",
            UnpackError::Io { .. } => "artifact_io",
        }
    }
}

/// What was unpacked.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Unpacked {
    pub files: usize,
    pub bytes: u64,
}

/// Counts every byte read out of the archive and fails past the limit, so nothing the
/// archive claims (an entry's size, a long name, a PAX header) is trusted to be small.
struct Bounded<R> {
    inner: R,
    read: u64,
    max: u64,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.read >= self.max {
            // One byte more tells a stream that ends exactly at the limit from one that does not.
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(std::io::Error::other(BOUND_EXCEEDED)),
            };
        }
        let room = (self.max - self.read).min(buf.len() as u64) as usize;
        let n = self.inner.read(&mut buf[..room])?;
        self.read += n as u64;
        Ok(n)
    }
}

const BOUND_EXCEEDED: &str = "the archive exceeds its size limit";

/// Unpack `archive` (tar or tar.gz, told apart by the gzip magic) into `dest`, which
/// must exist and be empty.
pub fn unpack(archive: impl Read, dest: &Path, limits: &Limits) -> Result<Unpacked, UnpackError> {
    let mut archive = std::io::BufReader::new(archive);
    let gzipped = {
        use std::io::BufRead as _;
        let head = archive.fill_buf().map_err(|e| UnpackError::Format(e.to_string()))?;
        head.starts_with(&[0x1f, 0x8b])
    };
    let reader: Box<dyn Read> =
        if gzipped { Box::new(flate2::read::GzDecoder::new(archive)) } else { Box::new(archive) };
    let bounded = Bounded { inner: reader, read: 0, max: limits.max_bytes };
    let mut tar = tar::Archive::new(bounded);
    let mut state =
        State { dest, limits, seen: BTreeSet::new(), links: BTreeSet::new(), out: Unpacked::default() };
    let entries = tar.entries().map_err(|e| state.read_error(e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| state.read_error(e))?;
        state.entry(&mut entry)?;
    }
    state.check_links()?;
    Ok(state.out)
}

struct State<'a> {
    dest: &'a Path,
    limits: &'a Limits,
    /// Every path unpacked so far (relative).
    seen: BTreeSet<PathBuf>,
    /// The symlinks among them: nothing may be written through one.
    links: BTreeSet<PathBuf>,
    out: Unpacked,
}

impl State<'_> {
    fn read_error(&self, e: std::io::Error) -> UnpackError {
        if e.to_string().contains(BOUND_EXCEEDED) {
            UnpackError::TooLarge { max: self.limits.max_bytes }
        } else {
            UnpackError::Format(e.to_string())
        }
    }

    fn io(&self, rel: &Path, source: std::io::Error) -> UnpackError {
        if source.to_string().contains(BOUND_EXCEEDED) {
            return UnpackError::TooLarge { max: self.limits.max_bytes };
        }
        UnpackError::Io { path: self.dest.join(rel), source }
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), UnpackError> {
        use tar::EntryType;
        let kind = entry.header().entry_type();
        if matches!(kind, EntryType::XGlobalHeader) {
            return Ok(());
        }
        let raw = entry.path().map_err(|e| UnpackError::Format(e.to_string()))?.into_owned();
        let Some(rel) = self.relative(&raw)? else { return Ok(()) };
        self.out.files += 1;
        if self.out.files > self.limits.max_entries {
            return Err(UnpackError::TooManyEntries { max: self.limits.max_entries });
        }
        let shown = rel.display().to_string();
        if let Some(link) = self.links.iter().find(|l| rel.starts_with(l) && rel != **l) {
            return Err(UnpackError::ThroughLink { path: shown, link: link.display().to_string() });
        }
        let is_dir = matches!(kind, EntryType::Directory);
        // A directory may be named again (tars list parents before children and
        // sometimes again); anything else only once.
        if !self.seen.insert(rel.clone()) && !is_dir {
            return Err(UnpackError::Duplicate { path: shown });
        }
        let target = self.dest.join(&rel);
        match kind {
            EntryType::Directory => self.mkdir(&rel),
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                let executable = entry.header().mode().is_ok_and(|m| m & 0o111 != 0);
                self.parent(&rel)?;
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(if executable { 0o755 } else { 0o644 })
                    .custom_flags(libc_nofollow())
                    .open(&target)
                    .map_err(|e| self.io(&rel, e))?;
                let mut file = std::io::BufWriter::new(file);
                let n = std::io::copy(entry, &mut file).map_err(|e| self.io(&rel, e))?;
                file.into_inner().map_err(|e| self.io(&rel, e.into_error()))?;
                self.out.bytes += n;
                Ok(())
            }
            EntryType::Symlink => {
                let link = entry
                    .link_name()
                    .map_err(|e| UnpackError::Format(e.to_string()))?
                    .ok_or_else(|| UnpackError::Format(format!("{shown}: a link without a target")))?
                    .into_owned();
                let outside =
                    || UnpackError::LinkOutside { path: shown.clone(), target: link.display().to_string() };
                if link.is_absolute() {
                    return Err(outside());
                }
                let base = rel.parent().unwrap_or(Path::new(""));
                if normalize(&base.join(&link)).is_none() {
                    return Err(outside());
                }
                self.parent(&rel)?;
                std::os::unix::fs::symlink(&link, &target).map_err(|e| self.io(&rel, e))?;
                self.links.insert(rel);
                Ok(())
            }
            EntryType::Link => {
                // A hard link to a file unpacked earlier: written as a copy of it.
                let link = entry
                    .link_name()
                    .map_err(|e| UnpackError::Format(e.to_string()))?
                    .ok_or_else(|| UnpackError::Format(format!("{shown}: a link without a target")))?
                    .into_owned();
                let outside =
                    || UnpackError::LinkOutside { path: shown.clone(), target: link.display().to_string() };
                let from = match self.relative(&link) {
                    Ok(Some(from)) if self.seen.contains(&from) && !self.links.contains(&from) => from,
                    _ => return Err(outside()),
                };
                if !self.dest.join(&from).is_file() {
                    return Err(outside());
                }
                self.parent(&rel)?;
                let n = std::fs::copy(self.dest.join(&from), &target).map_err(|e| self.io(&rel, e))?;
                self.out.bytes += n;
                if self.out.bytes > self.limits.max_bytes {
                    return Err(UnpackError::TooLarge { max: self.limits.max_bytes });
                }
                Ok(())
            }
            EntryType::Char => Err(UnpackError::Special { path: shown, kind: "character device" }),
            EntryType::Block => Err(UnpackError::Special { path: shown, kind: "block device" }),
            EntryType::Fifo => Err(UnpackError::Special { path: shown, kind: "fifo" }),
            _ => Err(UnpackError::Special { path: shown, kind: "special entry" }),
        }
    }

    /// Every link, resolved as the kernel would (through the other links), must land on
    /// something inside the tree: a chain of links that each looked inside on its own
    /// (`a -> .`, then `b -> a/..`) cannot lead out, and no link dangles.
    fn check_links(&self) -> Result<(), UnpackError> {
        let root = std::fs::canonicalize(self.dest).map_err(|e| self.io(Path::new(""), e))?;
        for link in &self.links {
            let target = std::fs::read_link(self.dest.join(link)).unwrap_or_default();
            let outside = || UnpackError::LinkOutside {
                path: link.display().to_string(),
                target: target.display().to_string(),
            };
            match std::fs::canonicalize(self.dest.join(link)) {
                Ok(real) if real.starts_with(&root) => {}
                _ => return Err(outside()),
            }
        }
        Ok(())
    }

    /// The entry's path below the root: `None` for the root itself (`./`).
    fn relative(&self, raw: &Path) -> Result<Option<PathBuf>, UnpackError> {
        let shown = raw.display().to_string();
        let mut rel = PathBuf::new();
        for c in raw.components() {
            match c {
                Component::Normal(part) => rel.push(part),
                Component::CurDir => {}
                Component::ParentDir => return Err(UnpackError::Traversal { path: shown }),
                Component::RootDir | Component::Prefix(_) => {
                    return Err(UnpackError::Absolute { path: shown });
                }
            }
        }
        if rel.components().count() > self.limits.max_depth {
            return Err(UnpackError::TooDeep { path: shown, max: self.limits.max_depth });
        }
        Ok((!rel.as_os_str().is_empty()).then_some(rel))
    }

    fn mkdir(&self, rel: &Path) -> Result<(), UnpackError> {
        let mut at = PathBuf::new();
        for c in rel.components() {
            at.push(c);
            if self.links.contains(&at) {
                return Err(UnpackError::ThroughLink {
                    path: rel.display().to_string(),
                    link: at.display().to_string(),
                });
            }
            match std::fs::create_dir(self.dest.join(&at)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    // Only a directory we made may be reused.
                    let meta = std::fs::symlink_metadata(self.dest.join(&at)).map_err(|e| self.io(&at, e))?;
                    if !meta.is_dir() {
                        return Err(UnpackError::Duplicate { path: at.display().to_string() });
                    }
                }
                Err(e) => return Err(self.io(&at, e)),
            }
        }
        Ok(())
    }

    fn parent(&self, rel: &Path) -> Result<(), UnpackError> {
        match rel.parent() {
            Some(p) if !p.as_os_str().is_empty() => self.mkdir(p),
            _ => Ok(()),
        }
    }
}

/// `O_NOFOLLOW`: a file is never opened through a link, whatever raced in.
fn libc_nofollow() -> i32 {
    nix::fcntl::OFlag::O_NOFOLLOW.bits()
}

/// `p` with `.` and `..` resolved lexically; `None` if it climbs above its start.
fn normalize(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(part) => out.push(part),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    /// An archive built entry by entry; `raw_name` lets a test write what a well-behaved
    /// builder refuses to (absolute paths, `..`).
    struct Tar(tar::Builder<Vec<u8>>);

    impl Tar {
        fn new() -> Tar {
            Tar(tar::Builder::new(Vec::new()))
        }
        fn entry(mut self, name: &str, kind: tar::EntryType, data: &[u8], link: Option<&str>) -> Tar {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_size(data.len() as u64);
            h.set_mode(if kind == tar::EntryType::Directory { 0o755 } else { 0o644 });
            let raw = &mut h.as_old_mut().name;
            raw[..name.len()].copy_from_slice(name.as_bytes());
            if let Some(l) = link {
                h.as_old_mut().linkname[..l.len()].copy_from_slice(l.as_bytes());
            }
            h.set_cksum();
            self.0.append(&h, data).expect("append");
            self
        }
        fn file(self, name: &str, data: &[u8]) -> Tar {
            self.entry(name, tar::EntryType::Regular, data, None)
        }
        fn bytes(self) -> Vec<u8> {
            self.0.into_inner().expect("tar")
        }
        fn gz(self) -> Vec<u8> {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(&self.bytes()).expect("gzip");
            e.finish().expect("gzip")
        }
    }

    fn unpack_into(archive: &[u8], limits: &Limits) -> (tempfile::TempDir, Result<Unpacked, UnpackError>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = unpack(archive, dir.path(), limits);
        (dir, r)
    }

    fn refused(archive: &[u8]) -> UnpackError {
        unpack_into(archive, &Limits::default()).1.expect_err("refused")
    }

    #[test]
    fn a_module_unpacks_with_its_directories_modes_and_inside_links() {
        let archive = Tar::new()
            .entry("./", tar::EntryType::Directory, b"", None)
            .file("./main.tf", b"resource \"terraform_data\" \"a\" {}\n")
            .entry("modules/", tar::EntryType::Directory, b"", None)
            .file("modules/net/variables.tf", b"variable \"x\" {}\n")
            .entry("modules/alias", tar::EntryType::Symlink, b"", Some("net"))
            .entry("copy.tf", tar::EntryType::Link, b"", Some("main.tf"))
            .gz();
        let (dir, r) = unpack_into(&archive, &Limits::default());
        let u = r.expect("unpacked");
        assert_eq!(u.files, 5);
        let p = dir.path();
        assert_eq!(
            std::fs::read_to_string(p.join("copy.tf")).unwrap_or_default(),
            "resource \"terraform_data\" \"a\" {}\n"
        );
        assert!(p.join("modules/alias/variables.tf").is_file(), "a link inside the tree works");
        // Plain (uncompressed) tar too.
        let (_, r) = unpack_into(&Tar::new().file("a.tf", b"x").bytes(), &Limits::default());
        assert_eq!(r.expect("plain tar").files, 1);
    }

    #[test]
    fn paths_that_leave_the_tree_are_refused() {
        let e = refused(&Tar::new().file("../x", b"x").gz());
        assert_eq!(e.code(), "artifact_path_traversal");
        let e = refused(&Tar::new().file("a/../../x", b"x").gz());
        assert_eq!(e.code(), "artifact_path_traversal");
        let e = refused(&Tar::new().file("/etc/x", b"x").gz());
        assert_eq!(e.code(), "artifact_path_absolute", "{e}");
    }

    #[test]
    fn links_that_lead_out_are_refused_and_nothing_is_written_through_a_link() {
        let link = |target: &str| Tar::new().entry("l", tar::EntryType::Symlink, b"", Some(target)).gz();
        for target in ["/", "/etc/passwd", "..", "a/../../x"] {
            assert_eq!(refused(&link(target)).code(), "artifact_link_outside", "{target}");
        }
        // A chain of links that each look inside on their own: a -> ., b -> a/..
        let chain = Tar::new()
            .entry("a", tar::EntryType::Symlink, b"", Some("."))
            .entry("b", tar::EntryType::Symlink, b"", Some("a/.."))
            .gz();
        assert_eq!(refused(&chain).code(), "artifact_link_outside");
        // A dangling link.
        assert_eq!(refused(&link("missing")).code(), "artifact_link_outside");
        // A file written through a link to a directory inside the tree.
        let through = Tar::new()
            .entry("d/", tar::EntryType::Directory, b"", None)
            .entry("l", tar::EntryType::Symlink, b"", Some("d"))
            .file("l/x", b"x")
            .gz();
        assert_eq!(refused(&through).code(), "artifact_link_outside");
        // A hard link to something outside, or to a file not in the archive.
        let hard = |target: &str| Tar::new().entry("h", tar::EntryType::Link, b"", Some(target)).gz();
        for target in ["/etc/passwd", "../x", "not-there"] {
            assert_eq!(refused(&hard(target)).code(), "artifact_link_outside", "{target}");
        }
    }

    #[test]
    fn devices_fifos_and_duplicates_are_refused() {
        for kind in [tar::EntryType::Char, tar::EntryType::Block, tar::EntryType::Fifo] {
            let e = refused(&Tar::new().entry("dev", kind, b"", None).gz());
            assert_eq!(e.code(), "artifact_special_file", "{kind:?}");
        }
        let e = refused(&Tar::new().file("a", b"1").file("a", b"2").gz());
        assert_eq!(e.code(), "artifact_duplicate_entry");
    }

    #[test]
    fn too_many_entries_stop_at_the_limit() {
        let mut t = Tar::new();
        for i in 0..100_000 {
            t = t.file(&format!("f{i}"), b"");
        }
        let (dir, r) = unpack_into(&t.gz(), &Limits::default());
        assert_eq!(r.expect_err("refused").code(), "artifact_too_many_files");
        let written = std::fs::read_dir(dir.path()).map(|d| d.count()).unwrap_or(0);
        assert!(written <= Limits::default().max_entries, "{written} files written");
    }

    #[test]
    fn a_zip_bomb_stops_at_the_byte_limit_not_the_end_of_the_disk() {
        // 64 MiB of zeros in one entry: about 64 KiB compressed.
        let size = 64u64 << 20;
        let mut h = tar::Header::new_gnu();
        h.set_path("bomb").expect("path");
        h.set_size(size);
        h.set_mode(0o644);
        h.set_cksum();
        let mut b = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        b.append(&h, std::io::repeat(0).take(size)).expect("append");
        let bomb = b.into_inner().expect("tar").finish().expect("gzip");
        assert!(bomb.len() < (1 << 20), "{} bytes compressed", bomb.len());
        let limits = Limits { max_bytes: 8 << 20, ..Limits::default() };
        let (dir, r) = unpack_into(&bomb, &limits);
        assert_eq!(r.expect_err("refused").code(), "artifact_too_large");
        let written = std::fs::metadata(dir.path().join("bomb")).map(|m| m.len()).unwrap_or(0);
        assert!(written <= limits.max_bytes, "{written} bytes written");
    }

    #[test]
    fn garbage_is_not_an_archive() {
        let e = refused(b"this is not a tar archive at all, just some text that goes on and on");
        assert_eq!(e.code(), "artifact_invalid", "{e}");
    }
}
