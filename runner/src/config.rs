//! Runner configuration: TOML file plus `BYOC_RUNNER__SECTION__KEY` environment
//! overrides, validated completely before any side effect. Every problem is collected
//! and reported at once; unknown keys are errors.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ed25519_dalek::VerifyingKey;

pub const DEFAULT_CONFIG_PATH: &str = "/etc/byoc-runner/runner.toml";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/byoc-runner";
/// Prefix of environment overrides: `BYOC_RUNNER__POLL__WAIT_SECS=10`.
pub const ENV_PREFIX: &str = "BYOC_RUNNER__";

#[derive(Debug, Clone)]
pub struct Config {
    pub control_plane: ControlPlaneConfig,
    pub runner: RunnerConfig,
    pub poll: PollConfig,
    pub jobs: JobsConfig,
    pub logging: LoggingConfig,
    pub sandbox: SandboxConfig,
    pub containers: ContainersConfig,
    pub aws: AwsConfig,
    pub roles: RolesConfig,
    pub oci: OciConfig,
    pub terraform: TerraformConfig,
    pub helm: HelmConfig,
    pub policy: PolicyConfig,
    /// Where the configuration was read from (hidden from jobs).
    pub source: PathBuf,
    /// SHA-256 of the effective configuration (file plus overrides), for the audit trail.
    pub digest: String,
}

#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    pub url: reqwest::Url,
    /// Pinned control-plane job-signing keys, by key id.
    pub public_keys: BTreeMap<String, VerifyingKey>,
    pub ca_bundle: Option<PathBuf>,
    /// Dev only: allow plain http:// when the host is loopback.
    pub allow_insecure_loopback: bool,
    pub request_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct RunnerConfig {
    pub state_dir: PathBuf,
    pub install_id: String,
    pub bootstrap_token_file: Option<PathBuf>,
    pub hostname: Option<String>,
}

