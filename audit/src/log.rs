//! The audit log on disk (one writer) and its records.
//!
//! `<dir>/log.jsonl`: one record per line, its canonical bytes being the line as
//! written (leaf = SHA-256(0x00 || line)); never re-serialised when verified.
//! `<dir>/checkpoints.jsonl`: a signed checkpoint after every commit and at least
//! every 60 s when idle. `<dir>/cosigned.jsonl`: checkpoints the control plane
//! acknowledged with its cosignature. `<dir>/runner.pub`, `<dir>/control-plane.pub`:
//! the keys an offline verifier needs (trust them, or pin them with `--trust`).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead as _, BufReader, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};

use ed25519_dalek::SigningKey;
use serde::{Deserialize, Serialize};

use crate::merkle::{self, CompactTree, Frontier, Hash};
use crate::note::{self, Checkpoint};

pub const LOG: &str = "log.jsonl";
pub const CHECKPOINTS: &str = "checkpoints.jsonl";
pub const COSIGNED: &str = "cosigned.jsonl";
pub const RUNNER_PUB: &str = "runner.pub";
pub const CONTROL_PLANE_PUB: &str = "control-plane.pub";
/// A checkpoint is signed at least this often while the runner runs.
pub const IDLE_CHECKPOINT_SECS: u64 = 60;
/// Name of the control plane's cosigning key in notes.
pub const CONTROL_PLANE_KEY_NAME: &str = "byoc-control-plane";

/// One audit record. Field order is the canonical order. Never secrets, tokens,
/// credentials or plan contents: only names, codes and digests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub seq: u64,
    pub time_ms: u64,
    pub install: String,
    pub event: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The job's operation alone (`deploy`, `trigger`), the same on every record of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<String>,
    /// What the operation acts on (`component`, `action`, `install`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub digests: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredCheckpoint {
    pub size: u64,
    pub note: String,
}

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error(
        "audit log {path} is damaged at line {line}: {reason}; keep it as evidence, the runner will not write past it"
    )]
    Corrupt { path: PathBuf, line: u64, reason: String },
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

fn append_line(file: &mut File, path: &Path, line: &[u8]) -> Result<(), AuditError> {
    let io = |e| AuditError::Io { op: "appending to", path: path.to_path_buf(), source: e };
    file.write_all(line).map_err(io)?;
    file.write_all(b"\n").map_err(io)?;
    Ok(())
}

pub struct AuditWriter {
    dir: PathBuf,
    log: File,
    checkpoints: File,
    /// Subtree hashes up to the acknowledged size, leaf hashes after it: memory bounded
    /// by what the control plane has not acknowledged yet, not by the log's length.
    tree: CompactTree,
    frontier: Frontier,
    origin: String,
    key_name: String,
    key: SigningKey,
    install: String,
    last_checkpoint_ms: u64,
}

/// What opening found.
#[derive(Debug, Default)]
pub struct Opened {
    /// Bytes of a torn final record that were cut (and recorded as `audit_tail_cut`).
    pub cut_bytes: u64,
}

/// An I/O error of `op` on `path`.
fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> AuditError {
    let path = path.to_path_buf();
    move |e| AuditError::Io { op, path, source: e }
}

/// The keys an offline verifier needs beside the log. Control-plane keys accumulate:
/// after a key rotation the old cosignatures must still verify.
fn write_keys(dir: &Path, key: &SigningKey, control_plane_keys: &[String]) -> Result<(), AuditError> {
    let pub_path = dir.join(RUNNER_PUB);
    write_durably(&pub_path, &format!("{}\n", base64_key(key))).map_err(io("writing", &pub_path))?;
    let cp_path = dir.join(CONTROL_PLANE_PUB);
    let mut cp_keys: Vec<String> = std::fs::read_to_string(&cp_path)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    for k in control_plane_keys {
        if !cp_keys.contains(k) {
            cp_keys.push(k.clone());
        }
    }
    write_durably(&cp_path, &(cp_keys.join("\n") + "\n")).map_err(io("writing", &cp_path))?;
    Ok(())
}

