//! Local approvals (`[[guardrails.approval_rule]]`, docs/GUARDRAILS.md). The daemon
//! leaves a request for each job it holds in `control/approvals/<job>.request.json`;
//! `byoc-runner approve|deny` (root or `roles.admin_group`) answers it with
//! `<job>.decision.json`. Both are written durably (temp file, fsync, rename, fsync the
//! directory) before anyone acts on them; the daemon removes both when the job leaves
//! the gate. A decision that cannot be read counts as a denial: nothing runs on a
//! guess.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::state_dir::StateDir;

const MAX_FILE: u64 = 64 << 10;

/// What a held job will do, for the person asked to approve it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub job_id: String,
    pub kind: String,
    /// `entity.operation`.
    pub operation: String,
    pub role: Option<String>,
    pub component: Option<String>,
    pub rule: String,
    pub requested_at_ms: u64,
    pub expires_at_ms: u64,
    /// Plan approvals (`on = "plan"`): the plan the approval binds to, what it does
    /// (counts and addresses, never values) and why the rule asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_digest: Option<String>,
    /// The digest of the JSON the policies judged (the runner's rendering of that plan).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judged_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub findings: Vec<String>,
    /// The plan's checks that passed (`pass` rules): shown beside why the rule asked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub passed: Vec<String>,
    /// A `runner.update` job: the version it installs. An approval of it is also left
    /// for the root updater (`control/update-approvals/`), which installs a release in
    /// `mode = "approve"` only with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_version: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub approved: bool,
    /// User name (or `uid N`).
    pub by: String,
    pub uid: u32,
    #[serde(default)]
    pub reason: Option<String>,
    pub at_ms: u64,
    /// The plan approved (copied from the request): the daemon applies only that plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_digest: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ApprovalError {
    #[error("no job {0:?} is awaiting approval (`byoc-runner approvals` lists those that are)")]
    NotAwaiting(String),
    #[error("job {0:?} was already {1}")]
    AlreadyDecided(String, &'static str),
    #[error("the approval request of job {0:?} expired; the job will be refused (approval_expired)")]
    Expired(String),
    #[error("{0:?} is not a job id")]
    BadJobId(String),
    #[error("the reason is longer than 500 characters")]
    ReasonTooLong,
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
}

pub fn dir(state_dir: &Path) -> PathBuf {
    StateDir::of(state_dir).approvals()
}

