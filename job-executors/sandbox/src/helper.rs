//! `byoc-runner sandbox-exec`: builds the job's sandbox and execs the job.
//!
//! Three processes, so that every namespace has an owner outside it and the job's
//! whole tree dies with it:
//!
//! ```text
//! helper (runner's namespaces) ── clone(NEWUSER|NEWNS|NEWPID|NEWIPC|NEWUTS|NEWNET) ──▶ init (pid 1)
//!   writes init's uid/gid maps,                                                  sets the job's routes and rules,
//!   starts the user-mode network stack                                           hands the runner its sockets,
//!   (slirp4netns) for init's namespace,                                          mounts the new root,
//!   relays signals, exits with the job's status                                  forks the job, reaps,
//!                                                                                relays signals, exits
//!                                                                                with the job's status
//! ```
//!
//! When init exits the kernel kills everything left in the pid namespace, so nothing
//! of the job survives it; `PR_SET_PDEATHSIG` ties helper to the runner and init to
//! the helper, so not even a `kill -9` of the runner leaves a job behind.
//!
//! The steps run in this order, and the order matters (each comment says why).

use std::ffi::CString;
use std::io::Read as _;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::CloneFlags;
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, sigprocmask};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Gid, Pid, Uid};

use crate::net::Cidr;
use crate::netlink::Netlink;
use crate::spec::{
    DEFAULT_RO_PATHS, HANDOVER_FD, MAX_SPEC_BYTES, NetworkSpec, SANDBOX_INNER_ID, SANDBOX_WORK_DIR,
    SandboxSpec, UserModeNet, handover,
};
use crate::sys;

/// Exit code when the sandbox could not be built (as container runtimes use).
pub const EXIT_SANDBOX_FAILED: i32 = 125;
/// Exit code when the job's program could not be executed.
pub const EXIT_EXEC_FAILED: i32 = 127;
/// Exit code when the job's network boundary could not be built (nothing ran).
pub const EXIT_NETWORK_FAILED: i32 = 122;
/// Errors that mean the network boundary could not be built start with this.
const NETWORK_FAILED: &str = "network boundary: ";
/// Priority of the `prohibit` rules: ahead of the main table (32766).
const PROHIBIT_PRIORITY: u32 = 100;

const RELAYED: &[Signal] = &[Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP, Signal::SIGQUIT];

pub fn sandbox_exec_main() -> i32 {
    match helper() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sandbox: {e}");
            failure_code(&e)
        }
    }
}

fn failure_code(e: &str) -> i32 {
    if e.starts_with(NETWORK_FAILED) { EXIT_NETWORK_FAILED } else { EXIT_SANDBOX_FAILED }
}

