//! Stage 8, execute: `AssumedJob` → `RanJob`. The working directory (0700) and the log
//! spool are created, `started` is journaled, and the executor runs while a companion
//! task heartbeats the lease (picking up cancellation) and uploads the spooled log.
//! When the executor returns, the spool is fsynced and digested and the working
//! directory removed; `record` journals the end. A job whose role could not be assumed
//! goes through `not_run`: started, failed, its reason at the head of its log, the
//! executor never called.

use std::os::unix::fs::DirBuilderExt as _;
use std::path::PathBuf;
use std::sync::Arc;

use byoc_job_executors::{ExecContext, ExecOutcome};
use tokio_util::sync::CancellationToken;

use super::VerifiedJob;
use super::assume_role::{AssumedJob, NotAssumed, Session};
use super::gate::ClearedJob;
use crate::clock::now_ms;
use crate::journal::{Event, RecordError};
use crate::runtime::Rt;
use crate::spool::{LogCap, SpoolDigest, SpoolWriter, Uploader};
use crate::state_dir::StateDir;

/// A job that ran (or was refused a role), before its end is journaled.
pub struct RanJob {
    pub verified: VerifiedJob,
    pub started_at_ms: u64,
    pub outcome: ExecOutcome,
    /// The spooled log's size, SHA-256 and what the cap left out.
    pub log: SpoolDigest,
}

pub async fn execute(rt: &Rt, job: AssumedJob) -> Result<RanJob, RecordError> {
    let AssumedJob { cleared, session } = job;
    run(rt, cleared, session, None).await
}

/// A job that may not run: its role could not be assumed.
pub async fn not_run(rt: &Rt, job: NotAssumed) -> Result<RanJob, RecordError> {
    let NotAssumed { cleared, log_note, error } = job;
    let session = Session { log_note: Some(log_note), ..Session::default() };
    run(rt, cleared, session, Some(error)).await
}

/// `refused`: the executor is not called and the job fails with this error.
async fn run(
    rt: &Rt,
    mut job: ClearedJob,
    session: Session,
    refused: Option<String>,
) -> Result<RanJob, RecordError> {
    let job_id = job.verified.payload.job_id.clone();
    let work_dir = StateDir::of(&rt.state_dir).work().join(&job_id);
    let started_at_ms = now_ms();
    let network = byoc_job_executors::describe_network(
        job.verified.executor.placement(),
        rt.sandbox.as_ref(),
        rt.containers.as_ref(),
    );
    rt.transition(Event::Started {
        job_id: job_id.clone(),
        started_at_ms,
        network: Some(network),
        state_workspace: job.verified.executor.state_workspace(),
    })?;

    let (outcome, log) = match prepare(rt, &job_id, &work_dir) {
        Err(error) => (ExecOutcome::failed(error.to_string()), spool_as_found(rt, &job_id)),
        Ok(spool) => run_spooled(rt, &mut job, session, refused, &work_dir, spool).await,
    };
    for dir in std::iter::once(work_dir.clone())
        .chain(byoc_job_executors::BESIDE_WORK.iter().map(|s| byoc_job_executors::beside_work(&work_dir, s)))
    {
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(error = %e, path = %dir.display(), "Could not remove the job's working directory: {e}.");
        }
    }
    Ok(RanJob { verified: job.verified, started_at_ms, outcome, log })
}

