//! The runner's side of the audit log: every journaled transition and runner event
//! becomes a record (fsynced, checkpointed) before the action proceeds, mirrored to
//! journald with AUDIT_* fields, and acknowledged by the control plane's cosignature.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use byoc_audit::log::{AuditError, AuditWriter, Record};
use byoc_audit::merkle;
use ed25519_dalek::SigningKey;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::control_plane::retry::{Policy, Retried, retry};
use crate::control_plane::{ClientError, ControlPlane};
use crate::journal::Event;
use crate::state_dir::StateDir;

/// Most records sent in one acknowledgement request.
const UPLOAD_BATCH: u64 = 500;

pub struct Audit {
    writer: Mutex<AuditWriter>,
    dir: PathBuf,
    pub changed: Notify,
    reserve: Option<crate::disk::Reserve>,
}

impl Audit {
    pub fn open(
        state_dir: &Path,
        key: SigningKey,
        runner_id: &str,
        install: &str,
        control_plane_keys: &[String],
    ) -> Result<(Audit, u64), AuditError> {
        let dir = StateDir::of(state_dir).audit();
        let (writer, opened) = AuditWriter::open(&dir, key, runner_id, install, control_plane_keys)?;
        Ok((
            Audit { writer: Mutex::new(writer), dir, changed: Notify::new(), reserve: None },
            opened.cut_bytes,
        ))
    }

    /// Give the disk reserve back before a record that would find the disk full.
    pub fn with_reserve(mut self, reserve: crate::disk::Reserve) -> Self {
        self.reserve = Some(reserve);
        self
    }

