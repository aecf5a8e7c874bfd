//! One registry as the OCI distribution API sees it: authentication (Basic, or Bearer
//! tokens from the registry's realm), retries with backoff on 5xx, 429 and cut
//! connections, and the handful of endpoints a copy needs.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use reqwest::header::{HeaderMap, HeaderValue};
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use url::Url;

use crate::auth::{Challenge, parse_challenge};
use crate::error::{Side, SyncError};
use crate::reach::Reach;
use crate::reference::{Digest, is_loopback_host};

pub use crate::auth::Credential;

/// Manifests larger than this are refused (the spec recommends registries accept 4 MiB).
pub const MAX_MANIFEST_BYTES: usize = 4 << 20;

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const ACCEPT: &str = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.docker.distribution.manifest.v2+json";

/// Retry policy for requests that can be repeated.
#[derive(Debug, Clone, Copy)]
pub struct Retry {
    pub attempts: u32,
    pub first_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Retry { attempts: 6, first_backoff: Duration::from_millis(200), max_backoff: Duration::from_secs(10) }
    }
}

impl Retry {
    /// The delays between attempts (the workspace's one backoff schedule).
    pub fn backoff(&self) -> byoc_protocol::backoff::Backoff {
        byoc_protocol::backoff::Backoff::new(self.first_backoff, self.max_backoff)
    }
}

/// The HTTP client registries are reached with, and the rule for where it may connect
/// (its resolver refuses what the rule refuses; `Registry` checks every URL it fetches).
#[derive(Clone)]
pub struct Http {
    client: reqwest::Client,
    reach: Reach,
}

pub struct Registry {
    pub side: Side,
    /// `host[:port]` as references name it.
    pub name: String,
    base: Url,
    http: reqwest::Client,
    reach: Reach,
    credential: Option<Credential>,
    challenge: Mutex<Option<Challenge>>,
    tokens: Mutex<HashMap<String, String>>,
    /// Extra parameters of token requests (`digest`: the artifact a one-time grant is
    /// for, so a token service that binds grants to digests can check it).
    token_params: Vec<(String, String)>,
    pub retry: Retry,
}

/// What a request needs access to (for Bearer token scopes).
#[derive(Debug, Clone)]
pub struct Scope(pub String);

impl Scope {
    pub fn pull(repo: &str) -> Scope {
        Scope(format!("repository:{repo}:pull"))
    }
    pub fn push(repo: &str) -> Scope {
        Scope(format!("repository:{repo}:pull,push"))
    }
    pub fn mount(repo: &str, from: &str) -> Scope {
        Scope(format!("repository:{repo}:pull,push repository:{from}:pull"))
    }
}

pub struct Manifest {
    pub bytes: Bytes,
    pub media_type: String,
    pub digest: Digest,
}

impl Registry {
    /// `base_url` overrides where `name` is reached (the customer's configured endpoint:
    /// ECR's host mapped to a private endpoint, or to a local registry in tests);
    /// otherwise HTTPS (plain HTTP to loopback only for the customer's own commands,
    /// whose client is not guarded). A guarded client refuses a registry it may not
    /// reach here, before any request.
    pub fn new(
        side: Side,
        name: &str,
        base_url: Option<&str>,
        credential: Option<Credential>,
        http: Http,
    ) -> Result<Registry, SyncError> {
        let base = match base_url {
            Some(u) => u.to_string(),
            None if !http.reach.is_guarded() && is_loopback_host(name) => format!("http://{name}"),
            None => format!("https://{name}"),
        };
        let base = Url::parse(&base).map_err(|e| SyncError::Invalid {
            what: format!("{side} registry {name}"),
            reason: format!("{base:?} is not a URL: {e}"),
        })?;
        if base_url.is_none() {
            http.reach.check_url(&base).map_err(|e| SyncError::Refused {
                side,
                registry: name.to_string(),
                reason: e,
            })?;
        }
        Ok(Registry {
            side,
            name: name.to_string(),
            base,
            http: http.client,
            reach: http.reach,
            credential,
            challenge: Mutex::new(None),
            tokens: Mutex::new(HashMap::new()),
            token_params: Vec::new(),
            retry: Retry::default(),
        })
    }

