//! The last drift check of each terraform workspace (`mode = "drift"`), kubernetes
//! component and helm release (`action = "drift"`), docs/DRIFT.md, kept in
//! `<state dir>/drift/<workspace>.json` (`<kind>.<name>.json` for kubernetes and helm)
//! for `byoc-runner drift` and `status`:
//! the verdict (clean, drifted, violating), when, which job, what drifted (addresses
//! and attribute paths, never values), what a deploy would change, and the violations.

use std::path::{Path, PathBuf};

use crate::state_dir::StateDir;
use serde::{Deserialize, Serialize};

pub mod local;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DriftRecord {
    /// `terraform`, `kubernetes` or `helm`.
    #[serde(default = "terraform")]
    pub kind: String,
    /// The terraform workspace, the kubernetes component or the helm release.
    pub workspace: String,
    pub job_id: String,
    pub checked_at_ms: u64,
    /// `clean`, `drifted` or `violating`.
    pub verdict: String,
    /// Address, actions and changed attribute paths per resource changed outside
    /// terraform.
    pub drifted: serde_json::Value,
    /// Counts and addresses per action a deploy of the component would make.
    pub would_change: serde_json::Value,
    pub violations: serde_json::Value,
    pub refresh_plan_digest: String,
    pub plan_digest: String,
}

fn terraform() -> String {
    "terraform".into()
}

fn path(state_dir: &Path, kind: &str, workspace: &str) -> PathBuf {
    // Names are [a-z0-9_-]: the dot keeps kinds apart.
    let name =
        if kind == "terraform" { format!("{workspace}.json") } else { format!("{kind}.{workspace}.json") };
    StateDir::of(state_dir).drift().join(name)
}

/// Keep a finished drift job's result as its workspace's latest. `outputs` is the
/// job's result outputs; anything but a drift result is ignored.
pub fn record(
    state_dir: &Path,
    job_id: &str,
    at_ms: u64,
    outputs: &serde_json::Value,
) -> std::io::Result<()> {
    let d = &outputs["drift"];
    let Some(workspace) = d["workspace"].as_str() else { return Ok(()) };
    let kind = d["kind"].as_str().unwrap_or("terraform");
    if !byoc_job_executors::terraform::valid_name(workspace)
        || !matches!(kind, "terraform" | "kubernetes" | "helm")
    {
        return Ok(());
    }
    let r = DriftRecord {
        kind: kind.to_string(),
        workspace: workspace.to_string(),
        job_id: job_id.to_string(),
        checked_at_ms: at_ms,
        verdict: d["verdict"].as_str().unwrap_or("unknown").to_string(),
        drifted: d["drifted"].clone(),
        would_change: d["would_change"].clone(),
        violations: outputs["violations"].clone(),
        refresh_plan_digest: d["refresh_plan_digest"].as_str().unwrap_or("").to_string(),
        plan_digest: d["plan_digest"].as_str().unwrap_or("").to_string(),
    };
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(StateDir::of(state_dir).drift())?;
    let bytes = serde_json::to_vec_pretty(&r).map_err(std::io::Error::other)?;
    crate::state_dir::write(&path(state_dir, kind, workspace), &bytes, 0o600)
}

/// Every workspace's latest drift check, by name.
pub fn list(state_dir: &Path) -> Vec<DriftRecord> {
    let Ok(entries) = std::fs::read_dir(StateDir::of(state_dir).drift()) else { return Vec::new() };
    let mut out: Vec<DriftRecord> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
        .collect();
    out.sort_by(|a, b| (&a.workspace, &a.kind).cmp(&(&b.workspace, &b.kind)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_check_per_workspace_is_kept_and_other_results_ignored() {
        let d = tempfile::tempdir().unwrap();
        let out = |verdict: &str| {
            serde_json::json!({"drift": {"workspace": "network", "verdict": verdict, "drifted": [],
                "would_change": {"counts": {}}, "refresh_plan_digest": "sha256:a", "plan_digest": "sha256:b"},
                "violations": []})
        };
        record(d.path(), "job-1", 1, &out("drifted")).unwrap();
        record(d.path(), "job-2", 2, &out("clean")).unwrap();
        record(d.path(), "job-3", 3, &serde_json::json!({"summary": {}})).unwrap();
        record(d.path(), "job-4", 4, &serde_json::json!({"drift": {"workspace": "../x"}})).unwrap();
        record(d.path(), "job-5", 5, &serde_json::json!({"drift": {"workspace": "network", "kind": "../x"}}))
            .unwrap();
        // A kubernetes component of the same name is kept apart.
        let mut k8s = out("drifted");
        k8s["drift"]["kind"] = "kubernetes".into();
        record(d.path(), "job-6", 6, &k8s).unwrap();
        let all = list(d.path());
        assert_eq!(all.len(), 2);
        assert_eq!((all[0].kind.as_str(), all[0].verdict.as_str()), ("kubernetes", "drifted"));
        assert_eq!((all[1].job_id.as_str(), all[1].verdict.as_str()), ("job-2", "clean"));
    }
}
