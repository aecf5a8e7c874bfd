//! Stage 4: run the claimed job. The working directory (0700) and the log spool are
//! created, `started` is journaled, and the executor runs while a companion task
//! heartbeats the lease (picking up cancellation) and uploads the spooled log. When the
//! executor returns, the spool is fsynced and `finished` is journaled with the log's
//! size and SHA-256 before anything is reported.

use std::os::unix::fs::DirBuilderExt as _;
use std::path::PathBuf;

use std::sync::Arc;

use byoc_job_executors::mask::SecretFeed;
use byoc_job_executors::{ContainerCredentials, ExecContext, ExecOutcome, JobCredentials, JobStatus};
use tokio_util::sync::CancellationToken;

use super::resolve_role::ScopedRole;
use super::{ClaimedJob, Rt};
use crate::journal::{Event, JournalError, now_ms};
use crate::roles::creds::{
    CONTAINER_BUSYBOX, CONTAINER_CREDENTIALS_DIR, CredentialFile, JobEndpoint, JobSession, rfc3339,
};
use crate::roles::sts::{SessionParams, session_duration, sts_identifier, tag_value};
use crate::spool::{SpoolWriter, Uploader};

pub const WORK_DIR: &str = "work";
/// Saved plans of plan-only terraform jobs.
pub const PLANS_DIR: &str = "plans";

pub struct FinishedJob {
    pub job_id: String,
}

pub async fn execute(rt: &Rt, job: ClaimedJob) -> Result<FinishedJob, JournalError> {
    let job_id = job.verified.payload.job_id.clone();
    let work_dir = rt.state_dir.join(WORK_DIR).join(&job_id);
    let started_at_ms = now_ms();
    let network = byoc_job_executors::describe_network(
        job.verified.executor.placement(),
        rt.sandbox.as_ref(),
        rt.containers.as_ref(),
    );
    rt.transition(Event::Started { job_id: job_id.clone(), started_at_ms, network: Some(network) })?;
    tracing::info!("job started");

    let outcome;
    let (log_size, log_sha256);
    match prepare(rt, &job_id, &work_dir) {
        Err(error) => {
            outcome = ExecOutcome::failed(error);
            (log_size, log_sha256) =
                crate::spool::digest_file(&crate::spool::spool_path(&rt.state_dir, &job_id))
                    .unwrap_or((0, byoc_protocol::sha256_hex(b"")));
        }
        Ok(mut spool) => {
            // The role session lives as long as the executor runs; dropping it stops a
            // container's renewal (a process job's endpoint ends with its sandbox).
            let (registration, credentials) = match &job.role {
                None => (None, None),
                Some(role) => match assume_for_job(rt, &job, role).await {
                    Ok((reg, creds, note)) => {
                        let _ = byoc_job_executors::OutputSink::write(&mut spool, note.as_bytes());
                        (Some(reg), Some(creds))
                    }
                    Err(e) => {
                        let _ = byoc_job_executors::OutputSink::write(
                            &mut spool,
                            format!("[runner] {e}\n").as_bytes(),
                        );
                        (None, None)
                    }
                },
            };
            let assume_failed = job.role.is_some() && credentials.is_none();
            let cancel = rt.abort.child_token();
            let done = CancellationToken::new();
            let companion =
                tokio::spawn(heartbeat_and_upload(rt.clone(), job_id.clone(), cancel.clone(), done.clone()));
            // Only jobs that are decided by policy load it (and may note its problems).
            let decided = byoc_protocol::JobKind::parse(&job.verified.payload.kind)
                .is_some_and(byoc_protocol::JobKind::decided_by_policy);
            let policy = if decided { policy_scope(rt, &job, &mut spool) } else { None };
            let ctx = ExecContext {
                job_id: job_id.clone(),
                work_dir: work_dir.clone(),
                timeout: job.verified.timeout,
                kill_grace: rt.config.jobs.kill_grace,
                cancel,
                output: &mut spool,
                sandbox: rt.sandbox.clone(),
                containers: rt.containers.clone(),
                credentials,
                oci: byoc_job_executors::OciSettings {
                    registry_endpoints: rt.config.oci.registry_endpoints.clone(),
                    parallel: rt.config.oci.parallel,
                    chunk_size: rt.config.oci.chunk_bytes,
                    ca_bundle: rt.config.control_plane.ca_bundle.clone(),
                },
                tools: byoc_job_executors::ToolSettings {
                    terraform: rt.config.terraform.binary.clone(),
                    helm: rt.config.helm.binary.clone(),
                    plans_dir: rt.state_dir.join(PLANS_DIR),
                    plan_max_age: rt.config.terraform.plan_max_age,
                    cli_config_file: rt.config.terraform.cli_config_file.clone(),
                    plugin_cache_dir: rt.config.terraform.plugin_cache_dir.clone(),
                },
                policy,
                audit: Some(Arc::new(ExecutorAudit {
                    rt: rt.clone(),
                    job_id: job_id.clone(),
                    kind: job.verified.payload.kind.clone(),
                    operation: job.verified.payload.operation.clone(),
                    role: job.role.as_ref().map(|r| r.derived.role.name.clone()),
                })),
            };
            outcome = if assume_failed {
                ExecOutcome::failed(format!(
                    "could not assume role {:?}; the job did not run (see the job log)",
                    job.role.as_ref().map(|r| r.derived.role.name.as_str()).unwrap_or("")
                ))
            } else {
                byoc_job_executors::run_masked(job.verified.executor.as_ref(), ctx).await
            };
            drop(registration);
            done.cancel();
            let _ = companion.await;
            match spool.finish() {
                Ok(d) => (log_size, log_sha256) = d,
                Err(e) => {
                    tracing::error!(error = %e, "fsync of the job log failed");
                    (log_size, log_sha256) =
                        crate::spool::digest_file(&crate::spool::spool_path(&rt.state_dir, &job_id))
                            .unwrap_or((0, byoc_protocol::sha256_hex(b"")));
                }
            }
        }
    }
    if let Err(e) = std::fs::remove_dir_all(&work_dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(error = %e, path = %work_dir.display(), "could not remove the job's working directory");
    }
    rt.transition(Event::Finished {
        job_id: job_id.clone(),
        status: outcome.status,
        exit_code: outcome.exit_code,
        error: outcome.error.clone(),
        log_size,
        log_sha256,
        started_at_ms: Some(started_at_ms),
        finished_at_ms: now_ms(),
        outputs: outcome.outputs,
    })?;
    match outcome.status {
        JobStatus::Succeeded => tracing::info!(status = outcome.status.as_str(), log_size, "job finished"),
        _ => tracing::warn!(
            status = outcome.status.as_str(),
            exit_code = outcome.exit_code,
            error = outcome.error.as_deref().unwrap_or(""),
            "job finished"
        ),
    }
    Ok(FinishedJob { job_id })
}

