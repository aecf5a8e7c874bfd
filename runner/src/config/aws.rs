//! `[aws]` and `[roles]`: how the runner reaches AWS under its own identity, and the
//! customer's lifecycle-role settings.

use std::path::PathBuf;
use std::time::Duration;

use super::fields::{Fields, validate_url};

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

impl AwsConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("aws", table, problems);
        let aws = AwsConfig {
            region: f.get("region"),
            endpoint_url: f.get("endpoint_url"),
            account_id: f.get("account_id"),
        };
        let problems = f.finish();
        if let Some(u) = &aws.endpoint_url
            && let Err(e) = validate_url(u, true)
        {
            problems.push(format!("aws.endpoint_url: {e}"));
        }
        aws
    }
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
    /// The vendor's organization and app ids for role-name templates (`{{.org.id}}`,
    /// `{{.app.id}}`), as the install stack was given them.
    pub org_id: Option<String>,
    pub app_id: Option<String>,
    /// Where container jobs' renewable credential files live (a tmpfs: the keys never
    /// reach the state dir's disk), one directory per job, mounted into its container.
    pub container_credentials_dir: PathBuf,
    /// A statically linked busybox mounted into containers (any image, even one without
    /// a shell, can use it): it relays their output to the runner, holds and configures
    /// their network namespace and runs their `credential_process`.
    pub busybox: PathBuf,
    /// Roles (by name or type) usable only under a local allowance
    /// (`byoc-runner roles allow`) as well as their stack switch.
    pub require_local_allow: Vec<String>,
}

impl RolesConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("roles", table, problems);
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
            org_id: f.get("org_id"),
            app_id: f.get("app_id"),
            container_credentials_dir: f
                .absolute_path("container_credentials_dir", "/run/byoc-runner/credentials"),
            busybox: f.absolute_path("busybox", "/bin/busybox"),
            require_local_allow: f
                .get("require_local_allow")
                .unwrap_or_else(|| vec!["break_glass".to_string()]),
        };
        if let Some(p) = &roles.switches_file {
            f.require_absolute("switches_file", p);
        }
        let problems = f.finish();
        if roles.stack_name.is_some() && roles.switches_file.is_some() {
            problems.push("roles: set stack_name or switches_file, not both".into());
        }
        if roles.session_min > roles.session_max {
            problems.push("roles.session_min_secs: larger than roles.session_max_secs".into());
        }
        roles
    }
}
