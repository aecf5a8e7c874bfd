//! What the runner's few hand-signed AWS calls (S3 state reads, Secrets Manager) share.

use std::time::SystemTime;

use aws_sigv4::http_request::{PayloadChecksumKind, SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4;

/// An AWS identity's keys (a role session's, the runner's own): never logged.
pub struct Identity<'a> {
    pub access_key_id: &'a str,
    pub secret_access_key: &'a str,
    pub session_token: Option<&'a str>,
}

/// One request to sign.
pub struct Request<'a> {
    pub region: &'a str,
    /// The signing name: `s3`, `logs`, `secretsmanager`.
    pub service: &'a str,
    pub method: &'a str,
    pub url: &'a str,
    /// Headers sent and signed besides `host` (content type, target).
    pub headers: &'a [(&'a str, &'a str)],
    pub body: &'a [u8],
    /// S3 wants the payload's SHA-256 in `x-amz-content-sha256`.
    pub payload_hash_header: bool,
    pub time: SystemTime,
}

/// The headers to send: `headers` and the SigV4 ones (`authorization`, `x-amz-date`,
/// `x-amz-security-token`, `x-amz-content-sha256`).
pub fn signed_headers(identity: &Identity<'_>, r: &Request<'_>) -> Result<Vec<(String, String)>, String> {
    let credentials = aws_credential_types::Credentials::new(
        identity.access_key_id,
        identity.secret_access_key,
        identity.session_token.map(str::to_string),
        None,
        "byoc-runner",
    )
    .into();
    let mut settings = SigningSettings::default();
    if r.payload_hash_header {
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    }
    let params = v4::SigningParams::builder()
        .identity(&credentials)
        .region(r.region)
        .name(r.service)
        .time(r.time)
        .settings(settings)
        .build()
        .map_err(|e| format!("signing parameters: {e}"))?
        .into();
    let host = host_header(r.url).ok_or("no host in the URL")?;
    let signed: Vec<(&str, &str)> =
        std::iter::once(("host", host.as_str())).chain(r.headers.iter().copied()).collect();
    let request = SignableRequest::new(r.method, r.url, signed.into_iter(), SignableBody::Bytes(r.body))
        .map_err(|e| format!("signing: {e}"))?;
    let (instructions, _) = sign(request, &params).map_err(|e| format!("signing: {e}"))?.into_parts();
    let (headers, _) = instructions.into_parts();
    let mut out: Vec<(String, String)> =
        r.headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    out.extend(headers.into_iter().map(|h| (h.name().to_string(), h.value().to_string())));
    Ok(out)
}

/// The `host` header SigV4 signs: the URL's host, with its port when it has one (an
/// endpoint of the customer's, a local test server).
pub fn host_header(url: &str) -> Option<String> {
    let u = url::Url::parse(url).ok()?;
    let host = u.host_str()?;
    Some(match u.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_string(),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_host_header_keeps_an_explicit_port() {
        assert_eq!(super::host_header("http://127.0.0.1:5000/").as_deref(), Some("127.0.0.1:5000"));
        assert_eq!(
            super::host_header("https://secretsmanager.us-east-1.amazonaws.com/").as_deref(),
            Some("secretsmanager.us-east-1.amazonaws.com")
        );
        assert_eq!(super::host_header("not a url"), None);
    }
}
