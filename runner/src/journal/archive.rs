//! Compaction: settled jobs past the newest `jobs.journal_keep` move, lines unchanged,
//! into gzip files under `journal-archive/`, and readers that want every job merge the
//! archives with the journal.

use super::*;

use crate::state_dir::StateDir;

impl Journal {
    /// Archive settled jobs past the newest `keep` (and refused deliveries past the
    /// newest `keep`) whose nonces expired before `now_secs`. Runs only once there are a
    /// quarter more than `keep`, so the journal is not rewritten for every new job.
    pub fn compact(&self, keep: usize, now_secs: i64) -> Result<Option<Compacted>, RecordError> {
        let mut inner = self.lock();
        let plan = ArchivePlan::new(&inner.index, keep, now_secs);
        if plan.is_empty() {
            return Ok(None);
        }
        let err = |e| RecordError::Append { path: self.path.clone(), source: e };
        let bytes = std::fs::read(&self.path).map_err(err)?;
        let (mut kept, mut archived) = (Vec::new(), Vec::new());
        let (mut first_ts, mut last_ts) = (u64::MAX, 0);
        let mut rejected_seen = 0usize;
        for raw in bytes.split_inclusive(|b| *b == b'\n') {
            // Appends are whole lines under this lock: every line parses.
            let line: Line = serde_json::from_slice(raw).map_err(|e| RecordError::Corrupt {
                path: self.path.clone(),
                line: kept.len() + archived.len() + 1,
                reason: e.to_string(),
            })?;
            let archive = match &line.event {
                Event::Rejected { nonce, expires_at, .. } => {
                    rejected_seen += 1;
                    rejected_seen <= plan.rejected_lines && expired(nonce.as_ref().and(*expires_at), now_secs)
                }
                other => event_job(other).is_some_and(|id| plan.jobs.contains(id)),
            };
            if archive {
                first_ts = first_ts.min(line.ts);
                last_ts = last_ts.max(line.ts);
                archived.push(raw);
            } else {
                kept.push((raw, line));
            }
        }
        if archived.is_empty() {
            return Ok(None);
        }
        let dir = self.path.with_file_name(crate::state_dir::ARCHIVE_DIR);
        let name = format!("{first_ts:013}-{last_ts:013}-{}.jsonl.gz", byoc_protocol::random_hex(4));
        let archive_path = dir.join(&name);
        write_archive(&dir, &archive_path, &archived).map_err(err)?;
        // Then the journal without those lines, in place atomically.
        let replace = || -> std::io::Result<File> {
            byoc_statefs::write_with(&self.path, byoc_statefs::Options::mode(0o600), |f| {
                for (raw, _) in &kept {
                    f.write_all(raw)?;
                }
                Ok(())
            })?;
            OpenOptions::new().read(true).append(true).open(&self.path)
        };
        let file = replace().map_err(err)?;
        let mut index = Index::default();
        for (_, line) in &kept {
            index.apply(line);
        }
        inner.file = file;
        inner.index = index;
        Ok(Some(Compacted {
            jobs: plan.jobs.len(),
            lines: archived.len(),
            kept_lines: kept.len(),
            archive: archive_path,
        }))
    }
}

/// Envelopes that expired before this (Unix seconds) can no longer be accepted with
/// `skew` allowed: their nonces may be forgotten (an envelope is accepted until its
/// expiry plus the allowed skew). The `now_secs` that [`Journal::compact`] is given.
pub fn nonce_horizon_secs(now_ms: u64, skew: std::time::Duration) -> i64 {
    (now_ms / 1000) as i64 - skew.as_secs() as i64
}

/// What one compaction moved.
#[derive(Debug, Clone, PartialEq)]
pub struct Compacted {
    pub jobs: usize,
    pub lines: usize,
    pub kept_lines: usize,
    pub archive: PathBuf,
}

/// Which jobs and how many of the oldest refused deliveries a compaction archives.
struct ArchivePlan {
    jobs: std::collections::HashSet<String>,
    /// The oldest this many `rejected` lines may go (those whose nonce expired).
    rejected_lines: usize,
}