#[derive(Debug, Clone)]
pub struct PollConfig {
    pub wait: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

#[derive(Debug, Clone)]
pub struct JobsConfig {
    pub drain_grace: Duration,
    pub kill_grace: Duration,
    pub heartbeat_interval: Duration,
    pub max_clock_skew: Duration,
    pub max_timeout: Duration,
    /// Concurrency limit per job group.
    pub groups: BTreeMap<String, usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogTarget {
    Auto,
    Journald,
    Stderr,
}

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

#[derive(Debug, Clone)]
pub struct ContainersConfig {
    /// Run `action.container` jobs through the Docker Engine.
    pub enabled: bool,
    pub docker_socket: PathBuf,
}

/// How the runner reaches AWS under its own identity (its instance role on EC2; the
/// standard credential chain).
#[derive(Debug, Clone, Default)]
pub struct AwsConfig {
    pub region: Option<String>,
    /// A different endpoint for every AWS API (VPC endpoints; a local test server).
    pub endpoint_url: Option<String>,
    /// For role-name templates (`{{.cloud_account.aws.account_id}}`).
    pub account_id: Option<String>,
}

/// The terraform tool on this VM.
#[derive(Debug, Clone)]
pub struct TerraformConfig {
    pub binary: PathBuf,
    pub plan_max_age: Duration,
    pub cli_config_file: Option<PathBuf>,
    pub plugin_cache_dir: Option<PathBuf>,
}

/// The helm tool on this VM.
#[derive(Debug, Clone)]
pub struct HelmConfig {
    pub binary: PathBuf,
}

/// The customer's policies and the evaluation limits.
#[derive(Debug, Clone)]
pub struct PolicyConfig {
    pub dir: PathBuf,
    pub time_limit: Duration,
    pub max_input_bytes: usize,
    /// Address-space limit of the separate evaluator process.
    pub memory_mib: u64,
}

/// How `oci.sync` jobs reach registries.
#[derive(Debug, Clone, Default)]
pub struct OciConfig {
    /// Registry host → base URL: a private endpoint for a registry (for ECR, say, a VPC
    /// endpoint), or in tests ECR's host mapped to a local registry.
    pub registry_endpoints: std::collections::BTreeMap<String, String>,
    pub parallel: usize,
    pub chunk_bytes: u64,
}

/// The customer's lifecycle-role settings.
#[derive(Debug, Clone)]
pub struct RolesConfig {
    /// The CloudFormation install stack whose parameters switch roles and whose
    /// outputs hold their ARNs.
    pub stack_name: Option<String>,
    /// For installs not managed by CloudFormation: a local switches file.
    pub switches_file: Option<PathBuf>,
    /// ExternalId the lifecycle roles' trust policies require.
    pub external_id: Option<String>,
    pub session_min: Duration,
    pub session_max: Duration,
    /// Re-assume a job's role when its session has less than this left.
    pub refresh_before: Duration,
    /// Group (besides root) allowed to pause and resume the runner.
    pub admin_group: Option<String>,
    /// Install name for role-name templates (`{{.install.name}}`).
    pub install_name: Option<String>,
    /// Where container jobs' renewable credential files live (a tmpfs: the keys never
    /// reach the state dir's disk), one directory per job, mounted into its container.
    pub container_credentials_dir: PathBuf,
    /// A statically linked busybox mounted into containers to run their
    /// `credential_process` (any image, even one without a shell, can use it).
    pub busybox: PathBuf,
}

#[derive(Debug, Clone)]
pub struct LoggingConfig {
    pub target: LogTarget,
    pub level: String,
}

/// All problems with a configuration, one line each.
#[derive(Debug, thiserror::Error)]
#[error("{} problem(s) in configuration {}:\n{}", problems.len(), source_name, problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
pub struct ConfigError {
    pub source_name: String,
    pub problems: Vec<String>,
}

impl Config {
    /// Read the file and the process environment.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            source_name: path.display().to_string(),
            problems: vec![format!("cannot read {}: {e}", path.display())],
        })?;
        Self::parse(&text, &path.display().to_string(), std::env::vars())
    }

    pub fn parse(
        text: &str,
        source_name: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let fail = |problems: Vec<String>| ConfigError { source_name: source_name.into(), problems };
        let mut root: toml::Table =
            text.parse().map_err(|e: toml::de::Error| fail(vec![format!("not valid TOML: {e}")]))?;
        let mut problems = Vec::new();
        apply_env_overrides(&mut root, env, &mut problems);
        let digest = byoc_protocol::sha256_hex(toml::to_string(&root).unwrap_or_default().as_bytes());

        let mut top = Fields::new("", root, &mut problems);
        let cp_t = top.table("control_plane");
        let runner_t = top.table("runner");
        let poll_t = top.table("poll");
        let jobs_t = top.table("jobs");
        let logging_t = top.table("logging");
        let sandbox_t = top.table("sandbox");
        let containers_t = top.table("containers");
        let aws_t = top.table("aws");
        let roles_t = top.table("roles");
        let oci_t = top.table("oci");
        let terraform_t = top.table("terraform");
        let helm_t = top.table("helm");
        let policy_t = top.table("policy");
        top.finish();

        let mut f = Fields::new("control_plane", cp_t, &mut problems);
        let url_s: Option<String> = f.required("url");
        let keys_s: Vec<String> = f.get("public_keys").unwrap_or_default();
        let ca_bundle: Option<PathBuf> = f.get::<String>("ca_bundle").map(PathBuf::from);
        let allow_insecure_loopback = f.get("allow_insecure_loopback").unwrap_or(false);
        let request_timeout = f.secs("request_timeout_secs", 30, 1..=600);
        f.finish();
        let url = url_s.and_then(|u| match validate_url(&u, allow_insecure_loopback) {
            Ok(url) => Some(url),
            Err(e) => {
                problems.push(format!("control_plane.url: {e}"));
                None
            }
        });
        let mut public_keys = BTreeMap::new();
        if keys_s.is_empty() {
            problems.push(
                "control_plane.public_keys: at least one pinned control-plane key is required \
                 (base64 Ed25519 public key from the install stack)"
                    .into(),
            );
        }
        for (i, k) in keys_s.iter().enumerate() {
            match byoc_protocol::parse_public_key(k) {
                Ok(key) => {
                    public_keys.insert(byoc_protocol::key_id(&key), key);
                }
                Err(e) => problems.push(format!("control_plane.public_keys[{i}]: {e}")),
            }
        }
        if let Some(ca) = &ca_bundle
            && !ca.is_file()
        {
            problems.push(format!("control_plane.ca_bundle: {} is not a readable file", ca.display()));
        }

        let mut f = Fields::new("runner", runner_t, &mut problems);
        let state_dir =
            PathBuf::from(f.get::<String>("state_dir").unwrap_or_else(|| DEFAULT_STATE_DIR.into()));
        let install_id: Option<String> = f.required("install_id");
        let bootstrap_token_file = f.get::<String>("bootstrap_token_file").map(PathBuf::from);
        let hostname: Option<String> = f.get("hostname");
        f.finish();
        if !state_dir.is_absolute() {
            problems.push(format!("runner.state_dir: {} must be an absolute path", state_dir.display()));
        }

        let mut f = Fields::new("poll", poll_t, &mut problems);
        let wait = f.secs("wait_secs", 30, 1..=60);
        let backoff_initial = Duration::from_millis(f.ranged("backoff_initial_ms", 500, 10..=60_000));
        let backoff_max = f.secs("backoff_max_secs", 30, 1..=3600);
        f.finish();

        let mut f = Fields::new("jobs", jobs_t, &mut problems);
        let drain_grace = f.secs("drain_grace_secs", 300, 0..=86_400);
        let kill_grace = f.secs("kill_grace_secs", 10, 1..=600);
        let heartbeat_interval = f.secs("heartbeat_secs", 15, 1..=300);
        let max_clock_skew = f.secs("max_clock_skew_secs", 60, 0..=3600);
        let max_timeout = f.secs("max_timeout_secs", 6 * 3600, 1..=7 * 86_400);
        let groups_t = f.table("groups");
        f.finish();
        let mut groups: BTreeMap<String, usize> = [("deploys", 1), ("actions", 4), ("syncs", 2)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let mut g = Fields::new("jobs.groups", groups_t, &mut problems);
        for name in ["deploys", "actions", "syncs"] {
            let v = g.ranged(name, groups[name] as u64, 1..=64);
            groups.insert(name.to_string(), v as usize);
        }
        g.finish();

        let mut f = Fields::new("logging", logging_t, &mut problems);
        let target = match f.get::<String>("target").as_deref() {
            None | Some("auto") => LogTarget::Auto,
            Some("journald") => LogTarget::Journald,
            Some("stderr") => LogTarget::Stderr,
            Some(other) => {
                f.problem(format!("logging.target: {other:?} is not one of auto, journald, stderr"));
                LogTarget::Auto
            }
        };
        let level = f.get::<String>("level").unwrap_or_else(|| "info".into());
        f.finish();
        if tracing_subscriber::EnvFilter::try_new(&level).is_err() {
            problems
                .push(format!("logging.level: {level:?} is not a valid filter (try \"info\" or \"debug\")"));
        }
        let mut f = Fields::new("sandbox", sandbox_t, &mut problems);
        let sandbox = SandboxConfig {
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
        f.finish();
        let mut sandbox = sandbox;
        sandbox.egress = parse_egress(Fields::new("sandbox.egress", egress_t, &mut problems));
        for p in &sandbox.extra_ro_paths {
            if !p.is_absolute() {
                problems.push(format!("sandbox.extra_ro_paths: {} must be an absolute path", p.display()));
            }
        }
        let mut f = Fields::new("containers", containers_t, &mut problems);
        let containers = ContainersConfig {
            enabled: f.get("enabled").unwrap_or(true),
            docker_socket: PathBuf::from(
                f.get::<String>("docker_socket").unwrap_or_else(|| "/var/run/docker.sock".into()),
            ),
        };
        f.finish();
        if !containers.docker_socket.is_absolute() {
            problems.push(format!(
                "containers.docker_socket: {} must be an absolute path",
                containers.docker_socket.display()
            ));
        }
        let mut f = Fields::new("aws", aws_t, &mut problems);
        let aws = AwsConfig {
            region: f.get("region"),
            endpoint_url: f.get("endpoint_url"),
            account_id: f.get("account_id"),
        };
        f.finish();
        if let Some(u) = &aws.endpoint_url
            && let Err(e) = validate_url(u, true)
        {
            problems.push(format!("aws.endpoint_url: {e}"));
        }
        let mut f = Fields::new("roles", roles_t, &mut problems);
        let roles = RolesConfig {
            stack_name: f.get("stack_name"),
            switches_file: f.get::<String>("switches_file").map(PathBuf::from),
            external_id: f.get("external_id"),
            // STS accepts 900 s at least; lower values exist for tests of refresh.
            session_min: f.secs("session_min_secs", 900, 1..=43_200),
            session_max: f.secs("session_max_secs", 3600, 1..=43_200),
            refresh_before: f.secs("refresh_before_secs", 300, 0..=3600),
            admin_group: f.get("admin_group"),
            install_name: f.get("install_name"),
            container_credentials_dir: PathBuf::from(
                f.get::<String>("container_credentials_dir")
                    .unwrap_or_else(|| "/run/byoc-runner/credentials".into()),
            ),
            busybox: PathBuf::from(f.get::<String>("busybox").unwrap_or_else(|| "/bin/busybox".into())),
        };
        f.finish();
        if roles.stack_name.is_some() && roles.switches_file.is_some() {
            problems.push("roles: set stack_name or switches_file, not both".into());
        }
        if let Some(p) = &roles.switches_file
            && !p.is_absolute()
        {
            problems.push(format!("roles.switches_file: {} must be an absolute path", p.display()));
        }
        for (key, path) in
            [("container_credentials_dir", &roles.container_credentials_dir), ("busybox", &roles.busybox)]
        {
            if !path.is_absolute() {
                problems.push(format!("roles.{key}: {} must be an absolute path", path.display()));
            }
        }
        if roles.session_min > roles.session_max {
            problems.push("roles.session_min_secs: larger than roles.session_max_secs".into());
        }
        if roles.stack_name.is_some() && aws.region.is_none() {
            problems.push("aws.region: required when roles.stack_name is set".into());
        }
        let mut f = Fields::new("oci", oci_t, &mut problems);
        let oci = OciConfig {
            registry_endpoints: f.get("registry_endpoints").unwrap_or_default(),
            parallel: f.ranged("parallel", 4, 1..=32) as usize,
            // ECR wants chunks of 5 MiB at least (but the last).
            chunk_bytes: f.ranged("chunk_mib", 64, 5..=1024) << 20,
        };
        f.finish();
        let mut f = Fields::new("terraform", terraform_t, &mut problems);
        let terraform = TerraformConfig {
            binary: PathBuf::from(f.get::<String>("binary").unwrap_or_else(|| "/usr/bin/terraform".into())),
            plan_max_age: f.secs("plan_max_age_secs", 3600, 60..=7 * 86_400),
            cli_config_file: f.get::<String>("cli_config_file").map(PathBuf::from),
            plugin_cache_dir: f.get::<String>("plugin_cache_dir").map(PathBuf::from),
        };
        f.finish();
        if !terraform.binary.is_absolute() {
            problems
                .push(format!("terraform.binary: {} must be an absolute path", terraform.binary.display()));
        }
        let mut f = Fields::new("helm", helm_t, &mut problems);
        let helm = HelmConfig {
            binary: PathBuf::from(f.get::<String>("binary").unwrap_or_else(|| "/usr/bin/helm".into())),
        };
        f.finish();
        if !helm.binary.is_absolute() {
            problems.push(format!("helm.binary: {} must be an absolute path", helm.binary.display()));
        }
        let mut f = Fields::new("policy", policy_t, &mut problems);
        let policy = PolicyConfig {
            dir: PathBuf::from(
                f.get::<String>("dir").unwrap_or_else(|| crate::policy::DEFAULT_POLICY_DIR.into()),
            ),
            time_limit: Duration::from_millis(f.ranged("time_limit_ms", 10_000, 10..=600_000)),
            max_input_bytes: (f.ranged("max_input_mib", 64, 1..=1024) << 20) as usize,
            memory_mib: f.ranged("memory_mib", 2048, 256..=65_536),
        };
        f.finish();
        for (host, u) in &oci.registry_endpoints {
            if let Err(e) = validate_url(u, true) {
                problems.push(format!("oci.registry_endpoints.{host:?}: {e}"));
            }
        }
        if backoff_initial > backoff_max {
            problems.push("poll.backoff_initial_ms: larger than poll.backoff_max_secs".into());
        }

        if !problems.is_empty() {
            return Err(fail(problems));
        }
        Ok(Config {
            control_plane: ControlPlaneConfig {
                url: url.expect("validated"),
                public_keys,
                ca_bundle,
                allow_insecure_loopback,
                request_timeout,
            },
            runner: RunnerConfig {
                state_dir,
                install_id: install_id.expect("validated"),
                bootstrap_token_file,
                hostname,
            },
            poll: PollConfig { wait, backoff_initial, backoff_max },
            jobs: JobsConfig {
                drain_grace,
                kill_grace,
                heartbeat_interval,
                max_clock_skew,
                max_timeout,
                groups,
            },
            logging: LoggingConfig { target, level },
            sandbox,
            containers,
            aws,
            roles,
            oci,
            terraform,
            helm,
            policy,
            source: PathBuf::from(source_name),
            digest,
        })
    }
}

fn validate_url(s: &str, allow_insecure_loopback: bool) -> Result<reqwest::Url, String> {
    let url = reqwest::Url::parse(s).map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err("credentials must not be embedded in the URL".into());
    }
    match url.scheme() {
        "https" => Ok(url),
        "http" => {
            let loopback = match url.host() {
                Some(url::Host::Domain(d)) => d == "localhost",
                Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip).is_loopback(),
                Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip).is_loopback(),
                None => false,
            };
            if !loopback {
                Err("plain http:// is only allowed to a loopback address; use https://".into())
            } else if !allow_insecure_loopback {
                Err("plain http:// needs control_plane.allow_insecure_loopback = true (development only)"
                    .into())
            } else {
                Ok(url)
            }
        }
        other => Err(format!("scheme {other:?} is not supported; use https://")),
    }
}

