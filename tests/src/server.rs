//! HTTP front of the reference control plane: the runner API on one listener (which
//! the `down` fault really closes), the admin API on another.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State as AxState};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use byoc_protocol::{
    ChallengeRequest, ChallengeResponse, ClaimRequest, ClaimResponse, EnrollRequest, EnrollResponse,
    JobHeartbeatResponse, JobResult, LOG_OFFSET_HEADER, LogAppendResponse, PollRequest, PollResponse,
    RejectRequest, TokenRequest, TokenResponse,
};
use http_body_util::BodyExt as _;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::state::{CpError, EnqueueRequest, Faults, JobView, RunnerView, State};

#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    pub runner_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Longest a poll is held open.
    pub hold_max: Duration,
    pub lease_secs: u64,
    /// An offer neither claimed nor rejected within this time is offered again.
    pub offer_timeout: Duration,
    pub install_id: String,
    pub admin_token: String,
    /// Serve the runner API over TLS with this configuration (the admin API stays
    /// plain HTTP on loopback).
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl Default for ControlPlaneConfig {
    fn default() -> Self {
        ControlPlaneConfig {
            runner_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            hold_max: Duration::from_secs(30),
            lease_secs: 60,
            offer_timeout: Duration::from_secs(10),
            install_id: "inst-demo".into(),
            admin_token: byoc_protocol::random_hex(16),
            tls: None,
        }
    }
}

pub struct Shared {
    state: Mutex<State>,
    changed: watch::Sender<u64>,
    hold_max: Duration,
    admin_token: String,
    runner_addr: SocketAddr,
    runner_task: Mutex<Option<JoinHandle<()>>>,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a bug in this test server; keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Mutate state and wake every waiter (long polls, tests waiting on a job).
    fn update<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let out = f(&mut self.lock());
        self.bump();
        out
    }
}

pub struct ControlPlane {
    shared: Arc<Shared>,
    admin_addr: SocketAddr,
    admin_task: JoinHandle<()>,
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.admin_task.abort();
        if let Some(t) = self.shared.runner_task.lock().unwrap_or_else(|e| e.into_inner()).take() {
            t.abort();
        }
    }
}

