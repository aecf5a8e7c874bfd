//! The per-job credential endpoint: an HTTP server speaking the AWS container
//! credentials protocol (`AWS_CONTAINER_CREDENTIALS_FULL_URI` plus
//! `AWS_CONTAINER_AUTHORIZATION_TOKEN`), which every AWS SDK and the CLI already use.
//! It listens inside the job's own network namespace (127.0.0.1:80 there; the socket is
//! made by the sandbox and handed to the runner), so only that job can reach it, and
//! it also wants the job's random token. Behind it the runner re-assumes the job's
//! role before the session expires, so a job that outlives one session keeps working.
//! New keys enter the job's masking feed before the job sees them.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use byoc_job_executors::mask::SecretFeed;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};

use super::sts::{Assumer, Credentials, SessionParams};
use crate::clock::rfc3339;

pub const CREDENTIALS_PATH: &str = "/v1/credentials";

/// Called with each new session (its renewals), e.g. to audit them.
pub type OnAssume = Arc<dyn Fn(&SessionParams, &Credentials) + Send + Sync>;

/// One job's role session behind the endpoint.
pub struct JobSession {
    params: SessionParams,
    assumer: Arc<dyn Assumer>,
    /// The session served now, and whether it is the narrowed one.
    current: tokio::sync::Mutex<(Credentials, bool)>,
    /// Until the switch opens, sessions are assumed with these (the role's, narrowed by
    /// session policies) and `first` is one of them.
    narrowed: Option<(SessionParams, byoc_job_executors::FullSession)>,
    refresh_before: Duration,
    feed: SecretFeed,
    on_refresh: OnAssume,
    /// Unix seconds past which the session is not renewed (a local allowance's end).
    renew_until: Option<i64>,
}

impl JobSession {
    pub fn new(
        params: SessionParams,
        assumer: Arc<dyn Assumer>,
        first: Credentials,
        refresh_before: Duration,
        feed: SecretFeed,
        on_refresh: OnAssume,
    ) -> Self {
        feed_credentials(&feed, &first);
        JobSession {
            params,
            assumer,
            current: tokio::sync::Mutex::new((first, false)),
            narrowed: None,
            refresh_before,
            feed,
            on_refresh,
            renew_until: None,
        }
    }

    /// Do not renew the session past `unix_secs` (the role's local allowance ends then):
    /// the job keeps what it has until that session expires, and nothing after.
    pub fn renew_until(mut self, unix_secs: i64) -> Self {
        self.renew_until = Some(unix_secs);
        self
    }

    /// `first` was assumed with `narrowed`; so are its renewals until `full` opens, when
    /// the next request gets a session of the role's own `params`.
    pub fn narrowed_until(mut self, narrowed: SessionParams, full: byoc_job_executors::FullSession) -> Self {
        self.current.get_mut().1 = true;
        self.narrowed = Some((narrowed, full));
        self
    }

    /// The parameters of the session to serve now, and whether they are the narrowed ones.
    fn wanted(&self) -> (&SessionParams, bool) {
        match &self.narrowed {
            Some((narrowed, full)) if !full.is_open() => (narrowed, true),
            _ => (&self.params, false),
        }
    }

