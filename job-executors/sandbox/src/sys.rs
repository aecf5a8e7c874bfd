//! Every `unsafe` block and raw syscall of the workspace. Each is small and documented;
//! all but [`keep_allocator_lean`] (the daemon's first step) and [`default_sigpipe`]
//! (the printing CLI commands) are used from the
//! single-threaded sandbox helper only.
#![allow(unsafe_code)]

use nix::sched::CloneFlags;
use nix::unistd::Pid;

/// Start `child` in a new process created with `flags` (namespaces). Returns its pid.
/// The child gets a copy of the address space (no CLONE_VM) and its own stack.
pub fn clone_with(flags: CloneFlags, child: Box<dyn FnMut() -> isize + '_>) -> nix::Result<Pid> {
    let mut stack = vec![0u8; 1024 * 1024];
    // SAFETY: the helper is single-threaded (a fresh exec, no runtime), so the child's
    // copy of the address space has no other thread's locks held. Without CLONE_VM the
    // child writes only its own copy of `stack`; the parent frees its copy after clone
    // returns. SIGCHLD makes the child reapable with waitpid like a forked one.
    unsafe { nix::sched::clone(child, &mut stack, flags, Some(libc::SIGCHLD)) }
}

/// The kernel's `struct clone_args` (Linux 5.7: up to `cgroup`).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// fork(2), but the child is born in the cgroup v2 directory `cgroup` and in new
/// namespaces `flags` (`clone3` with `CLONE_INTO_CGROUP`): it never runs outside the
/// job's cgroup, and no migration (whose lock waits for an RCU grace period and holds
/// up every fork on the machine meanwhile) is needed. The kernel's errno on failure:
/// ENOSYS before Linux 5.3 or under a filter that hides `clone3`, E2BIG or EINVAL
/// before 5.7.
pub fn clone_into_cgroup(flags: CloneFlags, cgroup: std::os::fd::BorrowedFd<'_>) -> nix::Result<Forked> {
    use std::os::fd::AsRawFd as _;
    let args = CloneArgs {
        flags: flags.bits() as u64 | CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: cgroup.as_raw_fd() as u64,
        ..Default::default()
    };
    // SAFETY: `args` is a valid clone_args of the size passed. With no stack given the
    // child continues on a copy of this one, like fork; callers are the single-threaded
    // helper (a fresh exec, no runtime), so the copy holds no other thread's locks.
    let r = unsafe {
        libc::syscall(libc::SYS_clone3, &args as *const CloneArgs, std::mem::size_of::<CloneArgs>())
    };
    match r {
        -1 => Err(nix::errno::Errno::last()),
        0 => Ok(Forked::Child),
        pid => Ok(Forked::Parent(Pid::from_raw(pid as i32))),
    }
}

pub enum Forked {
    Parent(Pid),
    Child,
}

/// fork(2) from the single-threaded helper.
pub fn fork() -> nix::Result<Forked> {
    // SAFETY: called only in the sandbox helper's init process, which is
    // single-threaded, so the child cannot inherit a lock held by another thread.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Parent { child } => Ok(Forked::Parent(child)),
        nix::unistd::ForkResult::Child => Ok(Forked::Child),
    }
}

/// Close every descriptor from `first` up, so nothing the runner had open (sockets,
/// the journal, key files) leaks into the sandbox.
pub fn close_fds_from(first: u32) -> std::io::Result<()> {
    // SAFETY: close_range only closes descriptors; callers own none above `first` that
    // they still use (stdin/stdout/stderr are 0-2).
    let r = unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, 0u32) };
    if r == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;
const SECBIT_NO_SETUID_FIXUP_LOCKED: libc::c_ulong = 1 << 3;
const SECBIT_KEEP_CAPS_LOCKED: libc::c_ulong = 1 << 5;
const SECBIT_NO_CAP_AMBIENT_RAISE: libc::c_ulong = 1 << 6;
const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: libc::c_ulong = 1 << 7;

/// Make uid 0 carry no special power for the rest of this process tree: exec as root
/// grants no capabilities, and the setting cannot be undone.
pub fn lock_securebits() -> std::io::Result<()> {
    let bits = SECBIT_NOROOT
        | SECBIT_NOROOT_LOCKED
        | SECBIT_NO_SETUID_FIXUP
        | SECBIT_NO_SETUID_FIXUP_LOCKED
        | SECBIT_KEEP_CAPS_LOCKED
        | SECBIT_NO_CAP_AMBIENT_RAISE
        | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
    // SAFETY: PR_SET_SECUREBITS takes one integer argument and touches no memory.
    let r = unsafe { libc::prctl(libc::PR_SET_SECUREBITS, bits, 0, 0, 0) };
    if r == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Leave the process immediately (no destructors, no atexit), as a forked child must.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and is async-signal-safe.
    unsafe { libc::_exit(code) }
}

