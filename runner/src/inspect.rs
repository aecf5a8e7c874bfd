//! The customer's local inspection commands. They read the state dir only (never the
//! network), so they work while the daemon is stopped, and never change anything.

use std::path::Path;

use serde::Serialize;

use crate::identity;
use crate::journal::{self, Index, JobRecord, Phase};
use crate::spool;
use crate::state_dir::StateDir;

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("state dir {0} does not exist: is the runner installed, or is --state-dir wrong?")]
    NoStateDir(String),
    #[error(
        "permission denied reading {0}: run as root (sudo) or as the runner's user; pause, resume and approvals also as a member of roles.admin_group"
    )]
    Permission(String),
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    #[error(transparent)]
    Journal(#[from] journal::RecordError),
    #[error("no job {0:?} in the journal (see `byoc-runner jobs list`)")]
    NoSuchJob(String),
    #[error("job id prefix {prefix:?} names more than one job ({matches}): give more of it")]
    Ambiguous { prefix: String, matches: String },
    #[error("reading {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error(
        "job {job_id}'s log ({size} bytes, sha256 {sha256}) is no longer on this runner: it was removed after its retention (jobs.log_retention_days), once the control plane had acknowledged it"
    )]
    LogRemoved { job_id: String, size: u64, sha256: String },
}

/// Missing or unreadable is an error naming what to fix, never "nothing here".
pub fn check_state_dir(state_dir: &Path) -> Result<(), InspectError> {
    match std::fs::read_dir(state_dir) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(InspectError::NoStateDir(state_dir.display().to_string()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            Err(InspectError::Permission(state_dir.display().to_string()))
        }
        Err(e) => Err(InspectError::Io { path: state_dir.display().to_string(), source: e }),
    }
}

pub fn load_index(state_dir: &Path) -> Result<Index, InspectError> {
    check_state_dir(state_dir)?;
    if !StateDir::of(state_dir).journal().exists() {
        return Ok(Index::default());
    }
    Ok(journal::read_index(state_dir)?)
}

#[derive(Debug, Serialize)]
pub struct Status {
    pub state_dir: String,
    pub enrolled: bool,
    pub runner_id: Option<String>,
    pub install_id: Option<String>,
    pub control_plane_url: Option<String>,
    pub daemon_pid: Option<u32>,
    pub daemon_running: bool,
    pub jobs_total: usize,
    pub jobs_running: Vec<String>,
    /// Claimed, held back until a maintenance window opens or an admin approves.
    pub jobs_waiting: Vec<String>,
    pub jobs_unreported: Vec<String>,
    pub jobs_by_status: std::collections::BTreeMap<String, usize>,
    pub rejections: usize,
    pub last_rejection: Option<journal::Rejection>,
    /// The customer's pause, if in force.
    pub paused: Option<crate::roles::pause::Pause>,
    /// Bytes on disk of each part of the state dir.
    pub disk_use: std::collections::BTreeMap<&'static str, u64>,
    /// The customer's copies of the audit log, each sink's delivery and health.
    pub audit_export: Vec<crate::audit_export::ExportStatus>,
}

/// Bytes of each part of the state dir the runner grows: job logs, the journal, the
/// audit log, unpacked components, terraform state, plan-only jobs' saved plans.
fn disk_use(state_dir: &Path) -> std::collections::BTreeMap<&'static str, u64> {
    fn bytes(path: &Path) -> u64 {
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.is_dir() => std::fs::read_dir(path)
                .map(|entries| entries.flatten().map(|e| bytes(&e.path())).sum())
                .unwrap_or(0),
            Ok(m) => m.len(),
            Err(_) => 0,
        }
    }
    [
        ("job_logs", StateDir::of(state_dir).spool()),
        ("journal", StateDir::of(state_dir).journal()),
        ("audit", StateDir::of(state_dir).audit()),
        ("artifacts", StateDir::of(state_dir).artifacts()),
        ("terraform_state", StateDir::of(state_dir).tfstate()),
        ("plans", StateDir::of(state_dir).plans()),
        ("disk_reserve", StateDir::of(state_dir).disk_reserve()),
    ]
    .into_iter()
    .map(|(name, path)| (name, bytes(&path)))
    .collect()
}

pub fn status(state_dir: &Path) -> Result<Status, InspectError> {
    status_of(state_dir, &load_index(state_dir)?)
}

/// The status over a journal index already read.
pub fn status_of(state_dir: &Path, index: &Index) -> Result<Status, InspectError> {
    let enrollment = identity::load_enrollment(state_dir)?;
    let pid: Option<u32> =
        std::fs::read_to_string(StateDir::of(state_dir).pid()).ok().and_then(|s| s.trim().parse().ok());
    let running = pid.is_some_and(|p| Path::new(&format!("/proc/{p}")).exists());
    let mut by_status = std::collections::BTreeMap::new();
    for j in index.jobs.values() {
        *by_status.entry(status_label(j)).or_insert(0) += 1;
    }
    Ok(Status {
        state_dir: state_dir.display().to_string(),
        enrolled: enrollment.is_some(),
        runner_id: enrollment.as_ref().map(|e| e.runner_id.clone()),
        install_id: enrollment.as_ref().map(|e| e.install_id.clone()),
        control_plane_url: enrollment.as_ref().map(|e| e.control_plane_url.clone()),
        daemon_pid: pid.filter(|_| running),
        daemon_running: running,
        jobs_total: index.jobs.len(),
        jobs_running: ids_in(index, &[Phase::Claimed, Phase::Started]),
        jobs_waiting: ids_in(index, &[Phase::WaitingWindow, Phase::AwaitingApproval]),
        jobs_unreported: ids_in(index, &[Phase::Finished]),
        jobs_by_status: by_status,
        rejections: index.rejections.len(),
        last_rejection: index.rejections.last().cloned(),
        paused: crate::roles::pause::read(state_dir),
        disk_use: disk_use(state_dir),
        audit_export: crate::audit_export::status(state_dir),
    })
}