fn helper() -> Result<i32, String> {
    // 1. The spec arrives on stdin; afterwards stdin is /dev/null, so the job can read
    //    nothing the runner wrote.
    let spec = read_spec()?;
    // 2. Die with the runner: a kill -9 of the daemon takes the sandbox with it.
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(|e| format!("PR_SET_PDEATHSIG: {e}"))?;
    if nix::unistd::getppid() == Pid::from_raw(1) {
        return Err("the runner exited before the sandbox started".into());
    }
    // 3. Nothing the runner had open (sockets, journal, keys) may leak in; only the
    //    hand-over channel stays, close-on-exec so the network stack does not get it.
    let user_mode = match &spec.network {
        NetworkSpec::UserMode(net) => Some(net.clone()),
        _ => None,
    };
    let wants_handover = user_mode.as_ref().is_some_and(|n| n.handover);
    sys::close_fds_from(if wants_handover { HANDOVER_FD as u32 + 1 } else { HANDOVER_FD as u32 })
        .map_err(|e| format!("closing inherited descriptors: {e}"))?;
    let mut channel = if wants_handover {
        Some(sys::take_handover_fd(HANDOVER_FD).map_err(|e| format!("the hand-over channel: {e}"))?)
    } else {
        None
    };
    // 4. Join the job's cgroup first, so every process of the job is counted and limited.
    let pid = std::process::id().to_string();
    for procs in &spec.cgroup_procs {
        std::fs::write(procs, &pid).map_err(|e| format!("joining cgroup {}: {e}", procs.display()))?;
    }
    // The ranges the job may never reach, with this host's own addresses, which only
    // the helper (still in the runner's namespace) can list.
    let blocked = match &user_mode {
        Some(net) => Some(blocked_ranges(net)?),
        None => None,
    };
    // 5. Signals are handled synchronously (sigwait) by helper and init; block them
    //    before the clone so none is lost in between. The job unblocks them.
    let mut mask = SigSet::empty();
    for s in RELAYED.iter().chain([&Signal::SIGCHLD]) {
        mask.add(*s);
    }
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&mask), None).map_err(|e| format!("blocking signals: {e}"))?;
    // 6. New namespaces. init waits on the pipe until its id maps exist.
    //    Close-on-exec: the network stack the helper starts must not hold init's pipe.
    let (ready_r, ready_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    let mut flags = CloneFlags::CLONE_NEWUSER
        | CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS;
    if !matches!(spec.network, NetworkSpec::SharedWithHost) {
        flags |= CloneFlags::CLONE_NEWNET;
    }
    let root_mode = nix::unistd::geteuid().is_root();
    let write_end = ready_w.as_raw_fd();
    let child = sys::clone_with(
        flags,
        Box::new(|| {
            sys::close_raw(write_end);
            match init(&spec, &ready_r, root_mode, blocked.as_deref(), channel.take()) {
                Ok(code) => code as isize,
                Err(e) => {
                    eprintln!("sandbox: {e}");
                    failure_code(&e) as isize
                }
            }
        }),
    )
    .map_err(|e| format!("creating namespaces (clone): {e}; are unprivileged user namespaces allowed?"))?;
    drop(ready_r);
    // init has its own copy of the hand-over channel; ours would only keep the runner
    // from seeing it close should init fail before sending.
    drop(channel.take());
    // 7. Map ids: as root, inner 0 (setup only) and inner 1000 → the unprivileged host
    //    uid the job runs as; otherwise the only possible map, inner 0 → our own uid.
    if let Err(e) = write_id_maps(child, root_mode, &spec) {
        let _ = kill(child, Signal::SIGKILL);
        return Err(e);
    }
    // init builds the job's root while the network comes up (the stack takes a few
    // milliseconds to start): release it now, and again once the network is up.
    nix::unistd::write(&ready_w, b"1").map_err(|e| format!("releasing the sandbox init: {e}"))?;
    // 7b. The job's way out: the user-mode stack joins init's namespaces and brings up
    //     its interface. It lives as long as this helper (its exit descriptor closes
    //     when we exit) and sits in the job's cgroup.
    let _stack = match &user_mode {
        Some(net) => match start_user_mode_stack(child, net) {
            Ok(stack) => {
                nix::unistd::write(&ready_w, b"2").map_err(|e| format!("releasing the sandbox init: {e}"))?;
                Some(stack)
            }
            Err(e) => {
                let _ = kill(child, Signal::SIGKILL);
                return Err(format!("{NETWORK_FAILED}{e}"));
            }
        },
        None => None,
    };
    drop(ready_w);
    // 8. Relay stop signals to init and exit with its status.
    supervise(child, &mask, |sig| {
        let _ = kill(child, sig);
    })
}

fn read_spec() -> Result<SandboxSpec, String> {
    let mut buf = Vec::new();
    std::io::stdin()
        .take(MAX_SPEC_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| format!("reading the sandbox spec: {e}"))?;
    if buf.len() as u64 > MAX_SPEC_BYTES {
        return Err("sandbox spec too large".into());
    }
    let spec: SandboxSpec = serde_json::from_slice(&buf).map_err(|e| format!("sandbox spec: {e}"))?;
    let null = std::fs::File::open("/dev/null").map_err(|e| format!("opening /dev/null: {e}"))?;
    nix::unistd::dup2_stdin(&null).map_err(|e| format!("redirecting stdin: {e}"))?;
    if spec.argv.is_empty() || !spec.argv[0].starts_with('/') {
        return Err("sandbox spec: argv[0] must be an absolute path".into());
    }
    Ok(spec)
}

