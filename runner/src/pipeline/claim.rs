//! Stage 5, claim: take the job with a lease. Transient failures are retried until the
//! envelope expires or the runner stops; a refusal (cancelled or taken) ends the job
//! here, journaled, without running anything.

use super::VerifiedJob;
use super::authorize::{AuthorizedJob, PolicyChoice};
use super::resolve_role::ResolvedRole;
use crate::control_plane::ClientError;
use crate::control_plane::retry::{Policy, Retried, retry};
use crate::journal::{Event, RecordError};
use crate::runtime::Rt;

pub struct ClaimedJob {
    pub verified: VerifiedJob,
    pub role: Option<ResolvedRole>,
    pub policy: PolicyChoice,
    pub lease_secs: u64,
    /// When its maintenance window closes, for a rule that cancels the job then.
    pub window_close: Option<super::window::WindowClose>,
    /// Approvals a local admin gave it (for the policy context).
    pub approvals: Vec<serde_json::Value>,
}

pub enum ClaimOutcome {
    Claimed(Box<ClaimedJob>),
    /// The job will not run here; journaled.
    NotClaimed {
        detail: String,
    },
}

pub async fn claim(rt: &Rt, job: AuthorizedJob) -> Result<ClaimOutcome, RecordError> {
    let AuthorizedJob { verified, role, policy } = job;
    let job_id = verified.payload.job_id.clone();
    let expires_at = verified.payload.expires_at;
    let retry_policy = Policy::new(rt.config.poll.backoff_initial, rt.config.poll.backoff_max);
    let offer = crate::leases::can_bind(verified.executor.placement(), rt.sandbox.is_some());
    // Ok(Ok(lease)): claimed; Ok(Err(why)): refused for good; Err: transient.
    let claimed = retry(retry_policy, &rt.abort, |_| async {
        let sent = crate::leases::now_ns();
        match rt.plane(verified.origin).claim(&job_id, &verified.delivery_id, offer).await {
            Ok(c) => {
                if c.lease_bound && offer {
                    rt.leases.bind(&job_id, sent, c.lease_secs);
                }
                Ok(Ok((c.lease_secs, c.epoch)))
            }
            Err(e) if e.is_transient() => {
                if rt.clock.unix_now() > expires_at {
                    Ok(Err(format!("envelope expired before the claim went through: {e}")))
                } else if rt.stop_reporting.is_cancelled() {
                    Ok(Err("runner stopped before the job was claimed".to_string()))
                } else {
                    tracing::warn!(error = %e, "Claim failed, retrying: {e}.");
                    Err(e)
                }
            }
            Err(ClientError::Conflict { body, .. }) => {
                Ok(Err(format!("control plane refused the claim: {body}")))
            }
            Err(e) => Ok(Err(format!("claim failed: {e}"))),
        }
    })
    .await;
    let refused = match claimed {
        Retried::Done(Ok((lease_secs, epoch))) => {
            rt.transition(Event::Claimed { job_id: job_id.clone(), lease_secs, epoch })?;
            return Ok(ClaimOutcome::Claimed(Box::new(ClaimedJob {
                verified,
                role,
                policy,
                lease_secs,
                window_close: None,
                approvals: Vec::new(),
            })));
        }
        Retried::Done(Err(detail)) => detail,
        Retried::Stopped | Retried::Exhausted(_) => "runner stopped before the job was claimed".to_string(),
    };
    rt.transition(Event::ClaimRefused { job_id, detail: refused.clone() })?;
    Ok(ClaimOutcome::NotClaimed { detail: refused })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, conflict, journaled, unavailable};

    fn authorized(f: &testing::Fakes, job_id: &str) -> AuthorizedJob {
        let verified = testing::verified(job_id, None);
        testing::receive(f, &verified);
        AuthorizedJob { verified, role: None, policy: PolicyChoice::default() }
    }

    #[tokio::test]
    async fn a_claim_the_control_plane_grants_is_journaled_with_its_lease() {
        let f = testing::runtime().await;
        f.cp.script_claims([Ok(byoc_protocol::ClaimResponse {
            lease_secs: 90,
            epoch: 0,
            lease_bound: false,
        })]);
        let outcome = claim(&f.rt, authorized(&f, "job-1")).await.expect("journal");
        let ClaimOutcome::Claimed(c) = outcome else { panic!("not claimed") };
        assert_eq!(c.lease_secs, 90);
        assert_eq!(journaled(&f), ["received", "claimed"]);
        assert_eq!(f.audit.events(), ["job_received", "job_claimed"]);
    }

    #[tokio::test]
    async fn transient_failures_are_retried_until_the_claim_goes_through() {
        let f = testing::runtime().await;
        f.cp.script_claims([
            Err(unavailable("claim")),
            Err(unavailable("claim")),
            Ok(byoc_protocol::ClaimResponse { lease_secs: 60, epoch: 0, lease_bound: false }),
        ]);
        let outcome = claim(&f.rt, authorized(&f, "job-1")).await.expect("journal");
        assert!(matches!(outcome, ClaimOutcome::Claimed(_)));
        assert_eq!(f.cp.calls(), ["claim job-1"; 3]);
    }

    #[tokio::test]
    async fn a_refused_claim_ends_the_job_journaled_and_never_run() {
        let f = testing::runtime().await;
        f.cp.script_claims([Err(conflict("claim", "job taken by rn-2"))]);
        let outcome = claim(&f.rt, authorized(&f, "job-1")).await.expect("journal");
        let ClaimOutcome::NotClaimed { detail } = outcome else { panic!("claimed") };
        assert!(detail.contains("job taken by rn-2"), "{detail}");
        assert_eq!(journaled(&f), ["received", "claim_refused"]);
        assert_eq!(f.cp.calls().len(), 1, "a refusal is not retried");
    }

    #[tokio::test]
    async fn an_envelope_that_expires_while_claims_fail_is_given_up() {
        let f = testing::runtime().await;
        let job = authorized(&f, "job-1");
        // Past the envelope's expiry: the next transient failure ends the attempts.
        f.clock.advance_secs(301);
        f.cp.script_claims([Err(unavailable("claim"))]);
        let ClaimOutcome::NotClaimed { detail } = claim(&f.rt, job).await.expect("journal") else {
            panic!("claimed")
        };
        assert!(detail.contains("envelope expired"), "{detail}");
        assert_eq!(journaled(&f), ["received", "claim_refused"]);
    }

    #[tokio::test]
    async fn an_abort_stops_the_retries() {
        let f = testing::runtime().await;
        f.cp.script_claims((0..1000).map(|_| Err(unavailable("claim"))));
        f.rt.abort.cancel();
        let ClaimOutcome::NotClaimed { detail } =
            claim(&f.rt, authorized(&f, "job-1")).await.expect("journal")
        else {
            panic!("claimed")
        };
        assert!(detail.contains("runner stopped"), "{detail}");
    }

    #[tokio::test]
    async fn a_claim_that_cannot_be_journaled_is_an_error() {
        let f = testing::runtime().await;
        let job = authorized(&f, "job-1");
        f.journal.fail_appends.store(true, std::sync::atomic::Ordering::SeqCst);
        let err = claim(&f.rt, job).await.err().expect("journal failure surfaces");
        assert!(err.to_string().contains("no space left"), "{err}");
    }
}
