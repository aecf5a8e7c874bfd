//! The customer's own copies of the audit log (`[audit.export]`): every record, every
//! signed checkpoint and every cosignature, in order, to an S3 bucket, a CloudWatch Logs
//! stream and an OTLP collector.
//!
//! Each sink has a cursor in `audit-export/<sink>.json`: how far into `log.jsonl`,
//! `checkpoints.jsonl` and `cosigned.jsonl` it has delivered. A round reads what follows
//! the cursor (records only up to a signed checkpoint, so the copy never holds records
//! no checkpoint covers), hands it to the sink, and moves the cursor (fsynced) only once
//! the sink has stored it. After a crash in between the same lines are sent again:
//! S3 objects and the log events carry their line numbers, so a reader takes each once.
//!
//! A sink never stops jobs: it runs beside them reading files. A failing sink is retried
//! with backoff; the first failure of an outage is audited (`audit_export_failed`) and
//! the recovery too (`audit_export_resumed`), and both show in `status` and `metrics`.

pub mod cloudwatch;
pub mod copy;
pub mod otlp;
pub mod s3;

use std::future::Future;
use std::io::{BufRead as _, Seek as _};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use byoc_audit::log::{CHECKPOINTS, COSIGNED, LOG, Record, StoredCheckpoint, now_ms};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::config::{AuditExportConfig, Config};
use crate::state_dir::StateDir;

/// How long checkpoints signed while nothing happens wait for company before they go
/// (records, and checkpoints with them, go at once).
const IDLE_BATCH_MS: u64 = 5 * 60 * 1000;

/// What one round delivers: lines as they are in the audit directory (no newline).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Batch {
    pub records_from: u64,
    pub records: Vec<String>,
    pub checkpoints_from: u64,
    pub checkpoints: Vec<String>,
    pub cosigned_from: u64,
    pub cosigned: Vec<String>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.records.is_empty() && self.checkpoints.is_empty() && self.cosigned.is_empty()
    }
}

/// The keys a verifier of the copy needs, as the audit directory holds them.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishedKeys {
    /// `runner.pub`: the runner's Ed25519 key, base64, one line.
    pub runner_pub: String,
    /// `control-plane.pub`: the control plane's keys, one a line.
    pub control_plane_pub: String,
    /// `runner.vkey`: the runner's key as a signed-note verifier key.
    pub runner_vkey: String,
}

impl PublishedKeys {
    pub fn read(audit_dir: &Path) -> std::io::Result<PublishedKeys> {
        let runner_pub = std::fs::read_to_string(audit_dir.join(byoc_audit::log::RUNNER_PUB))?;
        let control_plane_pub =
            std::fs::read_to_string(audit_dir.join(byoc_audit::log::CONTROL_PLANE_PUB)).unwrap_or_default();
        let key = byoc_protocol::parse_public_key(runner_pub.trim())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
        let origin = origin_of(audit_dir).unwrap_or_default();
        let runner_vkey = format!("{}\n", byoc_audit::note::verifier_key(&origin, &key));
        Ok(PublishedKeys { runner_pub, control_plane_pub, runner_vkey })
    }
}

/// The log's origin line, from its first checkpoint.
fn origin_of(audit_dir: &Path) -> Option<String> {
    let first = std::fs::File::open(audit_dir.join(CHECKPOINTS)).ok()?;
    let mut line = String::new();
    std::io::BufReader::new(first).read_line(&mut line).ok()?;
    let stored: StoredCheckpoint = serde_json::from_str(&line).ok()?;
    stored.note.lines().next().map(str::to_string)
}

/// Why a sink did not take a batch (retried). Never holds a credential.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct SinkError(pub String);

pub type SinkFuture<'a> = Pin<Box<dyn Future<Output = Result<(), SinkError>> + Send + 'a>>;

/// Where copies go.
pub trait Sink: Send + Sync {
    /// `s3`, `cloudwatch`, `otlp`: the name of its cursor and of its metrics label.
    fn kind(&self) -> &'static str;
    /// Where it writes, for the customer (`s3://bucket/prefix/runner`).
    fn target(&self) -> String;
    /// Store the keys a verifier needs (at every start: control-plane keys accumulate).
    fn put_keys<'a>(&'a self, keys: &'a PublishedKeys) -> SinkFuture<'a>;
    /// Store one batch: records first, then checkpoints, then cosignatures.
    fn put<'a>(&'a self, batch: &'a Batch) -> SinkFuture<'a>;
}

