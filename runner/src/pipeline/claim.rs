//! Stage 3: journal the job as received (spending its nonce), then claim it with a
//! lease. Transient failures are retried until the envelope expires; a refusal
//! (cancelled or taken) ends the job here, journaled, without running anything.

use super::{Backoff, Rt, ScopedJob, VerifiedJob};
use crate::client::ClientError;
use crate::journal::{Event, JournalError};

pub struct ClaimedJob {
    pub verified: VerifiedJob,
    pub role: Option<super::resolve_role::ScopedRole>,
    pub lease_secs: u64,
}

pub enum ClaimOutcome {
    Claimed(Box<ClaimedJob>),
    /// The job will not run here; journaled.
    NotClaimed {
        detail: String,
    },
}

/// Journal `received` before anything acts on the job. Must run on the poll loop,
/// before the next poll, so a replay of the same nonce is refused deterministically.
pub fn record_received(rt: &Rt, job: &VerifiedJob) -> Result<(), JournalError> {
    let p = &job.payload;
    rt.transition(Event::Received {
        job_id: p.job_id.clone(),
        delivery_id: job.delivery_id.clone(),
        nonce: p.nonce.clone(),
        expires_at: p.expires_at,
        kind: p.kind.clone(),
        operation: p.operation.clone(),
        entity: p.entity.clone(),
        payload_sha256: job.payload_sha256.clone(),
        timeout_secs: p.timeout_secs,
    })
}

pub async fn claim(rt: &Rt, scoped: ScopedJob) -> Result<ClaimOutcome, JournalError> {
    let ScopedJob { verified: job, role } = scoped;
    let job_id = job.payload.job_id.clone();
    let mut backoff = Backoff::new(rt.config.poll.backoff_initial, rt.config.poll.backoff_max);
    loop {
        let refused = match rt.client.claim(&job_id, &job.delivery_id).await {
            Ok(c) => {
                rt.transition(Event::Claimed { job_id: job_id.clone(), lease_secs: c.lease_secs })?;
                return Ok(ClaimOutcome::Claimed(Box::new(ClaimedJob {
                    verified: job,
                    role,
                    lease_secs: c.lease_secs,
                })));
            }
            Err(e) if e.is_transient() => {
                let now = crate::daemon::unix_now();
                if now > job.payload.expires_at {
                    Some(format!("envelope expired before the claim went through: {e}"))
                } else if rt.abort.is_cancelled() || rt.stop_reporting.is_cancelled() {
                    Some("runner stopped before the job was claimed".to_string())
                } else {
                    tracing::warn!(error = %e, "claim failed, retrying");
                    None
                }
            }
            Err(ClientError::Conflict { body, .. }) => {
                Some(format!("control plane refused the claim: {body}"))
            }
            Err(e) => Some(format!("claim failed: {e}")),
        };
        if let Some(detail) = refused {
            tracing::warn!(reason = %detail, "job not claimed; it will not run");
            rt.transition(Event::ClaimRefused { job_id, detail: detail.clone() })?;
            return Ok(ClaimOutcome::NotClaimed { detail });
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff.next_delay()) => {}
            _ = rt.abort.cancelled() => {}
        }
    }
}
