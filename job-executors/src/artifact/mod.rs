//! Components by digest from the install's own registry: a `terraform` module, a
//! `helm` chart or a `kubernetes` manifests bundle named `<registry>/<repo>@sha256:…`
//! is fetched from the install's ECR under the job's role (ECR's authorization token
//! from the role session, never a vendor credential), every byte verified against the
//! digest (the manifest's, then its one layer's), unpacked with the strict rules of
//! `unpack.rs` and cached by digest in the state dir (bounded; least recently used
//! evicted). What runs is exactly what was synced and verified: the registry host must
//! be the install's own, the one GetAuthorizationToken names.

pub mod unpack;

use std::io::Write as _;
use std::path::{Path, PathBuf};

use byoc_oci_sync::{Digest, Reference, Registry, Side, SyncError};
use sha2::Digest as _;

use crate::ExecSettings;

/// Where unpacked artifacts are kept and how much they may hold.
#[derive(Debug, Clone)]
pub struct CacheSettings {
    /// `<state dir>/artifacts`; `None`: every job fetches afresh into its own directory.
    pub dir: Option<PathBuf>,
    /// Total size of the cache (unpacked), past which the least recently used go.
    pub max_bytes: u64,
    pub limits: unpack::Limits,
}

impl Default for CacheSettings {
    fn default() -> Self {
        CacheSettings { dir: None, max_bytes: 1 << 30, limits: unpack::Limits::default() }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("{what} must name its digest (`<registry>/<repository>@sha256:…`)")]
    NoDigest { what: String },
    #[error(
        "the artifact is fetched from the install's registry under the job's role, and this job has none (set requested_role)"
    )]
    NoRole,
    #[error("{reference} is not in the install's registry ({install}): sync it there first (oci.sync)")]
    NotInstallRegistry { reference: String, install: String },
    #[error(transparent)]
    Registry(#[from] SyncError),
    #[error("{reference}: {reason}")]
    Manifest { reference: String, reason: String },
    #[error("{reference}: the layer's bytes have digest {actual}, the manifest names {expected}")]
    LayerDigest { reference: String, expected: String, actual: String },
    #[error("{reference}: {source}")]
    Unpack { reference: String, source: unpack::UnpackError },
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
}

impl ArtifactError {
    /// The reason code the job's result carries.
    pub fn code(&self) -> String {
        match self {
            ArtifactError::NoDigest { .. } => "invalid_spec".into(),
            ArtifactError::NoRole => "artifact_no_role".into(),
            ArtifactError::NotInstallRegistry { .. } => "artifact_not_in_install_registry".into(),
            ArtifactError::Registry(SyncError::DigestMismatch { .. }) | ArtifactError::LayerDigest { .. } => {
                "artifact_digest_mismatch".into()
            }
            ArtifactError::Registry(SyncError::NotFound { .. }) => "artifact_not_found".into(),
            ArtifactError::Registry(e) => format!("artifact_{}", e.code()),
            ArtifactError::Manifest { .. } => "artifact_invalid".into(),
            ArtifactError::Unpack { source, .. } => source.code().into(),
            ArtifactError::Io { .. } => "artifact_io".into(),
        }
    }
}

/// A parsed `<registry>/<repo>@sha256:…` (checked when the job's spec is).
pub fn parse_reference(what: &str, s: &str) -> Result<Reference, crate::InvalidSpec> {
    let r = Reference::parse(s).map_err(|e| crate::InvalidSpec(format!("{what}: {e}")))?;
    if r.digest.is_none() {
        return Err(crate::InvalidSpec(
            ArtifactError::NoDigest { what: format!("{what} {s:?}") }.to_string(),
        ));
    }
    Ok(r)
}

/// Where components by digest come from.
#[derive(Debug, Clone, Default)]
pub enum ArtifactSource {
    /// The install's own registry under the job's role (ECR's token from the role
    /// session); a reference naming any other registry is refused. The runner's only
    /// source.
    #[default]
    InstallRegistry,
    /// Any registry, with the credential given (`run-local` on a vendor's machine,
    /// which has no install and no role). The digest is verified all the same.
    AnyRegistry { credential: Option<byoc_oci_sync::Credential> },
}

/// An artifact unpacked, ready to copy into a job's directory.
#[derive(Debug)]
pub struct Fetched {
    /// The unpacked tree (in the cache, or the job's own scratch when there is none).
    pub tree: PathBuf,
    pub digest: Digest,
    pub files: usize,
    pub bytes: u64,
    /// Served from the cache: nothing was fetched.
    pub cached: bool,
}

const TREE: &str = "tree";
const SIZE_FILE: &str = "size";
/// Written with every entry since no job can reach an entry writable (mirrors are bound
/// read-only, never linked into a job's tree): an entry without it was made when one
/// could have (hard links into jobs' trees) and is fetched again, never used.
const SEALED_FILE: &str = "sealed-v2";

