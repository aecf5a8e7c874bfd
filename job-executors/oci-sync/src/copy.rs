//! The copy: walk the artifact from its root digest (index → manifests → blobs, and
//! referrers), copy blobs in parallel (skip what the destination has, mount within one
//! registry, otherwise stream with the digest checked on the way), push manifests
//! children first by digest, and only then apply tags.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures_util::StreamExt as _;
use serde::Serialize;
use sha2::Digest as _;
use tokio_util::sync::CancellationToken;

use crate::client::{OCI_INDEX, Registry};
use crate::error::{Side, SyncError};
use crate::manifest::{Descriptor, Parsed, index_entries, index_of};
use crate::reference::Digest;

/// Blobs up to this size go in one request, read into memory.
const SMALL_BLOB: u64 = 1 << 20;
/// How deep referrers of referrers are followed (a signature of an SBOM of an image).
const REFERRER_DEPTH: u32 = 3;
/// Upload restarts per blob when the destination dropped a cut upload.
const BLOB_RESTARTS: u32 = 3;
/// Source re-opens (HTTP Range) per blob after cut connections.
const SOURCE_REOPENS: u32 = 8;

#[derive(Debug, Clone)]
pub struct Options {
    /// Blobs copied at once.
    pub parallel: usize,
    /// Bytes per upload chunk (PATCH); a cut chunk is resumed where the registry allows.
    pub chunk_size: u64,
    pub referrers: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { parallel: 4, chunk_size: 64 << 20, referrers: true }
    }
}

/// Live counters (progress on a terminal reads them while the copy runs).
#[derive(Debug, Default)]
pub struct Counters {
    pub bytes_total: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_done: AtomicU64,
    pub blobs_total: AtomicU64,
    pub blobs_done: AtomicU64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    pub source: String,
    pub destination: String,
    pub digest: String,
    pub media_type: String,
    pub tags: Vec<String>,
    pub manifests: usize,
    pub manifests_pushed: usize,
    pub blobs: usize,
    pub blobs_moved: usize,
    pub blobs_skipped: usize,
    pub blobs_mounted: usize,
    /// Sizes of the blobs copied (each counted once, however often it was resumed).
    pub bytes_moved: u64,
    /// Sizes of the blobs the destination already had or mounted.
    pub bytes_skipped: u64,
    /// Bytes read from the source, resumes included.
    pub bytes_read: u64,
    pub referrers: usize,
    /// Resumptions after cut connections (source re-opens and upload resumes).
    pub resumed: u64,
    /// Blob uploads started over because the destination dropped a cut upload.
    pub restarted: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum BlobOutcome {
    Moved,
    Skipped,
    Mounted,
}

struct Node {
    digest: Digest,
    media_type: String,
    bytes: Bytes,
}

#[derive(Default)]
struct Plan {
    /// Children before parents, subjects before their referrers.
    manifests: Vec<Node>,
    blobs: BTreeMap<Digest, u64>,
    /// Subject → referrer descriptors found at the source.
    referrers: BTreeMap<Digest, Vec<Descriptor>>,
    seen: HashSet<Digest>,
}

pub struct Copier {
    pub src: Arc<Registry>,
    pub dst: Arc<Registry>,
    pub options: Options,
    pub counters: Arc<Counters>,
    pub cancel: CancellationToken,
    resumed: AtomicU64,
    restarted: AtomicU64,
}

impl Copier {
    pub fn new(src: Arc<Registry>, dst: Arc<Registry>, options: Options) -> Copier {
        Copier {
            src,
            dst,
            options,
            counters: Arc::default(),
            cancel: CancellationToken::new(),
            resumed: AtomicU64::new(0),
            restarted: AtomicU64::new(0),
        }
    }

    /// Copy `src_repo@reference` (a digest, or a tag for the CLI) to `dst_repo`, then
    /// tag it `tags`. `expected` pins the root digest: any other content is refused.
    pub async fn copy(
        &self,
        src_repo: &str,
        reference: &str,
        expected: Option<&Digest>,
        dst_repo: &str,
        tags: &[String],
    ) -> Result<Report, SyncError> {
        tokio::select! {
            r = self.copy_inner(src_repo, reference, expected, dst_repo, tags) => r,
            _ = self.cancel.cancelled() => Err(SyncError::Cancelled),
        }
    }