impl ControlPlane {
    pub async fn start(config: ControlPlaneConfig) -> std::io::Result<ControlPlane> {
        let state = State::new(config.install_id.clone(), config.lease_secs, config.offer_timeout);
        let (changed, _) = watch::channel(0);
        let runner_listener = TcpListener::bind(config.runner_addr).await?;
        let admin_listener = TcpListener::bind(config.admin_addr).await?;
        let admin_addr = admin_listener.local_addr()?;
        // `down` closes the runner listener and opens it again on the same port: no
        // server this process starts later may be given that port meanwhile.
        crate::ports::reserve(runner_listener.local_addr()?.port());
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            changed,
            hold_max: config.hold_max,
            admin_token: config.admin_token.clone(),
            runner_addr: runner_listener.local_addr()?,
            runner_task: Mutex::new(None),
            tls: config.tls.clone().map(tokio_rustls::TlsAcceptor::from),
        });
        let runner_task =
            tokio::spawn(serve(runner_listener, runner_router(shared.clone()), shared.tls.clone()));
        *shared.runner_task.lock().unwrap_or_else(|e| e.into_inner()) = Some(runner_task);
        let admin_task = tokio::spawn(serve(admin_listener, admin_router(shared.clone()), None));
        Ok(ControlPlane { shared, admin_addr, admin_task })
    }

    pub fn runner_url(&self) -> String {
        match self.shared.tls {
            Some(_) => format!("https://localhost:{}", self.shared.runner_addr.port()),
            None => format!("http://{}", self.shared.runner_addr),
        }
    }
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin_addr)
    }
    pub fn admin_token(&self) -> &str {
        &self.shared.admin_token
    }
    pub fn install_id(&self) -> String {
        self.shared.lock().install_id.clone()
    }
    pub fn public_key_b64(&self) -> String {
        byoc_protocol::b64(self.shared.lock().signing_key.verifying_key().as_bytes())
    }
    pub fn bootstrap_token(&self) -> String {
        self.shared.update(|s| s.new_bootstrap_token())
    }
    /// A token enrolling up to `runners` serving runners, replacements included.
    pub fn install_token(&self, runners: usize) -> String {
        self.shared.update(|s| s.new_install_token(runners))
    }
    /// The vendor says the runner is gone (see `State::retire`).
    pub fn retire_runner(&self, runner_id: &str) -> Result<(), CpError> {
        self.shared.update(|s| s.retire(runner_id))
    }
    pub fn enqueue(&self, req: EnqueueRequest) -> Result<String, CpError> {
        self.shared.update(|s| s.enqueue(req))
    }
    /// Mint jobs' one-time source grants with this token service (`"source_grant"` in
    /// an `oci.sync` spec asks for one): the one the vendor's registry trusts.
    pub fn use_registry_tokens(&self, tokens: std::sync::Arc<crate::grants::RegistryTokens>) {
        self.shared.update(|s| s.registry_tokens = Some(tokens));
    }
    pub fn registry_tokens(&self) -> Option<std::sync::Arc<crate::grants::RegistryTokens>> {
        self.shared.lock().registry_tokens.clone()
    }
    pub fn redeliver(&self, job_id: &str) -> Result<(), CpError> {
        self.shared.update(|s| s.redeliver(job_id))
    }
    pub fn simulate_lost_claim_answer(&self, job_id: &str) -> Result<String, CpError> {
        self.shared.update(|s| s.simulate_lost_claim_answer(job_id))
    }
    pub fn cancel(&self, job_id: &str) -> Result<(), CpError> {
        self.shared.update(|s| s.cancel(job_id))
    }
    /// The vendor says the runner holding the job stopped (see `State::release_lease`).
    pub fn release_lease(&self, job_id: &str) -> Result<(), CpError> {
        self.shared.update(|s| s.release_lease(job_id))
    }
    pub fn job(&self, job_id: &str) -> Option<JobView> {
        self.shared.lock().view(job_id)
    }
    pub fn jobs(&self) -> Vec<JobView> {
        self.shared.lock().jobs()
    }
    pub fn log(&self, job_id: &str) -> Option<Vec<u8>> {
        self.shared.lock().log(job_id)
    }
    /// The logs of the job's earlier leases (epoch, bytes): a job leased anew starts
    /// its log again.
    pub fn earlier_logs(&self, job_id: &str) -> Vec<(u64, Vec<u8>)> {
        self.shared.lock().earlier_logs(job_id)
    }
    pub fn runners(&self) -> Vec<RunnerView> {
        self.shared.lock().runners()
    }
    pub fn publish_release(&self, release: crate::state::Release) -> Result<(), CpError> {
        self.shared.update(|s| s.publish_release(release))
    }
    /// Send a published release to a runner (`runner.update`); the job's id.
    pub fn update_runner(&self, runner_id: &str, req: crate::state::UpdateRunner) -> Result<String, CpError> {
        self.shared.update(|s| s.update_runner(runner_id, req))
    }
    /// Audit records acknowledged for a runner.
    pub fn audit_size(&self, runner_id: &str) -> u64 {
        self.shared.lock().audit_size(runner_id)
    }

    pub fn request_counts(&self) -> std::collections::BTreeMap<String, u64> {
        self.shared.lock().requests.clone()
    }

    /// Apply fault switches. `down` closes the runner listener and every open runner
    /// connection; clearing it listens again on the same port.
    pub async fn set_faults(&self, faults: Faults) -> std::io::Result<()> {
        apply_faults(&self.shared, faults).await
    }

    /// Wait until `pred` holds for the control plane, woken by state changes.
    pub async fn wait_until(&self, timeout: Duration, pred: impl Fn(&ControlPlane) -> bool) -> bool {
        let mut rx = self.shared.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if pred(self) {
                return true;
            }
            if !matches!(tokio::time::timeout_at(deadline, rx.changed()).await, Ok(Ok(()))) {
                return pred(self);
            }
        }
    }

    /// Wait until `pred` holds for the job, woken by state changes (no polling sleeps).
    pub async fn wait_for(
        &self,
        job_id: &str,
        timeout: Duration,
        pred: impl Fn(&JobView) -> bool,
    ) -> Option<JobView> {
        let mut rx = self.shared.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(v) = self.job(job_id).filter(|v| pred(v)) {
                return Some(v);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => continue,
                _ => return None,
            }
        }
    }
}