/// A sink's cursor and health, in `audit-export/<kind>.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SinkState {
    pub sink: String,
    pub target: String,
    /// Records delivered (the next record's sequence number).
    pub records: u64,
    pub log_offset: u64,
    pub checkpoints: u64,
    pub checkpoints_offset: u64,
    pub cosigned: u64,
    pub cosigned_offset: u64,
    pub last_success_ms: Option<u64>,
    /// Set while the sink fails: when the outage began.
    pub failing_since_ms: Option<u64>,
    pub last_error: Option<String>,
    pub errors_total: u64,
}

fn state_path(state_dir: &Path, kind: &str) -> PathBuf {
    StateDir::of(state_dir).audit_export().join(format!("{kind}.json"))
}

pub fn load_state(state_dir: &Path, kind: &str) -> Option<SinkState> {
    serde_json::from_slice(&std::fs::read(state_path(state_dir, kind)).ok()?).ok()
}

fn save_state(state_dir: &Path, state: &SinkState) -> std::io::Result<()> {
    let dir = StateDir::of(state_dir).audit_export();
    byoc_statefs::create_dir(&dir, 0o700)?;
    let bytes = serde_json::to_vec_pretty(state).unwrap_or_default();
    crate::state_dir::write(&state_path(state_dir, &state.sink), &bytes, 0o644)
}

/// Every sink's state, for `status` and `metrics` (read with the daemon stopped too).
pub fn states(state_dir: &Path) -> Vec<SinkState> {
    let Ok(entries) = std::fs::read_dir(StateDir::of(state_dir).audit_export()) else { return Vec::new() };
    let mut out: Vec<SinkState> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
        .collect();
    out.sort_by(|a, b| a.sink.cmp(&b.sink));
    out
}

/// Whole lines after `offset`, at most `max`; with the offset after the last one read.
/// A line still being written (no newline yet) is left for the next round.
fn read_lines_from(path: &Path, offset: u64, max: usize) -> std::io::Result<(Vec<String>, u64)> {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), offset)),
        Err(e) => return Err(e),
    };
    f.seek(std::io::SeekFrom::Start(offset))?;
    let mut reader = std::io::BufReader::new(f);
    let (mut lines, mut at) = (Vec::new(), offset);
    while lines.len() < max {
        let mut line = String::new();
        let n = reader.read_line(&mut line)?;
        if n == 0 || !line.ends_with('\n') {
            break;
        }
        at += n as u64;
        line.pop();
        lines.push(line);
    }
    Ok((lines, at))
}

/// The next batch after `state` and the state once it is delivered; `None` when the
/// sink has everything.
pub fn next_batch(
    audit_dir: &Path,
    state: &SinkState,
    max: usize,
) -> std::io::Result<Option<(Batch, SinkState)>> {
    let mut next = state.clone();
    let mut batch = Batch {
        records_from: state.records,
        checkpoints_from: state.checkpoints,
        cosigned_from: state.cosigned,
        ..Default::default()
    };
    // Checkpoints first: they say how many records may go (all they cover, and no more).
    let (candidates, _) = read_lines_from(&audit_dir.join(CHECKPOINTS), state.checkpoints_offset, max)?;
    let mut covered = state.records;
    for line in candidates {
        let size = serde_json::from_str::<StoredCheckpoint>(&line)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{CHECKPOINTS}: {e}")))?
            .size;
        // Stop before a checkpoint that would make the batch too large (one always goes).
        if !batch.checkpoints.is_empty() && size.saturating_sub(state.records) > max as u64 {
            break;
        }
        covered = covered.max(size);
        next.checkpoints_offset += line.len() as u64 + 1;
        batch.checkpoints.push(line);
    }
    next.checkpoints += batch.checkpoints.len() as u64;
    if covered > state.records {
        let want = (covered - state.records) as usize;
        let (records, offset) = read_lines_from(&audit_dir.join(LOG), state.log_offset, want)?;
        if records.len() != want {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{LOG} holds {} records, its checkpoint covers {covered}",
                    state.records + records.len() as u64
                ),
            ));
        }
        batch.records = records;
        next.records = covered;
        next.log_offset = offset;
    }
    // Cosignatures of sizes the copy holds records for, in order.
    let (cosigned, _) = read_lines_from(&audit_dir.join(COSIGNED), state.cosigned_offset, max)?;
    for line in cosigned {
        let size = serde_json::from_str::<StoredCheckpoint>(&line).map(|c| c.size).unwrap_or(u64::MAX);
        if size > next.records {
            break;
        }
        next.cosigned_offset += line.len() as u64 + 1;
        batch.cosigned.push(line);
    }
    next.cosigned += batch.cosigned.len() as u64;
    Ok((!batch.is_empty()).then_some((batch, next)))
}

