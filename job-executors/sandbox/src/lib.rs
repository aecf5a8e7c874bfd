//! The job sandbox.
//!
//! The daemon never forks inside its async runtime to build a sandbox: the executor
//! starts `byoc-runner sandbox-exec` (a fresh, single-threaded process) and writes a
//! [`SandboxSpec`] to its stdin. [`helper::sandbox_exec_main`] then builds the sandbox
//! in a fixed order (see `helper.rs`) and execs the job's program.
//!
//! `unsafe` and raw syscalls live only in `sys.rs`.

pub mod cgroup;
pub mod helper;
pub mod lease;
pub mod net;
pub mod netlink;
pub mod probe;
pub mod seccomp;
pub mod spec;
mod sys;
pub use sys::default_sigpipe;

pub use spec::SandboxSpec;

/// Give the helper `cmd` starts the runner's ends of its channels: the hand-over
/// channel at [`spec::HANDOVER_FD`], the gate channel at [`spec::GATE_FD`], the lease
/// pipe at [`spec::LEASE_FD`].
pub fn pass_channels(
    cmd: &mut std::process::Command,
    handover: Option<std::os::fd::OwnedFd>,
    gate: Option<std::os::fd::OwnedFd>,
    lease: Option<std::os::fd::OwnedFd>,
) {
    let fds: Vec<_> = [(handover, spec::HANDOVER_FD), (gate, spec::GATE_FD), (lease, spec::LEASE_FD)]
        .into_iter()
        .filter_map(|(fd, target)| Some((fd?, target)))
        .collect();
    if !fds.is_empty() {
        sys::pass_fds_as(cmd, fds);
    }
}

/// Make the allocator hand freed memory back instead of keeping it (see
/// `sys::keep_allocator_lean`): for the daemon, before its runtime starts. False where
/// the C library has no such settings or refused one.
pub fn keep_allocator_lean() -> bool {
    sys::keep_allocator_lean()
}

/// Return the heap's free pages to the kernel (see `sys::return_free_heap`): for the
/// daemon when it is idle, after jobs that needed large buffers.
pub fn return_free_heap() -> bool {
    sys::return_free_heap()
}

/// Hand back the idle runner's code and read-only data pages (see
/// `sys::page_out_read_only_mappings`): bytes of the mappings advised.
pub fn page_out_read_only_mappings() -> u64 {
    sys::page_out_read_only_mappings()
}

/// Receive one message of the hand-over channel and its descriptors (non-blocking
/// when the socket is).
pub fn receive_with_fds(
    channel: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
) -> std::io::Result<(usize, Vec<std::os::fd::OwnedFd>)> {
    sys::recv_with_fds(channel, buf)
}

/// Whether the kernel enforces Landlock (a ruleset can be created; nothing is
/// restricted by asking).
pub fn landlock_supported() -> bool {
    use landlock::{ABI, Access, AccessFs, CompatLevel, Compatible, Ruleset, RulesetAttr};
    Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(ABI::V1))
        .and_then(|r| r.create())
        .is_ok()
}
