//! The CloudWatch Logs sink: one log stream per runner in the customer's log group,
//! one event per record (its exact line) and per checkpoint or cosignature
//! (`{"stream":"checkpoints","index":N,"line":"…"}`), in order, with signed PutLogEvents
//! calls under the runner's own identity.
//!
//! An event's timestamp is its record's time, kept non-decreasing within a call (the
//! service requires it) and within the window the service accepts (at most 14 days old,
//! 2 hours ahead), so a copy that catches up after a long outage is not refused. A
//! batch is split to the service's limits (10,000 events, 1 MiB, 24 hours a call); one
//! sent again after a failure part-way repeats events, which carry their line numbers.

use std::time::{Duration, SystemTime};

use super::{AwsIdentity, Batch, PublishedKeys, Sink, SinkError, SinkFuture, answer_text};
use crate::config::CloudWatchSinkConfig;

const MAX_EVENTS: usize = 10_000;
const MAX_BYTES: usize = 1_048_576;
/// Bytes the service counts per event besides its message.
const EVENT_OVERHEAD: usize = 26;
const MAX_EVENT: usize = 262_144 - EVENT_OVERHEAD;
const DAY_MS: u64 = 24 * 3600 * 1000;

pub struct CloudWatchSink {
    http: reqwest::Client,
    url: String,
    region: String,
    log_group: String,
    log_stream: String,
    identity: AwsIdentity,
    stream_ready: tokio::sync::Mutex<bool>,
}

/// One log event.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Event {
    pub timestamp: u64,
    pub message: String,
}

impl CloudWatchSink {
    pub fn new(
        c: &CloudWatchSinkConfig,
        region: &str,
        endpoint: Option<String>,
        runner_id: &str,
        identity: AwsIdentity,
    ) -> Result<CloudWatchSink, String> {
        let url = match endpoint {
            Some(e) => format!("{}/", e.trim_end_matches('/')),
            None => format!("https://logs.{region}.amazonaws.com/"),
        };
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("HTTP client for the CloudWatch Logs sink: {e}"))?;
        Ok(CloudWatchSink {
            http,
            url,
            region: region.to_string(),
            log_group: c.log_group.clone(),
            log_stream: c.log_stream.clone().unwrap_or_else(|| runner_id.to_string()),
            identity,
            stream_ready: tokio::sync::Mutex::new(false),
        })
    }

    /// One call; the error type (`ResourceNotFoundException`) and message on failure.
    async fn call(
        &self,
        action: &str,
        body: &serde_json::Value,
    ) -> Result<Result<Vec<u8>, (String, String)>, SinkError> {
        let body = serde_json::to_vec(body).map_err(|e| SinkError(e.to_string()))?;
        let keys = self.identity.keys().await?;
        let target = format!("Logs_20140328.{action}");
        let signed = byoc_job_executors::aws_sign::signed_headers(
            &keys.identity(),
            &byoc_job_executors::aws_sign::Request {
                region: &self.region,
                service: "logs",
                method: "POST",
                url: &self.url,
                headers: &[("content-type", "application/x-amz-json-1.1"), ("x-amz-target", &target)],
                body: &body,
                payload_hash_header: false,
                time: SystemTime::now(),
            },
        )
        .map_err(SinkError)?;
        let mut req = self.http.post(&self.url).body(body);
        for (k, v) in signed {
            req = req.header(k, v);
        }
        let what = |e: String| SinkError(format!("{} {action}: {e}", self.target()));
        let resp = req.send().await.map_err(|e| what(byoc_oci_sync::client::error_chain(&e)))?;
        let status = resp.status().as_u16();
        let answer = resp.bytes().await.map_err(|e| what(byoc_oci_sync::client::error_chain(&e)))?.to_vec();
        if (200..300).contains(&status) {
            return Ok(Ok(answer));
        }
        #[derive(serde::Deserialize, Default)]
        struct Fault {
            #[serde(rename = "__type", default)]
            kind: String,
            #[serde(default, alias = "Message")]
            message: String,
        }
        let f: Fault = serde_json::from_slice(&answer).unwrap_or_default();
        let kind = f.kind.rsplit('#').next().unwrap_or_default().to_string();
        let message = if kind.is_empty() && f.message.is_empty() {
            format!("HTTP {status} {}", answer_text(&answer))
        } else {
            answer_text(format!("HTTP {status} {kind}: {}", f.message).as_bytes())
        };
        Ok(Err((kind, message)))
    }

    async fn ensure_stream(&self) -> Result<(), SinkError> {
        let mut ready = self.stream_ready.lock().await;
        if *ready {
            return Ok(());
        }
        let body = serde_json::json!({ "logGroupName": self.log_group, "logStreamName": self.log_stream });
        match self.call("CreateLogStream", &body).await? {
            Ok(_) => {}
            Err((kind, _)) if kind == "ResourceAlreadyExistsException" => {}
            Err((kind, _)) if kind == "ResourceNotFoundException" => {
                return Err(SinkError(format!(
                    "{}: the log group does not exist (the install stack creates it; check audit.export.cloudwatch.log_group)",
                    self.target()
                )));
            }
            Err((_, message)) => {
                return Err(SinkError(format!("{} CreateLogStream: {message}", self.target())));
            }
        }
        *ready = true;
        Ok(())
    }

    async fn put_events(&self, events: &[Event]) -> Result<(), SinkError> {
        for chunk in chunks(events) {
            self.ensure_stream().await?;
            let body = serde_json::json!({
                "logGroupName": self.log_group,
                "logStreamName": self.log_stream,
                "logEvents": chunk,
            });
            match self.call("PutLogEvents", &body).await? {
                Ok(answer) => {
                    let v: serde_json::Value = serde_json::from_slice(&answer).unwrap_or_default();
                    if let Some(rejected) = v.get("rejectedLogEventsInfo").filter(|r| !r.is_null()) {
                        return Err(SinkError(format!("{} refused events: {rejected}", self.target())));
                    }
                }
                Err((kind, message)) => {
                    if kind == "ResourceNotFoundException" {
                        // The stream was deleted: made again on the retry.
                        *self.stream_ready.lock().await = false;
                    }
                    return Err(SinkError(format!("{} PutLogEvents: {message}", self.target())));
                }
            }
        }
        Ok(())
    }
}