/// `BYOC_RUNNER__POLL__WAIT_SECS=10` sets `[poll] wait_secs = 10`. Values are parsed as
/// TOML when they can be (numbers, booleans, arrays), else taken as strings.
fn apply_env_overrides(
    root: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
    problems: &mut Vec<String>,
) {
    for (name, value) in env {
        let Some(path) = name.strip_prefix(ENV_PREFIX) else { continue };
        let parts: Vec<String> = path.split("__").map(|p| p.to_ascii_lowercase()).collect();
        if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
            problems.push(format!("{name}: expected {ENV_PREFIX}SECTION__KEY"));
            continue;
        }
        let parsed = format!("v = {value}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or(toml::Value::String(value));
        if let Err(e) = insert_path(root, &parts, parsed) {
            problems.push(format!("{name}: {e}"));
        }
    }
}

fn insert_path(table: &mut toml::Table, parts: &[String], value: toml::Value) -> Result<(), String> {
    let (first, rest) = parts.split_first().expect("at least two parts");
    if rest.is_empty() {
        table.insert(first.clone(), value);
        return Ok(());
    }
    match table.entry(first.clone()).or_insert_with(|| toml::Value::Table(Default::default())) {
        toml::Value::Table(t) => insert_path(t, rest, value),
        _ => Err(format!("{first} is not a table")),
    }
}

