//! When the runner last heard from its control plane, for `status`: the last poll that
//! was answered, the last that failed and why, the last result acknowledged. The
//! daemon writes `contact.json` after each (through `byoc_statefs`); nothing depends
//! on it, so a write that fails is logged and the runner goes on.

use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::state_dir::StateDir;

/// Writers in one process take turns: each reads the file, changes its part, writes.
static WRITING: Mutex<()> = Mutex::new(());

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Contact {
    /// Unix ms of the last poll the control plane answered (a job or none).
    #[serde(default)]
    pub last_poll_ms: Option<u64>,
    /// The last poll that failed, if it came after the last answered one.
    #[serde(default)]
    pub poll_error: Option<ContactError>,
    /// Unix ms and job of the last result the control plane acknowledged.
    #[serde(default)]
    pub last_result_ms: Option<u64>,
    #[serde(default)]
    pub last_result_job: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContactError {
    pub at_ms: u64,
    pub error: String,
}

/// What the daemon last wrote (`Contact::default()` when it never did).
pub fn read(state_dir: &Path) -> Contact {
    std::fs::read(StateDir::of(state_dir).contact())
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn update(state_dir: &Path, change: impl FnOnce(&mut Contact)) {
    let _turn = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    let mut contact = read(state_dir);
    change(&mut contact);
    let written = serde_json::to_vec(&contact)
        .map_err(std::io::Error::other)
        .and_then(|bytes| crate::state_dir::write(&StateDir::of(state_dir).contact(), &bytes, 0o600));
    if let Err(e) = written {
        tracing::warn!(error = %e, "Could not record the last contact with the control plane: {e}.");
    }
}

pub fn poll_answered(state_dir: &Path, at_ms: u64) {
    update(state_dir, |c| {
        c.last_poll_ms = Some(at_ms);
        c.poll_error = None;
    });
}

pub fn poll_failed(state_dir: &Path, at_ms: u64, error: &str) {
    update(state_dir, |c| c.poll_error = Some(ContactError { at_ms, error: error.to_string() }));
}

pub fn result_acknowledged(state_dir: &Path, at_ms: u64, job_id: &str) {
    update(state_dir, |c| {
        c.last_result_ms = Some(at_ms);
        c.last_result_job = Some(job_id.to_string());
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_event_changes_its_part_and_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()), Contact::default());
        poll_answered(dir.path(), 1_000);
        result_acknowledged(dir.path(), 2_000, "job-1");
        poll_failed(dir.path(), 3_000, "connection refused");
        let c = read(dir.path());
        assert_eq!(c.last_poll_ms, Some(1_000));
        assert_eq!(c.last_result_ms, Some(2_000));
        assert_eq!(c.last_result_job.as_deref(), Some("job-1"));
        assert_eq!(c.poll_error, Some(ContactError { at_ms: 3_000, error: "connection refused".into() }));
        poll_answered(dir.path(), 4_000);
        let c = read(dir.path());
        assert_eq!((c.last_poll_ms, c.poll_error, c.last_result_ms), (Some(4_000), None, Some(2_000)));
    }
}
