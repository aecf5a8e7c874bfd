//! The durable job journal: one append-only JSON-lines file in the state dir.
//!
//! Every job transition is appended and fsynced *before* the runner acts on it, so after
//! a crash or `kill -9` the journal says exactly how far each job got: a job that was
//! started but has no `finished` line was interrupted and is reported as such, never
//! silently re-run; a finished job without `reported` has its result sent again
//! (results are idempotent on the control plane).
//!
//! A torn last line (the crash hit mid-write) is cut off on open; damage anywhere else
//! is refused, because the journal is evidence and guessing would hide it.
//!
//! Bounded for years of uptime: settled jobs (reported, or refused and never run) past
//! the newest `jobs.journal_keep` move, lines unchanged, into a gzip file under
//! `journal-archive/` once their nonces have expired (a spent nonce must stay known
//! until then). The archive is written and fsynced before the journal is replaced
//! (write, fsync, rename, fsync the directory), so a crash between the two leaves a
//! job in both, which readers merge. `jobs list --all` and `jobs show` read archives.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufRead as _, BufReader, Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use byoc_protocol::{JobStatus, RejectReason};
use serde::{Deserialize, Serialize};

use crate::state_dir::StateDir;

mod archive;
pub use archive::{ArchivesRemoved, Compacted, nonce_horizon_secs, read_index_all, remove_archives_before};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A verified envelope was accepted for this runner (its nonce is now spent).
    Received {
        job_id: String,
        delivery_id: String,
        nonce: String,
        expires_at: i64,
        kind: String,
        operation: String,
        entity: String,
        payload_sha256: String,
        timeout_secs: u64,
        /// What the job does, as the runner derived it from its kind and spec (read,
        /// change, destroy, copy, run); absent in lines older than the field.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        effect: Option<String>,
        /// The component it asks a role for (the vendor's label).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        component: Option<String>,
        /// One of the runner's own checks, not a delivery (`pipeline::Origin::Local`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        local: bool,
    },
    /// An envelope was refused. Fields the payload did not yield are absent.
    Rejected {
        delivery_id: String,
        job_id: Option<String>,
        nonce: Option<String>,
        expires_at: Option<i64>,
        reason: RejectReason,
        detail: String,
    },
    /// A received job refused before its claim (a role the customer switched off or
    /// that is not in the install); reported to the control plane as a rejection.
    Refused {
        job_id: String,
        delivery_id: String,
        reason: RejectReason,
        detail: String,
        role: Option<String>,
    },
    Claimed {
        job_id: String,
        lease_secs: u64,
        /// The lease's fencing epoch (0: a control plane without fencing).
        #[serde(default, skip_serializing_if = "is_zero")]
        epoch: u64,
    },
    /// The control plane gave the job's lease to another runner of the install: this
    /// runner stopped it and never reports a result for it.
    Fenced { job_id: String, detail: String },
    /// The control plane refused the claim (cancelled or taken); the job never ran.
    ClaimRefused { job_id: String, detail: String },
    Started {
        job_id: String,
        started_at_ms: u64,
        /// The network the job got (its log's `[sandbox] network: …` line).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        network: Option<String>,
        /// The terraform workspace whose local state the job may change: after a crash
        /// the runner keeps what the job left, and learns which workspace from here,
        /// never from a file in the job's tree.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        state_workspace: Option<String>,
    },
    Finished {
        job_id: String,
        status: JobStatus,
        exit_code: Option<i32>,
        error: Option<String>,
        log_size: u64,
        log_sha256: String,
        /// Output past the log cap that was not kept.
        #[serde(default, skip_serializing_if = "is_zero")]
        log_omitted: u64,
        started_at_ms: Option<u64>,
        finished_at_ms: u64,
        #[serde(default)]
        outputs: serde_json::Value,
    },
    /// A claimed job held back by the customer's guardrails (`state`:
    /// `waiting_window`) until `until` (unix seconds), if known.
    Waiting {
        job_id: String,
        state: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        until: Option<i64>,
        detail: String,
    },
    /// The control plane acknowledged the result.
    Reported { job_id: String },
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Line {
    /// Unix milliseconds when the line was written.
    pub ts: u64,
    #[serde(flatten)]
    pub event: Event,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Received,
    Claimed,
    ClaimRefused,
    /// Received, then refused before it was claimed (a role the customer switched
    /// off); the refusal was reported instead of a result. Named `rejected` as
    /// everywhere a customer sees it (the audit's `job_rejected`, `jobs rejections`).
    #[serde(rename = "rejected", alias = "refused")]
    Refused,
    /// Claimed, held back by a maintenance window.
    WaitingWindow,
    /// Claimed, held until a local admin approves it.
    AwaitingApproval,
    Started,
    Finished,
    Reported,
    /// Leased anew to another runner; settled here without a report.
    Fenced,
}

