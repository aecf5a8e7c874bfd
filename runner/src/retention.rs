//! Retention: a job's log spool is removed once its result is acknowledged (so the
//! control plane holds the whole log, checked against its digest) and it finished more
//! than `jobs.log_retention_days` ago. Nothing else is removed: a job not yet reported
//! keeps its spool however old, and the journal and audit log are evidence.

use std::path::Path;
use std::time::Duration;

use crate::journal::{JobJournal, Phase};
use crate::spool;

/// What a sweep removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    pub logs: usize,
    pub bytes: u64,
}

/// Remove the spools of reported jobs that finished before `now_ms - keep`.
pub fn sweep_spools(journal: &dyn JobJournal, state_dir: &Path, keep: Duration, now_ms: u64) -> Swept {
    let cutoff = now_ms.saturating_sub(keep.as_millis() as u64);
    let mut expired = Vec::new();
    journal.visit_index(&mut |index| {
        expired.extend(
            index
                .jobs
                .values()
                .filter(|j| j.phase == Phase::Reported)
                .filter(|j| j.finished.as_ref().is_some_and(|f| f.finished_at_ms < cutoff))
                .map(|j| j.job_id.clone()),
        );
    });
    let mut swept = Swept::default();
    for job_id in expired {
        for path in [spool::spool_path(state_dir, &job_id), spool::tail_path(state_dir, &job_id)] {
            let Ok(meta) = std::fs::metadata(&path) else { continue };
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    swept.logs += usize::from(path.extension().is_some_and(|e| e == "log"));
                    swept.bytes += meta.len();
                }
                Err(e) => {
                    tracing::warn!(error = %e, path = %path.display(), "could not remove an expired job log")
                }
            }
        }
    }
    swept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::Event;
    use crate::testing;

    const DAY_MS: u64 = 86_400_000;

    fn finish(f: &testing::Fakes, job_id: &str, finished_at_ms: u64, reported: bool) {
        testing::receive(f, &testing::verified(job_id, None));
        let mut events = vec![
            Event::Claimed { job_id: job_id.into(), lease_secs: 60 },
            Event::Started { job_id: job_id.into(), started_at_ms: finished_at_ms - 1, network: None },
            Event::Finished {
                job_id: job_id.into(),
                status: byoc_protocol::JobStatus::Succeeded,
                exit_code: Some(0),
                error: None,
                log_size: 4,
                log_sha256: byoc_protocol::sha256_hex(b"log\n"),
                log_omitted: 0,
                started_at_ms: Some(finished_at_ms - 1),
                finished_at_ms,
                outputs: serde_json::Value::Null,
            },
        ];
        if reported {
            events.push(Event::Reported { job_id: job_id.into() });
        }
        for e in events {
            f.rt.transition(e).expect("journal");
        }
        let path = spool::spool_path(&f.rt.state_dir, job_id);
        std::fs::create_dir_all(path.parent().expect("spool dir")).expect("spool dir");
        std::fs::write(path, b"log\n").expect("spool");
    }

    #[tokio::test]
    async fn only_acknowledged_logs_past_the_retention_go() {
        let f = testing::runtime().await;
        let now = 100 * DAY_MS;
        finish(&f, "old-reported", now - 31 * DAY_MS, true);
        finish(&f, "old-unreported", now - 31 * DAY_MS, false);
        finish(&f, "new-reported", now - 29 * DAY_MS, true);
        let swept =
            sweep_spools(f.rt.journal.as_ref(), &f.rt.state_dir, Duration::from_secs(30 * 86_400), now);
        assert_eq!(swept, Swept { logs: 1, bytes: 4 });
        let exists = |id: &str| spool::spool_path(&f.rt.state_dir, id).exists();
        assert!(!exists("old-reported"));
        assert!(exists("old-unreported"), "a log the control plane may not hold yet was removed");
        assert!(exists("new-reported"));
        // A day later the next one is due; a second sweep finds nothing else.
        let swept = sweep_spools(
            f.rt.journal.as_ref(),
            &f.rt.state_dir,
            Duration::from_secs(30 * 86_400),
            now + 2 * DAY_MS,
        );
        assert_eq!(swept.logs, 1);
        assert!(!exists("new-reported") && exists("old-unreported"));
    }
}