fn ids_in(index: &Index, phases: &[Phase]) -> Vec<String> {
    index
        .order
        .iter()
        .filter(|id| index.jobs.get(*id).is_some_and(|j| phases.contains(&j.phase)))
        .cloned()
        .collect()
}

/// Every word [`status_label`] can say (what `jobs list --status` takes).
pub const STATUS_LABELS: &[&str] = &[
    "succeeded",
    "failed",
    "timed_out",
    "cancelled",
    "interrupted",
    "fenced",
    "running",
    "received",
    "rejected",
    "claim_refused",
    "waiting_window",
    "awaiting_approval",
    "finished",
    "reported",
];

/// The one-word state a person wants: the final status if there is one, else the phase.
pub fn status_label(j: &JobRecord) -> String {
    match &j.finished {
        // Another runner of the install has the job now: what ended here is not its end.
        _ if j.phase == Phase::Fenced => "fenced".into(),
        Some(f) => f.status.as_str().to_string(),
        None => match j.phase {
            Phase::Claimed | Phase::Started => "running".into(),
            p => p.as_str().into(),
        },
    }
}

/// The journal's jobs, or with `all` the archive's too.
fn index_of(state_dir: &Path, all: bool) -> Result<Index, InspectError> {
    if all {
        check_state_dir(state_dir)?;
        Ok(journal::read_index_all(state_dir)?)
    } else {
        load_index(state_dir)
    }
}

/// Newest first; `all`: archived jobs too.
/// Newest first, the first `limit` of those `keep` accepts; `all`: archived jobs too.
pub fn jobs(
    state_dir: &Path,
    limit: usize,
    all: bool,
    keep: impl Fn(&JobRecord) -> bool,
) -> Result<Vec<JobRecord>, InspectError> {
    let index = index_of(state_dir, all)?;
    Ok(index
        .order
        .iter()
        .rev()
        .filter_map(|id| index.jobs.get(id))
        .filter(|j| keep(j))
        .take(limit)
        .cloned()
        .collect())
}

/// Newest first, the first `limit` of those `keep` accepts.
pub fn rejections(
    state_dir: &Path,
    limit: usize,
    all: bool,
    keep: impl Fn(&journal::Rejection) -> bool,
) -> Result<Vec<journal::Rejection>, InspectError> {
    let index = index_of(state_dir, all)?;
    Ok(index.rejections.iter().rev().filter(|r| keep(r)).take(limit).cloned().collect())
}

/// One job, by its exact id, from the journal or, once archived, from the archive.
pub fn job(state_dir: &Path, job_id: &str) -> Result<JobRecord, InspectError> {
    if let Some(j) = load_index(state_dir)?.jobs.get(job_id) {
        return Ok(j.clone());
    }
    index_of(state_dir, true)?.jobs.get(job_id).cloned().ok_or_else(|| InspectError::NoSuchJob(job_id.into()))
}

/// The one job whose id starts with `prefix` (as docker takes container ids). Only for
/// what no job, rejection or audit record has as its exact id: an exact id always
/// means itself.
pub fn job_by_prefix(state_dir: &Path, prefix: &str) -> Result<JobRecord, InspectError> {
    let index = index_of(state_dir, true)?;
    let matching: Vec<&JobRecord> =
        index.jobs.values().filter(|j| !prefix.is_empty() && j.job_id.starts_with(prefix)).collect();
    match matching.as_slice() {
        [one] => Ok((*one).clone()),
        [] => Err(InspectError::NoSuchJob(prefix.into())),
        many => Err(InspectError::Ambiguous {
            prefix: prefix.into(),
            matches: many.iter().map(|j| j.job_id.clone()).take(5).collect::<Vec<_>>().join(", "),
        }),
    }
}

/// A job refused before the journal had a record of it (its envelope did not verify,
/// or it was for another runner): the newest rejection naming it.
pub fn rejection_of(state_dir: &Path, job_id: &str) -> Result<Option<journal::Rejection>, InspectError> {
    let index = index_of(state_dir, true)?;
    Ok(index.rejections.iter().rev().find(|r| r.job_id.as_deref() == Some(job_id)).cloned())
}

pub fn log(state_dir: &Path, job_id: &str) -> Result<Vec<u8>, InspectError> {
    let record = job(state_dir, job_id)?;
    let path = spool::spool_path(state_dir, job_id);
    match std::fs::read(&path) {
        Ok(b) => Ok(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match record.finished {
            Some(f) if record.phase == Phase::Reported && f.log_size > 0 => Err(InspectError::LogRemoved {
                job_id: job_id.into(),
                size: f.log_size,
                sha256: f.log_sha256,
            }),
            _ => Ok(Vec::new()),
        },
        Err(e) => Err(InspectError::Io { path: path.display().to_string(), source: e }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_state_dir_says_so() {
        let err = status(Path::new("/nonexistent/byoc")).unwrap_err();
        assert!(err.to_string().contains("does not exist"));
    }
}
