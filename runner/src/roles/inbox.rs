//! Audit records for what the customer does with the CLI outside the daemon (`state
//! unlock`). The audit log has one writer, the daemon (it holds the chain and the
//! tree), so the CLI leaves each record in `control/audit-inbox/`, written and fsynced
//! *before* it acts; the daemon appends them to the log in order at its next check
//! (within seconds, or at its next start) and removes them. `pause` and `resume` leave
//! theirs here too, so a pause lifted within a second still has both records.

use std::path::{Path, PathBuf};

use crate::state_dir::StateDir;
use byoc_audit::log::Record;

/// Events the CLI may leave; anything else in the inbox is audited as
/// `customer_record_invalid` and dropped.
pub const EVENTS: &[&str] = &[
    "allowance_granted",
    "approved",
    "denied",
    "allowance_revoked",
    "state_read",
    "state_unlock_requested",
    "state_unlocked",
    "state_unlock_failed",
    "drift_requested",
    "runner_paused",
    "runner_resumed",
];
const MAX_RECORD: u64 = 16 << 10;

pub fn inbox_dir(state_dir: &Path) -> PathBuf {
    StateDir::of(state_dir).audit_inbox()
}

/// Leave `record` for the daemon, durably (temp file, fsync, rename, fsync the dir).
pub fn submit(state_dir: &Path, record: &Record) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
    let dir = inbox_dir(state_dir);
    if !dir.is_dir() {
        // The daemon makes it at start; before it ever ran, make it as `control/` is
        // (its owner and mode), so the daemon can still drain it.
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
        if let Ok(control) = std::fs::metadata(StateDir::of(state_dir).control()) {
            let _ = std::os::unix::fs::chown(&dir, Some(control.uid()), Some(control.gid()));
            // Sticky as the install makes it: no one removes another's record.
            let _ = std::fs::set_permissions(
                &dir,
                std::fs::Permissions::from_mode((control.mode() & 0o770) | 0o1000),
            );
        }
    }
    // Time first, in nanoseconds, so a name sort is submission order (a `resume` right
    // after a `pause` is a later process, with a later clock reading).
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let name = format!("{nanos:020}-{}-{}.json", std::process::id(), unique());
    let path = dir.join(name);
    let bytes = serde_json::to_vec(record).map_err(std::io::Error::other)?;
    // Readable by the daemon's user whoever writes it (the directory keeps others out).
    crate::state_dir::write(&path, &bytes, 0o644)?;
    Ok(path)
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Append every waiting record through `audit`, oldest first, removing each once it is
/// in the log. Stops at the first record `audit` cannot write (it stays for next time).
pub fn drain<E: std::fmt::Display>(
    state_dir: &Path,
    mut audit: impl FnMut(Record) -> Result<(), E>,
) -> usize {
    let dir = inbox_dir(state_dir);
    let Ok(entries) = std::fs::read_dir(&dir) else { return 0 };
    let mut names: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
        .collect();
    names.sort();
    let mut done = 0;
    for path in names {
        let record = read(&path);
        if let Err(e) = audit(record) {
            tracing::error!(error = %e, path = %path.display(), "Could not audit a customer action; kept for the next try: {e}.");
            break;
        }
        if let Err(e) = std::fs::remove_file(&path) {
            tracing::error!(error = %e, path = %path.display(), "Could not remove an audited customer action: {e}.");
            break;
        }
        done += 1;
    }
    if done > 0
        && let Ok(d) = std::fs::File::open(&dir)
    {
        let _ = d.sync_all();
    }
    done
}

/// The record as left, reduced to what the CLI may say; a file that is not one is
/// audited as such (its name only: its content is not trusted).
fn read(path: &Path) -> Record {
    let invalid = |why: &str| Record {
        event: "customer_record_invalid".into(),
        reason: Some("invalid_request".into()),
        detail: Some(format!("{}: {why}", path.file_name().unwrap_or_default().to_string_lossy())),
        ..Default::default()
    };
    use std::io::Read as _;
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits() | nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open(path);
    let Ok((file, meta)) = opened.and_then(|f| f.metadata().map(|m| (f, m))) else {
        return invalid("unreadable");
    };
    if !meta.is_file() || meta.len() > MAX_RECORD {
        return invalid("not a regular file, or larger than 16 KiB");
    }
    let mut bytes = Vec::new();
    let Ok(r) = file
        .take(MAX_RECORD)
        .read_to_end(&mut bytes)
        .map_err(|_| ())
        .and_then(|_| serde_json::from_slice::<Record>(&bytes).map_err(|_| ()))
    else {
        return invalid("not an audit record");
    };
    // Who left it is the file's owner, as the kernel says: a group member's record
    // names them, whatever its text claims.
    let detail = match meta.uid() {
        0 => r.detail,
        uid => {
            Some(format!("[left by {}] {}", super::allowance::writer(uid, ""), r.detail.unwrap_or_default()))
        }
    };
    if !EVENTS.contains(&r.event.as_str()) {
        return invalid("not an event the CLI leaves");
    }
    // The log numbers, times and attributes records itself.
    Record {
        event: r.event,
        job: r.job.map(|j| j.chars().take(128).collect()),
        kind: r.kind.map(|k| k.chars().take(64).collect()),
        operation: r.operation,
        entity: r.entity.map(|e| e.chars().take(64).collect()),
        role: r.role,
        reason: r.reason,
        status: r.status,
        detail: detail.map(|d| d.chars().take(1100).collect()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_audited_in_order_once_and_bad_ones_are_named_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        for event in ["state_unlock_requested", "state_unlocked"] {
            let r = Record {
                event: event.into(),
                seq: 99,
                detail: Some("workspace network".into()),
                ..Default::default()
            };
            submit(dir.path(), &r).unwrap();
        }
        std::fs::write(inbox_dir(dir.path()).join("zzzz-forged.json"), br#"{"event":"job_succeeded"}"#)
            .unwrap();
        std::fs::write(inbox_dir(dir.path()).join("zzzz-junk.json"), b"not json").unwrap();
        let mut seen = Vec::new();
        assert_eq!(
            drain(dir.path(), |r| {
                seen.push(r);
                Ok::<(), String>(())
            }),
            4
        );
        let events: Vec<&str> = seen.iter().map(|r| r.event.as_str()).collect();
        assert_eq!(
            events,
            [
                "state_unlock_requested",
                "state_unlocked",
                "customer_record_invalid",
                "customer_record_invalid"
            ]
        );
        assert_eq!(seen[0].seq, 0, "the log numbers records, not the file");
        assert!(seen[2].detail.as_deref().unwrap_or("").contains("zzzz-forged.json"));
        assert_eq!(drain(dir.path(), |_| Ok::<(), String>(())), 0, "each is audited once");
    }

    #[test]
    fn a_record_the_log_cannot_take_stays_for_the_next_try() {
        let dir = tempfile::tempdir().unwrap();
        submit(dir.path(), &Record { event: "state_unlocked".into(), ..Default::default() }).unwrap();
        assert_eq!(drain(dir.path(), |_| Err("disk full")), 0);
        assert_eq!(drain(dir.path(), |_| Ok::<(), String>(())), 1);
    }
}
