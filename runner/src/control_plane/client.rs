//! HTTP client for the control plane: enrollment, challenge-signed access tokens (sent
//! only in the Authorization header, never in URLs), and the job endpoints.
//!
//! One TLS stack (rustls). `HTTPS_PROXY`/`NO_PROXY` are honoured through reqwest's
//! system proxy support; a custom CA bundle is added to the platform roots.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use byoc_protocol::{
    ChallengeRequest, ChallengeResponse, ClaimRequest, ClaimResponse, EnrollRequest, EnrollResponse,
    JobHeartbeatResponse, JobResult, LOG_OFFSET_HEADER, LogAppendResponse, PollRequest, PollResponse,
    RejectReason, RejectRequest, TokenRequest, TokenResponse,
};
use ed25519_dalek::SigningKey;
use reqwest::{Method, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::config::ControlPlaneConfig;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("control plane unreachable ({op}): {detail}")]
    Transport { op: &'static str, detail: String },
    #[error("control plane answered {status} to {op}: {body}")]
    Status { op: &'static str, status: u16, body: String },
    #[error("control plane refused {op}: {body}")]
    Conflict { op: &'static str, body: String },
    #[error("control plane rejected our credentials ({op}): {body}")]
    Unauthorized { op: &'static str, body: String },
    #[error("log offset mismatch: control plane has {server_offset} bytes")]
    LogOffset { server_offset: u64 },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("building the HTTP client: {0}")]
    Setup(String),
}

impl ClientError {
    /// Worth retrying with backoff (the request may succeed later).
    pub fn is_transient(&self) -> bool {
        match self {
            ClientError::Transport { .. } => true,
            ClientError::Status { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            _ => false,
        }
    }
}

/// Render a reqwest error with its causes but without the URL's query (never holds
/// secrets here, but keep error text free of anything request-specific but the path).
fn transport(op: &'static str, e: reqwest::Error) -> ClientError {
    let e = e.without_url();
    let mut detail = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        detail.push_str(": ");
        detail.push_str(&s.to_string());
        src = s.source();
    }
    ClientError::Transport { op, detail }
}

/// What a request about a job carries besides its body: log bytes at an offset, and
/// the job whose lease (fencing epoch) it is made under.
#[derive(Default, Clone, Copy)]
struct JobRequest<'a> {
    log: Option<(&'a [u8], u64)>,
    lease_of: Option<&'a str>,
}

impl<'a> JobRequest<'a> {
    fn leased(job_id: &'a str) -> Self {
        JobRequest { log: None, lease_of: Some(job_id) }
    }
}

pub struct CpClient {
    http: reqwest::Client,
    base: Url,
    request_timeout: Duration,
    identity: Option<(String, SigningKey)>,
    token: Mutex<Option<(String, Instant)>>,
    /// Each claimed job's fencing epoch, sent with its heartbeats, logs and result.
    leases: Mutex<std::collections::HashMap<String, u64>>,
}

impl CpClient {
    pub fn new(cfg: &ControlPlaneConfig) -> Result<CpClient, ClientError> {
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .user_agent(concat!("byoc-runner/", env!("CARGO_PKG_VERSION")))
            .https_only(!cfg.allow_insecure_loopback);
        if let Some(path) = &cfg.ca_bundle {
            let pem = std::fs::read(path)
                .map_err(|e| ClientError::Setup(format!("reading CA bundle {}: {e}", path.display())))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| ClientError::Setup(format!("parsing CA bundle {}: {e}", path.display())))?;
            builder = builder.tls_certs_merge(certs);
        }
        let http = builder.build().map_err(|e| ClientError::Setup(e.to_string()))?;
        Ok(CpClient {
            http,
            base: cfg.url.clone(),
            request_timeout: cfg.request_timeout,
            identity: None,
            token: Mutex::new(None),
            leases: Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// Reach the control plane without credentials (`config check`): any HTTP answer
    /// proves DNS, TCP, TLS (and the proxy) work. Returns the status and the server's
    /// `Date` header.
    pub async fn probe(&self) -> Result<(u16, Option<String>), ClientError> {
        let resp = self
            .http
            .get(self.url("/"))
            .timeout(self.request_timeout)
            .send()
            .await
            .map_err(|e| transport("probe", e))?;
        let date =
            resp.headers().get(reqwest::header::DATE).and_then(|d| d.to_str().ok()).map(str::to_string);
        Ok((resp.status().as_u16(), date))
    }

    /// Use this enrolled identity for authenticated calls.
    pub fn with_identity(mut self, runner_id: String, key: SigningKey) -> Self {
        self.identity = Some((runner_id, key));
        self
    }

    fn url(&self, path: &str) -> Url {
        let mut u = self.base.clone();
        let base_path = u.path().trim_end_matches('/').to_string();
        u.set_path(&format!("{base_path}{path}"));
        u
    }

    async fn send(
        &self,
        op: &'static str,
        req: reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<reqwest::Response, ClientError> {
        let resp = req.timeout(timeout).send().await.map_err(|e| transport(op, e))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        if status == StatusCode::RANGE_NOT_SATISFIABLE {
            let offset = resp
                .headers()
                .get(LOG_OFFSET_HEADER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| ClientError::Protocol(format!("416 without {LOG_OFFSET_HEADER}")))?;
            return Err(ClientError::LogOffset { server_offset: offset });
        }
        let body: String = resp.text().await.unwrap_or_default().chars().take(512).collect();
        Err(match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => ClientError::Unauthorized { op, body },
            StatusCode::CONFLICT => ClientError::Conflict { op, body },
            s => ClientError::Status { op, status: s.as_u16(), body },
        })
    }

    async fn json<T: DeserializeOwned>(op: &'static str, resp: reqwest::Response) -> Result<T, ClientError> {
        resp.json().await.map_err(|e| transport(op, e))
    }

    pub async fn enroll(&self, req: &EnrollRequest) -> Result<EnrollResponse, ClientError> {
        let r = self
            .send("enroll", self.http.post(self.url("/v1/enroll")).json(req), self.request_timeout)
            .await?;
        Self::json("enroll", r).await
    }

    async fn access_token(&self) -> Result<String, ClientError> {
        if let Some((t, exp)) = self.token.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
            && *exp > Instant::now()
        {
            return Ok(t.clone());
        }
        let (runner_id, key) =
            self.identity.as_ref().ok_or_else(|| ClientError::Protocol("runner is not enrolled".into()))?;
        let r = self
            .send(
                "auth challenge",
                self.http
                    .post(self.url("/v1/auth/challenge"))
                    .json(&ChallengeRequest { runner_id: runner_id.clone() }),
                self.request_timeout,
            )
            .await?;
        let ch: ChallengeResponse = Self::json("auth challenge", r).await?;
        let req = TokenRequest {
            runner_id: runner_id.clone(),
            signature: byoc_protocol::sign_challenge(key, &ch.challenge),
            challenge: ch.challenge,
        };
        let r = self
            .send("auth token", self.http.post(self.url("/v1/auth/token")).json(&req), self.request_timeout)
            .await?;
        let tok: TokenResponse = Self::json("auth token", r).await?;
        // Renew well before expiry so a long poll never starts with a dying token.
        let life = Duration::from_secs(tok.expires_in_secs.saturating_mul(3) / 4);
        *self.token.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((tok.access_token.clone(), Instant::now() + life));
        Ok(tok.access_token)
    }

    /// An authenticated call; on 401 the token is dropped and the call tried once more.
    async fn authed<B: Serialize + ?Sized>(
        &self,
        op: &'static str,
        method: Method,
        path: &str,
        body: Option<&B>,
        job: JobRequest<'_>,
        timeout: Duration,
    ) -> Result<reqwest::Response, ClientError> {
        for attempt in 0..2 {
            let token = self.access_token().await?;
            let mut req = self.http.request(method.clone(), self.url(path)).bearer_auth(&token);
            if let Some(b) = body {
                req = req.json(b);
            }
            if let Some((bytes, offset)) = job.log {
                req = req.header(LOG_OFFSET_HEADER, offset).body(bytes.to_vec());
            }
            if let Some(epoch) = job.lease_of.and_then(|id| self.lease_epoch(id)) {
                req = req.header(byoc_protocol::LEASE_EPOCH_HEADER, epoch);
            }
            match self.send(op, req, timeout).await {
                Err(ClientError::Unauthorized { .. }) if attempt == 0 => {
                    *self.token.lock().unwrap_or_else(|e| e.into_inner()) = None;
                }
                other => return other,
            }
        }
        unreachable!("the loop returns on its second attempt")
    }

    /// Long poll. `Ok(None)` when the server held the request and had nothing.
    pub async fn poll(&self, req: &PollRequest) -> Result<Option<PollResponse>, ClientError> {
        let timeout = Duration::from_secs(req.wait_secs) + self.request_timeout;
        let r = self
            .authed("poll", Method::POST, "/v1/jobs/poll", Some(req), JobRequest::default(), timeout)
            .await?;
        if r.status() == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        Self::json("poll", r).await.map(Some)
    }

    pub async fn reject(
        &self,
        delivery_id: &str,
        reason: RejectReason,
        detail: &str,
    ) -> Result<(), ClientError> {
        let body = RejectRequest { reason, detail: detail.to_string() };
        let path = format!("/v1/deliveries/{}/reject", path_segment(delivery_id));
        self.authed("reject", Method::POST, &path, Some(&body), JobRequest::default(), self.request_timeout)
            .await?;
        Ok(())
    }

    pub async fn claim(
        &self,
        job_id: &str,
        delivery_id: &str,
        lease_bound: bool,
    ) -> Result<ClaimResponse, ClientError> {
        let body = ClaimRequest { delivery_id: delivery_id.to_string(), lease_bound };
        let path = format!("/v1/jobs/{}/claim", path_segment(job_id));
        let r = self
            .authed("claim", Method::POST, &path, Some(&body), JobRequest::default(), self.request_timeout)
            .await?;
        let claimed: ClaimResponse = Self::json("claim", r).await?;
        if claimed.epoch > 0 {
            self.remember_lease(job_id, claimed.epoch);
        }
        Ok(claimed)
    }

    /// The fencing epoch to send for `job_id` (set by its claim, or from the journal
    /// after a restart).
    pub fn remember_lease(&self, job_id: &str, epoch: u64) {
        self.leases.lock().unwrap_or_else(|e| e.into_inner()).insert(job_id.to_string(), epoch);
    }

    fn lease_epoch(&self, job_id: &str) -> Option<u64> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner()).get(job_id).copied()
    }

    pub async fn heartbeat(
        &self,
        job_id: &str,
        waiting: Option<&byoc_protocol::JobWaiting>,
    ) -> Result<JobHeartbeatResponse, ClientError> {
        let path = format!("/v1/jobs/{}/heartbeat", path_segment(job_id));
        let body = byoc_protocol::JobHeartbeatRequest { waiting: waiting.cloned() };
        let r = self
            .authed(
                "heartbeat",
                Method::POST,
                &path,
                Some(&body),
                JobRequest::leased(job_id),
                self.request_timeout,
            )
            .await?;
        Self::json("heartbeat", r).await
    }

    /// Append log bytes at `offset`. Returns the server's new offset.
    pub async fn append_log(&self, job_id: &str, offset: u64, bytes: &[u8]) -> Result<u64, ClientError> {
        let path = format!("/v1/jobs/{}/log", path_segment(job_id));
        let r = self
            .authed::<()>(
                "log upload",
                Method::PUT,
                &path,
                None,
                JobRequest { log: Some((bytes, offset)), lease_of: Some(job_id) },
                self.request_timeout,
            )
            .await?;
        let resp: LogAppendResponse = Self::json("log upload", r).await?;
        Ok(resp.offset)
    }

    /// This runner leaves the install (its instance is going away, drained): the
    /// control plane refuses it from now on and gives its place to a replacement.
    pub async fn retire(&self) -> Result<(), ClientError> {
        let body = serde_json::json!({});
        self.authed(
            "retire",
            Method::POST,
            "/v1/runner/retire",
            Some(&body),
            JobRequest::default(),
            self.request_timeout,
        )
        .await?;
        Ok(())
    }

    pub async fn audit(
        &self,
        req: &byoc_protocol::AuditUploadRequest,
    ) -> Result<byoc_protocol::AuditUploadResponse, ClientError> {
        let r = self
            .authed(
                "audit upload",
                Method::POST,
                "/v1/audit",
                Some(req),
                JobRequest::default(),
                self.request_timeout,
            )
            .await?;
        Self::json("audit upload", r).await
    }

    pub async fn result(&self, job_id: &str, result: &JobResult) -> Result<(), ClientError> {
        let path = format!("/v1/jobs/{}/result", path_segment(job_id));
        self.authed(
            "result",
            Method::POST,
            &path,
            Some(result),
            JobRequest::leased(job_id),
            self.request_timeout,
        )
        .await?;
        Ok(())
    }
}

/// Job and delivery ids are validated before use, but encode anyway: an id is data,
/// never path structure.
fn path_segment(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
