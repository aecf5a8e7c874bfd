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
pub mod probe;
pub mod seccomp;
pub mod spec;
mod sys;

pub use spec::SandboxSpec;

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