    async fn copy_inner(
        &self,
        src_repo: &str,
        reference: &str,
        expected: Option<&Digest>,
        dst_repo: &str,
        tags: &[String],
    ) -> Result<Report, SyncError> {
        let root_ref = expected.map(|d| d.to_string()).unwrap_or_else(|| reference.to_string());
        let root = self.src.get_manifest(src_repo, &root_ref).await?.ok_or_else(|| SyncError::NotFound {
            side: Side::Source,
            registry: self.src.name.clone(),
            what: format!("manifest {src_repo}:{root_ref}"),
        })?;
        if let Some(d) = expected
            && *d != root.digest
        {
            return Err(SyncError::DigestMismatch {
                side: Side::Source,
                registry: self.src.name.clone(),
                what: format!("manifest {src_repo}:{reference}"),
                expected: d.to_string(),
                actual: root.digest.to_string(),
            });
        }
        let mut plan = Plan::default();
        self.walk(
            &mut plan,
            src_repo,
            root.digest.clone(),
            Some((root.bytes.clone(), root.media_type.clone())),
            0,
        )
        .await?;
        let total: u64 = plan.blobs.values().sum();
        self.counters.bytes_total.store(total, Ordering::Relaxed);
        self.counters.blobs_total.store(plan.blobs.len() as u64, Ordering::Relaxed);

        let outcomes = self.copy_blobs(&plan, src_repo, dst_repo).await?;

        // Manifests by digest, children first: nothing is tagged yet.
        let mut pushed = 0;
        for m in &plan.manifests {
            if self.dst.head_manifest(dst_repo, m.digest.as_str()).await?.is_none() {
                self.dst.put_manifest(dst_repo, m.digest.as_str(), &m.media_type, &m.bytes).await?;
                pushed += 1;
            }
        }

        // Tags last: every blob and manifest has arrived and been verified.
        for (subject, entries) in &plan.referrers {
            self.publish_referrers(dst_repo, subject, entries).await?;
        }
        for t in tags {
            let current = self.dst.head_manifest(dst_repo, t).await?;
            if current.as_deref() != Some(root.digest.as_str()) {
                self.dst.put_manifest(dst_repo, t, &root.media_type, &root.bytes).await?;
            }
        }

        let sum = |want: BlobOutcome| -> (usize, u64) {
            outcomes.iter().filter(|(_, o)| *o == want).fold((0, 0), |(n, b), (s, _)| (n + 1, b + s))
        };
        let (moved, bytes_moved) = sum(BlobOutcome::Moved);
        let (skipped, bytes_present) = sum(BlobOutcome::Skipped);
        let (mounted, bytes_mounted) = sum(BlobOutcome::Mounted);
        Ok(Report {
            source: format!("{}/{src_repo}@{}", self.src.name, root.digest),
            destination: format!("{}/{dst_repo}@{}", self.dst.name, root.digest),
            digest: root.digest.to_string(),
            media_type: root.media_type.clone(),
            tags: tags.to_vec(),
            manifests: plan.manifests.len(),
            manifests_pushed: pushed,
            blobs: plan.blobs.len(),
            blobs_moved: moved,
            blobs_skipped: skipped,
            blobs_mounted: mounted,
            bytes_moved,
            bytes_skipped: bytes_present + bytes_mounted,
            bytes_read: self.counters.bytes_read.load(Ordering::Relaxed),
            referrers: plan.referrers.values().map(Vec::len).sum(),
            resumed: self.resumed.load(Ordering::Relaxed),
            restarted: self.restarted.load(Ordering::Relaxed),
        })
    }

    /// The plan's blobs, several at once; the first error stops the rest. Each blob's
    /// size with how it arrived.
    async fn copy_blobs(
        &self,
        plan: &Plan,
        src_repo: &str,
        dst_repo: &str,
    ) -> Result<Vec<(u64, BlobOutcome)>, SyncError> {
        let mut outcomes = Vec::with_capacity(plan.blobs.len());
        // Owned items: a closure over borrowed ones is not `Send` for every lifetime.
        let blobs: Vec<(Digest, u64)> = plan.blobs.iter().map(|(d, s)| (d.clone(), *s)).collect();
        let mut stream = futures_util::stream::iter(blobs)
            .map(|(d, size)| async move {
                let r = self.copy_blob(src_repo, dst_repo, &d, size).await;
                (d, size, r)
            })
            .buffer_unordered(self.options.parallel.max(1));
        while let Some((d, size, r)) = stream.next().await {
            let outcome = r?;
            tracing::debug!(digest = %d, size, ?outcome, "Blob copied.");
            self.counters.blobs_done.fetch_add(1, Ordering::Relaxed);
            self.counters.bytes_done.fetch_add(size, Ordering::Relaxed);
            outcomes.push((size, outcome));
        }
        Ok(outcomes)
    }