async fn apply_faults(shared: &Arc<Shared>, faults: Faults) -> std::io::Result<()> {
    let down = faults.down;
    let running = shared.runner_task.lock().unwrap_or_else(|e| e.into_inner()).is_some();
    match (down, running) {
        (true, true) => {
            let task = shared.runner_task.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(t) = task {
                t.abort();
            }
        }
        (false, false) => {
            let listener = TcpListener::bind(shared.runner_addr).await?;
            let task = tokio::spawn(serve(listener, runner_router(shared.clone()), shared.tls.clone()));
            *shared.runner_task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
        }
        _ => {}
    }
    shared.update(|s| s.faults = faults);
    Ok(())
}

/// Accept loop whose connections all die with it (aborting the task drops the JoinSet),
/// so `down` cuts long polls that are in flight, as a crashed server would.
/// Serve `router` on `listener`, over TLS when `tls` is given, until the task is aborted.
pub async fn serve(listener: TcpListener, router: Router, tls: Option<tokio_rustls::TlsAcceptor>) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let svc = hyper_util::service::TowerToHyperService::new(router.clone());
                let tls = tls.clone();
                conns.spawn(async move {
                    let http = hyper::server::conn::http1::Builder::new();
                    match tls {
                        Some(acceptor) => {
                            let Ok(stream) = acceptor.accept(stream).await else { return };
                            let _ = http.serve_connection(hyper_util::rt::TokioIo::new(stream), svc).await;
                        }
                        None => {
                            let _ = http.serve_connection(hyper_util::rt::TokioIo::new(stream), svc).await;
                        }
                    }
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

// ---- runner API ------------------------------------------------------------------

type Sh = AxState<Arc<Shared>>;

impl IntoResponse for CpError {
    fn into_response(self) -> Response {
        let status = match &self {
            CpError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            CpError::NotFound(_) => StatusCode::NOT_FOUND,
            CpError::Conflict(_) => StatusCode::CONFLICT,
            CpError::BadRequest(_) => StatusCode::BAD_REQUEST,
            CpError::Fenced(detail) => {
                return (
                    StatusCode::CONFLICT,
                    Json(serde_json::json!({"error": byoc_protocol::FENCED, "detail": detail})),
                )
                    .into_response();
            }
            CpError::LogOffset { server_offset } => {
                let mut r = (
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    Json(serde_json::json!({"error": "log offset mismatch", "offset": server_offset})),
                )
                    .into_response();
                r.headers_mut().insert(LOG_OFFSET_HEADER, HeaderValue::from(*server_offset));
                return r;
            }
        };
        (status, Json(serde_json::json!({"error": self.to_string()}))).into_response()
    }
}

fn runner_router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/enroll", post(enroll))
        .route("/v1/auth/challenge", post(challenge))
        .route("/v1/auth/token", post(token))
        .route("/v1/jobs/poll", post(poll))
        .route("/v1/deliveries/{delivery}/reject", post(reject))
        .route("/v1/jobs/{job}/claim", post(claim))
        .route("/v1/jobs/{job}/heartbeat", post(heartbeat))
        .route("/v1/jobs/{job}/log", put(append_log))
        .route("/v1/jobs/{job}/result", post(result))
        .route("/v1/audit", post(audit_upload))
        .route("/v1/runner/retire", post(retire))
        .layer(axum::middleware::from_fn_with_state(shared.clone(), faults_layer))
        .with_state(shared)
}

async fn faults_layer(AxState(sh): Sh, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let what = path.rsplit('/').next().unwrap_or("").to_string();
    let faults = {
        let mut st = sh.lock();
        st.count_request(&what);
        st.faults.clone()
    };
    if faults.slow_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.slow_ms)).await;
    }
    let roll: f64 = rand::random();
    if roll < faults.error_rate / 2.0 {
        return (StatusCode::SERVICE_UNAVAILABLE, "injected fault (before handler)").into_response();
    }
    let resp = next.run(req).await;
    if roll < faults.error_rate {
        return (StatusCode::SERVICE_UNAVAILABLE, "injected fault (after handler)").into_response();
    }
    if rand::random::<f64>() < faults.cut_rate {
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        let half = Bytes::copy_from_slice(&bytes[..bytes.len() / 2]);
        let stream = futures_util::stream::iter(vec![
            Ok(half),
            Err(std::io::Error::other("injected fault: connection cut mid-body")),
        ]);
        let mut parts = parts;
        // Announce the full length so the client knows the body was cut short.
        parts.headers.insert(axum::http::header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
        return Response::from_parts(parts, Body::from_stream(stream));
    }
    resp
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")
}

