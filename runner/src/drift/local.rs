//! Drift checks the runner starts itself: on the customer's `[drift]` schedules and on
//! `byoc-runner drift run NAME` (docs/DRIFT.md).
//!
//! What to check comes from the vendor: every deploy that succeeded here (a terraform
//! apply, a kubernetes apply) leaves a *target*, the deploy's signed payload with its
//! spec turned into a drift check's (`Executor::drift_spec`), in
//! `<state dir>/drift/targets/<kind>.<name>.json`. A deploy that carried secrets leaves
//! none (secrets never go to disk), and removes an older one: the component changed, and
//! only the control plane can send its check. A local check is that payload under a
//! job id of its own ([`byoc_protocol::LOCAL_JOB_PREFIX`]), admitted by the same checks
//! as a delivery (pause, disk, role, app policies) and run on the same path; its
//! control-plane calls are answered on the VM (`control_plane::local`).

use std::path::{Path, PathBuf};

use byoc_protocol::JobPayload;
use serde::{Deserialize, Serialize};

use crate::config::DriftSchedule;
use crate::state_dir::StateDir;

const TARGETS_DIR: &str = "targets";
/// `control/drift-run.<kind>.<name>.json`: `byoc-runner drift run` asks the daemon.
const REQUEST_PREFIX: &str = "drift-run.";
/// A request file is a few hundred bytes; anything bigger is not one.
const MAX_REQUEST: u64 = 4096;

/// A component the runner can check on its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Target {
    /// `terraform`, `kubernetes` or `helm`.
    pub kind: String,
    /// The terraform workspace, kubernetes component or helm release.
    pub name: String,
    /// The deploy that left it.
    pub from_job: String,
    pub recorded_at_ms: u64,
    /// The deploy's payload, its spec a drift check's.
    pub payload: JobPayload,
}

fn targets_dir(state_dir: &Path) -> PathBuf {
    StateDir::of(state_dir).drift().join(TARGETS_DIR)
}

fn target_path(state_dir: &Path, kind: &str, name: &str) -> PathBuf {
    targets_dir(state_dir).join(format!("{kind}.{name}.json"))
}

/// The name a drift spec checks: its workspace, component or release.
fn checked_name(kind: &str, spec: &serde_json::Value) -> Option<String> {
    let key = match kind {
        "terraform" => "workspace",
        "kubernetes" => "component",
        "helm" => "release",
        _ => return None,
    };
    spec[key].as_str().filter(|n| byoc_job_executors::terraform::valid_name(n)).map(str::to_string)
}

/// After a deploy succeeded: keep what a check of it needs, or forget an older target
/// when this deploy carried secrets. `Ok(true)` when a target was kept.
pub fn remember(
    state_dir: &Path,
    payload: &JobPayload,
    executor: &dyn byoc_job_executors::Executor,
    at_ms: u64,
) -> std::io::Result<bool> {
    if payload.entity != "component" || payload.operation != "deploy" {
        return Ok(false);
    }
    let Some(spec) = executor.drift_spec() else { return Ok(false) };
    let Some(name) = checked_name(&payload.kind, &spec) else { return Ok(false) };
    let path = target_path(state_dir, &payload.kind, &name);
    if !executor.secrets().is_empty() {
        return match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(false),
        };
    }
    let mut payload = payload.clone();
    payload.spec = spec;
    payload.operation = "drift".into();
    let target = Target {
        kind: payload.kind.clone(),
        name,
        from_job: payload.job_id.clone(),
        recorded_at_ms: at_ms,
        payload,
    };
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(targets_dir(state_dir))?;
    let bytes = serde_json::to_vec(&target).map_err(std::io::Error::other)?;
    crate::state_dir::write(&path, &bytes, 0o600)?;
    Ok(true)
}

/// Every target, by kind and name.
pub fn targets(state_dir: &Path) -> Vec<Target> {
    let Ok(entries) = std::fs::read_dir(targets_dir(state_dir)) else { return Vec::new() };
    let mut out: Vec<Target> = entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
        .collect();
    out.sort_by(|a, b| (&a.name, &a.kind).cmp(&(&b.name, &b.kind)));
    out
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FindError {
    #[error(
        "no deploy of {0:?} without secrets has succeeded on this runner: nothing to check it against (a deploy that carries secrets leaves nothing on disk; the control plane can send its drift check)"
    )]
    NotFound(String),
    #[error("{name:?} is both a {kinds}: name the kind (--kind)")]
    Ambiguous { name: String, kinds: String },
}