    fn lock(&self) -> MutexGuard<'_, AuditWriter> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Append (fsynced, checkpointed) and mirror to journald.
    pub fn record(&self, r: Record) -> Result<u64, AuditError> {
        if let Some(reserve) = &self.reserve {
            reserve.make_room_for_evidence();
        }
        let seq = self.lock().append(r.clone())?;
        crate::logging::audit_entry(seq, &r);
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

/// Where a job's stages write audit records: the signed log, or a fake in tests.
pub trait AuditSink: Send + Sync {
    /// Append one record durably (fsynced, checkpointed); its sequence number.
    fn record(&self, r: Record) -> Result<u64, AuditError>;
}

impl AuditSink for Audit {
    fn record(&self, r: Record) -> Result<u64, AuditError> {
        Audit::record(self, r)
    }
}

/// The audit log's events and what each records, for the journal catalog
/// (`byoc-runner journal-catalog`; docs/OPERATIONS.md). An event missing here still
/// has its `MESSAGE_ID`, only no catalog entry.
pub const EVENTS: &[(&str, &str)] = &[
    ("runner_started", "The runner started: its version, configuration digest and pinned keys."),
    ("runner_stopped", "The runner stopped (drained, or told to stop)."),
    ("config_loaded", "The runner read its configuration; the record holds its digest."),
    ("key_created", "The runner created its identity key (first start)."),
    ("runner_paused", "A local admin paused the runner: new jobs are refused (paused) until resumed."),
    ("runner_resumed", "A local admin resumed the runner."),
    (
        "job_received",
        "A signed job was verified and accepted; its nonce is spent. Kind, operation, the effect the runner derived and the payload digest are recorded.",
    ),
    (
        "job_rejected",
        "A job was refused, with its reason code: a bad envelope, a role switched off, a window or rule, a policy that could not be read. Nothing of it ran.",
    ),
    ("job_claimed", "The control plane leased the job to this runner."),
    (
        "job_claim_refused",
        "The control plane refused the claim (cancelled or given to another attempt); the job did not run.",
    ),
    ("job_started", "The job's process started in its sandbox."),
    ("job_finished", "The job ended: status, exit code and the digest of its log."),
    ("job_cancelled", "The job was cancelled by the control plane, a window closing or a stop."),
    ("job_interrupted", "The job was cut short by a restart of the runner; it is reported, not run again."),
    ("job_reported", "The control plane acknowledged the job's result."),
    (
        "job_fenced",
        "The control plane gave the job's lease to another runner of the install (this one stopped answering): the job was stopped here and its result is not reported.",
    ),
    (
        "policy_decision",
        "Policies decided a plan or manifests: the verdict, the counts, the digests of what was judged and of every policy.",
    ),
    ("approval_requested", "A job waits for a local admin's approval under the customer's rule."),
    ("approved", "A local admin approved a held job (who, uid and why)."),
    ("denied", "A local admin denied a held job (who, uid and why); it will not run."),
    ("window_wait", "A job waits for the customer's maintenance window."),
    ("role_resolved", "The role a job asked for was matched against the customer's switches."),
    (
        "role_assumed",
        "The runner assumed a lifecycle role for a job (session name, duration, narrowed or not).",
    ),
    ("role_assume_failed", "Assuming a lifecycle role failed; the job did not run with it."),
    ("role_session_opened", "An allowed plan's job was given the role's full session."),
    ("role_session_refreshed", "A running job's role session was renewed."),
    ("allowance_granted", "A local admin allowed a role that needs a local allowance, for a while."),
    ("allowance_revoked", "A local admin revoked a role's allowance."),
    ("allowance_seen", "The runner found an allowance written by hand and honours it as audited."),
    ("allowance_expired", "A role's allowance ran out."),
    (
        "update_started",
        "A signed runner release was verified with the pinned release key and staged for the updater (both versions, the package's digest).",
    ),
    (
        "update_applied",
        "The updater installed a release and the new version came up healthy (both versions and digests).",
    ),
    (
        "update_rolled_back",
        "A release did not come up healthy (or the customer rolled back): the kept package runs again; the reason is recorded.",
    ),
    (
        "update_refused",
        "The updater refused a staged release (its own checks, or the customer's terms); nothing was installed.",
    ),
    (
        "update_pin_changed",
        "A local admin pinned or unpinned the runner's version (`byoc-runner update pin`).",
    ),
    ("artifact_synced", "An OCI artifact was copied into the install's registry, by digest."),
    ("artifact_sync_failed", "Copying an OCI artifact failed; nothing was tagged."),
    ("secret_read", "A job read one of the customer's secrets (its name and version, never its value)."),
    ("state_read", "Terraform state was read by a local admin through the CLI."),
    ("state_unlock_requested", "A local admin asked to remove a stale terraform state lock."),
    ("state_unlocked", "A stale terraform state lock was removed."),
    ("state_unlock_failed", "Removing a terraform state lock failed."),
    ("drift_requested", "A drift check was asked for."),
    ("drift_check_started", "The runner started one of its own drift checks."),
    ("drift_checked", "A drift check ended with its verdict."),
    ("drift_skipped", "A scheduled drift check was skipped (a job of the workspace was running)."),
    ("cluster_policies_applied", "The customer's cluster policies were applied into the cluster."),
    ("cluster_policies_removed", "The customer's cluster policies were removed from the cluster."),
    ("plans_removed", "Saved plans that could no longer be applied were removed."),
    ("logs_removed", "Job logs past their retention were removed (their digests stay in the audit log)."),
    ("journal_compacted", "The runner's job journal was compacted."),
    ("journal_archives_removed", "Job journal archives past their retention were removed."),
    (
        "audit_export_started",
        "A copy of the audit log began to a sink of the customer's (S3, CloudWatch Logs, OTLP): from the first record, also when its target changed.",
    ),
    (
        "audit_export_failed",
        "A sink stopped taking the copy (its error); jobs go on, the copy catches up when it is back. Once per outage.",
    ),
    (
        "audit_export_resumed",
        "A failing sink took the copy again: how long it was out, how far it now holds.",
    ),
    (
        "audit_export_stopped",
        "A sink was removed from the configuration: the copy there stops at the record named.",
    ),
    (
        "lifecycle_notice",
        "The metadata service announced the instance's end (a Spot interruption or an Auto Scaling termination): the runner takes no new job and hands over what cannot finish.",
    ),
    (
        "runner_retired",
        "Drained before its instance's termination, the runner left the install: the control plane refuses it from now on and a replacement takes its place.",
    ),
    ("lifecycle_action_completed", "Drained: the runner told Auto Scaling the instance may terminate."),
    (
        "lifecycle_action_failed",
        "Completing the Auto Scaling lifecycle action failed (the hook's timeout ends it).",
    ),
    (
        "customer_record_invalid",
        "A record a local admin left for the audit log could not be read; it was set aside.",
    ),
];

/// The audit record for a journaled job transition.
pub fn record_for(event: &Event) -> Record {
    let mut r = Record::default();
    match event {
        Event::Received { job_id, kind, operation, entity, payload_sha256, effect, component, .. } => {
            r.event = "job_received".into();
            r.job = Some(job_id.clone());
            r.kind = Some(kind.clone());
            r.operation = Some(operation.clone());
            r.entity = Some(entity.clone()).filter(|e| !e.is_empty());
            r.digests.insert("payload_sha256".into(), payload_sha256.clone());
            let said: Vec<String> = [("effect", effect), ("component", component)]
                .into_iter()
                .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k} {v}")))
                .collect();
            if !said.is_empty() {
                r.detail = Some(said.join(", "));
            }
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
        Event::Claimed { job_id, epoch, .. } => {
            r.event = "job_claimed".into();
            r.job = Some(job_id.clone());
            if *epoch > 0 {
                r.detail = Some(format!("lease epoch {epoch}"));
            }
        }
        Event::Fenced { job_id, detail } => {
            r.event = "job_fenced".into();
            r.job = Some(job_id.clone());
            r.detail = Some(detail.chars().take(300).collect());
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
        Event::Finished { job_id, status, exit_code, log_size, log_sha256, log_omitted, .. } => {
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
            r.detail = Some(match log_omitted {
                0 => format!("log {log_size} bytes"),
                n => format!("log {log_size} bytes kept, {n} bytes omitted (log cap)"),
            });
        }
        Event::Waiting { job_id, state, until, detail } => {
            r.event = if state == "awaiting_approval" { "approval_requested" } else { "window_wait" }.into();
            r.job = Some(job_id.clone());
            r.status = Some(state.clone());
            r.detail = Some(match until {
                Some(t) => format!("{detail}; until {}", crate::clock::rfc3339(*t)),
                None => detail.clone(),
            });
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
pub async fn upload_loop(audit: Arc<Audit>, client: Arc<dyn ControlPlane>, stop: CancellationToken) {
    let (audit, client) = (audit.as_ref(), client.as_ref());
    let mut acked = byoc_audit::log::acknowledged_size(audit.dir());
    let policy = Policy::new(Duration::from_millis(500), Duration::from_secs(30));
    loop {
        let changed = audit.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if audit.size() > acked {
            let uploaded = retry(policy, &stop, |_| async {
                upload_once(audit, client, acked).await.inspect_err(
                    |e| tracing::warn!(error = %e, acknowledged = acked, "Audit upload failed; retrying: {e}."),
                )
            })
            .await;
            match uploaded {
                Retried::Done(size) => {
                    acked = size;
                    continue;
                }
                Retried::Stopped | Retried::Exhausted(_) => return,
            }
        }
        tokio::select! {
            _ = changed => {}
            _ = tokio::time::sleep(Duration::from_secs(30)) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// Why one acknowledgement round failed (the loop retries it).
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("reading records to upload: {0}")]
    Read(AuditError),
    #[error(transparent)]
    ControlPlane(#[from] ClientError),
    #[error("storing the control plane's cosignature: {0}")]
    StoreCosigned(AuditError),
    #[error("the audit writer holds no tree from {from} to {to} (below what was acknowledged)")]
    Forgotten { from: u64, to: u64 },
}

async fn upload_once(audit: &Audit, client: &dyn ControlPlane, acked: u64) -> Result<u64, UploadError> {
    let (to, records, note, proof) = {
        let w = audit.lock();
        let to = w.size().min(acked + UPLOAD_BATCH);
        let records = w.read_lines(acked, to).map_err(UploadError::Read)?;
        let forgotten = || UploadError::Forgotten { from: acked, to };
        let note = w.sign_at(to).ok_or_else(forgotten)?;
        let proof = w.consistency_proof(acked, to).ok_or_else(forgotten)?;
        (to, records, note, proof)
    };
    use base64::Engine as _;
    let req = byoc_protocol::AuditUploadRequest {
        from: acked,
        records,
        checkpoint: note,
        proof: proof.iter().map(|h| base64::engine::general_purpose::STANDARD.encode(h)).collect(),
    };
    let resp = client.audit(&req).await?;
    audit.lock().store_cosigned(to, &resp.cosigned).map_err(UploadError::StoreCosigned)?;
    tracing::debug!(size = to, "Audit checkpoint acknowledged by the control plane.");
    Ok(to)
}

// ---- offline CLI support ------------------------------------------------------------

/// Why the keys to verify with could not be had.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: bad key {key:?}: {source}")]
    BadKey { path: PathBuf, key: String, source: byoc_protocol::ProtocolError },
    #[error("{path}: unexpected line {line:?} (expected `runner <base64>` or `control-plane <base64>`)")]
    UnexpectedLine { path: PathBuf, line: String },
    #[error("{path}: no `runner <key>` line")]
    NoRunnerKey { path: PathBuf },
}

/// Keys to verify with: `--trust FILE` (lines `runner <base64>` and
/// `control-plane <base64>`), else the keys stored beside the log (trust on first use).
pub fn load_trust(
    dir: &Path,
    trust_file: Option<&Path>,
) -> Result<(byoc_audit::verify::Trust, bool), TrustError> {
    let read = |path: PathBuf| {
        std::fs::read_to_string(&path)
            .map(|text| (text, path.clone()))
            .map_err(|source| TrustError::Read { path, source })
    };
    let parse = |path: &Path, key: &str| {
        byoc_protocol::parse_public_key(key.trim()).map_err(|source| TrustError::BadKey {
            path: path.to_path_buf(),
            key: key.trim().to_string(),
            source,
        })
    };
    match trust_file {
        Some(path) => {
            let (text, path) = read(path.to_path_buf())?;
            let mut runner = None;
            let mut cps = Vec::new();
            for line in text.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')) {
                match line.split_once(' ') {
                    Some(("runner", k)) => runner = Some(parse(&path, k)?),
                    Some(("control-plane", k)) => cps.push(parse(&path, k)?),
                    _ => return Err(TrustError::UnexpectedLine { path, line: line.to_string() }),
                }
            }
            let runner = runner.ok_or(TrustError::NoRunnerKey { path })?;
            Ok((byoc_audit::verify::Trust { runner, control_plane: cps }, true))
        }
        None => {
            let (runner, runner_path) = read(dir.join(byoc_audit::log::RUNNER_PUB))?;
            let runner = parse(&runner_path, &runner)?;
            let (cps, cps_path) = read(dir.join(byoc_audit::log::CONTROL_PLANE_PUB))?;
            let cps = cps
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|k| parse(&cps_path, k))
                .collect::<Result<Vec<_>, _>>()?;
            Ok((byoc_audit::verify::Trust { runner, control_plane: cps }, false))
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProveError {
    #[error(transparent)]
    Read(#[from] AuditError),
    #[error("no checkpoint covers record {seq} (the log has {records} records)")]
    NotCovered { seq: u64, records: usize },
}

/// Inclusion proof for record `seq` against the latest checkpoint, as JSON a third
/// party can check with any RFC 6962 implementation.
pub fn prove(dir: &Path, seq: u64) -> Result<serde_json::Value, ProveError> {
    let lines = byoc_audit::log::read_lines(dir, 0, u64::MAX)?;
    let leaves: Vec<merkle::Hash> = lines.iter().map(|l| merkle::leaf_hash(l.as_bytes())).collect();
    let checkpoints = byoc_audit::log::read_checkpoints(&dir.join(byoc_audit::log::CHECKPOINTS));
    let latest = checkpoints
        .iter()
        .filter(|c| c.size > seq && c.size as usize <= leaves.len())
        .max_by_key(|c| c.size)
        .ok_or(ProveError::NotCovered { seq, records: leaves.len() })?;
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
