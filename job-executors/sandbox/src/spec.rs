//! What the runner asks the sandbox helper to build (sent as JSON on its stdin).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Where the job's working directory appears inside the sandbox.
pub const SANDBOX_WORK_DIR: &str = "/work";
/// Host directories visible (read-only) inside every sandbox, when they exist.
pub const DEFAULT_RO_PATHS: &[&str] =
    &["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt"];
/// The unprivileged uid/gid the job runs as (inside the sandbox) when the helper can
/// map one, i.e. when the runner runs as root.
pub const SANDBOX_INNER_ID: u32 = 1000;
/// Largest spec the helper reads.
pub const MAX_SPEC_BYTES: u64 = 1024 * 1024;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// Program (a path inside the sandbox) and its arguments.
    pub argv: Vec<String>,
    /// The job's complete environment: nothing else is inherited.
    pub env: Vec<(String, String)>,
    /// Host path of the job's working directory, mounted read-write at `/work`.
    pub work_dir: PathBuf,
    /// An empty host directory used as the mount point of the sandbox's root.
    pub new_root: PathBuf,
    /// Host directories bound read-only at the same path inside.
    pub ro_paths: Vec<PathBuf>,
    /// Paths that must not be visible inside (the runner's state and config); masked
    /// if they lie under a bound directory.
    pub hidden_paths: Vec<PathBuf>,
    /// Keep the host network (default for terraform/helm); false gives an empty
    /// network namespace with no interfaces but loopback.
    pub network: bool,
    pub tmp_size_mib: u64,
    /// RLIMIT_NOFILE for the job.
    pub nofile: u64,
    /// Host uid/gid the job's inner uid maps to when the helper runs as root.
    pub host_uid: u32,
    pub host_gid: u32,
    /// `cgroup.procs` files the helper joins before building namespaces (prepared and
    /// limited by the runner; empty when cgroups are unavailable).
    pub cgroup_procs: Vec<PathBuf>,
    pub hostname: String,
}
