//! One-time, artifact-scoped source grants and the registry token service that honours
//! them: the reference control plane's end of "a one-time token created for the install
//! to pull one specific artifact".
//!
//! The control plane mints a grant with each job that fetches from the vendor's
//! registry (bound to the install, the job, one repository and the artifact's digest,
//! pull only, expiring within minutes) and puts it in the job as the source credential.
//! The runner exchanges it at the registry's token realm (the OCI distribution token
//! flow); this service answers the first exchange with a registry token the registry
//! verifies (an ES256 JWT whose certificate is the registry's `rootcertbundle`), marks
//! the grant spent, and refuses anything else — a second exchange, another repository,
//! a push scope, an expired or unknown grant — with the error code `GRANT_REFUSED`,
//! which the runner reports as `source_grant_refused`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use rcgen::SigningKey as _;
use sha2::Digest as _;

/// The code of the token endpoint's refusals (in the distribution error format).
pub const GRANT_REFUSED: &str = "GRANT_REFUSED";
/// The user name a grant is presented with (Basic auth at the token realm).
pub const GRANT_USER: &str = "byoc-grant";

#[derive(Debug, Clone, serde::Serialize)]
pub struct Grant {
    pub job_id: String,
    pub install: String,
    pub repository: String,
    pub digest: String,
    pub expires_at: i64,
    pub spent: Option<Spent>,
}

/// When and by whom a grant was exchanged.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Spent {
    pub at: i64,
    /// The client's address at the token endpoint.
    pub by: String,
}

/// One exchange attempt, for the vendor's evidence: the grant by digest, never its value.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Exchange {
    pub grant_sha256: String,
    pub job_id: Option<String>,
    pub scopes: Vec<String>,
    pub at: i64,
    pub from: String,
    /// `None`: a token was issued; else why it was refused.
    pub refused: Option<String>,
}

