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

use crate::client::{ClientError, CpClient};

pub const SPOOL_DIR: &str = "spool";
/// Largest log chunk sent in one request.
pub const UPLOAD_CHUNK: usize = 256 * 1024;

pub fn spool_path(state_dir: &Path, job_id: &str) -> PathBuf {
    state_dir.join(SPOOL_DIR).join(format!("{job_id}.log"))
}

pub struct SpoolWriter {
    file: File,
    path: PathBuf,
    len: u64,
    hasher: Sha256,
}

impl SpoolWriter {
    pub fn create(state_dir: &Path, job_id: &str) -> std::io::Result<SpoolWriter> {
        let path = spool_path(state_dir, job_id);
        let file = OpenOptions::new().create(true).truncate(true).write(true).mode(0o600).open(&path)?;
        Ok(SpoolWriter { file, path, len: 0, hasher: Sha256::new() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Fsync and return (size, SHA-256 hex) of the whole log.
    pub fn finish(self) -> std::io::Result<(u64, String)> {
        self.file.sync_all()?;
        Ok((self.len, hex::encode(self.hasher.finalize())))
    }
}

impl OutputSink for SpoolWriter {
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        self.file.write_all(chunk)?;
        self.hasher.update(chunk);
        self.len += chunk.len() as u64;
        Ok(())
    }
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
    pub async fn upload_available(&mut self, client: &CpClient) -> Result<(), UploadError> {
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
                    tracing::debug!(job_id = %self.job_id, server_offset, "log offset corrected by control plane");
                    self.uploaded = server_offset;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}
