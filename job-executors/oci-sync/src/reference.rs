//! Image references: `host[:port]/path[:tag][@sha256:hex]`, the host always explicit.

use std::fmt;

/// A reference, digest, repository or tag that is not well formed: what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidReference(pub String);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `host` or `host:port`, as written.
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<Digest>,
}

/// A content digest. Only sha256 is accepted: it is what registries compute and what
/// the runner can verify while streaming.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    pub fn parse(s: &str) -> Result<Digest, InvalidReference> {
        let hex = s
            .strip_prefix("sha256:")
            .ok_or_else(|| InvalidReference(format!("digest {s:?} is not sha256:<64 hex>")))?;
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(InvalidReference(format!("digest {s:?} is not sha256:<64 lowercase hex>")));
        }
        Ok(Digest(s.to_string()))
    }

    pub fn of(bytes: &[u8]) -> Digest {
        use sha2::Digest as _;
        Digest(format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes))))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// The tag under which registries without the referrers API list this digest's
    /// referrers (OCI distribution spec, "referrers tag schema").
    pub fn fallback_tag(&self) -> String {
        format!("sha256-{}", self.hex())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Reference {
    pub fn parse(s: &str) -> Result<Reference, InvalidReference> {
        let bad = |why: &str| InvalidReference(format!("reference {s:?}: {why}"));
        if s.len() > 1024 {
            return Err(bad("longer than 1024 bytes"));
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (r, Some(Digest::parse(d).map_err(|e| bad(&e.0))?)),
            None => (s, None),
        };
        let (registry, path) =
            rest.split_once('/').ok_or_else(|| bad("no registry host (host/repository)"))?;
        if registry.is_empty()
            || !(registry.contains('.') || registry.contains(':') || registry == "localhost")
        {
            return Err(bad(
                "the first component must be a registry host (with a dot or a port, or localhost)",
            ));
        }
        if !registry.bytes().all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b)) {
            return Err(bad("registry host has characters a host cannot have"));
        }
        // A colon after the last slash starts the tag.
        let (repository, tag) = match path.rfind(':') {
            Some(i) if !path[i..].contains('/') => (&path[..i], Some(path[i + 1..].to_string())),
            _ => (path, None),
        };
        validate_repository(repository).map_err(|e| bad(&e.0))?;
        if let Some(t) = &tag {
            validate_tag(t).map_err(|e| bad(&e.0))?;
        }
        Ok(Reference { registry: registry.to_string(), repository: repository.to_string(), tag, digest })
    }

    /// Loopback registries speak plain HTTP (as Docker treats 127.0.0.0/8); every
    /// other registry is HTTPS.
    pub fn is_loopback(&self) -> bool {
        is_loopback_host(&self.registry)
    }
}

pub fn is_loopback_host(registry: &str) -> bool {
    let host = match registry.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => registry,
    };
    host == "localhost"
        || host == "[::1]"
        || host.parse::<std::net::Ipv4Addr>().is_ok_and(|a| a.is_loopback())
}

/// OCI distribution spec: `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(\/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*`.
pub fn validate_repository(r: &str) -> Result<(), InvalidReference> {
    if r.is_empty() || r.len() > 255 {
        return Err(InvalidReference(format!("repository {r:?} must be 1 to 255 characters")));
    }
    for part in r.split('/') {
        let ok = !part.is_empty()
            && part.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
            && part.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && part.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
        if !ok {
            return Err(InvalidReference(format!(
                "repository {r:?}: each path component is lowercase letters and digits, separated by . _ or -"
            )));
        }
    }
    Ok(())
}

/// OCI distribution spec: `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub fn validate_tag(t: &str) -> Result<(), InvalidReference> {
    let ok = !t.is_empty()
        && t.len() <= 128
        && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !t.starts_with(['.', '-']);
    if ok {
        Ok(())
    } else {
        Err(InvalidReference(format!("tag {t:?} is not a valid tag ([A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})")))
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn parses_host_port_path_tag_and_digest() {
        let r = Reference::parse(&format!("127.0.0.1:5000/app/api:1.2@{D}")).unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "app/api");
        assert_eq!(r.tag.as_deref(), Some("1.2"));
        assert_eq!(r.digest.as_ref().map(Digest::as_str), Some(D));
        assert!(r.is_loopback());
        let r = Reference::parse("123.dkr.ecr.us-east-1.amazonaws.com/a/b").unwrap();
        assert_eq!((r.is_loopback(), r.tag, r.digest), (false, None, None));
        assert_eq!(Reference::parse("localhost/x:y").unwrap().to_string(), "localhost/x:y");
    }

    #[test]
    fn refuses_what_is_not_a_reference() {
        for bad in [
            "nohost",
            "ubuntu/latest",
            "h.io/UPPER",
            "h.io/a//b",
            "h.io/a:bad tag",
            "h.io/a@sha256:xyz",
            "h.io/a@md5:0123",
            "h.io/../etc",
            "h.io/a:-x",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn fallback_tag_follows_the_spec() {
        assert_eq!(Digest::parse(D).unwrap().fallback_tag(), format!("sha256-{}", &D[7..]));
    }
}
