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
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::path::PathBuf;

use nix::sched::CloneFlags;
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, sigprocmask};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Gid, Pid, Uid};

mod error;
mod net;
mod root;

pub use self::error::SetupError;
use self::error::StepExt as _;
use self::net::{blocked_ranges, configure_user_mode, hand_over, start_user_mode_stack};
use self::root::build_root;
use crate::net::Cidr;
use crate::netlink::Netlink;
use crate::spec::{
    GATE_FD, HANDOVER_FD, LEASE_FD, MAX_SPEC_BYTES, NetworkSpec, SANDBOX_INNER_ID, SANDBOX_SEALED_DIR,
    SANDBOX_WORK_DIR, SandboxSpec,
};
use crate::sys;

/// Exit code when the sandbox could not be built (as container runtimes use).
pub const EXIT_SANDBOX_FAILED: i32 = 125;
/// Exit code when the job's program could not be executed.
pub const EXIT_EXEC_FAILED: i32 = 127;
/// Exit code when the job's network boundary could not be built (nothing ran).
pub const EXIT_NETWORK_FAILED: i32 = 122;
/// Exit code when the runner did not open a gated stage's gate (it never ran).
pub const EXIT_GATE_CLOSED: i32 = 123;
/// Exit code when a file a stage seals is not a regular file (that stage never ran).
pub const EXIT_SEAL_REFUSED: i32 = 124;
/// Exit code when the job's lease ran out and the helper stopped it (see
/// [`crate::lease`]).
pub const EXIT_LEASE_EXPIRED: i32 = 121;

const RELAYED: &[Signal] = &[Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP, Signal::SIGQUIT];

pub fn sandbox_exec_main() -> i32 {
    match helper() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sandbox: {e}");
            e.exit_code()
        }
    }
}

