//! On-disk log spool: job output is appended to `spool/<job_id>.log` first and
//! uploaded from there by byte offset, so an outage of the control plane loses nothing
//! and a restarted runner resumes where the server says it stopped (HTTP 416).
//!
//! Only fsynced bytes are uploaded: the server must never hold log bytes that a crash
//! could take back from the runner's copy.

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use byoc_job_executors::OutputSink;
use sha2::{Digest as _, Sha256};

use crate::control_plane::{ClientError, ControlPlane};
use crate::state_dir::StateDir;

/// Largest log chunk sent in one request.
pub const UPLOAD_CHUNK: usize = 256 * 1024;

pub fn spool_path(state_dir: &Path, job_id: &str) -> PathBuf {
    StateDir::of(state_dir).spool().join(format!("{job_id}.log"))
}

/// Where a job's log stops growing on disk: the first `head` bytes are kept as they
/// come (and uploaded as they come); past them the output goes to a ring file of `tail`
/// bytes beside the spool, appended when the job ends (after an omission marker if the
/// ring wrapped). A log within the cap is therefore kept byte for byte. A
/// runaway job therefore costs at most `head + tail` bytes of the customer's disk, keeps
/// running, and its log still shows how it started and how it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogCap {
    pub head: u64,
    pub tail: u64,
}

impl LogCap {
    /// Half the cap for the head, half for the tail.
    pub fn of(max_bytes: u64) -> LogCap {
        let head = max_bytes / 2;
        LogCap { head, tail: max_bytes - head }
    }

    pub fn max_bytes(self) -> u64 {
        self.head + self.tail
    }
}

/// What the spool holds when the job ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolDigest {
    pub size: u64,
    /// SHA-256 of exactly the bytes kept (and uploaded).
    pub sha256: String,
    /// Output dropped between the head and the tail (0: nothing was dropped).
    pub omitted: u64,
}

pub fn tail_path(state_dir: &Path, job_id: &str) -> PathBuf {
    StateDir::of(state_dir).spool().join(format!("{job_id}.tail"))
}

/// When the log's bytes were written, for `jobs logs --timestamps` and `--since`: pairs
/// of little-endian u64s (byte offset, Unix ms), one whenever the time has moved on by
/// [`TIME_MARK_MS`]. Not part of the log or its digest; lost times lose only the labels.
pub fn times_path(state_dir: &Path, job_id: &str) -> PathBuf {
    StateDir::of(state_dir).spool().join(format!("{job_id}.times"))
}

/// How far apart two marks of the times file are at least.
const TIME_MARK_MS: u64 = 10;

/// The marks of a log's times file (empty when it has none), in offset order.
pub fn read_times(state_dir: &Path, job_id: &str) -> Vec<(u64, u64)> {
    let Ok(bytes) = std::fs::read(times_path(state_dir, job_id)) else { return Vec::new() };
    bytes
        .chunks_exact(16)
        .map(|c| {
            let (offset, ms) = c.split_at(8);
            (
                u64::from_le_bytes(offset.try_into().unwrap_or_default()),
                u64::from_le_bytes(ms.try_into().unwrap_or_default()),
            )
        })
        .collect()
}

/// The time the byte at `offset` was written, from `marks` (`read_times`).
pub fn time_at(marks: &[(u64, u64)], offset: u64) -> Option<u64> {
    let i = marks.partition_point(|(o, _)| *o <= offset);
    i.checked_sub(1).map(|i| marks[i].1)
}

pub struct SpoolWriter {
    file: File,
    path: PathBuf,
    len: u64,
    hasher: Sha256,
    cap: LogCap,
    tail: Option<TailRing>,
    /// The last byte the spool holds (a runner line starts on a line of its own).
    last: u8,
    /// Free space the log may not take (the disk reserve), checked every `DISK_CHECK_EVERY`.
    disk_floor: u64,
    since_disk_check: u64,
    /// The first write that failed: the log ends there, whole.
    failed: Option<(std::io::ErrorKind, String)>,
    /// Where the write times go ([`times_path`]), and the last mark's time.
    times: Option<File>,
    last_mark_ms: u64,
}

