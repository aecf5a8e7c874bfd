//! Stage 9, record: `RanJob` → `FinishedJob`. What a job that succeeded leaves for
//! later (a drift check's result, what a drift check of the deploy needs, where it
//! wrote the customer's secrets), then `finished` journaled with its outcome and the
//! log's size and SHA-256, before anything is reported.

use byoc_job_executors::{ExecOutcome, JobStatus};
use byoc_protocol::JobResult;

use super::VerifiedJob;
use super::execute::RanJob;
use crate::clock::now_ms;
use crate::journal::{Event, RecordError};
use crate::runtime::Rt;

/// A job whose end is journaled, with the result to report.
pub struct FinishedJob {
    pub job_id: String,
    pub origin: super::Origin,
    pub result: JobResult,
}

impl FinishedJob {
    /// A job the journal has as finished (after a restart, or settled while it was
    /// held); `None` for one it does not.
    pub fn from_journal(rt: &Rt, job_id: &str) -> Option<FinishedJob> {
        let record = rt.journal.job(job_id)?;
        let finished = record.finished.as_ref()?;
        Some(FinishedJob {
            job_id: job_id.to_string(),
            origin: super::Origin::of_record(&record),
            result: super::report::result_of(&record, finished),
        })
    }
}

pub fn record(rt: &Rt, ran: RanJob) -> Result<FinishedJob, RecordError> {
    let RanJob { verified, started_at_ms, outcome, log } = ran;
    let job_id = verified.payload.job_id.clone();
    keep_for_later(rt, &job_id, &verified, &outcome);
    let finished_at_ms = now_ms();
    let result = JobResult {
        status: outcome.status,
        exit_code: outcome.exit_code,
        log_size: log.size,
        log_sha256: log.sha256.clone(),
        log_omitted_bytes: log.omitted,
        error: outcome.error.clone(),
        outputs: outcome.outputs.clone(),
        started_at_ms: Some(started_at_ms),
        finished_at_ms: Some(finished_at_ms),
    };
    rt.transition(Event::Finished {
        job_id: job_id.clone(),
        status: outcome.status,
        exit_code: outcome.exit_code,
        error: outcome.error.clone(),
        log_size: log.size,
        log_sha256: log.sha256,
        log_omitted: log.omitted,
        started_at_ms: Some(started_at_ms),
        finished_at_ms,
        outputs: outcome.outputs,
    })?;
    Ok(FinishedJob { job_id, origin: verified.origin, result })
}

/// What a job that succeeded leaves for later: a drift check's result (for
/// `byoc-runner drift`), what a drift check of this deploy needs, and where it wrote
/// the customer's secrets. Failures are logged: the job's own result stands.
fn keep_for_later(rt: &Rt, job_id: &str, job: &VerifiedJob, outcome: &ExecOutcome) {
    if outcome.status != JobStatus::Succeeded {
        return;
    }
    if outcome.outputs.get("drift").is_some()
        && let Err(e) = crate::drift::record(&rt.state_dir, job_id, now_ms(), &outcome.outputs)
    {
        tracing::warn!(error = %e, "Could not keep the drift check's result for `byoc-runner drift`: {e}.");
    }
    match crate::drift::local::remember(&rt.state_dir, &job.payload, job.executor.as_ref(), now_ms()) {
        Ok(true) => tracing::info!("Kept what a drift check of this deploy needs (docs/DRIFT.md)."),
        Ok(false) => {}
        Err(e) => tracing::warn!(error = %e, "Could not keep this deploy's drift check target: {e}."),
    }
    match crate::secrets::record(&rt.state_dir, job_id, now_ms(), &outcome.outputs) {
        Ok(0) => {}
        Ok(n) => tracing::info!(secrets = n, "Kept where the job wrote the customer's secrets."),
        Err(e) => {
            tracing::warn!(error = %e, "Could not keep where the job wrote the customer's secrets: {e}.")
        }
    }
}