/// The log replayed into its tree (leaves before `acked` forgotten): the length of its
/// good records; a torn last record is left for the caller to cut, any other bad record
/// is corruption.
fn replay(
    log: &std::fs::File,
    log_path: &Path,
    acked: u64,
) -> Result<(CompactTree, Frontier, u64), AuditError> {
    let mut tree = CompactTree::default();
    let mut frontier = Frontier::default();
    let mut good = 0u64;
    let mut torn: Option<(u64, String)> = None;
    let mut reader = BufReader::new(log);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = reader.read_until(b'\n', &mut buf).map_err(io("reading", log_path))?;
        if n == 0 {
            break;
        }
        if let Some((line, reason)) = torn.take() {
            return Err(AuditError::Corrupt { path: log_path.to_path_buf(), line, reason });
        }
        let line_no = tree.size() + 1;
        let complete = buf.ends_with(b"\n");
        let body = buf.strip_suffix(b"\n").unwrap_or(&buf);
        match serde_json::from_slice::<Record>(body) {
            Ok(r) if complete && r.seq == tree.size() => {
                let h = merkle::leaf_hash(body);
                tree.push(h);
                tree.forget_before(acked);
                frontier.push(h);
                good += n as u64;
            }
            Ok(r) if complete => {
                return Err(AuditError::Corrupt {
                    path: log_path.to_path_buf(),
                    line: line_no,
                    reason: format!("sequence {} where {} was expected", r.seq, tree.size()),
                });
            }
            Ok(_) => torn = Some((line_no, "last record has no newline".into())),
            Err(e) => torn = Some((line_no, e.to_string())),
        }
    }
    Ok((tree, frontier, good))
}