impl ArchivePlan {
    fn new(index: &Index, keep: usize, now_secs: i64) -> ArchivePlan {
        let threshold = keep + keep / 4;
        let settled: Vec<&JobRecord> = index
            .order
            .iter()
            .filter_map(|id| index.jobs.get(id))
            .filter(|j| {
                matches!(j.phase, Phase::Reported | Phase::ClaimRefused | Phase::Refused | Phase::Fenced)
            })
            .collect();
        let jobs: std::collections::HashSet<String> = if settled.len() > threshold {
            settled[..settled.len() - keep]
                .iter()
                .filter(|j| index.nonces.get(&j.nonce).is_none_or(|(_, exp)| *exp < now_secs))
                .map(|j| j.job_id.clone())
                .collect()
        } else {
            Default::default()
        };
        let rejected = index.rejected_lines;
        let rejected_lines = if rejected > threshold { rejected - keep } else { 0 };
        // The file is rewritten only for a batch, not for the one job whose nonce just
        // expired (this runs before every poll).
        let batch = (keep / 4).max(1);
        if jobs.len() < batch && rejected_lines < batch {
            return ArchivePlan { jobs: Default::default(), rejected_lines: 0 };
        }
        ArchivePlan { jobs, rejected_lines }
    }

    fn is_empty(&self) -> bool {
        self.jobs.is_empty() && self.rejected_lines == 0
    }
}

fn expired(expires_at: Option<i64>, now_secs: i64) -> bool {
    expires_at.is_none_or(|exp| exp < now_secs)
}

/// The job a line is about (`rejected` lines belong to no job of this runner's).
fn event_job(e: &Event) -> Option<&str> {
    match e {
        Event::Received { job_id, .. }
        | Event::Refused { job_id, .. }
        | Event::Claimed { job_id, .. }
        | Event::Fenced { job_id, .. }
        | Event::ClaimRefused { job_id, .. }
        | Event::Started { job_id, .. }
        | Event::Finished { job_id, .. }
        | Event::Waiting { job_id, .. }
        | Event::Reported { job_id } => Some(job_id),
        Event::Rejected { .. } => None,
    }
}

/// Written under a temporary name and renamed when whole: a failure (a full disk)
/// leaves no half archive for readers to trip on.
fn write_archive(dir: &Path, path: &Path, lines: &[&[u8]]) -> std::io::Result<()> {
    byoc_statefs::create_dir(dir, 0o700)?;
    byoc_statefs::write_with(path, byoc_statefs::Options::mode(0o600), |file| {
        let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::default());
        for l in lines {
            gz.write_all(l)?;
        }
        gz.finish().map(drop)
    })
}

/// What one archive sweep removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ArchivesRemoved {
    pub files: usize,
    pub bytes: u64,
}

/// Remove archives whose newest line is older than `older_than_ms` (the second
/// timestamp in the name `FIRST-LAST-RAND.jsonl.gz`). Every job in an archive was
/// settled and its envelope expired long before, so no replay protection rests on
/// them: they only serve `jobs list --all`. Names that do not parse are left alone.
pub fn remove_archives_before(state_dir: &Path, older_than_ms: u64) -> std::io::Result<ArchivesRemoved> {
    let dir = StateDir::of(state_dir).journal_archive();
    let entries = match std::fs::read_dir(&dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ArchivesRemoved::default()),
        other => other?,
    };
    let mut removed = ArchivesRemoved::default();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let last_ms = name
            .strip_suffix(".jsonl.gz")
            .and_then(|stem| stem.split('-').nth(1))
            .and_then(|last| last.parse::<u64>().ok());
        if last_ms.is_some_and(|last| last < older_than_ms) {
            let bytes = entry.metadata().map(|m| m.len()).unwrap_or(0);
            std::fs::remove_file(entry.path())?;
            removed.files += 1;
            removed.bytes += bytes;
        }
    }
    if removed.files > 0 {
        File::open(&dir)?.sync_all()?;
    }
    Ok(removed)
}