    /// Collect a manifest, its children and blobs, then its referrers.
    fn walk<'a>(
        &'a self,
        plan: &'a mut Plan,
        repo: &'a str,
        digest: Digest,
        fetched: Option<(Bytes, String)>,
        depth: u32,
    ) -> futures_util::future::BoxFuture<'a, Result<(), SyncError>> {
        Box::pin(async move {
            if !plan.seen.insert(digest.clone()) {
                return Ok(());
            }
            let (bytes, header_type) = match fetched {
                Some(f) => f,
                None => {
                    let m = self.src.get_manifest(repo, digest.as_str()).await?.ok_or_else(|| {
                        SyncError::NotFound {
                            side: Side::Source,
                            registry: self.src.name.clone(),
                            what: format!("manifest {repo}@{digest}"),
                        }
                    })?;
                    (m.bytes, m.media_type)
                }
            };
            let parsed = Parsed::parse(&bytes, &header_type).map_err(|e| SyncError::Invalid {
                what: format!("manifest {repo}@{digest} from the source"),
                reason: e.0,
            })?;
            let media_type = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v.get("mediaType").and_then(|m| m.as_str()).map(str::to_string))
                .filter(|m| !m.is_empty())
                .unwrap_or(header_type);
            match parsed {
                Parsed::Index(children) => {
                    for (d, _) in children {
                        self.walk(plan, repo, d, None, depth).await?;
                    }
                }
                Parsed::Image(blobs) => plan.blobs.extend(blobs),
            }
            plan.manifests.push(Node { digest: digest.clone(), media_type, bytes });
            if self.options.referrers && depth < REFERRER_DEPTH {
                let entries = self.source_referrers(repo, &digest).await?;
                for e in &entries {
                    let d = Digest::parse(&e.digest).map_err(|e| SyncError::Invalid {
                        what: format!("referrer of {digest} at the source"),
                        reason: e.0,
                    })?;
                    self.walk(plan, repo, d, None, depth + 1).await?;
                }
                if !entries.is_empty() {
                    plan.referrers.insert(digest, entries);
                }
            }
            Ok(())
        })
    }

    /// Referrers from the referrers API, else from the tag schema.
    async fn source_referrers(&self, repo: &str, digest: &Digest) -> Result<Vec<Descriptor>, SyncError> {
        let index = match self.src.referrers_api(repo, digest).await? {
            Some(b) => Some(b),
            None => self.src.get_manifest(repo, &digest.fallback_tag()).await?.map(|m| m.bytes),
        };
        match index {
            None => Ok(vec![]),
            Some(b) => index_entries(&b).map_err(|e| SyncError::Invalid {
                what: format!("referrers of {digest} at the source"),
                reason: e.0,
            }),
        }
    }

    /// Make the referrers findable at the destination: registries with the referrers
    /// API index them from the pushed manifests' `subject`; for the others, merge them
    /// into the `sha256-<hex>` fallback tag (OCI distribution spec, tag schema).
    async fn publish_referrers(
        &self,
        repo: &str,
        subject: &Digest,
        entries: &[Descriptor],
    ) -> Result<(), SyncError> {
        if self.dst.referrers_api(repo, subject).await?.is_some() {
            return Ok(());
        }
        let tag = subject.fallback_tag();
        let mut merged = match self.dst.get_manifest(repo, &tag).await? {
            Some(m) => index_entries(&m.bytes).unwrap_or_default(),
            None => vec![],
        };
        let before = merged.len();
        for e in entries {
            if !merged.iter().any(|m| m.digest == e.digest) {
                merged.push(e.clone());
            }
        }
        if merged.len() == before && before > 0 {
            return Ok(());
        }
        self.dst.put_manifest(repo, &tag, OCI_INDEX, &Bytes::from(index_of(&merged))).await?;
        Ok(())
    }

    async fn copy_blob(
        &self,
        src_repo: &str,
        dst_repo: &str,
        digest: &Digest,
        size: u64,
    ) -> Result<BlobOutcome, SyncError> {
        if self.dst.blob_size(dst_repo, digest).await?.is_some() {
            return Ok(BlobOutcome::Skipped);
        }
        if self.src.name == self.dst.name && self.dst.mount(dst_repo, digest, src_repo).await? {
            return Ok(BlobOutcome::Mounted);
        }
        let mut restarts = 0;
        loop {
            match self.upload_blob(src_repo, dst_repo, digest, size).await {
                Ok(()) => return Ok(BlobOutcome::Moved),
                Err(Upload::Restart(reason)) if restarts < BLOB_RESTARTS => {
                    restarts += 1;
                    self.restarted.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%digest, reason, restarts, "Destination dropped the upload; starting this blob over.");
                }
                Err(Upload::Restart(reason)) => {
                    return Err(self.dst.err_transport(
                        &format!("uploading blob {digest} to {dst_repo}"),
                        format!("{reason} (gave up after {restarts} restarts)"),
                    ));
                }
                Err(Upload::Fatal(e)) => return Err(e),
            }
        }
    }

    async fn upload_blob(
        &self,
        src_repo: &str,
        dst_repo: &str,
        digest: &Digest,
        size: u64,
    ) -> Result<(), Upload> {
        let mut upload = self.dst.start_upload(dst_repo).await?;
        let reader = Arc::new(tokio::sync::Mutex::new(SourceReader::new(
            self.src.clone(),
            src_repo,
            digest.clone(),
            size,
            self.counters.clone(),
        )));
        if size <= SMALL_BLOB {
            let mut body = bytes::BytesMut::with_capacity(size as usize);
            let mut r = reader.lock().await;
            while let Some(b) = r.next(size - body.len() as u64).await? {
                body.extend_from_slice(&b);
            }
            r.verify()?;
            self.add_resumes(&r);
            drop(r);
            return Ok(self.dst.finish_upload(dst_repo, &upload, digest, body.freeze()).await?);
        }
        let mut offset = 0u64;
        while offset < size {
            let len = self.options.chunk_size.min(size - offset);
            let snapshot = reader.lock().await.snapshot();
            let body = reqwest::Body::wrap_stream(chunk_stream(reader.clone(), len));
            match self.dst.patch_upload(dst_repo, &upload, offset, len, body).await {
                Ok(next) => {
                    upload = next;
                    offset += len;
                }
                Err(e) => {
                    if let Some(src_err) = reader.lock().await.failure.take() {
                        self.dst.cancel_upload(dst_repo, &upload).await;
                        return Err(Upload::Fatal(src_err));
                    }
                    if matches!(e, SyncError::Unauthorized { .. } | SyncError::Forbidden { .. }) {
                        return Err(Upload::Fatal(e));
                    }
                    // 404 on a chunk is BLOB_UPLOAD_UNKNOWN: the registry dropped the
                    // session (distribution does so after a cut chunk, possibly after it
                    // already answered a status query that let us resume). The
                    // repository exists (the upload was opened), so start the blob over.
                    if matches!(e, SyncError::NotFound { .. }) {
                        return Err(Upload::Restart(e.to_string()));
                    }
                    let status = self.dst.upload_status(dst_repo, &upload).await;
                    match status {
                        Ok(Some((held, next))) if held >= offset && held <= offset + len => {
                            tracing::info!(%digest, held, "Resuming a cut upload where the destination stands.");
                            self.resumed.fetch_add(1, Ordering::Relaxed);
                            let mut r = reader.lock().await;
                            r.restore(snapshot);
                            // Bytes the destination already has: read and hash, not resend.
                            while r.pos < held {
                                let want = held - r.pos;
                                if r.next(want).await?.is_none() {
                                    break;
                                }
                            }
                            upload = next;
                            offset = held;
                        }
                        Ok(_) => {
                            self.dst.cancel_upload(dst_repo, &upload).await;
                            return Err(Upload::Restart(e.to_string()));
                        }
                        Err(status_err) => {
                            return Err(Upload::Restart(format!(
                                "{e}; then asking the upload's status: {status_err}"
                            )));
                        }
                    }
                }
            }
        }
        let r = reader.lock().await;
        self.add_resumes(&r);
        if let Err(e) = r.verify() {
            self.dst.cancel_upload(dst_repo, &upload).await;
            return Err(Upload::Fatal(e));
        }
        drop(r);
        Ok(self.dst.finish_upload(dst_repo, &upload, digest, Bytes::new()).await?)
    }

    fn add_resumes(&self, r: &SourceReader) {
        self.resumed.fetch_add(r.reopens as u64, Ordering::Relaxed);
    }
}