/// AssumeRole for the job (audited), then its credential endpoint registration and
/// the environment that reaches the sandbox. Returns a line for the job log.
async fn assume_for_job(
    rt: &Rt,
    job: &ClaimedJob,
    role: &ScopedRole,
) -> Result<(RoleSession, JobCredentials, String), String> {
    let p = &job.verified.payload;
    let roles = &rt.roles;
    let name = &role.derived.role.name;
    let Some(assumer) = &roles.assumer else {
        return Err(format!("role {name:?} cannot be assumed: aws.region is not configured on this runner"));
    };
    let params = SessionParams {
        role_arn: role.arn.clone(),
        session_name: sts_identifier("byoc-", &p.job_id),
        external_id: roles.external_id.clone(),
        source_identity: sts_identifier("", &p.job_id),
        tags: vec![
            ("install".into(), tag_value(&p.install_id)),
            ("operation".into(), tag_value(&format!("{}.{}", p.entity, p.operation))),
            ("job".into(), tag_value(&p.job_id)),
        ],
        duration_secs: session_duration(p.timeout_secs, roles.session_min_secs, roles.session_max_secs),
    };
    let audit = |event: &str, detail: String| {
        let r = byoc_audit::log::Record {
            event: event.into(),
            job: Some(p.job_id.clone()),
            kind: Some(p.kind.clone()),
            operation: Some(p.operation.clone()),
            role: Some(name.clone()),
            detail: Some(detail),
            ..Default::default()
        };
        rt.audit.record(r).map_err(|e| format!("auditing {event}: {e}"))
    };
    let first = match assumer.assume(&params).await {
        Ok(c) => c,
        Err(e) => {
            let msg = format!("AssumeRole {} failed: {}", role.arn, e.message);
            audit("role_assume_failed", msg.chars().take(300).collect())?;
            return Err(msg);
        }
    };
    let expires = rfc3339(first.expiration);
    audit(
        "role_assumed",
        format!(
            "{} session {} for {}s, expires {expires}",
            role.arn, params.session_name, params.duration_secs
        ),
    )?;
    roles.assumed(name, &p.job_id);
    let mut static_env = vec![
        ("AWS_ACCESS_KEY_ID".to_string(), first.access_key_id.clone()),
        ("AWS_SECRET_ACCESS_KEY".to_string(), first.secret_access_key.clone()),
        ("AWS_SESSION_TOKEN".to_string(), first.session_token.clone()),
    ];
    let feed = SecretFeed::default();
    let on_refresh = {
        let rt = rt.clone();
        let (job_id, role_name) = (p.job_id.clone(), name.clone());
        Arc::new(move |params: &SessionParams, c: &crate::roles::sts::Credentials| {
            let r = byoc_audit::log::Record {
                event: "role_session_refreshed".into(),
                job: Some(job_id.clone()),
                role: Some(role_name.clone()),
                detail: Some(format!(
                    "{} session {} expires {}",
                    params.role_arn,
                    params.session_name,
                    rfc3339(c.expiration)
                )),
                ..Default::default()
            };
            if let Err(e) = rt.audit.record(r) {
                tracing::error!(error = %e, "could not audit a role session refresh");
            }
        })
    };
    let session = JobSession::new(
        params.clone(),
        assumer.clone(),
        first,
        roles.refresh_before,
        feed.clone(),
        on_refresh,
    );
    let mut common =
        vec![("BYOC_ROLE".to_string(), name.clone()), ("BYOC_ROLE_ARN".to_string(), role.arn.clone())];
    if let Some(region) = &roles.region {
        common.push(("AWS_REGION".into(), region.clone()));
        common.push(("AWS_DEFAULT_REGION".into(), region.clone()));
    }
    if let Some(url) = &roles.endpoint_url {
        common.push(("AWS_ENDPOINT_URL".into(), url.clone()));
    }
    static_env.extend(common.iter().cloned());
    let intro = format!(
        "[runner] assumed role {name} ({}) chosen by {}; session {} expires {expires}",
        role.arn,
        role.derived.step.as_str(),
        params.session_name
    );
    tracing::info!(role = %name, role_arn = %role.arn, "assumed the job's role");

    // Containers cannot reach the loopback endpoint: a renewed credentials file instead.
    if p.kind == "action.container" {
        let file = if !crate::roles::creds::is_static_elf(&roles.busybox) {
            Err(format!(
                "{} is missing or not statically linked (install busybox-static)",
                roles.busybox.display()
            ))
        } else {
            CredentialFile::start(
                &roles.container_credentials_dir,
                &p.job_id,
                session,
                roles.region.as_deref(),
            )
            .map_err(|e| {
                format!(
                    "writing the credentials file under {}: {e}",
                    roles.container_credentials_dir.display()
                )
            })
        };
        return Ok(match file {
            Ok(file) => {
                let mut env = vec![
                    ("AWS_CONFIG_FILE".to_string(), format!("{CONTAINER_CREDENTIALS_DIR}/config")),
                    // The Go SDK v1 reads the config file only when asked to.
                    ("AWS_SDK_LOAD_CONFIG".to_string(), "1".to_string()),
                ];
                env.extend(common);
                let container = ContainerCredentials {
                    host_dir: file.dir.clone(),
                    mount: CONTAINER_CREDENTIALS_DIR.into(),
                    busybox: roles.busybox.clone(),
                    busybox_mount: CONTAINER_BUSYBOX.into(),
                    env,
                };
                let note =
                    format!("{intro}, renewed before expiry through the container's credential_process\n");
                let creds = JobCredentials {
                    endpoint_env: vec![],
                    endpoint: None,
                    static_env,
                    container: Some(container),
                    feed,
                };
                (RoleSession { _file: Some(file) }, creds, note)
            }
            Err(why) => {
                tracing::warn!(reason = %why, "a container gets its role session's keys without renewal");
                let note = format!("{intro}; the container gets its keys without renewal: {why}\n");
                let creds = JobCredentials {
                    endpoint_env: vec![],
                    endpoint: None,
                    static_env,
                    container: None,
                    feed,
                };
                (RoleSession { _file: None }, creds, note)
            }
        });
    }
    let endpoint = JobEndpoint::new(session);
    let mut endpoint_env = endpoint.env();
    endpoint_env.extend(common);
    let note = format!(
        "{intro}, renewed before expiry through the credential endpoint in the job's own network namespace\n"
    );
    let endpoint: Arc<dyn byoc_job_executors::jobnet::CredentialEndpoint> = endpoint;
    let creds = JobCredentials { endpoint_env, endpoint: Some(endpoint), static_env, container: None, feed };
    Ok((RoleSession { _file: None }, creds, note))
}

