//! The job's new root, built by init in its own mount namespace: an empty tmpfs with
//! read-only binds of what jobs may use, the paths to hide covered, a private /tmp,
//! /dev and /proc, the working directory, then pivot_root and a read-only remount.

use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};

use super::error::{SetupError, StepExt as _};
use crate::spec::{DEFAULT_RO_PATHS, NetworkSpec, SANDBOX_SEALED_DIR, SANDBOX_WORK_DIR, SandboxSpec};

/// Mount flags of `path`'s mount that a less privileged mount namespace may not clear
/// (the kernel locks them); a read-only remount must repeat them.
pub(super) fn locked_flags(path: &Path) -> MsFlags {
    use nix::sys::statvfs::{FsFlags, statvfs};
    let Ok(st) = statvfs(path) else { return MsFlags::empty() };
    let f = st.flags();
    let mut m = MsFlags::empty();
    for (fs, ms) in [
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if f.contains(fs) {
            m |= ms;
        }
    }
    m
}

fn inside(root: &Path, p: &Path) -> PathBuf {
    root.join(p.strip_prefix("/").unwrap_or(p))
}

fn mnt(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), SetupError> {
    mount(src, target, fstype, flags, data).step(format!(
        "mount {} on {}",
        src.map(|s| s.display().to_string()).unwrap_or_else(|| fstype.unwrap_or("").into()),
        target.display()
    ))
}

/// Bind `host` read-only at the same path under `root`.
fn bind_ro(root: &Path, host: &Path) -> Result<(), SetupError> {
    let Ok(meta) = std::fs::symlink_metadata(host) else { return Ok(()) };
    let target = inside(root, host);
    if meta.file_type().is_symlink() {
        // Merged-/usr systems: /bin -> usr/bin. Recreate the link, bind nothing.
        let dest = std::fs::read_link(host).step(format!("reading link {}", host.display()))?;
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).step(format!("creating {}", parent.display()))?;
        }
        return match std::os::unix::fs::symlink(&dest, &target) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(e).step(format!("linking {}", target.display())),
        };
    }
    if !target.exists() {
        let made = if meta.is_dir() {
            std::fs::create_dir_all(&target)
        } else {
            target
                .parent()
                .map(std::fs::create_dir_all)
                .unwrap_or(Ok(()))
                .and_then(|()| std::fs::write(&target, b""))
        };
        if let Err(e) = made {
            // Under an already read-only bind (an extra path inside /usr, say) a
            // missing mount point cannot be made; the path is simply not visible.
            eprintln!("sandbox: {} not visible: {e}", host.display());
            return Ok(());
        }
    }
    mnt(Some(host), &target, None, MsFlags::MS_BIND | MsFlags::MS_REC, None)?;
    remount_read_only(&target, locked_flags(host))
}

/// Make the bind mount at `target` read-only, nosuid, nodev (with the flags the kernel
/// locked on its source, which a remount must repeat).
fn remount_read_only(target: &Path, locked: MsFlags) -> Result<(), SetupError> {
    remount(target, locked, true)
}

/// Remount the bind mount at `target` nosuid, nodev, read-only or writable.
pub(super) fn remount(target: &Path, locked: MsFlags, read_only: bool) -> Result<(), SetupError> {
    let ro = if read_only { MsFlags::MS_RDONLY } else { MsFlags::empty() };
    mnt(
        None,
        target,
        None,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | ro | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | locked,
        None,
    )
}

