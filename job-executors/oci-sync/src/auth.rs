//! Registry credentials and the `WWW-Authenticate` challenges registries answer with
//! (Basic, or Bearer with a token realm), parsed without trusting their shape.

/// A registry credential. Debug never shows the secret.
#[derive(Clone)]
pub enum Credential {
    /// Username and password or token: sent as Basic auth, or to the registry's token realm.
    Basic { username: String, secret: String },
    /// A ready registry bearer token.
    Bearer(String),
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credential::Basic { username, .. } => write!(f, "Basic({username}, <secret>)"),
            Credential::Bearer(_) => f.write_str("Bearer(<secret>)"),
        }
    }
}

impl Credential {
    pub fn secret(&self) -> &str {
        match self {
            Credential::Basic { secret, .. } => secret,
            Credential::Bearer(t) => t,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) enum Challenge {
    Basic,
    Bearer { realm: String, service: Option<String> },
}

pub(crate) fn parse_challenge(h: &str) -> Option<Challenge> {
    let (scheme, params) = h.trim().split_once(' ').unwrap_or((h.trim(), ""));
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut realm = None;
    let mut service = None;
    for (k, v) in parse_params(params) {
        match k.as_str() {
            "realm" => realm = Some(v),
            "service" => service = Some(v),
            _ => {}
        }
    }
    Some(Challenge::Bearer { realm: realm?, service })
}

/// `k="v", k2="v,2"`: values may be quoted and contain commas.
fn parse_params(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let Some((k, after)) = rest.split_once('=') else { break };
        let key = k.trim().trim_start_matches(',').trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            match q.find('"') {
                Some(end) => (q[..end].to_string(), &q[end + 1..]),
                None => (q.to_string(), ""),
            }
        } else {
            match after.find(',') {
                Some(end) => (after[..end].trim().to_string(), &after[end..]),
                None => (after.trim().to_string(), ""),
            }
        };
        out.push((key, value));
        rest = next.trim_start().trim_start_matches(',').trim_start();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_parse() {
        let c = parse_challenge(
            r#"Bearer realm="https://auth.example.com/token",service="registry.example.com",scope="repository:a/b:pull,push""#,
        );
        match c {
            Some(Challenge::Bearer { realm, service }) => {
                assert_eq!(realm, "https://auth.example.com/token");
                assert_eq!(service.as_deref(), Some("registry.example.com"));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse_challenge(r#"Basic realm="Registry Realm""#), Some(Challenge::Basic)));
        assert!(parse_challenge("Negotiate").is_none());
        assert!(parse_challenge("Bearer service=x").is_none());
    }

    #[test]
    fn credentials_never_print_their_secret() {
        let c = Credential::Basic { username: "u".into(), secret: "s3cr3t-token".into() };
        assert!(!format!("{c:?}").contains("s3cr3t"));
        assert!(!format!("{:?}", Credential::Bearer("s3cr3t-token".into())).contains("s3cr3t"));
    }
}
