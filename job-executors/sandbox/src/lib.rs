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
