//! Local OCI registries for the artifact-sync suites: Debian's `docker-registry`
//! (distribution 2.8) on a free loopback port with its own storage, optionally behind
//! htpasswd basic auth; artifact builders that push with plain HTTP calls (independent
//! of the runner's client); and a TCP relay that cuts one connection mid-transfer.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use sha2::Digest as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

use crate::ports::{free_port, start_child};

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";
pub const HELM_CONFIG: &str = "application/vnd.cncf.helm.config.v1+json";
pub const HELM_CHART: &str = "application/vnd.cncf.helm.chart.content.v1.tar+gzip";
pub const TF_MODULE_CONFIG: &str = "application/vnd.opentofu.modulepkg";
pub const TF_MODULE_LAYER: &str = "archive/zip";
pub const COSIGN_SIG: &str = "application/vnd.dev.cosign.artifact.sig.v1+json";
pub const SBOM: &str = "application/spdx+json";

pub fn digest_of(b: &[u8]) -> String {
    format!("sha256:{}", hex_encode(&sha2::Sha256::digest(b)))
}

fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `docker-registry` from Debian (`scripts/setup` installs it).
pub fn registry_binary() -> PathBuf {
    std::env::var_os("BYOC_DOCKER_REGISTRY")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/usr/bin/docker-registry".into())
}

pub struct LocalRegistry {
    pub port: u16,
    pub dir: tempfile::TempDir,
    pub auth: Option<(String, String)>,
    /// Token mode: the registry trusts these tokens; the harness pushes with its own.
    tokens: Option<Arc<crate::grants::RegistryTokens>>,
    child: Child,
    http: reqwest::Client,
    scheme: &'static str,
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Clone)]
pub struct Pushed {
    pub digest: String,
    pub media_type: String,
    pub bytes: Vec<u8>,
    pub size: u64,
}

impl Pushed {
    pub fn descriptor(&self) -> serde_json::Value {
        serde_json::json!({"mediaType": self.media_type, "digest": self.digest, "size": self.size})
    }
}

impl LocalRegistry {
    /// Start and wait until `/v2/` answers. `auth`: htpasswd basic auth with this user.
    pub async fn start(auth: Option<(&str, &str)>) -> LocalRegistry {
        Self::start_with(auth, None).await
    }

    /// Serving HTTPS with this certificate and key (PEM) instead of plain HTTP.
    pub async fn start_tls(cert_pem: &str, key_pem: &str) -> LocalRegistry {
        Self::start_with(None, Some((cert_pem, key_pem))).await
    }

    async fn start_with(auth: Option<(&str, &str)>, tls: Option<(&str, &str)>) -> LocalRegistry {
        Self::start_on(auth, tls, None, free_port).await
    }

    /// In token mode: it accepts only registry tokens `tokens` signed (the OCI
    /// distribution token flow, its realm the control plane's token endpoint).
    pub async fn start_token(tokens: &Arc<crate::grants::RegistryTokens>) -> LocalRegistry {
        Self::start_on(None, None, Some(tokens.clone()), free_port).await
    }

