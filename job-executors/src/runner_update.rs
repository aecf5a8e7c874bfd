//! `runner.update`: a signed release of the runner itself, named by digest in the
//! install's registry (synced there like any artifact). The executor fetches and
//! unpacks it (verified against the digest); the runner's [`ReleaseStager`] verifies
//! the release's signature with the key pinned at install and stages it for the
//! updater, which is a separate unit: nothing here installs anything.

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use crate::{ExecContext, ExecFuture, ExecOutcome, Executor, JobStatus};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    /// `<install registry>/<repository>@sha256:…`: SHA256SUMS, its minisign signature
    /// and the package, as one layer.
    release: String,
    /// The package version the release carries.
    version: String,
    /// A version older than the running one: applied only if the release signs it.
    #[serde(default)]
    downgrade: bool,
    /// Accepted for compatibility and ignored: a rollback floor from the vendor could
    /// veto the customer's own rollback, which is root's alone.
    #[serde(default)]
    min_rollback_version: Option<String>,
}

/// What an update job asks for, checked against the customer's terms before the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpdateAsk {
    pub version: String,
    pub downgrade: bool,
    pub min_rollback_version: Option<String>,
}

/// The runner's side of an update: verify the fetched release and stage it.
pub trait ReleaseStager: Send + Sync {
    /// `Ok`: the job's outputs; `Err`: a reason code and what is wrong.
    fn stage(
        &self,
        job_id: &str,
        tree: &Path,
        ask: &UpdateAsk,
    ) -> Result<serde_json::Value, (String, String)>;
}

pub type Stager = Arc<dyn ReleaseStager>;

pub struct RunnerUpdate {
    release: byoc_oci_sync::Reference,
    ask: UpdateAsk,
}

/// A plausible package version (the runner checks it fully): what a file name and
/// dpkg can carry.
fn plausible_version(v: &str) -> bool {
    v.starts_with(|c: char| c.is_ascii_digit())
        && v.len() <= 128
        && v.bytes().all(|b| b.is_ascii_alphanumeric() || b".+~-:".contains(&b))
}

impl RunnerUpdate {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, crate::InvalidSpec> {
        let s: Spec = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
        let release = crate::artifact::parse_reference("release", &s.release)?;
        for (field, v) in
            [("version", Some(&s.version)), ("min_rollback_version", s.min_rollback_version.as_ref())]
        {
            if let Some(v) = v.filter(|v| !plausible_version(v)) {
                return Err(format!("{field} {v:?} is not a package version").into());
            }
        }
        Ok(RunnerUpdate {
            release,
            ask: UpdateAsk {
                version: s.version,
                downgrade: s.downgrade,
                min_rollback_version: s.min_rollback_version,
            },
        })
    }

    async fn stage(&self, ctx: &mut ExecContext<'_>) -> Result<serde_json::Value, (String, String)> {
        let stager = ctx.settings.update.clone().ok_or_else(|| {
            ("update_unavailable".to_string(), "this runner cannot stage updates".to_string())
        })?;
        let fetched = crate::artifact::fetch(&ctx.settings, &self.release)
            .await
            .map_err(|e| (e.code(), format!("release {}: {e}", self.release)))?;
        let _ = ctx.output.write(
            format!("[runner.update] release {} fetched and verified against its digest\n", fetched.digest)
                .as_bytes(),
        );
        stager.stage(&ctx.settings.job_id, &fetched.tree, &self.ask)
    }
}

impl Executor for RunnerUpdate {
    fn effect(&self) -> byoc_protocol::Effect {
        byoc_protocol::Effect::Update
    }

    fn runner_update(&self) -> Option<&UpdateAsk> {
        Some(&self.ask)
    }

    fn run<'a>(&'a self, mut ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move {
            let _ = ctx
                .output
                .write(format!("[runner.update] {} from {}\n", self.ask.version, self.release).as_bytes());
            match self.stage(&mut ctx).await {
                Ok(outputs) => {
                    let _ = ctx.output.write(
                        format!(
                            "[runner.update] {} staged: the updater installs it and checks its health\n",
                            self.ask.version
                        )
                        .as_bytes(),
                    );
                    ExecOutcome { status: JobStatus::Succeeded, exit_code: Some(0), error: None, outputs }
                }
                Err((code, why)) => {
                    let _ = ctx.output.write(format!("[runner.update] refused ({code}): {why}\n").as_bytes());
                    crate::tool::failed(
                        &code,
                        why,
                        serde_json::json!({"release": self.release.to_string(), "version": self.ask.version}),
                    )
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_names_a_release_by_digest_and_a_version() {
        let digest = format!("sha256:{}", "a".repeat(64));
        let ok = serde_json::json!({"release": format!("reg.example/runner@{digest}"), "version": "0.2.0"});
        let u = RunnerUpdate::from_spec(&ok).unwrap();
        assert_eq!(u.ask.version, "0.2.0");
        assert_eq!(u.effect(), byoc_protocol::Effect::Update);
        for bad in [
            serde_json::json!({"release": "reg.example/runner:latest", "version": "0.2.0"}),
            serde_json::json!({"release": format!("reg.example/runner@{digest}"), "version": "../0.2"}),
            serde_json::json!({"release": format!("reg.example/runner@{digest}"), "version": "0.2", "extra": 1}),
            serde_json::json!({"release": format!("reg.example/runner@{digest}"), "version": "0.2", "min_rollback_version": "x"}),
        ] {
            assert!(RunnerUpdate::from_spec(&bad).is_err(), "{bad}");
        }
    }
}