impl AuditWriter {
    /// Open (or create) the log in `dir`, replaying it; a torn tail is cut and the cut
    /// is itself recorded. `control_plane_keys` are written for offline verification.
    pub fn open(
        dir: &Path,
        key: SigningKey,
        runner_id: &str,
        install: &str,
        control_plane_keys: &[String],
    ) -> Result<(AuditWriter, Opened), AuditError> {
        std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
        write_keys(dir, &key, control_plane_keys)?;
        let log_path = dir.join(LOG);
        let mut log = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&log_path)
            .map_err(io("opening", &log_path))?;
        let (tree, frontier, good) = replay(&log, &log_path, acknowledged_size(dir))?;
        let total = log.seek(SeekFrom::End(0)).map_err(io("reading", &log_path))?;
        let cut = total - good;
        if cut > 0 {
            log.set_len(good).map_err(io("truncating", &log_path))?;
            log.sync_all().map_err(io("syncing", &log_path))?;
        }
        let ck_path = dir.join(CHECKPOINTS);
        let checkpoints =
            OpenOptions::new().append(true).create(true).open(&ck_path).map_err(io("opening", &ck_path))?;
        fsync_dir(dir).map_err(io("syncing", dir))?;
        let mut w = AuditWriter {
            dir: dir.to_path_buf(),
            log,
            checkpoints,
            tree,
            frontier,
            origin: format!("byoc-runner/{install}/{runner_id}"),
            // C2SP: a log's key name matches its origin.
            key_name: format!("byoc-runner/{install}/{runner_id}"),
            key,
            install: install.to_string(),
            last_checkpoint_ms: 0,
        };
        if cut > 0 {
            w.append(Record {
                event: "audit_tail_cut".into(),
                detail: Some(format!("cut {cut} bytes of a torn record after a crash")),
                ..Default::default()
            })?;
        }
        Ok((w, Opened { cut_bytes: cut }))
    }

    pub fn size(&self) -> u64 {
        self.tree.size()
    }

    /// Leaf hashes held in memory: the records not yet acknowledged.
    pub fn held_leaf_hashes(&self) -> u64 {
        self.tree.size() - self.tree.base_size()
    }

    /// Consistency proof from the first `from` records to the first `to`; `None` below
    /// the acknowledged size (those leaves are kept only as subtree hashes).
    pub fn consistency_proof(&self, from: u64, to: u64) -> Option<Vec<Hash>> {
        self.tree.consistency_proof(from, to)
    }

    pub fn key_name(&self) -> &str {
        &self.key_name
    }

    /// Append one record, fsync it, then sign and fsync a checkpoint. Returns its seq.
    pub fn append(&mut self, record: Record) -> Result<u64, AuditError> {
        let seq = self.append_batch(vec![record])?;
        Ok(seq)
    }

    /// Group commit: all records written, one fsync, one checkpoint. Returns the last seq.
    pub fn append_batch(&mut self, records: Vec<Record>) -> Result<u64, AuditError> {
        self.lock_commit()?;
        let done = self.append_batch_locked(records);
        let _ = self.log.unlock();
        done
    }

    /// An exclusive lock on the log for one commit (its records and their checkpoint):
    /// a verifier snapshots under the shared lock, so on a live log it never sees
    /// records whose checkpoint is still being written (see `verify::verify_dir`).
    fn lock_commit(&self) -> Result<(), AuditError> {
        self.log.lock().map_err(|e| AuditError::Io { op: "locking", path: self.dir.join(LOG), source: e })
    }

    fn append_batch_locked(&mut self, records: Vec<Record>) -> Result<u64, AuditError> {
        let path = self.dir.join(LOG);
        let before = self
            .log
            .metadata()
            .map_err(|e| AuditError::Io { op: "reading", path: path.clone(), source: e })?
            .len();
        let mut hashes = Vec::with_capacity(records.len());
        let written = (|| {
            for mut r in records {
                r.seq = self.tree.size() + hashes.len() as u64;
                r.time_ms = now_ms();
                r.install = self.install.clone();
                let bytes = serde_json::to_vec(&r).expect("record serialises");
                append_line(&mut self.log, &path, &bytes)?;
                hashes.push(merkle::leaf_hash(&bytes));
            }
            self.log.sync_data().map_err(|e| AuditError::Io { op: "syncing", path: path.clone(), source: e })
        })();
        if let Err(e) = written {
            // A batch that did not all reach the disk (a full disk) is cut again: the log
            // holds whole, checkpointable records only, and the writer's tree is unchanged.
            let _ = self.log.set_len(before);
            return Err(e);
        }
        for h in hashes {
            self.tree.push(h);
            self.frontier.push(h);
        }
        self.checkpoint_locked()?;
        Ok(self.size() - 1)
    }

    /// Sign and store a checkpoint of the current tree.
    pub fn checkpoint(&mut self) -> Result<StoredCheckpoint, AuditError> {
        self.lock_commit()?;
        let done = self.checkpoint_locked();
        let _ = self.log.unlock();
        done
    }

    fn checkpoint_locked(&mut self) -> Result<StoredCheckpoint, AuditError> {
        let note = note::sign(
            &Checkpoint {
                origin: self.origin.clone(),
                size: self.size(),
                root: self.frontier.root(),
                time: Some(now_ms() / 1000),
            },
            &self.key_name,
            &self.key,
        );
        let stored = StoredCheckpoint { size: self.size(), note };
        let path = self.dir.join(CHECKPOINTS);
        let line = serde_json::to_vec(&stored).expect("checkpoint serialises");
        let before = self
            .checkpoints
            .metadata()
            .map_err(|e| AuditError::Io { op: "reading", path: path.clone(), source: e })?
            .len();
        if let Err(e) = append_line(&mut self.checkpoints, &path, &line).and_then(|()| {
            self.checkpoints.sync_data().map_err(|e| AuditError::Io {
                op: "syncing",
                path: path.clone(),
                source: e,
            })
        }) {
            let _ = self.checkpoints.set_len(before);
            return Err(e);
        }
        self.last_checkpoint_ms = now_ms();
        Ok(stored)
    }

    /// The idle heartbeat: a checkpoint when none was signed for 60 s.
    pub fn checkpoint_if_idle(&mut self) -> Result<(), AuditError> {
        if now_ms().saturating_sub(self.last_checkpoint_ms) >= IDLE_CHECKPOINT_SECS * 1000 {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// A signed note for the first `size` records: any size from the acknowledged one
    /// up to the current one (`None` outside that).
    pub fn sign_at(&self, size: u64) -> Option<String> {
        let root = if size == self.size() { self.frontier.root() } else { self.tree.root_at(size)? };
        let cp = Checkpoint { origin: self.origin.clone(), size, root, time: Some(now_ms() / 1000) };
        Some(note::sign(&cp, &self.key_name, &self.key))
    }

    /// Raw record lines `[from, to)` for upload.
    pub fn read_lines(&self, from: u64, to: u64) -> Result<Vec<String>, AuditError> {
        read_lines(&self.dir, from, to)
    }

    /// Store a checkpoint the control plane cosigned.
    pub fn store_cosigned(&mut self, size: u64, note: &str) -> Result<(), AuditError> {
        let path = self.dir.join(COSIGNED);
        let mut f = OpenOptions::new().append(true).create(true).open(&path).map_err(|e| AuditError::Io {
            op: "opening",
            path: path.clone(),
            source: e,
        })?;
        let line =
            serde_json::to_vec(&StoredCheckpoint { size, note: note.to_string() }).expect("serialises");
        append_line(&mut f, &path, &line)?;
        f.sync_data().map_err(|e| AuditError::Io { op: "syncing", path, source: e })?;
        // Acknowledged: no root or proof will start below this size again.
        self.tree.forget_before(size);
        Ok(())
    }
}

/// The state directory's one way (`byoc_statefs`): exclusive temporary file, fsync,
/// rename, directory fsync.
fn write_durably(path: &Path, text: &str) -> std::io::Result<()> {
    byoc_statefs::write(path, text.as_bytes(), byoc_statefs::Options::mode(0o600))
}

fn base64_key(key: &SigningKey) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(key.verifying_key().as_bytes())
}

