//! Retention: a job's log spool is removed once its result is acknowledged (so the
//! control plane holds the whole log, checked against its digest) and it finished more
//! than `jobs.log_retention_days` ago; a job not yet reported keeps its spool however
//! old. A plan-only job's saved plan is removed a day after no job may apply it any
//! more (`terraform.plan_max_age_secs`): it holds what the plan holds, unencrypted.
//! The journal and audit log are evidence (their archives have their own retention).

use std::path::Path;
use std::time::Duration;

use crate::journal::{JobJournal, Phase};
use crate::spool;

/// What a sweep removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    /// Job logs or saved plans removed (a log's tail ring is counted in bytes only).
    pub files: usize,
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
        for path in [
            spool::spool_path(state_dir, &job_id),
            spool::tail_path(state_dir, &job_id),
            spool::times_path(state_dir, &job_id),
        ] {
            let Ok(meta) = std::fs::metadata(&path) else { continue };
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    swept.files += usize::from(path.extension().is_some_and(|e| e == "log"));
                    swept.bytes += meta.len();
                }
                Err(e) => {
                    tracing::warn!(error = %e, path = %path.display(), "Could not remove an expired job log: {e}.")
                }
            }
        }
    }
    swept
}

/// How long past `plan_max_age` a saved plan stays: a late apply is refused as
/// `plan_stale` ("plan again") rather than `plan_unknown` for that long.
pub const STALE_PLAN_GRACE: Duration = Duration::from_secs(86_400);

/// Remove the saved plans (`<plans_dir>/<workspace>/<digest>.tfplan`) last written
/// before `now_ms - plan_max_age - STALE_PLAN_GRACE`. Anything else there (other
/// files, symbolic links) is left alone.
pub fn sweep_saved_plans(plans_dir: &Path, plan_max_age: Duration, now_ms: u64) -> Swept {
    let cutoff = now_ms.saturating_sub((plan_max_age + STALE_PLAN_GRACE).as_millis() as u64);
    let mut swept = Swept::default();
    let Ok(workspaces) = std::fs::read_dir(plans_dir) else { return swept };
    for workspace in workspaces.flatten() {
        if !workspace.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(plans) = std::fs::read_dir(workspace.path()) else { continue };
        for plan in plans.flatten() {
            let path = plan.path();
            let Ok(meta) = plan.metadata() else { continue };
            let written_ms = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(u64::MAX, |d| d.as_millis() as u64);
            if !meta.is_file() || path.extension().is_none_or(|e| e != "tfplan") || written_ms >= cutoff {
                continue;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    swept.files += 1;
                    swept.bytes += meta.len();
                }
                Err(e) => {
                    tracing::warn!(error = %e, path = %path.display(), "Could not remove an expired saved plan: {e}.")
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
            Event::Claimed { job_id: job_id.into(), lease_secs: 60, epoch: 0 },
            Event::Started {
                job_id: job_id.into(),
                started_at_ms: finished_at_ms - 1,
                network: None,
                state_workspace: None,
            },
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
        assert_eq!(swept, Swept { files: 1, bytes: 4 });
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
        assert_eq!(swept.files, 1);
        assert!(!exists("new-reported") && exists("old-unreported"));
    }

    #[test]
    fn only_saved_plans_a_day_past_their_max_age_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let plans = dir.path().join("plans");
        let now = 100 * DAY_MS;
        let max_age = Duration::from_secs(3600);
        let write = |rel: &str, age_ms: u64| {
            let path = plans.join(rel);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("dir");
            std::fs::write(&path, b"plan").expect("plan");
            let at = std::time::UNIX_EPOCH + Duration::from_millis(now - age_ms);
            std::fs::File::options().write(true).open(&path).expect("open").set_modified(at).expect("mtime");
            path
        };
        let gone = write("vpc/aaaa.tfplan", 2 * DAY_MS);
        let stale_but_kept = write("vpc/bbbb.tfplan", 3_600_000 + 12 * 3_600_000);
        let fresh = write("eks/cccc.tfplan", 60_000);
        let not_a_plan = write("eks/notes.txt", 10 * DAY_MS);
        let elsewhere = dir.path().join("elsewhere.tfplan");
        std::fs::write(&elsewhere, b"x").expect("file");
        std::os::unix::fs::symlink(&elsewhere, plans.join("vpc/link.tfplan")).expect("symlink");
        std::fs::File::options()
            .write(true)
            .open(&elsewhere)
            .expect("open")
            .set_modified(std::time::UNIX_EPOCH)
            .expect("mtime");
        assert_eq!(sweep_saved_plans(&plans, max_age, now), Swept { files: 1, bytes: 4 });
        assert!(!gone.exists());
        assert!(stale_but_kept.exists(), "a plan refused as stale for less than a day went");
        assert!(fresh.exists() && not_a_plan.exists() && elsewhere.exists());
        assert!(plans.join("vpc/link.tfplan").symlink_metadata().is_ok(), "a symbolic link was followed");
        // No plans directory yet (no plan-only job ran): nothing to do.
        assert_eq!(sweep_saved_plans(&dir.path().join("none"), max_age, now), Swept::default());
    }
}