fn runner_id(sh: &Shared, headers: &HeaderMap) -> Result<String, CpError> {
    let token = bearer(headers).ok_or(CpError::Unauthorized("missing bearer token"))?;
    sh.lock().authenticate(token)
}

async fn enroll(AxState(sh): Sh, Json(req): Json<EnrollRequest>) -> Result<Json<EnrollResponse>, CpError> {
    let key =
        byoc_protocol::parse_public_key(&req.public_key).map_err(|e| CpError::BadRequest(e.to_string()))?;
    let (runner_id, install_id) = sh.update(|s| {
        s.enroll(&req.bootstrap_token, key, req.hostname.clone()).map(|id| (id, s.install_id.clone()))
    })?;
    Ok(Json(EnrollResponse { runner_id, install_id }))
}

async fn challenge(
    AxState(sh): Sh,
    Json(req): Json<ChallengeRequest>,
) -> Result<Json<ChallengeResponse>, CpError> {
    let challenge = sh.lock().challenge(&req.runner_id)?;
    Ok(Json(ChallengeResponse { challenge }))
}

async fn token(AxState(sh): Sh, Json(req): Json<TokenRequest>) -> Result<Json<TokenResponse>, CpError> {
    let mut st = sh.lock();
    let access_token = st.token(&req.runner_id, &req.challenge, &req.signature)?;
    Ok(Json(TokenResponse { access_token, expires_in_secs: st.token_ttl.as_secs() }))
}

async fn poll(
    AxState(sh): Sh,
    headers: HeaderMap,
    Json(req): Json<PollRequest>,
) -> Result<Response, CpError> {
    let runner = runner_id(&sh, &headers)?;
    let hold = Duration::from_secs(req.wait_secs).min(sh.hold_max);
    let deadline = tokio::time::Instant::now() + hold;
    let mut rx = sh.changed.subscribe();
    sh.update(|s| s.record_poll(&runner, &req));
    loop {
        let next = sh.lock().next_delivery(&runner, &req.free_groups);
        if let Some((delivery_id, envelope)) = next {
            sh.bump();
            return Ok(Json(PollResponse { delivery_id, envelope }).into_response());
        }
        // Wake on any change, and at least every second so expired offers return.
        let tick = tokio::time::Instant::now() + Duration::from_secs(1);
        let until = deadline.min(tick);
        let _ = tokio::time::timeout_at(until, rx.changed()).await;
        if tokio::time::Instant::now() >= deadline {
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
    }
}

async fn reject(
    AxState(sh): Sh,
    headers: HeaderMap,
    Path(delivery): Path<String>,
    Json(req): Json<RejectRequest>,
) -> Result<StatusCode, CpError> {
    let runner = runner_id(&sh, &headers)?;
    sh.update(|s| s.reject(&runner, &delivery, req.reason, req.detail))?;
    Ok(StatusCode::NO_CONTENT)
}

async fn claim(
    AxState(sh): Sh,
    headers: HeaderMap,
    Path(job): Path<String>,
    Json(req): Json<ClaimRequest>,
) -> Result<Response, CpError> {
    let runner = runner_id(&sh, &headers)?;
    let fail = sh.update(|s| {
        let fail = s.faults.fail_claims > 0;
        s.faults.fail_claims = s.faults.fail_claims.saturating_sub(1);
        fail
    });
    if fail {
        return Ok((StatusCode::SERVICE_UNAVAILABLE, "injected fault: claim failed").into_response());
    }
    let (lease_secs, epoch, lease_bound) =
        sh.update(|s| s.claim(&runner, &job, &req.delivery_id, req.lease_bound))?;
    Ok(Json(ClaimResponse { lease_secs, epoch, lease_bound }).into_response())
}

/// The fencing epoch a request is made under (absent from runners that predate it).
fn lease_epoch(headers: &HeaderMap) -> Result<Option<u64>, CpError> {
    headers
        .get(byoc_protocol::LEASE_EPOCH_HEADER)
        .map(|v| {
            v.to_str().ok().and_then(|v| v.parse::<u64>().ok()).ok_or_else(|| {
                CpError::BadRequest(format!("bad {} header", byoc_protocol::LEASE_EPOCH_HEADER))
            })
        })
        .transpose()
}

async fn heartbeat(
    AxState(sh): Sh,
    headers: HeaderMap,
    Path(job): Path<String>,
    body: Bytes,
) -> Result<Json<JobHeartbeatResponse>, CpError> {
    let runner = runner_id(&sh, &headers)?;
    // An empty body is a heartbeat from a runner that predates waiting reports.
    let req: byoc_protocol::JobHeartbeatRequest = if body.is_empty() {
        Default::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| CpError::BadRequest(format!("heartbeat body: {e}")))?
    };
    let epoch = lease_epoch(&headers)?;
    let (lease_secs, cancel) = sh.update(|s| s.heartbeat(&runner, &job, epoch, req.waiting))?;
    Ok(Json(JobHeartbeatResponse { lease_secs, cancel }))
}

