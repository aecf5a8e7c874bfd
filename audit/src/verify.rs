//! Offline verification of an audit directory: every record, the tree, every
//! checkpoint and cosignature, sequence continuity, idle gaps, and that the log is not
//! shorter than anything a checkpoint (above all, an acknowledged one) covers.

use std::path::Path;

use ed25519_dalek::VerifyingKey;
use serde::Serialize;

use crate::log::{
    CHECKPOINTS, CONTROL_PLANE_KEY_NAME, COSIGNED, IDLE_CHECKPOINT_SECS, LOG, Record, StoredCheckpoint,
};
use crate::merkle::{self, Frontier, Hash};
use crate::note::{self, Checkpoint};

/// Keys the verifier trusts.
pub struct Trust {
    pub runner: VerifyingKey,
    pub control_plane: Vec<VerifyingKey>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub records: u64,
    pub checkpoints: usize,
    pub cosigned: usize,
    pub acknowledged_size: u64,
    pub origin: Option<String>,
    pub root: String,
}

#[derive(Debug, thiserror::Error, Serialize)]
pub enum VerifyError {
    #[error("record {seq} (line {line}): {reason}")]
    Record { seq: u64, line: u64, reason: String },
    #[error(
        "records up to {size} do not match the checkpoint on line {line} of {file}; first bad record is at or after seq {first_bad}"
    )]
    RootMismatch { file: String, line: u64, size: u64, first_bad: u64 },
    #[error("{file} line {line}: {reason}")]
    Checkpoint { file: String, line: u64, reason: String },
    #[error("provable truncation: {what} covers {size} records but the log has only {records}")]
    Truncated { what: String, size: u64, records: u64 },
    #[error("records {from}..{to} are not covered by any signed checkpoint")]
    Uncovered { from: u64, to: u64 },
    #[error(
        "checkpoints on lines {line} and {next_line} of {CHECKPOINTS} are {secs} s apart with no runner restart in between: checkpoints are missing"
    )]
    IdleGap { line: u64, next_line: u64, secs: u64 },
    #[error("reading {path}: {reason}")]
    Io { path: String, reason: String },
}

/// Bytes of log verified per round (split across the cores).
const VERIFY_BLOCK: usize = 16 << 20;

/// Leaf hashes and runner restarts (by index in the part) of a run of lines whose
/// sequence numbers run on from `first_seq` (its place in the log is the caller's check).
struct Parsed {
    leaves: Vec<Hash>,
    restarts: Vec<u64>,
    first_seq: Option<u64>,
}

/// The first bad line of a part, by index in the part.
struct PartError {
    at: u64,
    reason: String,
}

/// `bytes` (whole lines) in up to `n` parts of whole lines, about equal in size.
fn split_lines(bytes: &[u8], n: usize) -> Vec<&[u8]> {
    let mut parts = Vec::with_capacity(n);
    let mut rest = bytes;
    for i in (1..=n).rev() {
        if rest.is_empty() {
            break;
        }
        let want = rest.len().div_ceil(i);
        let end = match rest[want - 1..].iter().position(|b| *b == b'\n') {
            Some(p) => want + p,
            None => rest.len(),
        };
        parts.push(&rest[..end]);
        rest = &rest[end..];
    }
    parts
}

/// Parse and hash the records of `part`, checking that their sequence numbers run on.
fn parse_lines(part: &[u8]) -> Result<Parsed, PartError> {
    use std::io::BufRead as _;
    let mut out = Parsed { leaves: Vec::new(), restarts: Vec::new(), first_seq: None };
    let mut rest = part;
    let mut line = Vec::new();
    let mut at = 0u64;
    loop {
        line.clear();
        // `read_until` on a slice finds the newline with std's optimised search.
        let n = rest.read_until(b'\n', &mut line).unwrap_or(0);
        if n == 0 {
            return Ok(out);
        }
        let bad = |reason: String| PartError { at, reason };
        let body = line.strip_suffix(b"\n").ok_or_else(|| bad("incomplete (no newline)".into()))?;
        let r: Record = serde_json::from_slice(body).map_err(|e| bad(format!("not a record: {e}")))?;
        let first = *out.first_seq.get_or_insert(r.seq);
        if r.seq != first + at {
            return Err(bad(format!("carries sequence {} (records missing, inserted or reordered)", r.seq)));
        }
        if r.event == "runner_started" {
            out.restarts.push(at);
        }
        out.leaves.push(merkle::leaf_hash(body));
        at += 1;
    }
}