fn write_id_maps(child: Pid, root_mode: bool, spec: &SandboxSpec) -> Result<(), String> {
    let proc_dir = PathBuf::from(format!("/proc/{child}"));
    let write = |file: &str, text: String| {
        std::fs::write(proc_dir.join(file), &text)
            .map_err(|e| format!("writing {file} ({}): {e}", text.trim()))
    };
    if root_mode {
        write("uid_map", format!("0 0 1\n{SANDBOX_INNER_ID} {} 1\n", spec.host_uid))?;
        write("gid_map", format!("0 0 1\n{SANDBOX_INNER_ID} {} 1\n", spec.host_gid))?;
    } else {
        write("setgroups", "deny".into())?;
        write("uid_map", format!("0 {} 1\n", nix::unistd::geteuid()))?;
        write("gid_map", format!("0 {} 1\n", nix::unistd::getegid()))?;
    }
    Ok(())
}

/// Wait for `child`, calling `relay` for each stop signal; return its exit status
/// (128 + signal when it was killed, as a shell reports it).
fn supervise(child: Pid, mask: &SigSet, mut relay: impl FnMut(Signal)) -> Result<i32, String> {
    loop {
        let sig = mask.wait().map_err(|e| format!("waiting for signals: {e}"))?;
        if sig != Signal::SIGCHLD {
            relay(sig);
            continue;
        }
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) if pid == child => return Ok(code),
                Ok(WaitStatus::Signaled(pid, sig, _)) if pid == child => return Ok(128 + sig as i32),
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => continue,
            }
        }
    }
}

/// pid 1 of the sandbox.
fn init(
    spec: &SandboxSpec,
    ready: &OwnedFd,
    root_mode: bool,
    blocked: Option<&[Cidr]>,
    channel: Option<OwnedFd>,
) -> Result<i32, String> {
    // If the helper dies, init dies, and with it the whole pid namespace.
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(|e| format!("PR_SET_PDEATHSIG: {e}"))?;
    let mut b = [0u8; 1];
    match nix::unistd::read(ready, &mut b) {
        Ok(1) => {}
        _ => return Err("the helper did not map our ids".into()),
    }
    // The root first: it does not need the network, which the helper is bringing up
    // meanwhile.
    build_root(spec)?;
    // The network boundary is complete before anything of the job exists: routes and
    // rules are set by init, which still holds capabilities in the job's namespaces;
    // the job holds none and cannot change them.
    match &spec.network {
        NetworkSpec::UserMode(net) => {
            match nix::unistd::read(ready, &mut b) {
                Ok(1) if b[0] == b'2' => {}
                _ => return Err(format!("{NETWORK_FAILED}the user-mode network stack did not come up")),
            }
            configure_user_mode(net, blocked.unwrap_or_default())
                .map_err(|e| format!("{NETWORK_FAILED}{e}"))?;
            if let Some(channel) = channel {
                hand_over(net, channel).map_err(|e| format!("{NETWORK_FAILED}{e}"))?;
            }
        }
        NetworkSpec::Off => {
            // Loopback up, so the job's own local services work; nothing else exists.
            Netlink::open().and_then(|mut nl| nl.link_up(1)).map_err(|e| e.to_string())?;
        }
        NetworkSpec::SharedWithHost => {}
    }
    nix::unistd::sethostname(&spec.hostname).map_err(|e| format!("sethostname: {e}"))?;
    // Everything the job needs is prepared before the fork, so the job's own steps
    // are only restrictions.
    let filters = crate::seccomp::job_filters().map_err(|e| e.to_string())?;
    let argv: Vec<CString> = spec.argv.iter().map(|a| cstring(a)).collect::<Result<_, _>>()?;
    let env: Vec<CString> =
        spec.env.iter().map(|(k, v)| cstring(&format!("{k}={v}"))).collect::<Result<_, _>>()?;
    let job = match sys::fork().map_err(|e| format!("fork: {e}"))? {
        sys::Forked::Child => {
            let e = exec_job(spec, root_mode, &filters, &argv, &env);
            eprintln!("sandbox: {e}");
            sys::exit_now(if e.starts_with("exec") { EXIT_EXEC_FAILED } else { EXIT_SANDBOX_FAILED });
        }
        sys::Forked::Parent(pid) => pid,
    };
    let mut mask = SigSet::empty();
    for s in RELAYED.iter().chain([&Signal::SIGCHLD]) {
        mask.add(*s);
    }
    // pid 1 reaps every orphan in the namespace; the job's status is the sandbox's.
    supervise(job, &mask, |sig| {
        // -1 from pid 1: every process in the namespace but init itself.
        let _ = kill(Pid::from_raw(-1), sig);
    })
}