/// What keeps a container's role session alive while it runs: dropping it stops the
/// renewal and deletes its credentials file.
struct RoleSession {
    _file: Option<CredentialFile>,
}

/// The policies this job's decisions are made with: the built-in pack at the customer's
/// levels, the vendor's from the signed app config, the customer's own. `None` (and a
/// line in the job log) when the customer's directory has problems: decisions then deny.
fn policy_scope(rt: &Rt, job: &ClaimedJob, log: &mut SpoolWriter) -> Option<byoc_job_executors::PolicyScope> {
    let p = &job.verified.payload;
    let customer = match crate::policy::load(&rt.config.policy.dir) {
        Ok(c) => c,
        Err(problems) => {
            let line = format!(
                "[runner] the customer's policy directory {} has problems, so policy decisions deny: {}\n",
                rt.config.policy.dir.display(),
                problems.join("; ")
            );
            let _ = byoc_job_executors::OutputSink::write(log, line.as_bytes());
            return None;
        }
    };
    // The app config's blanket policies and the declarations for this job's type and
    // component (checked when the job was verified).
    let vendor = match &p.app_config {
        None => vec![],
        Some(app) => {
            let component = p.role_request.as_ref().map(|r| r.entity_name.as_str()).unwrap_or("");
            match crate::app_policies::for_job(app, &p.kind, &p.entity, component) {
                Ok(v) => v,
                Err(problems) => {
                    let line = format!(
                        "[runner] the app config's policies have problems, so policy decisions deny: {}\n",
                        problems.join("; ")
                    );
                    let _ = byoc_job_executors::OutputSink::write(log, line.as_bytes());
                    return None;
                }
            }
        }
    };
    Some(byoc_job_executors::PolicyScope {
        policies: customer.with_vendor(vendor),
        params: customer.params.clone(),
        phase: job
            .role
            .as_ref()
            .map(|r| r.derived.role.role_type.as_str().to_string())
            .unwrap_or_else(|| "none".into()),
        operation: format!("{}.{}", p.entity, p.operation),
        install: p.install_id.clone(),
        limits: byoc_policy::Limits {
            time_per_policy: rt.config.policy.time_limit,
            max_input_bytes: rt.config.policy.max_input_bytes,
        },
        cluster_policies: p
            .app_config
            .as_ref()
            .and_then(|app| crate::app_policies::cluster_policies(app).ok())
            .unwrap_or_default()
            .iter()
            .map(|d| (d.policy().name, d.text.clone()))
            .collect(),
        // This very binary, as `policy-eval`, under an address-space limit.
        evaluator: std::env::current_exe().ok().map(|program| byoc_job_executors::Evaluator {
            program,
            args: vec!["policy-eval".into()],
            memory_mib: rt.config.policy.memory_mib,
        }),
    })
}