impl Phase {
    fn rank(self) -> u8 {
        match self {
            Phase::Received => 0,
            Phase::Claimed => 1,
            Phase::WaitingWindow => 2,
            Phase::AwaitingApproval => 3,
            Phase::Started => 4,
            Phase::ClaimRefused | Phase::Refused | Phase::Finished => 5,
            Phase::Reported | Phase::Fenced => 6,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Received => "received",
            Phase::Claimed => "claimed",
            Phase::ClaimRefused => "claim_refused",
            Phase::Refused => "rejected",
            Phase::WaitingWindow => "waiting_window",
            Phase::AwaitingApproval => "awaiting_approval",
            Phase::Started => "started",
            Phase::Finished => "finished",
            Phase::Reported => "reported",
            Phase::Fenced => "fenced",
        }
    }
}

/// What the journal knows about one job (rebuilt from the lines on open).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobRecord {
    pub job_id: String,
    pub delivery_id: String,
    pub kind: String,
    pub operation: String,
    pub entity: String,
    pub nonce: String,
    pub payload_sha256: String,
    pub phase: Phase,
    pub received_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub finished: Option<Finished>,
    pub detail: Option<String>,
    /// `started`'s terraform workspace (see [`Event::Started`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_workspace: Option<String>,
    /// `received`'s effect and component (see [`Event::Received`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub component: Option<String>,
    /// `received`'s `local`: one of the runner's own checks.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub local: bool,
    /// `claimed`'s fencing epoch (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lease_epoch: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finished {
    pub status: JobStatus,
    pub exit_code: Option<i32>,
    pub error: Option<String>,
    pub log_size: u64,
    pub log_sha256: String,
    pub log_omitted: u64,
    pub finished_at_ms: u64,
    pub outputs: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Rejection {
    pub ts: u64,
    pub delivery_id: String,
    pub job_id: Option<String>,
    pub reason: RejectReason,
    pub detail: String,
}

#[derive(Debug, Default)]
pub struct Index {
    pub jobs: BTreeMap<String, JobRecord>,
    /// Order jobs were received in.
    pub order: Vec<String>,
    /// Spent nonces → (job id, expiry). Kept until expiry: after that the envelope is
    /// refused as expired anyway.
    pub nonces: HashMap<String, (String, i64)>,
    pub rejections: Vec<Rejection>,
    /// `rejected` lines (deliveries refused before any job existed), of `rejections`.
    pub rejected_lines: usize,
}

impl JobRecord {
    /// A job as its `received` line has it.
    fn received(line: &Line) -> Option<JobRecord> {
        let Event::Received {
            job_id,
            delivery_id,
            nonce,
            kind,
            operation,
            entity,
            payload_sha256,
            effect,
            component,
            local,
            ..
        } = &line.event
        else {
            return None;
        };
        Some(JobRecord {
            job_id: job_id.clone(),
            delivery_id: delivery_id.clone(),
            kind: kind.clone(),
            operation: operation.clone(),
            entity: entity.clone(),
            nonce: nonce.clone(),
            payload_sha256: payload_sha256.clone(),
            phase: Phase::Received,
            received_at_ms: line.ts,
            started_at_ms: None,
            state_workspace: None,
            finished: None,
            detail: None,
            effect: effect.clone(),
            component: component.clone(),
            local: *local,
            lease_epoch: 0,
        })
    }
}