    /// Valid credentials: the current session, or a new one when it is about to expire
    /// (or when the job's full session has just been opened).
    async fn credentials(&self) -> Result<Credentials, String> {
        let mut guard = self.current.lock().await;
        let (current, current_narrowed) = &mut *guard;
        let now = crate::clock::unix_now();
        let (params, narrowed) = self.wanted();
        if narrowed == *current_narrowed && current.expiration - now > self.refresh_before.as_secs() as i64 {
            return Ok(current.clone());
        }
        // Widening never serves the narrowed session again (and, past a local
        // allowance's end, is refused like any renewal).
        if narrowed != *current_narrowed {
            if let Some(until) = self.renew_until.filter(|until| now >= *until) {
                return Err(format!(
                    "the role's local allowance ended at {}: its session is not renewed",
                    rfc3339(until)
                ));
            }
            let fresh = self.assumer.assume(params).await.map_err(|e| e.to_string())?;
            feed_credentials(&self.feed, &fresh);
            (self.on_refresh)(params, &fresh);
            *current = fresh.clone();
            *current_narrowed = narrowed;
            return Ok(fresh);
        }
        if let Some(until) = self.renew_until.filter(|until| now >= *until) {
            if current.expiration > now {
                return Ok(current.clone());
            }
            return Err(format!(
                "the role's local allowance ended at {}: its session is not renewed",
                rfc3339(until)
            ));
        }
        match self.assumer.assume(params).await {
            Ok(fresh) => {
                // Masked before the job can see them.
                feed_credentials(&self.feed, &fresh);
                (self.on_refresh)(params, &fresh);
                *current = fresh.clone();
                Ok(fresh)
            }
            // Still valid for a while: hand out what we have and try again next time.
            Err(e) if current.expiration > now => {
                tracing::warn!(error = %e, "Refreshing the job's role session failed; the current one is still valid: {e}.");
                Ok(current.clone())
            }
            Err(e) => Err(e.to_string()),
        }
    }
}

pub fn feed_credentials(feed: &SecretFeed, c: &Credentials) {
    feed.add(c.access_key_id.as_bytes().to_vec());
    feed.add(c.secret_access_key.as_bytes().to_vec());
    feed.add(c.session_token.as_bytes().to_vec());
}

/// One job's credential endpoint, served by the runner on connections accepted inside
/// the job's own network namespace (a listener its sandbox's init made there): no
/// other job and nothing on the host can connect to it. The random token stays as a
/// second lock; it dies with the job.
pub struct JobEndpoint {
    token: String,
    session: Arc<JobSession>,
}

impl JobEndpoint {
    pub fn new(session: JobSession) -> Arc<JobEndpoint> {
        let token = byoc_protocol::random_hex(32);
        session.feed.add(token.as_bytes().to_vec());
        Arc::new(JobEndpoint { token, session: Arc::new(session) })
    }

    /// What the job's environment says: where the endpoint is inside its namespace.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            (
                "AWS_CONTAINER_CREDENTIALS_FULL_URI".to_string(),
                format!("http://{}{CREDENTIALS_PATH}", byoc_sandbox::net::JOB_CREDENTIALS),
            ),
            ("AWS_CONTAINER_AUTHORIZATION_TOKEN".to_string(), self.token.clone()),
        ]
    }

    async fn handle(&self, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        handle(&self.token, &self.session, req).await
    }
}