async fn append_log(
    AxState(sh): Sh,
    headers: HeaderMap,
    Path(job): Path<String>,
    body: Bytes,
) -> Result<Response, CpError> {
    let runner = runner_id(&sh, &headers)?;
    let offset = headers
        .get(LOG_OFFSET_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| CpError::BadRequest(format!("missing or bad {LOG_OFFSET_HEADER} header")))?;
    let epoch = lease_epoch(&headers)?;
    let (offset, lose_ack) = sh.update(|s| {
        let r = s.append_log(&runner, &job, epoch, offset, &body);
        let lose = r.is_ok() && !body.is_empty() && s.faults.lose_log_acks > 0;
        if lose {
            s.faults.lose_log_acks -= 1;
        }
        r.map(|o| (o, lose))
    })?;
    if lose_ack {
        return Ok((StatusCode::SERVICE_UNAVAILABLE, "injected fault: log append stored, answer lost")
            .into_response());
    }
    Ok(Json(LogAppendResponse { offset }).into_response())
}

async fn result(
    AxState(sh): Sh,
    headers: HeaderMap,
    Path(job): Path<String>,
    Json(res): Json<JobResult>,
) -> Result<Json<serde_json::Value>, CpError> {
    let runner = runner_id(&sh, &headers)?;
    let epoch = lease_epoch(&headers)?;
    let duplicate = sh.update(|s| s.result(&runner, &job, epoch, res))?;
    Ok(Json(serde_json::json!({ "duplicate": duplicate })))
}

async fn audit_upload(
    AxState(sh): Sh,
    headers: HeaderMap,
    Json(req): Json<byoc_protocol::AuditUploadRequest>,
) -> Result<Json<byoc_protocol::AuditUploadResponse>, CpError> {
    let runner = runner_id(&sh, &headers)?;
    Ok(Json(sh.update(|s| s.audit_upload(&runner, req))?))
}

// ---- admin API -------------------------------------------------------------------

fn admin_router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/admin/info", get(admin_info))
        .route("/admin/bootstrap-tokens", post(admin_bootstrap))
        .route("/admin/jobs", post(admin_enqueue).get(admin_jobs))
        .route("/admin/jobs/{job}", get(admin_job))
        .route("/admin/jobs/{job}/log", get(admin_log))
        .route("/admin/jobs/{job}/cancel", post(admin_cancel))
        .route("/admin/jobs/{job}/redeliver", post(admin_redeliver))
        .route("/admin/jobs/{job}/release-lease", post(admin_release_lease))
        .route("/admin/runners", get(admin_runners))
        .route("/admin/runners/{runner}/retire", post(admin_retire))
        .route("/admin/install-tokens", post(admin_install_token))
        .route("/admin/runners/{runner}/update", post(admin_update_runner))
        .route("/admin/releases", post(admin_publish_release).get(admin_releases))
        .route("/admin/grants", get(admin_grants))
        .route("/admin/faults", put(admin_faults))
        .route("/admin/requests", get(admin_requests))
        .layer(axum::middleware::from_fn_with_state(shared.clone(), admin_auth))
        .with_state(shared)
}

async fn admin_auth(AxState(sh): Sh, req: Request, next: Next) -> Response {
    if bearer(req.headers()) != Some(sh.admin_token.as_str()) {
        return CpError::Unauthorized("admin token required").into_response();
    }
    next.run(req).await
}

async fn admin_info(AxState(sh): Sh) -> Json<serde_json::Value> {
    let st = sh.lock();
    Json(serde_json::json!({
        "install_id": st.install_id,
        "public_key": byoc_protocol::b64(st.signing_key.verifying_key().as_bytes()),
        "key_id": byoc_protocol::key_id(&st.signing_key.verifying_key()),
        "faults": st.faults,
    }))
}