impl Finished {
    /// A job's end as its `finished` line has it.
    fn of(event: &Event) -> Option<Finished> {
        let Event::Finished {
            status,
            exit_code,
            error,
            log_size,
            log_sha256,
            log_omitted,
            finished_at_ms,
            outputs,
            ..
        } = event
        else {
            return None;
        };
        Some(Finished {
            status: *status,
            exit_code: *exit_code,
            error: error.clone(),
            log_size: *log_size,
            log_sha256: log_sha256.clone(),
            log_omitted: *log_omitted,
            finished_at_ms: *finished_at_ms,
            outputs: outputs.clone(),
        })
    }
}

impl Index {
    /// Fold one journal line into the index (replay and append both do).
    pub fn apply(&mut self, line: &Line) {
        match &line.event {
            Event::Received { job_id, nonce, expires_at, .. } => {
                self.nonces.insert(nonce.clone(), (job_id.clone(), *expires_at));
                // The same envelope again is accepted only while still `received`.
                if !self.jobs.contains_key(job_id)
                    && let Some(record) = JobRecord::received(line)
                {
                    self.order.push(job_id.clone());
                    self.jobs.insert(job_id.clone(), record);
                }
            }
            Event::Refused { job_id, delivery_id, reason, detail, .. } => {
                self.set_phase(job_id, Phase::Refused);
                if let Some(j) = self.jobs.get_mut(job_id)
                    && j.phase == Phase::Refused
                {
                    j.detail = Some(format!("{}: {detail}", reason.code()));
                }
                self.rejections.push(Rejection {
                    ts: line.ts,
                    delivery_id: delivery_id.clone(),
                    job_id: Some(job_id.clone()),
                    reason: *reason,
                    detail: detail.clone(),
                });
            }
            Event::Rejected { delivery_id, job_id, nonce, expires_at, reason, detail } => {
                self.rejected_lines += 1;
                // A refused envelope's nonce is spent too: the same bytes must not get
                // a second chance later.
                if let (Some(n), Some(exp)) = (nonce, expires_at) {
                    self.nonces.entry(n.clone()).or_insert((job_id.clone().unwrap_or_default(), *exp));
                }
                self.rejections.push(Rejection {
                    ts: line.ts,
                    delivery_id: delivery_id.clone(),
                    job_id: job_id.clone(),
                    reason: *reason,
                    detail: detail.clone(),
                });
            }
            Event::Claimed { job_id, epoch, .. } => {
                self.set_phase(job_id, Phase::Claimed);
                if let Some(j) = self.jobs.get_mut(job_id) {
                    j.lease_epoch = *epoch;
                }
            }
            Event::Fenced { job_id, detail } => {
                self.set_phase(job_id, Phase::Fenced);
                if let Some(j) = self.jobs.get_mut(job_id) {
                    j.detail = Some(detail.clone());
                }
            }
            Event::ClaimRefused { job_id, detail } => {
                self.set_phase(job_id, Phase::ClaimRefused);
                if let Some(j) = self.jobs.get_mut(job_id)
                    && j.phase == Phase::ClaimRefused
                {
                    j.detail = Some(detail.clone());
                }
            }
            Event::Started { job_id, started_at_ms, state_workspace, .. } => {
                self.set_phase(job_id, Phase::Started);
                if let Some(j) = self.jobs.get_mut(job_id) {
                    j.started_at_ms = Some(*started_at_ms);
                    j.state_workspace.clone_from(state_workspace);
                }
            }
            Event::Finished { job_id, .. } => {
                self.set_phase(job_id, Phase::Finished);
                if let Some(j) = self.jobs.get_mut(job_id) {
                    j.finished = Finished::of(&line.event);
                }
            }
            Event::Waiting { job_id, state, until, detail } => {
                let phase =
                    if state == "awaiting_approval" { Phase::AwaitingApproval } else { Phase::WaitingWindow };
                self.set_phase(job_id, phase);
                // Also while it runs: a plan awaiting approval is held inside the job.
                if let Some(j) = self.jobs.get_mut(job_id)
                    && matches!(j.phase, Phase::WaitingWindow | Phase::AwaitingApproval | Phase::Started)
                {
                    j.detail = Some(match until {
                        Some(t) => format!("{detail} (until {})", crate::clock::rfc3339(*t)),
                        None => detail.clone(),
                    });
                }
            }
            Event::Reported { job_id } => self.set_phase(job_id, Phase::Reported),
        }
    }