/// The target `name` (of `kind`, when given).
pub fn find(state_dir: &Path, name: &str, kind: Option<&str>) -> Result<Target, FindError> {
    let mut found: Vec<Target> = targets(state_dir)
        .into_iter()
        .filter(|t| t.name == name && kind.is_none_or(|k| t.kind == k))
        .collect();
    match found.len() {
        0 => Err(FindError::NotFound(name.to_string())),
        1 => Ok(found.remove(0)),
        _ => Err(FindError::Ambiguous {
            name: name.to_string(),
            kinds: found.iter().map(|t| t.kind.as_str()).collect::<Vec<_>>().join(" and a "),
        }),
    }
}

/// A check `drift run` asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub name: String,
    pub kind: Option<String>,
    pub by: String,
    pub at_ms: u64,
}

/// The CLI: ask the daemon for a check, durably.
pub fn request(state_dir: &Path, r: &Request) -> std::io::Result<PathBuf> {
    let control = StateDir::of(state_dir).control();
    let path =
        control.join(format!("{REQUEST_PREFIX}{}.{}.json", r.kind.as_deref().unwrap_or("any"), r.name));
    let bytes = serde_json::to_vec(r).map_err(std::io::Error::other)?;
    crate::state_dir::write(&path, &bytes, 0o660)?;
    Ok(path)
}

/// The daemon: every waiting request, each removed as it is taken (a damaged one is
/// dropped: the CLI audited the request before it wrote it).
pub fn take_requests(state_dir: &Path) -> Vec<Request> {
    use std::io::Read as _;
    let control = StateDir::of(state_dir).control();
    let Ok(entries) = std::fs::read_dir(&control) else { return Vec::new() };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.starts_with(REQUEST_PREFIX) || !name.ends_with(".json") {
            continue;
        }
        let mut bytes = Vec::new();
        let read = std::fs::File::open(e.path()).and_then(|f| f.take(MAX_REQUEST).read_to_end(&mut bytes));
        let _ = std::fs::remove_file(e.path());
        match read.ok().and_then(|_| serde_json::from_slice::<Request>(&bytes).ok()) {
            Some(r) if byoc_job_executors::terraform::valid_name(&r.name) => out.push(r),
            _ => tracing::warn!(file = %name, "Dropped an unreadable drift check request."),
        }
    }
    out.sort_by_key(|r| r.at_ms);
    out
}

/// The payload of a check of `target` now: a job id and nonce of its own, valid for
/// its timeout and a margin, asking for the customer's role if one is configured.
pub fn payload(
    target: &Target,
    runner_id: &str,
    install_id: &str,
    now: i64,
    role: Option<&str>,
) -> JobPayload {
    let mut p = target.payload.clone();
    let suffix = byoc_protocol::random_hex(6);
    p.job_id = format!("{}drift-{}-{}-{suffix}", byoc_protocol::LOCAL_JOB_PREFIX, target.kind, target.name);
    p.nonce = format!("{}{suffix}", byoc_protocol::LOCAL_JOB_PREFIX);
    p.runner_id = runner_id.to_string();
    p.install_id = install_id.to_string();
    p.issued_at = now;
    p.expires_at = now.saturating_add(p.timeout_secs as i64).saturating_add(600);
    p.attempt = 1;
    if let Some(role) = role {
        let mut rr = p.role_request.unwrap_or_default();
        rr.runtime_override = Some(role.to_string());
        p.role_request = Some(rr);
    }
    p
}

