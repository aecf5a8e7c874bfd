//! What the runner's few hand-signed AWS calls (S3 state reads, Secrets Manager) share.

/// The `host` header SigV4 signs: the URL's host, with its port when it has one (an
/// endpoint of the customer's, a local test server).
pub(crate) fn host_header(url: &str) -> Option<String> {
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