    /// Phases only move forward: a late or duplicate line can never make a finished
    /// job look runnable again.
    fn set_phase(&mut self, job_id: &str, phase: Phase) {
        if let Some(j) = self.jobs.get_mut(job_id)
            && phase.rank() > j.phase.rank()
        {
            j.phase = phase;
        }
    }
}

/// A job's state could not be recorded durably: its journal (opened, read, appended)
/// or, for a transition, its audit record. Either way nothing may act on the job until
/// the next start settles it.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("opening job journal {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error(
        "job journal {path} is damaged at line {line}: {reason}. Keep a copy for investigation; the runner will not guess past it"
    )]
    Corrupt { path: PathBuf, line: usize, reason: String },
    #[error("appending to job journal {path}: {source}")]
    Append { path: PathBuf, source: std::io::Error },
    #[error("appending to the audit log: {0}")]
    Audit(String),
}

pub struct Journal {
    path: PathBuf,
    inner: Mutex<Inner>,
    reserve: Option<crate::disk::Reserve>,
}

struct Inner {
    file: File,
    index: Index,
}

impl Journal {
    /// Open (creating if absent) and replay. Returns the journal and the number of
    /// torn bytes cut from its tail, if any.
    pub fn open(state_dir: &Path) -> Result<(Journal, u64), RecordError> {
        let path = StateDir::of(state_dir).journal();
        let open_err = |e| RecordError::Open { path: path.clone(), source: e };
        let mut file =
            OpenOptions::new().read(true).append(true).create(true).open(&path).map_err(open_err)?;
        let mut index = Index::default();
        let mut good_len = 0u64;
        let mut reader = BufReader::new(&file);
        let mut buf = Vec::new();
        let mut line_no = 0usize;
        let mut torn: Option<(usize, String)> = None;
        loop {
            buf.clear();
            let n = reader.read_until(b'\n', &mut buf).map_err(open_err)?;
            if n == 0 {
                break;
            }
            line_no += 1;
            if let Some((l, reason)) = torn.take() {
                // Damage followed by more lines is not a torn tail.
                return Err(RecordError::Corrupt { path, line: l, reason });
            }
            let complete = buf.ends_with(b"\n");
            match serde_json::from_slice::<Line>(&buf) {
                Ok(line) if complete => {
                    index.apply(&line);
                    good_len += n as u64;
                }
                Ok(_) => torn = Some((line_no, "last line has no newline".into())),
                Err(e) => torn = Some((line_no, e.to_string())),
            }
        }
        drop(reader);
        let total = file.seek(SeekFrom::End(0)).map_err(open_err)?;
        let cut = total - good_len;
        if cut > 0 {
            file.set_len(good_len).map_err(open_err)?;
            file.sync_all().map_err(open_err)?;
        }
        Ok((Journal { path, inner: Mutex::new(Inner { file, index }), reserve: None }, cut))
    }

