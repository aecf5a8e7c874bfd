//! Stage 4: run the claimed job. The working directory (0700) and the log spool are
//! created, `started` is journaled, and the executor runs while a companion task
//! heartbeats the lease (picking up cancellation) and uploads the spooled log. When the
//! executor returns, the spool is fsynced and `finished` is journaled with the log's
//! size and SHA-256 before anything is reported.

use std::os::unix::fs::DirBuilderExt as _;
use std::path::PathBuf;

use byoc_job_executors::{ExecContext, ExecOutcome, JobStatus};
use tokio_util::sync::CancellationToken;

use super::{ClaimedJob, Rt};
use crate::journal::{Event, JournalError, now_ms};
use crate::spool::{SpoolWriter, Uploader};

pub const WORK_DIR: &str = "work";

pub struct FinishedJob {
    pub job_id: String,
}

pub async fn execute(rt: &Rt, job: ClaimedJob) -> Result<FinishedJob, JournalError> {
    let job_id = job.verified.payload.job_id.clone();
    let work_dir = rt.state_dir.join(WORK_DIR).join(&job_id);
    let started_at_ms = now_ms();
    rt.transition(Event::Started { job_id: job_id.clone(), started_at_ms })?;
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
            let cancel = rt.abort.child_token();
            let done = CancellationToken::new();
            let companion =
                tokio::spawn(heartbeat_and_upload(rt.clone(), job_id.clone(), cancel.clone(), done.clone()));
            let ctx = ExecContext {
                job_id: job_id.clone(),
                work_dir: work_dir.clone(),
                timeout: job.verified.timeout,
                kill_grace: rt.config.jobs.kill_grace,
                cancel,
                output: &mut spool,
                sandbox: rt.sandbox.clone(),
                containers: rt.containers.clone(),
            };
            outcome = byoc_job_executors::run_masked(job.verified.executor.as_ref(), ctx).await;
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