fn helper() -> Result<i32, SetupError> {
    // 1. The spec arrives on stdin; afterwards stdin is /dev/null, so the job can read
    //    nothing the runner wrote.
    let spec = read_spec()?;
    // 2. Die with the runner: a kill -9 of the daemon takes the sandbox with it.
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).step("PR_SET_PDEATHSIG")?;
    if nix::unistd::getppid() == Pid::from_raw(1) {
        return Err(SetupError::Refused("the runner exited before the sandbox started".into()));
    }
    // 3. Nothing the runner had open (sockets, journal, keys) may leak in; only the
    //    hand-over channel stays, close-on-exec so the network stack does not get it.
    let user_mode = match &spec.network {
        NetworkSpec::UserMode(net) => Some(net.clone()),
        _ => None,
    };
    let (gate, mut channel, lease) = keep_only_channels(
        spec.then.iter().any(|s| s.gate),
        user_mode.as_ref().is_some_and(|n| n.handover),
        spec.lease.is_some(),
    )?;
    let mut lease = lease
        .zip(spec.lease)
        .map(|(pipe, l)| crate::lease::LeaseWatch::new(pipe, std::time::Duration::from_millis(l.grace_ms)));
    // 4. Every process of the job is counted and limited. On cgroup v2 init and the
    //    network stack are born in the job's cgroup (6, 7b) and the helper stays out;
    //    otherwise the helper joins first and they follow.
    let born_in = match &spec.cgroup_born_in {
        Some(dir) => Some(open_cgroup(dir)?),
        None => {
            join_cgroups(&spec.cgroup_procs)?;
            None
        }
    };
    // The ranges the job may never reach, with this host's own addresses, which only
    // the helper (still in the runner's namespace) can list.
    let blocked = match &user_mode {
        Some(net) => Some(blocked_ranges(net)?),
        None => None,
    };
    // 5. Signals are handled synchronously (sigwait) by helper and init; block them
    //    before the clone so none is lost in between. The job unblocks them.
    let mask = block_signals()?;
    // 6. New namespaces. init waits on the pipe until its id maps exist.
    //    Close-on-exec: the network stack the helper starts must not hold init's pipe.
    let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).step("pipe")?;
    let flags = namespaces(&spec.network);
    let root_mode = nix::unistd::geteuid().is_root();
    let write_end = ready_w.as_raw_fd();
    let lease_pipe = lease.as_ref().and_then(|l| l.pipe()).map(|p| p.as_raw_fd());
    let mut run_init = || {
        sys::close_raw(write_end);
        // The lease is the helper's to keep; init runs the job.
        if let Some(fd) = lease_pipe {
            sys::close_raw(fd);
        }
        match init(&spec, &ready_r, root_mode, blocked.as_deref(), channel.take(), gate.as_ref()) {
            Ok(code) => code as isize,
            Err(e) => {
                eprintln!("sandbox: {e}");
                e.exit_code() as isize
            }
        }
    };
    let cloned = match &born_in {
        Some(cgroup) => match sys::clone_into_cgroup(flags, cgroup.as_fd()) {
            Ok(sys::Forked::Child) => sys::exit_now(run_init() as i32),
            Ok(sys::Forked::Parent(pid)) => Ok((pid, true)),
            // A kernel (or a filter above the runner) without `clone3` or
            // CLONE_INTO_CGROUP: the helper joins first, as on v1. Same isolation.
            Err(nix::errno::Errno::ENOSYS | nix::errno::Errno::E2BIG | nix::errno::Errno::EINVAL) => {
                join_cgroups(&spec.cgroup_procs)?;
                sys::clone_with(flags, Box::new(&mut run_init)).map(|pid| (pid, false))
            }
            Err(e) => Err(e),
        },
        None => sys::clone_with(flags, Box::new(&mut run_init)).map(|pid| (pid, false)),
    };
    let (child, born) =
        cloned.step("creating namespaces (clone; are unprivileged user namespaces allowed?)")?;
    drop(ready_r);
    // init has its own copy of the hand-over channel; ours would only keep the runner
    // from seeing it close should init fail before sending.
    drop(channel.take());
    // Likewise the gate: once init is gone the runner must see it closed.
    drop(gate);
    // 7. Map ids: as root, inner 0 (setup only) and inner 1000 → the unprivileged host
    //    uid the job runs as; otherwise the only possible map, inner 0 → our own uid.
    if let Err(e) = write_id_maps(child, root_mode, &spec) {
        let _ = kill(child, Signal::SIGKILL);
        return Err(e);
    }
    // init builds the job's root while the network comes up (the stack takes a few
    // milliseconds to start): release it now, and again once the network is up.
    nix::unistd::write(&ready_w, b"1").step("releasing the sandbox init")?;
    // 7b. The job's way out: the user-mode stack joins init's namespaces and brings up
    //     its interface. It lives as long as this helper (its exit descriptor closes
    //     when we exit) and sits in the job's cgroup: born there beside init, or
    //     there with the helper that joined.
    let stack_cgroup = born_in.as_ref().filter(|_| born).map(|fd| fd.as_fd());
    let _stack = match &user_mode {
        Some(net) => Some(network_up(child, net, stack_cgroup, &ready_w)?),
        None => None,
    };
    drop(ready_w);
    // 8. Relay stop signals to init and exit with its status; with a lease, stop the
    //    job when it runs out.
    match lease.as_mut() {
        Some(lease) => supervise_leased(child, &mask, lease),
        None => supervise(child, &mask, |sig| {
            let _ = kill(child, sig);
        }),
    }
}

/// The job's new namespaces: user, mount, pid, IPC, UTS, and network unless it shares
/// the host's (never asked for by the runner: the benchmark of what the boundary costs).
fn namespaces(network: &NetworkSpec) -> CloneFlags {
    let mut flags = CloneFlags::CLONE_NEWUSER
        | CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS;
    if !matches!(network, NetworkSpec::SharedWithHost) {
        flags |= CloneFlags::CLONE_NEWNET;
    }
    flags
}

type Channels = (Option<OwnedFd>, Option<OwnedFd>, Option<OwnedFd>);

/// Close every descriptor the runner left open but the channels this sandbox uses:
/// the gate (a gated stage), the hand-over (the runner's services in the job's
/// namespace) and the lease pipe, returned in that order.
fn keep_only_channels(gated: bool, wants_handover: bool, leased: bool) -> Result<Channels, SetupError> {
    let wanted = [(HANDOVER_FD, wants_handover), (GATE_FD, gated), (LEASE_FD, leased)];
    let keep_up_to = wanted.iter().filter(|(_, w)| *w).map(|(fd, _)| *fd).max().unwrap_or(HANDOVER_FD - 1);
    sys::close_fds_from(keep_up_to as u32 + 1).step("closing inherited descriptors")?;
    for (fd, _) in wanted.iter().filter(|(fd, w)| !w && *fd < keep_up_to) {
        sys::close_raw(*fd);
    }
    let gate = if gated { Some(sys::take_handover_fd(GATE_FD).step("the gate channel")?) } else { None };
    let channel = if wants_handover {
        Some(sys::take_handover_fd(HANDOVER_FD).step("the hand-over channel")?)
    } else {
        None
    };
    let lease = if leased { Some(sys::take_pipe_fd(LEASE_FD).step("the lease pipe")?) } else { None };
    Ok((gate, channel, lease))
}

