//! Stage 10, report: `FinishedJob` → `Reported`. Deliver the rest of the log and the
//! result, retrying until the control plane acknowledges; then journal `reported`. Results are idempotent on the server,
//! so a retry after a lost acknowledgement is harmless.

use byoc_protocol::JobResult;

use super::record::FinishedJob;
use crate::control_plane::ClientError;
use crate::control_plane::retry::{Policy, Retried, retry};
use crate::journal::{Event, Finished, JobRecord, RecordError};
use crate::runtime::Rt;
use crate::spool::Uploader;

pub fn result_of(record: &JobRecord, finished: &Finished) -> JobResult {
    JobResult {
        status: finished.status,
        exit_code: finished.exit_code,
        log_size: finished.log_size,
        log_sha256: finished.log_sha256.clone(),
        log_omitted_bytes: finished.log_omitted,
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

pub async fn report(rt: &Rt, finished: FinishedJob) -> Result<Reported, RecordError> {
    let FinishedJob { job_id, origin, result } = finished;
    let plane = rt.plane(origin);
    let job_id = job_id.as_str();
    // Shared by the attempts (a retry resumes the upload where the last one stopped).
    let uploader = tokio::sync::Mutex::new(Uploader::new(&rt.state_dir, job_id));
    let policy = Policy::new(rt.config.poll.backoff_initial, rt.config.poll.backoff_max);
    // Ok(None): acknowledged; Ok(Some(Ok(why))): refused for good; Ok(Some(Err(why))):
    // fenced (the job was leased to another runner); Err: try again.
    let reported = retry(policy, &rt.stop_reporting, |_| async {
        let attempt = async {
            let mut uploader = uploader.lock().await;
            match uploader.upload_available(plane).await {
                Ok(()) => {}
                Err(crate::spool::UploadError::Client(e)) if crate::control_plane::is_fenced(&e) => {
                    return Ok(Some(Err(e.to_string())));
                }
                Err(e) => return Err(e.to_string()),
            }
            match plane.result(job_id, &result).await {
                Ok(()) => Ok(None),
                Err(e) if crate::control_plane::is_fenced(&e) => Ok(Some(Err(e.to_string()))),
                Err(e) if e.is_transient() => Err(e.to_string()),
                Err(ClientError::Conflict { body, .. }) if body.contains("log mismatch") => {
                    // The server's log differs from what we uploaded: resend from its offset.
                    uploader.uploaded = 0;
                    Err(format!("control plane log out of step: {body}"))
                }
                Err(e) => Ok(Some(Ok(e.to_string()))),
            }
        };
        tokio::select! {
            r = attempt => r.inspect_err(|e| tracing::warn!(error = %e, "Reporting the result failed; retrying: {e}.")),
            // Stopping mid-attempt: the journal keeps the job finished-not-reported.
            _ = rt.stop_reporting.cancelled() => Err("the runner is stopping".to_string()),
        }
    })
    .await;
    match reported {
        Retried::Done(None) => {
            rt.transition(Event::Reported { job_id: job_id.to_string() })?;
            // Its journal entry is the `job_reported` audit record's (one per step).
            crate::contact::result_acknowledged(&rt.state_dir, rt.clock.now_ms(), job_id);
            Ok(Reported::Acknowledged)
        }
        Retried::Done(Some(Ok(refusal))) => {
            tracing::error!(error = %refusal, "Control plane refused the job result: {refusal}.");
            Ok(Reported::Refused(refusal))
        }
        Retried::Done(Some(Err(fenced))) => {
            tracing::warn!(error = %fenced, "The job's lease was given to another runner: its result is not reported.");
            rt.transition(Event::Fenced { job_id: job_id.to_string(), detail: fenced.clone() })?;
            Ok(Reported::Refused(fenced))
        }
        Retried::Stopped | Retried::Exhausted(_) => Ok(Reported::Deferred),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::testing::{self, Fakes, conflict, journaled, unavailable};

    /// A job journaled through `finished`, with `log` in its spool.
    fn finished(f: &Fakes, job_id: &str, log: &[u8]) -> FinishedJob {
        let job = testing::verified(job_id, None);
        testing::receive(f, &job);
        let spool = crate::spool::spool_path(&f.rt.state_dir, job_id);
        std::fs::create_dir_all(spool.parent().expect("spool dir")).expect("spool dir");
        std::fs::write(&spool, log).expect("spool");
        for event in [
            Event::Claimed { job_id: job_id.into(), lease_secs: 60, epoch: 0 },
            Event::Started { job_id: job_id.into(), started_at_ms: 1, network: None, state_workspace: None },
            Event::Finished {
                job_id: job_id.into(),
                status: byoc_protocol::JobStatus::Succeeded,
                exit_code: Some(0),
                error: None,
                log_size: log.len() as u64,
                log_sha256: byoc_protocol::sha256_hex(log),
                log_omitted: 0,
                started_at_ms: Some(1),
                finished_at_ms: 2,
                outputs: serde_json::Value::Null,
            },
        ] {
            f.rt.transition(event).expect("journal");
        }
        FinishedJob::from_journal(&f.rt, job_id).expect("finished")
    }

    #[tokio::test]
    async fn the_log_then_the_result_are_delivered_and_reported_is_journaled() {
        let f = testing::runtime().await;
        let job = finished(&f, "job-1", b"hello\nworld\n");
        let r = report(&f.rt, job).await.expect("journal");
        assert!(matches!(r, Reported::Acknowledged), "{r:?}");
        assert_eq!(*f.cp.log.lock().unwrap_or_else(|e| e.into_inner()), b"hello\nworld\n");
        let reported = f.cp.reported.lock().unwrap_or_else(|e| e.into_inner()).clone();
        assert_eq!(reported.len(), 1);
        assert_eq!(reported[0].log_sha256, byoc_protocol::sha256_hex(b"hello\nworld\n"));
        assert_eq!(journaled(&f).last().map(String::as_str), Some("reported"));
    }

    #[tokio::test]
    async fn transient_failures_are_retried_and_the_log_is_not_sent_twice() {
        let f = testing::runtime().await;
        let job = finished(&f, "job-1", b"once\n");
        f.cp.script_results([Err(unavailable("result")), Err(unavailable("result"))]);
        let r = report(&f.rt, job).await.expect("journal");
        assert!(matches!(r, Reported::Acknowledged), "{r:?}");
        assert_eq!(f.cp.calls(), ["result job-1 succeeded"; 3]);
        assert_eq!(*f.cp.log.lock().unwrap_or_else(|e| e.into_inner()), b"once\n");
    }

    #[tokio::test]
    async fn a_result_refused_for_good_is_not_journaled_as_reported() {
        let f = testing::runtime().await;
        let job = finished(&f, "job-1", b"");
        f.cp.script_results([Err(conflict("result", "job was cancelled"))]);
        let r = report(&f.rt, job).await.expect("journal");
        let Reported::Refused(why) = r else { panic!("{r:?}") };
        assert!(why.contains("job was cancelled"), "{why}");
        assert_ne!(journaled(&f).last().map(String::as_str), Some("reported"));
        assert_eq!(f.cp.calls().len(), 1);
    }

    #[tokio::test]
    async fn a_fenced_result_is_journaled_as_fenced_and_never_sent_again() {
        let f = testing::runtime().await;
        let job = finished(&f, "job-1", b"");
        let fenced = r#"{"error":"fenced","detail":"job job-1: the lease of epoch 1 was given to another runner (epoch 2)"}"#;
        f.cp.script_results([Err(conflict("result", fenced))]);
        let r = report(&f.rt, job).await.expect("journal");
        assert!(matches!(r, Reported::Refused(_)), "{r:?}");
        assert_eq!(journaled(&f).last().map(String::as_str), Some("fenced"));
        // Settled (not finished-unreported): a restart does not report it.
        assert_eq!(f.rt.journal.job("job-1").map(|j| j.phase), Some(crate::journal::Phase::Fenced));
        // A plain 409 mentioning the word is not a fence.
        assert!(!crate::control_plane::is_fenced(&conflict("result", "fenced off by a proxy")));
    }

    #[tokio::test]
    async fn a_stopping_runner_defers_the_report_to_the_next_start() {
        let f = testing::runtime().await;
        let job = finished(&f, "job-1", b"x\n");
        f.cp.script_results((0..1000).map(|_| Err(unavailable("result"))));
        f.rt.stop_reporting.cancel();
        let r = report(&f.rt, job).await.expect("journal");
        assert!(matches!(r, Reported::Deferred), "{r:?}");
        assert_eq!(journaled(&f).last().map(String::as_str), Some("finished"));
    }

    #[tokio::test]
    async fn jobs_unknown_or_unfinished_have_nothing_to_report() {
        let f = testing::runtime().await;
        assert!(FinishedJob::from_journal(&f.rt, "nope").is_none());
        testing::receive(&f, &testing::verified("job-2", None));
        assert!(FinishedJob::from_journal(&f.rt, "job-2").is_none());
        let job = finished(&f, "job-3", b"x\n");
        assert_eq!((job.result.log_size, job.result.started_at_ms), (2, Some(1)));
    }

    #[tokio::test]
    async fn an_acknowledgement_that_cannot_be_journaled_is_an_error() {
        let f = testing::runtime().await;
        let job = finished(&f, "job-1", b"");
        f.journal.fail_appends.store(true, Ordering::SeqCst);
        assert!(report(&f.rt, job).await.is_err());
        // The control plane has the result; the next start sends it again (idempotent).
        assert_eq!(f.cp.calls(), ["result job-1 succeeded"]);
    }
}
