//! `oci.sync`: copy one artifact, named by source reference and digest, from the
//! vendor's registry into the install's own ECR repository (see `byoc-oci-sync`).
//! The source credential is the one-time token in the signed job: held in memory for
//! this sync only, masked everywhere. The destination credential comes from ECR under
//! the job's assumed role.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use byoc_oci_sync::ecr::{AwsAccess, RepositorySettings};
use byoc_oci_sync::{Copier, Credential, Digest, Options, Reference, Registry, Side, SyncError};
use serde::Deserialize;

use crate::{ExecContext, ExecFuture, ExecOutcome, Executor, JobStatus, OciSettings};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    /// `host/repository[:tag]@sha256:…`: the digest is required and pins the content.
    source: String,
    #[serde(default)]
    source_credential: Option<SourceCredential>,
    destination: Destination,
    #[serde(default)]
    repository: RepositorySettings,
    #[serde(default = "crate::default_true")]
    referrers: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceCredential {
    /// With a username the token is a password (Basic, or exchanged at the registry's
    /// token realm); without one it is a registry bearer token.
    #[serde(default)]
    username: Option<String>,
    token: String,
    /// Unix seconds; past it the sync is refused before any request.
    #[serde(default)]
    expires_at: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Destination {
    /// Repository in the install's ECR registry.
    repository: String,
    #[serde(default)]
    tags: Vec<String>,
}

pub struct OciSync {
    source: Reference,
    digest: Digest,
    credential: Option<(Credential, Option<i64>)>,
    repository: String,
    tags: Vec<String>,
    settings: RepositorySettings,
    referrers: bool,
}

impl OciSync {
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self, crate::InvalidSpec> {
        let s: Spec = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
        let source = Reference::parse(&s.source)?;
        let digest = source
            .digest
            .clone()
            .ok_or_else(|| format!("source {:?} must name the artifact's digest (…@sha256:…)", s.source))?;
        byoc_oci_sync::reference::validate_repository(&s.destination.repository)
            .map_err(|e| format!("destination: {e}"))?;
        for t in &s.destination.tags {
            byoc_oci_sync::reference::validate_tag(t).map_err(|e| format!("destination: {e}"))?;
        }
        s.repository.validate().map_err(|e| crate::InvalidSpec(e.to_string()))?;
        let credential = match s.source_credential {
            None => None,
            Some(c) => {
                if c.token.len() < crate::mask::MIN_SECRET_LEN {
                    return Err(crate::InvalidSpec::from(format!(
                        "source_credential.token: shorter than {} bytes cannot be masked reliably",
                        crate::mask::MIN_SECRET_LEN
                    )));
                }
                let cred = match c.username {
                    Some(username) => Credential::Basic { username, secret: c.token },
                    None => Credential::Bearer(c.token),
                };
                Some((cred, c.expires_at))
            }
        };
        Ok(OciSync {
            source,
            digest,
            credential,
            repository: s.destination.repository,
            tags: s.destination.tags,
            settings: s.repository,
            referrers: s.referrers,
        })
    }

    async fn sync(&self, ctx: &mut ExecContext<'_>) -> Result<serde_json::Value, SyncError> {
        if let Some((_, Some(at))) = &self.credential {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0);
            if *at <= now {
                return Err(SyncError::Expired { side: Side::Source, at: *at });
            }
        }
        let aws = aws_access(&ctx.settings).ok_or_else(|| SyncError::Invalid {
            what: "oci.sync".into(),
            reason: "the destination is written under the job's assumed role, and this job has none (set requested_role)"
                .into(),
        })?;
        let dest = byoc_oci_sync::ecr::prepare(&aws, &self.repository, &self.settings).await?;
        log(
            ctx,
            &format!(
                "[oci.sync] destination {}/{}{}\n",
                dest.registry_host,
                self.repository,
                if dest.repository_created { " (repository created)" } else { "" }
            ),
        );
        let settings: &OciSettings = &ctx.settings.oci;
        let http = settings.http()?;
        let src = Registry::new(
            Side::Source,
            &self.source.registry,
            settings.registry_endpoints.get(&self.source.registry).map(String::as_str),
            self.credential.as_ref().map(|(c, _)| c.clone()),
            http.clone(),
        )?
        // The artifact a one-time grant is for: a token service binding grants to
        // digests refuses another's.
        .with_token_param("digest", self.digest.as_str());
        let dst = Registry::new(
            Side::Destination,
            &dest.registry_host,
            settings.registry_endpoints.get(&dest.registry_host).map(String::as_str),
            Some(dest.credential),
            http,
        )?;
        let options = Options {
            parallel: settings.parallel.max(1),
            chunk_size: settings.chunk_size.max(5 << 20),
            referrers: self.referrers,
        };
        let copier = Copier::new(Arc::new(src), Arc::new(dst), options);
        let cancel = ctx.settings.cancel.clone();
        let copy = copier.copy(
            &self.source.repository,
            self.digest.as_str(),
            Some(&self.digest),
            &self.repository,
            &self.tags,
        );
        let report = tokio::select! {
            r = copy => r?,
            _ = cancel.cancelled() => return Err(SyncError::Cancelled),
        };
        let moved = copier.counters.bytes_read.load(Ordering::Relaxed);
        log(
            ctx,
            &format!(
                "[oci.sync] {} -> {}: {} blobs ({} moved, {} present, {} mounted), {} bytes moved, {} bytes skipped, {} referrers, tags {:?}\n",
                report.source,
                report.destination,
                report.blobs,
                report.blobs_moved,
                report.blobs_skipped,
                report.blobs_mounted,
                report.bytes_moved,
                report.bytes_skipped,
                report.referrers,
                report.tags,
            ),
        );
        tracing::debug!(bytes_read = moved, "Oci.sync done.");
        let mut v = serde_json::to_value(&report).unwrap_or_default();
        v["repository_created"] = dest.repository_created.into();
        Ok(v)
    }
}