/// The stop signals and SIGCHLD, blocked: the helper and init take them with sigwait.
fn block_signals() -> Result<SigSet, SetupError> {
    let mut mask = SigSet::empty();
    for s in RELAYED.iter().chain([&Signal::SIGCHLD]) {
        mask.add(*s);
    }
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&mask), None).step("blocking signals")?;
    Ok(mask)
}

/// The user-mode stack in init's namespaces, then init released; init is killed if the
/// stack cannot start.
fn network_up(
    child: Pid,
    net: &crate::spec::UserModeNet,
    cgroup: Option<std::os::fd::BorrowedFd<'_>>,
    ready: &OwnedFd,
) -> Result<net::UserModeStack, SetupError> {
    match start_user_mode_stack(child, net, cgroup) {
        Ok(stack) => {
            nix::unistd::write(ready, b"2").step("releasing the sandbox init")?;
            Ok(stack)
        }
        Err(e) => {
            let _ = kill(child, Signal::SIGKILL);
            Err(SetupError::Network(Box::new(e)))
        }
    }
}

/// Move this process into each cgroup. On a v1 hierarchy a single-threaded process
/// writes `0` to `tasks`, moving its only thread: the kernel then skips the global
/// thread-group lock whose write side waits for an RCU grace period (about 11 ms on
/// the build machines, for every sandbox). Otherwise its pid goes to `cgroup.procs`.
fn join_cgroups(procs_files: &[PathBuf]) -> Result<(), SetupError> {
    let single_threaded = std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.split_whitespace().eq(["Threads:", "1"])));
    let pid = std::process::id().to_string();
    for procs in procs_files {
        let tasks = procs.with_file_name("tasks");
        if single_threaded && tasks.exists() {
            std::fs::write(&tasks, "0").step(format!("joining cgroup {}", tasks.display()))?;
        } else {
            std::fs::write(procs, &pid).step(format!("joining cgroup {}", procs.display()))?;
        }
    }
    Ok(())
}

/// The job's cgroup v2 directory, for `CLONE_INTO_CGROUP`.
fn open_cgroup(dir: &std::path::Path) -> Result<OwnedFd, SetupError> {
    use nix::fcntl::OFlag;
    let fd = nix::fcntl::open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .step(format!("opening cgroup {}", dir.display()))?;
    Ok(fd)
}

fn read_spec() -> Result<SandboxSpec, SetupError> {
    let mut buf = Vec::new();
    std::io::stdin().take(MAX_SPEC_BYTES + 1).read_to_end(&mut buf).step("reading the sandbox spec")?;
    if buf.len() as u64 > MAX_SPEC_BYTES {
        return Err(SetupError::Refused("sandbox spec too large".into()));
    }
    let spec: SandboxSpec = serde_json::from_slice(&buf).step("sandbox spec")?;
    let null = std::fs::File::open("/dev/null").step("opening /dev/null")?;
    nix::unistd::dup2_stdin(&null).step("redirecting stdin")?;
    check_spec(&spec)?;
    Ok(spec)
}

/// What the helper refuses to build from: a program not named by absolute path, a
/// sealed file that is not a plain path under the working directory (or no sealed
/// directory to put it in).
fn check_spec(spec: &SandboxSpec) -> Result<(), SetupError> {
    let programs = std::iter::once(&spec.argv).chain(spec.then.iter().map(|s| &s.argv));
    if programs.into_iter().any(|argv| argv.first().is_none_or(|p| !p.starts_with('/'))) {
        return Err(SetupError::Refused("sandbox spec: argv[0] must be an absolute path".into()));
    }
    check_binds(spec)?;
    for file in spec.then.iter().flat_map(|s| &s.seal) {
        if spec.sealed_dir.is_none() {
            return Err(SetupError::Refused(
                "sandbox spec: a stage seals files but no sealed_dir is given".into(),
            ));
        }
        let under_work = file.strip_prefix(SANDBOX_WORK_DIR).is_ok_and(|rel| {
            rel.components().count() > 0
                && rel.components().all(|c| matches!(c, std::path::Component::Normal(_)))
        });
        if !under_work {
            return Err(SetupError::Refused(format!(
                "sandbox spec: sealed file {} is not a plain path under {SANDBOX_WORK_DIR}",
                file.display()
            )));
        }
    }
    Ok(())
}

