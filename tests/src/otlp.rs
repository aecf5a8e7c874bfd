//! An OTLP/HTTP logs receiver (JSON encoding) on loopback over TLS, written for the
//! tests: it keeps every log record it was sent, and can refuse requests for a while.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

#[derive(Default)]
struct Shared {
    /// Every log record received, with its resource's attributes.
    records: Mutex<Vec<serde_json::Value>>,
    /// Each request's headers, as received.
    headers: Mutex<Vec<HeaderMap>>,
    refusing: AtomicBool,
}

pub struct OtlpReceiver {
    pub url: String,
    /// The CA the receiver's certificate is signed by (PEM).
    pub ca_pem: String,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn logs(State(s): State<Arc<Shared>>, headers: HeaderMap, body: String) -> (StatusCode, String) {
    if s.refusing.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "{\"message\":\"collector overloaded\"}".into());
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "{\"message\":\"not JSON\"}".into());
    };
    let mut out = Vec::new();
    for rl in v["resourceLogs"].as_array().into_iter().flatten() {
        for sl in rl["scopeLogs"].as_array().into_iter().flatten() {
            for r in sl["logRecords"].as_array().into_iter().flatten() {
                let mut r = r.clone();
                r["resource"] = rl["resource"].clone();
                out.push(r);
            }
        }
    }
    s.records.lock().unwrap_or_else(|e| e.into_inner()).extend(out);
    s.headers.lock().unwrap_or_else(|e| e.into_inner()).push(headers);
    (StatusCode::OK, "{}".into())
}

impl OtlpReceiver {
    pub async fn start() -> anyhow::Result<OtlpReceiver> {
        let pki = crate::tls::test_pki()?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("https://127.0.0.1:{}", listener.local_addr()?.port());
        let shared = Arc::new(Shared::default());
        let app = Router::new().route("/v1/logs", post(logs)).with_state(shared.clone());
        let tls = tokio_rustls::TlsAcceptor::from(pki.server.clone());
        let task = tokio::spawn(crate::server::serve(listener, app, Some(tls)));
        Ok(OtlpReceiver { url, ca_pem: pki.ca_pem, shared, task })
    }

    pub fn records(&self) -> Vec<serde_json::Value> {
        self.shared.records.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn headers(&self) -> Vec<HeaderMap> {
        self.shared.headers.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Answer 503 to every request until `accept`.
    pub fn refuse(&self) {
        self.shared.refusing.store(true, Ordering::SeqCst);
    }

    pub fn accept(&self) {
        self.shared.refusing.store(false, Ordering::SeqCst);
    }
}

/// A log record's attribute, as its JSON value (`{"stringValue": …}`).
pub fn attribute<'a>(record: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    record["attributes"].as_array()?.iter().find(|a| a["key"] == key).map(|a| &a["value"])
}
