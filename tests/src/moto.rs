//! A `moto` server (AWS API emulator from PyPI) on a free loopback port, for the
//! suites that need STS and CloudFormation. `scripts/setup` installs it into the
//! project's `.venv`. Its request recorder tells a test exactly which AWS calls the
//! runner made (moto itself assumes any role, so the runner's own refusals are proven
//! by the calls that never arrived).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;

use crate::ports::{free_port, start_child};

pub struct MotoServer {
    pub port: u16,
    /// The address it listens on (127.0.0.1 unless started in another namespace).
    host: String,
    child: Child,
    http: reqwest::Client,
    logs: tempfile::TempDir,
}

/// `BYOC_MOTO_SERVER`, else the project's `.venv/bin/moto_server`.
pub fn moto_binary() -> PathBuf {
    std::env::var_os("BYOC_MOTO_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/moto_server"))
}

/// One request AWS received: the Query API action and its parameters.
#[derive(Debug, Clone)]
pub struct AwsCall {
    pub action: String,
    pub params: BTreeMap<String, String>,
}

impl MotoServer {
    /// Start and wait until it answers; recording is on from the start.
    pub async fn start() -> MotoServer {
        Self::start_on(free_port, None, "127.0.0.1").await
    }

    /// Started in the network namespace at `netns` (a `/proc/PID/ns/net` path),
    /// listening on `host` there: an AWS a job reaches through its own network, as it
    /// would reach AWS's endpoints (the host's loopback is closed to every job).
    pub async fn start_in(netns: String, host: &str) -> MotoServer {
        Self::start_on(free_port, Some(netns), host).await
    }

    async fn start_on(next_port: impl FnMut() -> u16, netns: Option<String>, host: &str) -> MotoServer {
        let bin = moto_binary();
        assert!(
            bin.exists(),
            "moto_server not found at {} (run scripts/setup, or set BYOC_MOTO_SERVER)",
            bin.display()
        );
        let logs = tempfile::tempdir().expect("tempdir");
        let log_path = logs.path().join("moto.log");
        let http = reqwest::Client::new();
        let spawn = |port: u16| {
            let log = std::fs::File::create(&log_path).expect("moto log");
            let mut cmd = match &netns {
                // nsenter joins the namespace and execs moto: one process, whose own
                // view `listens_on` reads.
                Some(ns) => {
                    let mut c = Command::new("nsenter");
                    c.arg(format!("--net={ns}")).arg(&bin);
                    c
                }
                None => Command::new(&bin),
            };
            cmd.args(["-H", host, "-p", &port.to_string()])
                // The recorder writes to a file (default: in the working directory): one
                // per server, or parallel tests would read each other's calls.
                .current_dir(logs.path())
                .env("MOTO_RECORDER_FILEPATH", logs.path().join("recording.jsonl"))
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log fd"))
                .stderr(log)
                .spawn()
                .expect("moto_server starts")
        };
        let answers = async |port: u16| {
            let start_recording = format!("http://{host}:{port}/moto-api/recorder/start-recording");
            http.post(&start_recording).send().await.is_ok_and(|r| r.status().is_success())
        };
        let patience = Duration::from_secs(60);
        let (port, child) = start_child("moto_server", &log_path, patience, next_port, spawn, answers).await;
        MotoServer { port, host: host.to_string(), child, http, logs }
    }

    pub fn url(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }

    /// Every call recorded so far, in order.
    pub async fn calls(&self) -> Vec<AwsCall> {
        let text = self
            .http
            .get(format!("{}/moto-api/recorder/download-recording", self.url()))
            .send()
            .await
            .expect("moto recorder")
            .text()
            .await
            .expect("recording");
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| {
                let body = v["body"].as_str()?;
                let raw = base64::engine::general_purpose::STANDARD.decode(body).ok()?;
                // JSON-protocol APIs (ECR) name the action in X-Amz-Target.
                if let Some(target) = v["headers"]["X-Amz-Target"].as_str() {
                    let json: serde_json::Value = serde_json::from_slice(&raw).unwrap_or_default();
                    let params = json
                        .as_object()
                        .map(|o| o.iter().map(|(k, v)| (k.clone(), v.to_string())).collect())
                        .unwrap_or_default();
                    return Some(AwsCall { action: target.rsplit('.').next()?.to_string(), params });
                }
                let params: BTreeMap<String, String> =
                    url::form_urlencoded::parse(&raw).into_owned().collect();
                Some(AwsCall { action: params.get("Action")?.clone(), params })
            })
            .collect()
    }

    pub async fn calls_of(&self, action: &str) -> Vec<AwsCall> {
        self.calls().await.into_iter().filter(|c| c.action == action).collect()
    }

    /// A JSON-protocol call (ECR) as the test itself.
    pub async fn json_call(&self, service: &str, target: &str, body: serde_json::Value) -> serde_json::Value {
        let auth = format!(
            "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/{service}/aws4_request, SignedHeaders=host, Signature=00"
        );
        let r = self
            .http
            .post(format!("{}/", self.url()))
            .header("Content-Type", "application/x-amz-json-1.1")
            .header("X-Amz-Target", target)
            .header("Authorization", auth)
            .body(body.to_string())
            .send()
            .await
            .expect("moto answers");
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        assert!(status.is_success(), "{target} failed: {status} {text}");
        serde_json::from_str(&text).unwrap_or_default()
    }

    /// A Query API call as the test itself (moto does not check signatures, but routes
    /// by the credential scope's service name).
    pub async fn query(&self, service: &str, params: &[(String, String)]) -> String {
        let body: String = url::form_urlencoded::Serializer::new(String::new()).extend_pairs(params).finish();
        let auth = format!(
            "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/{service}/aws4_request, SignedHeaders=host, Signature=00"
        );
        // moto answers 5xx now and then while it is still importing a service's backend on
        // a loaded machine: a server error is retried (a few times), never a client error.
        let mut attempt = 0;
        loop {
            let r = self
                .http
                .post(format!("{}/", self.url()))
                .header("Content-Type", "application/x-www-form-urlencoded; charset=utf-8")
                .header("Authorization", &auth)
                .body(body.clone())
                .send()
                .await
                .expect("moto answers");
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            attempt += 1;
            if status.is_server_error() && attempt < 4 {
                tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
                continue;
            }
            assert!(
                status.is_success(),
                "{service} call failed: {status} {text}\nmoto's log:\n{}",
                std::fs::read_to_string(self.logs.path().join("moto.log")).unwrap_or_default()
            );
            return text;
        }
    }

    /// An S3 bucket (path-style, as the test itself).
    pub async fn create_bucket(&self, bucket: &str) {
        let r = self
            .http
            .put(format!("{}/{bucket}", self.url()))
            .header("Authorization", Self::auth("s3"))
            .send()
            .await
            .expect("moto answers");
        assert!(r.status().is_success(), "CreateBucket {bucket}: {}", r.text().await.unwrap_or_default());
    }

    /// An S3 bucket with Object Lock on and a default retention in compliance mode (as
    /// the install stack creates the audit bucket): every object must carry a checksum.
    pub async fn create_locked_bucket(&self, bucket: &str) {
        let r = self
            .http
            .put(format!("{}/{bucket}", self.url()))
            .header("Authorization", Self::auth("s3"))
            .header("x-amz-bucket-object-lock-enabled", "true")
            .send()
            .await
            .expect("moto answers");
        assert!(r.status().is_success(), "CreateBucket {bucket}: {}", r.text().await.unwrap_or_default());
        let config = "<ObjectLockConfiguration><ObjectLockEnabled>Enabled</ObjectLockEnabled><Rule><DefaultRetention>\
                      <Mode>COMPLIANCE</Mode><Days>1</Days></DefaultRetention></Rule></ObjectLockConfiguration>";
        let r = self
            .http
            .put(format!("{}/{bucket}?object-lock", self.url()))
            .header("Authorization", Self::auth("s3"))
            .body(config)
            .send()
            .await
            .expect("moto answers");
        assert!(
            r.status().is_success(),
            "PutObjectLockConfiguration: {}",
            r.text().await.unwrap_or_default()
        );
    }

    /// Delete an S3 object (as the test itself); the status.
    pub async fn s3_delete(&self, bucket: &str, key: &str) -> u16 {
        self.http
            .delete(format!("{}/{bucket}/{key}", self.url()))
            .header("Authorization", Self::auth("s3"))
            .send()
            .await
            .expect("moto answers")
            .status()
            .as_u16()
    }

    /// Every message in a CloudWatch Logs stream, oldest first.
    pub async fn log_messages(&self, group: &str, stream: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut body =
                serde_json::json!({"logGroupName": group, "logStreamName": stream, "startFromHead": true});
            if let Some(t) = &token {
                body["nextToken"] = t.clone().into();
            }
            let v = self.json_call("logs", "Logs_20140328.GetLogEvents", body).await;
            let events = v["events"].as_array().cloned().unwrap_or_default();
            out.extend(events.iter().filter_map(|e| e["message"].as_str().map(str::to_string)));
            let next = v["nextForwardToken"].as_str().map(str::to_string);
            if events.is_empty() || next == token {
                return out;
            }
            token = next;
        }
    }

    /// Whether an S3 bucket exists, and whether versioning is on in it.
    pub async fn bucket_versioning(&self, bucket: &str) -> Option<bool> {
        let r = self
            .http
            .get(format!("{}/{bucket}?versioning", self.url()))
            .header("Authorization", Self::auth("s3"))
            .send()
            .await
            .expect("moto answers");
        if !r.status().is_success() {
            return None;
        }
        Some(r.text().await.unwrap_or_default().contains("<Status>Enabled</Status>"))
    }

    /// The keys in an S3 bucket.
    pub async fn s3_keys(&self, bucket: &str) -> Vec<String> {
        let text = self
            .http
            .get(format!("{}/{bucket}?list-type=2", self.url()))
            .header("Authorization", Self::auth("s3"))
            .send()
            .await
            .expect("moto answers")
            .text()
            .await
            .unwrap_or_default();
        text.split("<Key>").skip(1).filter_map(|k| k.split("</Key>").next()).map(str::to_string).collect()
    }

    /// Put an S3 object (as the test itself).
    pub async fn s3_put(&self, bucket: &str, key: &str, body: Vec<u8>) {
        let r = self
            .http
            .put(format!("{}/{bucket}/{key}", self.url()))
            .header("Authorization", Self::auth("s3"))
            .body(body)
            .send()
            .await
            .expect("moto answers");
        assert!(r.status().is_success(), "PutObject {bucket}/{key}: {}", r.text().await.unwrap_or_default());
    }

    /// An S3 object's bytes.
    pub async fn s3_object(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let r = self
            .http
            .get(format!("{}/{bucket}/{key}", self.url()))
            .header("Authorization", Self::auth("s3"))
            .send()
            .await
            .expect("moto answers");
        if !r.status().is_success() {
            return None;
        }
        r.bytes().await.ok().map(|b| b.to_vec())
    }

    /// moto routes by the credential scope's service name; it checks no signature.
    fn auth(service: &str) -> String {
        format!(
            "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/{service}/aws4_request, SignedHeaders=host, Signature=00"
        )
    }

    /// CreateStack or UpdateStack with a JSON template and parameters.
    pub async fn put_stack(
        &self,
        action: &str,
        stack: &str,
        template: &serde_json::Value,
        params: &[(&str, &str)],
    ) {
        let mut p: Vec<(String, String)> = vec![
            ("Action".into(), action.into()),
            ("Version".into(), "2010-05-15".into()),
            ("StackName".into(), stack.into()),
            ("TemplateBody".into(), template.to_string()),
        ];
        for (i, (k, v)) in params.iter().enumerate() {
            p.push((format!("Parameters.member.{}.ParameterKey", i + 1), k.to_string()));
            p.push((format!("Parameters.member.{}.ParameterValue", i + 1), v.to_string()));
        }
        self.query("cloudformation", &p).await;
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_taken_port_is_given_up_for_another() {
        // The squatter answers everything with 200, as docker-registry answers `POST /`.
        let squatter = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let taken = squatter.local_addr().unwrap().port();
        let serve = tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = squatter.accept().await else { return };
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
                    let mut buf = [0u8; 4096];
                    let _ = conn.read(&mut buf).await;
                    let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
                });
            }
        });
        let mut ports = [taken, free_port()].into_iter();
        let moto = MotoServer::start_on(move || ports.next().expect("two ports"), None, "127.0.0.1").await;
        assert_ne!(moto.port, taken);
        assert!(crate::ports::listens_on(moto.child.id(), moto.port));
        serve.abort();
    }
}