fn log(ctx: &mut ExecContext<'_>, line: &str) {
    let _ = ctx.output.write(line.as_bytes());
}

/// The job's role session as of its start (an ECR token lasts 12 hours, so a sync
/// needs the session only to begin).
pub(crate) fn aws_access(settings: &crate::ExecSettings) -> Option<AwsAccess> {
    let env = &settings.credentials.as_ref()?.static_env;
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    Some(AwsAccess {
        region: get("AWS_REGION")?,
        endpoint_url: get("AWS_ENDPOINT_URL"),
        access_key_id: get("AWS_ACCESS_KEY_ID")?,
        secret_access_key: get("AWS_SECRET_ACCESS_KEY")?,
        session_token: get("AWS_SESSION_TOKEN"),
    })
}

impl Executor for OciSync {
    fn effect(&self) -> byoc_protocol::Effect {
        byoc_protocol::Effect::Copy
    }

    fn endpoints(&self) -> Vec<crate::Endpoint> {
        vec![crate::Endpoint::Registry { field: "source", name: self.source.registry.clone() }]
    }

    fn run<'a>(&'a self, mut ctx: ExecContext<'a>) -> ExecFuture<'a> {
        Box::pin(async move {
            log(&mut ctx, &format!("[oci.sync] {} -> {}\n", self.source, self.repository));
            let timeout = ctx.settings.timeout;
            let result = match tokio::time::timeout(timeout, self.sync(&mut ctx)).await {
                Ok(r) => r,
                Err(_) => {
                    let outcome = ExecOutcome {
                        status: JobStatus::TimedOut,
                        exit_code: None,
                        error: Some(format!(
                            "the sync did not finish within {timeout:?}; nothing was tagged unless all of it arrived"
                        )),
                        outputs: serde_json::json!({"reason": "timed_out", "source": self.source.to_string()}),
                    };
                    self.audit(&ctx, &outcome);
                    return outcome;
                }
            };
            let outcome = match result {
                Ok(outputs) => {
                    ExecOutcome { status: JobStatus::Succeeded, exit_code: Some(0), error: None, outputs }
                }
                Err(SyncError::Cancelled) => ExecOutcome {
                    status: JobStatus::Cancelled,
                    exit_code: None,
                    error: Some("cancelled".into()),
                    outputs: serde_json::json!({"reason": "cancelled", "source": self.source.to_string()}),
                },
                Err(e) => {
                    log(&mut ctx, &format!("[oci.sync] failed ({}): {e}\n", e.code()));
                    ExecOutcome {
                        status: JobStatus::Failed,
                        exit_code: None,
                        error: Some(format!("{} ({})", e, e.code())),
                        outputs: serde_json::json!({"reason": e.code(), "source": self.source.to_string(), "digest": self.digest.to_string()}),
                    }
                }
            };
            self.audit(&ctx, &outcome);
            outcome
        })
    }

    fn secrets(&self) -> Vec<Vec<u8>> {
        self.credential.iter().map(|(c, _)| c.secret().as_bytes().to_vec()).collect()
    }
}

impl OciSync {
    /// One audit record per artifact: references, digest, bytes moved and skipped.
    fn audit(&self, ctx: &ExecContext<'_>, outcome: &ExecOutcome) {
        let Some(audit) = &ctx.settings.audit else { return };
        let o = &outcome.outputs;
        let mut digests = std::collections::BTreeMap::new();
        digests.insert("artifact".to_string(), self.digest.to_string());
        // The one-time grant (or token) by its digest, never its value: the vendor's
        // token service can show which grant this was.
        if let Some((c, _)) = &self.credential {
            use sha2::Digest as _;
            digests.insert(
                "source_credential".to_string(),
                format!("sha256:{}", hex::encode(sha2::Sha256::digest(c.secret().as_bytes()))),
            );
        }
        let (event, detail) = if outcome.status == JobStatus::Succeeded {
            (
                "artifact_synced",
                format!(
                    "{} -> {}; {} bytes moved, {} bytes skipped, {} blobs, {} referrers",
                    o["source"].as_str().unwrap_or(""),
                    o["destination"].as_str().unwrap_or(""),
                    o["bytes_moved"],
                    o["bytes_skipped"],
                    o["blobs"],
                    o["referrers"],
                ),
            )
        } else {
            (
                "artifact_sync_failed",
                format!(
                    "{} -> {}: {}",
                    self.source,
                    self.repository,
                    o["reason"].as_str().unwrap_or("failed")
                ),
            )
        };
        // The source reference carries no credential; error texts are left out (they
        // are in the job log, masked).
        if let Err(e) = audit.record(event, detail, digests) {
            tracing::error!(error = %e, "Could not audit the artifact sync: {e}.");
        }
    }
}