/// The job's run with its log open: the companion (heartbeats, log uploads, approvals
/// held), the window's close, the executor with everything it is given, the log
/// finished.
async fn run_spooled(
    rt: &Rt,
    job: &mut ClearedJob,
    session: Session,
    refused: Option<String>,
    work_dir: &std::path::Path,
    mut spool: SpoolWriter,
) -> (ExecOutcome, SpoolDigest) {
    let job_id = job.verified.payload.job_id.clone();
    for note in [&session.log_note, &job.policy.note].into_iter().flatten() {
        let _ = byoc_job_executors::OutputSink::write(&mut spool, note.as_bytes());
    }
    let cancel = rt.abort.child_token();
    let done = CancellationToken::new();
    let holding = super::plan_approval::Holding::default();
    let companion = tokio::spawn(heartbeat_and_upload(
        rt.clone(),
        job.verified.origin,
        job_id.clone(),
        cancel.clone(),
        done.clone(),
        holding.clone(),
    ));
    let apply_approval = super::plan_approval::PlanApprover::for_job(rt, &job.verified, holding);
    let window_closed = CancellationToken::new();
    if let Some(close) = &job.window_close {
        tokio::spawn(cancel_at_window_close(
            rt.clone(),
            close.at,
            cancel.clone(),
            window_closed.clone(),
            done.clone(),
        ));
    }
    let secrets = secret_settings(rt, job);
    let ctx = ExecContext::builder(job_id.clone(), work_dir.to_path_buf())
        .timeout(job.verified.timeout, rt.config.jobs.kill_grace)
        .cancel(cancel)
        .lease(rt.leases.get(&job_id))
        .isolation(rt.sandbox.clone(), rt.containers.clone())
        .credentials(session.credentials)
        .oci(oci_settings(rt))
        .cluster_reach(rt.config.kubernetes.reach())
        .tools(tool_settings(rt))
        .policy(job.policy.scope.take())
        .secrets(secrets)
        .apply_approval(apply_approval)
        .update(update_stager(rt, job))
        .audit(Arc::new(ExecutorAudit {
            rt: rt.clone(),
            job_id: job_id.clone(),
            kind: job.verified.payload.kind.clone(),
            operation: job.verified.payload.operation.clone(),
            role: job.role.as_ref().map(|r| r.derived.role.name.clone()),
        }))
        .build(&mut spool);
    let mut ran = match refused {
        Some(why) => ExecOutcome::failed(why),
        None => byoc_job_executors::run_masked(job.verified.executor.as_ref(), ctx).await,
    };
    if let Some(close) = job.window_close.as_ref().filter(|_| window_closed.is_cancelled())
        && ran.status == byoc_protocol::JobStatus::Cancelled
    {
        ran.error = Some(closed_by_window(close));
    }
    drop(session.keep_alive);
    done.cancel();
    let _ = companion.await;
    rt.leases.release(&job_id);
    let log = match spool.finish_with(Some(&outcome_line(&ran))) {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(error = %e, "Finishing the job log failed: {e}.");
            spool_as_found(rt, &job_id)
        }
    };
    (ran, log)
}

/// The log's last line: how the job ended, in the words its result uses.
fn outcome_line(ran: &ExecOutcome) -> String {
    let code = ran.exit_code.map(|c| format!(", exit code {c}")).unwrap_or_default();
    // One line, no control characters: nothing in an error moves the cursor over it.
    let why = ran
        .error
        .as_deref()
        .map(|e| format!(": {}", e.lines().next().unwrap_or("").replace(|c: char| c.is_control(), " ")))
        .unwrap_or_default();
    format!("[runner] job {}{code}{why}", ran.status.as_str().replace('_', " "))
}

/// What the job reads the customer's secrets with: the app config's declarations (as
/// verified), the install's Secrets Manager, the digest key and the job's role. `None`
/// for jobs that name no secret and declare none (and when the digest key cannot be
/// had: a job naming secrets then fails with `secret_unavailable`).
/// For a `runner.update`: the release is verified with the pinned key and staged.
fn update_stager(rt: &Rt, job: &ClearedJob) -> Option<byoc_job_executors::runner_update::Stager> {
    job.verified.executor.runner_update()?;
    Some(Arc::new(crate::update::stage::Stager {
        state_dir: rt.state_dir.clone(),
        key: rt.config.update.release_key.clone(),
        current: crate::update::running_version().to_string(),
        audit: Some(rt.audit.clone()),
    }))
}

fn secret_settings(rt: &Rt, job: &ClearedJob) -> Option<byoc_job_executors::secrets::SecretSettings> {
    let v = &job.verified;
    if v.secrets.is_empty() && v.executor.secret_uses().is_empty() {
        return None;
    }
    let role = job
        .role
        .as_ref()
        .map(|r| (r.derived.role.role_type.as_str().to_string(), r.derived.role.name.clone()));
    crate::secrets::settings(
        &rt.state_dir,
        &rt.install_id,
        rt.config.aws.endpoint_url.as_deref(),
        v.secrets.clone(),
        role,
    )
    .inspect_err(|e| tracing::error!(error = %e, "The secrets' digest key is unavailable: {e}."))
    .ok()
}