    /// Give the disk reserve back before an append that would find the disk full.
    pub fn with_reserve(mut self, reserve: crate::disk::Reserve) -> Self {
        self.reserve = Some(reserve);
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Append one event and fsync it. Only after this returns may the runner act on it.
    pub fn append(&self, event: Event) -> Result<(), RecordError> {
        let line = Line { ts: crate::clock::now_ms(), event };
        let mut bytes = serde_json::to_vec(&line).expect("journal line serialises");
        bytes.push(b'\n');
        if let Some(r) = &self.reserve {
            r.make_room_for_evidence();
        }
        let mut inner = self.lock();
        let err = |e| RecordError::Append { path: self.path.clone(), source: e };
        let before = inner.file.metadata().map_err(err)?.len();
        if let Err(e) = inner.file.write_all(&bytes).and_then(|()| inner.file.sync_data()) {
            // A line half-written (a full disk) is cut again, so the next append starts
            // on a line of its own and nothing is acted on that is not durable.
            let _ = inner.file.set_len(before);
            return Err(err(e));
        }
        inner.index.apply(&line);
        Ok(())
    }

    pub fn with_index<T>(&self, f: impl FnOnce(&Index) -> T) -> T {
        f(&self.lock().index)
    }

    pub fn job(&self, job_id: &str) -> Option<JobRecord> {
        self.with_index(|i| i.jobs.get(job_id).cloned())
    }
}

/// Where a job's stages journal their transitions and read back what is known: the
/// file-backed [`Journal`], or a fake in tests.
pub trait JobJournal: Send + Sync {
    /// Append one event durably. Only after this returns may the runner act on it.
    fn append(&self, event: Event) -> Result<(), RecordError>;
    /// Call `f` with the index of every job as of now (object-safe form of
    /// [`with_index`](dyn JobJournal::with_index)).
    fn visit_index(&self, f: &mut dyn FnMut(&Index));
    /// Archive settled jobs past the newest `keep` (see [`Journal::compact`]).
    fn compact(&self, _keep: usize, _now_secs: i64) -> Result<Option<Compacted>, RecordError> {
        Ok(None)
    }
}

impl JobJournal for Journal {
    fn append(&self, event: Event) -> Result<(), RecordError> {
        Journal::append(self, event)
    }
    fn compact(&self, keep: usize, now_secs: i64) -> Result<Option<Compacted>, RecordError> {
        Journal::compact(self, keep, now_secs)
    }
    fn visit_index(&self, f: &mut dyn FnMut(&Index)) {
        f(&self.lock().index)
    }
}

impl dyn JobJournal {
    pub fn with_index<T>(&self, f: impl FnOnce(&Index) -> T) -> T {
        let mut f = Some(f);
        let mut out = None;
        self.visit_index(&mut |index| {
            if let Some(f) = f.take() {
                out = Some(f(index));
            }
        });
        out.expect("visit_index calls back exactly once")
    }