    /// Send `key=value` with every token request (token services ignore what they do
    /// not know).
    pub fn with_token_param(mut self, key: &str, value: &str) -> Registry {
        self.token_params.push((key.into(), value.into()));
        self
    }

    /// The HTTP client both sides share: rustls, the system's roots, no overall timeout
    /// (blobs can be large) but a connect timeout and TCP keepalive. Unguarded: for the
    /// customer's own commands.
    pub fn http_client() -> Result<Http, SyncError> {
        Self::http_client_with_ca(None)
    }

    /// Same, trusting the extra CA roots in a PEM bundle as well (a TLS-inspecting
    /// proxy, a private registry); `HTTPS_PROXY`/`NO_PROXY` are honoured either way.
    pub fn http_client_with_ca(ca_bundle: Option<&std::path::Path>) -> Result<Http, SyncError> {
        Self::http_client_for(ca_bundle, Reach::open())
    }

    /// The client for what a job names: `reach` decides where it may connect (DNS
    /// answers, redirects and every URL a registry hands back included).
    pub fn http_client_for(ca_bundle: Option<&std::path::Path>, reach: Reach) -> Result<Http, SyncError> {
        let mut b = reqwest::Client::builder();
        if reach.is_guarded() {
            let hops = reach.clone();
            b = b
                .dns_resolver(std::sync::Arc::new(crate::reach::GuardedResolver::new(reach.clone())))
                .redirect(reqwest::redirect::Policy::custom(move |attempt| {
                    if attempt.previous().len() >= 10 {
                        attempt.error("too many redirects")
                    } else if let Err(e) = hops.check_url(attempt.url()) {
                        attempt.error(e)
                    } else {
                        attempt.follow()
                    }
                }));
        }
        if let Some(path) = ca_bundle {
            let bad =
                |reason: String| SyncError::Invalid { what: format!("CA bundle {}", path.display()), reason };
            let pem = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
            b = b.tls_certs_merge(
                reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| bad(e.to_string()))?,
            );
        }
        b.connect_timeout(Duration::from_secs(15))
            .read_timeout(Duration::from_secs(120))
            .tcp_keepalive(Duration::from_secs(30))
            .pool_max_idle_per_host(16)
            .user_agent(concat!("byoc-runner/", env!("CARGO_PKG_VERSION")))
            .build()
            .map(|client| Http { client, reach })
            .map_err(|e| SyncError::Invalid { what: "HTTP client".into(), reason: e.to_string() })
    }

    pub fn url(&self, path: &str) -> Url {
        let mut u = self.base.clone();
        u.set_path(path);
        u
    }

    /// Resolve a `Location` header (often relative) against the registry.
    pub fn location(&self, resp: &Response, what: &str) -> Result<Url, SyncError> {
        let loc = resp
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| self.err_transport(what, "the registry sent no Location header".into()))?;
        self.base.join(loc).map_err(|e| self.err_transport(what, format!("bad Location {loc:?}: {e}")))
    }

    pub fn err_transport(&self, what: &str, reason: String) -> SyncError {
        SyncError::Transport { side: self.side, registry: self.name.clone(), what: what.into(), reason }
    }

    fn auth_header(&self, scope: &Scope) -> Option<HeaderValue> {
        use base64::Engine as _;
        let token = self.tokens.lock().ok()?.get(&scope.0).cloned();
        let value = match (token, &self.credential, self.challenge.lock().ok()?.clone()) {
            (Some(t), _, _) => format!("Bearer {t}"),
            (None, Some(Credential::Bearer(t)), _) => format!("Bearer {t}"),
            (None, Some(Credential::Basic { username, secret }), Some(Challenge::Basic)) => format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{username}:{secret}"))
            ),
            _ => return None,
        };
        let mut v = HeaderValue::from_str(&value).ok()?;
        v.set_sensitive(true);
        Some(v)
    }

    /// Send a request built by `build`, authenticating on a 401 challenge and retrying
    /// 5xx, 429 and transport errors with backoff (`retry = false` for requests whose
    /// body cannot be replayed). Returns the response for any other status.
    pub async fn send(
        &self,
        what: &str,
        scope: &Scope,
        retry: bool,
        build: impl Fn(&reqwest::Client) -> RequestBuilder,
    ) -> Result<Response, SyncError> {
        let mut authenticated = false;
        let mut attempt = 0u32;
        let mut backoff = self.retry.backoff();
        loop {
            let mut req = build(&self.http);
            if let Some(h) = self.auth_header(scope) {
                req = req.header(reqwest::header::AUTHORIZATION, h);
            }
            // Every URL is checked, not only the registry's base: upload locations come
            // from the registry's answers.
            let (client, req) = req.build_split();
            let req = req.map_err(|e| self.err_transport(what, error_chain(&e)))?;
            self.reach.check_url(req.url()).map_err(|e| self.refused(e))?;
            let result = client.execute(req).await;
            let retryable_failure = match result {
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED && !authenticated => {
                    authenticated = true;
                    self.authenticate(&resp, scope, what).await?;
                    continue;
                }
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED => {
                    return Err(self.unauthorized(what));
                }
                Ok(resp)
                    if retry
                        && (resp.status().is_server_error()
                            || resp.status() == StatusCode::TOO_MANY_REQUESTS) =>
                {
                    let wait = retry_after(resp.headers());
                    let status = resp.status().as_u16();
                    let body = self.scrub(body_excerpt(resp).await);
                    (format!("HTTP {status}: {body}"), wait, Some((status, body)))
                }
                Ok(resp) => return Ok(resp),
                // The resolver refused the name's addresses: no retry changes that.
                Err(e) if refusal_in(&e).is_some() => {
                    return Err(self.refused(refusal_in(&e).cloned().unwrap_or(
                        crate::reach::Refused::Invalid { url: String::new(), why: error_chain(&e) },
                    )));
                }
                Err(e) if retry => (error_chain(&e), None, None),
                Err(e) => return Err(self.err_transport(what, error_chain(&e))),
            };
            let (reason, wait, status) = retryable_failure;
            attempt += 1;
            if attempt >= self.retry.attempts {
                return Err(match status {
                    Some((status, body)) => SyncError::Status {
                        side: self.side,
                        registry: self.name.clone(),
                        what: format!("{what} (after {attempt} attempts)"),
                        status,
                        body,
                    },
                    None => self.err_transport(what, format!("{reason} (after {attempt} attempts)")),
                });
            }
            let delay = wait.unwrap_or_else(|| backoff.next_delay()).min(self.retry.max_backoff);
            tracing::debug!(side = %self.side, registry = %self.name, what, reason, ?delay, "Retrying.");
            tokio::time::sleep(delay).await;
        }
    }

    fn refused(&self, reason: crate::reach::Refused) -> SyncError {
        SyncError::Refused { side: self.side, registry: self.name.clone(), reason }
    }

    fn unauthorized(&self, what: &str) -> SyncError {
        let hint = match (self.side, &self.credential) {
            (Side::Source, None) => "the job carries no source credential".to_string(),
            (Side::Source, Some(_)) => "the one-time token is wrong, expired or already used".to_string(),
            (Side::Destination, None) => "no destination credential".to_string(),
            (Side::Destination, Some(_)) => {
                "the destination rejected the authorization token (for ECR: GetAuthorizationToken under the job's role)"
                    .to_string()
            }
        };
        SyncError::Unauthorized { side: self.side, registry: self.name.clone(), what: what.into(), hint }
    }

    async fn authenticate(&self, resp: &Response, scope: &Scope, what: &str) -> Result<(), SyncError> {
        let header = resp
            .headers()
            .get(reqwest::header::WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let challenge = parse_challenge(&header).ok_or_else(|| self.unauthorized(what))?;
        if let Ok(mut c) = self.challenge.lock() {
            *c = Some(challenge.clone());
        }
        match (challenge, &self.credential) {
            (_, None) => Err(self.unauthorized(what)),
            (Challenge::Basic, Some(Credential::Basic { .. })) => Ok(()),
            (Challenge::Basic, Some(Credential::Bearer(_))) => Err(self.unauthorized(what)),
            // A ready bearer token that was refused: nothing to exchange it for.
            (Challenge::Bearer { .. }, Some(Credential::Bearer(_))) => Err(self.unauthorized(what)),
            (Challenge::Bearer { realm, service }, Some(Credential::Basic { username, secret })) => {
                let token =
                    self.fetch_token(&realm, service.as_deref(), scope, username, secret, what).await?;
                if let Ok(mut t) = self.tokens.lock() {
                    t.insert(scope.0.clone(), token);
                }
                Ok(())
            }
        }
    }

    async fn fetch_token(
        &self,
        realm: &str,
        service: Option<&str>,
        scope: &Scope,
        username: &str,
        secret: &str,
        what: &str,
    ) -> Result<String, SyncError> {
        let mut url = Url::parse(realm)
            .map_err(|e| self.err_transport(what, format!("token realm {realm:?} is not a URL: {e}")))?;
        // The realm comes from the registry's answer: it is held to the same rule.
        self.reach.check_url(&url).map_err(|e| self.refused(e))?;
        {
            let mut q = url.query_pairs_mut();
            if let Some(s) = service {
                q.append_pair("service", s);
            }
            for s in scope.0.split(' ') {
                q.append_pair("scope", s);
            }
            for (k, v) in &self.token_params {
                q.append_pair(k, v);
            }
        }
        let resp = self
            .http
            .get(url)
            .basic_auth(username, Some(secret))
            .send()
            .await
            .map_err(|e| self.err_transport(what, format!("token endpoint: {}", error_chain(&e))))?;
        match resp.status() {
            s if s.is_success() => {}
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                let body = self.scrub(body_excerpt(resp).await);
                return Err(match grant_refusal(&body) {
                    Some(reason) => {
                        SyncError::GrantRefused { side: self.side, registry: self.name.clone(), reason }
                    }
                    None => self.unauthorized(what),
                });
            }
            s => {
                return Err(SyncError::Status {
                    side: self.side,
                    registry: self.name.clone(),
                    what: format!("{what} (token endpoint)"),
                    status: s.as_u16(),
                    body: self.scrub(body_excerpt(resp).await),
                });
            }
        }
        #[derive(serde::Deserialize)]
        struct TokenResponse {
            token: Option<String>,
            access_token: Option<String>,
        }
        let t: TokenResponse =
            resp.json().await.map_err(|e| self.err_transport(what, format!("token endpoint answer: {e}")))?;
        t.token
            .or(t.access_token)
            .ok_or_else(|| self.err_transport(what, "token endpoint answered without a token".into()))
    }

    /// Map a non-success status to the error for `what`.
    pub async fn fail(&self, resp: Response, what: &str) -> SyncError {
        let (side, registry, what) = (self.side, self.name.clone(), what.to_string());
        match resp.status() {
            StatusCode::UNAUTHORIZED => self.unauthorized(&what),
            StatusCode::FORBIDDEN => SyncError::Forbidden { side, registry, what },
            StatusCode::NOT_FOUND => SyncError::NotFound { side, registry, what },
            s => {
                let body = self.scrub(body_excerpt(resp).await);
                SyncError::Status { side, registry, what, status: s.as_u16(), body }
            }
        }
    }

    /// `text` (a registry's answer, bound for an error) without the credential or any
    /// registry token this client holds: a registry that echoes them puts them nowhere.
    fn scrub(&self, mut text: String) -> String {
        let held: Vec<String> = self
            .credential
            .iter()
            .map(|c| c.secret().to_string())
            .chain(self.tokens.lock().map(|t| t.values().cloned().collect::<Vec<_>>()).unwrap_or_default())
            .filter(|s| s.len() >= 4)
            .collect();
        for secret in held {
            text = text.replace(&secret, "***");
        }
        text
    }

    /// GET a manifest by tag or digest; `None` if the registry does not have it. The
    /// bytes are bounded and, when fetched by digest, verified against it.
    pub async fn get_manifest(&self, repo: &str, reference: &str) -> Result<Option<Manifest>, SyncError> {
        let what = format!("manifest {repo}:{reference}");
        let url = self.url(&format!("/v2/{repo}/manifests/{reference}"));
        let resp = self
            .send(&what, &Scope::pull(repo), true, |c| c.get(url.clone()).header("Accept", ACCEPT))
            .await?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !resp.status().is_success() {
            return Err(self.fail(resp, &what).await);
        }
        let media_type = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|s| s.split(';').next().unwrap_or("").trim().to_string())
            .unwrap_or_default();
        let bytes = read_bounded(resp, MAX_MANIFEST_BYTES).await.map_err(|e| self.err_transport(&what, e))?;
        let digest = Digest::of(&bytes);
        if let Ok(expected) = Digest::parse(reference)
            && expected != digest
        {
            return Err(SyncError::DigestMismatch {
                side: self.side,
                registry: self.name.clone(),
                what,
                expected: expected.to_string(),
                actual: digest.to_string(),
            });
        }
        Ok(Some(Manifest { bytes, media_type, digest }))
    }

    /// HEAD a manifest: its digest if present.
    pub async fn head_manifest(&self, repo: &str, reference: &str) -> Result<Option<String>, SyncError> {
        let what = format!("manifest {repo}:{reference}");
        let url = self.url(&format!("/v2/{repo}/manifests/{reference}"));
        let resp = self
            .send(&what, &Scope::pull(repo), true, |c| c.head(url.clone()).header("Accept", ACCEPT))
            .await?;
        match resp.status() {
            StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => Ok(Some(
                resp.headers()
                    .get("Docker-Content-Digest")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string(),
            )),
            _ => Err(self.fail(resp, &what).await),
        }
    }

    /// PUT a manifest under a tag or its digest. Returns whether the registry said it
    /// processed the manifest's `subject` (the referrers API is supported).
    pub async fn put_manifest(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        bytes: &Bytes,
    ) -> Result<bool, SyncError> {
        let what = format!("pushing manifest {repo}:{reference}");
        let url = self.url(&format!("/v2/{repo}/manifests/{reference}"));
        let resp = self
            .send(&what, &Scope::push(repo), true, |c| {
                c.put(url.clone()).header("Content-Type", media_type).body(bytes.clone())
            })
            .await?;
        if !resp.status().is_success() {
            return Err(self.fail(resp, &what).await);
        }
        Ok(resp.headers().contains_key("OCI-Subject"))
    }

    /// The size of a blob if the repository has it.
    pub async fn blob_size(&self, repo: &str, digest: &Digest) -> Result<Option<u64>, SyncError> {
        let what = format!("blob {digest} in {repo}");
        let url = self.url(&format!("/v2/{repo}/blobs/{digest}"));
        let resp = self.send(&what, &Scope::pull(repo), true, |c| c.head(url.clone())).await?;
        match resp.status() {
            StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => Ok(Some(resp.content_length().unwrap_or(0))),
            _ => Err(self.fail(resp, &what).await),
        }
    }

    /// GET a blob from `offset` (a Range request when non-zero). The response must be
    /// 200 from 0, or 206 starting exactly at `offset`.
    pub async fn get_blob(&self, repo: &str, digest: &Digest, offset: u64) -> Result<Response, SyncError> {
        let what = format!("blob {digest} in {repo}");
        let url = self.url(&format!("/v2/{repo}/blobs/{digest}"));
        let resp = self
            .send(&what, &Scope::pull(repo), true, |c| {
                let r = c.get(url.clone());
                if offset > 0 { r.header("Range", format!("bytes={offset}-")) } else { r }
            })
            .await?;
        match resp.status() {
            StatusCode::OK if offset == 0 => Ok(resp),
            StatusCode::PARTIAL_CONTENT if offset > 0 => {
                let start = resp
                    .headers()
                    .get("Content-Range")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("bytes "))
                    .and_then(|v| v.split('-').next())
                    .and_then(|v| v.parse::<u64>().ok());
                if start == Some(offset) {
                    Ok(resp)
                } else {
                    Err(self.err_transport(
                        &what,
                        format!("resuming at byte {offset}: the range answered starts at {start:?}"),
                    ))
                }
            }
            StatusCode::OK => Err(self.err_transport(
                &what,
                format!("resuming at byte {offset}: the registry does not serve byte ranges"),
            )),
            _ => Err(self.fail(resp, &what).await),
        }
    }

    /// Ask the registry to mount a blob from another repository it holds. `true` if
    /// mounted; otherwise the registry may have opened an upload, which is cancelled.
    pub async fn mount(&self, repo: &str, digest: &Digest, from: &str) -> Result<bool, SyncError> {
        let what = format!("mounting blob {digest} from {from} into {repo}");
        let mut url = self.url(&format!("/v2/{repo}/blobs/uploads/"));
        url.query_pairs_mut().append_pair("mount", digest.as_str()).append_pair("from", from);
        let resp = self
            .send(&what, &Scope::mount(repo, from), true, |c| {
                c.post(url.clone()).header("Content-Length", "0")
            })
            .await?;
        match resp.status() {
            StatusCode::CREATED => Ok(true),
            StatusCode::ACCEPTED => {
                if let Ok(loc) = self.location(&resp, &what) {
                    self.cancel_upload(repo, &loc).await;
                }
                Ok(false)
            }
            _ => Err(self.fail(resp, &what).await),
        }
    }

    pub async fn start_upload(&self, repo: &str) -> Result<Url, SyncError> {
        let what = format!("starting a blob upload to {repo}");
        let url = self.url(&format!("/v2/{repo}/blobs/uploads/"));
        let resp = self
            .send(&what, &Scope::push(repo), true, |c| c.post(url.clone()).header("Content-Length", "0"))
            .await?;
        if resp.status() != StatusCode::ACCEPTED {
            return Err(self.fail(resp, &what).await);
        }
        self.location(&resp, &what)
    }

    /// Where an upload stands: the number of bytes the registry holds and the URL to
    /// continue at; `None` if the upload is gone (registries cancel an upload whose
    /// chunk was cut, distribution 2.8 among them).
    pub async fn upload_status(&self, repo: &str, upload: &Url) -> Result<Option<(u64, Url)>, SyncError> {
        let what = format!("upload status in {repo}");
        let resp = self.send(&what, &Scope::push(repo), true, |c| c.get(upload.clone())).await?;
        match resp.status() {
            StatusCode::NO_CONTENT => {
                let held = resp
                    .headers()
                    .get("Range")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.rsplit('-').next())
                    .and_then(|v| v.parse::<u64>().ok())
                    .map(|end| end + 1)
                    .unwrap_or(0);
                Ok(Some((held, self.location(&resp, &what)?)))
            }
            StatusCode::NOT_FOUND | StatusCode::BAD_REQUEST => Ok(None),
            _ => Err(self.fail(resp, &what).await),
        }
    }

    /// Complete an upload (with the last bytes in `body`, possibly empty).
    pub async fn finish_upload(
        &self,
        repo: &str,
        upload: &Url,
        digest: &Digest,
        body: Bytes,
    ) -> Result<(), SyncError> {
        let what = format!("completing the upload of blob {digest} to {repo}");
        let mut url = upload.clone();
        url.query_pairs_mut().append_pair("digest", digest.as_str());
        let resp = self
            .send(&what, &Scope::push(repo), true, |c| {
                c.put(url.clone())
                    .header("Content-Type", "application/octet-stream")
                    .header("Content-Length", body.len().to_string())
                    .body(body.clone())
            })
            .await?;
        if resp.status() != StatusCode::CREATED {
            return Err(self.fail(resp, &what).await);
        }
        Ok(())
    }

    /// Best effort: an abandoned upload is cleaned up by the registry eventually anyway.
    pub async fn cancel_upload(&self, repo: &str, upload: &Url) {
        let _ = self
            .send("cancelling an upload", &Scope::push(repo), false, |c| {
                c.request(Method::DELETE, upload.clone())
            })
            .await;
    }

    /// The digest's referrers via the referrers API, or `None` when the registry does
    /// not implement it (callers then use the tag schema).
    pub async fn referrers_api(&self, repo: &str, digest: &Digest) -> Result<Option<Bytes>, SyncError> {
        let what = format!("referrers of {digest} in {repo}");
        let url = self.url(&format!("/v2/{repo}/referrers/{digest}"));
        let resp = self
            .send(&what, &Scope::pull(repo), true, |c| c.get(url.clone()).header("Accept", OCI_INDEX))
            .await?;
        let is_index = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with(OCI_INDEX));
        match resp.status() {
            StatusCode::OK if is_index => Ok(Some(
                read_bounded(resp, MAX_MANIFEST_BYTES).await.map_err(|e| self.err_transport(&what, e))?,
            )),
            StatusCode::OK | StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => Ok(None),
            _ => Err(self.fail(resp, &what).await),
        }
    }

    /// Send a chunk without retry (its body is a one-shot stream): the caller checks
    /// the upload's status and resumes.
    pub async fn patch_upload(
        &self,
        repo: &str,
        upload: &Url,
        start: u64,
        len: u64,
        body: reqwest::Body,
    ) -> Result<Url, SyncError> {
        let what = format!("uploading bytes {start}..{} to {repo}", start + len);
        let body = std::sync::Mutex::new(Some(body));
        let resp = self
            .send(&what, &Scope::push(repo), false, |c| {
                let b =
                    body.lock().ok().and_then(|mut b| b.take()).unwrap_or_else(|| reqwest::Body::from(""));
                c.patch(upload.clone())
                    .header("Content-Type", "application/octet-stream")
                    .header("Content-Length", len.to_string())
                    .header("Content-Range", format!("{start}-{}", start + len - 1))
                    .body(b)
            })
            .await?;
        if resp.status() != StatusCode::ACCEPTED {
            return Err(self.fail(resp, &what).await);
        }
        self.location(&resp, &what)
    }
}

