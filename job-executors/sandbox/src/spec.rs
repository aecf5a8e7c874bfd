//! What the runner asks the sandbox helper to build (sent as JSON on its stdin).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::net::Cidr;

/// Where the job's working directory appears inside the sandbox.
pub const SANDBOX_WORK_DIR: &str = "/work";
/// Where [`SandboxSpec::sealed_dir`] appears inside the sandbox (read-only to the job).
pub const SANDBOX_SEALED_DIR: &str = "/sealed";
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
    /// The job's network: see [`NetworkSpec`].
    pub network: NetworkSpec,
    pub tmp_size_mib: u64,
    /// RLIMIT_NOFILE for the job.
    pub nofile: u64,
    /// Host uid/gid the job's inner uid maps to when the helper runs as root.
    pub host_uid: u32,
    pub host_gid: u32,
    /// `cgroup.procs` files the helper joins before building namespaces (prepared and
    /// limited by the runner; empty when cgroups are unavailable).
    pub cgroup_procs: Vec<PathBuf>,
    /// The job's cgroup v2 directory: init is born in it (`clone3` with
    /// `CLONE_INTO_CGROUP`) and the helper joins `cgroup_procs` only afterwards, off the
    /// job's path. `None` (cgroup v1, or no cgroup): the helper joins first.
    #[serde(default)]
    pub cgroup_born_in: Option<PathBuf>,
    pub hostname: String,
    /// Programs run after `argv`, in order, in the same sandbox (one network set-up
    /// instead of several), each only after the one before exited 0.
    #[serde(default)]
    pub then: Vec<Stage>,
    /// A host directory (the runner's, not the job's) mounted read-only at
    /// [`SANDBOX_SEALED_DIR`], where a [`Stage::seal`] puts its copies.
    #[serde(default)]
    pub sealed_dir: Option<PathBuf>,
    /// The job is held to its lease (see [`crate::lease`]): deadlines arrive on
    /// [`LEASE_FD`]; when one passes, the job is stopped, and killed `grace_ms` later.
    #[serde(default)]
    pub lease: Option<LeaseSpec>,
    /// The runner's directories mounted at fixed places inside, in this order (a later
    /// one may sit on a mount point inside an earlier one, made by the runner).
    #[serde(default)]
    pub binds: Vec<Bind>,
    /// Mount the pid namespace's /proc. Off where no process inside may reach another's
    /// descriptors (a step whose standard output the runner believes): without /proc a
    /// process can open only what it was handed.
    #[serde(default = "mount_proc_by_default")]
    pub proc: bool,
}

fn mount_proc_by_default() -> bool {
    true
}

/// A runner directory seen inside the sandbox at `inside`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Bind {
    pub host: PathBuf,
    pub inside: PathBuf,
    /// Writable by the job (until a stage freezes it, see [`Stage::freeze`]); read-only
    /// otherwise.
    pub writable: bool,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseSpec {
    pub grace_ms: u64,
}

/// A later program of the same sandbox. Before it starts, init kills whatever the
/// earlier ones left running, so it starts with no process of theirs beside it, as in
/// a sandbox of its own.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    pub argv: Vec<String>,
    /// Files under [`SANDBOX_WORK_DIR`] that init copies into the sealed directory, by
    /// file name, before this stage starts: what the earlier stages made, fixed where
    /// no process of the job can change it (the runner reads the same bytes later).
    #[serde(default)]
    pub seal: Vec<PathBuf>,
    /// Before this stage starts, init asks the runner on [`GATE_FD`] (one byte `?`) and
    /// runs it only on the answer `y`; any other answer, or none, ends the sandbox with
    /// `EXIT_GATE_CLOSED` (123) and the stage never runs.
    #[serde(default)]
    pub gate: bool,
    /// Writable [`Bind`]s (by `inside` path) that init makes read-only before this
    /// stage starts, for good: what the earlier stages wrote there stays as they left
    /// it, and no later process of the job can change it.
    #[serde(default)]
    pub freeze: Vec<PathBuf>,
}

/// The descriptor on which the helper finds the runner's end of the gate channel, when
/// a stage is gated: a stream socket.
pub const GATE_FD: i32 = 4;

/// The descriptor on which the helper (and the sandbox's init) finds the runner's end
/// of the hand-over channel, when [`UserModeNet::handover`] is set.
pub const HANDOVER_FD: i32 = 3;

/// The descriptor on which the helper finds the read end of the lease pipe, when
/// [`SandboxSpec::lease`] is set.
pub const LEASE_FD: i32 = 5;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum NetworkSpec {
    /// An empty network namespace: loopback only, nothing outside.
    Off,
    /// The job's own namespace with egress through a user-mode stack, the blocked
    /// ranges refused ahead of every route.
    UserMode(UserModeNet),
    /// The runner's own network namespace. The runner never asks for it; it exists
    /// for the benchmark that shows what the boundary costs.
    SharedWithHost,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserModeNet {
    /// The `slirp4netns` program (run by the helper in the runner's namespaces).
    pub slirp4netns: PathBuf,
    /// Give the job IPv6 egress too (the blocked IPv6 ranges are refused either way).
    pub ipv6: bool,
    pub mtu: u32,
    /// Refused besides [`crate::net::ALWAYS_BLOCKED`] and the host's own addresses
    /// (which the helper adds itself).
    pub blocked: Vec<Cidr>,
    /// `None`: every destination not blocked. `Some`: only these ranges (and the
    /// addresses of allowed host names, which the runner routes as the job resolves them).
    pub allow: Option<Vec<Cidr>>,
    /// Make the sockets the runner serves inside the namespace (DNS, a netlink socket
    /// for allowed names' routes, and with `credentials` the role's endpoint) and send
    /// them on [`HANDOVER_FD`].
    pub handover: bool,
    pub credentials: bool,
    /// How long the user-mode stack may take to come up.
    pub ready_timeout_ms: u64,
}

/// What the sandbox's init sends on the hand-over channel: one message whose text names
/// the descriptors that travel with it, in order.
pub mod handover {
    pub const DNS_UDP: &str = "dns_udp";
    pub const DNS_TCP: &str = "dns_tcp";
    pub const NETLINK: &str = "netlink";
    pub const CREDENTIALS: &str = "credentials";
}
