//! The runner's side of the audit log: every journaled transition and runner event
//! becomes a record (fsynced, checkpointed) before the action proceeds, mirrored to
//! journald with AUDIT_* fields, and acknowledged by the control plane's cosignature.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use byoc_audit::log::{AuditError, AuditWriter, Record};
use byoc_audit::merkle;
use ed25519_dalek::SigningKey;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::client::{ClientError, CpClient};
use crate::journal::Event;

pub const AUDIT_DIR: &str = "audit";
/// Most records sent in one acknowledgement request.
const UPLOAD_BATCH: u64 = 500;

pub struct Audit {
    writer: Mutex<AuditWriter>,
    dir: PathBuf,
    pub changed: Notify,
}

impl Audit {
    pub fn open(
        state_dir: &Path,
        key: SigningKey,
        runner_id: &str,
        install: &str,
        control_plane_keys: &[String],
    ) -> Result<(Audit, u64), AuditError> {
        let dir = state_dir.join(AUDIT_DIR);
        let (writer, opened) = AuditWriter::open(&dir, key, runner_id, install, control_plane_keys)?;
        Ok((Audit { writer: Mutex::new(writer), dir, changed: Notify::new() }, opened.cut_bytes))
    }

    fn lock(&self) -> MutexGuard<'_, AuditWriter> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Append (fsynced, checkpointed) and mirror to journald.
    pub fn record(&self, r: Record) -> Result<u64, AuditError> {
        let seq = self.lock().append(r.clone())?;
        tracing::info!(
            audit_seq = seq,
            audit_event = %r.event,
            job_id = r.job.as_deref().unwrap_or(""),
            kind = r.kind.as_deref().unwrap_or(""),
            role = r.role.as_deref().unwrap_or(""),
            reason = r.reason.as_deref().unwrap_or(""),
            status = r.status.as_deref().unwrap_or(""),
            "audit record"
        );
        self.changed.notify_waiters();
        Ok(seq)
    }

    pub fn checkpoint_if_idle(&self) -> Result<(), AuditError> {
        self.lock().checkpoint_if_idle()
    }

    pub fn size(&self) -> u64 {
        self.lock().size()
    }
}

/// The audit record for a journaled job transition.
pub fn record_for(event: &Event) -> Record {
    let mut r = Record::default();
    match event {
        Event::Received { job_id, kind, operation, payload_sha256, .. } => {
            r.event = "job_received".into();
            r.job = Some(job_id.clone());
            r.kind = Some(kind.clone());
            r.operation = Some(operation.clone());
            r.digests.insert("payload_sha256".into(), payload_sha256.clone());
        }
        Event::Refused { job_id, reason, detail, role, .. } => {
            r.event = "job_rejected".into();
            r.job = Some(job_id.clone());
            r.role = role.clone();
            r.reason = Some(reason.code().into());
            r.detail = Some(detail.chars().take(300).collect());
        }
        Event::Rejected { job_id, reason, detail, .. } => {
            r.event = "job_rejected".into();
            r.job = job_id.clone();
            r.reason = Some(reason.code().into());
            r.detail = Some(detail.chars().take(300).collect());
        }
        Event::Claimed { job_id, .. } => {
            r.event = "job_claimed".into();
            r.job = Some(job_id.clone());
        }
        Event::ClaimRefused { job_id, detail } => {
            r.event = "job_claim_refused".into();
            r.job = Some(job_id.clone());
            r.detail = Some(detail.chars().take(300).collect());
        }
        Event::Started { job_id, network, .. } => {
            r.event = "job_started".into();
            r.job = Some(job_id.clone());
            r.detail = network.clone();
        }
        Event::Finished { job_id, status, exit_code, log_size, log_sha256, .. } => {
            r.event = match status {
                byoc_protocol::JobStatus::Cancelled => "job_cancelled",
                byoc_protocol::JobStatus::Interrupted => "job_interrupted",
                _ => "job_finished",
            }
            .into();
            r.job = Some(job_id.clone());
            r.status = Some(status.as_str().into());
            r.exit_code = *exit_code;
            r.digests.insert("log_sha256".into(), log_sha256.clone());
            r.detail = Some(format!("log {log_size} bytes"));
        }
        Event::Reported { job_id } => {
            r.event = "job_reported".into();
            r.job = Some(job_id.clone());
        }
    }
    r
}

