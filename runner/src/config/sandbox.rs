//! `[sandbox]` (with `[sandbox.egress]`) and `[containers]`: how jobs are isolated.

use std::path::PathBuf;
use std::time::Duration;

use super::fields::Fields;

#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Run process jobs in the sandbox (namespaces, seccomp, Landlock, cgroups).
    pub enabled: bool,
    pub memory_mib: u64,
    pub pids: u64,
    /// CPU quota, percent of one core.
    pub cpu_percent: u64,
    pub cgroups: bool,
    pub tmp_size_mib: u64,
    pub nofile: u64,
    /// Extra host directories jobs may read (tools installed outside /usr, /opt).
    pub extra_ro_paths: Vec<PathBuf>,
    /// Host uid/gid jobs run as when the runner runs as root.
    pub uid: u32,
    pub gid: u32,
    /// Refuse a job whose cgroup limits cannot be applied (default), rather than run it
    /// without memory/pids/cpu limits.
    pub require_limits: bool,
    /// `[sandbox.egress]`: the network boundary of networked jobs.
    pub egress: byoc_job_executors::jobnet::NetworkSettings,
}

impl SandboxConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("sandbox", table, problems);
        let mut sandbox = SandboxConfig {
            enabled: f.get("enabled").unwrap_or(true),
            memory_mib: f.ranged("memory_mib", 2048, 16..=1024 * 1024),
            pids: f.ranged("pids", 1024, 8..=1_000_000),
            cpu_percent: f.ranged("cpu_percent", 200, 10..=100_000),
            cgroups: f.get("cgroups").unwrap_or(true),
            tmp_size_mib: f.ranged("tmp_size_mib", 1024, 1..=1024 * 1024),
            nofile: f.ranged("nofile", 4096, 64..=1_048_576),
            extra_ro_paths: f
                .get::<Vec<String>>("extra_ro_paths")
                .unwrap_or_default()
                .into_iter()
                .map(PathBuf::from)
                .collect(),
            uid: f.ranged("uid", 65534, 1..=u32::MAX as u64) as u32,
            gid: f.ranged("gid", 65534, 1..=u32::MAX as u64) as u32,
            require_limits: f.get("require_limits").unwrap_or(true),
            egress: Default::default(),
        };
        let egress_t = f.table("egress");
        let problems = f.finish();
        sandbox.egress = parse_egress(Fields::new("sandbox.egress", egress_t, problems));
        for p in &sandbox.extra_ro_paths {
            if !p.is_absolute() {
                problems.push(format!("sandbox.extra_ro_paths: {} must be an absolute path", p.display()));
            }
        }
        sandbox
    }
}

/// `[sandbox.egress]`: every problem reported, none fatal on its own.
fn parse_egress(mut f: Fields<'_>) -> byoc_job_executors::jobnet::NetworkSettings {
    use byoc_job_executors::jobnet::{EgressAllow, NetworkSettings};
    use byoc_sandbox::net::Cidr;
    let d = NetworkSettings::default();
    let slirp4netns =
        f.get::<String>("slirp4netns").map(PathBuf::from).unwrap_or_else(|| d.slirp4netns.clone());
    let ipv6 = f.get("ipv6").unwrap_or(d.ipv6);
    let mtu = f.ranged("mtu", u64::from(d.mtu), 1280..=65520) as u32;
    let ready_timeout = Duration::from_millis(f.ranged("ready_timeout_ms", 10_000, 100..=60_000));
    let deny_s: Vec<String> = f.get("deny").unwrap_or_default();
    let allow_s: Option<Vec<String>> = f.get("allow");
    let ns_s: Vec<String> = f.get("nameservers").unwrap_or_default();
    f.require_absolute("slirp4netns", &slirp4netns);
    let mut deny = Vec::new();
    for (i, d) in deny_s.iter().enumerate() {
        match d.parse::<Cidr>() {
            Ok(c) => deny.push(c),
            Err(e) => f.problem(format!("sandbox.egress.deny[{i}]: {e}")),
        }
    }
    let blocked = byoc_sandbox::net::always_blocked();
    let allow = allow_s.map(|entries| {
        let mut allow = EgressAllow::default();
        for (i, entry) in entries.iter().enumerate() {
            let entry = entry.trim();
            if entry.chars().next().is_some_and(|c| c.is_ascii_digit() || c == ':') || entry.contains('/') {
                match entry.parse::<Cidr>() {
                    // A range wholly inside one that is always blocked could never be reached.
                    Ok(c) => match blocked.iter().find(|b| b.prefix_len() <= c.prefix_len() && b.contains(c.addr())) {
                        Some(b) => f.problem(format!(
                            "sandbox.egress.allow[{i}]: {c} is inside {b}, which no job may ever reach"
                        )),
                        None => allow.ranges.push(c),
                    },
                    Err(e) => f.problem(format!("sandbox.egress.allow[{i}]: {e}")),
                }
            } else if valid_host_pattern(entry) {
                allow.hosts.push(entry.trim_end_matches('.').to_ascii_lowercase());
            } else {
                f.problem(format!(
                    "sandbox.egress.allow[{i}]: {entry:?} is neither an address range (10.0.0.0/8, 2001:db8::/32) \
                     nor a host name (sts.us-east-1.amazonaws.com, *.amazonaws.com)"
                ));
            }
        }
        allow
    });
    let mut nameservers = Vec::new();
    for (i, n) in ns_s.iter().enumerate() {
        let parsed = n
            .parse::<std::net::SocketAddr>()
            .or_else(|_| n.parse::<std::net::IpAddr>().map(|ip| std::net::SocketAddr::new(ip, 53)));
        match parsed {
            Ok(a) => nameservers.push(a),
            Err(_) => {
                f.problem(format!("sandbox.egress.nameservers[{i}]: {n:?} is not an IP address (or IP:port)"))
            }
        }
    }
    f.finish();
    NetworkSettings { slirp4netns, ipv6, mtu, deny, allow, nameservers, ready_timeout }
}

/// A host name, or `*.` followed by one: letters, digits, hyphens, dots.
fn valid_host_pattern(s: &str) -> bool {
    let name = s.strip_prefix("*.").unwrap_or(s).trim_end_matches('.');
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
}

#[derive(Debug, Clone)]
pub struct ContainersConfig {
    /// Run `action.container` jobs through the Docker Engine.
    pub enabled: bool,
    pub docker_socket: PathBuf,
}

impl ContainersConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("containers", table, problems);
        let containers = ContainersConfig {
            enabled: f.get("enabled").unwrap_or(true),
            docker_socket: f.absolute_path("docker_socket", "/var/run/docker.sock"),
        };
        f.finish();
        containers
    }
}
