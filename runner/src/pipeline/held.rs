//! A held job's signed envelope, kept in `<state dir>/held/<job>.json` (0600, fsynced)
//! from the moment it waits at a window or for an approval until it leaves the gate,
//! so `recover` can verify it again and resume it after a restart (see `window`).

use super::VerifiedJob;
use crate::runtime::Rt;
use crate::state_dir::StateDir;

#[derive(serde::Serialize, serde::Deserialize)]
struct Held {
    delivery_id: String,
    envelope: byoc_protocol::JobEnvelope,
}

fn held_path(state_dir: &std::path::Path, job_id: &str) -> std::path::PathBuf {
    StateDir::of(state_dir).held().join(format!("{job_id}.json"))
}

/// Keep a held job's envelope so a restart can resume it.
pub(super) fn keep_held(rt: &Rt, job: &VerifiedJob) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    let dir = StateDir::of(&rt.state_dir).held();
    let at = |path: &std::path::Path, e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
    };
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(|e| at(&dir, e))?;
    let held = Held { delivery_id: job.delivery_id.clone(), envelope: job.envelope.clone() };
    let path = held_path(&rt.state_dir, &job.payload.job_id);
    let bytes = serde_json::to_vec(&held).map_err(std::io::Error::other)?;
    crate::state_dir::write(&path, &bytes, 0o600).map_err(|e| at(&path, e))
}

/// The job left the gate (ran, or was settled): its envelope goes.
pub fn forget_held(rt: &Rt, job_id: &str) {
    let path = held_path(&rt.state_dir, job_id);
    if let Err(e) = std::fs::remove_file(&path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(error = %e, path = %path.display(), "Could not remove a held job's envelope: {e}.");
    }
}

/// A held job's delivery as kept, for `recover`.
pub fn kept_delivery(state_dir: &std::path::Path, job_id: &str) -> Option<super::PolledJob> {
    if !super::verify::valid_job_id(job_id) {
        return None;
    }
    let bytes = std::fs::read(held_path(state_dir, job_id)).ok()?;
    let held: Held = serde_json::from_slice(&bytes).ok()?;
    Some(super::PolledJob {
        delivery_id: held.delivery_id,
        envelope: held.envelope,
        received_at: std::time::Instant::now(),
    })
}