/// How much log may be written between two looks at the free space.
const DISK_CHECK_EVERY: u64 = 8 << 20;

/// The ring file's header: how many bytes were ever written to it and its capacity
/// (little-endian u64s), updated after each write, so a runner restarted mid-job can
/// still put the tail in order (`recover_tail`).
const RING_HEADER: u64 = 16;

/// The last `capacity` bytes of the output past the head, written round a file (after
/// its header).
struct TailRing {
    file: File,
    path: PathBuf,
    capacity: u64,
    /// Every byte ever written to the ring; `written % capacity` is where the next goes.
    written: u64,
}

impl TailRing {
    fn write(&mut self, mut chunk: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        if self.capacity == 0 {
            self.written += chunk.len() as u64;
            return Ok(());
        }
        // Only the last `capacity` bytes of a huge chunk can survive.
        if chunk.len() as u64 > self.capacity {
            let skip = chunk.len() - self.capacity as usize;
            self.written += skip as u64;
            chunk = &chunk[skip..];
        }
        while !chunk.is_empty() {
            let at = self.written % self.capacity;
            let n = chunk.len().min((self.capacity - at) as usize);
            self.file.write_all_at(&chunk[..n], RING_HEADER + at)?;
            self.written += n as u64;
            chunk = &chunk[n..];
        }
        self.write_header()
    }

    fn write_header(&self) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        let mut header = [0u8; RING_HEADER as usize];
        header[..8].copy_from_slice(&self.written.to_le_bytes());
        header[8..].copy_from_slice(&self.capacity.to_le_bytes());
        self.file.write_all_at(&header, 0)
    }

    /// A ring a stopped writer left: `None` if its header is missing or does not fit
    /// the file (then its bytes cannot be put in order).
    fn reopen(path: PathBuf) -> std::io::Result<Option<TailRing>> {
        use std::os::unix::fs::FileExt as _;
        let file = OpenOptions::new().read(true).write(true).open(&path)?;
        let mut header = [0u8; RING_HEADER as usize];
        if file.read_exact_at(&mut header, 0).is_err() {
            return Ok(None);
        }
        let word = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().unwrap_or_default());
        let ring = TailRing { file, path, written: word(0), capacity: word(8) };
        let data = ring.file.metadata()?.len().saturating_sub(RING_HEADER);
        Ok((data >= ring.kept()).then_some(ring))
    }

    fn kept(&self) -> u64 {
        self.written.min(self.capacity)
    }

    /// The kept bytes, oldest first, in pieces of at most 64 KiB.
    fn drain_into(&self, mut out: impl FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        let kept = self.kept();
        let start = if self.written > self.capacity { self.written % self.capacity } else { 0 };
        let mut buf = vec![0u8; 64 * 1024];
        let mut done = 0;
        while done < kept {
            let at = (start + done) % self.capacity.max(1);
            let n = (kept - done).min(buf.len() as u64).min(self.capacity - at) as usize;
            self.file.read_exact_at(&mut buf[..n], RING_HEADER + at)?;
            out(&buf[..n])?;
            done += n as u64;
        }
        Ok(())
    }
}

impl SpoolWriter {
    /// `disk_floor`: the log stops (the write fails, the job is stopped) rather than
    /// leave less free space than this on the state dir's disk.
    pub fn create(
        state_dir: &Path,
        job_id: &str,
        cap: LogCap,
        disk_floor: u64,
    ) -> std::io::Result<SpoolWriter> {
        let path = spool_path(state_dir, job_id);
        let file = OpenOptions::new().create(true).truncate(true).write(true).mode(0o600).open(&path)?;
        let times = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(times_path(state_dir, job_id))
            .ok();
        Ok(SpoolWriter {
            times,
            last_mark_ms: 0,
            file,
            path,
            len: 0,
            hasher: Sha256::new(),
            cap,
            tail: None,
            last: b'\n',
            disk_floor,
            since_disk_check: DISK_CHECK_EVERY,
            failed: None,
        })
    }