/// One sink's exporter: its sink, where it keeps its cursor, what it records.
pub struct Exporter {
    pub sink: Box<dyn Sink>,
    pub state_dir: PathBuf,
    pub audit: Arc<crate::audit::Audit>,
    pub batch_records: usize,
    pub retry_max: Duration,
}

impl Exporter {
    fn record(&self, event: &str, detail: String) {
        let mut r = crate::audit_records::note(event, detail);
        r.kind = Some(self.sink.kind().to_string());
        if let Err(e) = self.audit.record(r) {
            tracing::error!(error = %e, sink = self.sink.kind(), "Could not audit {event}: {e}.");
        }
    }

    /// The cursor to start from: the stored one if it is for the same target; a new
    /// target starts the copy from the beginning.
    fn starting_state(&self) -> SinkState {
        let target = self.sink.target();
        match load_state(&self.state_dir, self.sink.kind()) {
            Some(s) if s.target == target => s,
            previous => {
                let detail = match previous {
                    Some(p) => format!("to {target} (was {}: a new copy from the first record)", p.target),
                    None => format!("to {target}"),
                };
                self.record("audit_export_started", detail);
                SinkState { sink: self.sink.kind().into(), target, ..Default::default() }
            }
        }
    }

    fn failed(&self, state: &mut SinkState, error: &str) {
        state.errors_total += 1;
        state.last_error = Some(error.to_string());
        if state.failing_since_ms.is_none() {
            state.failing_since_ms = Some(now_ms());
            tracing::warn!(sink = self.sink.kind(), target = %state.target, error, "Audit export failing; jobs go on, the copy catches up when the sink is back: {error}.");
            self.record("audit_export_failed", error.to_string());
        } else {
            tracing::debug!(sink = self.sink.kind(), error, "Audit export still failing.");
        }
        if let Err(e) = save_state(&self.state_dir, state) {
            tracing::warn!(error = %e, "Could not store the audit export state: {e}.");
        }
    }

    fn succeeded(&self, state: &mut SinkState) -> std::io::Result<()> {
        state.last_success_ms = Some(now_ms());
        if let Some(since) = state.failing_since_ms.take() {
            let secs = now_ms().saturating_sub(since) / 1000;
            tracing::info!(sink = self.sink.kind(), target = %state.target, secs, "Audit export resumed.");
            self.record(
                "audit_export_resumed",
                format!("{} after {secs} s; delivered up to record {}", state.target, state.records),
            );
        }
        state.last_error = None;
        save_state(&self.state_dir, state)
    }