/// Reads typed fields from one table, collecting problems instead of stopping at the
/// first, and reports every key that was never read as unknown.
struct Fields<'p> {
    section: &'static str,
    table: toml::Table,
    problems: &'p mut Vec<String>,
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
    if !slirp4netns.is_absolute() {
        f.problem(format!("sandbox.egress.slirp4netns: {} must be an absolute path", slirp4netns.display()));
    }
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

impl<'p> Fields<'p> {
    fn new(section: &'static str, table: toml::Table, problems: &'p mut Vec<String>) -> Self {
        Fields { section, table, problems }
    }

    fn name(&self, key: &str) -> String {
        if self.section.is_empty() { key.to_string() } else { format!("{}.{key}", self.section) }
    }

    fn problem(&mut self, p: String) {
        self.problems.push(p);
    }

    fn get<T: serde::de::DeserializeOwned>(&mut self, key: &str) -> Option<T> {
        let v = self.table.remove(key)?;
        match v.clone().try_into::<T>() {
            Ok(t) => Some(t),
            Err(e) => {
                let name = self.name(key);
                let msg = e.to_string();
                self.problems.push(format!("{name}: {} (got {v})", msg.trim()));
                None
            }
        }
    }

    fn required<T: serde::de::DeserializeOwned>(&mut self, key: &str) -> Option<T> {
        let present = self.table.contains_key(key);
        let v = self.get(key);
        if !present {
            let name = self.name(key);
            self.problems.push(format!("{name}: required setting is missing"));
        }
        v
    }