fn retry_after(h: &HeaderMap) -> Option<Duration> {
    h.get("Retry-After")?.to_str().ok()?.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// The resolver's refusal, somewhere in a request error's chain.
fn refusal_in<'e>(e: &'e (dyn std::error::Error + 'static)) -> Option<&'e crate::reach::Refused> {
    let mut cur: Option<&'e (dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<crate::reach::Refused>() {
            return Some(r);
        }
        cur = err.source();
    }
    None
}

pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let c_s = c.to_string();
        if !s.contains(&c_s) {
            s.push_str(": ");
            s.push_str(&c_s);
        }
        cur = c.source();
    }
    s
}

/// A token service's refusal of a one-time grant (`{"errors":[{"code":"GRANT_REFUSED",
/// "message":…}]}`): its message, printable characters only and bounded.
fn grant_refusal(body: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let e = v["errors"].as_array()?.iter().find(|e| e["code"] == "GRANT_REFUSED")?;
    let message: String =
        e["message"].as_str().unwrap_or("refused").chars().filter(|c| !c.is_control()).take(200).collect();
    Some(message)
}

async fn body_excerpt(resp: Response) -> String {
    let b = read_bounded(resp, 64 << 10).await.unwrap_or_default();
    let s = String::from_utf8_lossy(&b);
    let s = s.trim();
    if s.len() > 300 { format!("{}…", &s[..s.floor_char_boundary(300)]) } else { s.to_string() }
}