    async fn start_on(
        auth: Option<(&str, &str)>,
        tls: Option<(&str, &str)>,
        tokens: Option<Arc<crate::grants::RegistryTokens>>,
        next_port: impl FnMut() -> u16,
    ) -> LocalRegistry {
        let bin = registry_binary();
        assert!(bin.exists(), "{} not found (run scripts/setup, or set BYOC_DOCKER_REGISTRY)", bin.display());
        let dir = tempfile::tempdir().expect("tempdir");
        let mut tail = String::new();
        if let Some((cert, key)) = tls {
            std::fs::write(dir.path().join("tls.crt"), cert).expect("cert");
            std::fs::write(dir.path().join("tls.key"), key).expect("key");
            tail.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                dir.path().join("tls.crt").display(),
                dir.path().join("tls.key").display()
            ));
        }
        if let Some((user, pass)) = auth {
            let out = Command::new("htpasswd")
                .args(["-Bbn", user, pass])
                .output()
                .expect("htpasswd (apache2-utils) runs");
            assert!(out.status.success(), "htpasswd: {}", String::from_utf8_lossy(&out.stderr));
            std::fs::write(dir.path().join("htpasswd"), &out.stdout).expect("htpasswd file");
            tail.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: byoc-test\n    path: {}\n",
                dir.path().join("htpasswd").display()
            ));
        }
        if let Some(t) = &tokens {
            let cert = dir.path().join("token.crt");
            std::fs::write(&cert, &t.cert_pem).expect("token certificate");
            tail.push_str(&t.registry_auth_config(&cert));
        }
        let http = match tls {
            // The harness pushes test content; the runner's side is what checks certificates.
            Some(_) => {
                reqwest::Client::builder().tls_danger_accept_invalid_certs(true).build().expect("client")
            }
            None => reqwest::Client::new(),
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let log_path = dir.path().join("registry.log");
        let spawn = |port: u16| {
            let config = format!(
                "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n  secret: byoc-test-secret\n{tail}",
                dir.path().join("data").display()
            );
            std::fs::write(dir.path().join("config.yml"), config).expect("registry config");
            let log = std::fs::File::create(&log_path).expect("registry log");
            Command::new(&bin)
                .args(["serve", &dir.path().join("config.yml").display().to_string()])
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log fd"))
                .stderr(log)
                .spawn()
                .expect("docker-registry starts")
        };
        let answers =
            async |port: u16| http.get(format!("{scheme}://127.0.0.1:{port}/v2/")).send().await.is_ok();
        let patience = Duration::from_secs(30);
        let (port, child) =
            start_child("docker-registry", &log_path, patience, next_port, spawn, answers).await;
        let auth = auth.map(|(u, p)| (u.to_string(), p.to_string()));
        LocalRegistry { port, dir, auth, tokens, child, http, scheme }
    }

    pub fn url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.port)
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Where the registry keeps a blob's bytes (to corrupt it behind its back).
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.dir.path().join(format!("data/docker/registry/v2/blobs/sha256/{}/{hex}/data", &hex[..2]))
    }

    fn req(&self, m: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let url = if path.starts_with("http") { path.to_string() } else { format!("{}{path}", self.url()) };
        let r = self.http.request(m, url.clone());
        if let Some(t) = &self.tokens {
            // /v2/<repository>/(blobs|manifests|tags|referrers)/…
            let path = url.split("/v2/").nth(1).unwrap_or("");
            let end = ["/blobs/", "/manifests/", "/tags/", "/referrers/"]
                .iter()
                .filter_map(|m| path.find(m))
                .min()
                .unwrap_or(path.len());
            return r.bearer_auth(t.admin_token(&path[..end], &["pull", "push"]));
        }
        match &self.auth {
            Some((u, p)) => r.basic_auth(u, Some(p)),
            None => r,
        }
    }

    /// Push a blob in one request (POST, then PUT with the body).
    pub async fn push_blob(&self, repo: &str, body: impl Into<reqwest::Body>, digest: &str, size: u64) {
        let r = self
            .req(reqwest::Method::POST, &format!("/v2/{repo}/blobs/uploads/"))
            .send()
            .await
            .expect("POST upload");
        assert_eq!(r.status(), 202, "starting an upload: {}", r.text().await.unwrap_or_default());
        let loc = r.headers()["location"].to_str().expect("location").to_string();
        let sep = if loc.contains('?') { '&' } else { '?' };
        let r = self
            .req(reqwest::Method::PUT, &format!("{loc}{sep}digest={digest}"))
            .header("Content-Length", size.to_string())
            .header("Content-Type", "application/octet-stream")
            .body(body)
            .send()
            .await
            .expect("PUT blob");
        assert_eq!(r.status(), 201, "pushing blob {digest}: {}", r.text().await.unwrap_or_default());
    }

    pub async fn push_bytes(&self, repo: &str, media_type: &str, bytes: Vec<u8>) -> Pushed {
        let digest = digest_of(&bytes);
        let size = bytes.len() as u64;
        self.push_blob(repo, bytes.clone(), &digest, size).await;
        Pushed { digest, media_type: media_type.into(), bytes, size }
    }

    pub async fn push_manifest(
        &self,
        repo: &str,
        reference: Option<&str>,
        media_type: &str,
        m: serde_json::Value,
    ) -> Pushed {
        let bytes = serde_json::to_vec(&m).expect("manifest json");
        let digest = digest_of(&bytes);
        let r = self
            .req(reqwest::Method::PUT, &format!("/v2/{repo}/manifests/{}", reference.unwrap_or(&digest)))
            .header("Content-Type", media_type)
            .body(bytes.clone())
            .send()
            .await
            .expect("PUT manifest");
        assert_eq!(r.status(), 201, "pushing manifest: {}", r.text().await.unwrap_or_default());
        Pushed { digest, media_type: media_type.into(), size: bytes.len() as u64, bytes }
    }

    /// An image manifest (or artifact, with `artifact_type`) over `layers`.
    pub async fn push_image(
        &self,
        repo: &str,
        tag: Option<&str>,
        config: Pushed,
        layers: &[Pushed],
        artifact_type: Option<&str>,
        subject: Option<&Pushed>,
    ) -> Pushed {
        let mut m = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": config.descriptor(),
            "layers": layers.iter().map(Pushed::descriptor).collect::<Vec<_>>(),
        });
        if let Some(t) = artifact_type {
            m["artifactType"] = t.into();
        }
        if let Some(s) = subject {
            m["subject"] = s.descriptor();
        }
        self.push_manifest(repo, tag, OCI_MANIFEST, m).await
    }

    /// A component artifact: one tar.gz layer of `files` (path → content; a path
    /// ending in `/` is a directory), as a terraform module, chart or manifests bundle
    /// is published.
    pub async fn push_tar_artifact(
        &self,
        repo: &str,
        tag: Option<&str>,
        artifact_type: &str,
        files: &[(&str, &str)],
    ) -> Pushed {
        let layer = self.push_bytes(repo, OCI_LAYER, tar_gz(files)).await;
        let config = self.push_bytes(repo, "application/vnd.oci.empty.v1+json", b"{}".to_vec()).await;
        self.push_image(repo, tag, config, &[layer], Some(artifact_type), None).await
    }

    /// [`push_tar_artifact`] of any bytes (a release's package).
    pub async fn push_tar_artifact_bytes(
        &self,
        repo: &str,
        tag: Option<&str>,
        artifact_type: &str,
        files: &[(&str, &[u8])],
    ) -> Pushed {
        let layer = self.push_bytes(repo, OCI_LAYER, tar_gz_bytes(files)).await;
        let config = self.push_bytes(repo, "application/vnd.oci.empty.v1+json", b"{}".to_vec()).await;
        self.push_image(repo, tag, config, &[layer], Some(artifact_type), None).await
    }

    /// A runnable-looking image: a config and `layers` random layers of `size` bytes.
    pub async fn push_random_image(
        &self,
        repo: &str,
        tag: Option<&str>,
        layers: usize,
        size: usize,
        seed: u64,
    ) -> Pushed {
        let mut ls = Vec::new();
        for i in 0..layers {
            ls.push(self.push_bytes(repo, OCI_LAYER, random_bytes(size, seed * 1000 + i as u64)).await);
        }
        let config = serde_json::json!({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": ls.iter().map(|l| l.digest.clone()).collect::<Vec<_>>()}, "seed": seed});
        let config = self.push_bytes(repo, OCI_CONFIG, serde_json::to_vec(&config).expect("json")).await;
        self.push_image(repo, tag, config, &ls, None, None).await
    }

    pub async fn push_index(&self, repo: &str, tag: Option<&str>, children: &[(Pushed, &str)]) -> Pushed {
        let manifests: Vec<serde_json::Value> = children
            .iter()
            .map(|(p, arch)| {
                let mut d = p.descriptor();
                d["platform"] = serde_json::json!({"architecture": arch, "os": "linux"});
                d
            })
            .collect();
        let m = serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests});
        self.push_manifest(repo, tag, OCI_INDEX, m).await
    }

    /// A referrer (signature, SBOM) of `subject`, listed under the referrers tag
    /// schema as a registry without the referrers API (distribution 2.8) needs.
    pub async fn push_referrer(
        &self,
        repo: &str,
        subject: &Pushed,
        artifact_type: &str,
        content: &[u8],
    ) -> Pushed {
        let empty = self.push_bytes(repo, "application/vnd.oci.empty.v1+json", b"{}".to_vec()).await;
        let layer = self.push_bytes(repo, artifact_type, content.to_vec()).await;
        let r = self.push_image(repo, None, empty, &[layer], Some(artifact_type), Some(subject)).await;
        let tag = format!("sha256-{}", subject.digest.trim_start_matches("sha256:"));
        let mut entries = self.index_entries(repo, &tag).await;
        let mut d = r.descriptor();
        d["artifactType"] = artifact_type.into();
        entries.push(d);
        let idx = serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries});
        self.push_manifest(repo, Some(&tag), OCI_INDEX, idx).await;
        r
    }

    /// The manifests an index under `reference` lists (empty if there is none).
    pub async fn index_entries(&self, repo: &str, reference: &str) -> Vec<serde_json::Value> {
        match self.manifest(repo, reference).await {
            Some((_, b)) => serde_json::from_slice::<serde_json::Value>(&b).expect("index json")["manifests"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
            None => vec![],
        }
    }

    /// A manifest's digest and bytes, or `None` if absent.
    pub async fn manifest(&self, repo: &str, reference: &str) -> Option<(String, Vec<u8>)> {
        let r = self
            .req(reqwest::Method::GET, &format!("/v2/{repo}/manifests/{reference}"))
            .header("Accept", format!("{OCI_MANIFEST}, {OCI_INDEX}"))
            .send()
            .await
            .expect("GET manifest");
        if r.status() == 404 {
            return None;
        }
        assert!(r.status().is_success(), "GET manifest {reference}: {}", r.status());
        let b = r.bytes().await.expect("manifest body").to_vec();
        Some((digest_of(&b), b))
    }

    pub async fn has_blob(&self, repo: &str, digest: &str) -> bool {
        let r = self
            .req(reqwest::Method::HEAD, &format!("/v2/{repo}/blobs/{digest}"))
            .send()
            .await
            .expect("HEAD blob");
        r.status().is_success()
    }

    pub async fn tags(&self, repo: &str) -> Vec<String> {
        let r = self.req(reqwest::Method::GET, &format!("/v2/{repo}/tags/list")).send().await.expect("tags");
        if r.status() == 404 {
            return vec![];
        }
        let v: serde_json::Value = r.json().await.expect("tags json");
        v["tags"]
            .as_array()
            .map(|a| a.iter().filter_map(|t| t.as_str().map(String::from)).collect())
            .unwrap_or_default()
    }
}

