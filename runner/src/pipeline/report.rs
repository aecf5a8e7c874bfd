//! Stage 5: deliver the rest of the log and the result, retrying until the control
//! plane acknowledges; then journal `reported`. Results are idempotent on the server,
//! so a retry after a lost acknowledgement is harmless.

use byoc_protocol::JobResult;

use super::{Backoff, Rt};
use crate::client::ClientError;
use crate::journal::{Event, Finished, JobRecord, JournalError};
use crate::spool::Uploader;

pub fn result_of(record: &JobRecord, finished: &Finished) -> JobResult {
    JobResult {
        status: finished.status,
        exit_code: finished.exit_code,
        log_size: finished.log_size,
        log_sha256: finished.log_sha256.clone(),
        error: finished.error.clone(),
        outputs: finished.outputs.clone(),
        started_at_ms: record.started_at_ms,
        finished_at_ms: Some(finished.finished_at_ms),
    }
}

#[derive(Debug)]
pub enum Reported {
    Acknowledged,
    /// The runner is stopping; the journal keeps the job as finished-not-reported.
    Deferred,
    /// The control plane refuses this result for good (logged).
    Refused(String),
}

pub async fn report(rt: &Rt, job_id: &str) -> Result<Reported, JournalError> {
    let Some(record) = rt.journal.job(job_id) else {
        return Ok(Reported::Refused(format!("job {job_id} is not in the journal")));
    };
    let Some(finished) = record.finished.clone() else {
        return Ok(Reported::Refused(format!("job {job_id} has not finished")));
    };
    let result = result_of(&record, &finished);
    let mut uploader = Uploader::new(&rt.state_dir, job_id);
    let mut backoff = Backoff::new(rt.config.poll.backoff_initial, rt.config.poll.backoff_max);
    loop {
        let attempt = async {
            uploader.upload_available(&rt.client).await.map_err(|e| e.to_string())?;
            match rt.client.result(job_id, &result).await {
                Ok(()) => Ok(None),
                Err(e) if e.is_transient() => Err(e.to_string()),
                Err(ClientError::Conflict { body, .. }) if body.contains("log mismatch") => {
                    // The server's log differs from what we uploaded: resend from its offset.
                    uploader.uploaded = 0;
                    Err(format!("control plane log out of step: {body}"))
                }
                Err(e) => Ok(Some(e.to_string())),
            }
        };
        let outcome = tokio::select! {
            r = attempt => r,
            _ = rt.stop_reporting.cancelled() => return Ok(Reported::Deferred),
        };
        match outcome {
            Ok(None) => {
                rt.transition(Event::Reported { job_id: job_id.to_string() })?;
                tracing::info!(status = result.status.as_str(), "result acknowledged");
                return Ok(Reported::Acknowledged);
            }
            Ok(Some(refusal)) => {
                tracing::error!(error = %refusal, "control plane refused the job result");
                return Ok(Reported::Refused(refusal));
            }
            Err(e) => tracing::warn!(error = %e, "reporting the result failed; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff.next_delay()) => {}
            _ = rt.stop_reporting.cancelled() => return Ok(Reported::Deferred),
        }
    }
}
