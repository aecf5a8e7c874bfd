//! Refusals on the way: a delivery rejected by `verify` (journaled, then reported) and
//! a received job refused before its claim (`resolve_role`). Both are journaled and
//! audited before the control plane hears of them.

use super::Rejection;
use crate::control_plane::retry::{Policy, Retried, retry};
use crate::journal::{Event, RecordError};
use crate::runtime::Rt;

/// How many times a rejection report is tried (it is advisory: the control plane also
/// sees the delivery expire).
const REJECTION_ATTEMPTS: u32 = 5;

/// Journal (and audit) a rejected delivery. Runs on the poll loop, before the next poll.
/// Its journal entry is the audit record's (one entry per step, see `logging`).
pub fn journal_rejection(rt: &Rt, r: &Rejection) {
    if let Err(e) = rt.transition(Event::Rejected {
        delivery_id: r.delivery_id.clone(),
        job_id: r.job_id.clone(),
        nonce: r.nonce.clone(),
        expires_at: r.expires_at,
        reason: r.reason,
        detail: r.detail.clone(),
    }) {
        // Its audit record (the one entry of this step) may be lost with it: say it here.
        tracing::error!(
            error = %e,
            reason = r.reason.code(),
            delivery_id = %r.delivery_id,
            job_id = r.job_id.as_deref().unwrap_or(""),
            "Could not journal the rejection of job {} ({}: {}): {e}.",
            r.job_id.as_deref().unwrap_or("(no valid id)"),
            r.reason.code(),
            r.detail
        );
    }
}

/// A received job refused before its claim: journaled (and audited) as refused, then
/// reported to the control plane like any rejection.
pub async fn refuse_received(rt: &Rt, job: &super::VerifiedJob, r: Rejection) -> Result<(), RecordError> {
    rt.transition(Event::Refused {
        job_id: job.payload.job_id.clone(),
        delivery_id: r.delivery_id.clone(),
        reason: r.reason,
        detail: r.detail.clone(),
        role: job.role.as_ref().map(|d| d.role.name.clone()),
    })?;
    send_rejection(rt, job.origin, &r).await;
    Ok(())
}

/// Tell the control plane why a delivery was refused (bounded retries).
pub async fn send_rejection(rt: &Rt, origin: super::Origin, r: &Rejection) {
    let policy =
        Policy::new(rt.config.poll.backoff_initial, rt.config.poll.backoff_max).attempts(REJECTION_ATTEMPTS);
    let sent = retry(policy, &rt.stop_reporting, |_| async {
        match rt.plane(origin).reject(&r.delivery_id, r.reason, &r.detail).await {
            Err(e) if e.is_transient() => Err(e),
            other => Ok(other),
        }
    })
    .await;
    if let Retried::Done(Err(e)) = sent {
        tracing::warn!(error = %e, "Control plane did not take the rejection report: {e}.");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, journaled, unavailable};
    use byoc_protocol::RejectReason;

    fn rejection(job: &super::super::VerifiedJob) -> Rejection {
        Rejection {
            delivery_id: job.delivery_id.clone(),
            reason: RejectReason::RoleDisabled,
            detail: "role \"maintenance\" is switched off".into(),
            job_id: Some(job.payload.job_id.clone()),
            nonce: Some(job.payload.nonce.clone()),
            expires_at: Some(job.payload.expires_at),
        }
    }

    #[tokio::test]
    async fn a_received_job_refused_is_journaled_audited_and_reported() {
        let f = testing::runtime().await;
        let job = testing::verified("job-1", Some("maintenance"));
        testing::receive(&f, &job);
        refuse_received(&f.rt, &job, rejection(&job)).await.expect("journal");
        assert_eq!(journaled(&f), ["received", "refused"]);
        assert_eq!(f.cp.calls(), ["reject dl-job-1 role_disabled"]);
        let audited =
            f.audit.records.lock().unwrap_or_else(|e| e.into_inner()).last().cloned().expect("record");
        assert_eq!(audited.reason.as_deref(), Some("role_disabled"));
        assert_eq!(audited.role.as_deref(), Some("maintenance"));
    }

    #[tokio::test]
    async fn a_refusal_that_cannot_be_journaled_is_not_reported() {
        let f = testing::runtime().await;
        let job = testing::verified("job-1", None);
        f.journal.fail_appends.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(refuse_received(&f.rt, &job, rejection(&job)).await.is_err());
        assert!(f.cp.calls().is_empty());
    }

    #[tokio::test]
    async fn a_rejection_report_is_tried_a_bounded_number_of_times() {
        let f = testing::runtime().await;
        let job = testing::verified("job-1", None);
        f.cp.script_rejects((0..100).map(|_| Err(unavailable("reject"))));
        send_rejection(&f.rt, job.origin, &rejection(&job)).await;
        assert_eq!(f.cp.calls().len(), REJECTION_ATTEMPTS as usize);
    }

    #[tokio::test]
    async fn a_rejected_delivery_is_journaled_with_its_nonce_spent() {
        let f = testing::runtime().await;
        let job = testing::verified("job-1", None);
        journal_rejection(&f.rt, &rejection(&job));
        assert_eq!(journaled(&f), ["rejected"]);
        assert!(f.rt.journal.with_index(|i| i.nonces.contains_key("nonce-job-1")));
    }
}
