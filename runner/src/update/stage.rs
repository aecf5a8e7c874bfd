//! The daemon's half of an update: verify the fetched release with the pinned key and
//! stage it where the updater looks (`<state dir>/update/staged/`, then
//! `request.json`, written last and fsynced: its appearance starts the updater).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use byoc_job_executors::runner_update::{ReleaseStager, UpdateAsk};

use super::minisign::PublicKey;
use super::release::{self, Release};
use super::{Request, request_path, staged_dir};

pub struct Stager {
    pub state_dir: PathBuf,
    pub key: Option<PublicKey>,
    pub current: String,
    pub audit: Option<Arc<dyn crate::audit::AuditSink>>,
}

impl ReleaseStager for Stager {
    fn stage(
        &self,
        job_id: &str,
        tree: &Path,
        ask: &UpdateAsk,
    ) -> Result<serde_json::Value, (String, String)> {
        let key = self.key.as_ref().ok_or_else(|| {
            (
                "update_disabled".to_string(),
                "no release key is pinned ([update] release_public_key)".to_string(),
            )
        })?;
        let found = release::verify(tree, key, &ask.version, &self.current)
            .map_err(|e| (e.code().to_string(), e.to_string()))?;
        let staged = copy_release(&found, &self.state_dir).map_err(|e| {
            let _ = std::fs::remove_dir_all(staged_dir(&self.state_dir));
            ("update_staging_failed".to_string(), format!("staging the release: {e}"))
        })?;
        // What is staged is what was verified (the cache could change under a copy).
        release::verify(&staged, key, &ask.version, &self.current)
            .map_err(|e| (e.code().to_string(), e.to_string()))?;
        let request = Request {
            job_id: job_id.to_string(),
            version: found.version.clone(),
            from_version: self.current.clone(),
            package: found.package.clone(),
            package_sha256: found.package_sha256.clone(),
            sums_sha256: found.sums_sha256.clone(),
            // A rollback floor from a job spec is never believed: rollback is root's.
            min_rollback_version: None,
            rollback: false,
            staged_at_ms: crate::clock::now_ms(),
        };
        if let Some(audit) = &self.audit {
            let mut r = crate::audit_records::about_job(
                "update_started",
                [job_id, "runner.update", "runner.update"],
                None,
                format!("{} -> {} staged for the updater", self.current, found.version),
            );
            r.digests.insert("to_package_sha256".into(), found.package_sha256.clone());
            r.digests.insert("sums_sha256".into(), found.sums_sha256.clone());
            audit
                .record(r)
                .map_err(|e| ("update_staging_failed".to_string(), format!("auditing the update: {e}")))?;
        }
        crate::state_dir::write(
            &request_path(&self.state_dir),
            &serde_json::to_vec_pretty(&request).unwrap_or_default(),
            0o644,
        )
        .map_err(|e| ("update_staging_failed".to_string(), format!("writing the update request: {e}")))?;
        Ok(serde_json::json!({
            "version": found.version,
            "from_version": self.current,
            "package": found.package,
            "package_sha256": found.package_sha256,
            "downgrade": !found.replaces.is_empty() && ask.downgrade,
            "staged": true,
        }))
    }
}

/// The release's signed files into a fresh `staged/` (fsynced), replacing any before.
fn copy_release(found: &Release, state_dir: &Path) -> std::io::Result<PathBuf> {
    let dir = super::dir(state_dir);
    std::fs::create_dir_all(&dir)?;
    let tmp = dir.join("staged.tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp)?;
    for name in found.files() {
        let from = found.dir.join(name);
        if !from.exists() {
            continue;
        }
        let to = tmp.join(name);
        std::fs::copy(&from, &to)?;
        std::fs::File::open(&to)?.sync_all()?;
    }
    std::fs::File::open(&tmp)?.sync_all()?;
    let staged = staged_dir(state_dir);
    let _ = std::fs::remove_dir_all(&staged);
    std::fs::rename(&tmp, &staged)?;
    std::fs::File::open(&dir)?.sync_all()?;
    // The updater (root) reads it; the directory above keeps everyone else out.
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755))?;
    Ok(staged)
}

#[cfg(test)]
mod tests {
    use super::super::release::fixture;
    use super::*;

    fn ask(version: &str) -> UpdateAsk {
        UpdateAsk { version: version.into(), downgrade: false, min_rollback_version: Some("0.1.0".into()) }
    }

    #[test]
    fn a_verified_release_is_staged_and_the_request_written_last() {
        let (state, tree) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let package = fixture::release(tree.path(), "0.2.0", &[]);
        let stager = Stager {
            state_dir: state.path().into(),
            key: Some(fixture::public_key()),
            current: "0.1.0".into(),
            audit: None,
        };
        let out = stager.stage("job-1", tree.path(), &ask("0.2.0")).unwrap();
        assert_eq!(out["version"], "0.2.0");
        let req: Request =
            serde_json::from_slice(&std::fs::read(request_path(state.path())).unwrap()).unwrap();
        assert_eq!(
            (req.version.as_str(), req.from_version.as_str(), req.package.as_str()),
            ("0.2.0", "0.1.0", package.as_str())
        );
        // The job's rollback floor is not passed on: rollback is root's alone.
        assert_eq!(req.min_rollback_version, None);
        assert!(staged_dir(state.path()).join(&package).is_file());
        assert_eq!(super::super::pending(state.path()).as_deref(), Some("0.2.0"));
    }

    #[test]
    fn a_refused_release_stages_nothing() {
        let (state, tree) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let package = fixture::release(tree.path(), "0.2.0", &[]);
        std::fs::write(tree.path().join(&package), "tampered").unwrap();
        let stager = Stager {
            state_dir: state.path().into(),
            key: Some(fixture::public_key()),
            current: "0.1.0".into(),
            audit: None,
        };
        let (code, _) = stager.stage("job-1", tree.path(), &ask("0.2.0")).unwrap_err();
        assert_eq!(code, "update_digest_mismatch");
        assert!(!request_path(state.path()).exists());
        assert!(!staged_dir(state.path()).exists());
        let unkeyed = Stager { key: None, ..stager };
        assert_eq!(unkeyed.stage("job-1", tree.path(), &ask("0.2.0")).unwrap_err().0, "update_disabled");
    }
}