/// The archived lines, oldest archive first, then the journal's, folded into one
/// index (a job found in both, after a crash mid-compaction, merges: phases only move
/// forward). For `jobs list --all` and `jobs show`.
pub fn read_index_all(state_dir: &Path) -> Result<Index, RecordError> {
    let dir = StateDir::of(state_dir).journal_archive();
    let mut names: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.to_string_lossy().ends_with(".jsonl.gz"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => vec![],
        Err(e) => return Err(RecordError::Open { path: dir, source: e }),
    };
    names.sort();
    let mut index = Index::default();
    for path in names {
        let open = |e| RecordError::Open { path: path.clone(), source: e };
        let mut text = Vec::new();
        flate2::read::GzDecoder::new(File::open(&path).map_err(open)?)
            .read_to_end(&mut text)
            .map_err(open)?;
        for (i, raw) in text.split(|b| *b == b'\n').filter(|l| !l.is_empty()).enumerate() {
            let line: Line = serde_json::from_slice(raw).map_err(|e| RecordError::Corrupt {
                path: path.clone(),
                line: i + 1,
                reason: e.to_string(),
            })?;
            index.apply(&line);
        }
    }
    if StateDir::of(state_dir).journal().exists() {
        replay_into(state_dir, &mut index)?;
    }
    Ok(index)
}

#[cfg(test)]
mod tests {
    use super::super::tests::received;
    use super::*;

    fn settle(j: &Journal, id: &str) {
        j.append(received(id, &format!("n-{id}"))).unwrap();
        j.append(Event::Claimed { job_id: id.into(), lease_secs: 60, epoch: 0 }).unwrap();
        j.append(Event::Reported { job_id: id.into() }).unwrap();
    }

    fn rejected(j: &Journal, n: usize, expires_at: i64) {
        j.append(Event::Rejected {
            delivery_id: format!("r{n}"),
            job_id: None,
            nonce: Some(format!("rn{n}")),
            expires_at: Some(expires_at),
            reason: RejectReason::Expired,
            detail: "late".into(),
        })
        .unwrap();
    }