/// A gzip-compressed tar of `files` (path → content; a path ending in `/` is a
/// directory), with fixed times and owners so the same files give the same digest.
pub fn tar_gz(files: &[(&str, &str)]) -> Vec<u8> {
    let files: Vec<(&str, &[u8])> = files.iter().map(|(p, c)| (*p, c.as_bytes())).collect();
    tar_gz_bytes(&files)
}

/// [`tar_gz`] of any bytes.
pub fn tar_gz_bytes(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default()));
    for (path, content) in files {
        let mut h = tar::Header::new_gnu();
        if path.ends_with('/') {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o755);
            h.set_size(0);
        } else {
            // A script is a program (a provider in a mirror, say).
            h.set_mode(if content.starts_with(b"#!") { 0o755 } else { 0o644 });
            h.set_size(content.len() as u64);
        }
        h.set_mtime(1_700_000_000);
        // GNU long names for paths over 100 bytes (a provider in a mirror's layout).
        b.append_data(&mut h, path, *content).expect("tar entry");
    }
    b.into_inner().expect("tar").finish().expect("gzip")
}

/// Incompressible bytes from a seed (xorshift: fast, reproducible).
pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; n];
    fill_random(&mut out, seed);
    out
}

pub fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Which way a [`CutRelay`] cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// After this many bytes from the registry to the client (a download).
    Downstream(u64),
    /// After this many bytes from the client to the registry (an upload).
    Upstream(u64),
}

