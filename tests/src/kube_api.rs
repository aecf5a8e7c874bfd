//! A fake Kubernetes API server on loopback for the kubernetes executor's suites (no
//! real API server can be had offline): objects in memory by path, server-side apply
//! stored as sent (with a generation and, for workloads, a status that says ready
//! unless the test holds it back), GET, DELETE, 404s as Kubernetes words them, and a
//! record of every request (method, path, query, content type, body).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;

#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub query: String,
    pub content_type: String,
    pub body: serde_json::Value,
    pub authorization: String,
}

#[derive(Default)]
struct Inner {
    objects: BTreeMap<String, serde_json::Value>,
    requests: Vec<Recorded>,
    not_ready: BTreeSet<String>,
}

#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Inner>>);

pub struct FakeKubeApi {
    pub addr: SocketAddr,
    shared: Shared,
    task: tokio::task::JoinHandle<()>,
    /// The CA its certificate is signed by (the kubeconfig carries it inline).
    pub ca_pem: String,
}

impl Drop for FakeKubeApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn status(code: u16, reason: &str, message: String) -> Response {
    let body = serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": if code < 300 { "Success" } else { "Failure" }, "reason": reason, "message": message, "code": code});
    Response::builder()
        .status(code)
        .header("Content-Type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_default()
}

fn json(v: &serde_json::Value) -> Response {
    Response::builder()
        .header("Content-Type", "application/json")
        .body(Body::from(v.to_string()))
        .unwrap_or_default()
}

async fn handle(State(s): State<Shared>, req: Request) -> Response {
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let (content_type, authorization) = {
        let header = |k: &str| req.headers().get(k).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        (header("content-type"), header("authorization"))
    };
    let bytes = axum::body::to_bytes(req.into_body(), 16 << 20).await.unwrap_or_default();
    let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    serve(&s, method, path, query, content_type, authorization, body)
}

/// The synchronous part (the lock is never held across an await).
fn serve(
    s: &Shared,
    method: String,
    path: String,
    query: String,
    content_type: String,
    authorization: String,
    body: serde_json::Value,
) -> Response {
    let Ok(mut inner) = s.0.lock() else { return status(500, "InternalError", "lock".into()) };
    inner.requests.push(Recorded {
        method: method.clone(),
        path: path.clone(),
        query,
        content_type,
        body: body.clone(),
        authorization,
    });
    match method.as_str() {
        "GET" => match inner.objects.get(&path) {
            Some(o) => json(o),
            None => status(404, "NotFound", format!("{path} not found")),
        },
        "DELETE" => match inner.objects.remove(&path) {
            Some(_) => status(200, "", "deleted".into()),
            None => status(404, "NotFound", format!("{path} not found")),
        },
        "PATCH" => {
            let generation =
                inner.objects.get(&path).and_then(|o| o["metadata"]["generation"].as_i64()).unwrap_or(0) + 1;
            let mut obj = body;
            obj["metadata"]["generation"] = generation.into();
            let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
            let held = inner.not_ready.contains(&name);
            let replicas = obj["spec"]["replicas"].as_i64().unwrap_or(1);
            match obj["kind"].as_str() {
                Some("Deployment") | Some("StatefulSet") if !held => {
                    obj["status"] = serde_json::json!({"observedGeneration": generation, "replicas": replicas,
                        "updatedReplicas": replicas, "availableReplicas": replicas, "readyReplicas": replicas});
                }
                Some("Deployment") | Some("StatefulSet") => {
                    obj["status"] = serde_json::json!({"observedGeneration": generation, "replicas": replicas, "updatedReplicas": 0, "availableReplicas": 0});
                }
                Some("Job") if !held => {
                    obj["status"] =
                        serde_json::json!({"succeeded": obj["spec"]["completions"].as_i64().unwrap_or(1)})
                }
                _ => {}
            }
            inner.objects.insert(path, obj.clone());
            json(&obj)
        }
        _ => status(405, "MethodNotAllowed", method),
    }
}

/// A data-only kubeconfig for a cluster no test reaches (plan-only runs, the helm
/// stand-in): what the runner accepts from a job.
pub fn unreached_kubeconfig() -> String {
    "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://kube.invalid:6443\nusers:\n- name: u\n  user:\n    token: unreached-cluster-token-0001\n".into()
}

impl FakeKubeApi {
    /// Serve HTTPS on a loopback port, with a certificate of a CA of its own: the runner
    /// reaches a job's cluster over HTTPS only, and a loopback server only when its
    /// configuration names it ([`FakeKubeApi::runner_config`]).
    pub async fn start() -> FakeKubeApi {
        Self::start_named(&[]).await
    }

    /// The same, its certificate also valid for `names` (a host name of this machine's
    /// that resolves to loopback, so that only the runner's own rule keeps it away).
    pub async fn start_named(names: &[&str]) -> FakeKubeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shared = Shared::default();
        let app = axum::Router::new().fallback(handle).with_state(shared.clone());
        let all: Vec<&str> = ["127.0.0.1"].into_iter().chain(names.iter().copied()).collect();
        let pki = crate::tls::test_pki_for(&all).expect("test certificates");
        let tls = tokio_rustls::TlsAcceptor::from(pki.server.clone());
        let task = tokio::spawn(crate::server::serve(listener, app, Some(tls)));
        FakeKubeApi { addr, shared, task, ca_pem: pki.ca_pem }
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// What a runner's configuration says to let jobs name this server (it is on the
    /// runner's own loopback).
    pub fn runner_config(&self) -> String {
        format!("\n[kubernetes]\nallowed_servers = [\"{}\"]\n", self.url())
    }

    /// A kubeconfig for this server with a bearer token (data only: the CA inline).
    pub fn kubeconfig(&self, token: &str) -> String {
        use base64::Engine as _;
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n    certificate-authority-data: {ca}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: job\ncurrent-context: fake\nusers:\n- name: job\n  user:\n    token: {token}\n",
            self.url()
        )
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.0.lock().map(|i| i.requests.clone()).unwrap_or_default()
    }

    pub fn object(&self, path: &str) -> Option<serde_json::Value> {
        self.shared.0.lock().ok().and_then(|i| i.objects.get(path).cloned())
    }

    /// Change a stored object as someone with cluster access would (`kubectl edit`);
    /// `false` if there is none at `path`.
    pub fn edit(&self, path: &str, change: impl FnOnce(&mut serde_json::Value)) -> bool {
        let Ok(mut i) = self.shared.0.lock() else { return false };
        i.objects.get_mut(path).map(change).is_some()
    }

    /// Store an object as a tool other than the executor (helm) would have created it.
    pub fn put(&self, path: &str, object: serde_json::Value) {
        if let Ok(mut i) = self.shared.0.lock() {
            i.objects.insert(path.to_string(), object);
        }
    }

    /// Delete a stored object outside any job (`kubectl delete`).
    pub fn remove(&self, path: &str) -> Option<serde_json::Value> {
        self.shared.0.lock().ok().and_then(|mut i| i.objects.remove(path))
    }

    /// Workloads with this name never become ready.
    pub fn hold_back(&self, name: &str) {
        if let Ok(mut i) = self.shared.0.lock() {
            i.not_ready.insert(name.to_string());
        }
    }
}