enum Upload {
    Restart(String),
    Fatal(SyncError),
}

impl From<SyncError> for Upload {
    fn from(e: SyncError) -> Self {
        Upload::Fatal(e)
    }
}

/// The source side of one blob: a streaming GET that re-opens with a Range request
/// where a connection was cut, hashing every byte it hands out.
struct SourceReader {
    src: Arc<Registry>,
    repo: String,
    digest: Digest,
    size: u64,
    pos: u64,
    hasher: sha2::Sha256,
    resp: Option<reqwest::Response>,
    pending: Bytes,
    reopens: u32,
    reopen_backoff: byoc_protocol::backoff::Backoff,
    counters: Arc<Counters>,
    /// Set when the source fails for good while a chunk streams (the upload sees only
    /// a broken body).
    failure: Option<SyncError>,
}

struct Snapshot {
    pos: u64,
    hasher: sha2::Sha256,
}

impl SourceReader {
    fn new(
        src: Arc<Registry>,
        repo: &str,
        digest: Digest,
        size: u64,
        counters: Arc<Counters>,
    ) -> SourceReader {
        SourceReader {
            reopen_backoff: src.retry.backoff(),
            src,
            repo: repo.to_string(),
            digest,
            size,
            pos: 0,
            hasher: sha2::Sha256::new(),
            resp: None,
            pending: Bytes::new(),
            reopens: 0,
            counters,
            failure: None,
        }
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot { pos: self.pos, hasher: self.hasher.clone() }
    }

