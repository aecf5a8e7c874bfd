//! What an executor runs with: `ExecContext`, built in one place (`ExecSettings`).
//! A context is the job's settings plus the sink its output goes to; a step of a
//! multi-step job, or the masking wrapper, takes the settings and builds a context of
//! its own around another sink.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::{
    ContainerSettings, JobAudit, JobCredentials, JobPolicies, OciSettings, OutputSink, SandboxSettings,
    ToolSettings,
};

pub struct ExecContext<'a> {
    /// Everything about the job but where its output goes.
    pub settings: ExecSettings,
    pub output: &'a mut dyn OutputSink,
}

/// Everything in an `ExecContext` but its output sink. Defaults: a 60 s timeout, 5 s
/// kill grace, no sandbox, no containers, no credentials, no audit, no policy (so jobs
/// that need a decision are refused).
#[derive(Clone)]
pub struct ExecSettings {
    pub job_id: String,
    /// The job's private working directory (created 0700 by the runner).
    pub work_dir: PathBuf,
    pub timeout: Duration,
    /// Grace between the escalation steps interrupt → terminate → kill.
    pub kill_grace: Duration,
    pub cancel: CancellationToken,
    pub sandbox: Option<SandboxSettings>,
    /// `None`: container actions are refused.
    pub containers: Option<ContainerSettings>,
    /// The assumed role's credentials, for jobs that asked for a role (`None`: the job
    /// gets no AWS credentials at all).
    pub credentials: Option<JobCredentials>,
    pub oci: OciSettings,
    /// Where the runner may connect for a job's cluster: the rule, and the API servers
    /// the customer's configuration names (`[kubernetes] allowed_servers`).
    pub cluster_reach: byoc_oci_sync::Reach,
    pub audit: Option<Arc<dyn JobAudit>>,
    pub tools: ToolSettings,
    /// `None`: jobs that need a policy decision are refused.
    pub policy: Option<JobPolicies>,
    /// The digest of the component artifact the job deploys, once fetched: its policy
    /// decisions are audited with it.
    pub artifact: Option<String>,
    /// Stop after the policy decision: nothing is applied (`run-local --plan-only`).
    pub decide_only: bool,
    /// Asked before an allowed plan is applied, when the customer requires approval.
    pub apply_approval: Option<Arc<dyn crate::policy_gate::ApplyApproval>>,
    /// The customer's secrets the job may name (`None`: a job naming one fails).
    pub secrets: Option<crate::secrets::SecretSettings>,
    /// Verifies and stages a `runner.update`'s release (`None`: such a job fails).
    pub update: Option<crate::runner_update::Stager>,
    /// The job is held to its lease: each sandbox it runs stops when the lease runs
    /// out unrenewed (`None`: the lease cannot pass to another runner).
    pub lease: Option<Arc<byoc_sandbox::lease::LeaseBinding>>,
}

impl ExecContext<'_> {
    pub fn builder(job_id: impl Into<String>, work_dir: impl Into<PathBuf>) -> ExecSettings {
        ExecSettings {
            job_id: job_id.into(),
            work_dir: work_dir.into(),
            timeout: Duration::from_secs(60),
            kill_grace: Duration::from_secs(5),
            cancel: CancellationToken::new(),
            sandbox: None,
            containers: None,
            credentials: None,
            oci: OciSettings::default(),
            cluster_reach: byoc_oci_sync::Reach::guarded(Vec::<String>::new()),
            audit: None,
            tools: ToolSettings::default(),
            policy: None,
            artifact: None,
            decide_only: false,
            apply_approval: None,
            secrets: None,
            update: None,
            lease: None,
        }
    }
}

impl<'a> ExecContext<'a> {
    /// This context's settings (cloned), to build a step's context from.
    pub fn settings(&self) -> ExecSettings {
        self.settings.clone()
    }

    /// The settings and the sink, apart (the masker wraps the sink).
    pub fn split(self) -> (ExecSettings, &'a mut dyn OutputSink) {
        (self.settings, self.output)
    }
}

impl ExecSettings {
    pub fn build(self, output: &mut dyn OutputSink) -> ExecContext<'_> {
        ExecContext { settings: self, output }
    }

    pub fn timeout(mut self, timeout: Duration, kill_grace: Duration) -> Self {
        self.timeout = timeout;
        self.kill_grace = kill_grace;
        self
    }
    pub fn cancel(mut self, cancel: CancellationToken) -> Self {
        self.cancel = cancel;
        self
    }
    pub fn lease(mut self, lease: Option<Arc<byoc_sandbox::lease::LeaseBinding>>) -> Self {
        self.lease = lease;
        self
    }
    pub fn isolation(
        mut self,
        sandbox: Option<SandboxSettings>,
        containers: Option<ContainerSettings>,
    ) -> Self {
        self.sandbox = sandbox;
        self.containers = containers;
        self
    }
    pub fn credentials(mut self, credentials: Option<JobCredentials>) -> Self {
        self.credentials = credentials;
        self
    }
    pub fn oci(mut self, oci: OciSettings) -> Self {
        self.oci = oci;
        self
    }
    pub fn cluster_reach(mut self, reach: byoc_oci_sync::Reach) -> Self {
        self.cluster_reach = reach;
        self
    }
    pub fn tools(mut self, tools: ToolSettings) -> Self {
        self.tools = tools;
        self
    }
    pub fn policy(mut self, policy: Option<JobPolicies>) -> Self {
        self.policy = policy;
        self
    }
    pub fn apply_approval(mut self, approval: Option<Arc<dyn crate::policy_gate::ApplyApproval>>) -> Self {
        self.apply_approval = approval;
        self
    }
    pub fn secrets(mut self, secrets: Option<crate::secrets::SecretSettings>) -> Self {
        self.secrets = secrets;
        self
    }
    pub fn update(mut self, stager: Option<crate::runner_update::Stager>) -> Self {
        self.update = stager;
        self
    }
    pub fn decide_only(mut self, decide_only: bool) -> Self {
        self.decide_only = decide_only;
        self
    }
    pub fn audit(mut self, audit: Arc<dyn JobAudit>) -> Self {
        self.audit = Some(audit);
        self
    }
}
