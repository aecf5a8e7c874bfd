//! Lifecycle roles the customer controls (docs/ROLES.md):
//!
//! - `model`: the app's role files, break-glass roles and operation-role matrix;
//! - `template`: role names as Go-style templates over install state;
//! - `chain`: the precedence chain that derives a job's role (and refuses a mismatch);
//! - `switches`: the customer's switches, from the install stack or a local file;
//! - `sts`: AssumeRole per job; `creds`: the per-job credential endpoint;
//! - `pause`: the customer's local pause; `allowance`: time-boxed local allowances;
//! - `inbox`: audit records the CLI leaves for the daemon (`state unlock`).

pub mod allowance;
pub mod chain;
pub mod control;
pub mod creds;
pub mod inbox;
pub mod model;
pub mod pause;
pub mod plan_scope;
pub mod sts;
pub mod switches;
pub mod template;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::state_dir::StateDir;
use model::RoleDef;
use switches::{Snapshot, SwitchSource};
use template::InstallState;

/// `roles.json` in `control/`: what the runner last knew about each role, for
/// `byoc-runner roles` (the admin group reads it there).
pub const STATUS_FILE: &str = "roles.json";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RolesStatus {
    pub switch_source: String,
    /// When the switches were last read, Unix ms.
    pub switches_read_ms: Option<u64>,
    pub roles: Vec<RoleStatus>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoleStatus {
    pub name: String,
    pub role_type: model::RoleType,
    pub defined_in: String,
    /// Its switch parameter in the install stack.
    pub switch_parameter: String,
    pub enabled: bool,
    pub arn: Option<String>,
    pub source: String,
    #[serde(default)]
    pub how_to_enable: Option<String>,
    #[serde(default)]
    pub last_assumed_ms: Option<u64>,
    #[serde(default)]
    pub last_job: Option<String>,
    /// What its terraform plans may do beyond read-only (the app's `plan_actions`).
    #[serde(default)]
    pub plan_actions: Vec<String>,
}

impl RolesStatus {
    pub fn load(state_dir: &Path) -> Option<RolesStatus> {
        Self::read(state_dir).ok().flatten()
    }

    /// As [`Self::load`], but a file that is there and cannot be read or parsed is an
    /// error (for the CLI, which must not answer "no roles" to a permission problem).
    pub fn read(state_dir: &Path) -> Result<Option<RolesStatus>, String> {
        let path = StateDir::of(state_dir).control().join(STATUS_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map(Some).map_err(|e| format!("{}: {e}", path.display()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("reading {}: {e}", path.display())),
        }
    }

    /// Merge a fresh view of the roles an app defines with what was known before.
    pub fn update(&mut self, roles: &[RoleDef], snapshot: &Snapshot, source: String) {
        self.switch_source = source;
        self.switches_read_ms = Some(crate::clock::now_ms());
        for def in roles {
            let sw = snapshot.switch_for(def);
            let fresh = RoleStatus {
                name: def.name.clone(),
                role_type: def.role_type,
                defined_in: def.defined_in.clone(),
                switch_parameter: format!("Enable{}Role", def.key),
                enabled: sw.enabled,
                arn: sw.arn,
                source: sw.source,
                how_to_enable: sw.how_to_enable,
                last_assumed_ms: None,
                last_job: None,
                plan_actions: def.plan_actions.clone(),
            };
            match self.roles.iter_mut().find(|r| r.name == def.name) {
                Some(r) => {
                    let (ms, job) = (r.last_assumed_ms, r.last_job.take());
                    *r = RoleStatus { last_assumed_ms: ms, last_job: job, ..fresh };
                }
                None => self.roles.push(fresh),
            }
        }
        self.roles.sort_by(|a, b| a.name.cmp(&b.name));
    }

    /// Re-evaluate every known role against a new snapshot (`roles --refresh`).
    pub fn refresh(&mut self, snapshot: &Snapshot, source: String) {
        self.switch_source = source;
        self.switches_read_ms = Some(crate::clock::now_ms());
        for r in &mut self.roles {
            let def = RoleDef {
                name: r.name.clone(),
                name_template: r.name.clone(),
                role_type: r.role_type,
                key: r.switch_parameter.trim_start_matches("Enable").trim_end_matches("Role").to_string(),
                display_name: None,
                description: None,
                defined_in: r.defined_in.clone(),
                policies: 0,
                plan_actions: r.plan_actions.clone(),
            };
            let sw = snapshot.switch_for(&def);
            r.enabled = sw.enabled;
            r.arn = sw.arn;
            r.source = sw.source;
            r.how_to_enable = sw.how_to_enable;
        }
    }
}

/// The daemon's role machinery.
pub struct Roles {
    pub install: InstallState,
    pub source: Box<dyn SwitchSource>,
    /// `None` without `aws.region`: a job that asks for a role fails with a clear error.
    pub assumer: Option<Arc<dyn sts::Assumer>>,
    pub external_id: Option<String>,
    pub session_min_secs: u64,
    pub session_max_secs: u64,
    pub refresh_before: std::time::Duration,
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
    pub container_credentials_dir: PathBuf,
    pub busybox: PathBuf,
    /// Roles that also need a local allowance (`roles allow`).
    pub require_local_allow: Vec<String>,
    status_path: PathBuf,
    status: Mutex<RolesStatus>,
}

/// An AWS SDK error in words: its chain of causes without the SDK's debug dump and, when
/// no credentials were found, what the runner looks for and what to check.
#[derive(Debug, Clone, PartialEq)]
pub struct AwsErrorText {
    pub no_credentials: bool,
    pub text: String,
}

pub fn aws_error_text(e: &(dyn std::error::Error + 'static)) -> AwsErrorText {
    let mut causes: Vec<String> = Vec::new();
    let mut next = Some(e);
    while let Some(err) = next {
        // One line a cause; a cause already said by the one before adds nothing.
        let line = err.to_string().lines().next().unwrap_or_default().trim().to_string();
        if !line.is_empty() && !causes.last().is_some_and(|c| c.contains(&line)) {
            causes.push(line);
        }
        next = err.source();
    }
    let text = causes.join(": ");
    if text.contains("no credentials found") || text.contains("credential provider was not enabled") {
        let imds_off =
            std::env::var("AWS_EC2_METADATA_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
        return AwsErrorText {
            no_credentials: true,
            text: format!(
                "no AWS credentials were found: on EC2 the runner uses its instance role through the metadata \
                 service{}; elsewhere set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
                if imds_off { " (switched off here by AWS_EC2_METADATA_DISABLED)" } else { "" }
            ),
        };
    }
    AwsErrorText { no_credentials: false, text }
}

/// The AWS SDK configuration for the runner's own identity.
pub async fn sdk_config(config: &Config) -> Option<aws_config::SdkConfig> {
    let region = config.aws.region.clone()?;
    let mut loader =
        aws_config::defaults(aws_config::BehaviorVersion::latest()).region(aws_config::Region::new(region));
    if let Some(url) = &config.aws.endpoint_url {
        loader = loader.endpoint_url(url);
    }
    Some(loader.load().await)
}

/// The switch source the configuration names.
pub fn switch_source(config: &Config, sdk: Option<&aws_config::SdkConfig>) -> Box<dyn SwitchSource> {
    match (&config.roles.stack_name, &config.roles.switches_file, sdk) {
        (Some(stack), _, Some(sdk)) => Box::new(switches::StackSource {
            client: aws_sdk_cloudformation::Client::new(sdk),
            stack: stack.clone(),
        }),
        (_, Some(path), _) => Box::new(switches::FileSource { path: path.clone() }),
        _ => Box::new(switches::NoSource),
    }
}

pub fn install_state(config: &Config, install_id: &str) -> InstallState {
    InstallState::new(
        install_id,
        config.roles.install_name.as_deref(),
        config.aws.region.as_deref(),
        config.aws.account_id.as_deref(),
    )
    .with("org.id", config.roles.org_id.as_deref())
    .with("app.id", config.roles.app_id.as_deref())
}

impl Roles {
    pub async fn from_config(config: &Config, install_id: &str, state_dir: &Path) -> std::io::Result<Roles> {
        let sdk = sdk_config(config).await;
        let assumer: Option<Arc<dyn sts::Assumer>> = sdk.as_ref().map(|s| {
            Arc::new(sts::StsAssumer { client: aws_sdk_sts::Client::new(s) }) as Arc<dyn sts::Assumer>
        });
        // No job runs yet: credential files left by a runner that was killed belong to
        // jobs that are now interrupted, so their sessions go.
        creds::remove_stale_credential_files(&config.roles.container_credentials_dir);
        let status_path = StateDir::of(state_dir).control().join(STATUS_FILE);
        Ok(Roles {
            install: install_state(config, install_id),
            source: switch_source(config, sdk.as_ref()),
            assumer,
            external_id: config.roles.external_id.clone(),
            session_min_secs: config.roles.session_min.as_secs(),
            session_max_secs: config.roles.session_max.as_secs(),
            refresh_before: config.roles.refresh_before,
            region: config.aws.region.clone(),
            // The SDK sends the runner's own calls to AWS_ENDPOINT_URL when the config
            // names none; what the runner asks under a job's role (ECR's token, the state
            // bucket) and the job's own clients go to the same place.
            endpoint_url: config
                .aws
                .endpoint_url
                .clone()
                .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok().filter(|u| !u.is_empty())),
            container_credentials_dir: config.roles.container_credentials_dir.clone(),
            busybox: config.roles.busybox.clone(),
            require_local_allow: config.roles.require_local_allow.clone(),
            status: Mutex::new(RolesStatus::load(state_dir).unwrap_or_default()),
            status_path,
        })
    }

    fn save_status(&self, status: &RolesStatus) {
        let bytes = serde_json::to_vec_pretty(status).unwrap_or_default();
        let parent = self.status_path.parent().unwrap_or(Path::new("."));
        let written = byoc_statefs::create_dir(parent, 0o700)
            .and_then(|()| crate::state_dir::write(&self.status_path, &bytes, 0o644));
        if let Err(e) = written {
            tracing::warn!(error = %e, "could not write {}", self.status_path.display());
        }
    }

    /// Record a fresh read of the switches for the roles an app defines.
    pub fn observe(&self, roles: &[RoleDef], snapshot: &Snapshot) {
        let mut s = self.status.lock().unwrap_or_else(|e| e.into_inner());
        s.update(roles, snapshot, self.source.describe());
        self.save_status(&s);
    }

    pub fn assumed(&self, role: &str, job_id: &str) {
        let mut s = self.status.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = s.roles.iter_mut().find(|r| r.name == role) {
            r.last_assumed_ms = Some(crate::clock::now_ms());
            r.last_job = Some(job_id.to_string());
        }
        self.save_status(&s);
    }
}
