//! The daemon's periodic upkeep, off the job path: the metrics textfile, journal
//! compaction, and removing acknowledged job logs past their retention.

use super::*;

use crate::state_dir::StateDir;

/// The metrics textfile, replaced whole; failures are logged (they never touch jobs).
pub(super) fn write_metrics(rt: &Rt, path: &Path, tally: &mut crate::metrics::AuditTally) {
    if let Err(e) = tally.update(&StateDir::of(&rt.state_dir).audit()) {
        tracing::warn!(error = %e, "Reading the audit log for metrics: {e}.");
    }
    let written = crate::metrics::collect(&rt.state_dir, &rt.config.disk, tally, rt.clock.now_ms())
        .map_err(|e| e.to_string())
        .and_then(|f| {
            crate::metrics::write_textfile(path, &crate::metrics::render(&f)).map_err(|e| e.to_string())
        });
    if let Err(e) = written {
        tracing::warn!(error = %e, path = %path.display(), "Could not write the metrics textfile: {e}.");
    }
}

/// Remove acknowledged job logs past their retention; audited when anything went.
/// Settled jobs past `jobs.journal_keep` to the journal's archive (audited), so the
/// journal and its in-memory index stay bounded however long the runner runs.
pub(super) fn compact_journal(rt: &Rt) {
    use std::sync::atomic::Ordering;
    // After a failure (a full disk, say) the next try waits: this runs before every
    // poll, and each try reads the whole journal.
    static RETRY_AT_MS: AtomicU64 = AtomicU64::new(0);
    let now_ms = rt.clock.now_ms();
    if now_ms < RETRY_AT_MS.load(Ordering::Relaxed) {
        return;
    }
    match rt.journal.compact(
        rt.config.jobs.journal_keep,
        crate::journal::nonce_horizon_secs(now_ms, rt.config.jobs.max_clock_skew),
    ) {
        Ok(None) => {}
        Ok(Some(c)) => {
            let name = c.archive.file_name().unwrap_or_default().to_string_lossy().to_string();
            tracing::info!(jobs = c.jobs, lines = c.lines, archive = %name, "Archived settled jobs from the journal.");
            let detail = format!(
                "{} settled jobs ({} lines) moved to {}/{name}; {} lines kept (jobs.journal_keep = {})",
                c.jobs,
                c.lines,
                crate::state_dir::ARCHIVE_DIR,
                c.kept_lines,
                rt.config.jobs.journal_keep
            );
            rt.audit_or_log(crate::audit_records::note("journal_compacted", detail), "a journal compaction");
        }
        // Nothing lost: the journal is replaced only after the archive is durable.
        Err(e) => {
            RETRY_AT_MS.store(now_ms + 600_000, Ordering::Relaxed);
            tracing::error!(error = %e, "Could not compact the job journal (next try in 10 minutes); it keeps growing until this is fixed: {e}.")
        }
    }
}

pub(super) fn sweep_logs(rt: &Rt, keep: Duration) {
    let swept = crate::retention::sweep_spools(rt.journal.as_ref(), &rt.state_dir, keep, rt.clock.now_ms());
    if swept.files == 0 {
        return;
    }
    let days = keep.as_secs() / 86_400;
    tracing::info!(
        logs = swept.files,
        bytes = swept.bytes,
        days,
        "Removed acknowledged job logs past their retention."
    );
    let detail = format!(
        "{} acknowledged job logs ({} bytes) older than {days} days (jobs.log_retention_days)",
        swept.files, swept.bytes
    );
    rt.audit_or_log(crate::audit_records::note("logs_removed", detail), "the removal of expired job logs");
}

/// Remove saved plans no job may apply any more (a day past
/// `terraform.plan_max_age_secs`); audited when any went.
pub(super) fn sweep_plans(rt: &Rt) {
    let max_age = rt.config.terraform.plan_max_age;
    let plans_dir = StateDir::of(&rt.state_dir).plans();
    let swept = crate::retention::sweep_saved_plans(&plans_dir, max_age, rt.clock.now_ms());
    if swept.files == 0 {
        return;
    }
    let detail = format!(
        "{} saved plans ({} bytes) written more than {} s + 1 day ago (terraform.plan_max_age_secs)",
        swept.files,
        swept.bytes,
        max_age.as_secs()
    );
    rt.audit_or_log(crate::audit_records::note("plans_removed", detail), "the removal of saved plans");
    // After the record: a reader of the log finds it in the audit log.
    tracing::info!(plans = swept.files, bytes = swept.bytes, "Removed saved plans past their use.");
}

/// Remove journal archives past `jobs.journal_archive_days`; audited when any went.
pub(super) fn sweep_archives(rt: &Rt, keep: Duration) {
    let older_than_ms = rt.clock.now_ms().saturating_sub(keep.as_millis() as u64);
    let days = keep.as_secs() / 86_400;
    match crate::journal::remove_archives_before(&rt.state_dir, older_than_ms) {
        Ok(removed) if removed.files == 0 => {}
        Ok(removed) => {
            tracing::info!(
                files = removed.files,
                bytes = removed.bytes,
                days,
                "Removed journal archives past their retention."
            );
            let detail = format!(
                "{} journal archives ({} bytes) whose newest job settled more than {days} days ago (jobs.journal_archive_days)",
                removed.files, removed.bytes
            );
            let record = crate::audit_records::note("journal_archives_removed", detail);
            rt.audit_or_log(record, "the removal of journal archives");
        }
        Err(e) => {
            tracing::error!(error = %e, "Could not remove expired journal archives (next try in an hour): {e}.")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;

    #[tokio::test]
    async fn expired_saved_plans_are_removed_and_audited() {
        let f = testing::runtime().await;
        let plan = StateDir::of(&f.rt.state_dir).plans().join("vpc/aaaa.tfplan");
        std::fs::create_dir_all(plan.parent().expect("parent")).expect("dir");
        std::fs::write(&plan, b"plan").expect("plan");
        let now = std::time::UNIX_EPOCH + Duration::from_millis(f.rt.clock.now_ms());
        let written = now - f.rt.config.terraform.plan_max_age - crate::retention::STALE_PLAN_GRACE;
        // Exactly at the end of its grace: kept.
        std::fs::File::options().write(true).open(&plan).expect("open").set_modified(written).expect("mtime");
        sweep_plans(&f.rt);
        assert!(plan.exists() && !f.audit.events().iter().any(|e| e == "plans_removed"));
        let just_past = written - Duration::from_secs(1);
        std::fs::File::options()
            .write(true)
            .open(&plan)
            .expect("open")
            .set_modified(just_past)
            .expect("mtime");
        sweep_plans(&f.rt);
        assert!(!plan.exists());
        assert_eq!(f.audit.events().iter().filter(|e| *e == "plans_removed").count(), 1);
    }
}