/// Why a job its window's closing cancelled was cancelled.
fn closed_by_window(close: &super::window::WindowClose) -> String {
    format!(
        "maintenance window {:?} closed at {} and its rule cancels jobs then (on_close = \"cancel\")",
        close.window,
        crate::clock::rfc3339(close.at)
    )
}

/// How `oci.sync` reaches registries, from the configuration.
fn oci_settings(rt: &Rt) -> byoc_job_executors::OciSettings {
    byoc_job_executors::OciSettings {
        registry_endpoints: rt.config.oci.registry_endpoints.clone(),
        parallel: rt.config.oci.parallel,
        chunk_size: rt.config.oci.chunk_bytes,
        ca_bundle: rt.config.control_plane.ca_bundle.clone(),
    }
}

/// The tools jobs run (terraform, helm), where their plans, state and fetched
/// components live.
fn tool_settings(rt: &Rt) -> byoc_job_executors::ToolSettings {
    byoc_job_executors::ToolSettings {
        terraform: rt.config.terraform.binary.clone(),
        helm: rt.config.helm.binary.clone(),
        plans_dir: StateDir::of(&rt.state_dir).plans(),
        plan_max_age: rt.config.terraform.plan_max_age,
        cli_config_file: rt.config.terraform.cli_config_file.clone(),
        job_provider_mirrors: rt.config.terraform.job_provider_mirrors,
        plugin_cache_dir: rt.config.terraform.plugin_cache_dir.clone(),
        artifacts: artifact_cache(rt),
        // The runner deploys only what was synced into the install's registry.
        artifact_source: byoc_job_executors::artifact::ArtifactSource::InstallRegistry,
        state: terraform_state(rt),
    }
}

/// Where terraform workspaces' state lives: the customer's bucket, or local state in
/// the state dir.
pub fn terraform_state(rt: &Rt) -> byoc_job_executors::terraform::state::StateSettings {
    use byoc_job_executors::terraform::state::{Backend, StateSettings};
    let s = &rt.config.terraform.state;
    let backend = match &s.bucket {
        Some(bucket) => Backend::S3 {
            bucket: bucket.clone(),
            region: s.region.clone().or_else(|| rt.config.aws.region.clone()).unwrap_or_default(),
            key_prefix: s.key_prefix.clone().unwrap_or_else(|| rt.install_id.clone()),
            endpoint: s.endpoint.clone(),
        },
        None => Backend::Local { root: StateDir::of(&rt.state_dir).tfstate() },
    };
    StateSettings { backend, allow_job_backend: s.allow_job_backend }
}

/// Where components fetched by digest are cached, and the unpacking limits.
pub fn artifact_cache(rt: &Rt) -> byoc_job_executors::artifact::CacheSettings {
    let a = &rt.config.artifacts;
    byoc_job_executors::artifact::CacheSettings {
        dir: (a.cache_bytes > 0).then(|| StateDir::of(&rt.state_dir).artifacts()),
        max_bytes: a.cache_bytes,
        limits: byoc_job_executors::artifact::unpack::Limits {
            max_entries: a.max_files,
            max_bytes: a.max_unpacked_bytes,
            ..Default::default()
        },
    }
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
    ) -> Result<(), byoc_job_executors::AuditFailed> {
        let r = byoc_audit::log::Record {
            digests,
            ..crate::audit_records::about_job(
                event,
                [&self.job_id, &self.kind, &self.operation],
                self.role.as_deref(),
                detail.chars().take(500).collect::<String>(),
            )
        };
        self.rt.audit.record(r).map(|_| ()).map_err(|e| byoc_job_executors::AuditFailed(e.to_string()))
    }
}

/// What stops a job before its executor runs: no place to work or to log.
#[derive(Debug, thiserror::Error)]
enum PrepareError {
    #[error("creating working directory {path}: {source}")]
    WorkDir { path: PathBuf, source: std::io::Error },
    #[error("creating the log spool: {0}")]
    Spool(std::io::Error),
}

