//! The runner's own audit records (a job transition's are `audit::record_for`), built
//! in one place: their event names and what their fields say are the customer's
//! evidence, and docs/OPERATIONS.md lists them (`audit::EVENTS`).

use byoc_audit::log::Record;

/// A record of `event`, saying `detail`.
pub fn note(event: &str, detail: impl Into<String>) -> Record {
    Record { event: event.into(), detail: Some(detail.into()), ..Default::default() }
}

/// A record of `event` about a job: its id, kind, operation and role.
pub fn of_job(
    event: &str,
    job: &byoc_protocol::JobPayload,
    role: Option<&str>,
    detail: impl Into<String>,
) -> Record {
    Record {
        entity: Some(job.entity.clone()).filter(|e| !e.is_empty()),
        ..about_job(event, [&job.job_id, &job.kind, &job.operation], role, detail)
    }
}

/// `of_job` from the job's id, kind and operation alone.
pub fn about_job(
    event: &str,
    [job_id, kind, operation]: [&str; 3],
    role: Option<&str>,
    detail: impl Into<String>,
) -> Record {
    Record {
        event: event.into(),
        job: Some(job_id.to_string()),
        kind: Some(kind.to_string()),
        operation: Some(operation.to_string()),
        role: role.map(str::to_string),
        detail: Some(detail.into()),
        ..Default::default()
    }
}

pub fn runner_started() -> Record {
    note("runner_started", format!("byoc-runner {}", crate::update::running_version()))
}

pub fn runner_stopped() -> Record {
    Record { event: "runner_stopped".into(), ..Default::default() }
}

/// The configuration the daemon runs with, by digest.
pub fn config_loaded(source: &std::path::Path, digest: &str) -> Record {
    let mut r = note("config_loaded", source.display().to_string());
    r.digests.insert("config_sha256".into(), digest.to_string());
    r
}

/// A new identity key, by its public key's digest.
pub fn key_created(public_key: &[u8]) -> Record {
    let mut r = Record { event: "key_created".into(), ..Default::default() };
    r.digests.insert("public_key_sha256".into(), byoc_protocol::sha256_hex(public_key));
    r
}

/// The customer's pause as it now stands: `runner_paused` (by whom, why) or
/// `runner_resumed`.
pub fn pause_changed(now: Option<&crate::roles::pause::Pause>) -> Record {
    match now {
        Some(p) => Record {
            event: "runner_paused".into(),
            reason: Some("paused".into()),
            detail: Some(format!(
                "by {}{}",
                p.by,
                p.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
            )),
            ..Default::default()
        },
        None => Record { event: "runner_resumed".into(), ..Default::default() },
    }
}

/// The CLI's record of a pause, left in the audit inbox before the pause file is
/// written: who (name and uid), when and why.
pub fn pause_requested(p: &crate::roles::pause::Pause, uid: u32) -> Record {
    Record {
        event: "runner_paused".into(),
        reason: Some("paused".into()),
        detail: Some(format!(
            "by {} (uid {uid}) at {}{}",
            p.by,
            crate::clock::rfc3339_ms(p.paused_at_ms),
            p.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
        )),
        ..Default::default()
    }
}

/// The CLI's record of a resume, left before the pause file is removed: who lifted
/// which pause, and when.
pub fn resume_requested(by: &str, uid: u32, at_ms: u64, lifted: &crate::roles::pause::Pause) -> Record {
    note(
        "runner_resumed",
        format!(
            "by {by} (uid {uid}) at {}; the pause by {} since {}{} is lifted",
            crate::clock::rfc3339_ms(at_ms),
            lifted.by,
            crate::clock::rfc3339_ms(lifted.paused_at_ms),
            lifted.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
        ),
    )
}

/// A local allowance the daemon honours from now on.
pub fn allowance_seen(role: &str, a: &crate::roles::allowance::Allowance, note_text: Option<&str>) -> Record {
    Record {
        event: "allowance_seen".into(),
        role: Some(role.to_string()),
        detail: Some(format!(
            "written by {}, until {}{}: {}",
            a.by,
            crate::clock::rfc3339_ms(a.until_ms),
            note_text.map(|n| format!(" ({n})")).unwrap_or_default(),
            a.reason
        )),
        ..Default::default()
    }
}

/// A local allowance that ran out.
pub fn allowance_expired(role: &str, a: &crate::roles::allowance::Allowance) -> Record {
    Record {
        event: "allowance_expired".into(),
        role: Some(role.to_string()),
        detail: Some(format!(
            "granted by {} ({}), expired at {}",
            a.by,
            a.reason,
            crate::clock::rfc3339_ms(a.until_ms)
        )),
        ..Default::default()
    }
}

/// A drift check the runner did not start, and why.
pub fn drift_skipped(name: &str, trigger: &str, reason: &str, detail: &str) -> Record {
    Record {
        event: "drift_skipped".into(),
        reason: Some(reason.into()),
        detail: Some(format!("{name} ({trigger}): {detail}")),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_built_here_is_in_the_catalog() {
        let payload = crate::testing::payload("job-1");
        let a = crate::roles::allowance::Allowance {
            granted_ms: 0,
            until_ms: 1_795_000_000_000,
            by: "root".into(),
            reason: "r".into(),
        };
        let pause =
            crate::roles::pause::Pause { paused_at_ms: 0, reason: Some("why".into()), by: "root".into() };
        let built = [
            runner_started(),
            runner_stopped(),
            config_loaded(std::path::Path::new("/etc/byoc-runner/runner.toml"), "ab"),
            key_created(b"k"),
            pause_changed(Some(&pause)),
            pause_changed(None),
            allowance_seen("maintenance", &a, None),
            allowance_expired("maintenance", &a),
            drift_skipped("vpc", "schedule", "drift_target_unknown", "no deploy"),
            of_job("role_assumed", &payload, Some("maintenance"), "d"),
        ];
        for r in &built {
            assert!(
                crate::audit::EVENTS.iter().any(|(e, _)| *e == r.event),
                "{} is not in audit::EVENTS",
                r.event
            );
        }
        assert_eq!(
            allowance_expired("m", &a).detail.as_deref(),
            Some("granted by root (r), expired at 2026-11-18T11:06:40Z")
        );
        assert_eq!(pause_changed(Some(&pause)).detail.as_deref(), Some("by root: why"));
    }
}