struct Signed {
    file: &'static str,
    line: u64,
    cp: Checkpoint,
}

/// The names the runner's key may sign a checkpoint of `origin` under: the origin
/// itself (C2SP), and `byoc-runner/<runner>`, as logs written before were signed.
pub fn key_names(origin: &str) -> [String; 2] {
    [origin.to_string(), format!("byoc-runner/{}", origin.rsplit('/').next().unwrap_or(""))]
}

fn read_signed(
    dir: &Path,
    file: &'static str,
    trust: &Trust,
    cosigned: bool,
) -> Result<Vec<Signed>, VerifyError> {
    let path = dir.join(file);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && cosigned => return Ok(vec![]),
        Err(e) => return Err(VerifyError::Io { path: path.display().to_string(), reason: e.to_string() }),
    };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i as u64 + 1;
        let bad = |reason: String| VerifyError::Checkpoint { file: file.into(), line: line_no, reason };
        let stored: StoredCheckpoint =
            serde_json::from_str(line).map_err(|e| bad(format!("not a checkpoint: {e}")))?;
        let body = Checkpoint::parse_body(
            stored.note.split("\n\n").next().map(|b| format!("{b}\n")).as_deref().unwrap_or(""),
        )
        .map_err(|e| bad(e.to_string()))?;
        let names = key_names(&body.origin);
        let cp = if cosigned {
            let mut last = None;
            let mut found = None;
            'keys: for k in &trust.control_plane {
                for name in &names {
                    match note::open(&stored.note, &[(name, &trust.runner), (CONTROL_PLANE_KEY_NAME, k)]) {
                        Ok(cp) => {
                            found = Some(cp);
                            break 'keys;
                        }
                        Err(e) => last = Some(e),
                    }
                }
            }
            found.ok_or_else(|| {
                bad(last
                    .map(|e| e.to_string())
                    .unwrap_or_else(|| "no control-plane key to check the cosignature".into()))
            })?
        } else {
            note::open(&stored.note, &[(&names[0], &trust.runner)])
                .or_else(|_| note::open(&stored.note, &[(&names[1], &trust.runner)]))
                .map_err(|e| bad(e.to_string()))?
        };
        if cp.size != stored.size {
            return Err(bad(format!("stored size {} but the signed size is {}", stored.size, cp.size)));
        }
        out.push(Signed { file, line: line_no, cp });
    }
    Ok(out)
}

/// The log's records as leaf hashes, with where the runner restarted: blocks of whole
/// lines, each split across the machine's cores, merged in order (so the first bad
/// record reported is the first in the log).
fn read_leaves(mut reader: impl std::io::Read, path: &Path) -> Result<(Vec<Hash>, Vec<u64>), VerifyError> {
    let mut leaves: Vec<Hash> = Vec::new();
    let mut restarts: Vec<u64> = Vec::new();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(16);
    let mut pending: Vec<u8> = Vec::new();
    let mut eof = false;
    let mut block = VERIFY_BLOCK;
    while !eof || !pending.is_empty() {
        if !eof && pending.len() < block {
            let want = (block - pending.len()) as u64;
            let n = std::io::Read::read_to_end(&mut std::io::Read::take(&mut reader, want), &mut pending)
                .map_err(|e| VerifyError::Io { path: path.display().to_string(), reason: e.to_string() })?;
            eof = (n as u64) < want;
        }
        // Whole lines only, but for a last line without its newline (reported as such).
        let cut =
            if eof { pending.len() } else { pending.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1) };
        if cut == 0 {
            // A line longer than a block: read on.
            block += VERIFY_BLOCK;
            continue;
        }
        block = VERIFY_BLOCK;
        let parts = split_lines(&pending[..cut], threads);
        let parsed: Vec<Result<Parsed, PartError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = parts.iter().map(|part| scope.spawn(move || parse_lines(part))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        // In order: the first error reported is the first in the log.
        for p in parsed {
            let start = leaves.len() as u64;
            let bad = |at: u64, reason: String| VerifyError::Record {
                seq: start + at,
                line: start + at + 1,
                reason,
            };
            let p = match p {
                Ok(p) => p,
                Err(PartError { at, reason }) => return Err(bad(at, reason)),
            };
            if let Some(first) = p.first_seq
                && first != start
            {
                return Err(bad(
                    0,
                    format!("carries sequence {first} (records missing, inserted or reordered)"),
                ));
            }
            restarts.extend(p.restarts.iter().map(|r| start + r));
            leaves.extend(p.leaves);
        }
        pending.drain(..cut);
    }
    Ok((leaves, restarts))
}