/// What the kernel (through the process's seccomp filters) does with `getpid` made
/// through x86-64's x32 ABI (its number with `__X32_SYSCALL_BIT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum X32Answer {
    /// The call ran: x32 is open to this process.
    Allowed,
    /// It failed with this errno (EPERM from a filter, ENOSYS from a kernel without
    /// x32 that no filter stopped).
    Errno(i32),
    /// A filter killed the process (Docker's profile does, SIGSYS).
    Killed(i32),
}

/// `pidfd_getfd` of this process's own standard output, through a pidfd of itself: the
/// call a process would make to take another's descriptor. Returns the errno (0: it
/// worked, and the copy is closed).
pub fn pidfd_getfd_own_stdout() -> i32 {
    // SAFETY: pidfd_open takes a pid and flags and returns a descriptor or -1.
    let pidfd =
        unsafe { libc::syscall(libc::SYS_pidfd_open, std::process::id() as libc::c_long, 0 as libc::c_long) };
    if pidfd < 0 {
        return nix::errno::Errno::last_raw();
    }
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number and flags; it returns a
    // new descriptor or -1 and touches no memory of ours.
    let fd = unsafe {
        libc::syscall(libc::SYS_pidfd_getfd, pidfd as libc::c_long, 1 as libc::c_long, 0 as libc::c_long)
    };
    let code = if fd < 0 { nix::errno::Errno::last_raw() } else { 0 };
    close_raw(pidfd as i32);
    if fd >= 0 {
        close_raw(fd as i32);
    }
    code
}

/// Try an x32 `getpid` in a child (a filter may kill whoever makes the call) and say
/// what happened to it. On other architectures there is no such ABI: `Errno(ENOSYS)`.
pub fn x32_getpid() -> nix::Result<X32Answer> {
    #[cfg(target_arch = "x86_64")]
    {
        use nix::sys::wait::{WaitStatus, waitpid};
        // SAFETY: the probe is a single-threaded command; the child makes one system
        // call and leaves with _exit, touching no lock or allocator.
        match unsafe { nix::unistd::fork() }? {
            nix::unistd::ForkResult::Child => {
                // SAFETY: getpid takes no arguments and touches no memory, under any ABI.
                let r = unsafe { libc::syscall(0x4000_0000 | libc::SYS_getpid) };
                let code = if r < 0 { nix::errno::Errno::last_raw() } else { 0 };
                exit_now(code)
            }
            nix::unistd::ForkResult::Parent { child } => match waitpid(child, None)? {
                WaitStatus::Exited(_, 0) => Ok(X32Answer::Allowed),
                WaitStatus::Exited(_, code) => Ok(X32Answer::Errno(code)),
                WaitStatus::Signaled(_, sig, _) => Ok(X32Answer::Killed(sig as i32)),
                _ => Err(nix::errno::Errno::ECHILD),
            },
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    Ok(X32Answer::Errno(libc::ENOSYS))
}

/// Close one descriptor by number (the child's copy of a pipe end it must not hold).
pub fn close_raw(fd: std::os::fd::RawFd) {
    // SAFETY: the caller names a descriptor of its own (a copy inherited through clone)
    // that no other code in this process uses afterwards.
    unsafe {
        libc::close(fd);
    }
}

/// Take ownership of the hand-over channel the runner placed at `fd`, after checking
/// it is a socket, and mark it close-on-exec (init sends on it; nothing exec'd may
/// inherit it).
pub fn take_handover_fd(fd: std::os::fd::RawFd) -> std::io::Result<std::os::fd::OwnedFd> {
    take_fd(fd, libc::S_IFSOCK, "a socket")
}

/// The lease pipe's read end the runner placed at `fd` (see [`take_handover_fd`]).
pub fn take_pipe_fd(fd: std::os::fd::RawFd) -> std::io::Result<std::os::fd::OwnedFd> {
    take_fd(fd, libc::S_IFIFO, "a pipe")
}

fn take_fd(fd: std::os::fd::RawFd, kind: libc::mode_t, what: &str) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd as _;
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a `struct stat` into the buffer we own and touches nothing else.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fstat succeeded, so it initialised the buffer.
    let st = unsafe { st.assume_init() };
    if st.st_mode & libc::S_IFMT != kind {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is not {what}"),
        ));
    }
    // SAFETY: the descriptor is open (fstat succeeded) and, by the helper's contract
    // with the runner, ours alone: nothing else in this process refers to it.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    nix::fcntl::fcntl(&owned, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC))?;
    Ok(owned)
}