/// Where the runner's binds may go: an absolute plain path that is none of the places
/// the sandbox makes itself (nor inside one); each frozen path a writable bind.
fn check_binds(spec: &SandboxSpec) -> Result<(), SetupError> {
    let reserved = [SANDBOX_WORK_DIR, SANDBOX_SEALED_DIR, "/proc", "/dev", "/tmp"];
    for bind in &spec.binds {
        let mut parts = bind.inside.components();
        let plain = parts.next() == Some(std::path::Component::RootDir)
            && parts.clone().count() > 0
            && parts.all(|c| matches!(c, std::path::Component::Normal(_)));
        let taken = reserved.iter().any(|r| bind.inside.starts_with(r));
        if !plain || taken || !bind.host.is_absolute() {
            return Err(SetupError::Refused(format!(
                "sandbox spec: bind {} at {} is not an absolute plain path of its own",
                bind.host.display(),
                bind.inside.display()
            )));
        }
    }
    for path in spec.then.iter().flat_map(|s| &s.freeze) {
        if !spec.binds.iter().any(|b| b.writable && &b.inside == path) {
            return Err(SetupError::Refused(format!(
                "sandbox spec: {} is frozen but is no writable bind",
                path.display()
            )));
        }
    }
    Ok(())
}

fn write_id_maps(child: Pid, root_mode: bool, spec: &SandboxSpec) -> Result<(), SetupError> {
    let proc_dir = PathBuf::from(format!("/proc/{child}"));
    let write = |file: &str, text: String| {
        std::fs::write(proc_dir.join(file), &text).step(format!("writing {file} ({})", text.trim()))
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
fn supervise(child: Pid, mask: &SigSet, mut relay: impl FnMut(Signal)) -> Result<i32, SetupError> {
    loop {
        let sig = mask.wait().step("waiting for signals")?;
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

/// [`supervise`] for a job held to its lease: signals and renewed deadlines are
/// waited for together; when the deadline passes the job is asked to stop (SIGTERM,
/// relayed by init), and the grace later init is killed, which ends every process of
/// the pid namespace. Exits [`EXIT_LEASE_EXPIRED`] then, whatever the job's status.
fn supervise_leased(
    child: Pid,
    mask: &SigSet,
    lease: &mut crate::lease::LeaseWatch,
) -> Result<i32, SetupError> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use nix::sys::signalfd::{SfdFlags, SignalFd};
    let signals =
        SignalFd::with_flags(mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK).step("signalfd")?;
    // Set once the deadline passed: when init is killed if still there.
    let mut kill_at: Option<u64> = None;
    let mut killed = false;
    loop {
        let now = crate::lease::monotonic_now_ns();
        if kill_at.is_none() && now >= lease.deadline_ns {
            eprintln!(
                "sandbox: the job's lease ran out (the runner did not renew it): stopping the job so that \
                 another runner may take it"
            );
            let _ = kill(child, Signal::SIGTERM);
            kill_at = Some(now.saturating_add(lease.grace.as_nanos() as u64));
        }
        if !killed && kill_at.is_some_and(|at| now >= at) {
            let _ = kill(child, Signal::SIGKILL);
            killed = true;
        }
        let next = match kill_at {
            Some(_) if killed => now.saturating_add(60_000_000_000),
            Some(at) => at,
            None => lease.deadline_ns,
        };
        // At most a minute at a time: a deadline far off needs no exact sleep.
        let wait_ms = (next.saturating_sub(now) / 1_000_000 + 1).min(60_000) as i32;
        let timeout = PollTimeout::try_from(wait_ms).unwrap_or(PollTimeout::MAX);
        let mut fds = vec![PollFd::new(signals.as_fd(), PollFlags::POLLIN)];
        if let Some(pipe) = lease.pipe() {
            fds.push(PollFd::new(pipe, PollFlags::POLLIN));
        }
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e).step("waiting for the job"),
        }
        let pipe_ready = fds.get(1).and_then(|f| f.revents()).is_some_and(|r| !r.is_empty());
        if pipe_ready {
            lease.read();
        }
        while let Ok(Some(info)) = signals.read_signal() {
            let Ok(sig) = Signal::try_from(info.ssi_signo as i32) else { continue };
            if sig != Signal::SIGCHLD {
                let _ = kill(child, sig);
                continue;
            }
            loop {
                let code = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::Exited(pid, code)) if pid == child => code,
                    Ok(WaitStatus::Signaled(pid, sig, _)) if pid == child => 128 + sig as i32,
                    Ok(WaitStatus::StillAlive) | Err(_) => break,
                    Ok(_) => continue,
                };
                return Ok(if kill_at.is_some() { crate::helper::EXIT_LEASE_EXPIRED } else { code });
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
    gate: Option<&OwnedFd>,
) -> Result<i32, SetupError> {
    // If the helper dies, init dies, and with it the whole pid namespace.
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).step("PR_SET_PDEATHSIG")?;
    let mut b = [0u8; 1];
    match nix::unistd::read(ready, &mut b) {
        Ok(1) => {}
        _ => return Err(SetupError::Refused("the helper did not map our ids".into())),
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
                _ => {
                    let why = SetupError::Refused("the user-mode network stack did not come up".into());
                    return Err(SetupError::Network(Box::new(why)));
                }
            }
            configure_user_mode(net, blocked.unwrap_or_default())
                .map_err(|e| SetupError::Network(Box::new(e)))?;
            if let Some(channel) = channel {
                hand_over(net, channel).map_err(|e| SetupError::Network(Box::new(e)))?;
            }
        }
        NetworkSpec::Off => {
            // Loopback up, so the job's own local services work; nothing else exists.
            Netlink::open().and_then(|mut nl| nl.link_up(1)).step("netlink")?;
        }
        NetworkSpec::SharedWithHost => {}
    }
    nix::unistd::sethostname(&spec.hostname).step("sethostname")?;
    // Everything the job needs is prepared before the fork, so the job's own steps
    // are only restrictions.
    let filters = crate::seccomp::job_filters().step("building the seccomp filter")?;
    let cstrings = |argv: &[String]| argv.iter().map(|a| cstring(a)).collect::<Result<Vec<_>, _>>();
    let mut stages = vec![(cstrings(&spec.argv)?, &[][..], &[][..], false)];
    for stage in &spec.then {
        stages.push((cstrings(&stage.argv)?, &stage.seal[..], &stage.freeze[..], stage.gate));
    }
    let env: Vec<CString> =
        spec.env.iter().map(|(k, v)| cstring(&format!("{k}={v}"))).collect::<Result<_, _>>()?;
    let mut mask = SigSet::empty();
    for s in RELAYED.iter().chain([&Signal::SIGCHLD]) {
        mask.add(*s);
    }
    let mut code = 0;
    for (i, (argv, seal, freeze, gated)) in stages.iter().enumerate() {
        if i > 0 {
            // A later stage starts as in a sandbox of its own: nothing the earlier
            // ones left running survives, and what it must not change is sealed or
            // frozen (init alone holds the capability to remount).
            end_stage();
            seal_files(seal)?;
            for path in freeze.iter() {
                root::remount(path, root::locked_flags(path), true)?;
            }
        }
        if *gated && !gate.is_some_and(gate_opens) {
            return Ok(EXIT_GATE_CLOSED);
        }
        let job = match sys::fork().step("fork")? {
            sys::Forked::Child => {
                let e = exec_job(spec, root_mode, &filters, argv, &env);
                eprintln!("sandbox: {e}");
                sys::exit_now(e.exit_code());
            }
            sys::Forked::Parent(pid) => pid,
        };
        // pid 1 reaps every orphan in the namespace; the job's status is the sandbox's.
        code = supervise(job, &mask, |sig| {
            // -1 from pid 1: every process in the namespace but init itself.
            let _ = kill(Pid::from_raw(-1), sig);
        })?;
        if code != 0 {
            break;
        }
    }
    Ok(code)
}