/// The runner leaves the install (drained before its instance goes).
async fn retire(AxState(sh): Sh, headers: HeaderMap) -> Result<StatusCode, CpError> {
    let runner = runner_id(&sh, &headers)?;
    sh.update(|s| s.retire(&runner))?;
    Ok(StatusCode::NO_CONTENT)
}

/// The vendor says the runner is gone for good (an instance that died without draining).
async fn admin_retire(AxState(sh): Sh, Path(runner): Path<String>) -> Result<StatusCode, CpError> {
    sh.update(|s| s.retire(&runner))?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(serde::Deserialize)]
struct InstallTokenRequest {
    runners: usize,
}

/// A bootstrap token for an install stack of `runners` instances (see
/// `State::new_install_token`).
async fn admin_install_token(
    AxState(sh): Sh,
    Json(req): Json<InstallTokenRequest>,
) -> Json<serde_json::Value> {
    let token = sh.update(|s| s.new_install_token(req.runners));
    Json(serde_json::json!({ "bootstrap_token": token }))
}

async fn admin_bootstrap(AxState(sh): Sh) -> Json<serde_json::Value> {
    let token = sh.update(|s| s.new_bootstrap_token());
    Json(serde_json::json!({ "bootstrap_token": token }))
}

async fn admin_enqueue(
    AxState(sh): Sh,
    Json(req): Json<EnqueueRequest>,
) -> Result<Json<serde_json::Value>, CpError> {
    let job_id = sh.update(|s| s.enqueue(req))?;
    Ok(Json(serde_json::json!({ "job_id": job_id })))
}

async fn admin_jobs(AxState(sh): Sh) -> Json<Vec<JobView>> {
    Json(sh.lock().jobs())
}

async fn admin_job(AxState(sh): Sh, Path(job): Path<String>) -> Result<Json<JobView>, CpError> {
    sh.lock().view(&job).map(Json).ok_or(CpError::NotFound(job))
}

async fn admin_log(AxState(sh): Sh, Path(job): Path<String>) -> Result<Vec<u8>, CpError> {
    sh.lock().log(&job).ok_or(CpError::NotFound(job))
}

async fn admin_cancel(AxState(sh): Sh, Path(job): Path<String>) -> Result<StatusCode, CpError> {
    sh.update(|s| s.cancel(&job))?;
    Ok(StatusCode::NO_CONTENT)
}

/// The vendor says the runner holding the job stopped: it may go to another runner.
async fn admin_release_lease(AxState(sh): Sh, Path(job): Path<String>) -> Result<StatusCode, CpError> {
    sh.update(|s| s.release_lease(&job))?;
    Ok(StatusCode::NO_CONTENT)
}

async fn admin_redeliver(AxState(sh): Sh, Path(job): Path<String>) -> Result<StatusCode, CpError> {
    sh.update(|s| s.redeliver(&job))?;
    Ok(StatusCode::NO_CONTENT)
}

async fn admin_runners(AxState(sh): Sh) -> Json<Vec<RunnerView>> {
    Json(sh.lock().runners())
}

async fn admin_publish_release(
    AxState(sh): Sh,
    Json(release): Json<crate::state::Release>,
) -> Result<StatusCode, CpError> {
    sh.update(|s| s.publish_release(release))?;
    Ok(StatusCode::NO_CONTENT)
}

/// The one-time source grants: each by digest with the job it was minted for, the
/// runner that claimed that job, and every exchange at the token service.
async fn admin_grants(AxState(sh): Sh) -> Json<serde_json::Value> {
    Json(sh.lock().grant_report())
}

async fn admin_releases(AxState(sh): Sh) -> Json<Vec<crate::state::Release>> {
    Json(sh.lock().releases())
}

async fn admin_update_runner(
    AxState(sh): Sh,
    Path(runner): Path<String>,
    Json(req): Json<crate::state::UpdateRunner>,
) -> Result<Json<serde_json::Value>, CpError> {
    let job_id = sh.update(|s| s.update_runner(&runner, req))?;
    Ok(Json(serde_json::json!({ "job_id": job_id })))
}

async fn admin_requests(AxState(sh): Sh) -> Json<std::collections::BTreeMap<String, u64>> {
    Json(sh.lock().requests.clone())
}

async fn admin_faults(AxState(sh): Sh, Json(f): Json<Faults>) -> Result<StatusCode, CpError> {
    apply_faults(&sh, f)
        .await
        .map_err(|e| CpError::BadRequest(format!("re-opening the runner listener: {e}")))?;
    Ok(StatusCode::NO_CONTENT)
}
