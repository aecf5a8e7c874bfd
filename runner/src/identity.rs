//! The runner's Ed25519 identity key and its enrollment record, in the state dir.
//!
//! The key file holds the 32-byte seed, mode 0600, created exclusively so two starts
//! can never race to different identities. The bootstrap token is never written here.

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Write as _};
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use ed25519_dalek::SigningKey;
use serde::{Deserialize, Serialize};

use crate::state_dir::StateDir;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("reading identity key {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("creating identity key {path}: {source}")]
    Create { path: PathBuf, source: std::io::Error },
    #[error(
        "identity key {path} is corrupt (expected 32 bytes, found {len}); restore it from backup or re-enroll with a new bootstrap token after removing it"
    )]
    Corrupt { path: PathBuf, len: usize },
    #[error("identity key {path} is readable by others (mode {mode:o}); run: chmod 600 {path}")]
    Permissions { path: PathBuf, mode: u32 },
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("enrollment record {path} is unreadable: {reason}")]
    Enrollment { path: PathBuf, reason: String },
}

/// Load the identity key, creating it on first start. Returns (key, created).
pub fn load_or_create_key(state_dir: &Path) -> Result<(SigningKey, bool), IdentityError> {
    let path = StateDir::of(state_dir).key();
    match File::open(&path) {
        Ok(mut f) => {
            let mode = f
                .metadata()
                .map_err(|e| IdentityError::Read { path: path.clone(), source: e })?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                return Err(IdentityError::Permissions { path, mode: mode & 0o777 });
            }
            let mut buf = Vec::new();
            f.read_to_end(&mut buf).map_err(|e| IdentityError::Read { path: path.clone(), source: e })?;
            let seed: [u8; 32] = buf
                .as_slice()
                .try_into()
                .map_err(|_| IdentityError::Corrupt { path: path.clone(), len: buf.len() })?;
            Ok((SigningKey::from_bytes(&seed), false))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = byoc_protocol::generate_signing_key();
            let create = |e| IdentityError::Create { path: path.clone(), source: e };
            let mut f =
                OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).map_err(create)?;
            f.write_all(key.as_bytes()).map_err(create)?;
            f.sync_all().map_err(create)?;
            sync_dir(state_dir).map_err(create)?;
            Ok((key, true))
        }
        Err(e) => Err(IdentityError::Read { path, source: e }),
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Enrollment {
    pub runner_id: String,
    pub install_id: String,
    pub control_plane_url: String,
    pub enrolled_at: i64,
    pub public_key: String,
}

pub fn load_enrollment(state_dir: &Path) -> Result<Option<Enrollment>, IdentityError> {
    let path = StateDir::of(state_dir).enrollment();
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| IdentityError::Enrollment { path, reason: e.to_string() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(IdentityError::Read { path, source: e }),
    }
}

pub fn save_enrollment(state_dir: &Path, e: &Enrollment) -> Result<(), IdentityError> {
    let bytes = serde_json::to_vec_pretty(e).expect("enrollment serialises");
    let path = StateDir::of(state_dir).enrollment();
    crate::state_dir::write(&path, &bytes, 0o600).map_err(|source| IdentityError::Write { path, source })
}

pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_is_created_0600_once_and_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let (k1, created) = load_or_create_key(dir.path()).unwrap();
        assert!(created);
        let mode = std::fs::metadata(StateDir::of(dir.path()).key()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let (k2, created) = load_or_create_key(dir.path()).unwrap();
        assert!(!created);
        assert_eq!(k1.to_bytes(), k2.to_bytes());
    }

    #[test]
    fn loose_permissions_and_corruption_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        load_or_create_key(dir.path()).unwrap();
        let path = StateDir::of(dir.path()).key();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(load_or_create_key(dir.path()), Err(IdentityError::Permissions { .. })));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, b"short").unwrap();
        assert!(matches!(load_or_create_key(dir.path()), Err(IdentityError::Corrupt { len: 5, .. })));
    }
}