/// Fetch (or find in the cache) the artifact `reference` names, verified and unpacked.
pub async fn fetch(settings: &ExecSettings, reference: &Reference) -> Result<Fetched, ArtifactError> {
    let digest =
        reference.digest.clone().ok_or_else(|| ArtifactError::NoDigest { what: reference.to_string() })?;
    let credential = match &settings.tools.artifact_source {
        ArtifactSource::InstallRegistry => {
            let aws = crate::oci::aws_access(settings).ok_or(ArtifactError::NoRole)?;
            // Even a cached artifact is served only to a job whose role can read the
            // install's registry, and only if the reference names that registry.
            let (install_registry, credential) = byoc_oci_sync::ecr::registry_access(&aws).await?;
            if reference.registry != install_registry {
                return Err(ArtifactError::NotInstallRegistry {
                    reference: reference.to_string(),
                    install: install_registry,
                });
            }
            Some(credential)
        }
        ArtifactSource::AnyRegistry { credential } => credential.clone(),
    };
    let cache = &settings.tools.artifacts;
    // Without a cache, beside the job's directory: never where its processes write.
    let scratch = crate::beside_work(&settings.work_dir, ".artifact");
    let home = match &cache.dir {
        Some(dir) => dir.join(digest.hex()),
        None => scratch.clone(),
    };
    if cache.dir.is_some()
        && let Some(hit) = cached(&home, &digest)
    {
        return Ok(hit);
    }
    let oci = &settings.oci;
    let http = oci.http()?;
    let registry = Registry::new(
        Side::Source,
        &reference.registry,
        oci.registry_endpoints.get(&reference.registry).map(String::as_str),
        credential,
        http,
    )?;
    let manifest = registry.get_manifest(&reference.repository, digest.as_str()).await?.ok_or_else(|| {
        SyncError::NotFound {
            side: Side::Source,
            registry: reference.registry.clone(),
            what: format!("manifest {}@{digest}", reference.repository),
        }
    })?;
    let layer = single_layer(reference, &manifest.bytes, &cache.limits)?;
    // Unpacked beside its final place, then renamed: a crash leaves no half tree.
    let parent = home.parent().unwrap_or(&home).to_path_buf();
    let io = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| ArtifactError::Io { op, path, source }
    };
    std::fs::create_dir_all(&parent).map_err(io("creating", &parent))?;
    // The job's id too: two jobs of this runner may fetch one digest at once.
    let staging =
        parent.join(format!(".staging-{}-{}-{}", digest.hex(), std::process::id(), settings.job_id));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(staging.join(TREE)).map_err(io("creating", &staging))?;
    let archive_path = staging.join("layer");
    let result = async {
        download(&registry, reference, &layer, &archive_path, &settings.cancel).await?;
        let archive = std::fs::File::open(&archive_path).map_err(io("opening", &archive_path))?;
        let unpacked = unpack::unpack(archive, &staging.join(TREE), &cache.limits)
            .map_err(|source| ArtifactError::Unpack { reference: reference.to_string(), source })?;
        std::fs::remove_file(&archive_path).map_err(io("removing", &archive_path))?;
        std::fs::write(staging.join(SIZE_FILE), format!("{} {}", unpacked.files, unpacked.bytes))
            .map_err(io("writing", &staging))?;
        std::fs::write(staging.join(SEALED_FILE), b"").map_err(io("writing", &staging))?;
        let _ = std::fs::remove_dir_all(&home);
        std::fs::rename(&staging, &home).map_err(io("renaming into place", &home))?;
        Ok::<_, ArtifactError>(unpacked)
    }
    .await;
    let unpacked = match result {
        Ok(u) => u,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    if let Some(dir) = &cache.dir {
        evict(dir, cache.max_bytes, &home);
    }
    Ok(Fetched { tree: home.join(TREE), digest, files: unpacked.files, bytes: unpacked.bytes, cached: false })
}

/// The cached tree for `digest`, marked as just used.
fn cached(home: &Path, digest: &Digest) -> Option<Fetched> {
    if !home.join(SEALED_FILE).is_file() {
        return None;
    }
    let text = std::fs::read_to_string(home.join(SIZE_FILE)).ok()?;
    let (files, bytes) = text.trim().split_once(' ')?;
    let tree = home.join(TREE);
    if !tree.is_dir() {
        return None;
    }
    // Least recently *used*: a hit moves it to the back of the eviction queue.
    let _ = std::fs::File::options()
        .append(true)
        .open(home.join(SIZE_FILE))
        .and_then(|f| f.set_modified(std::time::SystemTime::now()));
    Some(Fetched {
        tree,
        digest: digest.clone(),
        files: files.parse().ok()?,
        bytes: bytes.parse().ok()?,
        cached: true,
    })
}