pub fn read_lines(dir: &Path, from: u64, to: u64) -> Result<Vec<String>, AuditError> {
    let path = dir.join(LOG);
    let f = File::open(&path).map_err(|e| AuditError::Io { op: "opening", path: path.clone(), source: e })?;
    BufReader::new(f)
        .lines()
        .skip(from as usize)
        .take((to - from) as usize)
        .map(|l| l.map_err(|e| AuditError::Io { op: "reading", path: path.clone(), source: e }))
        .collect()
}

/// Highest size the control plane acknowledged (0 if none).
pub fn acknowledged_size(dir: &Path) -> u64 {
    read_checkpoints(&dir.join(COSIGNED)).iter().map(|c| c.size).max().unwrap_or(0)
}

pub fn read_checkpoints(path: &Path) -> Vec<StoredCheckpoint> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_plane_keys_accumulate_across_rotations() {
        let dir = tempfile::tempdir().unwrap();
        let key = byoc_protocol::generate_signing_key();
        AuditWriter::open(dir.path(), key.clone(), "rn", "i", &["old".into()]).unwrap();
        AuditWriter::open(dir.path(), key, "rn", "i", &["new".into()]).unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join(CONTROL_PLANE_PUB)).unwrap(), "old\nnew\n");
    }

    /// Memory follows what is unacknowledged, not the log's length, and a reopened
    /// writer starts from the acknowledged size with proofs still right.
    #[test]
    fn leaf_hashes_are_held_only_until_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        let key = byoc_protocol::generate_signing_key();
        let (mut w, _) = AuditWriter::open(dir.path(), key.clone(), "rn", "i", &[]).unwrap();
        let batch =
            |n: usize| (0..n).map(|i| Record { event: format!("e{i}"), ..Default::default() }).collect();
        w.append_batch(batch(3000)).unwrap();
        assert_eq!(w.held_leaf_hashes(), 3000);
        let note = w.sign_at(3000).unwrap();
        w.store_cosigned(3000, &note).unwrap();
        assert_eq!(w.held_leaf_hashes(), 0);
        w.append_batch(batch(10)).unwrap();
        assert_eq!(w.held_leaf_hashes(), 10);
        let proof = w.consistency_proof(3000, 3010).unwrap();
        assert!(w.sign_at(2999).is_none() && w.consistency_proof(2999, 3010).is_none());
        drop(w);
        let (w, _) = AuditWriter::open(dir.path(), key, "rn", "i", &[]).unwrap();
        assert_eq!((w.size(), w.held_leaf_hashes()), (3010, 10));
        assert_eq!(w.consistency_proof(3000, 3010).unwrap(), proof);
        // The proof checks against the full tree's roots.
        let text = std::fs::read_to_string(dir.path().join(LOG)).unwrap();
        let leaves: Vec<Hash> = text.lines().map(|l| merkle::leaf_hash(l.as_bytes())).collect();
        assert_eq!(proof, merkle::consistency_proof(&leaves, 3000));
    }
}