pub(super) fn build_root(spec: &SandboxSpec) -> Result<(), SetupError> {
    let root = spec.new_root.as_path();
    // Nothing mounted from here on may propagate back to the host.
    mnt(None, Path::new("/"), None, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None)?;
    // The new root is an empty tmpfs: only what is bound below exists in it, so the
    // runner's state dir, keys and config are absent unless a bound path contains them.
    mnt(None, root, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=0755,size=16m"))?;
    // A private /tmp, mounted before the read-only binds so an extra path under /tmp
    // can still be bound into it.
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).step(format!("creating {}", tmp.display()))?;
    let tmp_opts = format!("mode=1777,size={}m", spec.tmp_size_mib);
    mnt(None, &tmp, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some(&tmp_opts))?;
    for p in DEFAULT_RO_PATHS.iter().map(PathBuf::from).chain(spec.ro_paths.iter().cloned()) {
        bind_ro(root, &p)?;
    }
    // Hidden paths under bound directories (e.g. /etc/byoc-runner) are covered.
    for hidden in &spec.hidden_paths {
        let target = inside(root, hidden);
        match std::fs::symlink_metadata(&target) {
            Ok(m) if m.is_dir() => mnt(
                None,
                &target,
                Some("tmpfs"),
                MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some("mode=000,size=4k"),
            )?,
            Ok(_) => mnt(Some(Path::new("/dev/null")), &target, None, MsFlags::MS_BIND, None)?,
            Err(_) => {}
        }
    }
    // A networked job resolves names through the runner's forwarder in its namespace,
    // whatever the host's resolver is (a link-local one would be blocked).
    if matches!(spec.network, NetworkSpec::UserMode(_)) {
        override_file(root, Path::new("/etc/resolv.conf"), &crate::net::job_resolv_conf())?;
    }
    mount_dev(&root.join("dev"))?;
    // /proc of the new pid namespace: the runner's processes do not appear in it. Not
    // even that where the runner believes a step's output (see `SandboxSpec::proc`).
    let proc_dir = root.join("proc");
    std::fs::create_dir_all(&proc_dir).step(format!("creating {}", proc_dir.display()))?;
    if spec.proc {
        mnt(
            None,
            &proc_dir,
            Some("proc"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            None,
        )?;
    }
    // The job's working directory is, with /tmp, the only writable place.
    let work = inside(root, Path::new(SANDBOX_WORK_DIR));
    std::fs::create_dir_all(&work).step(format!("creating {}", work.display()))?;
    mnt(Some(&spec.work_dir), &work, None, MsFlags::MS_BIND, None)?;
    mnt(
        None,
        &work,
        None,
        MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV
            | locked_flags(&spec.work_dir),
        None,
    )?;
    // The runner's sealed directory: the job reads what init sealed there, never writes.
    if let Some(sealed) = &spec.sealed_dir {
        let target = inside(root, Path::new(SANDBOX_SEALED_DIR));
        std::fs::create_dir_all(&target).step(format!("creating {}", target.display()))?;
        mnt(Some(sealed), &target, None, MsFlags::MS_BIND, None)?;
        remount_read_only(&target, locked_flags(sealed))?;
    }
    // The runner's directories, in order: a later one's mount point inside an earlier
    // (read-only) one exists already, made by the runner.
    for bind in &spec.binds {
        let target = inside(root, &bind.inside);
        if !target.is_dir() {
            std::fs::create_dir_all(&target).step(format!("creating {}", target.display()))?;
        }
        mnt(Some(&bind.host), &target, None, MsFlags::MS_BIND, None)?;
        remount(&target, locked_flags(&bind.host), !bind.writable)?;
    }
    // Switch to the new root and drop every path to the old one.
    let old = root.join(".old");
    std::fs::create_dir_all(&old).step(format!("creating {}", old.display()))?;
    nix::unistd::pivot_root(root, &old).step("pivot_root")?;
    nix::unistd::chdir("/").step("chdir /")?;
    umount2("/.old", MntFlags::MNT_DETACH).step("detaching the old root")?;
    std::fs::remove_dir("/.old").step("removing /.old")?;
    // The root tmpfs itself becomes read-only.
    mnt(
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        None,
    )
}

/// /dev: a tmpfs with the harmless device nodes bound in, the usual links and a
/// private /dev/shm.
fn mount_dev(dev: &Path) -> Result<(), SetupError> {
    std::fs::create_dir_all(dev).step(format!("creating {}", dev.display()))?;
    mnt(None, dev, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, Some("mode=0755,size=64k"))?;
    for node in ["null", "zero", "full", "random", "urandom"] {
        let target = dev.join(node);
        std::fs::write(&target, b"").step(format!("creating {}", target.display()))?;
        mnt(Some(&Path::new("/dev").join(node)), &target, None, MsFlags::MS_BIND, None)?;
    }
    for (link, dest) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let _ = std::os::unix::fs::symlink(dest, dev.join(link));
    }
    let shm = dev.join("shm");
    std::fs::create_dir_all(&shm).step(format!("creating {}", shm.display()))?;
    mnt(
        None,
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=1777,size=64m"),
    )?;
    Ok(())
}

/// Make `path` inside the new root read `content`: bind a file of the root's tmpfs
/// over it where it exists (under a read-only bind), or create it there.
fn override_file(root: &Path, path: &Path, content: &str) -> Result<(), SetupError> {
    let mut target = inside(root, path);
    // /etc/resolv.conf is often a link (to /run/systemd/resolve/…, not in the sandbox).
    for _ in 0..8 {
        match std::fs::read_link(&target) {
            Ok(dest) => {
                let base = target.parent().map(Path::to_path_buf).unwrap_or_else(|| root.to_path_buf());
                let abs = if dest.is_absolute() { inside(root, &dest) } else { base.join(dest) };
                target = abs;
            }
            Err(_) => break,
        }
    }
    if !target.starts_with(root) {
        return Err(SetupError::Refused(format!("{} leads outside the sandbox's root", path.display())));
    }
    let source = root.join(format!(".byoc-{}", path.file_name().and_then(|n| n.to_str()).unwrap_or("file")));
    std::fs::write(&source, content).step(format!("writing {}", source.display()))?;
    if target.exists() {
        mnt(Some(&source), &target, None, MsFlags::MS_BIND, None)?;
        remount_read_only(&target, MsFlags::empty())
    } else {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).step(format!("creating {}", parent.display()))?;
        }
        std::fs::write(&target, content).step(format!("writing {}", target.display()))
    }
}
