//! The OTLP sink: OTLP/HTTP logs in the JSON encoding (`POST <endpoint>/v1/logs`) to the
//! customer's collector, trusting the customer's CA.
//!
//! One log record per audit record: the record's exact line as the body, each field as
//! an attribute (`byoc.audit.seq`, `byoc.audit.event`, `byoc.audit.job`, …,
//! `byoc.audit.digest.<name>`); one per checkpoint and cosignature
//! (`byoc.audit.stream` = `checkpoints` | `cosigned`, `byoc.audit.index`,
//! `byoc.audit.size`, the stored line as the body). The resource names the runner and
//! the install. A batch sent again after a failure repeats records; `byoc.audit.seq` and
//! `byoc.audit.index` let a collector drop the repeats.

use std::time::Duration;

use serde_json::{Value, json};

use super::{Batch, PublishedKeys, Sink, SinkError, SinkFuture, answer_text};
use crate::config::OtlpSinkConfig;

/// Log records in one request (a collector's default limit is a few MiB).
const MAX_RECORDS: usize = 500;

pub struct OtlpSink {
    http: reqwest::Client,
    url: reqwest::Url,
    headers: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
    runner_id: String,
    install_id: String,
}

impl OtlpSink {
    pub fn new(c: &OtlpSinkConfig, runner_id: &str, install_id: &str) -> Result<OtlpSink, String> {
        let mut url = c.endpoint.clone();
        if !url.path().ends_with("/v1/logs") {
            let path = format!("{}/v1/logs", url.path().trim_end_matches('/'));
            url.set_path(&path);
        }
        let mut builder = reqwest::Client::builder()
            .timeout(c.timeout)
            .connect_timeout(Duration::from_secs(10))
            .redirect(reqwest::redirect::Policy::none());
        if let Some(path) = &c.ca_file {
            let pem = std::fs::read(path)
                .map_err(|e| format!("audit.export.otlp.ca_file {}: {e}", path.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("audit.export.otlp.ca_file {}: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!(
                    "audit.export.otlp.ca_file {}: no PEM certificate in it",
                    path.display()
                ));
            }
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        let http = builder.build().map_err(|e| format!("HTTP client for the OTLP sink: {e}"))?;
        let headers = match &c.headers_file {
            Some(path) => read_headers(path)?,
            None => Vec::new(),
        };
        Ok(OtlpSink {
            http,
            url,
            headers,
            runner_id: runner_id.to_string(),
            install_id: install_id.to_string(),
        })
    }

    async fn send(&self, records: &[Value]) -> Result<(), SinkError> {
        for chunk in records.chunks(MAX_RECORDS) {
            let body = request(&self.runner_id, &self.install_id, chunk);
            let mut req = self
                .http
                .post(self.url.clone())
                .header("content-type", "application/json")
                .body(body.to_string());
            for (k, v) in &self.headers {
                req = req.header(k, v);
            }
            // The chain names the URL.
            let resp = req.send().await.map_err(|e| SinkError(byoc_oci_sync::client::error_chain(&e)))?;
            let status = resp.status().as_u16();
            let answer = resp.bytes().await.unwrap_or_default();
            if !(200..300).contains(&status) {
                return Err(SinkError(format!(
                    "{}: HTTP {status} {}",
                    self.url,
                    self.scrub(&answer_text(&answer))
                )));
            }
            // A partial success names records the collector dropped: sent again.
            let v: Value = serde_json::from_slice(&answer).unwrap_or_default();
            let rejected = &v["partialSuccess"]["rejectedLogRecords"];
            let rejected =
                rejected.as_u64().or_else(|| rejected.as_str().and_then(|s| s.parse().ok())).unwrap_or(0);
            if rejected > 0 {
                let why = v["partialSuccess"]["errorMessage"].as_str().unwrap_or_default();
                return Err(SinkError(format!(
                    "{}: the collector rejected {rejected} log records: {}",
                    self.url,
                    self.scrub(&answer_text(why.as_bytes()))
                )));
            }
        }
        Ok(())
    }

    /// A collector that echoes a request header (an API key) does not get it into an error.
    fn scrub(&self, text: &str) -> String {
        let mut out = text.to_string();
        for (_, v) in &self.headers {
            if let Ok(v) = v.to_str()
                && v.len() >= 4
            {
                out = out.replace(v, "<redacted>");
            }
        }
        out
    }
}

/// `Name: value` lines; blank lines and `#` comments skipped. Values are kept secret
/// (marked sensitive, never logged). The file holds the collector's credentials: it must
/// be a regular file (not a link), readable by its owner alone (0600 or 0400), and owned
/// by root or the user the runner runs as.
fn read_headers(
    path: &std::path::Path,
) -> Result<Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>, String> {
    use std::io::Read as _;
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let fail = |e: String| format!("audit.export.otlp.headers_file {}: {e}", path.display());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| fail(e.to_string()))?;
    let meta = file.metadata().map_err(|e| fail(e.to_string()))?;
    let me = nix::unistd::geteuid().as_raw();
    if !meta.is_file() {
        return Err(fail("not a regular file".into()));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(fail(format!(
            "mode {:o}: it holds credentials, make it 0600 (chmod 600)",
            meta.mode() & 0o777
        )));
    }
    if meta.uid() != 0 && meta.uid() != me {
        return Err(fail(format!("owned by uid {}, neither root nor the runner's user ({me})", meta.uid())));
    }
    let mut text = String::new();
    file.take(1 << 20).read_to_string(&mut text).map_err(|e| fail(e.to_string()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = || {
            format!(
                "audit.export.otlp.headers_file {} line {}: expected `Name: value`",
                path.display(),
                i + 1
            )
        };
        let (name, value) = line.split_once(':').ok_or_else(bad)?;
        let name = reqwest::header::HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| bad())?;
        let mut value = reqwest::header::HeaderValue::from_str(value.trim()).map_err(|_| bad())?;
        value.set_sensitive(true);
        out.push((name, value));
    }
    Ok(out)
}