/// Job ids name files here: letters, digits, `-`, `_`, `.`, not leading with a dot.
fn file_safe(job_id: &str) -> bool {
    !job_id.is_empty()
        && job_id.len() <= 128
        && !job_id.starts_with('.')
        && job_id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

fn request_path(state_dir: &Path, job_id: &str) -> PathBuf {
    dir(state_dir).join(format!("{job_id}.request.json"))
}

fn decision_path(state_dir: &Path, job_id: &str) -> PathBuf {
    dir(state_dir).join(format!("{job_id}.decision.json"))
}

fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), ApprovalError> {
    let parent = path.parent().unwrap_or(Path::new("."));
    let io = |op, p: &Path, e| ApprovalError::Io { op, path: p.to_path_buf(), source: e };
    byoc_statefs::create_dir(parent, 0o700).map_err(|e| io("creating", parent, e))?;
    // Readable by the daemon's user and the admin group whoever writes it (the
    // directory keeps others out).
    crate::state_dir::write(path, bytes, 0o644).map_err(|e| io("writing", path, e))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Option<Result<T, ApprovalError>> {
    read_owned::<T>(path).map(|r| r.map(|(v, _)| v))
}

/// A file of `control/approvals/`, never through a link, with its owner's uid: who wrote
/// it, as the kernel says.
fn read_owned<T: serde::de::DeserializeOwned>(path: &Path) -> Option<Result<(T, u32), ApprovalError>> {
    use std::io::Read as _;
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let read_err = |source| ApprovalError::Io { op: "reading", path: path.to_path_buf(), source };
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits() | nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open(path)
    {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(Err(read_err(e))),
        Ok(f) => f,
    };
    let owner = match f.metadata() {
        Ok(m) if m.is_file() => m.uid(),
        Ok(_) => return Some(Err(read_err(std::io::Error::other("not a regular file")))),
        Err(e) => return Some(Err(read_err(e))),
    };
    let mut bytes = Vec::new();
    if let Err(e) = f.take(MAX_FILE).read_to_end(&mut bytes) {
        return Some(Err(read_err(e)));
    }
    Some(serde_json::from_slice(&bytes).map(|v| (v, owner)).map_err(|e| read_err(std::io::Error::other(e))))
}

/// The daemon: ask for approval of a held job.
pub fn write_request(state_dir: &Path, r: &Request) -> Result<(), ApprovalError> {
    if !file_safe(&r.job_id) {
        return Err(ApprovalError::BadJobId(r.job_id.clone()));
    }
    // A decision left from before (a restart) must not answer this new request.
    let _ = std::fs::remove_file(decision_path(state_dir, &r.job_id));
    write_durably(&request_path(state_dir, &r.job_id), &serde_json::to_vec_pretty(r).unwrap_or_default())
}

/// The request left for `job_id`, if any (a resumed job keeps its first one: its
/// expiry and any answer given while the runner was down).
pub fn read_request(state_dir: &Path, job_id: &str) -> Option<Request> {
    if !file_safe(job_id) {
        return None;
    }
    read_json::<Request>(&request_path(state_dir, job_id))?.ok()
}

/// The daemon: the answer, if any. A damaged decision denies. Who decided is the file's
/// owner as the kernel says; the name in it counts only when root wrote it (root's CLI
/// names the person behind `sudo`).
pub fn decision(state_dir: &Path, job_id: &str) -> Option<Decision> {
    match read_owned::<Decision>(&decision_path(state_dir, job_id))? {
        Ok((d, 0)) => Some(d),
        Ok((d, owner)) => {
            Some(Decision { by: crate::roles::allowance::writer(owner, &d.by), uid: owner, ..d })
        }
        Err(e) => Some(Decision {
            approved: false,
            by: "unknown".into(),
            uid: u32::MAX,
            reason: Some(format!("the decision file could not be read ({e}); treated as a denial")),
            at_ms: 0,
            plan_digest: None,
        }),
    }
}

/// The daemon: the job left the gate.
pub fn clear(state_dir: &Path, job_id: &str) {
    if !file_safe(job_id) {
        return;
    }
    for p in [request_path(state_dir, job_id), decision_path(state_dir, job_id)] {
        if let Err(e) = std::fs::remove_file(&p)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(error = %e, path = %p.display(), "Could not remove an approval file: {e}.");
        }
    }
}

/// Requests the daemon left, each with its answer if it has one, oldest first.
pub fn requests(state_dir: &Path) -> Vec<(Request, Option<Decision>)> {
    requests_checked(state_dir).unwrap_or_default()
}

/// As [`requests`], for the CLI: a directory or a request that is there and cannot be
/// read is an error (never "no job is awaiting approval").
pub fn requests_checked(state_dir: &Path) -> Result<Vec<(Request, Option<Decision>)>, ApprovalError> {
    let entries = match std::fs::read_dir(dir(state_dir)) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(ApprovalError::Io { op: "reading", path: dir(state_dir), source }),
    };
    let mut out = Vec::new();
    for id in entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".request.json").map(str::to_string))
        .filter(|id| file_safe(id))
    {
        if let Some(r) = read_json::<Request>(&request_path(state_dir, &id)) {
            out.push((r?, decision(state_dir, &id)));
        }
    }
    out.sort_by_key(|(r, _)| r.requested_at_ms);
    Ok(out)
}