/// Records an executor makes (one per synced artifact, say), with the job's identity.
struct ExecutorAudit {
    rt: Rt,
    job_id: String,
    kind: String,
    operation: String,
    role: Option<String>,
}

impl byoc_job_executors::JobAudit for ExecutorAudit {
    fn record(
        &self,
        event: &str,
        detail: String,
        digests: std::collections::BTreeMap<String, String>,
    ) -> Result<(), String> {
        let r = byoc_audit::log::Record {
            event: event.into(),
            job: Some(self.job_id.clone()),
            kind: Some(self.kind.clone()),
            operation: Some(self.operation.clone()),
            role: self.role.clone(),
            digests,
            detail: Some(detail.chars().take(500).collect()),
            ..Default::default()
        };
        self.rt.audit.record(r).map(|_| ()).map_err(|e| e.to_string())
    }
}

fn prepare(rt: &Rt, job_id: &str, work_dir: &PathBuf) -> Result<SpoolWriter, String> {
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(work_dir)
        .map_err(|e| format!("creating working directory {}: {e}", work_dir.display()))?;
    SpoolWriter::create(&rt.state_dir, job_id).map_err(|e| format!("creating the log spool: {e}"))
}

/// Heartbeat the lease and stream the log while the job runs. Errors are logged and
/// retried next tick: an outage must not stop the job; the report stage catches up.
async fn heartbeat_and_upload(rt: Rt, job_id: String, cancel: CancellationToken, done: CancellationToken) {
    let mut uploader = Uploader::new(&rt.state_dir, &job_id);
    let mut tick = tokio::time::interval(rt.config.jobs.heartbeat_interval);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tick.tick() => {}
        }
        match rt.client.heartbeat(&job_id).await {
            Ok(hb) if hb.cancel && !cancel.is_cancelled() => {
                tracing::warn!("control plane cancelled the job");
                cancel.cancel();
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "job heartbeat failed"),
        }
        if let Err(e) = uploader.upload_available(&rt.client).await {
            tracing::debug!(error = %e, "log upload deferred");
        }
    }
}
