//! Runner configuration: TOML file plus `BYOC_RUNNER__SECTION__KEY` environment
//! overrides, validated completely before any side effect. Every problem is collected
//! and reported at once; unknown keys are errors.
//!
//! One file per section, each parsing its own table over the shared collector
//! (`fields.rs`); checks that span sections live here, in `Config::parse`.

mod audit;
mod aws;
mod control_plane;
mod drift;
mod fields;
mod lifecycle;
mod runner;
mod sandbox;
mod tools;
mod update;

use std::path::{Path, PathBuf};

pub use audit::{AuditConfig, AuditExportConfig, CloudWatchSinkConfig, OtlpSinkConfig, S3SinkConfig};
pub use aws::{AwsConfig, RolesConfig};
pub use control_plane::ControlPlaneConfig;
pub use drift::{DRIFT_KINDS, DriftConfig, DriftSchedule};
pub use lifecycle::LifecycleConfig;
pub use runner::{JobsConfig, LogTarget, LoggingConfig, PollConfig, RunnerConfig};
pub use sandbox::{ContainersConfig, SandboxConfig};
pub use tools::{
    ArtifactsConfig, HelmConfig, KubernetesConfig, OciConfig, PolicyConfig, TerraformConfig,
    TerraformStateConfig,
};
pub use update::{UpdateConfig, UpdateMode};

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
    /// `[kubernetes]`: cluster API servers the runner may reach on this VM's addresses.
    pub kubernetes: KubernetesConfig,
    pub policy: PolicyConfig,
    pub artifacts: ArtifactsConfig,
    pub disk: crate::disk::DiskSettings,
    /// `[[guardrails.window]]` and `[[guardrails.window_rule]]`: maintenance windows.
    pub guardrails: crate::guardrails::Guardrails,
    /// `[drift]`: the checks the runner starts itself.
    pub drift: DriftConfig,
    /// `[update]`: the customer's terms for the runner's own updates.
    pub update: UpdateConfig,
    /// `[audit.export]`: the customer's own copies of the audit log.
    pub audit: AuditConfig,
    /// `[lifecycle]`: hand over when the instance is being replaced.
    pub lifecycle: LifecycleConfig,
    /// `[metrics] textfile`: where the daemon writes its metrics for node_exporter.
    pub metrics_textfile: Option<PathBuf>,
    /// Where the configuration was read from (hidden from jobs).
    pub source: PathBuf,
    /// SHA-256 of the effective configuration (file plus overrides), for the audit trail.
    pub digest: String,
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
        fields::apply_env_overrides(&mut root, env, &mut problems);
        let digest = byoc_protocol::sha256_hex(toml::to_string(&root).unwrap_or_default().as_bytes());

        let mut top = fields::Fields::new("", root, &mut problems);
        let mut t = |name: &str| top.table(name);
        let (cp_t, runner_t, poll_t, jobs_t, logging_t, sandbox_t, containers_t) = (
            t("control_plane"),
            t("runner"),
            t("poll"),
            t("jobs"),
            t("logging"),
            t("sandbox"),
            t("containers"),
        );
        let (aws_t, roles_t, oci_t, terraform_t, helm_t, policy_t, artifacts_t) =
            (t("aws"), t("roles"), t("oci"), t("terraform"), t("helm"), t("policy"), t("artifacts"));
        let disk_t = t("disk");
        let metrics_t = t("metrics");
        let guardrails_t = t("guardrails");
        let drift_t = t("drift");
        let kubernetes_t = t("kubernetes");
        let update_t = t("update");
        let audit_t = t("audit");
        let lifecycle_t = t("lifecycle");
        top.finish();

        let control_plane = ControlPlaneConfig::parse(cp_t, &mut problems);
        let runner = RunnerConfig::parse(runner_t, &mut problems);
        let poll = PollConfig::parse(poll_t, &mut problems);
        let jobs = JobsConfig::parse(jobs_t, &mut problems);
        let logging = LoggingConfig::parse(logging_t, &mut problems);
        let sandbox = SandboxConfig::parse(sandbox_t, &mut problems);
        let containers = ContainersConfig::parse(containers_t, &mut problems);
        let aws = AwsConfig::parse(aws_t, &mut problems);
        let roles = RolesConfig::parse(roles_t, &mut problems);
        let oci = OciConfig::parse(oci_t, &mut problems);
        let terraform = TerraformConfig::parse(terraform_t, &mut problems);
        let helm = HelmConfig::parse(helm_t, &mut problems);
        let kubernetes = KubernetesConfig::parse(kubernetes_t, &mut problems);
        let policy = PolicyConfig::parse(policy_t, &mut problems);
        let artifacts = ArtifactsConfig::parse(artifacts_t, &mut problems);
        let guardrails = crate::guardrails::parse(guardrails_t, &mut problems);
        let drift = DriftConfig::parse(drift_t, &mut problems);
        let disk = parse_disk(disk_t, &mut problems);
        let metrics_textfile = parse_metrics(metrics_t, &mut problems);
        let update = UpdateConfig::parse(update_t, &mut problems);
        let audit = AuditConfig::parse(audit_t, &mut problems);
        let lifecycle = LifecycleConfig::parse(lifecycle_t, &mut problems);
        // Across sections.
        if terraform.state.bucket.is_some() && terraform.state.region.is_none() && aws.region.is_none() {
            problems.push("terraform.state.region: required (or aws.region) with a state bucket".into());
        }
        let export = &audit.export;
        let export_regions = [
            ("audit.export.s3.region", export.s3.as_ref().map(|s| s.region.is_some())),
            ("audit.export.cloudwatch.region", export.cloudwatch.as_ref().map(|c| c.region.is_some())),
        ];
        for (name, has_region) in export_regions {
            if has_region == Some(false) && aws.region.is_none() {
                problems.push(format!("{name}: required (or aws.region) with this sink"));
            }
        }
        if roles.stack_name.is_some() && aws.region.is_none() {
            problems.push("aws.region: required when roles.stack_name is set".into());
        }

        let (Some(control_plane), Some(runner), true) = (control_plane, runner, problems.is_empty()) else {
            return Err(fail(problems));
        };
        Ok(Config {
            control_plane,
            runner,
            poll,
            jobs,
            logging,
            sandbox,
            containers,
            aws,
            roles,
            oci,
            terraform,
            helm,
            kubernetes,
            policy,
            artifacts,
            disk,
            guardrails,
            drift,
            update,
            audit,
            lifecycle,
            metrics_textfile,
            source: PathBuf::from(source_name),
            digest,
        })
    }
}

/// `[disk]`: the free space under which new jobs are refused, and the reserve.
fn parse_disk(table: toml::Table, problems: &mut Vec<String>) -> crate::disk::DiskSettings {
    let mut f = fields::Fields::new("disk", table, problems);
    let settings = crate::disk::DiskSettings {
        min_free_bytes: f.ranged("min_free_mib", 2048, 0..=1024 * 1024) << 20,
        min_free_percent: f.ranged("min_free_percent", 5, 0..=90),
        reserve_bytes: f.ranged("reserve_mib", 32, 0..=4096) << 20,
    };
    f.finish();
    settings
}

/// `[metrics]`: the node exporter's textfile, if any.
fn parse_metrics(table: toml::Table, problems: &mut Vec<String>) -> Option<PathBuf> {
    let mut f = fields::Fields::new("metrics", table, problems);
    let path = f.get::<String>("textfile").map(PathBuf::from);
    if let Some(p) = &path {
        f.require_absolute("textfile", p);
    }
    f.finish();
    path
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