/// Send records the control plane has not acknowledged, with a consistency proof from
/// the last acknowledged checkpoint; store its cosignature. Resumes after outages from
/// the acknowledged size, so nothing is sent twice as a different record.
pub async fn upload_loop(rt: crate::pipeline::Rt) {
    let (audit, client, stop): (&Audit, &CpClient, &CancellationToken) =
        (&rt.audit, &rt.client, &rt.stop_reporting);
    let mut acked = byoc_audit::log::acknowledged_size(audit.dir());
    let mut backoff = crate::pipeline::Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
    loop {
        let changed = audit.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if audit.size() > acked {
            match upload_once(audit, client, acked).await {
                Ok(size) => {
                    acked = size;
                    backoff.reset();
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, acknowledged = acked, "audit upload failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff.next_delay()) => continue,
                        _ = stop.cancelled() => return,
                    }
                }
            }
        }
        tokio::select! {
            _ = changed => {}
            _ = tokio::time::sleep(Duration::from_secs(30)) => {}
            _ = stop.cancelled() => return,
        }
    }
}

async fn upload_once(audit: &Audit, client: &CpClient, acked: u64) -> Result<u64, String> {
    let (to, records, note, proof) = {
        let w = audit.lock();
        let to = w.size().min(acked + UPLOAD_BATCH);
        let records = w.read_lines(acked, to).map_err(|e| e.to_string())?;
        let note = w.sign_at(to);
        let proof = merkle::consistency_proof(&w.leaves()[..to as usize], acked as usize);
        (to, records, note, proof)
    };
    use base64::Engine as _;
    let req = byoc_protocol::AuditUploadRequest {
        from: acked,
        records,
        checkpoint: note,
        proof: proof.iter().map(|h| base64::engine::general_purpose::STANDARD.encode(h)).collect(),
    };
    let resp = client.audit(&req).await.map_err(|e: ClientError| e.to_string())?;
    audit.lock().store_cosigned(to, &resp.cosigned).map_err(|e| e.to_string())?;
    tracing::debug!(size = to, "audit checkpoint acknowledged by the control plane");
    Ok(to)
}

// ---- offline CLI support ------------------------------------------------------------

/// Keys to verify with: `--trust FILE` (lines `runner <base64>` and
/// `control-plane <base64>`), else the keys stored beside the log (trust on first use).
pub fn load_trust(
    dir: &Path,
    trust_file: Option<&Path>,
) -> Result<(byoc_audit::verify::Trust, bool), String> {
    let parse =
        |s: &str| byoc_protocol::parse_public_key(s.trim()).map_err(|e| format!("bad key {s:?}: {e}"));
    match trust_file {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
            let mut runner = None;
            let mut cps = Vec::new();
            for line in text.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')) {
                match line.split_once(' ') {
                    Some(("runner", k)) => runner = Some(parse(k)?),
                    Some(("control-plane", k)) => cps.push(parse(k)?),
                    _ => return Err(format!("{}: unexpected line {line:?}", path.display())),
                }
            }
            let runner = runner.ok_or_else(|| format!("{}: no `runner <key>` line", path.display()))?;
            Ok((byoc_audit::verify::Trust { runner, control_plane: cps }, true))
        }
        None => {
            let read = |f: &str| {
                std::fs::read_to_string(dir.join(f))
                    .map_err(|e| format!("reading {}: {e}", dir.join(f).display()))
            };
            let runner = parse(&read(byoc_audit::log::RUNNER_PUB)?)?;
            let cps = read(byoc_audit::log::CONTROL_PLANE_PUB)?
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(parse)
                .collect::<Result<Vec<_>, _>>()?;
            Ok((byoc_audit::verify::Trust { runner, control_plane: cps }, false))
        }
    }
}

/// Inclusion proof for record `seq` against the latest checkpoint, as JSON a third
/// party can check with any RFC 6962 implementation.
pub fn prove(dir: &Path, seq: u64) -> Result<serde_json::Value, String> {
    let lines = byoc_audit::log::read_lines(dir, 0, u64::MAX).map_err(|e| e.to_string())?;
    let leaves: Vec<merkle::Hash> = lines.iter().map(|l| merkle::leaf_hash(l.as_bytes())).collect();
    let checkpoints = byoc_audit::log::read_checkpoints(&dir.join(byoc_audit::log::CHECKPOINTS));
    let latest = checkpoints
        .iter()
        .filter(|c| c.size > seq && c.size as usize <= leaves.len())
        .max_by_key(|c| c.size)
        .ok_or_else(|| format!("no checkpoint covers record {seq}"))?;
    let size = latest.size as usize;
    let proof = merkle::inclusion_proof(&leaves[..size], seq as usize);
    Ok(serde_json::json!({
        "seq": seq,
        "record": lines[seq as usize],
        "leaf_hash": hex::encode(leaves[seq as usize]),
        "tree_size": size,
        "root": hex::encode(merkle::root(&leaves[..size])),
        "proof": proof.iter().map(hex::encode).collect::<Vec<_>>(),
        "checkpoint": latest.note,
    }))
}