fn prepare(rt: &Rt, job_id: &str, work_dir: &PathBuf) -> Result<SpoolWriter, PrepareError> {
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(work_dir)
        .map_err(|source| PrepareError::WorkDir { path: work_dir.clone(), source })?;
    // A job's log never takes the space held back for the journal and audit log.
    let floor = rt.config.disk.reserve_bytes;
    SpoolWriter::create(&rt.state_dir, job_id, LogCap::of(rt.config.jobs.log_max_bytes), floor)
        .map_err(PrepareError::Spool)
}

/// What the spool holds when the writer's own account is lost (it could not be created
/// or finished): digested from the file.
fn spool_as_found(rt: &Rt, job_id: &str) -> SpoolDigest {
    let (size, sha256) = crate::spool::digest_file(&crate::spool::spool_path(&rt.state_dir, job_id))
        .unwrap_or((0, byoc_protocol::sha256_hex(b"")));
    SpoolDigest { size, sha256, omitted: 0 }
}

/// Cancel the job when its maintenance window closes (a rule with `on_close =
/// "cancel"`), unless it ended first.
async fn cancel_at_window_close(
    rt: Rt,
    closes_at: i64,
    cancel: CancellationToken,
    closed: CancellationToken,
    done: CancellationToken,
) {
    let left = closes_at.saturating_sub(rt.clock.unix_now()).max(0) as u64;
    tokio::select! {
        _ = done.cancelled() => {}
        _ = tokio::time::sleep(std::time::Duration::from_secs(left)) => {
            tracing::warn!("The job's maintenance window closed: cancelling it (on_close = \"cancel\").");
            closed.cancel();
            cancel.cancel();
        }
    }
}