    /// Refuse the write if the disk is down to the reserve (or its space unreadable).
    fn check_disk(&mut self, n: u64) -> std::io::Result<()> {
        self.since_disk_check += n;
        if self.disk_floor == 0 || self.since_disk_check < DISK_CHECK_EVERY {
            return Ok(());
        }
        self.since_disk_check = 0;
        let dir = self.path.parent().unwrap_or(Path::new("/"));
        let free = crate::disk::space(dir)?.free;
        if free < self.disk_floor + n {
            return Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                format!(
                    "the runner's disk has {} MiB free, and the last {} MiB are kept for the audit log and journal",
                    free >> 20,
                    self.disk_floor >> 20
                ),
            ));
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn append(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        if let Err(e) = self.file.write_all(chunk) {
            // Cut what part of the chunk reached the file: the log and its digest agree.
            self.file.set_len(self.len)?;
            self.file.seek(SeekFrom::Start(self.len))?;
            return Err(e);
        }
        self.hasher.update(chunk);
        self.mark_time();
        self.len += chunk.len() as u64;
        if let Some(&b) = chunk.last() {
            self.last = b;
        }
        Ok(())
    }

    /// Note when the bytes from the current end on are written (at most one mark every
    /// `TIME_MARK_MS`: one clock read per write, one small write now and then).
    fn mark_time(&mut self) {
        let now = crate::clock::now_ms();
        if now < self.last_mark_ms + TIME_MARK_MS {
            return;
        }
        self.last_mark_ms = now;
        if let Some(times) = &mut self.times {
            let mut mark = [0u8; 16];
            mark[..8].copy_from_slice(&self.len.to_le_bytes());
            mark[8..].copy_from_slice(&now.to_le_bytes());
            if times.write_all(&mark).is_err() {
                // No labels from here on; the log itself is unaffected.
                self.times = None;
            }
        }
    }

    /// A line of the runner's own, on a line of its own.
    fn append_note(&mut self, note: &str) -> std::io::Result<()> {
        if self.last != b'\n' {
            self.append(b"\n")?;
        }
        self.append(note.as_bytes())
    }

    fn start_tail(&mut self) -> std::io::Result<&mut TailRing> {
        if self.tail.is_none() {
            let path = self.path.with_extension("tail");
            let file = OpenOptions::new()
                .create(true)
                .truncate(true)
                .read(true)
                .write(true)
                .mode(0o600)
                .open(&path)?;
            let ring = TailRing { file, path, capacity: self.cap.tail, written: 0 };
            ring.write_header()?;
            self.tail = Some(ring);
        }
        Ok(self.tail.as_mut().expect("just set"))
    }

    /// Append the omission marker and the tail, fsync, and return what the spool holds.
    pub fn finish(self) -> std::io::Result<SpoolDigest> {
        self.finish_with(None)
    }