    pub fn job(&self, job_id: &str) -> Option<JobRecord> {
        self.with_index(|i| i.jobs.get(job_id).cloned())
    }
}

/// Read-only replay for the inspection CLI: never modifies the file, tolerates a torn
/// tail (the daemon may be mid-write).
pub fn read_index(state_dir: &Path) -> Result<Index, RecordError> {
    let mut index = Index::default();
    replay_into(state_dir, &mut index)?;
    Ok(index)
}

fn replay_into(state_dir: &Path, index: &mut Index) -> Result<(), RecordError> {
    let path = StateDir::of(state_dir).journal();
    let file = File::open(&path).map_err(|e| RecordError::Open { path: path.clone(), source: e })?;
    let mut bytes = Vec::new();
    BufReader::new(file)
        .read_to_end(&mut bytes)
        .map_err(|e| RecordError::Open { path: path.clone(), source: e })?;
    let complete = bytes.ends_with(b"\n");
    let lines: Vec<&[u8]> = bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()).collect();
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_slice::<Line>(line) {
            Ok(l) => index.apply(&l),
            // The daemon may be in the middle of writing the last line.
            Err(_) if i + 1 == lines.len() && !complete => {}
            Err(e) => return Err(RecordError::Corrupt { path, line: i + 1, reason: e.to_string() }),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn received(job: &str, nonce: &str) -> Event {
        Event::Received {
            job_id: job.into(),
            delivery_id: "d".into(),
            nonce: nonce.into(),
            expires_at: 100,
            kind: "runner.noop".into(),
            operation: "trigger".into(),
            entity: "action".into(),
            payload_sha256: "00".into(),
            timeout_secs: 10,
            effect: None,
            component: None,
            local: false,
        }
    }

    #[test]
    fn replay_rebuilds_phases_and_nonces() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (j, cut) = Journal::open(dir.path()).unwrap();
            assert_eq!(cut, 0);
            j.append(received("a", "n1")).unwrap();
            j.append(Event::Claimed { job_id: "a".into(), lease_secs: 60, epoch: 0 }).unwrap();
            j.append(Event::Started {
                job_id: "a".into(),
                started_at_ms: 5,
                network: None,
                state_workspace: None,
            })
            .unwrap();
        }
        let (j, _) = Journal::open(dir.path()).unwrap();
        let rec = j.job("a").unwrap();
        assert_eq!(rec.phase, Phase::Started);
        assert_eq!(rec.started_at_ms, Some(5));
        assert!(j.with_index(|i| i.nonces.contains_key("n1")));
    }

    #[test]
    fn the_read_only_replay_skips_a_line_being_written_but_not_damage() {
        let dir = tempfile::tempdir().unwrap();
        let (j, _) = Journal::open(dir.path()).unwrap();
        j.append(received("a", "n1")).unwrap();
        drop(j);
        let path = StateDir::of(dir.path()).journal();
        let good = std::fs::read(&path).unwrap();
        let mut torn = good.clone();
        torn.extend_from_slice(b"{\"ts\":1,\"ev");
        std::fs::write(&path, &torn).unwrap();
        assert!(read_index(dir.path()).unwrap().jobs.contains_key("a"));
        let mut damaged = b"garbage\n".to_vec();
        damaged.extend_from_slice(&good);
        std::fs::write(&path, &damaged).unwrap();
        assert!(matches!(read_index(dir.path()), Err(RecordError::Corrupt { line: 1, .. })));
    }

    #[test]
    fn phases_never_move_backwards() {
        let dir = tempfile::tempdir().unwrap();
        let (j, _) = Journal::open(dir.path()).unwrap();
        j.append(received("a", "n1")).unwrap();
        j.append(Event::Claimed { job_id: "a".into(), lease_secs: 1, epoch: 0 }).unwrap();
        j.append(Event::Reported { job_id: "a".into() }).unwrap();
        j.append(Event::ClaimRefused { job_id: "a".into(), detail: "late".into() }).unwrap();
        j.append(received("a", "n1")).unwrap();
        assert_eq!(j.job("a").unwrap().phase, Phase::Reported);
    }

    #[test]
    fn torn_tail_is_cut_and_later_damage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (j, _) = Journal::open(dir.path()).unwrap();
            j.append(received("a", "n1")).unwrap();
        }
        let path = StateDir::of(dir.path()).journal();
        let good = std::fs::read(&path).unwrap();
        let mut torn = good.clone();
        let tail = b"{\"ts\":1,\"event\":\"clai";
        torn.extend_from_slice(tail);
        std::fs::write(&path, &torn).unwrap();
        let (j, cut) = Journal::open(dir.path()).unwrap();
        assert_eq!(cut, tail.len() as u64);
        assert_eq!(std::fs::read(&path).unwrap(), good);
        j.append(Event::Claimed { job_id: "a".into(), lease_secs: 1, epoch: 0 }).unwrap();
        drop(j);

        // Garbage in the middle is not a torn tail.
        let mut damaged = b"garbage\n".to_vec();
        damaged.extend_from_slice(&std::fs::read(&path).unwrap());
        std::fs::write(&path, &damaged).unwrap();
        match Journal::open(dir.path()) {
            Err(RecordError::Corrupt { line, .. }) => assert_eq!(line, 1),
            other => panic!("expected corruption error, got {:?}", other.map(|_| ())),
        }
    }
}
