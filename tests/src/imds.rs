//! A stand-in for the EC2 instance metadata service, IMDSv2 only (a token from
//! `PUT /latest/api/token`, then reads with that token), on a loopback port. Point the
//! runner at it with `AWS_EC2_METADATA_SERVICE_ENDPOINT`.

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, put};

pub const INSTANCE_ID: &str = "i-0b1c2d3e4f5a6b7c8";
const TOKEN: &str = "fake-imds-session-token";

pub struct FakeImds {
    pub url: String,
    task: tokio::task::JoinHandle<()>,
}

async fn token(headers: HeaderMap) -> Result<&'static str, StatusCode> {
    // IMDSv2 requires the TTL header on the token request.
    headers.get("x-aws-ec2-metadata-token-ttl-seconds").map(|_| TOKEN).ok_or(StatusCode::BAD_REQUEST)
}

async fn instance_id(headers: HeaderMap) -> Result<&'static str, StatusCode> {
    match headers.get("x-aws-ec2-metadata-token").and_then(|v| v.to_str().ok()) {
        Some(TOKEN) => Ok(INSTANCE_ID),
        _ => Err(StatusCode::UNAUTHORIZED),
    }
}

impl FakeImds {
    pub async fn start() -> std::io::Result<FakeImds> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let app = Router::new()
            .route("/latest/api/token", put(token))
            .route("/latest/meta-data/instance-id", get(instance_id));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(FakeImds { url, task })
    }
}

impl Drop for FakeImds {
    fn drop(&mut self) {
        self.task.abort();
    }
}