fn string(key: &str, value: &str) -> Value {
    json!({ "key": key, "value": { "stringValue": value } })
}

/// OTLP's JSON encoding carries 64-bit integers as strings.
fn int(key: &str, value: i64) -> Value {
    json!({ "key": key, "value": { "intValue": value.to_string() } })
}

/// The log records of a batch, in order.
pub fn log_records(batch: &Batch, now_ms: u64) -> Vec<Value> {
    let mut out = Vec::new();
    let nanos = |ms: u64| (ms as u128 * 1_000_000).to_string();
    for line in &batch.records {
        let mut attributes = vec![string("byoc.audit.stream", "records")];
        let mut time = now_ms;
        if let Some(r) = super::parse_record(line) {
            time = r.time_ms;
            attributes.push(int("byoc.audit.seq", r.seq as i64));
            attributes.push(string("byoc.audit.install", &r.install));
            attributes.push(string("byoc.audit.event", &r.event));
            for (key, value) in [
                ("job", &r.job),
                ("kind", &r.kind),
                ("operation", &r.operation),
                ("role", &r.role),
                ("reason", &r.reason),
                ("status", &r.status),
                ("detail", &r.detail),
            ] {
                if let Some(v) = value {
                    attributes.push(string(&format!("byoc.audit.{key}"), v));
                }
            }
            if let Some(code) = r.exit_code {
                attributes.push(int("byoc.audit.exit_code", code.into()));
            }
            for (name, digest) in &r.digests {
                attributes.push(string(&format!("byoc.audit.digest.{name}"), digest));
            }
        }
        out.push(json!({
            "timeUnixNano": nanos(time),
            "observedTimeUnixNano": nanos(now_ms),
            "severityNumber": 9,
            "severityText": "INFO",
            "body": { "stringValue": line },
            "attributes": attributes,
        }));
    }
    for (stream, from, lines) in [
        ("checkpoints", batch.checkpoints_from, &batch.checkpoints),
        ("cosigned", batch.cosigned_from, &batch.cosigned),
    ] {
        for (i, line) in lines.iter().enumerate() {
            let stored: Option<byoc_audit::log::StoredCheckpoint> = serde_json::from_str(line).ok();
            let mut attributes =
                vec![string("byoc.audit.stream", stream), int("byoc.audit.index", (from + i as u64) as i64)];
            if let Some(s) = &stored {
                attributes.push(int("byoc.audit.size", s.size as i64));
            }
            out.push(json!({
                "timeUnixNano": nanos(now_ms),
                "observedTimeUnixNano": nanos(now_ms),
                "severityNumber": 9,
                "severityText": "INFO",
                "body": { "stringValue": line },
                "attributes": attributes,
            }));
        }
    }
    out
}

fn request(runner_id: &str, install_id: &str, records: &[Value]) -> Value {
    json!({
        "resourceLogs": [{
            "resource": { "attributes": [
                string("service.name", "byoc-runner"),
                string("byoc.runner.id", runner_id),
                string("byoc.install.id", install_id),
            ]},
            "scopeLogs": [{
                "scope": { "name": "byoc-runner.audit", "version": env!("CARGO_PKG_VERSION") },
                "logRecords": records,
            }],
        }],
    })
}

