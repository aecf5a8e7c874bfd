//! EKS cluster credentials from the job's role: the token `aws eks get-token` makes, a
//! presigned STS GetCallerIdentity URL bound to the cluster's name
//! (`k8s-aws-v1.` + base64url of the URL). EKS accepts it for 15 minutes.

use std::time::{Duration, SystemTime};

use aws_sigv4::http_request::{SignableBody, SignableRequest, SignatureLocation, SigningSettings, sign};
use aws_sigv4::sign::v4;

/// The session keys the token is signed with.
pub struct Keys<'a> {
    pub access_key_id: &'a str,
    pub secret_access_key: &'a str,
    pub session_token: Option<&'a str>,
}

/// Why the cluster cannot be reached with the job's credentials: what is missing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ClusterAccessError(pub String);

impl From<String> for ClusterAccessError {
    fn from(s: String) -> Self {
        ClusterAccessError(s)
    }
}

impl From<&str> for ClusterAccessError {
    fn from(s: &str) -> Self {
        ClusterAccessError(s.to_string())
    }
}

pub fn token(
    keys: &Keys<'_>,
    region: &str,
    cluster: &str,
    now: SystemTime,
) -> Result<String, ClusterAccessError> {
    use base64::Engine as _;
    let host = format!("sts.{region}.amazonaws.com");
    let url = format!("https://{host}/?Action=GetCallerIdentity&Version=2011-06-15");
    let identity = aws_credential_types::Credentials::new(
        keys.access_key_id,
        keys.secret_access_key,
        keys.session_token.map(str::to_string),
        None,
        "byoc-job-role",
    )
    .into();
    let mut settings = SigningSettings::default();
    settings.signature_location = SignatureLocation::QueryParams;
    settings.expires_in = Some(Duration::from_secs(60));
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name("sts")
        .time(now)
        .settings(settings)
        .build()
        .map_err(|e| format!("signing parameters: {e}"))?
        .into();
    let headers = [("host", host.as_str()), ("x-k8s-aws-id", cluster)];
    let request = SignableRequest::new("GET", url.as_str(), headers.into_iter(), SignableBody::Bytes(&[]))
        .map_err(|e| format!("signing GetCallerIdentity: {e}"))?;
    let (instructions, _) =
        sign(request, &params).map_err(|e| format!("signing GetCallerIdentity: {e}"))?.into_parts();
    let (_, query) = instructions.into_parts();
    let mut signed = url::Url::parse(&url).map_err(|e| e.to_string())?;
    for (k, v) in query {
        signed.query_pairs_mut().append_pair(k, &v);
    }
    Ok(format!("k8s-aws-v1.{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(signed.as_str())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_a_presigned_get_caller_identity_bound_to_the_cluster() {
        use base64::Engine as _;
        let keys = Keys {
            access_key_id: "ASIAEXAMPLE",
            secret_access_key: "secret",
            session_token: Some("session"),
        };
        let t = token(
            &keys,
            "eu-west-1",
            "acme-prod",
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
        )
        .unwrap_or_default();
        let b64 = t.strip_prefix("k8s-aws-v1.").unwrap_or_default();
        let url = String::from_utf8(
            base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(b64).unwrap_or_default(),
        )
        .unwrap_or_default();
        assert!(
            url.starts_with(
                "https://sts.eu-west-1.amazonaws.com/?Action=GetCallerIdentity&Version=2011-06-15"
            ),
            "{url}"
        );
        for part in [
            "X-Amz-Algorithm=AWS4-HMAC-SHA256",
            "X-Amz-Credential=ASIAEXAMPLE%2F20270115%2Feu-west-1%2Fsts%2Faws4_request",
            "X-Amz-Expires=60",
            "X-Amz-SignedHeaders=host%3Bx-k8s-aws-id",
            "X-Amz-Security-Token=session",
            "X-Amz-Signature=",
        ] {
            assert!(url.contains(part), "{part} missing: {url}");
        }
        // The signature depends on the cluster it is bound to.
        let other =
            token(&keys, "eu-west-1", "other", SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000))
                .unwrap_or_default();
        assert_ne!(t, other);
    }
}