    fn ranged(&mut self, key: &str, default: u64, range: std::ops::RangeInclusive<u64>) -> u64 {
        match self.get::<u64>(key) {
            None => default,
            Some(v) if range.contains(&v) => v,
            Some(v) => {
                let name = self.name(key);
                self.problems.push(format!(
                    "{name}: {v} is out of range {}..={}",
                    range.start(),
                    range.end()
                ));
                default
            }
        }
    }

    fn secs(&mut self, key: &str, default: u64, range: std::ops::RangeInclusive<u64>) -> Duration {
        Duration::from_secs(self.ranged(key, default, range))
    }

    fn table(&mut self, key: &str) -> toml::Table {
        match self.table.remove(key) {
            None => toml::Table::new(),
            Some(toml::Value::Table(t)) => t,
            Some(_) => {
                let name = self.name(key);
                self.problems.push(format!("{name}: must be a table"));
                toml::Table::new()
            }
        }
    }

    fn finish(self) {
        for key in self.table.keys() {
            let name = self.name(key);
            self.problems.push(format!("{name}: unknown setting"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> String {
        byoc_protocol::b64(byoc_protocol::generate_signing_key().verifying_key().as_bytes())
    }

    fn minimal() -> String {
        format!(
            "[control_plane]\nurl = \"https://cp.example.com\"\npublic_keys = [\"{}\"]\n[runner]\ninstall_id = \"inst-1\"\n",
            key()
        )
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::parse(&minimal(), "t", []).unwrap();
        assert_eq!(c.runner.state_dir, PathBuf::from(DEFAULT_STATE_DIR));
        assert_eq!(c.poll.wait, Duration::from_secs(30));
        assert_eq!(c.jobs.groups["deploys"], 1);
        assert_eq!(c.control_plane.public_keys.len(), 1);
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let text = "[control_plane]\nurl = \"http://10.0.0.1\"\npublic_keys = [\"!!\"]\nbogus = 1\n\
                    [poll]\nwait_secs = 900\n[jobs]\nkill_grace_secs = \"ten\"\n[logging]\ntarget = \"syslog\"\n[extra]\n";
        let err = Config::parse(text, "t", []).unwrap_err();
        let all = err.problems.join("\n");
        for needle in [
            "control_plane.url",
            "control_plane.public_keys[0]",
            "control_plane.bogus: unknown setting",
            "runner.install_id: required",
            "poll.wait_secs: 900 is out of range",
            "jobs.kill_grace_secs",
            "logging.target",
            "extra: unknown setting",
        ] {
            assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
        }
        assert_eq!(err.problems.len(), 8, "{all}");
    }

    #[test]
    fn role_settings_are_validated_together() {
        let bad = format!(
            "{}\n[aws]\nendpoint_url = \"ftp://x\"\n[roles]\nstack_name = \"s\"\nswitches_file = \"roles.toml\"\nsession_min_secs = 4000\nsession_max_secs = 3600\n",
            minimal()
        );
        let all = Config::parse(&bad, "t", []).unwrap_err().problems.join("\n");
        for needle in [
            "aws.endpoint_url",
            "not both",
            "roles.switches_file: roles.toml must be an absolute path",
            "session_min_secs: larger than",
            "aws.region: required when roles.stack_name is set",
        ] {
            assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
        }
        let good = format!(
            "{}\n[aws]\nregion = \"eu-west-1\"\n[roles]\nstack_name = \"byoc-install\"\nexternal_id = \"x\"\nadmin_group = \"ops\"\n",
            minimal()
        );
        let c = Config::parse(&good, "t", []).unwrap();
        assert_eq!(c.roles.stack_name.as_deref(), Some("byoc-install"));
        assert_eq!(c.roles.session_min, Duration::from_secs(900));
        assert_eq!(c.roles.session_max, Duration::from_secs(3600));
        assert_eq!(c.aws.region.as_deref(), Some("eu-west-1"));
    }

    #[test]
    fn plain_http_needs_loopback_and_the_dev_flag() {
        let base = minimal().replace("https://cp.example.com", "http://127.0.0.1:9");
        let err = Config::parse(&base, "t", []).unwrap_err();
        assert!(err.problems[0].contains("allow_insecure_loopback"));
        let ok = base.replace("[runner]", "allow_insecure_loopback = true\n[runner]");
        assert!(Config::parse(&ok, "t", []).is_ok());
        let remote = ok.replace("127.0.0.1:9", "example.com");
        let err = Config::parse(&remote, "t", []).unwrap_err();
        assert!(err.problems[0].contains("only allowed to a loopback"));
    }

    #[test]
    fn env_overrides_apply_and_are_validated() {
        let env = vec![
            ("BYOC_RUNNER__POLL__WAIT_SECS".to_string(), "5".to_string()),
            ("BYOC_RUNNER__RUNNER__STATE_DIR".to_string(), "/tmp/x".to_string()),
            ("UNRELATED".to_string(), "1".to_string()),
        ];
        let c = Config::parse(&minimal(), "t", env).unwrap();
        assert_eq!(c.poll.wait, Duration::from_secs(5));
        assert_eq!(c.runner.state_dir, PathBuf::from("/tmp/x"));
        let bad = vec![("BYOC_RUNNER__POLL__NOPE".to_string(), "1".to_string())];
        let err = Config::parse(&minimal(), "t", bad).unwrap_err();
        assert!(err.problems[0].contains("poll.nope: unknown setting"));
    }

    #[test]
    fn syntax_errors_are_reported() {
        let err = Config::parse("[control_plane\n", "t", []).unwrap_err();
        assert!(err.problems[0].contains("not valid TOML"));
    }
}