/// Make each `fd` appear as its descriptor `target` in the program `cmd` starts (the
/// sandbox helper's channels), whatever numbers they have here.
pub fn pass_fds_as(cmd: &mut std::process::Command, fds: Vec<(std::os::fd::OwnedFd, std::os::fd::RawFd)>) {
    use std::os::fd::AsRawFd as _;
    use std::os::unix::process::CommandExt as _;
    // SAFETY: the closure runs in the forked child before exec and calls only fcntl and
    // dup2, which are async-signal-safe; the descriptors stay open in the parent (moved
    // into the closure, which the Command keeps) until the child has been spawned.
    unsafe {
        cmd.pre_exec(move || {
            // First out of the way (a source may sit on another's target), then in place;
            // dup2 clears close-on-exec on the target, the copies keep it.
            let mut moved = Vec::with_capacity(fds.len());
            for (fd, target) in &fds {
                let copy = libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 64);
                if copy == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                moved.push((copy, *target));
            }
            for (copy, target) in moved {
                if libc::dup2(copy, target) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Receive one message and the descriptors that came with it (close-on-exec).
pub fn recv_with_fds(
    fd: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
) -> std::io::Result<(usize, Vec<std::os::fd::OwnedFd>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    use std::os::fd::{AsRawFd as _, FromRawFd as _};
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 8]);
    let msg = recvmsg::<()>(fd.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raws) = c {
            for raw in raws {
                // SAFETY: the kernel just installed `raw` in our table for this message;
                // nothing else in the process knows the number, so we own it.
                fds.push(unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) });
            }
        }
    }
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(std::io::Error::other("descriptors were cut off (more than expected)"));
    }
    Ok((msg.bytes, fds))
}

/// glibc's allocator settings for a process that lives for years and is idle most of
/// the time: one arena for every thread (each further arena keeps its own freed
/// pages), and trim and mmap thresholds fixed at 128 KiB, glibc's starting values,
/// which it otherwise raises after every larger free (up to 32 MiB kept unreturned).
/// Returns whether glibc took every setting.
#[cfg(target_env = "gnu")]
pub fn keep_allocator_lean() -> bool {
    const THRESHOLD: libc::c_int = 128 * 1024;
    // SAFETY: mallopt sets allocator parameters under glibc's own lock; it touches no
    // memory of ours.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, THRESHOLD) == 1
            && libc::mallopt(libc::M_MMAP_THRESHOLD, THRESHOLD) == 1
    }
}

/// Other C libraries have no such settings.
#[cfg(not(target_env = "gnu"))]
pub fn keep_allocator_lean() -> bool {
    false
}

/// Give the kernel back the heap's free pages, wherever they are: after a large job
/// the freed buffers sit between live allocations, where the trim threshold cannot
/// reach them. Returns whether anything was released.
#[cfg(target_env = "gnu")]
pub fn return_free_heap() -> bool {
    // SAFETY: malloc_trim works under glibc's own arena lock and only releases pages
    // that are free; it touches no memory of ours.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(target_env = "gnu"))]
pub fn return_free_heap() -> bool {
    false
}

/// Hand back the pages of this process's read-only file mappings (its code, the C
/// library's, read-only data): after a job they hold every path it ran, which the idle
/// runner does not run again until the next job; that one reads back from the page
/// cache (or the disk) what it needs. Returns the bytes of the mappings advised;
/// nothing where the kernel lacks `MADV_PAGEOUT` (before 5.4).
pub fn page_out_read_only_mappings() -> u64 {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return 0 };
    let mut advised = 0;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else { continue };
        // A file's private, unwritable mapping: clean pages the kernel can read again.
        let path = fields.nth(3).unwrap_or("");
        if !perms.starts_with('r') || perms.as_bytes().get(1) != Some(&b'-') || !path.starts_with('/') {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16)) else {
            continue;
        };
        // SAFETY: the range is one of this process's own mappings as the kernel lists
        // it, file-backed and not writable: paging it out changes no content, the next
        // access faults the same bytes back in.
        if unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_PAGEOUT) } == 0 {
            advised += (end - start) as u64;
        }
    }
    advised
}

/// Let a write to a closed pipe end this process quietly, as it ends `ls | head`: for
/// the customer CLI's commands that only print (their output piped into `head`), never
/// the daemon, which must see a closed peer as an error it handles.
pub fn default_sigpipe() {
    // SAFETY: SIG_DFL installs no handler code to run; the call only changes this
    // process's disposition of SIGPIPE, before the command starts any thread.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_env = "gnu")]
    fn glibc_takes_the_daemons_allocator_settings() {
        assert!(super::keep_allocator_lean());
        // Blocks on both sides of the fixed mmap threshold still allocate and free.
        for size in [1 << 10, 1 << 17, 1 << 20] {
            let block = vec![7u8; size];
            assert_eq!(block.iter().map(|&b| usize::from(b)).sum::<usize>(), 7 * size);
        }
    }
}