    /// As [`Self::finish`], with `last` (the job's outcome, in the runner's words) as
    /// the log's last line, after the tail: a log never just stops.
    pub fn finish_with(mut self, last: Option<&str>) -> std::io::Result<SpoolDigest> {
        // Written even after a failed write (a job that filled the disk to its reserve
        // must not have the last word): a line fits in the reserve. If the disk takes
        // not even that, the log ends where it is.
        let write_last = |w: &mut SpoolWriter| {
            if let Some(line) = last {
                let _ = w.append_note(&format!("{}\n", line.trim_end()));
            }
        };
        let mut omitted = 0;
        if let Some(ring) = self.tail.take() {
            if self.failed.is_some() {
                // The disk is at its reserve: copying the tail in would take what the
                // journal and audit log are kept. The log ends where writing failed.
                drop(ring.file);
                let _ = std::fs::remove_file(&ring.path);
                write_last(&mut self);
                self.file.sync_all()?;
                let omitted = ring.written;
                return Ok(SpoolDigest {
                    size: self.len,
                    sha256: hex::encode(self.hasher.finalize()),
                    omitted,
                });
            }
            omitted = ring.written - ring.kept();
            if omitted > 0 {
                self.append_note(&format!("[runner] … {omitted} bytes omitted …\n"))?;
            }
            ring.drain_into(|piece| self.append(piece))?;
            if omitted > 0 {
                let end = format!(
                    "[runner] log truncated: {omitted} bytes omitted; kept the first {} and the last {} bytes\n",
                    self.cap.head,
                    ring.kept()
                );
                self.append_note(&end)?;
            }
            write_last(&mut self);
            self.file.sync_all()?;
            drop(ring.file);
            if let Err(e) = std::fs::remove_file(&ring.path) {
                tracing::warn!(error = %e, path = %ring.path.display(), "Could not remove the log's tail ring: {e}.");
            }
        } else {
            write_last(&mut self);
        }
        self.file.sync_all()?;
        Ok(SpoolDigest { size: self.len, sha256: hex::encode(self.hasher.finalize()), omitted })
    }

    fn write_capped(&mut self, mut chunk: &[u8]) -> std::io::Result<()> {
        if self.tail.is_none() {
            let room = self.cap.head.saturating_sub(self.len);
            let n = chunk.len().min(usize::try_from(room).unwrap_or(usize::MAX));
            self.append(&chunk[..n])?;
            chunk = &chunk[n..];
            if chunk.is_empty() {
                return Ok(());
            }
        }
        let ring = self.start_tail()?;
        let was_whole = ring.written <= ring.capacity;
        ring.write(chunk)?;
        if was_whole && ring.written > ring.capacity {
            // Output is being dropped from now on: say so at once, for whoever follows
            // the log live (it pauses here until the job ends).
            let note = format!(
                "[runner] the job's log reached its cap of {} bytes (jobs.log_max_mib): output is dropped from here, except the last {} bytes, which follow when the job ends\n",
                self.cap.max_bytes(),
                self.cap.tail
            );
            self.append_note(&note)?;
        }
        Ok(())
    }
}

impl OutputSink for SpoolWriter {
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        if let Some((kind, why)) = &self.failed {
            return Err(std::io::Error::new(*kind, why.clone()));
        }
        let written = self.check_disk(chunk.len() as u64).and_then(|()| self.write_capped(chunk));
        if let Err(e) = &written {
            self.failed = Some((e.kind(), e.to_string()));
        }
        written
    }
}

/// A job the runner stopped under while its log was past the cap: the tail its ring
/// holds is put after the head as `finish` would have (omission marker, tail, the
/// truncation line), the spool fsynced, the ring removed. `None` when there is no ring
/// (the log never reached the cap); a ring whose header does not fit is removed and
/// the head stands as the log.
pub fn recover_tail(state_dir: &Path, job_id: &str, cap: LogCap) -> std::io::Result<Option<SpoolDigest>> {
    let ring_path = tail_path(state_dir, job_id);
    let ring = match TailRing::reopen(ring_path.clone()) {
        Ok(Some(ring)) => ring,
        Ok(None) => {
            std::fs::remove_file(&ring_path)?;
            return Ok(None);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let path = spool_path(state_dir, job_id);
    let mut file = OpenOptions::new().read(true).append(true).open(&path)?;
    let (mut hasher, mut len, mut last) = (Sha256::new(), 0u64, b'\n');
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        len += n as u64;
        last = buf[n - 1];
    }
    let writer = SpoolWriter {
        file,
        path,
        len,
        hasher,
        cap: LogCap { tail: ring.capacity, ..cap },
        tail: Some(ring),
        last,
        disk_floor: 0,
        since_disk_check: 0,
        failed: None,
        times: OpenOptions::new().append(true).open(times_path(state_dir, job_id)).ok(),
        last_mark_ms: 0,
    };
    writer.finish().map(Some)
}

/// Append `line` to the spooled log at `path` on a line of its own, fsynced (the
/// writer's state is gone: a runner restarted under the job).
pub fn append_last_line(path: &Path, line: &str) -> std::io::Result<()> {
    let mut file = OpenOptions::new().read(true).append(true).open(path)?;
    let len = file.metadata()?.len();
    let mut last = [b'\n'];
    if len > 0 {
        use std::os::unix::fs::FileExt as _;
        file.read_exact_at(&mut last, len - 1)?;
    }
    let mut bytes = Vec::with_capacity(line.len() + 2);
    if last[0] != b'\n' {
        bytes.push(b'\n');
    }
    bytes.extend_from_slice(line.trim_end().as_bytes());
    bytes.push(b'\n');
    file.write_all(&bytes)?;
    file.sync_all()
}

/// Size and SHA-256 of a spooled log (after a crash the writer's state is gone). A
/// missing spool is an empty log.
pub fn digest_file(path: &Path) -> std::io::Result<(u64, String)> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok((0, hex::encode(Sha256::digest(b""))));
        }
        Err(e) => return Err(e),
    };
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut len = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        len += n as u64;
    }
    Ok((len, hex::encode(hasher.finalize())))
}