impl Sink for OtlpSink {
    fn kind(&self) -> &'static str {
        "otlp"
    }

    fn target(&self) -> String {
        self.url.to_string()
    }

    fn put_keys<'a>(&'a self, keys: &'a PublishedKeys) -> SinkFuture<'a> {
        Box::pin(async move {
            let now = byoc_audit::log::now_ms();
            let record = json!({
                "timeUnixNano": (now as u128 * 1_000_000).to_string(),
                "severityNumber": 9,
                "severityText": "INFO",
                "body": { "stringValue": keys.runner_vkey.trim() },
                "attributes": [
                    string("byoc.audit.stream", "keys"),
                    string("byoc.audit.runner_pub", keys.runner_pub.trim()),
                    string("byoc.audit.control_plane_pub", keys.control_plane_pub.trim()),
                ],
            });
            self.send(&[record]).await
        })
    }

    fn put<'a>(&'a self, batch: &'a Batch) -> SinkFuture<'a> {
        Box::pin(async move { self.send(&log_records(batch, byoc_audit::log::now_ms())).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_becomes_one_log_record_with_its_fields_as_attributes() {
        let line = r#"{"seq":4,"time_ms":1800000000123,"install":"inst-1","event":"job_finished","job":"j-1","status":"succeeded","exit_code":0,"digests":{"log_sha256":"ab"}}"#;
        let batch = Batch {
            records_from: 4,
            records: vec![line.into()],
            checkpoints_from: 2,
            checkpoints: vec![r#"{"size":5,"note":"n"}"#.into()],
            ..Default::default()
        };
        let records = log_records(&batch, 1_800_000_000_999);
        assert_eq!(records.len(), 2);
        let r = &records[0];
        assert_eq!(r["body"]["stringValue"], line);
        assert_eq!(r["timeUnixNano"], "1800000000123000000");
        let attr = |rec: &Value, k: &str| {
            rec["attributes"].as_array().unwrap().iter().find(|a| a["key"] == k).map(|a| a["value"].clone())
        };
        assert_eq!(attr(r, "byoc.audit.seq").unwrap()["intValue"], "4");
        assert_eq!(attr(r, "byoc.audit.event").unwrap()["stringValue"], "job_finished");
        assert_eq!(attr(r, "byoc.audit.digest.log_sha256").unwrap()["stringValue"], "ab");
        assert_eq!(attr(r, "byoc.audit.exit_code").unwrap()["intValue"], "0");
        assert!(attr(r, "byoc.audit.role").is_none());
        assert_eq!(attr(&records[1], "byoc.audit.index").unwrap()["intValue"], "2");
        assert_eq!(attr(&records[1], "byoc.audit.size").unwrap()["intValue"], "5");
        let req = request("rn-1", "inst-1", &records);
        assert_eq!(req["resourceLogs"][0]["scopeLogs"][0]["logRecords"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn the_endpoint_gets_the_logs_path_and_headers_come_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let headers = dir.path().join("h");
        std::fs::write(
            &headers,
            "# the collector's key\nAuthorization: Bearer s3cret-value\n\nX-Tenant: acme\n",
        )
        .unwrap();
        let chmod = |mode| {
            std::fs::set_permissions(&headers, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap()
        };
        chmod(0o600);
        let c = OtlpSinkConfig {
            endpoint: "https://otel.example:4318".parse().unwrap(),
            ca_file: None,
            headers_file: Some(headers.clone()),
            timeout: Duration::from_secs(5),
        };
        let s = OtlpSink::new(&c, "rn-1", "inst-1").unwrap();
        assert_eq!(s.target(), "https://otel.example:4318/v1/logs");
        assert_eq!(s.headers.len(), 2);
        assert!(s.headers[0].1.is_sensitive());
        assert_eq!(s.scrub("denied for Bearer s3cret-value"), "denied for <redacted>");
        // Readable by others: refused, its values never read into an error.
        chmod(0o644);
        let err = OtlpSink::new(&c, "rn-1", "inst-1").err().unwrap();
        assert!(err.contains("mode 644") && !err.contains("s3cret"), "{err}");
        chmod(0o600);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&headers, &link).unwrap();
        let linked = OtlpSinkConfig { headers_file: Some(link), ..c.clone() };
        assert!(OtlpSink::new(&linked, "rn-1", "inst-1").is_err(), "a link is not followed");
        std::fs::write(&headers, "no colon here\n").unwrap();
        let err = OtlpSink::new(&c, "rn-1", "inst-1").err().unwrap();
        assert!(err.contains("line 1") && !err.contains("no colon"), "{err}");
        let c = OtlpSinkConfig { ca_file: Some(dir.path().join("missing.pem")), headers_file: None, ..c };
        assert!(OtlpSink::new(&c, "rn-1", "inst-1").err().unwrap().contains("missing.pem"));
    }
}