/// Heartbeat the lease and stream the log while the job runs. Errors are logged and
/// retried next tick: an outage must not stop the job; the report stage catches up.
async fn heartbeat_and_upload(
    rt: Rt,
    origin: super::Origin,
    job_id: String,
    cancel: CancellationToken,
    done: CancellationToken,
    holding: super::plan_approval::Holding,
) {
    let mut uploader = Uploader::new(&rt.state_dir, &job_id);
    let mut tick =
        tokio::time::interval(rt.leases.heartbeat_every(&job_id, rt.config.jobs.heartbeat_interval));
    tick.tick().await;
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tick.tick() => {}
        }
        let waiting = holding.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let sent = crate::leases::now_ns();
        match rt.plane(origin).heartbeat(&job_id, waiting.as_ref()).await {
            Ok(hb) if hb.cancel && !cancel.is_cancelled() => {
                tracing::warn!("Control plane cancelled the job.");
                cancel.cancel();
            }
            Ok(hb) => rt.leases.renewed(&job_id, sent, hb.lease_secs),
            Err(e) if crate::control_plane::is_fenced(&e) => {
                // The control plane gave the job to another runner (this one stopped
                // answering for longer than the lease): stop it now; its result will
                // be refused and is journaled as fenced, never reported.
                if !cancel.is_cancelled() {
                    tracing::warn!(error = %e, "The job's lease was given to another runner: stopping it here.");
                    cancel.cancel();
                }
            }
            Err(e) => tracing::warn!(error = %e, "Job heartbeat failed: {e}."),
        }
        if let Err(e) = uploader.upload_available(rt.plane(origin)).await {
            tracing::debug!(error = %e, "Log upload deferred: {e}.");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::authorize::PolicyChoice;
    use crate::testing::{self, Fakes, journaled};
    use byoc_job_executors::JobStatus;

    fn cleared(f: &Fakes, verified: VerifiedJob) -> ClearedJob {
        testing::receive(f, &verified);
        f.rt.transition(Event::Claimed { job_id: verified.payload.job_id.clone(), lease_secs: 60, epoch: 0 })
            .expect("journal");
        ClearedJob { verified, role: None, policy: PolicyChoice::default(), window_close: None }
    }

    fn assumed(f: &Fakes, verified: VerifiedJob, session: Session) -> AssumedJob {
        AssumedJob { cleared: cleared(f, verified), session }
    }

    /// Executed and recorded: the journal's account of its end.
    async fn executed(f: &Fakes, job: AssumedJob) -> crate::journal::Finished {
        let ran = execute(&f.rt, job).await.expect("journal");
        finished(f, ran)
    }

    fn finished(f: &Fakes, ran: RanJob) -> crate::journal::Finished {
        let id = ran.verified.payload.job_id.clone();
        crate::pipeline::record::record(&f.rt, ran).expect("journal");
        f.rt.journal.job(&id).and_then(|j| j.finished).expect("finished")
    }

    #[tokio::test]
    async fn a_job_runs_and_its_log_is_spooled_digested_and_journaled() {
        let f = testing::runtime().await;
        let job = assumed(&f, testing::verified("job-1", None), Session::default());
        let done = executed(&f, job).await;
        assert_eq!(journaled(&f), ["received", "claimed", "started", "finished"]);
        assert_eq!(done.status, JobStatus::Succeeded);
        let log = std::fs::read(crate::spool::spool_path(&f.rt.state_dir, "job-1")).expect("spool");
        // The job's output, then the runner's line of how it ended: a log never just stops.
        let want = b"noop\n[runner] job succeeded, exit code 0\n";
        assert_eq!(String::from_utf8_lossy(&log), String::from_utf8_lossy(want));
        assert_eq!((done.log_size, done.log_sha256), (want.len() as u64, byoc_protocol::sha256_hex(want)));
        assert!(
            !StateDir::of(&f.rt.state_dir).work().join("job-1").exists(),
            "the working directory is removed"
        );
    }

    #[tokio::test]
    async fn a_job_whose_role_could_not_be_assumed_fails_without_running() {
        let f = testing::runtime().await;
        let refused = NotAssumed {
            cleared: cleared(&f, testing::verified("job-1", None)),
            log_note: "[runner] AssumeRole arn:x failed: AccessDenied\n".into(),
            error: "could not assume role \"maintenance\"; the job did not run".into(),
        };
        let ran = not_run(&f.rt, refused).await.expect("journal");
        let done = finished(&f, ran);
        assert_eq!(done.status, JobStatus::Failed);
        assert!(done.error.as_deref().is_some_and(|e| e.contains("did not run")));
        let log = std::fs::read_to_string(crate::spool::spool_path(&f.rt.state_dir, "job-1")).expect("spool");
        assert_eq!(
            log,
            "[runner] AssumeRole arn:x failed: AccessDenied\n[runner] job failed: could not assume role \"maintenance\"; the job did not run\n",
            "the executor never ran"
        );
    }

    /// Runs until cancelled.
    struct UntilCancelled;

    impl byoc_job_executors::Executor for UntilCancelled {
        fn effect(&self) -> byoc_protocol::Effect {
            byoc_protocol::Effect::Run
        }

        fn run<'a>(&'a self, ctx: ExecContext<'a>) -> byoc_job_executors::ExecFuture<'a> {
            Box::pin(async move {
                ctx.settings.cancel.cancelled().await;
                ExecOutcome {
                    status: JobStatus::Cancelled,
                    exit_code: None,
                    error: None,
                    outputs: Default::default(),
                }
            })
        }
    }

    #[tokio::test]
    async fn a_cancellation_carried_by_a_heartbeat_reaches_the_executor() {
        let f = testing::runtime().await;
        f.cp.heartbeats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(Ok(byoc_protocol::JobHeartbeatResponse { lease_secs: 60, cancel: true }));
        let mut verified = testing::verified("job-1", None);
        verified.executor = Box::new(UntilCancelled);
        let done = executed(&f, assumed(&f, verified, Session::default())).await;
        assert_eq!(done.status, JobStatus::Cancelled);
        assert_eq!(f.cp.calls(), ["heartbeat job-1"]);
    }

    #[tokio::test]
    async fn a_start_that_cannot_be_journaled_runs_nothing() {
        let f = testing::runtime().await;
        let job = assumed(&f, testing::verified("job-1", None), Session::default());
        f.journal.fail_appends.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(execute(&f.rt, job).await.is_err());
        assert!(
            !crate::spool::spool_path(&f.rt.state_dir, "job-1").exists() || {
                std::fs::read(crate::spool::spool_path(&f.rt.state_dir, "job-1")).is_ok_and(|l| l.is_empty())
            }
        );
    }
}