/// The events of a batch, in order, with timestamps the service accepts.
pub fn events(batch: &Batch, now_ms: u64) -> Vec<Event> {
    let oldest = now_ms.saturating_sub(14 * DAY_MS - 3600 * 1000);
    let newest = now_ms + 3600 * 1000;
    let mut last = oldest;
    let mut out = Vec::new();
    let mut push = |time: Option<u64>, message: String| {
        let t = time.unwrap_or(last).clamp(last, newest);
        last = t;
        out.push(Event { timestamp: t, message });
    };
    for (i, line) in batch.records.iter().enumerate() {
        let time = super::parse_record(line).map(|r| r.time_ms);
        if line.len() <= MAX_EVENT {
            push(time, line.clone());
            continue;
        }
        // A record larger than an event may be goes in parts, in order: the copy stays
        // whole (join the `text` of the parts of one `seq`).
        let seq = batch.records_from + i as u64;
        let pieces = split_at_chars(line, MAX_EVENT / 2);
        let parts = pieces.len();
        for (part, text) in pieces.into_iter().enumerate() {
            let message =
                serde_json::json!({ "stream": "records", "seq": seq, "part": part, "parts": parts, "text": text })
                    .to_string();
            push(time, message);
        }
    }
    for (stream, from, lines) in [
        ("checkpoints", batch.checkpoints_from, &batch.checkpoints),
        ("cosigned", batch.cosigned_from, &batch.cosigned),
    ] {
        for (i, line) in lines.iter().enumerate() {
            let message =
                serde_json::json!({ "stream": stream, "index": from + i as u64, "line": line }).to_string();
            push(None, message);
        }
    }
    out
}

/// `text` in pieces of at most `max` bytes, cut between characters. (JSON escaping can
/// at most double a piece's length, so half an event's size is the piece size.)
fn split_at_chars(text: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut end = rest.len().min(max);
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        out.push(&rest[..end]);
        rest = &rest[end..];
    }
    out
}

