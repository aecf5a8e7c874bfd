//! Every `unsafe` block and raw syscall of the workspace. Each is small, documented and
//! used from the single-threaded sandbox helper only.
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

/// Close one descriptor by number (the child's copy of a pipe end it must not hold).
pub fn close_raw(fd: std::os::fd::RawFd) {
    // SAFETY: the caller names a descriptor of its own (a copy inherited through clone)
    // that no other code in this process uses afterwards.
    unsafe {
        libc::close(fd);
    }
}