/// Which schedules are due at `now_ms`: never checked, or last checked (by anyone:
/// the control plane's checks count) `every` ago or more. `last_tried` holds when the
/// runner last tried each schedule (so a skipped one waits before the next try).
pub fn due<'a>(
    schedules: &'a [DriftSchedule],
    records: &[super::DriftRecord],
    last_tried: &std::collections::BTreeMap<(String, Option<String>), u64>,
    now_ms: u64,
) -> Vec<&'a DriftSchedule> {
    schedules
        .iter()
        .filter(|s| {
            let checked = records
                .iter()
                .filter(|r| r.workspace == s.name && s.kind.as_ref().is_none_or(|k| *k == r.kind))
                .map(|r| r.checked_at_ms)
                .max();
            let tried = last_tried.get(&(s.name.clone(), s.kind.clone())).copied();
            let last = checked.into_iter().chain(tried).max();
            last.is_none_or(|t| now_ms >= t.saturating_add(s.every_secs * 1000))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drift::DriftRecord;

    fn schedule(name: &str, every_secs: u64) -> DriftSchedule {
        DriftSchedule { name: name.into(), kind: None, every_secs }
    }

    fn checked(name: &str, at_ms: u64) -> DriftRecord {
        DriftRecord {
            kind: "terraform".into(),
            workspace: name.into(),
            job_id: "j".into(),
            checked_at_ms: at_ms,
            verdict: "clean".into(),
            drifted: serde_json::Value::Null,
            would_change: serde_json::Value::Null,
            violations: serde_json::Value::Null,
            refresh_plan_digest: String::new(),
            plan_digest: String::new(),
        }
    }

    #[test]
    fn a_schedule_is_due_every_period_after_the_last_check_or_try() {
        let s = [schedule("network", 3600), schedule("db", 60)];
        let mut tried = std::collections::BTreeMap::new();
        let names = |d: Vec<&DriftSchedule>| d.into_iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        // Never checked: both at once.
        assert_eq!(names(due(&s, &[], &tried, 1_000)), ["network", "db"]);
        // Checked (by the control plane's job, say) 30 minutes ago: only db.
        let records = [checked("network", 0), checked("db", 0)];
        assert_eq!(names(due(&s, &records, &tried, 1_800_000)), ["db"]);
        // Tried a minute ago and skipped (paused): not again until its period passed.
        tried.insert(("db".to_string(), None), 1_790_000);
        assert!(due(&s, &records, &tried, 1_800_000).is_empty());
        assert_eq!(names(due(&s, &records, &tried, 1_850_000)), ["db"]);
        assert_eq!(names(due(&s, &records, &tried, 3_600_000)), ["network", "db"]);
    }

    #[test]
    fn a_deploy_leaves_a_target_unless_it_carried_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = crate::testing::payload("job-1");
        p.kind = "terraform".into();
        p.entity = "component".into();
        p.operation = "deploy".into();
        p.spec = serde_json::json!({"mode": "apply", "workspace": "network", "files": {"main.tf": ""}});
        let exec = byoc_job_executors::build(&p.kind, &p.spec).unwrap();
        assert!(remember(dir.path(), &p, exec.as_ref(), 5).unwrap());
        let t = find(dir.path(), "network", None).unwrap();
        assert_eq!(
            (t.kind.as_str(), t.from_job.as_str(), t.payload.operation.as_str()),
            ("terraform", "job-1", "drift")
        );
        assert_eq!(t.payload.spec["mode"], "drift");
        // The check built from it: a job id of its own, this runner's, built to be admitted.
        let local = payload(&t, "rn-9", "inst-9", 100, Some("auditor"));
        assert!(local.job_id.starts_with("local-drift-terraform-network-"), "{}", local.job_id);
        assert!(crate::pipeline::verify::valid_job_id(&local.job_id));
        assert_eq!((local.runner_id.as_str(), local.issued_at), ("rn-9", 100));
        assert_eq!(local.role_request.unwrap().runtime_override.as_deref(), Some("auditor"));
        let check = byoc_job_executors::build(&local.kind, &local.spec).unwrap();
        assert!(
            byoc_job_executors::check_drift_operation(&local.entity, &local.operation, check.as_ref())
                .is_ok()
        );

        // A later deploy with a secret variable: the target goes (its contract changed).
        p.spec["secret_vars"] = serde_json::json!({"db_password": "hunter2-hunter2"});
        let exec = byoc_job_executors::build(&p.kind, &p.spec).unwrap();
        assert!(!remember(dir.path(), &p, exec.as_ref(), 6).unwrap());
        assert_eq!(find(dir.path(), "network", None), Err(FindError::NotFound("network".into())));
        assert!(
            !std::fs::read_dir(targets_dir(dir.path())).unwrap().any(|_| true),
            "nothing of it left on disk"
        );
        // Anything but a deploy leaves nothing.
        p.operation = "drift".into();
        p.spec = serde_json::json!({"mode": "drift", "workspace": "network", "files": {"main.tf": ""}});
        let exec = byoc_job_executors::build(&p.kind, &p.spec).unwrap();
        assert!(!remember(dir.path(), &p, exec.as_ref(), 7).unwrap());
    }

    #[test]
    fn requests_are_taken_once_and_damaged_ones_dropped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("control")).unwrap();
        let r = Request { name: "network".into(), kind: None, by: "alice".into(), at_ms: 1 };
        request(dir.path(), &r).unwrap();
        std::fs::write(dir.path().join("control/drift-run.any.bad.json"), b"{not json").unwrap();
        std::fs::write(dir.path().join("control/pause.json"), b"{}").unwrap();
        assert_eq!(take_requests(dir.path()), [r]);
        assert!(take_requests(dir.path()).is_empty());
        assert!(dir.path().join("control/pause.json").exists(), "only requests are taken");
    }
}