fn cstring(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{s:?} contains a NUL byte"))
}

/// Mount flags of `path`'s mount that a less privileged mount namespace may not clear
/// (the kernel locks them); a read-only remount must repeat them.
fn locked_flags(path: &Path) -> MsFlags {
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
) -> Result<(), String> {
    mount(src, target, fstype, flags, data).map_err(|e| {
        format!(
            "mount {} on {}: {e}",
            src.map(|s| s.display().to_string()).unwrap_or_else(|| fstype.unwrap_or("").into()),
            target.display()
        )
    })
}

/// Bind `host` read-only at the same path under `root`.
fn bind_ro(root: &Path, host: &Path) -> Result<(), String> {
    let Ok(meta) = std::fs::symlink_metadata(host) else { return Ok(()) };
    let target = inside(root, host);
    if meta.file_type().is_symlink() {
        // Merged-/usr systems: /bin -> usr/bin. Recreate the link, bind nothing.
        let dest = std::fs::read_link(host).map_err(|e| format!("reading link {}: {e}", host.display()))?;
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
        }
        return match std::os::unix::fs::symlink(&dest, &target) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(format!("linking {}: {e}", target.display())),
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
    mnt(
        None,
        &target,
        None,
        MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV
            | locked_flags(host),
        None,
    )
}

