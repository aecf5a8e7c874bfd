//! A saved plan named by its digest: known, fresh and exactly that digest, or refused.

use super::tree::LOCK_FILE;
use super::{PLAN_FILE, Terraform, saved_lock, sha256_file};
use crate::ExecOutcome;
use crate::tool::{Run, SealedDir, Step, failed};

impl Terraform {
    /// Copy the saved plan `want` of this workspace, and the lock file it was made with,
    /// into the sealed directory: refused as `plan_unknown`, `plan_stale` (older than
    /// `plan_max_age`) or `plan_digest_mismatch`.
    pub(super) fn take_saved_plan(&self, run: &Run<'_, '_>, want: &str, sealed: &SealedDir) -> Step<()> {
        let plan_path = sealed.path.join(PLAN_FILE);
        let saved = self.saved_plan(&run.ctx.settings.tools.plans_dir, want);
        let age = std::fs::metadata(&saved).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
        let Some(age) = age else {
            return Err(failed(
                "plan_unknown",
                format!("no saved plan {want} for workspace {}", self.spec.workspace),
                serde_json::Value::Null,
            ));
        };
        if age > run.ctx.settings.tools.plan_max_age {
            return Err(failed(
                "plan_stale",
                format!(
                    "saved plan {want} is {}s old (the limit is {}s): plan again",
                    age.as_secs(),
                    run.ctx.settings.tools.plan_max_age.as_secs()
                ),
                serde_json::Value::Null,
            ));
        }
        match sha256_file(&saved) {
            Ok(d) if d == want => {}
            Ok(d) => {
                return Err(failed(
                    "plan_digest_mismatch",
                    format!("saved plan has digest {d}, the job names {want}"),
                    serde_json::Value::Null,
                ));
            }
            Err(e) => return Err(ExecOutcome::failed(format!("reading saved plan: {e}"))),
        }
        std::fs::copy(&saved, &plan_path)
            .and_then(|_| std::fs::copy(saved_lock(&saved), sealed.path.join(LOCK_FILE)))
            .map(|_| ())
            .map_err(|e| ExecOutcome::failed(format!("copying saved plan: {e}")))
    }
}