pub struct RegistryTokens {
    pub issuer: String,
    pub service: String,
    /// The certificate registries are configured to trust (`rootcertbundle`).
    pub cert_pem: String,
    cert_der: Vec<u8>,
    key: rcgen::KeyPair,
    grants: Mutex<HashMap<String, Grant>>,
    exchanges: Mutex<Vec<Exchange>>,
    pub addr: SocketAddr,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for RegistryTokens {
    fn drop(&mut self) {
        if let Ok(mut t) = self.task.lock()
            && let Some(t) = t.take()
        {
            t.abort();
        }
    }
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn b64url(b: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

/// An ECDSA signature as DER (`SEQUENCE { INTEGER r, INTEGER s }`) in the fixed
/// `r || s` form JWS uses (32 bytes each for P-256).
fn der_to_fixed(der: &[u8]) -> Option<Vec<u8>> {
    let mut i = 2;
    if der.first()? != &0x30 {
        return None;
    }
    if der.get(1)? & 0x80 != 0 {
        i += usize::from(der[1] & 0x7f);
    }
    let mut out = Vec::with_capacity(64);
    for _ in 0..2 {
        if der.get(i)? != &0x02 {
            return None;
        }
        let len = usize::from(*der.get(i + 1)?);
        let int = der.get(i + 2..i + 2 + len)?;
        let int = if int.len() > 32 { &int[int.len() - 32..] } else { int };
        out.extend(std::iter::repeat_n(0u8, 32 - int.len()));
        out.extend_from_slice(int);
        i += 2 + len;
    }
    Some(out)
}

impl RegistryTokens {
    /// A token service on a free 127.0.0.1 port (`GET /token`), with a fresh key and
    /// certificate.
    pub async fn start(service: &str) -> Arc<RegistryTokens> {
        let key = rcgen::KeyPair::generate().expect("token key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(rcgen::DnType::CommonName, "byoc reference control plane tokens");
        let cert = params.self_signed(&key).expect("token certificate");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("token endpoint bind");
        let addr = listener.local_addr().expect("token endpoint addr");
        let tokens = Arc::new(RegistryTokens {
            issuer: "byoc-reference-control-plane".into(),
            service: service.into(),
            cert_pem: cert.pem(),
            cert_der: cert.der().to_vec(),
            key,
            grants: Mutex::default(),
            exchanges: Mutex::default(),
            addr,
            task: Mutex::default(),
        });
        let app = axum::Router::new()
            .route("/token", axum::routing::get(token_endpoint))
            .with_state(Arc::downgrade(&tokens));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await;
        });
        if let Ok(mut t) = tokens.task.lock() {
            *t = Some(task);
        }
        tokens
    }

    pub fn realm(&self) -> String {
        format!("http://{}/token", self.addr)
    }

    /// The `auth:` section of a docker-registry configuration trusting these tokens;
    /// `cert_path` is where the caller writes [`RegistryTokens::cert_pem`].
    pub fn registry_auth_config(&self, cert_path: &std::path::Path) -> String {
        format!(
            "auth:\n  token:\n    realm: {}\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
            self.realm(),
            self.service,
            self.issuer,
            cert_path.display()
        )
    }

    /// A grant for `job_id` to pull `repository@digest` once within `ttl_secs`: its value.
    pub fn mint(&self, job_id: &str, install: &str, repository: &str, digest: &str, ttl_secs: i64) -> String {
        let raw: [u8; 32] = rand::random();
        let value = format!("byocg_{}", b64url(&raw));
        let grant = Grant {
            job_id: job_id.into(),
            install: install.into(),
            repository: repository.into(),
            digest: digest.into(),
            expires_at: now() + ttl_secs,
            spent: None,
        };
        if let Ok(mut g) = self.grants.lock() {
            g.insert(value.clone(), grant);
        }
        value
    }

    /// The value of the grant minted for `job_id` (what a captured request would hold).
    pub fn grant_of_job(&self, job_id: &str) -> Option<String> {
        self.grants.lock().ok()?.iter().find(|(_, g)| g.job_id == job_id).map(|(v, _)| v.clone())
    }

    /// The grants minted, by the digest of their value.
    pub fn grants(&self) -> Vec<(String, Grant)> {
        self.grants
            .lock()
            .map(|g| g.iter().map(|(v, g)| (sha256_hex(v), g.clone())).collect())
            .unwrap_or_default()
    }

    /// Every exchange attempt, in order.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.exchanges.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// A registry token for `repository` with `actions`, for the harness's own pushes.
    pub fn admin_token(&self, repository: &str, actions: &[&str]) -> String {
        self.jwt("byoc-test-harness", repository, actions, 600)
    }

    fn jwt(&self, subject: &str, repository: &str, actions: &[&str], ttl: i64) -> String {
        let header = serde_json::json!({
            "typ": "JWT", "alg": "ES256",
            "x5c": [base64::engine::general_purpose::STANDARD.encode(&self.cert_der)],
        });
        let jti: [u8; 16] = rand::random();
        let t = now();
        let claims = serde_json::json!({
            "iss": self.issuer, "sub": subject, "aud": self.service,
            "exp": t + ttl, "nbf": t - 5, "iat": t, "jti": hex::encode(jti),
            "access": [{"type": "repository", "name": repository, "actions": actions}],
        });
        let signing_input =
            format!("{}.{}", b64url(header.to_string().as_bytes()), b64url(claims.to_string().as_bytes()));
        let der = self.key.sign(signing_input.as_bytes()).expect("signing a token");
        let sig = der_to_fixed(&der).expect("an ECDSA signature");
        format!("{signing_input}.{}", b64url(&sig))
    }

    /// The exchange: a registry token for the grant's one repository, pull only, once.
    fn exchange(
        &self,
        grant: &str,
        service: &str,
        scopes: &[String],
        digest: Option<&str>,
        from: &str,
    ) -> Result<String, String> {
        let mut grants = self.grants.lock().map_err(|_| "grants unavailable".to_string())?;
        let Some(g) = grants.get_mut(grant) else { return Err("unknown grant".into()) };
        if let Some(s) = &g.spent {
            return Err(format!("grant already used (at unix time {} by {})", s.at, s.by));
        }
        if g.expires_at <= now() {
            return Err(format!("grant expired at unix time {}", g.expires_at));
        }
        if service != self.service {
            return Err(format!("grant is for service {}, not {service:?}", self.service));
        }
        let wanted = format!("repository:{}:pull", g.repository);
        if scopes.is_empty() {
            return Err("no scope asked".into());
        }
        if let Some(other) = scopes.iter().find(|s| **s != wanted) {
            return Err(format!("grant allows only {wanted:?}, not {other:?}"));
        }
        // The runner names the artifact it pulls; a grant opens only its own.
        match digest {
            Some(d) if d == g.digest => {}
            Some(d) => return Err(format!("grant is for digest {}, not {d}", g.digest)),
            None => return Err("the request names no digest; a grant opens one artifact".into()),
        }
        g.spent = Some(Spent { at: now(), by: from.into() });
        let subject = format!("grant:{}:{}", g.job_id, &sha256_hex(grant)[..16]);
        let repository = g.repository.clone();
        drop(grants);
        Ok(self.jwt(&subject, &repository, &["pull"], 900))
    }
}

fn sha256_hex(s: &str) -> String {
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}

async fn token_endpoint(
    axum::extract::State(tokens): axum::extract::State<std::sync::Weak<RegistryTokens>>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<SocketAddr>,
    headers: axum::http::HeaderMap,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let Some(tokens) = tokens.upgrade() else {
        return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let pairs: Vec<(String, String)> = url::form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    let service = pairs.iter().find(|(k, _)| k == "service").map(|(_, v)| v.clone()).unwrap_or_default();
    let scopes: Vec<String> = pairs
        .iter()
        .filter(|(k, _)| k == "scope")
        .flat_map(|(_, v)| v.split(' ').map(str::to_string).collect::<Vec<_>>())
        .collect();
    let grant = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|up| up.strip_prefix(&format!("{GRANT_USER}:")).map(str::to_string));
    let refuse = |status: axum::http::StatusCode, why: &str| {
        let body = serde_json::json!({"errors": [{"code": GRANT_REFUSED, "message": why}]});
        (status, [(axum::http::header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
    };
    let Some(grant) = grant else {
        return refuse(axum::http::StatusCode::UNAUTHORIZED, "a grant is required");
    };
    let job_id = tokens.grants.lock().ok().and_then(|g| g.get(&grant).map(|g| g.job_id.clone()));
    let digest = pairs.iter().find(|(k, _)| k == "digest").map(|(_, v)| v.as_str());
    let result = tokens.exchange(&grant, &service, &scopes, digest, &peer.to_string());
    if let Ok(mut e) = tokens.exchanges.lock() {
        e.push(Exchange {
            grant_sha256: sha256_hex(&grant),
            job_id,
            scopes: scopes.clone(),
            at: now(),
            from: peer.to_string(),
            refused: result.as_ref().err().cloned(),
        });
    }
    match result {
        Ok(token) => axum::Json(serde_json::json!({
            "token": token, "access_token": token, "expires_in": 900, "issued_at": now(),
        }))
        .into_response(),
        Err(why) => refuse(axum::http::StatusCode::FORBIDDEN, &why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn der_signatures_become_fixed_width() {
        // r with a leading zero byte (33 bytes), s short (31 bytes).
        let mut der = vec![0x30, 0x44, 0x02, 0x21, 0x00];
        der.extend([0xAA; 32]);
        der.extend([0x02, 0x1f]);
        der.extend([0x11; 31]);
        let fixed = der_to_fixed(&der).unwrap();
        assert_eq!(fixed.len(), 64);
        assert_eq!(&fixed[..32], &[0xAA; 32]);
        assert_eq!(fixed[32], 0);
        assert_eq!(&fixed[33..], &[0x11; 31]);
        assert!(der_to_fixed(&[0x31, 0x00]).is_none());
    }
}