/// Ask the runner whether the next stage may run (`?`), and wait for its answer: `y`,
/// or anything else (the channel closed, too) for no. Nothing of the job runs meanwhile.
fn gate_opens(gate: &OwnedFd) -> bool {
    let mut answer = [0u8; 1];
    nix::unistd::write(gate, b"?").is_ok()
        && loop {
            match nix::unistd::read(gate, &mut answer) {
                Err(nix::errno::Errno::EINTR) => continue,
                Ok(1) => break answer[0] == b'y',
                _ => break false,
            }
        }
}

/// Kill every process of the namespace but init, and reap them all.
fn end_stage() {
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    while waitpid(Pid::from_raw(-1), None).is_ok() {}
}

/// Copy `files` (under the working directory) into the sealed directory, which is
/// writable only for the moment of the copy and only to init. Links are not followed:
/// only a regular file is sealed.
fn seal_files(files: &[PathBuf]) -> Result<(), SetupError> {
    if files.is_empty() {
        return Ok(());
    }
    let sealed = std::path::Path::new(SANDBOX_SEALED_DIR);
    let locked = root::locked_flags(sealed);
    root::remount(sealed, locked, false)?;
    let copied = files.iter().try_for_each(|file| {
        let dest = file.file_name().map(|n| sealed.join(n)).unwrap_or_default();
        seal_copy(file, &dest).map_err(|e| SetupError::Seal(format!("{}: {e}", file.display())))
    });
    let back = root::remount(sealed, locked, true);
    copied.and(back)
}