/// A TCP relay in front of a registry that cuts exactly one connection, once it has
/// carried the given number of bytes in the given direction; later connections pass.
pub struct CutRelay {
    pub addr: SocketAddr,
    pub cuts: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for CutRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl CutRelay {
    pub async fn start(target: SocketAddr, cut: Cut) -> CutRelay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("relay bind");
        let addr = listener.local_addr().expect("relay addr");
        let cuts = Arc::new(AtomicU64::new(0));
        let fired = Arc::new(AtomicBool::new(false));
        let counter = cuts.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        let (fired, counter) = (fired.clone(), counter.clone());
                        conns.spawn(async move {
                            if let Ok(server) = TcpStream::connect(target).await {
                                relay(client, server, cut, fired, counter).await;
                            }
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        CutRelay { addr, cuts, task }
    }

    pub fn host(&self) -> String {
        self.addr.to_string()
    }
}

async fn relay(client: TcpStream, server: TcpStream, cut: Cut, fired: Arc<AtomicBool>, cuts: Arc<AtomicU64>) {
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let (up_limit, down_limit) = match cut {
        Cut::Upstream(n) => (Some(n), None),
        Cut::Downstream(n) => (None, Some(n)),
    };
    // Either direction ending (or being cut) closes the whole connection.
    tokio::select! {
        _ = pump(cr, sw, up_limit, fired.clone(), cuts.clone()) => {}
        _ = pump(sr, cw, down_limit, fired, cuts) => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    limit: Option<u64>,
    fired: Arc<AtomicBool>,
    cuts: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 64 << 10];
    let mut carried = 0u64;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(limit) = limit
            && carried + n as u64 > limit
            && !fired.swap(true, Ordering::SeqCst)
        {
            let keep = (limit - carried) as usize;
            let _ = to.write_all(&buf[..keep]).await;
            cuts.fetch_add(1, Ordering::SeqCst);
            return;
        }
        carried += n as u64;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A TCP relay in front of a registry that answers the first `times` connections with
/// an HTTP status of its own (503, 429, 403…) and closes them; later connections pass.
pub struct StatusRelay {
    pub addr: SocketAddr,
    pub served: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for StatusRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl StatusRelay {
    pub async fn start(target: SocketAddr, status: u16, times: u64) -> StatusRelay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("relay bind");
        let addr = listener.local_addr().expect("relay addr");
        let served = Arc::new(AtomicU64::new(0));
        let counter = served.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((mut client, _)) = accepted else { continue };
                        let counter = counter.clone();
                        conns.spawn(async move {
                            if counter.fetch_add(1, Ordering::SeqCst) < times {
                                // Read the request head, answer, close.
                                let mut buf = vec![0u8; 16 << 10];
                                let _ = client.read(&mut buf).await;
                                let head = format!(
                                    "HTTP/1.1 {status} Injected\r\nRetry-After: 0\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
                                );
                                let _ = client.write_all(head.as_bytes()).await;
                                let _ = client.shutdown().await;
                                return;
                            }
                            counter.fetch_sub(1, Ordering::SeqCst);
                            if let Ok(server) = TcpStream::connect(target).await {
                                let (cr, cw) = client.into_split();
                                let (sr, sw) = server.into_split();
                                let never = Arc::new(AtomicBool::new(true));
                                let cuts = Arc::new(AtomicU64::new(0));
                                tokio::select! {
                                    _ = pump(cr, sw, None, never.clone(), cuts.clone()) => {}
                                    _ = pump(sr, cw, None, never, cuts) => {}
                                }
                            }
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        StatusRelay { addr, served, task }
    }

    pub fn host(&self) -> String {
        self.addr.to_string()
    }
}

/// An OCI 1.1 front for a distribution 2.8 registry: `GET /v2/<repo>/referrers/<digest>`
/// is answered from the backend's `sha256-<hex>` tag, and that tag itself is hidden,
/// so a client can only find referrers through the referrers API. Everything else is
/// forwarded.
pub struct ReferrersFront {
    pub addr: SocketAddr,
    /// Referrers API requests answered.
    pub api_calls: Arc<AtomicU64>,
    /// Upload chunks (PATCH) seen; the first `drop_chunks` of them were answered `404`
    /// (see [`ReferrersFront::dropping_uploads`]).
    pub chunks_seen: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ReferrersFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ReferrersFront {
    pub async fn start(backend: &LocalRegistry) -> ReferrersFront {
        Self::dropping_uploads(backend, 0).await
    }

    /// As [`ReferrersFront::start`], and the first `drop_chunks` upload chunks (PATCH)
    /// are answered `404 BLOB_UPLOAD_UNKNOWN` without reaching the backend, as a
    /// registry answers once it has dropped an upload session.
    pub async fn dropping_uploads(backend: &LocalRegistry, drop_chunks: u64) -> ReferrersFront {
        use axum::body::Body;
        use axum::extract::{Request, State};
        use axum::response::Response;
        #[derive(Clone)]
        struct Front {
            public: String,
            backend: String,
            auth: Option<(String, String)>,
            http: reqwest::Client,
            calls: Arc<AtomicU64>,
            dropped: Arc<AtomicU64>,
            drop_chunks: u64,
        }
        async fn handle(State(f): State<Front>, req: Request) -> Response {
            let path = req.uri().path().to_string();
            let query = req.uri().query().map(|q| format!("?{q}")).unwrap_or_default();
            let parts: Vec<&str> = path.trim_start_matches("/v2/").rsplitn(3, '/').collect();
            // parts (reversed): [reference, kind, repo]
            let status = |s: u16| Response::builder().status(s).body(Body::empty()).unwrap_or_default();
            if parts.len() == 3 && parts[1] == "referrers" && req.method() == axum::http::Method::GET {
                f.calls.fetch_add(1, Ordering::SeqCst);
                let tag = parts[0].replace("sha256:", "sha256-");
                let mut r = f
                    .http
                    .get(format!("{}/v2/{}/manifests/{tag}", f.backend, parts[2]))
                    .header("Accept", OCI_INDEX);
                if let Some((u, p)) = &f.auth {
                    r = r.basic_auth(u, Some(p));
                }
                let body = match r.send().await {
                    Ok(resp) if resp.status().is_success() => resp.bytes().await.unwrap_or_default().to_vec(),
                    _ => serde_json::to_vec(
                        &serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}),
                    )
                    .unwrap_or_default(),
                };
                return Response::builder()
                    .header("Content-Type", OCI_INDEX)
                    .body(Body::from(body))
                    .unwrap_or_default();
            }
            if parts.len() == 3 && parts[1] == "manifests" && parts[0].starts_with("sha256-") {
                return status(404);
            }
            if req.method() == axum::http::Method::PATCH
                && path.contains("/blobs/uploads/")
                && f.dropped.fetch_add(1, Ordering::SeqCst) < f.drop_chunks
            {
                // The chunk is read first, as a registry reads it: answering before the
                // client has sent it makes the client see a reset connection instead
                // (and retry the chunk) when the machine is busy.
                let _ = axum::body::to_bytes(req.into_body(), usize::MAX).await;
                return Response::builder()
                    .status(404)
                    .header("Content-Type", "application/json")
                    .body(Body::from(r#"{"errors":[{"code":"BLOB_UPLOAD_UNKNOWN","message":"blob upload unknown to registry"}]}"#))
                    .unwrap_or_default();
            }
            let (head, body) = req.into_parts();
            let mut r = f.http.request(head.method.clone(), format!("{}{path}{query}", f.backend));
            for (k, v) in &head.headers {
                if k != axum::http::header::HOST {
                    r = r.header(k, v);
                }
            }
            let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
            let resp = match r.body(bytes).send().await {
                Ok(resp) => resp,
                Err(_) => return status(502),
            };
            let mut out = Response::builder().status(resp.status().as_u16());
            for (k, v) in resp.headers() {
                // Upload locations may be absolute: keep the client on the front.
                match v.to_str() {
                    Ok(v) if k == axum::http::header::LOCATION => {
                        out = out.header(k.as_str(), v.replace(&f.backend, &f.public))
                    }
                    _ => out = out.header(k.as_str(), v.as_bytes()),
                }
            }
            out.body(Body::from(resp.bytes().await.unwrap_or_default())).unwrap_or_default()
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("front bind");
        let addr = listener.local_addr().expect("front addr");
        let calls = Arc::new(AtomicU64::new(0));
        let front = Front {
            public: format!("http://{addr}"),
            backend: backend.url(),
            auth: backend.auth.clone(),
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("client"),
            calls: calls.clone(),
            dropped: Arc::new(AtomicU64::new(0)),
            drop_chunks,
        };
        let chunks_seen = front.dropped.clone();
        let app = axum::Router::new().fallback(handle).with_state(front);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        ReferrersFront { addr, api_calls: calls, chunks_seen, task }
    }

    pub fn host(&self) -> String {
        self.addr.to_string()
    }
}

/// A Bearer-token front (as Docker Hub, GHCR or Harbor authenticate) over an open
/// registry: requests without a token get `401` with a `WWW-Authenticate: Bearer
/// realm=…` challenge; `GET /token?service=…&scope=…` with the right Basic credential
/// issues a token for those scopes; requests with a token whose scopes do not cover
/// them get 401 again. Everything authorized is forwarded.
/// Tokens a [`TokenFront`] issued, each with the scopes it was issued for.
pub type IssuedTokens = Arc<std::sync::Mutex<Vec<(String, Vec<String>)>>>;

pub struct TokenFront {
    pub addr: SocketAddr,
    /// Tokens issued, with the scopes they were issued for.
    pub issued: IssuedTokens,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TokenFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TokenFront {
    pub async fn start(backend: &LocalRegistry, user: &str, password: &str) -> TokenFront {
        use axum::body::Body;
        use axum::extract::{Request, State};
        use axum::response::Response;
        #[derive(Clone)]
        struct Front {
            backend: String,
            me: String,
            basic: String,
            http: reqwest::Client,
            issued: IssuedTokens,
        }
        fn needed_scope(path: &str, method: &axum::http::Method) -> Option<String> {
            let rest = path.strip_prefix("/v2/")?;
            let i = ["/manifests/", "/blobs/", "/referrers/", "/tags/"]
                .iter()
                .filter_map(|m| rest.find(m))
                .min()?;
            let action = if method == axum::http::Method::GET || method == axum::http::Method::HEAD {
                "pull"
            } else {
                "push"
            };
            Some(format!("repository:{}:{action}", &rest[..i]))
        }
        async fn handle(State(f): State<Front>, req: Request) -> Response {
            let path = req.uri().path().to_string();
            let query = req.uri().query().unwrap_or("").to_string();
            let resp = |s: u16, h: Option<(&str, String)>, body: Vec<u8>| {
                let mut b = Response::builder().status(s);
                if let Some((k, v)) = h {
                    b = b.header(k, v);
                }
                b.body(Body::from(body)).unwrap_or_default()
            };
            if path == "/token" {
                let auth = req.headers().get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("");
                if auth != f.basic {
                    return resp(401, None, b"{\"errors\":[{\"code\":\"UNAUTHORIZED\"}]}".to_vec());
                }
                let scopes: Vec<String> = url::form_urlencoded::parse(query.as_bytes())
                    .filter(|(k, _)| k == "scope")
                    .map(|(_, v)| v.into_owned())
                    .collect();
                let token = format!("tok-{}", f.issued.lock().map(|i| i.len()).unwrap_or(0));
                if let Ok(mut i) = f.issued.lock() {
                    i.push((token.clone(), scopes));
                }
                return resp(
                    200,
                    Some(("Content-Type", "application/json".into())),
                    format!("{{\"token\":\"{token}\"}}").into_bytes(),
                );
            }
            let challenge = || {
                resp(
                    401,
                    Some((
                        "WWW-Authenticate",
                        format!("Bearer realm=\"{}/token\",service=\"test-registry\"", f.me),
                    )),
                    b"{\"errors\":[{\"code\":\"UNAUTHORIZED\"}]}".to_vec(),
                )
            };
            let bearer = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::to_string);
            let Some(token) = bearer else { return challenge() };
            if let Some(need) = needed_scope(&path, req.method()) {
                let (repo_need, action) = need.rsplit_once(':').unwrap_or((&need, ""));
                let granted = f.issued.lock().map(|i| {
                    i.iter().any(|(t, scopes)| {
                        *t == token
                            && scopes.iter().flat_map(|s| s.split(' ')).any(|s| {
                                s.rsplit_once(':').is_some_and(|(r, acts)| {
                                    r == repo_need && acts.split(',').any(|a| a == action)
                                })
                            })
                    })
                });
                if !granted.unwrap_or(false) {
                    return challenge();
                }
            }
            let (head, body) = req.into_parts();
            let q = if query.is_empty() { String::new() } else { format!("?{query}") };
            let mut r = f.http.request(head.method.clone(), format!("{}{path}{q}", f.backend));
            for (k, v) in &head.headers {
                if k != axum::http::header::HOST && k != axum::http::header::AUTHORIZATION {
                    r = r.header(k, v);
                }
            }
            let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
            let Ok(up) = r.body(bytes).send().await else { return resp(502, None, vec![]) };
            let mut out = Response::builder().status(up.status().as_u16());
            for (k, v) in up.headers() {
                out = out.header(k.as_str(), v.as_bytes());
            }
            out.body(Body::from(up.bytes().await.unwrap_or_default())).unwrap_or_default()
        }
        use base64::Engine as _;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("front bind");
        let addr = listener.local_addr().expect("front addr");
        let issued = Arc::new(std::sync::Mutex::new(Vec::new()));
        let front = Front {
            backend: backend.url(),
            me: format!("http://{addr}"),
            basic: format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
            ),
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("client"),
            issued: issued.clone(),
        };
        let app = axum::Router::new().fallback(handle).with_state(front);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        TokenFront { addr, issued, task }
    }

    pub fn host(&self) -> String {
        self.addr.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_taken_port_is_given_up_for_another() {
        let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = squatter.local_addr().unwrap().port();
        let mut ports = [taken, free_port()].into_iter();
        let registry =
            LocalRegistry::start_on(None, None, None, move || ports.next().expect("two ports")).await;
        assert_ne!(registry.port, taken);
        assert_eq!(registry.tags("nothing").await, Vec::<String>::new());
    }
}
