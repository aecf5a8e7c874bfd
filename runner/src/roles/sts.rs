//! Role sessions: AssumeRole per job, with ExternalId, a session name and SourceIdentity
//! carrying the job id, session tags (install, operation, job) and a duration bounded
//! by the job's timeout. The runner calls STS under its own identity (its instance
//! role); the session's credentials go only to the job's sandbox.

use std::future::Future;
use std::pin::Pin;

#[derive(Debug, Clone, PartialEq)]
pub struct SessionParams {
    pub role_arn: String,
    pub session_name: String,
    pub external_id: Option<String>,
    pub source_identity: String,
    pub tags: Vec<(String, String)>,
    pub duration_secs: i32,
    /// Session policies: the session may do only what these and the role both allow.
    pub policy_arns: Vec<String>,
    /// An inline session policy (JSON), with the same effect.
    pub policy: Option<String>,
}

/// One session's credentials. `Debug` shows the key id's first characters only.
#[derive(Clone, PartialEq)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: String,
    /// Unix seconds.
    pub expiration: i64,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &"<redacted>")
            .field("expiration", &self.expiration)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("AssumeRole {role_arn}: {message}")]
pub struct StsError {
    pub role_arn: String,
    pub message: String,
}

pub type AssumeFuture<'a> = Pin<Box<dyn Future<Output = Result<Credentials, StsError>> + Send + 'a>>;

/// STS behind a trait: tests use moto through the real client.
pub trait Assumer: Send + Sync {
    fn assume<'a>(&'a self, params: &'a SessionParams) -> AssumeFuture<'a>;
}

pub struct StsAssumer {
    pub client: aws_sdk_sts::Client,
}

impl Assumer for StsAssumer {
    fn assume<'a>(&'a self, p: &'a SessionParams) -> AssumeFuture<'a> {
        Box::pin(async move {
            let fail = |message: String| StsError { role_arn: p.role_arn.clone(), message };
            let mut req = self
                .client
                .assume_role()
                .role_arn(&p.role_arn)
                .role_session_name(&p.session_name)
                .source_identity(&p.source_identity)
                .duration_seconds(p.duration_secs);
            if let Some(id) = &p.external_id {
                req = req.external_id(id);
            }
            for arn in &p.policy_arns {
                req = req.policy_arns(aws_sdk_sts::types::PolicyDescriptorType::builder().arn(arn).build());
            }
            if let Some(policy) = &p.policy {
                req = req.policy(policy);
            }
            for (k, v) in &p.tags {
                let tag = aws_sdk_sts::types::Tag::builder()
                    .key(k)
                    .value(v)
                    .build()
                    .map_err(|e| fail(format!("session tag {k}: {e}")))?;
                req = req.tags(tag);
            }
            let out = req.send().await.map_err(|e| fail(super::aws_error_text(&e).text))?;
            let c = out.credentials().ok_or_else(|| fail("the answer carried no credentials".into()))?;
            Ok(Credentials {
                access_key_id: c.access_key_id().to_string(),
                secret_access_key: c.secret_access_key().to_string(),
                session_token: c.session_token().to_string(),
                expiration: c.expiration().secs(),
            })
        })
    }
}

/// STS allows 2-64 characters of `[\w+=,.@-]` in session names and source identities.
pub fn sts_identifier(prefix: &str, id: &str) -> String {
    let cleaned: String = format!("{prefix}{id}")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || "+=,.@-_".contains(c) { c } else { '-' })
        .take(64)
        .collect();
    if cleaned.len() < 2 { format!("{cleaned}--") } else { cleaned }
}

/// Session tag values: up to 256 characters of letters, digits, spaces and `_.:/=+-@`.
pub fn tag_value(v: &str) -> String {
    v.chars()
        .map(|c| if c.is_alphanumeric() || " _.:/=+-@".contains(c) { c } else { '_' })
        .take(256)
        .collect()
}

/// A session as long as the job may run, within the configured bounds (STS accepts
/// 900 s up to the role's maximum session duration).
pub fn session_duration(timeout_secs: u64, min: u64, max: u64) -> i32 {
    timeout_secs.clamp(min, max).min(i32::MAX as u64) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_fit_sts_rules() {
        assert_eq!(sts_identifier("byoc-", "job-1"), "byoc-job-1");
        let long = "j".repeat(128);
        assert_eq!(sts_identifier("", &long).len(), 64);
        assert_eq!(sts_identifier("", "a b/c"), "a-b-c");
        assert_eq!(sts_identifier("", "x"), "x--");
        assert_eq!(tag_value("inst-1/deploy"), "inst-1/deploy");
        assert_eq!(tag_value("a#b"), "a_b");
    }

    #[test]
    fn duration_is_bounded_by_the_timeout_and_the_limits() {
        assert_eq!(session_duration(60, 900, 3600), 900);
        assert_eq!(session_duration(1800, 900, 3600), 1800);
        assert_eq!(session_duration(36_000, 900, 3600), 3600);
    }

    #[test]
    fn debug_never_shows_secrets() {
        let c = Credentials {
            access_key_id: "ASIAEXAMPLEKEY123456".into(),
            secret_access_key: "secret/value+xyz".into(),
            session_token: "token-abc".into(),
            expiration: 1,
        };
        let d = format!("{c:?}");
        assert!(!d.contains("ASIA") && !d.contains("secret/value") && !d.contains("token-abc"), "{d}");
    }
}