/// Every checkpoint's root is the tree's root at its size: one pass over the leaves.
fn check_roots(
    checkpoints: &[Signed],
    cosigned: &[Signed],
    leaves: &[Hash],
) -> Result<Frontier, VerifyError> {
    let records = leaves.len() as u64;
    let mut all: Vec<&Signed> = checkpoints.iter().chain(cosigned).collect();
    all.sort_by_key(|s| s.cp.size);
    let mut frontier = Frontier::default();
    let mut last_good = 0u64;
    let mut i = 0usize;
    for size in 0..=records {
        while i < all.len() && all[i].cp.size == size {
            if frontier.root() != all[i].cp.root {
                return Err(VerifyError::RootMismatch {
                    file: all[i].file.into(),
                    line: all[i].line,
                    size,
                    first_bad: last_good,
                });
            }
            last_good = size;
            i += 1;
        }
        if size < records {
            frontier.push(leaves[size as usize]);
        }
    }

    Ok(frontier)
}

pub fn verify_dir(dir: &Path, trust: &Trust) -> Result<Report, VerifyError> {
    let path = dir.join(LOG);
    let io = |e: std::io::Error| VerifyError::Io { path: path.display().to_string(), reason: e.to_string() };
    let f = std::fs::File::open(&path).map_err(io)?;
    // A consistent snapshot of a log the runner may be appending to: under a shared lock
    // (the writer holds the exclusive one for each commit of records + checkpoint) read
    // the checkpoints and the log's length, then verify only that prefix. The log is
    // append-only, so the prefix cannot change after the lock is released.
    f.lock_shared().map_err(io)?;
    let snapshot = (|| {
        let checkpoints = read_signed(dir, CHECKPOINTS, trust, false)?;
        let cosigned = read_signed(dir, COSIGNED, trust, true)?;
        let len = f.metadata().map_err(io)?.len();
        Ok((checkpoints, cosigned, len))
    })();
    let _ = f.unlock();
    let (checkpoints, cosigned, len) = snapshot?;
    let origin = checkpoints.first().map(|s| s.cp.origin.clone());
    for s in checkpoints.iter().chain(&cosigned) {
        if Some(&s.cp.origin) != origin.as_ref() {
            return Err(VerifyError::Checkpoint {
                file: s.file.into(),
                line: s.line,
                reason: format!("origin {:?} differs from {:?}", s.cp.origin, origin),
            });
        }
    }

    // Records: parse, sequence, leaf hashes.
    let (leaves, restarts) = read_leaves(std::io::Read::take(f, len), &path)?;
    let records = leaves.len() as u64;

    // Sizes first: a checkpoint beyond the log is truncation (acknowledged ones above all).
    // Acknowledged checkpoints first: their truncation is the one the control plane can prove.
    for s in cosigned.iter().chain(&checkpoints) {
        if s.cp.size > records {
            let what = match s.file {
                COSIGNED => format!("the acknowledged checkpoint on line {} of {COSIGNED}", s.line),
                _ => format!("the checkpoint on line {} of {}", s.line, s.file),
            };
            return Err(VerifyError::Truncated { what, size: s.cp.size, records });
        }
    }
    let covered = checkpoints.iter().map(|s| s.cp.size).max().unwrap_or(0);
    if covered < records {
        return Err(VerifyError::Uncovered { from: covered, to: records });
    }

    let frontier = check_roots(&checkpoints, &cosigned, &leaves)?;

    // Idle gaps: checkpoints at least every 60 s while running.
    for w in checkpoints.windows(2) {
        // Checkpoints that carry no time (no `t=` line) cannot show a gap.
        let (Some(t0), Some(t1)) = (w[0].cp.time, w[1].cp.time) else { continue };
        let secs = t1.saturating_sub(t0);
        let restarted =
            restarts.iter().any(|r| *r >= w[0].cp.size && *r < w[1].cp.size.max(w[0].cp.size + 1));
        if secs > 2 * IDLE_CHECKPOINT_SECS && !restarted {
            return Err(VerifyError::IdleGap { line: w[0].line, next_line: w[1].line, secs });
        }
    }
    Ok(Report {
        records,
        checkpoints: checkpoints.len(),
        cosigned: cosigned.len(),
        acknowledged_size: cosigned.iter().map(|s| s.cp.size).max().unwrap_or(0),
        origin,
        root: hex::encode(frontier.root()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::{AuditWriter, Record};
    use rand::{Rng as _, SeedableRng as _};

    struct Fixture {
        files: Vec<(String, Vec<u8>)>,
        trust: Trust,
        runner: ed25519_dalek::SigningKey,
    }

    fn fixture(records: usize) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let runner = byoc_protocol::generate_signing_key();
        let cp_key = byoc_protocol::generate_signing_key();
        let (mut w, _) = AuditWriter::open(dir.path(), runner.clone(), "rn-1", "inst-1", &[]).unwrap();
        let mut batch = Vec::new();
        for i in 0..records {
            batch.push(Record {
                event: "job_finished".into(),
                job: Some(format!("job-{i}")),
                status: Some("succeeded".into()),
                ..Default::default()
            });
            // Group commits of five records: one checkpoint each.
            if i % 5 == 4 || i + 1 == records {
                w.append_batch(std::mem::take(&mut batch)).unwrap();
            }
            if i % 10 == 9 {
                // The control plane acknowledges every tenth record.
                let n = note::cosign(&w.sign_at(w.size()).unwrap(), CONTROL_PLANE_KEY_NAME, &cp_key).unwrap();
                w.store_cosigned(w.size(), &n).unwrap();
            }
        }
        let files = [LOG, CHECKPOINTS, COSIGNED]
            .iter()
            .map(|f| (f.to_string(), std::fs::read(dir.path().join(f)).unwrap()))
            .collect();
        Fixture {
            files,
            trust: Trust { runner: runner.verifying_key(), control_plane: vec![cp_key.verifying_key()] },
            runner,
        }
    }

    fn write(dir: &Path, files: &[(String, Vec<u8>)]) {
        for (name, bytes) in files {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }

    fn lines(b: &[u8]) -> Vec<Vec<u8>> {
        b.split(|c| *c == b'\n').filter(|l| !l.is_empty()).map(|l| l.to_vec()).collect()
    }

    fn join(ls: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        for l in ls {
            out.extend_from_slice(l);
            out.push(b'\n');
        }
        out
    }

    #[test]
    fn a_log_being_appended_to_verifies_at_every_moment() {
        // The customer verifies while the runner writes: records land before their
        // checkpoint, so an unlocked reader sees an uncovered tail now and then.
        let dir = tempfile::tempdir().unwrap();
        let key = byoc_protocol::generate_signing_key();
        let trust = Trust { runner: key.verifying_key(), control_plane: vec![] };
        let (mut w, _) = AuditWriter::open(dir.path(), key, "rn-1", "inst-1", &[]).unwrap();
        w.append(Record { event: "runner_started".into(), ..Default::default() }).unwrap();
        let writing = std::sync::atomic::AtomicBool::new(true);
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..400 {
                    w.append(Record {
                        event: "job_finished".into(),
                        job: Some(format!("j{i}")),
                        ..Default::default()
                    })
                    .unwrap();
                }
                writing.store(false, std::sync::atomic::Ordering::SeqCst);
            });
            let mut verified = 0;
            while writing.load(std::sync::atomic::Ordering::SeqCst) {
                verify_dir(dir.path(), &trust).unwrap();
                verified += 1;
            }
            assert!(verified > 0);
        });
        assert_eq!(verify_dir(dir.path(), &trust).unwrap().records, 401);
    }

    #[test]
    fn a_clean_log_verifies() {
        let f = fixture(25);
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &f.files);
        let r = verify_dir(dir.path(), &f.trust).unwrap();
        assert_eq!(r.records, 25);
        assert_eq!(r.acknowledged_size, 20);
    }

    #[test]
    fn a_torn_tail_is_cut_recorded_and_the_log_still_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let key = byoc_protocol::generate_signing_key();
        {
            let (mut w, _) = AuditWriter::open(dir.path(), key.clone(), "rn-1", "inst-1", &[]).unwrap();
            for _ in 0..3 {
                w.append(Record { event: "job_started".into(), ..Default::default() }).unwrap();
            }
        }
        // A crash mid-write leaves half a record.
        let mut f = std::fs::OpenOptions::new().append(true).open(dir.path().join(LOG)).unwrap();
        std::io::Write::write_all(&mut f, br#"{"seq":3,"time_ms":1,"inst"#).unwrap();
        drop(f);
        let (w, opened) = AuditWriter::open(dir.path(), key.clone(), "rn-1", "inst-1", &[]).unwrap();
        assert_eq!(opened.cut_bytes, 26);
        assert_eq!(w.size(), 4);
        let last = crate::log::read_lines(dir.path(), 3, 4).unwrap();
        assert!(last[0].contains("audit_tail_cut"), "{last:?}");
        let trust = Trust { runner: key.verifying_key(), control_plane: vec![] };
        assert_eq!(verify_dir(dir.path(), &trust).unwrap().records, 4);
    }

    #[test]
    fn a_log_signed_under_the_former_key_name_still_verifies_and_no_other_name_does() {
        let dir = tempfile::tempdir().unwrap();
        let key = byoc_protocol::generate_signing_key();
        let (mut w, _) = AuditWriter::open(dir.path(), key.clone(), "rn-1", "inst-1", &[]).unwrap();
        w.append(Record { event: "job_started".into(), ..Default::default() }).unwrap();
        drop(w);
        let trust = Trust { runner: key.verifying_key(), control_plane: vec![] };
        let path = dir.path().join(crate::log::CHECKPOINTS);
        let resign = |name: &str| {
            let text = std::fs::read_to_string(&path).unwrap();
            let lines: Vec<String> = text
                .lines()
                .map(|l| {
                    let mut c: crate::log::StoredCheckpoint = serde_json::from_str(l).unwrap();
                    let body = format!("{}\n", c.note.split("\n\n").next().unwrap());
                    c.note = format!("{body}\n{}", note::sign_line(&body, name, &key));
                    serde_json::to_string(&c).unwrap()
                })
                .collect();
            std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        };
        // As logs were signed before the key was named as the origin.
        resign("byoc-runner/rn-1");
        assert_eq!(verify_dir(dir.path(), &trust).unwrap().records, 1);
        resign("byoc-runner/someone-else");
        assert!(verify_dir(dir.path(), &trust).is_err());
    }

    #[test]
    fn a_long_silence_between_checkpoints_is_a_gap_unless_the_runner_restarted() {
        let dir = tempfile::tempdir().unwrap();
        let key = byoc_protocol::generate_signing_key();
        let (mut w, _) = AuditWriter::open(dir.path(), key.clone(), "rn-1", "inst-1", &[]).unwrap();
        w.append(Record { event: "job_started".into(), ..Default::default() }).unwrap();
        let trust = Trust { runner: key.verifying_key(), control_plane: vec![] };
        // A checkpoint signed ten minutes later with nothing in between.
        let later = |size: u64, w: &AuditWriter| {
            let body = w.sign_at(size).unwrap().split("\n\n").next().unwrap().to_string() + "\n";
            let mut cp = Checkpoint::parse_body(&body).unwrap();
            cp.time = cp.time.map(|t| t + 600);
            serde_json::to_string(&StoredCheckpoint { size, note: note::sign(&cp, "byoc-runner/rn-1", &key) })
                .unwrap()
        };
        let path = dir.path().join(CHECKPOINTS);
        let original = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{original}{}\n", later(1, &w))).unwrap();
        assert!(matches!(verify_dir(dir.path(), &trust), Err(VerifyError::IdleGap { .. })));
        // With a restart recorded in between, the silence is explained.
        std::fs::write(&path, &original).unwrap();
        w.append(Record { event: "runner_started".into(), ..Default::default() }).unwrap();
        let with_restart = std::fs::read_to_string(&path).unwrap();
        let mut lines: Vec<String> = with_restart.lines().map(str::to_string).collect();
        let last = lines.pop().unwrap();
        let s: StoredCheckpoint = serde_json::from_str(&last).unwrap();
        lines.push(later(s.size, &w));
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        verify_dir(dir.path(), &trust).unwrap();
    }

    /// 10,000 random edits of the kinds an attacker or a failing disk makes; every one
    /// must be caught.
    #[test]
    fn ten_thousand_random_edits_are_all_caught() {
        let f = fixture(40);
        let dir = tempfile::tempdir().unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(6962);
        let other = byoc_protocol::generate_signing_key();
        let log = f.files[0].1.clone();
        let log_lines = lines(&log);
        let mut kinds = std::collections::BTreeMap::new();
        for round in 0..10_000 {
            let mut files = f.files.clone();
            let kind = rng.random_range(0..9);
            match kind {
                0 => {
                    // Change one byte of a record.
                    let i = rng.random_range(0..log.len());
                    let mut b = log.clone();
                    b[i] = b[i].wrapping_add(rng.random_range(1..=255));
                    files[0].1 = b;
                }
                1 => {
                    let mut ls = log_lines.clone();
                    ls.remove(rng.random_range(0..ls.len()));
                    files[0].1 = join(&ls);
                }
                2 => {
                    // Insert a copy of another record, or a forged one with the right seq.
                    let mut ls = log_lines.clone();
                    let at = rng.random_range(0..=ls.len());
                    let forged = format!(
                        r#"{{"seq":{at},"time_ms":1,"install":"inst-1","event":"job_finished","job":"forged"}}"#
                    );
                    let line = if rng.random_bool(0.5) {
                        ls[rng.random_range(0..ls.len())].clone()
                    } else {
                        forged.into_bytes()
                    };
                    ls.insert(at, line);
                    files[0].1 = join(&ls);
                }
                3 => {
                    let mut ls = log_lines.clone();
                    let a = rng.random_range(0..ls.len());
                    let mut b = rng.random_range(0..ls.len());
                    while b == a {
                        b = rng.random_range(0..ls.len());
                    }
                    ls.swap(a, b);
                    files[0].1 = join(&ls);
                }
                4 => {
                    files[0].1.truncate(rng.random_range(0..log.len()));
                }
                5 => {
                    // Roll the log back to an older copy (a complete prefix).
                    let keep = rng.random_range(0..log_lines.len());
                    files[0].1 = join(&log_lines[..keep]);
                }
                6 => {
                    // Rewrite a record and re-sign every checkpoint with another key.
                    let mut ls = log_lines.clone();
                    let i = rng.random_range(0..ls.len());
                    ls[i] =
                        String::from_utf8(ls[i].clone()).unwrap().replace("succeeded", "failed").into_bytes();
                    files[0].1 = join(&ls);
                    let resigned: Vec<Vec<u8>> = lines(&f.files[1].1)
                        .iter()
                        .map(|l| {
                            let s: StoredCheckpoint = serde_json::from_slice(l).unwrap();
                            let body = s.note.split("\n\n").next().unwrap().to_string() + "\n";
                            let cp = Checkpoint::parse_body(&body).unwrap();
                            let n = note::sign(&cp, "byoc-runner/rn-1", &other);
                            serde_json::to_vec(&StoredCheckpoint { size: s.size, note: n }).unwrap()
                        })
                        .collect();
                    files[1].1 = join(&resigned);
                }
                7 => {
                    // Forge the control plane's cosignature on a checkpoint of a longer log.
                    let cp = Checkpoint {
                        origin: "byoc-runner/inst-1/rn-1".into(),
                        size: 40,
                        root: [7; 32],
                        time: Some(1),
                    };
                    let n = note::cosign(
                        &note::sign(&cp, "byoc-runner/rn-1", &f.runner),
                        CONTROL_PLANE_KEY_NAME,
                        &other,
                    )
                    .unwrap();
                    let mut ls = lines(&f.files[2].1);
                    ls.push(serde_json::to_vec(&StoredCheckpoint { size: 40, note: n }).unwrap());
                    files[2].1 = join(&ls);
                }
                _ => {
                    // Edit a byte of a signed checkpoint.
                    let which = rng.random_range(1..=2);
                    let b = &mut files[which].1;
                    let i = rng.random_range(0..b.len());
                    let old = b[i];
                    b[i] = if old == b'7' { b'8' } else { b'7' };
                    if b[i] == old {
                        b[i] = b'x';
                    }
                }
            }
            if files[0].1 == log && files[1].1 == f.files[1].1 && files[2].1 == f.files[2].1 {
                continue; // the edit happened to change nothing
            }
            write(dir.path(), &files);
            let r = verify_dir(dir.path(), &f.trust);
            assert!(r.is_err(), "round {round}: edit kind {kind} went unnoticed");
            *kinds.entry(kind).or_insert(0) += 1;
        }
        assert_eq!(kinds.len(), 9, "{kinds:?}");
        assert!(kinds.values().sum::<u32>() >= 9_900);
    }
}
