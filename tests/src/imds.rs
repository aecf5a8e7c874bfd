//! A stand-in for the EC2 instance metadata service, IMDSv2 only (a token from
//! `PUT /latest/api/token`, then reads with that token), on a loopback port. Point the
//! runner at it with `AWS_EC2_METADATA_SERVICE_ENDPOINT`. It also serves the instance
//! profile's credentials (`iam/security-credentials/`), for the VM suite.

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, put};

pub const INSTANCE_ID: &str = "i-0b1c2d3e4f5a6b7c8";
/// The instance profile's role name (its credentials come from this service too).
pub const INSTANCE_ROLE: &str = "byoc-runner-instance";
const TOKEN: &str = "fake-imds-session-token";

pub struct FakeImds {
    pub url: String,
    lifecycle: Lifecycle,
    task: tokio::task::JoinHandle<()>,
}

/// What the instance's lifecycle paths answer: a Spot interruption notice (none: 404)
/// and Auto Scaling's target lifecycle state.
#[derive(Clone, Default)]
struct Lifecycle(std::sync::Arc<std::sync::Mutex<(Option<String>, Option<String>)>>);

async fn spot_action(
    axum::extract::State(l): axum::extract::State<Lifecycle>,
    headers: HeaderMap,
) -> Result<String, StatusCode> {
    authorized(&headers)?;
    l.0.lock().unwrap_or_else(|e| e.into_inner()).0.clone().ok_or(StatusCode::NOT_FOUND)
}

async fn target_lifecycle_state(
    axum::extract::State(l): axum::extract::State<Lifecycle>,
    headers: HeaderMap,
) -> Result<String, StatusCode> {
    authorized(&headers)?;
    Ok(l.0.lock().unwrap_or_else(|e| e.into_inner()).1.clone().unwrap_or_else(|| "InService".into()))
}

async fn token(headers: HeaderMap) -> Result<([(&'static str, String); 1], &'static str), StatusCode> {
    // IMDSv2 requires the TTL header on the token request and answers with it (the AWS
    // SDKs refuse a token without it).
    let ttl = headers.get("x-aws-ec2-metadata-token-ttl-seconds").ok_or(StatusCode::BAD_REQUEST)?;
    let ttl = ttl.to_str().map_err(|_| StatusCode::BAD_REQUEST)?.to_string();
    Ok(([("x-aws-ec2-metadata-token-ttl-seconds", ttl)], TOKEN))
}

fn authorized(headers: &HeaderMap) -> Result<(), StatusCode> {
    match headers.get("x-aws-ec2-metadata-token").and_then(|v| v.to_str().ok()) {
        Some(TOKEN) => Ok(()),
        _ => Err(StatusCode::UNAUTHORIZED),
    }
}

async fn instance_id(headers: HeaderMap) -> Result<&'static str, StatusCode> {
    authorized(&headers).map(|()| INSTANCE_ID)
}

async fn role_name(headers: HeaderMap) -> Result<&'static str, StatusCode> {
    authorized(&headers).map(|()| INSTANCE_ROLE)
}

/// The instance profile's credentials, as EC2 serves them (moto accepts any).
async fn role_credentials(
    headers: HeaderMap,
    axum::extract::Path(role): axum::extract::Path<String>,
) -> Result<axum::Json<serde_json::Value>, StatusCode> {
    authorized(&headers)?;
    if role != INSTANCE_ROLE {
        return Err(StatusCode::NOT_FOUND);
    }
    let expiration = std::time::SystemTime::now() + std::time::Duration::from_secs(6 * 3600);
    let secs = expiration.duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
    Ok(axum::Json(serde_json::json!({
        "Code": "Success",
        "Type": "AWS-HMAC",
        "AccessKeyId": "ASIAFAKEIMDSINSTANCE",
        "SecretAccessKey": "fake-imds-instance-secret-access-key",
        "Token": "fake-imds-instance-session-token",
        "Expiration": rfc3339(secs),
        "LastUpdated": rfc3339(secs - 6 * 3600),
    })))
}

/// `YYYY-MM-DDTHH:MM:SSZ` for a Unix time (civil-from-days, proleptic Gregorian).
fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

impl FakeImds {
    pub async fn start() -> std::io::Result<FakeImds> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let app = Router::new()
            .route("/latest/api/token", put(token))
            .route("/latest/meta-data/instance-id", get(instance_id))
            .route("/latest/meta-data/iam/security-credentials/", get(role_name))
            .route("/latest/meta-data/iam/security-credentials/{role}", get(role_credentials))
            .route("/latest/meta-data/spot/instance-action", get(spot_action))
            .route("/latest/meta-data/autoscaling/target-lifecycle-state", get(target_lifecycle_state));
        let lifecycle = Lifecycle::default();
        let app = app.with_state(lifecycle.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(FakeImds { url, lifecycle, task })
    }

    /// A Spot interruption notice: `action` at `at` (unix seconds), as EC2 words it.
    pub fn spot_notice(&self, action: &str, at: u64) {
        let notice = serde_json::json!({ "action": action, "time": rfc3339(at) }).to_string();
        self.lifecycle.0.lock().unwrap_or_else(|e| e.into_inner()).0 = Some(notice);
    }

    /// Auto Scaling's target lifecycle state (`InService` until set; `Terminated`).
    pub fn target_lifecycle_state(&self, state: &str) {
        self.lifecycle.0.lock().unwrap_or_else(|e| e.into_inner()).1 = Some(state.to_string());
    }
}

impl Drop for FakeImds {
    fn drop(&mut self) {
        self.task.abort();
    }
}