async fn read_bounded(mut resp: Response, max: usize) -> Result<Bytes, String> {
    let mut out = bytes::BytesMut::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| error_chain(&e))? {
        if out.len() + chunk.len() > max {
            return Err(format!("larger than {max} bytes"));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_that_echo_a_held_secret_are_scrubbed() {
        let http = Http { client: reqwest::Client::new(), reach: Reach::open() };
        let r = Registry::new(
            Side::Source,
            "127.0.0.1:5000",
            None,
            Some(Credential::Basic { username: "u".into(), secret: "grant-s3cr3t".into() }),
            http,
        )
        .unwrap();
        if let Ok(mut t) = r.tokens.lock() {
            t.insert("repository:a:pull".into(), "eyJ-registry-token".into());
        }
        let scrubbed = r.scrub("bad grant-s3cr3t and eyJ-registry-token here".into());
        assert_eq!(scrubbed, "bad *** and *** here");
    }

    #[test]
    fn a_grant_refusal_is_told_from_other_refusals() {
        let refused = r#"{"errors":[{"code":"GRANT_REFUSED","message":"grant already used\n(at 5)"}]}"#;
        assert_eq!(grant_refusal(refused).as_deref(), Some("grant already used(at 5)"));
        assert_eq!(grant_refusal(r#"{"errors":[{"code":"UNAUTHORIZED"}]}"#), None);
        assert_eq!(grant_refusal("not json"), None);
        let long = format!(r#"{{"errors":[{{"code":"GRANT_REFUSED","message":"{}"}}]}}"#, "x".repeat(500));
        assert_eq!(grant_refusal(&long).map(|m| m.len()), Some(200));
    }
}