fn build_root(spec: &SandboxSpec) -> Result<(), String> {
    let root = spec.new_root.as_path();
    // Nothing mounted from here on may propagate back to the host.
    mnt(None, Path::new("/"), None, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None)?;
    // The new root is an empty tmpfs: only what is bound below exists in it, so the
    // runner's state dir, keys and config are absent unless a bound path contains them.
    mnt(None, root, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=0755,size=16m"))?;
    // A private /tmp, mounted before the read-only binds so an extra path under /tmp
    // can still be bound into it.
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
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
    // /dev: a tmpfs with the harmless device nodes bound in.
    let dev = root.join("dev");
    std::fs::create_dir_all(&dev).map_err(|e| format!("creating {}: {e}", dev.display()))?;
    mnt(None, &dev, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, Some("mode=0755,size=64k"))?;
    for node in ["null", "zero", "full", "random", "urandom"] {
        let target = dev.join(node);
        std::fs::write(&target, b"").map_err(|e| format!("creating {}: {e}", target.display()))?;
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
    std::fs::create_dir_all(&shm).map_err(|e| format!("creating {}: {e}", shm.display()))?;
    mnt(
        None,
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=1777,size=64m"),
    )?;
    // /proc of the new pid namespace: the runner's processes do not appear in it.
    let proc_dir = root.join("proc");
    std::fs::create_dir_all(&proc_dir).map_err(|e| format!("creating {}: {e}", proc_dir.display()))?;
    mnt(None, &proc_dir, Some("proc"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC, None)?;
    // The job's working directory is, with /tmp, the only writable place.
    let work = inside(root, Path::new(SANDBOX_WORK_DIR));
    std::fs::create_dir_all(&work).map_err(|e| format!("creating {}: {e}", work.display()))?;
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
    // Switch to the new root and drop every path to the old one.
    let old = root.join(".old");
    std::fs::create_dir_all(&old).map_err(|e| format!("creating {}: {e}", old.display()))?;
    nix::unistd::pivot_root(root, &old).map_err(|e| format!("pivot_root: {e}"))?;
    nix::unistd::chdir("/").map_err(|e| format!("chdir /: {e}"))?;
    umount2("/.old", MntFlags::MNT_DETACH).map_err(|e| format!("detaching the old root: {e}"))?;
    std::fs::remove_dir("/.old").map_err(|e| format!("removing /.old: {e}"))?;
    // The root tmpfs itself becomes read-only.
    mnt(
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        None,
    )
}

/// In the job process: restrictions only, then exec. Returns only on failure.
fn exec_job(
    spec: &SandboxSpec,
    root_mode: bool,
    filters: &[seccompiler::BpfProgram],
    argv: &[CString],
    env: &[CString],
) -> String {
    let step = || -> Result<(), String> {
        // Signals back to normal for the job (the helper and init block them).
        sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)
            .map_err(|e| format!("signal mask: {e}"))?;
        nix::unistd::chdir(SANDBOX_WORK_DIR).map_err(|e| format!("chdir {SANDBOX_WORK_DIR}: {e}"))?;
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| format!("getrlimit: {e}"))?;
        let nofile = spec.nofile.min(hard);
        setrlimit(Resource::RLIMIT_NOFILE, nofile, nofile).map_err(|e| format!("RLIMIT_NOFILE: {e}"))?;
        setrlimit(Resource::RLIMIT_CORE, 0, 0).map_err(|e| format!("RLIMIT_CORE: {e}"))?;
        // Capabilities: none now, none by exec as (inner) root, none by ambient raise.
        caps::clear(None, caps::CapSet::Ambient).map_err(|e| format!("clearing ambient caps: {e}"))?;
        caps::clear(None, caps::CapSet::Inheritable)
            .map_err(|e| format!("clearing inheritable caps: {e}"))?;
        for cap in caps::all() {
            caps::drop(None, caps::CapSet::Bounding, cap)
                .map_err(|e| format!("dropping {cap} from the bounding set: {e}"))?;
        }
        sys::lock_securebits().map_err(|e| format!("securebits: {e}"))?;
        if root_mode {
            // A distinct unprivileged uid: inner 1000 is the host's `host_uid`.
            let id = SANDBOX_INNER_ID;
            nix::unistd::setgroups(&[]).map_err(|e| format!("setgroups: {e}"))?;
            nix::unistd::setresgid(Gid::from_raw(id), Gid::from_raw(id), Gid::from_raw(id))
                .map_err(|e| format!("setresgid: {e}"))?;
            nix::unistd::setresuid(Uid::from_raw(id), Uid::from_raw(id), Uid::from_raw(id))
                .map_err(|e| format!("setresuid: {e}"))?;
        }
        caps::clear(None, caps::CapSet::Effective).map_err(|e| format!("clearing effective caps: {e}"))?;
        caps::clear(None, caps::CapSet::Permitted).map_err(|e| format!("clearing permitted caps: {e}"))?;
        nix::sys::prctl::set_no_new_privs().map_err(|e| format!("no_new_privs: {e}"))?;
        landlock_rules()?;
        // Last: after it, the calls above would be refused.
        crate::seccomp::apply(filters).map_err(|e| e.to_string())?;
        Ok(())
    };
    if let Err(e) = step() {
        return e;
    }
    match nix::unistd::execve(&argv[0], argv, env) {
        Err(e) => format!("exec {}: {e}", argv[0].to_string_lossy()),
        Ok(never) => match never {},
    }
}

/// Landlock (where the kernel has it): read and execute anywhere in the sandbox's
/// root, write only in the working directory, /tmp and /dev/shm (and to /dev/null).
fn landlock_rules() -> Result<(), String> {
    use landlock::{ABI, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, path_beneath_rules};
    let abi = ABI::V5;
    let err = |e: &dyn std::fmt::Display| format!("landlock: {e}");
    Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .map_err(|e| err(&e))?
        .create()
        .map_err(|e| err(&e))?
        .add_rules(path_beneath_rules(["/"], AccessFs::from_read(abi)))
        .map_err(|e| err(&e))?
        .add_rules(path_beneath_rules([SANDBOX_WORK_DIR, "/tmp", "/dev/shm"], AccessFs::from_all(abi)))
        .map_err(|e| err(&e))?
        .add_rules(path_beneath_rules(["/dev/null", "/dev/zero", "/dev/full"], AccessFs::from_all(abi)))
        .map_err(|e| err(&e))?
        .restrict_self()
        .map_err(|e| err(&e))?;
    Ok(())
}

/// This job's blocked ranges: the fixed list, the customer's, the host's own addresses.
fn blocked_ranges(net: &UserModeNet) -> Result<Vec<Cidr>, String> {
    let mut all = crate::net::always_blocked();
    all.extend(net.blocked.iter().copied());
    all.extend(crate::net::host_addresses().map_err(|e| format!("{NETWORK_FAILED}{e}"))?);
    all.sort();
    all.dedup();
    Ok(all)
}

/// The running user-mode stack; dropping it closes its exit descriptor, and it exits.
struct UserModeStack {
    _exit: OwnedFd,
}

/// Start slirp4netns for `child`'s namespaces and wait until its interface is up.
fn start_user_mode_stack(child: Pid, net: &UserModeNet) -> Result<UserModeStack, String> {
    use nix::fcntl::{FcntlArg, FdFlag, OFlag, fcntl};
    use std::os::fd::AsFd as _;
    let (ready_r, ready_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    let (exit_r, exit_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    // Only these two ends are the stack's to inherit.
    for fd in [&ready_w, &exit_r] {
        fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty())).map_err(|e| format!("fcntl: {e}"))?;
    }
    // Its messages go to memory, shown only if it fails: never into the job's log.
    let log = nix::sys::memfd::memfd_create(c"slirp4netns", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .map_err(|e| format!("memfd_create: {e}"))?;
    let log_for_child = log.try_clone().map_err(|e| format!("dup: {e}"))?;
    let mut cmd = std::process::Command::new(&net.slirp4netns);
    cmd.env_clear()
        .args([
            "--configure",
            "--disable-host-loopback",
            "--disable-dns",
            "--enable-sandbox",
            "--enable-seccomp",
        ])
        .arg(format!("--mtu={}", net.mtu))
        .arg(format!("--ready-fd={}", ready_w.as_raw_fd()))
        .arg(format!("--exit-fd={}", exit_r.as_raw_fd()));
    if net.ipv6 {
        cmd.arg("--enable-ipv6");
    }
    cmd.arg(child.as_raw().to_string())
        .arg(crate::net::TAP_NAME)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::from(log_for_child));
    // The child is reaped by the helper's waitpid loop; the handle is not needed.
    let spawned = cmd.spawn().map_err(|e| format!("starting {}: {e}", net.slirp4netns.display()));
    drop(ready_w);
    drop(exit_r);
    spawned?;
    let mut fds = [nix::poll::PollFd::new(ready_r.as_fd(), nix::poll::PollFlags::POLLIN)];
    let timeout = nix::poll::PollTimeout::try_from(net.ready_timeout_ms.min(60_000) as i32)
        .unwrap_or(nix::poll::PollTimeout::MAX);
    let failed = |why: String| {
        let said = stack_messages(&log);
        if said.is_empty() { why } else { format!("{why}: {said}") }
    };
    match nix::poll::poll(&mut fds, timeout) {
        Ok(0) => {
            return Err(failed(format!(
                "{} did not bring the job's network up within {} ms",
                net.slirp4netns.display(),
                net.ready_timeout_ms
            )));
        }
        Ok(_) => {}
        Err(e) => return Err(format!("waiting for {}: {e}", net.slirp4netns.display())),
    }
    let mut b = [0u8; 1];
    match nix::unistd::read(&ready_r, &mut b) {
        Ok(1) if b[0] == b'1' => Ok(UserModeStack { _exit: exit_w }),
        _ => Err(failed(format!("{} exited before the job's network was up", net.slirp4netns.display()))),
    }
}

/// What the stack printed (its last lines), for an error message.
fn stack_messages(log: &OwnedFd) -> String {
    let mut text = String::new();
    let _ = nix::unistd::lseek(log, 0, nix::unistd::Whence::SeekSet);
    let mut file = std::fs::File::from(match log.try_clone() {
        Ok(fd) => fd,
        Err(_) => return text,
    });
    let _ = (&mut file).take(4096).read_to_string(&mut text);
    text.lines()
        .filter(|l| !l.starts_with("WARNING: Support for") && !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// In init, inside the job's namespaces: IPv6, the blocked ranges, the allow-list.
fn configure_user_mode(net: &UserModeNet, blocked: &[Cidr]) -> Result<(), String> {
    use crate::net::{GATEWAY_IPV4, GATEWAY_IPV6, JOB_IPV6};
    use std::net::IpAddr;
    let mut nl = Netlink::open().map_err(|e| e.to_string())?;
    let tap = nix::net::if_::if_nametoindex(crate::net::TAP_NAME)
        .map_err(|e| format!("the job's interface {}: {e}", crate::net::TAP_NAME))?;
    nl.link_up(1).map_err(|e| e.to_string())?;
    if net.ipv6 {
        nl.add_address(tap, IpAddr::V6(JOB_IPV6), 64).map_err(|e| e.to_string())?;
        // With an allow-list only the allowed ranges are routed, below.
        if net.allow.is_none() {
            let default =
                Cidr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), 0).ok_or("the IPv6 default range")?;
            nl.add_route_via(default, IpAddr::V6(GATEWAY_IPV6), tap).map_err(|e| e.to_string())?;
        }
    }
    if let Some(allow) = &net.allow {
        // The stack's --configure added the IPv4 default route: it must go.
        nl.delete_default_route(false).map_err(|e| e.to_string())?;
        for range in allow {
            if !range.is_ipv4() && !net.ipv6 {
                continue;
            }
            let gateway = if range.is_ipv4() { IpAddr::V4(GATEWAY_IPV4) } else { IpAddr::V6(GATEWAY_IPV6) };
            match nl.add_route_via(*range, gateway, tap) {
                Err(e) if e.errno() != Some(nix::Error::EEXIST) => return Err(e.to_string()),
                _ => {}
            }
        }
    }
    // Last, so that no route above is looked up against them; they come first in
    // every lookup from now on.
    for range in blocked {
        match nl.prohibit(*range, PROHIBIT_PRIORITY) {
            Err(e) if e.errno() != Some(nix::Error::EEXIST) => return Err(e.to_string()),
            _ => {}
        }
    }
    Ok(())
}

/// In init: make the sockets the runner serves inside the job's namespace and send
/// them over the hand-over channel; the job never holds any of them.
fn hand_over(net: &UserModeNet, channel: OwnedFd) -> Result<(), String> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    use std::os::fd::AsRawFd as _;
    let dns = crate::net::JOB_DNS;
    let udp =
        std::net::UdpSocket::bind(dns).map_err(|e| format!("binding the DNS forwarder's {dns}/udp: {e}"))?;
    let tcp = std::net::TcpListener::bind(dns)
        .map_err(|e| format!("binding the DNS forwarder's {dns}/tcp: {e}"))?;
    let nl = Netlink::open().map_err(|e| e.to_string())?;
    let mut names = vec![handover::DNS_UDP, handover::DNS_TCP, handover::NETLINK];
    let mut fds = vec![udp.as_raw_fd(), tcp.as_raw_fd(), nl.fd().as_raw_fd()];
    let creds = if net.credentials {
        let addr = crate::net::JOB_CREDENTIALS;
        let l = std::net::TcpListener::bind(addr)
            .map_err(|e| format!("binding the credential endpoint {addr}: {e}"))?;
        names.push(handover::CREDENTIALS);
        fds.push(l.as_raw_fd());
        Some(l)
    } else {
        None
    };
    // The job's interface travels too: routes for allowed names go through it.
    let tap = nix::net::if_::if_nametoindex(crate::net::TAP_NAME)
        .map_err(|e| format!("the job's interface {}: {e}", crate::net::TAP_NAME))?;
    let text = format!("{};tap={tap}", names.join(","));
    let iov = [std::io::IoSlice::new(text.as_bytes())];
    sendmsg::<()>(
        channel.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(|e| format!("handing the job's sockets to the runner: {e}"))?;
    drop((udp, tcp, nl, creds, channel));
    Ok(())
}

/// Make `path` inside the new root read `content`: bind a file of the root's tmpfs
/// over it where it exists (under a read-only bind), or create it there.
fn override_file(root: &Path, path: &Path, content: &str) -> Result<(), String> {
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
        return Err(format!("{} leads outside the sandbox's root", path.display()));
    }
    let source = root.join(format!(".byoc-{}", path.file_name().and_then(|n| n.to_str()).unwrap_or("file")));
    std::fs::write(&source, content).map_err(|e| format!("writing {}: {e}", source.display()))?;
    if target.exists() {
        mnt(Some(&source), &target, None, MsFlags::MS_BIND, None)?;
        mnt(
            None,
            &target,
            None,
            MsFlags::MS_BIND
                | MsFlags::MS_REMOUNT
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV,
            None,
        )
    } else {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
        }
        std::fs::write(&target, content).map_err(|e| format!("writing {}: {e}", target.display()))
    }
}