fn seal_copy(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let nofollow = nix::fcntl::OFlag::O_NOFOLLOW.bits();
    let mut src = std::fs::OpenOptions::new().read(true).custom_flags(nofollow).open(from)?;
    if !src.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut dest = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(nofollow)
        .open(to)?;
    std::io::copy(&mut src, &mut dest).map(|_| ())
}

fn cstring(s: &str) -> Result<CString, SetupError> {
    CString::new(s).map_err(|_| SetupError::Refused(format!("{s:?} contains a NUL byte")))
}

/// In the job process: restrictions only, then exec. Returns only on failure.
fn exec_job(
    spec: &SandboxSpec,
    root_mode: bool,
    filters: &[seccompiler::BpfProgram],
    argv: &[CString],
    env: &[CString],
) -> SetupError {
    let step = || -> Result<(), SetupError> {
        // Signals back to normal for the job (the helper and init block them).
        sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None).step("signal mask")?;
        nix::unistd::chdir(SANDBOX_WORK_DIR).step(format!("chdir {SANDBOX_WORK_DIR}"))?;
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).step("getrlimit")?;
        let nofile = spec.nofile.min(hard);
        setrlimit(Resource::RLIMIT_NOFILE, nofile, nofile).step("RLIMIT_NOFILE")?;
        setrlimit(Resource::RLIMIT_CORE, 0, 0).step("RLIMIT_CORE")?;
        // Capabilities: none now, none by exec as (inner) root, none by ambient raise.
        caps::clear(None, caps::CapSet::Ambient).step("clearing ambient caps")?;
        caps::clear(None, caps::CapSet::Inheritable).step("clearing inheritable caps")?;
        for cap in caps::all() {
            caps::drop(None, caps::CapSet::Bounding, cap)
                .step(format!("dropping {cap} from the bounding set"))?;
        }
        sys::lock_securebits().step("securebits")?;
        if root_mode {
            // A distinct unprivileged uid: inner 1000 is the host's `host_uid`.
            let id = SANDBOX_INNER_ID;
            nix::unistd::setgroups(&[]).step("setgroups")?;
            nix::unistd::setresgid(Gid::from_raw(id), Gid::from_raw(id), Gid::from_raw(id))
                .step("setresgid")?;
            nix::unistd::setresuid(Uid::from_raw(id), Uid::from_raw(id), Uid::from_raw(id))
                .step("setresuid")?;
        }
        caps::clear(None, caps::CapSet::Effective).step("clearing effective caps")?;
        caps::clear(None, caps::CapSet::Permitted).step("clearing permitted caps")?;
        nix::sys::prctl::set_no_new_privs().step("no_new_privs")?;
        landlock_rules(spec.binds.iter().filter(|b| b.writable).map(|b| b.inside.as_path()))?;
        // Last: after it, the calls above would be refused.
        crate::seccomp::apply(filters).step("applying the seccomp filter")?;
        Ok(())
    };
    if let Err(e) = step() {
        return e;
    }
    match nix::unistd::execve(&argv[0], argv, env) {
        Err(source) => SetupError::Exec { program: argv[0].to_string_lossy().into_owned(), source },
        Ok(never) => match never {},
    }
}

