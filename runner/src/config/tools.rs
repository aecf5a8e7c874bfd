//! `[terraform]`, `[helm]`, `[oci]` and `[policy]`: the tools deploys run with, how
//! artifacts reach registries, and the customer's policies.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use super::fields::{Fields, validate_url};

/// The terraform tool on this VM.
#[derive(Debug, Clone)]
pub struct TerraformConfig {
    pub binary: PathBuf,
    pub plan_max_age: Duration,
    pub cli_config_file: Option<PathBuf>,
    /// Jobs may bring their own provider mirror (`job_provider_mirrors = "allow"`);
    /// default: allowed unless `cli_config_file` says where providers come from.
    pub job_provider_mirrors: bool,
    pub plugin_cache_dir: Option<PathBuf>,
    pub state: TerraformStateConfig,
}

/// `[terraform.state]`: where workspaces' state lives. With `bucket` (the install
/// stack's state bucket), terraform's `s3` backend under each job's role; without,
/// local state per workspace in the runner's state dir.
#[derive(Debug, Clone, Default)]
pub struct TerraformStateConfig {
    pub bucket: Option<String>,
    /// Default: `aws.region`.
    pub region: Option<String>,
    /// Keys are `<key_prefix>/<workspace>/terraform.tfstate`; default: the install id.
    pub key_prefix: Option<String>,
    /// An S3 endpoint of the customer's (a VPC endpoint).
    pub endpoint: Option<String>,
    /// Jobs may name their own backend (`backend_config`).
    pub allow_job_backend: bool,
}

impl TerraformConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("terraform", table, problems);
        let cli_config_file: Option<PathBuf> = f.get::<String>("cli_config_file").map(PathBuf::from);
        let job_provider_mirrors = match f.get::<String>("job_provider_mirrors").as_deref() {
            None => cli_config_file.is_none(),
            Some("allow") => true,
            Some("refuse") => false,
            Some(other) => {
                f.problem(format!(
                    "terraform.job_provider_mirrors: {other:?} is not \"allow\" or \"refuse\""
                ));
                false
            }
        };
        let terraform = TerraformConfig {
            binary: f.absolute_path("binary", "/usr/bin/terraform"),
            plan_max_age: f.secs("plan_max_age_secs", 3600, 60..=7 * 86_400),
            cli_config_file,
            job_provider_mirrors,
            plugin_cache_dir: f.get::<String>("plugin_cache_dir").map(PathBuf::from),
            state: TerraformStateConfig::default(),
        };
        let state_t = f.table("state");
        let problems = f.finish();
        let mut f = Fields::new("terraform.state", state_t, problems);
        let mut terraform = terraform;
        terraform.state = TerraformStateConfig {
            bucket: f.get("bucket"),
            region: f.get("region"),
            key_prefix: f.get("key_prefix"),
            endpoint: f.get("endpoint"),
            allow_job_backend: f.get("allow_job_backend").unwrap_or(false),
        };
        let problems = f.finish();
        let s = &terraform.state;
        if let Some(b) = &s.bucket
            && (b.len() < 3
                || b.len() > 63
                || !b.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.'))
        {
            problems.push(format!("terraform.state.bucket: {b:?} is not an S3 bucket name"));
        }
        if let Some(u) = &s.endpoint
            && let Err(e) = validate_url(u, true)
        {
            problems.push(format!("terraform.state.endpoint: {e}"));
        }
        if s.bucket.is_none() && (s.region.is_some() || s.endpoint.is_some() || s.key_prefix.is_some()) {
            problems.push("terraform.state: region, key_prefix and endpoint go with bucket".into());
        }
        terraform
    }
}

/// The helm tool on this VM.
#[derive(Debug, Clone)]
pub struct HelmConfig {
    pub binary: PathBuf,
}

impl HelmConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("helm", table, problems);
        let helm = HelmConfig { binary: f.absolute_path("binary", "/usr/bin/helm") };
        f.finish();
        helm
    }
}

/// `[kubernetes]`: what the runner may reach for a job's cluster.
#[derive(Debug, Clone, Default)]
pub struct KubernetesConfig {
    /// API servers (`https://host:port`) the runner may reach although they sit on a
    /// loopback, link-local or host address (a cluster on the VM itself; the suites'
    /// fake API server). Any other server a job names must be elsewhere.
    pub allowed_servers: Vec<String>,
}

impl KubernetesConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("kubernetes", table, problems);
        let k = KubernetesConfig { allowed_servers: f.get("allowed_servers").unwrap_or_default() };
        let problems = f.finish();
        for s in &k.allowed_servers {
            let ok = url::Url::parse(s)
                .is_ok_and(|u| u.scheme() == "https" && u.host_str().is_some() && u.path() == "/");
            if !ok {
                problems.push(format!("kubernetes.allowed_servers: {s:?} is not https://host[:port]"));
            }
        }
        k
    }

    /// The rule the runner connects to a job's cluster by.
    pub fn reach(&self) -> byoc_oci_sync::Reach {
        byoc_oci_sync::Reach::guarded(&self.allowed_servers)
    }
}

/// How `oci.sync` jobs reach registries.
#[derive(Debug, Clone, Default)]
pub struct OciConfig {
    /// Registry host → base URL: a private endpoint for a registry (for ECR, say, a VPC
    /// endpoint), or in tests ECR's host mapped to a local registry.
    pub registry_endpoints: BTreeMap<String, String>,
    pub parallel: usize,
    pub chunk_bytes: u64,
}

impl OciConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("oci", table, problems);
        let oci = OciConfig {
            registry_endpoints: f.get("registry_endpoints").unwrap_or_default(),
            parallel: f.ranged("parallel", 4, 1..=32) as usize,
            // ECR wants chunks of 5 MiB at least (but the last).
            chunk_bytes: f.ranged("chunk_mib", 64, 5..=1024) << 20,
        };
        let problems = f.finish();
        for (host, u) in &oci.registry_endpoints {
            if let Err(e) = validate_url(u, true) {
                problems.push(format!("oci.registry_endpoints.{host:?}: {e}"));
            }
        }
        oci
    }
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

impl PolicyConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("policy", table, problems);
        let policy = PolicyConfig {
            dir: PathBuf::from(
                f.get::<String>("dir").unwrap_or_else(|| crate::customer_policies::DEFAULT_POLICY_DIR.into()),
            ),
            time_limit: Duration::from_millis(f.ranged("time_limit_ms", 10_000, 10..=600_000)),
            max_input_bytes: (f.ranged("max_input_mib", 64, 1..=1024) << 20) as usize,
            memory_mib: f.ranged("memory_mib", 2048, 256..=65_536),
        };
        f.finish();
        policy
    }
}

/// Components fetched by digest (`[artifacts]`): the cache of unpacked artifacts and
/// what one archive may unpack to.
#[derive(Debug, Clone)]
pub struct ArtifactsConfig {
    pub cache_bytes: u64,
    pub max_unpacked_bytes: u64,
    pub max_files: usize,
}

impl ArtifactsConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("artifacts", table, problems);
        let artifacts = ArtifactsConfig {
            cache_bytes: f.ranged("cache_mib", 1024, 0..=1024 * 1024) << 20,
            max_unpacked_bytes: f.ranged("max_unpacked_mib", 512, 1..=64 * 1024) << 20,
            max_files: f.ranged("max_files", 10_000, 1..=1_000_000) as usize,
        };
        f.finish();
        artifacts
    }
}