    #[test]
    fn compaction_archives_settled_jobs_past_the_keep_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let (j, _) = Journal::open(dir.path()).unwrap();
        for i in 0..30 {
            settle(&j, &format!("old{i:02}"));
        }
        // A job still in hand, older than the kept ones: never archived.
        j.append(received("running", "n-running")).unwrap();
        j.append(Event::Started {
            job_id: "running".into(),
            started_at_ms: 1,
            network: None,
            state_workspace: None,
        })
        .unwrap();
        for i in 0..30 {
            rejected(&j, i, 100);
        }
        // Below keep + keep/4: nothing happens.
        assert_eq!(j.compact(25, 1000).unwrap(), None);
        let c = j.compact(10, 1000).unwrap().expect("compacted");
        assert_eq!(c.jobs, 20);
        assert_eq!(c.lines, 20 * 3 + 20);
        j.with_index(|i| {
            assert_eq!(i.jobs.len(), 11, "10 settled + the running one");
            assert!(
                i.jobs.contains_key("running")
                    && i.jobs.contains_key("old29")
                    && !i.jobs.contains_key("old00")
            );
            assert_eq!(i.rejected_lines, 10);
            assert!(!i.nonces.contains_key("n-old00"), "archived with its expired nonce");
        });
        // Appends go on into the new file; a reopen sees the same.
        settle(&j, "new");
        drop(j);
        let (j, cut) = Journal::open(dir.path()).unwrap();
        assert_eq!(cut, 0);
        assert_eq!(j.with_index(|i| i.jobs.len()), 12);
        // The archive and the journal together are the whole history, in order.
        let all = read_index_all(dir.path()).unwrap();
        assert_eq!(all.order.len(), 32);
        assert_eq!(all.order.first().map(String::as_str), Some("old00"));
        assert_eq!(all.jobs["old00"].phase, Phase::Reported);
        assert_eq!(all.rejected_lines, 30);
        // Right after: nothing more to archive.
        assert_eq!(j.compact(10, 1000).unwrap(), None);
    }

    #[test]
    fn archives_past_their_retention_are_removed_and_the_rest_stay_readable() {
        let dir = tempfile::tempdir().unwrap();
        let (j, _) = Journal::open(dir.path()).unwrap();
        for i in 0..30 {
            settle(&j, &format!("old{i:02}"));
        }
        let first = j.compact(10, 1000).unwrap().expect("compacted").archive;
        let last_ms: u64 =
            first.file_name().unwrap().to_string_lossy().split('-').nth(1).unwrap().parse().unwrap();
        for i in 0..30 {
            settle(&j, &format!("new{i:02}"));
        }
        let second = j.compact(10, 1000).unwrap().expect("compacted again").archive;
        // Something else in the directory is never touched.
        let stray = StateDir::of(dir.path()).journal_archive().join("notes.txt");
        std::fs::write(&stray, b"mine").unwrap();

        // Nothing is older than the first archive's newest line.
        assert_eq!(remove_archives_before(dir.path(), last_ms).unwrap(), ArchivesRemoved::default());
        let removed = remove_archives_before(dir.path(), last_ms + 1).unwrap();
        assert_eq!(removed.files, 1);
        assert!(removed.bytes > 0);
        assert!(!first.exists() && second.exists() && stray.exists());
        // What is left still reads: the removed jobs are gone, the others are all there.
        let all = read_index_all(dir.path()).unwrap();
        assert!(!all.jobs.contains_key("old00"));
        assert_eq!(all.jobs["new00"].phase, Phase::Reported);
        assert!(all.jobs.contains_key("new29"));
        // No archive dir at all: nothing to do.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(remove_archives_before(empty.path(), u64::MAX).unwrap(), ArchivesRemoved::default());
    }

    #[test]
    fn a_nonce_still_valid_keeps_its_job_in_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let (j, _) = Journal::open(dir.path()).unwrap();
        for i in 0..30 {
            settle(&j, &format!("j{i:02}"));
        }
        // Every nonce expires at 100: at 50 none may go (replays must still be refused).
        assert_eq!(j.compact(10, 50).unwrap(), None);
        assert_eq!(j.with_index(|i| i.nonces.len()), 30);
        // Fewer archivable jobs than a batch (keep / 4): not worth rewriting the file.
        let dir = tempfile::tempdir().unwrap();
        let (j, _) = Journal::open(dir.path()).unwrap();
        for i in 0..55 {
            let id = format!("k{i:02}");
            let expires_at = if i < 5 { 100 } else { 10_000 };
            j.append(Event::Received {
                job_id: id.clone(),
                delivery_id: "d".into(),
                nonce: format!("n-{id}"),
                expires_at,
                kind: "runner.noop".into(),
                operation: "trigger".into(),
                entity: "action".into(),
                payload_sha256: "00".into(),
                timeout_secs: 10,
                effect: None,
                component: None,
                local: false,
            })
            .unwrap();
            j.append(Event::Reported { job_id: id }).unwrap();
        }
        assert_eq!(j.compact(40, 1000).unwrap(), None, "5 expired of 15, a batch is 10");
        assert_eq!(j.compact(40, 20_000).unwrap().map(|c| c.jobs), Some(15));
    }

    #[test]
    fn a_crash_between_archive_and_journal_merges_without_duplicates() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (j, _) = Journal::open(dir.path()).unwrap();
            for i in 0..30 {
                settle(&j, &format!("j{i:02}"));
            }
        }
        // The archive written, the journal not yet replaced: both hold the old jobs.
        let before = std::fs::read(StateDir::of(dir.path()).journal()).unwrap();
        let (j, _) = Journal::open(dir.path()).unwrap();
        j.compact(10, 1000).unwrap().expect("compacted");
        drop(j);
        std::fs::write(StateDir::of(dir.path()).journal(), &before).unwrap();
        let all = read_index_all(dir.path()).unwrap();
        assert_eq!(all.order.len(), 30, "each job once");
        // And the next compaction archives them again, harmlessly.
        let (j, _) = Journal::open(dir.path()).unwrap();
        j.compact(10, 1000).unwrap().expect("compacted again");
        assert_eq!(read_index_all(dir.path()).unwrap().order.len(), 30);
    }
}