/// The artifact's one layer: a (gzip-compressed) tar of the module, chart or bundle.
fn single_layer(
    reference: &Reference,
    manifest: &[u8],
    limits: &unpack::Limits,
) -> Result<(Digest, u64), ArtifactError> {
    let bad = |reason: String| ArtifactError::Manifest { reference: reference.to_string(), reason };
    let v: serde_json::Value =
        serde_json::from_slice(manifest).map_err(|e| bad(format!("the manifest is not JSON: {e}")))?;
    let layers = v["layers"].as_array().ok_or_else(|| {
        bad("not an image manifest (an index or another kind of document has no layers to unpack)".into())
    })?;
    let [layer] = layers.as_slice() else {
        return Err(bad(format!("has {} layers; a component artifact has exactly one", layers.len())));
    };
    let media = layer["mediaType"].as_str().unwrap_or("");
    let known = media.ends_with(".tar+gzip")
        || media.ends_with(".tar")
        || media.ends_with("tar.gzip")
        || media == "application/vnd.cncf.helm.chart.content.v1.tar+gzip";
    if !known {
        return Err(bad(format!("its layer's media type {media:?} is not a tar archive")));
    }
    let digest = Digest::parse(layer["digest"].as_str().unwrap_or("")).map_err(|e| bad(e.0))?;
    let size = layer["size"].as_u64().ok_or_else(|| bad("its layer has no size".into()))?;
    if size > limits.max_bytes {
        return Err(ArtifactError::Unpack {
            reference: reference.to_string(),
            source: unpack::UnpackError::TooLarge { max: limits.max_bytes },
        });
    }
    Ok((digest, size))
}

/// Stream the layer to `to`, hashing as it comes; refuse more bytes than the manifest
/// said, and any digest but the one it named.
async fn download(
    registry: &Registry,
    reference: &Reference,
    (digest, size): &(Digest, u64),
    to: &Path,
    cancel: &tokio_util::sync::CancellationToken,
) -> Result<(), ArtifactError> {
    let io = |op, source| ArtifactError::Io { op, path: to.to_path_buf(), source };
    let mut resp = registry.get_blob(&reference.repository, digest, 0).await?;
    let mut file = std::fs::File::create(to).map_err(|e| io("creating", e))?;
    let mut hasher = sha2::Sha256::new();
    let mut got = 0u64;
    loop {
        let chunk = tokio::select! {
            c = resp.chunk() => c.map_err(|e| registry.err_transport(&format!("blob {digest}"), byoc_oci_sync::client::error_chain(&e)))?,
            _ = cancel.cancelled() => return Err(SyncError::Cancelled.into()),
        };
        let Some(chunk) = chunk else { break };
        got += chunk.len() as u64;
        if got > *size {
            break;
        }
        hasher.update(&chunk);
        file.write_all(&chunk).map_err(|e| io("writing", e))?;
    }
    let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
    if got != *size || actual != digest.as_str() {
        return Err(ArtifactError::LayerDigest {
            reference: reference.to_string(),
            expected: format!("{digest} ({size} bytes)"),
            actual: if got > *size {
                format!("more than {size} bytes")
            } else {
                format!("{actual} ({got} bytes)")
            },
        });
    }
    file.sync_all().map_err(|e| io("syncing", e))?;
    Ok(())
}

/// Remove the least recently used artifacts until the cache holds at most `max_bytes`
/// (never `keep`, the one just fetched).
fn evict(dir: &Path, max_bytes: u64, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut all: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter_map(|e| {
            let size_file = e.path().join(SIZE_FILE);
            let used = std::fs::metadata(&size_file).and_then(|m| m.modified()).ok()?;
            let bytes = std::fs::read_to_string(&size_file).ok()?.split_whitespace().nth(1)?.parse().ok()?;
            Some((used, bytes, e.path()))
        })
        .collect();
    let mut total: u64 = all.iter().map(|(_, b, _)| b).sum();
    all.sort();
    for (_, bytes, path) in all {
        if total <= max_bytes {
            break;
        }
        if path == keep {
            continue;
        }
        if std::fs::remove_dir_all(&path).is_ok() {
            tracing::info!(artifact = %path.display(), bytes, "Evicted from the artifact cache.");
            total = total.saturating_sub(bytes);
        }
    }
}

/// Copy an unpacked tree into a job's directory: files and directories as they are,
/// links as links (never followed), so the cached copy stays as it was verified.
pub fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(entry.path())?, &target)?;
        } else if kind.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_entry_from_before_entries_were_sealed_is_never_used() {
        let d = tempfile::tempdir().expect("tempdir");
        let digest = Digest::parse(&format!("sha256:{}", "a".repeat(64))).expect("digest");
        std::fs::create_dir_all(d.path().join(TREE)).expect("tree");
        std::fs::write(d.path().join(SIZE_FILE), "1 8").expect("size");
        assert!(cached(d.path(), &digest).is_none(), "an unsealed entry was served");
        std::fs::write(d.path().join(SEALED_FILE), b"").expect("sealed");
        let hit = cached(d.path(), &digest).expect("a sealed entry is served");
        assert_eq!((hit.files, hit.bytes, hit.cached), (1, 8, true));
    }
}
