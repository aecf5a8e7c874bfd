//! The S3 sink: the layout of `byoc_audit::export` under `s3://bucket/prefix/<runner>/`,
//! written with signed PutObject calls under the runner's own identity.
//!
//! Every object carries a SHA-256 checksum (`x-amz-checksum-sha256`; a bucket with Object
//! Lock requires one). Records, checkpoints and cosignatures are written only if the name
//! is free (`If-None-Match: *`): an object once stored is never replaced, and a batch sent
//! again after a crash finds its object already there with the same bytes.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use byoc_audit::export::{RUNNER_VKEY, Stream, object_name};
use byoc_audit::log::{CONTROL_PLANE_PUB, RUNNER_PUB};
use sha2::Digest as _;

use super::{AwsIdentity, Batch, PublishedKeys, Sink, SinkError, SinkFuture, answer_text};
use crate::config::S3SinkConfig;

pub struct S3Sink {
    http: reqwest::Client,
    bucket: String,
    region: String,
    /// Path-style base (`<endpoint>/<bucket>`) with an endpoint, else virtual-hosted.
    base: String,
    /// `prefix/<runner>`, no slash at either end.
    key_prefix: String,
    identity: AwsIdentity,
}

impl S3Sink {
    pub fn new(
        c: &S3SinkConfig,
        region: &str,
        endpoint: Option<String>,
        runner_id: &str,
        identity: AwsIdentity,
    ) -> Result<S3Sink, String> {
        let base = match endpoint {
            Some(e) => format!("{}/{}", e.trim_end_matches('/'), c.bucket),
            None => format!("https://{}.s3.{region}.amazonaws.com", c.bucket),
        };
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("HTTP client for the S3 sink: {e}"))?;
        let key_prefix = [c.prefix.as_str(), runner_id]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join("/");
        Ok(S3Sink { http, bucket: c.bucket.clone(), region: region.to_string(), base, key_prefix, identity })
    }

    fn url(&self, name: &str) -> Result<url::Url, SinkError> {
        let mut url = url::Url::parse(&format!("{}/", self.base))
            .map_err(|e| SinkError(format!("S3 sink URL {}: {e}", self.base)))?;
        url.path_segments_mut()
            .map_err(|()| SinkError(format!("S3 sink URL {}", self.base)))?
            .pop_if_empty()
            .extend(self.key_prefix.split('/'))
            .extend(name.split('/'));
        Ok(url)
    }

    /// One signed request; the status and the answer.
    async fn call(
        &self,
        method: &str,
        name: &str,
        body: &[u8],
        extra: &[(&str, &str)],
    ) -> Result<(u16, Vec<u8>), SinkError> {
        let url = self.url(name)?;
        let keys = self.identity.keys().await?;
        let checksum = base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(body));
        let mut headers: Vec<(&str, &str)> = extra.to_vec();
        if method == "PUT" {
            headers.extend([
                ("x-amz-sdk-checksum-algorithm", "SHA256"),
                ("x-amz-checksum-sha256", checksum.as_str()),
            ]);
        }
        let signed = byoc_job_executors::aws_sign::signed_headers(
            &keys.identity(),
            &byoc_job_executors::aws_sign::Request {
                region: &self.region,
                service: "s3",
                method,
                url: url.as_str(),
                headers: &headers,
                body,
                payload_hash_header: true,
                time: SystemTime::now(),
            },
        )
        .map_err(SinkError)?;
        let method = reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| SinkError(e.to_string()))?;
        let mut req = self.http.request(method, url.as_str()).body(body.to_vec());
        for (k, v) in signed {
            req = req.header(k, v);
        }
        let what = |e: String| SinkError(format!("s3://{}/{}/{name}: {e}", self.bucket, self.key_prefix));
        let resp = req.send().await.map_err(|e| what(byoc_oci_sync::client::error_chain(&e)))?;
        let status = resp.status().as_u16();
        let body = resp.bytes().await.map_err(|e| what(byoc_oci_sync::client::error_chain(&e)))?;
        Ok((status, body.to_vec()))
    }

    fn failure(&self, name: &str, status: u16, body: &[u8]) -> SinkError {
        let text = String::from_utf8_lossy(body);
        let code = between(&text, "<Code>", "</Code>").unwrap_or_default();
        let message = between(&text, "<Message>", "</Message>").unwrap_or_default();
        let detail = if code.is_empty() {
            answer_text(body)
        } else {
            answer_text(format!("{code}: {message}").as_bytes())
        };
        SinkError(
            format!("s3://{}/{}/{name}: HTTP {status} {detail}", self.bucket, self.key_prefix)
                .trim_end()
                .to_string(),
        )
    }

    /// Store `body` under `name` if the name is free; an object already there must hold
    /// the same bytes (a batch sent again).
    async fn put_once(&self, name: &str, body: &[u8]) -> Result<(), SinkError> {
        let (status, answer) = self.call("PUT", name, body, &[("if-none-match", "*")]).await?;
        match status {
            200..=299 => Ok(()),
            // Taken: by this batch before a crash, or by something that is not the log.
            412 | 409 => {
                let (status, existing) = self.call("GET", name, &[], &[]).await?;
                if !(200..=299).contains(&status) {
                    return Err(self.failure(name, status, &existing));
                }
                if existing == body {
                    Ok(())
                } else {
                    Err(SinkError(format!(
                        "s3://{}/{}/{name} already holds other content: the copy will not overwrite it (another runner writing to the same prefix?)",
                        self.bucket, self.key_prefix
                    )))
                }
            }
            _ => Err(self.failure(name, status, &answer)),
        }
    }

    async fn put_lines(&self, stream: Stream, from: u64, lines: &[String]) -> Result<(), SinkError> {
        if lines.is_empty() {
            return Ok(());
        }
        let mut body = Vec::with_capacity(lines.iter().map(|l| l.len() + 1).sum());
        for l in lines {
            body.extend_from_slice(l.as_bytes());
            body.push(b'\n');
        }
        self.put_once(&object_name(stream, from, from + lines.len() as u64), &body).await
    }
}

fn between<'a>(text: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let start = text.find(open)? + open.len();
    let end = text[start..].find(close)? + start;
    Some(&text[start..end])
}

impl Sink for S3Sink {
    fn kind(&self) -> &'static str {
        "s3"
    }

    fn target(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.key_prefix)
    }

    fn put_keys<'a>(&'a self, keys: &'a PublishedKeys) -> SinkFuture<'a> {
        Box::pin(async move {
            for (name, text) in [
                (RUNNER_PUB, &keys.runner_pub),
                (RUNNER_VKEY, &keys.runner_vkey),
                (CONTROL_PLANE_PUB, &keys.control_plane_pub),
            ] {
                // Keys are replaced (control-plane keys accumulate across rotations); a
                // versioned bucket keeps every earlier version.
                let (status, answer) = self.call("PUT", name, text.as_bytes(), &[]).await?;
                if !(200..=299).contains(&status) {
                    return Err(self.failure(name, status, &answer));
                }
            }
            Ok(())
        })
    }

    fn put<'a>(&'a self, batch: &'a Batch) -> SinkFuture<'a> {
        Box::pin(async move {
            self.put_lines(Stream::Records, batch.records_from, &batch.records).await?;
            self.put_lines(Stream::Checkpoints, batch.checkpoints_from, &batch.checkpoints).await?;
            self.put_lines(Stream::Cosigned, batch.cosigned_from, &batch.cosigned).await
        })
    }
}