/// Calls within the service's limits: events, bytes, and a 24-hour span.
fn chunks(events: &[Event]) -> Vec<&[Event]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, e) in events.iter().enumerate() {
        let size = e.message.len() + EVENT_OVERHEAD;
        let full = i - start >= MAX_EVENTS
            || bytes + size > MAX_BYTES
            || e.timestamp.saturating_sub(events[start].timestamp) >= DAY_MS;
        if i > start && full {
            out.push(&events[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < events.len() {
        out.push(&events[start..]);
    }
    out
}

impl Sink for CloudWatchSink {
    fn kind(&self) -> &'static str {
        "cloudwatch"
    }

    fn target(&self) -> String {
        format!("cloudwatch:{}/{}", self.log_group, self.log_stream)
    }

    fn put_keys<'a>(&'a self, keys: &'a PublishedKeys) -> SinkFuture<'a> {
        Box::pin(async move {
            let message = serde_json::json!({
                "stream": "keys",
                "runner.pub": keys.runner_pub.trim(),
                "runner.vkey": keys.runner_vkey.trim(),
                "control-plane.pub": keys.control_plane_pub.lines().collect::<Vec<_>>(),
            })
            .to_string();
            self.put_events(&[Event { timestamp: byoc_audit::log::now_ms(), message }]).await
        })
    }

    fn put<'a>(&'a self, batch: &'a Batch) -> SinkFuture<'a> {
        Box::pin(async move { self.put_events(&events(batch, byoc_audit::log::now_ms())).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_keep_order_and_stay_in_the_window_the_service_accepts() {
        let now = 1_800_000_000_000;
        let batch = Batch {
            records_from: 7,
            records: vec![
                format!(r#"{{"seq":7,"time_ms":{},"install":"i","event":"a"}}"#, now - 20 * DAY_MS),
                format!(r#"{{"seq":8,"time_ms":{},"install":"i","event":"b"}}"#, now - 1000),
                // A clock that stepped back: kept in order.
                format!(r#"{{"seq":9,"time_ms":{},"install":"i","event":"c"}}"#, now - 5000),
            ],
            checkpoints_from: 3,
            checkpoints: vec![r#"{"size":10,"note":"n"}"#.into()],
            ..Default::default()
        };
        let e = events(&batch, now);
        assert_eq!(e.len(), 4);
        assert!(e.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        assert!(e[0].timestamp >= now - 14 * DAY_MS);
        assert_eq!(e[1].timestamp, now - 1000);
        assert_eq!(e[0].message, batch.records[0]);
        let cp: serde_json::Value = serde_json::from_str(&e[3].message).unwrap();
        assert_eq!((cp["stream"].as_str(), cp["index"].as_u64()), (Some("checkpoints"), Some(3)));
        assert_eq!(cp["line"].as_str(), Some(batch.checkpoints[0].as_str()));

        // A record larger than an event: in parts that fit and join back.
        let line = format!(r#"{{"seq":5,"time_ms":{now},"detail":"{}"}}"#, "é\\\"".repeat(MAX_EVENT / 2));
        let huge = Batch { records_from: 5, records: vec![line.clone()], ..Default::default() };
        let e = events(&huge, now);
        assert!(e.len() > 1 && e.iter().all(|e| e.message.len() <= MAX_EVENT), "{}", e.len());
        let joined: String = e
            .iter()
            .map(|e| serde_json::from_str::<serde_json::Value>(&e.message).unwrap())
            .inspect(|v| assert_eq!(v["seq"], 5))
            .map(|v| v["text"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(joined, line);
    }

    #[test]
    fn calls_are_split_to_the_service_limits() {
        let t = 1_800_000_000_000;
        let small: Vec<Event> =
            (0..25_000).map(|i| Event { timestamp: t, message: format!("{i}") }).collect();
        assert_eq!(chunks(&small).iter().map(|c| c.len()).collect::<Vec<_>>(), [10_000, 10_000, 5_000]);
        let big: Vec<Event> = (0..10).map(|_| Event { timestamp: t, message: "x".repeat(200_000) }).collect();
        let c = chunks(&big);
        assert!(
            c.iter().all(|c| c.iter().map(|e| e.message.len() + EVENT_OVERHEAD).sum::<usize>() <= MAX_BYTES)
        );
        assert_eq!(c.iter().map(|c| c.len()).sum::<usize>(), 10);
        let spread = [
            Event { timestamp: t, message: "a".into() },
            Event { timestamp: t + DAY_MS, message: "b".into() },
        ];
        assert_eq!(chunks(&spread).len(), 2);
        assert!(chunks(&[]).is_empty());
    }
}