/// The CLI: answer a waiting request. Refuses an unknown or answered job, or an
/// expired request, and writes nothing then.
pub fn decide(
    state_dir: &Path,
    job_id: &str,
    decision: Decision,
    now_ms: u64,
) -> Result<Request, ApprovalError> {
    if !file_safe(job_id) {
        return Err(ApprovalError::BadJobId(job_id.to_string()));
    }
    if decision.reason.as_ref().is_some_and(|r| r.chars().count() > 500) {
        return Err(ApprovalError::ReasonTooLong);
    }
    let request = match read_json::<Request>(&request_path(state_dir, job_id)) {
        Some(Ok(r)) => r,
        _ => return Err(ApprovalError::NotAwaiting(job_id.to_string())),
    };
    if let Some(d) = read_json::<Decision>(&decision_path(state_dir, job_id)) {
        let was = match d {
            Ok(d) if d.approved => "approved",
            _ => "denied",
        };
        return Err(ApprovalError::AlreadyDecided(job_id.to_string(), was));
    }
    if now_ms >= request.expires_at_ms {
        return Err(ApprovalError::Expired(job_id.to_string()));
    }
    write_durably(
        &decision_path(state_dir, job_id),
        &serde_json::to_vec_pretty(&decision).unwrap_or_default(),
    )?;
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(job_id: &str, expires_at_ms: u64) -> Request {
        Request {
            job_id: job_id.into(),
            kind: "action.script".into(),
            operation: "action.trigger".into(),
            role: Some("break_glass".into()),
            component: None,
            rule: "break-glass".into(),
            requested_at_ms: 1_000,
            expires_at_ms,
            plan_digest: None,
            judged_digest: None,
            summary: None,
            findings: Vec::new(),
            passed: Vec::new(),
            update_version: None,
        }
    }

    fn by(approved: bool) -> Decision {
        Decision {
            approved,
            by: "alice".into(),
            uid: 0,
            reason: Some("INC-42".into()),
            at_ms: 2_000,
            plan_digest: None,
        }
    }

    #[test]
    fn a_request_is_answered_once_and_cleared() {
        let d = tempfile::tempdir().unwrap();
        write_request(d.path(), &request("job-1", 10_000)).unwrap();
        assert_eq!(requests(d.path()), vec![(request("job-1", 10_000), None)]);
        assert_eq!(decision(d.path(), "job-1"), None);
        decide(d.path(), "job-1", by(true), 5_000).unwrap();
        let got = decision(d.path(), "job-1").unwrap();
        assert!(got.approved && got.reason == by(true).reason && got.at_ms == 2_000, "{got:?}");
        assert!(matches!(
            decide(d.path(), "job-1", by(false), 5_000),
            Err(ApprovalError::AlreadyDecided(_, "approved"))
        ));
        clear(d.path(), "job-1");
        assert!(requests(d.path()).is_empty());
        assert!(matches!(decide(d.path(), "job-1", by(true), 5_000), Err(ApprovalError::NotAwaiting(_))));
    }

    /// A decision file written by someone other than root names its writer as the kernel
    /// says, whatever it claims.
    #[test]
    fn who_decided_is_the_files_owner_not_what_it_says() {
        let d = tempfile::tempdir().unwrap();
        write_request(d.path(), &request("job-1", 10_000)).unwrap();
        decide(d.path(), "job-1", Decision { by: "the-ceo".into(), ..by(true) }, 5_000).unwrap();
        let path = decision_path(d.path(), "job-1");
        let owner = if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
            65534
        } else {
            nix::unistd::geteuid().as_raw()
        };
        let got = decision(d.path(), "job-1").unwrap();
        assert_eq!(got.uid, owner);
        assert!(got.by.contains(&format!("uid {owner}")) && !got.by.contains("the-ceo"), "{got:?}");
        // A link planted at the decision's name is not read.
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &path).unwrap();
        assert!(!decision(d.path(), "job-1").unwrap().approved);
    }

    #[test]
    fn unknown_expired_hostile_and_damaged_are_refused_or_deny() {
        let d = tempfile::tempdir().unwrap();
        assert!(matches!(decide(d.path(), "job-9", by(true), 0), Err(ApprovalError::NotAwaiting(_))));
        write_request(d.path(), &request("job-1", 10_000)).unwrap();
        assert!(matches!(decide(d.path(), "job-1", by(true), 10_000), Err(ApprovalError::Expired(_))));
        assert_eq!(decision(d.path(), "job-1"), None, "nothing written for an expired request");
        for hostile in ["../x", "", ".hidden", "a/b"] {
            assert!(
                matches!(decide(d.path(), hostile, by(true), 0), Err(ApprovalError::BadJobId(_))),
                "{hostile}"
            );
        }
        std::fs::write(decision_path(d.path(), "job-1"), b"{not json").unwrap();
        let damaged = decision(d.path(), "job-1").unwrap();
        assert!(!damaged.approved);
        // A new request for the same job is not answered by an old decision.
        write_request(d.path(), &request("job-1", 20_000)).unwrap();
        assert_eq!(decision(d.path(), "job-1"), None);
    }
}