/// Landlock (where the kernel has it): read and execute anywhere in the sandbox's
/// root, write only in the working directory, /tmp, /dev/shm, the writable binds (and
/// to /dev/null).
fn landlock_rules<'p>(writable: impl Iterator<Item = &'p std::path::Path>) -> Result<(), SetupError> {
    use landlock::{ABI, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, path_beneath_rules};
    let abi = ABI::V5;
    Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .step("landlock")?
        .create()
        .step("landlock")?
        .add_rules(path_beneath_rules(["/"], AccessFs::from_read(abi)))
        .step("landlock")?
        .add_rules(path_beneath_rules([SANDBOX_WORK_DIR, "/tmp", "/dev/shm"], AccessFs::from_all(abi)))
        .step("landlock")?
        .add_rules(path_beneath_rules(writable, AccessFs::from_all(abi)))
        .step("landlock")?
        .add_rules(path_beneath_rules(["/dev/null", "/dev/zero", "/dev/full"], AccessFs::from_all(abi)))
        .step("landlock")?
        .restrict_self()
        .step("landlock")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Stage;

    fn spec(then: Vec<Stage>, sealed: bool) -> SandboxSpec {
        SandboxSpec {
            argv: vec!["/bin/true".into()],
            env: vec![],
            work_dir: "/tmp/w".into(),
            new_root: "/tmp/r".into(),
            ro_paths: vec![],
            hidden_paths: vec![],
            network: NetworkSpec::Off,
            tmp_size_mib: 1,
            nofile: 64,
            host_uid: 1000,
            host_gid: 1000,
            cgroup_procs: vec![],
            cgroup_born_in: None,
            hostname: "t".into(),
            then,
            sealed_dir: sealed.then(|| "/tmp/s".into()),
            lease: None,
            binds: vec![],
            proc: true,
        }
    }

    fn stage(argv0: &str, seal: &[&str]) -> Stage {
        Stage {
            argv: vec![argv0.into()],
            seal: seal.iter().map(PathBuf::from).collect(),
            gate: false,
            freeze: vec![],
        }
    }

    #[test]
    fn stages_are_checked_before_anything_is_built() {
        assert!(check_spec(&spec(vec![stage("/bin/sh", &["/work/module/plan.tfplan"])], true)).is_ok());
        let refused = |then, sealed| match check_spec(&spec(then, sealed)) {
            Err(SetupError::Refused(why)) => why,
            other => panic!("not refused: {other:?}"),
        };
        assert!(refused(vec![stage("sh", &[])], true).contains("absolute"));
        assert!(refused(vec![stage("/bin/sh", &["/work/x"])], false).contains("no sealed_dir"));
        for bad in ["/etc/shadow", "/work", "/work/../etc/passwd", "/work/x/..", "work/x", "/workx/y"] {
            assert!(refused(vec![stage("/bin/sh", &[bad])], true).contains("not a plain path"), "{bad}");
        }
    }

    #[test]
    fn binds_go_only_to_places_of_their_own_and_only_writable_ones_freeze() {
        let bind = |inside: &str, writable| crate::spec::Bind {
            host: "/var/lib/r/work/j.tf".into(),
            inside: inside.into(),
            writable,
        };
        let with = |binds: Vec<crate::spec::Bind>, freeze: &[&str]| {
            let mut later = stage("/bin/sh", &[]);
            later.freeze = freeze.iter().map(PathBuf::from).collect();
            let mut s = spec(vec![later], true);
            s.binds = binds;
            check_spec(&s)
        };
        assert!(
            with(vec![bind("/tf", false), bind("/tf/providers", false), bind("/tfdata", true)], &["/tfdata"])
                .is_ok()
        );
        for bad in ["/", "/work", "/work/x", "/sealed", "/proc", "/dev/x", "/tmp", "tf", "/tf/../etc"] {
            let Err(SetupError::Refused(why)) = with(vec![bind(bad, true)], &[]) else {
                panic!("{bad} taken")
            };
            assert!(why.contains("absolute plain path"), "{bad}: {why}");
        }
        let Err(SetupError::Refused(why)) = with(vec![bind("/tf", false)], &["/tf"]) else { panic!("froze") };
        assert!(why.contains("no writable bind"), "{why}");
        let Err(SetupError::Refused(why)) = with(vec![], &["/tfdata"]) else { panic!("froze") };
        assert!(why.contains("no writable bind"), "{why}");
    }
}