#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("reading log spool {path}: {source}")]
    Spool { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(
        "control plane holds {server} log bytes for job {job_id} but the spool has only {local}; refusing to continue this upload"
    )]
    ServerAhead { job_id: String, server: u64, local: u64 },
}

/// Uploads a job's spool by offset. `uploaded` is the runner's belief of the server's
/// offset; the server corrects it with a 416 when they disagree.
pub struct Uploader {
    pub job_id: String,
    pub path: PathBuf,
    pub uploaded: u64,
}

impl Uploader {
    pub fn new(state_dir: &Path, job_id: &str) -> Uploader {
        Uploader { job_id: job_id.to_string(), path: spool_path(state_dir, job_id), uploaded: 0 }
    }

    /// Upload everything that is durably in the spool now.
    pub async fn upload_available(&mut self, client: &dyn ControlPlane) -> Result<(), UploadError> {
        let spool_err = |e| UploadError::Spool { path: self.path.clone(), source: e };
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(spool_err(e)),
        };
        // fsync on this descriptor flushes the file's data written through any other.
        file.sync_data().map_err(spool_err)?;
        let durable = file.metadata().map_err(spool_err)?.len();
        let mut buf = vec![0u8; UPLOAD_CHUNK];
        let mut corrections = 0;
        while self.uploaded < durable {
            let n = ((durable - self.uploaded) as usize).min(UPLOAD_CHUNK);
            file.seek(SeekFrom::Start(self.uploaded)).map_err(spool_err)?;
            file.read_exact(&mut buf[..n]).map_err(spool_err)?;
            match client.append_log(&self.job_id, self.uploaded, &buf[..n]).await {
                Ok(server_offset) => self.uploaded = server_offset,
                Err(ClientError::LogOffset { server_offset }) => {
                    corrections += 1;
                    if server_offset > durable {
                        return Err(UploadError::ServerAhead {
                            job_id: self.job_id.clone(),
                            server: server_offset,
                            local: durable,
                        });
                    }
                    if corrections > 8 {
                        return Err(ClientError::Protocol("log offset keeps moving".into()).into());
                    }
                    tracing::debug!(job_id = %self.job_id, server_offset, "Log offset corrected by control plane.");
                    self.uploaded = server_offset;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writer(dir: &Path, cap: LogCap) -> SpoolWriter {
        std::fs::create_dir_all(StateDir::of(dir).spool()).expect("spool dir");
        SpoolWriter::create(dir, "job-1", cap, 0).expect("spool")
    }

    /// Output written in uneven pieces: 1 byte up to 3 KiB, numbered lines so any
    /// misplaced byte shows.
    fn output(len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 16);
        let mut i = 0u64;
        while out.len() < len {
            out.extend_from_slice(format!("line {i:08}\n").as_bytes());
            i += 1;
        }
        out.truncate(len);
        out
    }

    fn write_unevenly(w: &mut SpoolWriter, bytes: &[u8]) {
        let mut at = 0;
        let mut step = 1;
        while at < bytes.len() {
            let n = step.min(bytes.len() - at);
            w.write(&bytes[at..at + n]).expect("write");
            at += n;
            step = (step * 7 + 3) % 3072 + 1;
        }
    }

    #[test]
    fn a_runner_stopped_past_the_cap_still_puts_the_tail_after_the_head() {
        let out = output(300_001);
        let cap = LogCap { head: 10_000, tail: 7_000 };
        // What the job's end would have kept ...
        let whole = tempfile::tempdir().expect("tempdir");
        let mut w = writer(whole.path(), cap);
        write_unevenly(&mut w, &out);
        let finished = w.finish().expect("finish");
        // ... is what a restart keeps from a writer that stopped there (killed: no finish).
        let dir = tempfile::tempdir().expect("tempdir");
        let mut w = writer(dir.path(), cap);
        write_unevenly(&mut w, &out);
        drop(w);
        let recovered = recover_tail(dir.path(), "job-1", cap).expect("recover").expect("a ring");
        assert_eq!(recovered, finished);
        assert_eq!(
            std::fs::read(spool_path(dir.path(), "job-1")).unwrap(),
            std::fs::read(spool_path(whole.path(), "job-1")).unwrap()
        );
        assert!(!tail_path(dir.path(), "job-1").exists());
        // No ring (the log never reached its cap): nothing to do.
        assert_eq!(recover_tail(dir.path(), "job-1", cap).unwrap(), None);
        // A ring whose header does not fit its file cannot be ordered: removed, the head stands.
        std::fs::write(tail_path(dir.path(), "job-1"), [0xffu8; 20]).unwrap();
        assert_eq!(recover_tail(dir.path(), "job-1", cap).unwrap(), None);
        assert!(!tail_path(dir.path(), "job-1").exists());
    }

    #[test]
    fn a_log_under_the_cap_is_kept_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut w = writer(dir.path(), LogCap::of(64 * 1024));
        let out = output(64 * 1024);
        write_unevenly(&mut w, &out);
        let d = w.finish().expect("finish");
        let kept = std::fs::read(spool_path(dir.path(), "job-1")).expect("spool");
        assert_eq!(kept, out);
        assert_eq!((d.size, d.sha256, d.omitted), (out.len() as u64, byoc_protocol::sha256_hex(&out), 0));
        assert!(!tail_path(dir.path(), "job-1").exists());
    }

    #[test]
    fn past_the_cap_the_head_and_the_tail_are_kept_and_the_rest_is_counted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cap = LogCap { head: 10_000, tail: 7_000 };
        let mut w = writer(dir.path(), cap);
        let out = output(1_000_003);
        write_unevenly(&mut w, &out[..500_000]);
        // Disk use is bounded while the job still runs: the spool holds the head and a
        // note, the ring at most the tail.
        let spool_len = std::fs::metadata(spool_path(dir.path(), "job-1")).expect("spool").len();
        let ring_len = std::fs::metadata(tail_path(dir.path(), "job-1")).expect("ring").len();
        assert!(
            spool_len < cap.head + 300 && ring_len <= cap.tail + RING_HEADER,
            "spool {spool_len}, ring {ring_len}"
        );
        write_unevenly(&mut w, &out[500_000..]);
        let d = w.finish().expect("finish");
        let kept = std::fs::read(spool_path(dir.path(), "job-1")).expect("spool");
        assert_eq!(d.omitted, out.len() as u64 - cap.max_bytes());
        assert_eq!(
            (d.size, d.sha256.as_str()),
            (kept.len() as u64, byoc_protocol::sha256_hex(&kept).as_str())
        );
        assert!(kept.starts_with(&out[..cap.head as usize]));
        let text = String::from_utf8_lossy(&kept);
        let marker = format!("[runner] … {} bytes omitted …\n", d.omitted);
        let after_marker = text.find(&marker).expect("omission marker") + marker.len();
        let tail = &out[out.len() - cap.tail as usize..];
        assert_eq!(&kept[after_marker..after_marker + tail.len()], tail);
        assert!(text.ends_with(&format!(
            "log truncated: {} bytes omitted; kept the first 10000 and the last 7000 bytes\n",
            d.omitted
        )));
        assert!(!tail_path(dir.path(), "job-1").exists(), "the ring was left behind");
    }