impl byoc_job_executors::jobnet::CredentialEndpoint for JobEndpoint {
    fn serve(&self, stream: tokio::net::TcpStream) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
        let me = JobEndpoint { token: self.token.clone(), session: self.session.clone() };
        let me = Arc::new(me);
        Box::pin(async move {
            let service = hyper::service::service_fn(move |req| {
                let me = me.clone();
                async move { Ok::<_, std::convert::Infallible>(me.handle(req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        })
    }
}

fn reply(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    r
}

fn error_body(code: &str, message: &str) -> String {
    serde_json::json!({ "code": code, "message": message }).to_string()
}

async fn handle(
    expected: &str,
    session: &JobSession,
    req: Request<hyper::body::Incoming>,
) -> Response<Full<Bytes>> {
    if req.method() != hyper::Method::GET || req.uri().path() != CREDENTIALS_PATH {
        return reply(StatusCode::NOT_FOUND, error_body("not_found", "GET /v1/credentials only"));
    }
    let token = req.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or("");
    let token = token.strip_prefix("Bearer ").unwrap_or(token);
    if !constant_time_eq(token.as_bytes(), expected.as_bytes()) {
        return reply(StatusCode::UNAUTHORIZED, error_body("unauthorized", "wrong token"));
    }
    match session.credentials().await {
        Ok(c) => reply(
            StatusCode::OK,
            serde_json::json!({
                "AccessKeyId": c.access_key_id,
                "SecretAccessKey": c.secret_access_key,
                "Token": c.session_token,
                "Expiration": rfc3339(c.expiration),
                "RoleArn": session.params.role_arn,
            })
            .to_string(),
        ),
        Err(e) => reply(StatusCode::SERVICE_UNAVAILABLE, error_body("assume_role_failed", &e)),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Where a container finds its credentials: the per-job directory is mounted read-only
/// at `CONTAINER_CREDENTIALS_DIR`, a static busybox at `CONTAINER_BUSYBOX` (named
/// `busybox`: only under that name does it take its applet from the first argument).
pub const CONTAINER_CREDENTIALS_DIR: &str = "/byoc-aws";
pub const CONTAINER_BUSYBOX: &str = "/byoc-aws-bin/busybox";

/// A container's role session, for jobs that cannot reach the loopback endpoint: an AWS
/// config file whose `credential_process` prints a credentials file that this task
/// rewrites with a fresh session well before the current one expires. Every AWS SDK and
/// the CLI re-run `credential_process` when their credentials near expiry, so a
/// container that outlives one session keeps working. Dropping it stops the renewal
/// and deletes the directory (the keys live on a tmpfs, never in the state dir).
pub struct CredentialFile {
    pub dir: std::path::PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for CredentialFile {
    fn drop(&mut self) {
        self.task.abort();
        if let Err(e) = std::fs::remove_dir_all(&self.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(error = %e, path = %self.dir.display(), "Could not remove a job's credentials directory: {e}.");
        }
    }
}

impl CredentialFile {
    /// Write `<parent>/<job>/{config,credentials.json}` and keep the session fresh:
    /// renewed when less than half its lifetime or `refresh_before` is left, whichever
    /// comes first, so an SDK never holds keys about to expire.
    pub fn start(
        parent: &std::path::Path,
        job_id: &str,
        session: JobSession,
        region: Option<&str>,
    ) -> std::io::Result<CredentialFile> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        // The parent must be the runner's alone (the job's directory inside is readable
        // by any uid). It is checked, never chmod-ed: a misconfigured path such as /tmp
        // is refused rather than changed.
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(parent)?;
        let meta = std::fs::metadata(parent)?;
        if meta.uid() != nix::unistd::geteuid().as_raw() || meta.mode() & 0o077 != 0 {
            return Err(std::io::Error::other(format!(
                "{} must be a directory of the runner's user with mode 0700 (it is {:o}, uid {})",
                parent.display(),
                meta.mode() & 0o7777,
                meta.uid()
            )));
        }
        let dir = parent.join(job_id);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::DirBuilder::new().mode(0o755).create(&dir)?;
        // Explicitly: the service's UMask=0077 would leave it unreadable to the container.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
        let first = session.current.try_lock().map(|c| c.0.clone()).map_err(std::io::Error::other)?;
        Self::write_files(&dir, job_id, &first, region).inspect_err(|_| {
            let _ = std::fs::remove_dir_all(&dir);
        })?;
        let path = dir.join("credentials.json");
        let task = tokio::spawn(async move {
            let mut current = first;
            loop {
                let lead = session.refresh_before.as_secs().max(session.params.duration_secs as u64 / 2);
                let wait = (current.expiration - lead as i64 - crate::clock::unix_now()).max(1) as u64;
                tokio::time::sleep(Duration::from_secs(wait)).await;
                match session.assumer.assume(&session.params).await {
                    Ok(fresh) => {
                        // Masked before the container can read them.
                        feed_credentials(&session.feed, &fresh);
                        if let Err(e) = write_readable(&path, &process_output(&fresh)) {
                            tracing::error!(error = %e, "Could not write a container's renewed credentials: {e}.");
                        }
                        (session.on_refresh)(&session.params, &fresh);
                        current = fresh;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "Renewing a container's role session failed; retrying: {e}.");
                        tokio::time::sleep(Duration::from_secs(5)).await;
                    }
                }
            }
        });
        Ok(CredentialFile { dir, task })
    }

    fn write_files(
        dir: &std::path::Path,
        job_id: &str,
        first: &Credentials,
        region: Option<&str>,
    ) -> std::io::Result<()> {
        let mut config = format!(
            "# Written by byoc-runner for job {job_id}: the role session, renewed while the job runs.\n[default]\ncredential_process = {CONTAINER_BUSYBOX} cat {CONTAINER_CREDENTIALS_DIR}/credentials.json\n"
        );
        if let Some(region) = region {
            config.push_str(&format!("region = {region}\n"));
        }
        write_readable(&dir.join("config"), config.as_bytes())?;
        write_readable(&dir.join("credentials.json"), &process_output(first))
    }
}

/// Remove the job directories (those holding a `credentials.json`) that a killed
/// runner left in `parent`; nothing else there is touched.
pub fn remove_stale_credential_files(parent: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for dir in entries.flatten().map(|e| e.path()) {
        if dir.join("credentials.json").is_file()
            && let Err(e) = std::fs::remove_dir_all(&dir)
        {
            tracing::warn!(error = %e, path = %dir.display(), "Could not remove credentials of an earlier container job: {e}.");
        }
    }
}

pub use byoc_job_executors::container::is_static_elf;

/// The `credential_process` output format (Version 1).
fn process_output(c: &Credentials) -> Vec<u8> {
    serde_json::json!({
        "Version": 1,
        "AccessKeyId": c.access_key_id,
        "SecretAccessKey": c.secret_access_key,
        "SessionToken": c.session_token,
        "Expiration": rfc3339(c.expiration),
    })
    .to_string()
    .into_bytes()
}

/// Replace `path` atomically (a reader sees the old file or the new, never a torn one),
/// world-readable inside its directory: the container's user may be any uid, and only
/// the runner can traverse the parent.
fn write_readable(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    // The mode is set exactly (the service's UMask=0077 does not apply).
    crate::state_dir::write(path, bytes, 0o444)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    struct Counting {
        calls: AtomicU32,
        lifetime: i64,
    }

    impl Assumer for Counting {
        fn assume<'a>(&'a self, _p: &'a SessionParams) -> super::super::sts::AssumeFuture<'a> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
            let lifetime = self.lifetime;
            Box::pin(async move {
                Ok(Credentials {
                    access_key_id: format!("ASIAKEY{n:013}"),
                    secret_access_key: format!("secret-{n}-xxxxxxxx"),
                    session_token: format!("token-{n}-yyyyyyyy"),
                    expiration: crate::clock::unix_now() + lifetime,
                })
            })
        }
    }

    fn params() -> SessionParams {
        SessionParams {
            role_arn: "arn:aws:iam::123456789012:role/r".into(),
            session_name: "byoc-job".into(),
            external_id: None,
            source_identity: "job".into(),
            tags: vec![],
            duration_secs: 900,
            policy_arns: vec![],
            policy: None,
        }
    }

    async fn get(url: &str, token: &str) -> (u16, serde_json::Value) {
        let r = reqwest::Client::new().get(url).header("Authorization", token).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    #[test]
    fn tells_static_executables_from_dynamic_ones_and_non_elf_files() {
        // The test machines install busybox-static (scripts/setup); /bin/ls is dynamic.
        assert!(is_static_elf(std::path::Path::new("/bin/busybox")));
        assert!(!is_static_elf(std::path::Path::new("/bin/ls")));
        assert!(!is_static_elf(std::path::Path::new("/etc/hostname")));
        assert!(!is_static_elf(std::path::Path::new("/nonexistent/busybox")));
    }

    async fn session() -> JobSession {
        let assumer = Arc::new(Counting { calls: AtomicU32::new(0), lifetime: 3600 });
        let first = assumer.assume(&params()).await.unwrap();
        JobSession::new(
            params(),
            assumer,
            first,
            Duration::from_secs(300),
            SecretFeed::default(),
            Arc::new(|_, _| {}),
        )
    }

    #[tokio::test]
    async fn a_credential_file_is_readable_in_its_directory_and_gone_when_dropped() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let parent = tmp.path().join("credentials");
        let file = CredentialFile::start(&parent, "job-1", session().await, Some("eu-west-1")).unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&parent), 0o700);
        assert_eq!(mode(&file.dir), 0o755);
        let body: serde_json::Value =
            serde_json::from_slice(&std::fs::read(file.dir.join("credentials.json")).unwrap()).unwrap();
        assert_eq!(
            (body["Version"].as_i64(), body["AccessKeyId"].as_str()),
            (Some(1), Some("ASIAKEY0000000000001"))
        );
        assert_eq!(mode(&file.dir.join("credentials.json")), 0o444);
        assert!(std::fs::read_to_string(file.dir.join("config")).unwrap().contains("region = eu-west-1"));
        let dir = file.dir.clone();
        drop(file);
        assert!(!dir.exists());
    }

    #[tokio::test]
    async fn a_credentials_directory_others_can_enter_is_refused_not_changed() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let parent = tmp.path().join("shared");
        std::fs::create_dir(&parent).unwrap();
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let err = CredentialFile::start(&parent, "job-1", session().await, None).err().unwrap();
        assert!(err.to_string().contains("mode 0700 (it is 1777"), "{err}");
        assert_eq!(std::fs::metadata(&parent).unwrap().permissions().mode() & 0o7777, 0o1777);
        assert!(!parent.join("job-1").exists());
    }

    #[test]
    fn only_job_directories_are_removed_as_stale() {
        let tmp = tempfile::tempdir().unwrap();
        let stale = tmp.path().join("job-old");
        std::fs::create_dir(&stale).unwrap();
        std::fs::write(stale.join("credentials.json"), b"{}").unwrap();
        let other = tmp.path().join("not-ours");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(tmp.path().join("file"), b"x").unwrap();
        remove_stale_credential_files(tmp.path());
        assert!(!stale.exists());
        assert!(other.exists() && tmp.path().join("file").exists());
        remove_stale_credential_files(&tmp.path().join("missing"));
    }

    #[tokio::test]
    async fn a_session_is_not_renewed_past_its_local_allowance() {
        let assumer = Arc::new(Counting { calls: AtomicU32::new(0), lifetime: 30 });
        let first = assumer.assume(&params()).await.unwrap();
        let now = crate::clock::unix_now();
        let session = JobSession::new(
            params(),
            assumer.clone(),
            first,
            Duration::from_secs(10),
            SecretFeed::default(),
            Arc::new(|_, _| {}),
        )
        .renew_until(now - 1);
        // Due for renewal, but the allowance has ended: the current one, while it lasts.
        session.current.lock().await.0.expiration = now + 5;
        assert_eq!(session.credentials().await.unwrap().access_key_id, "ASIAKEY0000000000001");
        session.current.lock().await.0.expiration = now - 1;
        let err = session.credentials().await.unwrap_err();
        assert!(err.contains("local allowance ended"), "{err}");
        assert_eq!(assumer.calls.load(Ordering::SeqCst), 1, "no renewal");
    }

    #[tokio::test]
    async fn serves_and_refreshes_with_the_jobs_token_only() {
        use byoc_job_executors::jobnet::CredentialEndpoint as _;
        let assumer = Arc::new(Counting { calls: AtomicU32::new(0), lifetime: 30 });
        let first = assumer.assume(&params()).await.unwrap();
        let feed = SecretFeed::default();
        let refreshed = Arc::new(AtomicU32::new(0));
        let r2 = refreshed.clone();
        let session = JobSession::new(
            params(),
            assumer.clone(),
            first,
            Duration::from_secs(10),
            feed.clone(),
            Arc::new(move |_, _| {
                r2.fetch_add(1, Ordering::SeqCst);
            }),
        );
        let endpoint = JobEndpoint::new(session);
        let env: std::collections::HashMap<String, String> = endpoint.env().into_iter().collect();
        assert_eq!(env["AWS_CONTAINER_CREDENTIALS_FULL_URI"], "http://127.0.0.1:80/v1/credentials");
        let token = env["AWS_CONTAINER_AUTHORIZATION_TOKEN"].clone();
        assert!(feed.secrets().iter().any(|s| s == token.as_bytes()), "the token is masked");
        // In the runner the listener lives in the job's namespace; here, on loopback.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}{CREDENTIALS_PATH}", listener.local_addr().unwrap());
        let serving = endpoint.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                tokio::spawn(serving.serve(stream));
            }
        });
        let (status, body) = get(&url, &token).await;
        assert_eq!(status, 200);
        assert_eq!(body["AccessKeyId"], "ASIAKEY0000000000001");
        assert!(body["Expiration"].as_str().unwrap().ends_with('Z'));
        assert_eq!(get(&url, "nope").await.0, 401);
        assert_eq!(get(&url, "").await.0, 401);
        // Less than refresh_before left: a new session, fed to the masker first.
        endpoint.session.current.lock().await.0.expiration = crate::clock::unix_now() + 5;
        let (_, body) = get(&url, &format!("Bearer {token}")).await;
        assert_eq!(body["AccessKeyId"], "ASIAKEY0000000000002");
        assert_eq!(refreshed.load(Ordering::SeqCst), 1);
        assert!(feed.secrets().iter().any(|s| s == b"secret-2-xxxxxxxx"));
    }

    /// Records the session policies of each AssumeRole.
    struct Recording(std::sync::Mutex<Vec<Vec<String>>>);

    impl Assumer for Recording {
        fn assume<'a>(&'a self, p: &'a SessionParams) -> super::super::sts::AssumeFuture<'a> {
            let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
            seen.push(p.policy_arns.clone());
            let n = seen.len();
            Box::pin(async move {
                Ok(Credentials {
                    access_key_id: format!("ASIAKEY{n:013}"),
                    secret_access_key: format!("secret-{n}-xxxxxxxx"),
                    session_token: format!("token-{n}-yyyyyyyy"),
                    expiration: crate::clock::unix_now() + 3600,
                })
            })
        }
    }

    #[tokio::test]
    async fn a_narrowed_session_is_served_until_the_full_one_is_opened_and_never_again_after() {
        let assumer = Arc::new(Recording(Default::default()));
        let narrowed =
            SessionParams { policy_arns: vec!["arn:aws:iam::aws:policy/ReadOnlyAccess".into()], ..params() };
        let first = assumer.assume(&narrowed).await.unwrap();
        let full = byoc_job_executors::FullSession::default();
        let feed = SecretFeed::default();
        let session = JobSession::new(
            params(),
            assumer.clone(),
            first,
            Duration::from_secs(300),
            feed.clone(),
            Arc::new(|_, _| {}),
        )
        .narrowed_until(narrowed, full.clone());
        // Before the decision: the narrowed session, however often asked.
        for _ in 0..3 {
            assert_eq!(session.credentials().await.unwrap().access_key_id, "ASIAKEY0000000000001");
        }
        full.open();
        // After: a session of the role's own, assumed once, masked.
        assert_eq!(session.credentials().await.unwrap().access_key_id, "ASIAKEY0000000000002");
        assert_eq!(session.credentials().await.unwrap().access_key_id, "ASIAKEY0000000000002");
        let seen = assumer.0.lock().unwrap().clone();
        assert_eq!(seen, vec![vec!["arn:aws:iam::aws:policy/ReadOnlyAccess".to_string()], vec![]]);
        assert!(feed.secrets().iter().any(|s| s == b"secret-2-xxxxxxxx"));
    }
}