    fn restore(&mut self, s: Snapshot) {
        self.pos = s.pos;
        self.hasher = s.hasher;
        self.resp = None;
        self.pending = Bytes::new();
    }

    fn what(&self) -> String {
        format!("blob {} in {}", self.digest, self.repo)
    }

    /// Up to `max` next bytes; `None` at the blob's declared size.
    async fn next(&mut self, max: u64) -> Result<Option<Bytes>, SyncError> {
        if self.pos >= self.size || max == 0 {
            return Ok(None);
        }
        loop {
            if self.pending.is_empty() {
                if self.resp.is_none() {
                    self.resp = Some(self.src.get_blob(&self.repo, &self.digest, self.pos).await?);
                }
                let chunk = match self.resp.as_mut().map(|r| r.chunk()) {
                    Some(fut) => fut.await,
                    None => continue,
                };
                match chunk {
                    Ok(Some(b)) => self.pending = b,
                    Ok(None) | Err(_) => {
                        // Cut (or ended early): re-open at the current position.
                        let reason = match chunk {
                            Err(e) => crate::client::error_chain(&e),
                            _ => format!("the source ended at byte {} of {}", self.pos, self.size),
                        };
                        self.resp = None;
                        self.reopens += 1;
                        if self.reopens > SOURCE_REOPENS {
                            return Err(self.src.err_transport(
                                &self.what(),
                                format!("{reason} (gave up after {SOURCE_REOPENS} resumptions)"),
                            ));
                        }
                        tracing::info!(digest = %self.digest, pos = self.pos, reason, "Resuming the source download.");
                        tokio::time::sleep(self.reopen_backoff.next_delay()).await;
                        continue;
                    }
                }
            }
            let take = (self.pending.len() as u64).min(max).min(self.size - self.pos) as usize;
            let out = self.pending.split_to(take);
            self.hasher.update(&out);
            self.pos += take as u64;
            self.counters.bytes_read.fetch_add(take as u64, Ordering::Relaxed);
            if self.pos == self.size {
                self.pending = Bytes::new();
                self.resp = None;
            }
            return Ok(Some(out));
        }
    }

    /// Every byte was read: the content must be exactly what the digest names.
    fn verify(&self) -> Result<(), SyncError> {
        let actual = format!("sha256:{}", hex::encode(self.hasher.clone().finalize()));
        if self.pos != self.size || actual != self.digest.as_str() {
            return Err(SyncError::DigestMismatch {
                side: Side::Source,
                registry: self.src.name.clone(),
                what: self.what(),
                expected: format!("{} ({} bytes)", self.digest, self.size),
                actual: format!("{actual} ({} bytes)", self.pos),
            });
        }
        Ok(())
    }
}

/// A request body of exactly `len` bytes from the reader. A source failure ends the
/// body with an error (and is kept in `failure` for the caller).
fn chunk_stream(
    reader: Arc<tokio::sync::Mutex<SourceReader>>,
    len: u64,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    futures_util::stream::unfold((reader, len), |(reader, left)| async move {
        if left == 0 {
            return None;
        }
        let mut r = reader.lock().await;
        match r.next(left).await {
            Ok(Some(b)) => {
                let n = b.len() as u64;
                drop(r);
                Some((Ok(b), (reader, left - n)))
            }
            Ok(None) => {
                let e = r
                    .src
                    .err_transport(&r.what(), format!("the source ended at byte {} of {}", r.pos, r.size));
                r.failure = Some(e);
                drop(r);
                Some((Err(std::io::Error::other("source ended early")), (reader, 0)))
            }
            Err(e) => {
                r.failure = Some(e);
                drop(r);
                Some((Err(std::io::Error::other("source failed")), (reader, 0)))
            }
        }
    })
}