    #[test]
    fn one_write_larger_than_the_whole_cap_keeps_its_own_head_and_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cap = LogCap::of(4096);
        let mut w = writer(dir.path(), cap);
        let out = output(100_000);
        w.write(&out).expect("write");
        let d = w.finish().expect("finish");
        let kept = std::fs::read(spool_path(dir.path(), "job-1")).expect("spool");
        assert!(kept.starts_with(&out[..2048]));
        assert_eq!(d.omitted, 100_000 - 4096);
        let tail = &out[out.len() - 2048..];
        assert!(kept.windows(tail.len()).any(|w| w == tail), "the last 2048 bytes are missing");
    }

    #[test]
    fn after_a_failed_write_the_tail_is_not_copied_in_and_counts_as_omitted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut w = writer(dir.path(), LogCap { head: 1000, tail: 1000 });
        let out = output(1500);
        w.write(&out).expect("write");
        // As a full disk would: the next write fails and the writer stays failed.
        w.failed = Some((std::io::ErrorKind::StorageFull, "disk full".into()));
        assert!(w.write(b"more").is_err());
        let d = w.finish().expect("finish");
        let kept = std::fs::read(spool_path(dir.path(), "job-1")).expect("spool");
        assert_eq!(kept, &out[..1000]);
        assert_eq!((d.size, d.omitted), (1000, 500));
        assert_eq!(d.sha256, byoc_protocol::sha256_hex(&kept));
        assert!(!tail_path(dir.path(), "job-1").exists());
    }

    #[test]
    fn the_runners_line_is_the_last_even_after_a_job_filled_the_disk_or_faked_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut w = writer(dir.path(), LogCap { head: 1000, tail: 1000 });
        w.write(b"[runner] job succeeded, exit code 0\nmore").expect("write");
        w.failed = Some((std::io::ErrorKind::StorageFull, "the disk reserve".into()));
        let d = w.finish_with(Some("[runner] job failed: writing job log")).expect("finish");
        let kept = String::from_utf8(std::fs::read(spool_path(dir.path(), "job-1")).expect("spool")).unwrap();
        assert_eq!(kept, "[runner] job succeeded, exit code 0\nmore\n[runner] job failed: writing job log\n");
        assert_eq!(d.sha256, byoc_protocol::sha256_hex(kept.as_bytes()));
        // A runner restarted under the job: the line is added to what the spool holds.
        append_last_line(&spool_path(dir.path(), "job-1"), "[runner] job interrupted: x").expect("append");
        let kept = std::fs::read_to_string(spool_path(dir.path(), "job-1")).unwrap();
        assert!(kept.ends_with("writing job log\n[runner] job interrupted: x\n"), "{kept}");
    }

    #[test]
    fn output_just_past_the_head_is_kept_without_an_omission() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cap = LogCap { head: 1000, tail: 1000 };
        let mut w = writer(dir.path(), cap);
        let out = output(1500);
        write_unevenly(&mut w, &out);
        let d = w.finish().expect("finish");
        let kept = std::fs::read(spool_path(dir.path(), "job-1")).expect("spool");
        assert_eq!(d.omitted, 0);
        assert!(kept.starts_with(&out[..1000]) && kept.ends_with(&out[1000..]));
        assert!(!String::from_utf8_lossy(&kept).contains("omitted"));
    }
}