    /// Deliver until `stop`: every round sends what follows the cursor.
    pub async fn run(self, stop: CancellationToken) {
        let audit_dir = self.audit.dir().to_path_buf();
        let mut state = self.starting_state();
        let mut keys_published = false;
        let mut backoff = Duration::from_millis(500);
        loop {
            let changed = self.audit.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let delivered = self.round(&audit_dir, &mut state, &mut keys_published).await;
            let wait = match delivered {
                Ok(true) => {
                    backoff = Duration::from_millis(500);
                    continue;
                }
                Ok(false) => {
                    backoff = Duration::from_millis(500);
                    // Idle checkpoints do not notify: look again now and then.
                    tokio::select! {
                        _ = changed => {}
                        _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                        _ = stop.cancelled() => return,
                    }
                    continue;
                }
                Err(e) => {
                    self.failed(&mut state, &e.0);
                    let wait = backoff;
                    backoff = (backoff * 2).min(self.retry_max);
                    wait
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    /// One round: `Ok(true)` when something was delivered.
    async fn round(
        &self,
        audit_dir: &Path,
        state: &mut SinkState,
        keys_published: &mut bool,
    ) -> Result<bool, SinkError> {
        if !*keys_published {
            let keys = PublishedKeys::read(audit_dir)
                .map_err(|e| SinkError(format!("reading the audit log's keys: {e}")))?;
            self.sink.put_keys(&keys).await?;
            *keys_published = true;
        }
        let next = next_batch(audit_dir, state, self.batch_records)
            .map_err(|e| SinkError(format!("reading the audit log: {e}")))?;
        // Idle checkpoints alone (one a minute) wait to go several at a time.
        let idle_only = next.as_ref().is_some_and(|(b, _)| b.records.is_empty() && b.cosigned.is_empty());
        let recently = state.last_success_ms.is_some_and(|t| now_ms().saturating_sub(t) < IDLE_BATCH_MS);
        let next = if idle_only && recently && state.failing_since_ms.is_none() { None } else { next };
        let Some((batch, next)) = next else {
            if state.failing_since_ms.is_some() || state.last_success_ms.is_none() {
                self.succeeded(state).map_err(|e| SinkError(format!("storing the export cursor: {e}")))?;
            }
            return Ok(false);
        };
        self.sink.put(&batch).await?;
        let (errors_total, failing_since_ms, last_error) =
            (state.errors_total, state.failing_since_ms, state.last_error.take());
        *state = SinkState { errors_total, failing_since_ms, last_error, ..next };
        // Delivered but not recorded as delivered: the next round sends the same lines
        // again, which the copy's layout makes harmless.
        self.succeeded(state).map_err(|e| SinkError(format!("storing the export cursor: {e}")))?;
        Ok(true)
    }
}

/// The sinks the configuration names, built; a sink that cannot be built is a start-up
/// error (the customer asked for a copy: it is not silently dropped).
pub async fn sinks(config: &Config, runner_id: &str) -> Result<Vec<Box<dyn Sink>>, String> {
    let export = &config.audit.export;
    let mut out: Vec<Box<dyn Sink>> = Vec::new();
    let endpoint = |own: &Option<String>| {
        own.clone()
            .or_else(|| config.aws.endpoint_url.clone())
            .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok().filter(|u| !u.is_empty()))
    };
    let needs_aws = export.s3.is_some() || export.cloudwatch.is_some();
    let sink_region = export
        .s3
        .as_ref()
        .and_then(|s| s.region.as_deref())
        .or_else(|| export.cloudwatch.as_ref().and_then(|c| c.region.as_deref()));
    let credentials = if needs_aws { Some(AwsIdentity::for_sink(config, sink_region).await?) } else { None };
    if let (Some(s3), Some(creds)) = (&export.s3, &credentials) {
        let region = s3.region.clone().or_else(|| config.aws.region.clone()).unwrap_or_default();
        out.push(Box::new(s3::S3Sink::new(
            s3,
            &region,
            endpoint(&s3.endpoint_url),
            runner_id,
            creds.clone(),
        )?));
    }
    if let (Some(cw), Some(creds)) = (&export.cloudwatch, &credentials) {
        let region = cw.region.clone().or_else(|| config.aws.region.clone()).unwrap_or_default();
        out.push(Box::new(cloudwatch::CloudWatchSink::new(
            cw,
            &region,
            endpoint(&cw.endpoint_url),
            runner_id,
            creds.clone(),
        )?));
    }
    if let Some(otlp) = &export.otlp {
        out.push(Box::new(otlp::OtlpSink::new(otlp, runner_id, &config.runner.install_id)?));
    }
    Ok(out)
}

/// Cursors of sinks no longer configured: the copy there stops, audited once.
pub fn forget_removed(state_dir: &Path, export: &AuditExportConfig, audit: &crate::audit::Audit) {
    let configured = [
        ("s3", export.s3.is_some()),
        ("cloudwatch", export.cloudwatch.is_some()),
        ("otlp", export.otlp.is_some()),
    ];
    for state in states(state_dir) {
        if configured.iter().any(|(k, on)| *k == state.sink && *on) {
            continue;
        }
        let mut r = crate::audit_records::note(
            "audit_export_stopped",
            format!(
                "{}: removed from the configuration; delivered up to record {}",
                state.target, state.records
            ),
        );
        r.kind = Some(state.sink.clone());
        if let Err(e) = audit.record(r) {
            tracing::error!(error = %e, "Could not audit audit_export_stopped: {e}.");
            continue;
        }
        let _ = std::fs::remove_file(state_path(state_dir, &state.sink));
        tracing::info!(sink = %state.sink, target = %state.target, "Audit export removed from the configuration.");
    }
}

/// The runner's own AWS identity (its instance role), for the sinks' signed calls.
#[derive(Clone)]
pub struct AwsIdentity {
    provider: Option<aws_credential_types::provider::SharedCredentialsProvider>,
}

impl AwsIdentity {
    pub async fn from_config(config: &Config) -> Result<AwsIdentity, String> {
        let sdk = crate::roles::sdk_config(config)
            .await
            .ok_or("aws.region is needed for the runner's own AWS calls")?;
        Ok(AwsIdentity { provider: sdk.credentials_provider() })
    }

    /// The same identity where only a sink names its region (`aws.region` unset): the
    /// credential chain does not depend on the region.
    async fn for_sink(config: &Config, sink_region: Option<&str>) -> Result<AwsIdentity, String> {
        if config.aws.region.is_some() {
            return Self::from_config(config).await;
        }
        let region = sink_region
            .ok_or("aws.region (or the sink's region) is needed for the S3 and CloudWatch Logs sinks")?;
        let sdk = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .region(aws_config::Region::new(region.to_string()))
            .load()
            .await;
        Ok(AwsIdentity { provider: sdk.credentials_provider() })
    }

    /// Keys as of now (the provider refreshes them before they expire).
    pub async fn keys(&self) -> Result<Keys, SinkError> {
        use aws_credential_types::provider::ProvideCredentials as _;
        let provider =
            self.provider.as_ref().ok_or_else(|| SinkError("no AWS credentials provider".into()))?;
        let c = provider.provide_credentials().await.map_err(|e| {
            SinkError(format!("the runner's AWS credentials: {}", crate::roles::aws_error_text(&e).text))
        })?;
        Ok(Keys {
            access_key_id: c.access_key_id().to_string(),
            secret_access_key: c.secret_access_key().to_string(),
            session_token: c.session_token().map(str::to_string),
        })
    }
}

/// Keys of one signed call (never logged).
pub struct Keys {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl Keys {
    pub fn identity(&self) -> byoc_job_executors::aws_sign::Identity<'_> {
        byoc_job_executors::aws_sign::Identity {
            access_key_id: &self.access_key_id,
            secret_access_key: &self.secret_access_key,
            session_token: self.session_token.as_deref(),
        }
    }
}

/// A service's answer in an error: bounded, one line, no control characters.
pub fn answer_text(body: &[u8]) -> String {
    let text: String = String::from_utf8_lossy(body)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(300)
        .collect();
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Fields of a record for sinks that index them (OTLP attributes).
pub fn parse_record(line: &str) -> Option<Record> {
    serde_json::from_str(line).ok()
}

/// Start one task per configured sink; and stop the copies of removed ones.
pub async fn start(
    config: &Config,
    runner_id: &str,
    audit: &Arc<crate::audit::Audit>,
    stop: &CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<()>>, String> {
    let state_dir = config.runner.state_dir.clone();
    forget_removed(&state_dir, &config.audit.export, audit);
    let mut tasks = Vec::new();
    for sink in sinks(config, runner_id).await? {
        tracing::info!(sink = sink.kind(), target = %sink.target(), "Exporting the audit log.");
        let exporter = Exporter {
            sink,
            state_dir: state_dir.clone(),
            audit: audit.clone(),
            batch_records: config.audit.export.batch_records,
            retry_max: config.audit.export.retry_max,
        };
        tasks.push(tokio::spawn(exporter.run(stop.clone())));
    }
    Ok(tasks)
}

/// Whether every sink that is up has delivered all of the log (a short wait at stop).
pub fn caught_up(state_dir: &Path, records: u64) -> bool {
    states(state_dir).iter().all(|s| s.records >= records || s.failing_since_ms.is_some())
}

/// One sink as `status` and `metrics` show it.
#[derive(Debug, Clone, Serialize)]
pub struct ExportStatus {
    pub sink: String,
    pub target: String,
    pub delivered_records: u64,
    /// Records signed into the log that the sink does not hold yet.
    pub lag_records: u64,
    pub last_success_ms: Option<u64>,
    pub failing_since_ms: Option<u64>,
    pub last_error: Option<String>,
    pub errors_total: u64,
}

/// Every sink's delivery against the log's latest checkpoint.
pub fn status(state_dir: &Path) -> Vec<ExportStatus> {
    let signed = latest_checkpoint_size(&StateDir::of(state_dir).audit()).unwrap_or(0);
    states(state_dir)
        .into_iter()
        .map(|s| ExportStatus {
            lag_records: signed.saturating_sub(s.records),
            delivered_records: s.records,
            sink: s.sink,
            target: s.target,
            last_success_ms: s.last_success_ms,
            failing_since_ms: s.failing_since_ms,
            last_error: s.last_error,
            errors_total: s.errors_total,
        })
        .collect()
}

/// The size of the last checkpoint, read from the end of `checkpoints.jsonl` (which
/// grows by a line a minute: not read whole for a status).
pub fn latest_checkpoint_size(audit_dir: &Path) -> Option<u64> {
    use std::io::Read as _;
    let mut f = std::fs::File::open(audit_dir.join(CHECKPOINTS)).ok()?;
    let len = f.metadata().ok()?.len();
    let start = len.saturating_sub(64 << 10);
    f.seek(std::io::SeekFrom::Start(start)).ok()?;
    let mut tail = String::new();
    f.read_to_string(&mut tail).ok()?;
    tail.lines().rev().find_map(|l| serde_json::from_str::<StoredCheckpoint>(l).ok()).map(|c| c.size)
}

#[cfg(test)]
mod tests;
