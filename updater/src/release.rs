//! A release, as the vendor publishes it and the runner receives it (an artifact's
//! unpacked tree, or the updater's kept copy): `SHA256SUMS`, its minisign signature
//! `SHA256SUMS.minisig` by the release key pinned at install, the one package it names
//! (`byoc-runner_<version>_<arch>.deb`) and, for a downgrade, `DOWNGRADE` (listed in
//! `SHA256SUMS`, so signed) naming the versions it may replace (`replaces 0.3.0`).
//! Nothing in the tree is believed before the signature verifies, and nothing the
//! signature does not cover is read at all.

use std::cmp::Ordering;
use std::io::Read as _;
use std::path::{Path, PathBuf};

use sha2::Digest as _;

use crate::minisign::{self, PublicKey};
use crate::version;

pub const SUMS: &str = "SHA256SUMS";
pub const SUMS_SIG: &str = "SHA256SUMS.minisig";
pub const DOWNGRADE: &str = "DOWNGRADE";
/// A key rotation: the new release key (a minisign `.pub`), and its signature by the key
/// pinned now. A release carrying them may be signed by the new key.
pub const NEW_KEY: &str = "RELEASE-KEY";
pub const NEW_KEY_SIG: &str = "RELEASE-KEY.minisig";

impl Release {
    /// The files of the release, by name: the signed ones, then those only some carry.
    pub fn files(&self) -> [&str; 6] {
        [SUMS, SUMS_SIG, self.package.as_str(), DOWNGRADE, NEW_KEY, NEW_KEY_SIG]
    }
}
const MAX_SMALL_FILE: u64 = 64 << 10;

/// A release whose signature and package digest verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub dir: PathBuf,
    pub package: String,
    pub version: String,
    pub arch: String,
    pub package_sha256: String,
    pub sums_sha256: String,
    /// Versions this (older) release may replace, as it signs them.
    pub replaces: Vec<String>,
    /// The new release key (its key line) when the release rotates it.
    pub rotated_key: Option<String>,
}

impl Release {
    pub fn package_path(&self) -> PathBuf {
        self.dir.join(&self.package)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error("the release has no {0} (a release is SHA256SUMS, SHA256SUMS.minisig and the package)")]
    Incomplete(&'static str),
    #[error("{file}: {why}")]
    Unreadable { file: String, why: String },
    #[error("SHA256SUMS: {0}")]
    Signature(minisign::MinisignError),
    #[error("the key rotation (RELEASE-KEY): {0}")]
    Rotation(String),
    #[error("SHA256SUMS: {0}")]
    Sums(String),
    #[error("the package is version {found}, the job names {expected}")]
    WrongVersion { expected: String, found: String },
    #[error("the package is for {found}, this machine is {host}")]
    WrongArchitecture { host: String, found: String },
    #[error("{file} does not match its checksum in the signed SHA256SUMS")]
    Digest { file: String },
    #[error(
        "{version} is not newer than the running {current}, and the release signs no downgrade from it (DOWNGRADE)"
    )]
    NotNewer { version: String, current: String },
}

impl ReleaseError {
    /// The reason code a refused update carries.
    pub fn code(&self) -> &'static str {
        match self {
            ReleaseError::Incomplete(_) | ReleaseError::Unreadable { .. } => "update_release_incomplete",
            ReleaseError::Signature(_) => "update_signature_invalid",
            ReleaseError::Rotation(_) => "update_key_rotation_invalid",
            ReleaseError::Sums(_) => "update_release_invalid",
            ReleaseError::WrongVersion { .. } => "update_wrong_version",
            ReleaseError::WrongArchitecture { .. } => "update_wrong_architecture",
            ReleaseError::Digest { .. } => "update_digest_mismatch",
            ReleaseError::NotNewer { .. } => "update_not_newer",
        }
    }
}

/// dpkg's name for this machine's architecture.
pub fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "i386",
        "arm" => "armhf",
        other => other,
    }
}

/// Verify the release in `dir` with `key`: the signature, then the package named, its
/// version and architecture, then its bytes; then that it is newer than `current`, or
/// a downgrade the release signs.
pub fn verify(dir: &Path, key: &PublicKey, version: &str, current: &str) -> Result<Release, ReleaseError> {
    let release = verify_signed(dir, key, version)?;
    if version::compare(version, current) != Ordering::Greater
        && !release.replaces.iter().any(|r| r == current)
    {
        return Err(ReleaseError::NotNewer { version: version.into(), current: current.into() });
    }
    Ok(release)
}

/// `verify` without the age check (a kept release the customer rolls back to).
pub fn verify_signed(dir: &Path, key: &PublicKey, version: &str) -> Result<Release, ReleaseError> {
    let sums = read_small(dir, SUMS)?;
    let sig = read_small(dir, SUMS_SIG)?;
    let sig = String::from_utf8(sig)
        .map_err(|_| ReleaseError::Signature(minisign::MinisignError::Malformed("not text")))?;
    let (signer, rotated_key) = key_of_release(dir, key)?;
    minisign::verify(&signer, &sums, &sig).map_err(ReleaseError::Signature)?;
    let entries = parse_sums(&sums)?;
    let packages: Vec<&(String, String)> = entries.iter().filter(|(_, n)| n.ends_with(".deb")).collect();
    let [(package_sha256, package)] = packages.as_slice() else {
        return Err(ReleaseError::Sums(format!("names {} packages, not exactly one", packages.len())));
    };
    let (found_version, arch) = package_name(package)?;
    if found_version != version {
        return Err(ReleaseError::WrongVersion { expected: version.into(), found: found_version });
    }
    if arch != host_arch() && arch != "all" {
        return Err(ReleaseError::WrongArchitecture { host: host_arch().into(), found: arch });
    }
    if sha256_file(&dir.join(package))? != *package_sha256 {
        return Err(ReleaseError::Digest { file: package.clone() });
    }
    let mut replaces = Vec::new();
    if let Some((digest, _)) = entries.iter().find(|(_, n)| n == DOWNGRADE) {
        let text = read_small(dir, DOWNGRADE)?;
        if crate::sha256_hex(&text) != *digest {
            return Err(ReleaseError::Digest { file: DOWNGRADE.into() });
        }
        for line in String::from_utf8_lossy(&text).lines().map(str::trim).filter(|l| !l.is_empty()) {
            match line.strip_prefix("replaces ").map(str::trim) {
                Some(v) if version::valid(v) => replaces.push(v.to_string()),
                _ => {
                    return Err(ReleaseError::Sums(format!("DOWNGRADE: {line:?} is not `replaces VERSION`")));
                }
            }
        }
    }
    Ok(Release {
        dir: dir.to_path_buf(),
        package: package.clone(),
        version: found_version,
        arch,
        package_sha256: package_sha256.clone(),
        sums_sha256: crate::sha256_hex(&sums),
        replaces,
        rotated_key,
    })
}

/// The key `SHA256SUMS` must be signed with: the pinned one, or the new key of a
/// rotation statement the pinned key signed (its key line returned too).
fn key_of_release(dir: &Path, pinned: &PublicKey) -> Result<(PublicKey, Option<String>), ReleaseError> {
    let statement = match read_small(dir, NEW_KEY) {
        Ok(text) => text,
        Err(ReleaseError::Incomplete(_)) => return Ok((pinned.clone(), None)),
        Err(e) => return Err(e),
    };
    let text = String::from_utf8(statement.clone())
        .map_err(|_| ReleaseError::Rotation("RELEASE-KEY is not text".into()))?;
    let new = PublicKey::parse(&text).map_err(|e| ReleaseError::Rotation(e.to_string()))?;
    if new == *pinned {
        // A release from after the rotation, checked under the key it rotated to.
        return Ok((new, None));
    }
    let sig = read_small(dir, NEW_KEY_SIG).map_err(|_| {
        ReleaseError::Rotation("RELEASE-KEY.minisig, its signature by the pinned key, is missing".into())
    })?;
    let sig = String::from_utf8(sig)
        .map_err(|_| ReleaseError::Rotation("RELEASE-KEY.minisig is not text".into()))?;
    minisign::verify(pinned, &statement, &sig).map_err(|e| ReleaseError::Rotation(e.to_string()))?;
    let line = new.line();
    Ok((new, Some(line)))
}

/// `byoc-runner_<version>_<arch>.deb` → version, arch (the name dpkg-deb gives; the
/// updater checks the package's own control fields again before installing).
fn package_name(name: &str) -> Result<(String, String), ReleaseError> {
    let bad = || ReleaseError::Sums(format!("{name:?} is not byoc-runner_<version>_<arch>.deb"));
    let stem = name.strip_prefix("byoc-runner_").and_then(|s| s.strip_suffix(".deb")).ok_or_else(bad)?;
    let (v, arch) = stem.rsplit_once('_').ok_or_else(bad)?;
    // A file name cannot carry an epoch's colon; dpkg-deb writes none.
    if !version::valid(v)
        || v.contains(':')
        || arch.is_empty()
        || !arch.bytes().all(|b| b.is_ascii_alphanumeric())
    {
        return Err(bad());
    }
    Ok((v.to_string(), arch.to_string()))
}

/// `SHA256SUMS` lines: 64 hex digits, two spaces (or space and `*`), a plain file name.
fn parse_sums(bytes: &[u8]) -> Result<Vec<(String, String)>, ReleaseError> {
    let text = std::str::from_utf8(bytes).map_err(|_| ReleaseError::Sums("not UTF-8".into()))?;
    let mut out: Vec<(String, String)> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let bad = || ReleaseError::Sums(format!("{line:?} is not `<sha256>  <file>`"));
        let (digest, rest) = line.split_at_checked(64).ok_or_else(bad)?;
        let name = rest.strip_prefix("  ").or_else(|| rest.strip_prefix(" *")).ok_or_else(bad)?;
        let plain = !name.is_empty()
            && !name.starts_with('.')
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._+~-".contains(&b));
        if !digest.bytes().all(|b| b.is_ascii_hexdigit()) || !plain {
            return Err(bad());
        }
        if out.iter().any(|(_, n)| n == name) {
            return Err(ReleaseError::Sums(format!("{name} is listed twice")));
        }
        out.push((digest.to_ascii_lowercase(), name.to_string()));
    }
    Ok(out)
}

/// A regular file of the release (never a link), opened without following one.
fn open(dir: &Path, name: &str) -> Result<std::fs::File, ReleaseError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = dir.join(name);
    let unreadable = |why: String| ReleaseError::Unreadable { file: name.into(), why };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(&path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ReleaseError::Incomplete(static_name(name)),
            _ => unreadable(e.to_string()),
        })?;
    match file.metadata() {
        Ok(m) if m.is_file() => Ok(file),
        Ok(_) => Err(unreadable("not a regular file".into())),
        Err(e) => Err(unreadable(e.to_string())),
    }
}

fn static_name(name: &str) -> &'static str {
    match name {
        SUMS => SUMS,
        SUMS_SIG => SUMS_SIG,
        DOWNGRADE => DOWNGRADE,
        NEW_KEY => NEW_KEY,
        NEW_KEY_SIG => NEW_KEY_SIG,
        _ => "package",
    }
}

fn read_small(dir: &Path, name: &str) -> Result<Vec<u8>, ReleaseError> {
    let mut bytes = Vec::new();
    open(dir, name)?
        .take(MAX_SMALL_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ReleaseError::Unreadable { file: name.into(), why: e.to_string() })?;
    if bytes.len() as u64 > MAX_SMALL_FILE {
        return Err(ReleaseError::Unreadable { file: name.into(), why: "larger than 64 KiB".into() });
    }
    Ok(bytes)
}

pub fn sha256_file(path: &Path) -> Result<String, ReleaseError> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut file = open(dir, &name)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| ReleaseError::Unreadable { file: name.clone(), why: e.to_string() })?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Test releases: a package of any bytes, SHA256SUMS, signed with `key`.
#[cfg(any(test, feature = "fixture"))]
#[allow(clippy::unwrap_used)]
pub mod fixture {
    use super::*;

    pub const KEY_ID: [u8; 8] = [0x51; 8];

    pub fn signing_key() -> ed25519_dalek::SigningKey {
        ed25519_dalek::SigningKey::from_bytes(&[0x42; 32])
    }

    pub fn public_key() -> PublicKey {
        let (line, _) = minisign::sign(&signing_key(), KEY_ID, b"", "");
        PublicKey::parse(&line).unwrap()
    }

    /// A release of `version` for this machine in `dir`, with the extra signed files.
    pub fn release(dir: &Path, version: &str, extra: &[(&str, &str)]) -> String {
        let package = format!("byoc-runner_{version}_{}.deb", host_arch());
        std::fs::write(dir.join(&package), format!("package {version}")).unwrap();
        for (name, text) in extra {
            std::fs::write(dir.join(name), text).unwrap();
        }
        sign_dir(dir, &signing_key(), KEY_ID);
        package
    }

    /// SHA256SUMS over every file in `dir` (but the sums and signature), signed.
    pub fn sign_dir(dir: &Path, key: &ed25519_dalek::SigningKey, key_id: [u8; 8]) {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != SUMS && n != SUMS_SIG)
            .collect();
        names.sort();
        let sums: String = names
            .iter()
            .map(|n| format!("{}  {n}\n", crate::sha256_hex(&std::fs::read(dir.join(n)).unwrap())))
            .collect();
        std::fs::write(dir.join(SUMS), &sums).unwrap();
        let (_, sig) = minisign::sign(key, key_id, sums.as_bytes(), "byoc-runner release");
        std::fs::write(dir.join(SUMS_SIG), sig).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::fixture::*;
    use super::*;

    fn code(dir: &Path, version: &str, current: &str) -> &'static str {
        verify(dir, &public_key(), version, current).unwrap_err().code()
    }

    #[test]
    fn a_signed_newer_release_verifies() {
        let d = tempfile::tempdir().unwrap();
        let package = release(d.path(), "0.2.0", &[]);
        let r = verify(d.path(), &public_key(), "0.2.0", "0.1.0").unwrap();
        assert_eq!((r.package.as_str(), r.version.as_str()), (package.as_str(), "0.2.0"));
        assert_eq!(r.package_sha256, crate::sha256_hex(b"package 0.2.0"));
    }

    #[test]
    fn tampering_of_any_part_is_refused_with_its_code() {
        let d = tempfile::tempdir().unwrap();
        let package = release(d.path(), "0.2.0", &[]);
        // The package changed after signing.
        std::fs::write(d.path().join(&package), "package 0.2.0!").unwrap();
        assert_eq!(code(d.path(), "0.2.0", "0.1.0"), "update_digest_mismatch");
        // SHA256SUMS changed to match it: the signature no longer verifies.
        let sums = format!("{}  {package}\n", crate::sha256_hex(b"package 0.2.0!"));
        std::fs::write(d.path().join(SUMS), sums).unwrap();
        assert_eq!(code(d.path(), "0.2.0", "0.1.0"), "update_signature_invalid");
        // Signed by a key that is not pinned.
        sign_dir(d.path(), &ed25519_dalek::SigningKey::from_bytes(&[3; 32]), [9; 8]);
        let e = verify(d.path(), &public_key(), "0.2.0", "0.1.0").unwrap_err();
        assert_eq!(e.code(), "update_signature_invalid");
        assert!(e.to_string().contains("not the pinned release key"), "{e}");
        // No signature at all.
        std::fs::remove_file(d.path().join(SUMS_SIG)).unwrap();
        assert_eq!(code(d.path(), "0.2.0", "0.1.0"), "update_release_incomplete");
    }

    #[test]
    fn version_architecture_and_age_are_checked_against_the_signed_names() {
        let d = tempfile::tempdir().unwrap();
        release(d.path(), "0.2.0", &[]);
        assert_eq!(code(d.path(), "0.3.0", "0.1.0"), "update_wrong_version");
        assert_eq!(code(d.path(), "0.2.0", "0.2.0"), "update_not_newer");
        assert_eq!(code(d.path(), "0.2.0", "0.3.0"), "update_not_newer");
        let other = tempfile::tempdir().unwrap();
        let foreign = if host_arch() == "amd64" { "arm64" } else { "amd64" };
        std::fs::write(other.path().join(format!("byoc-runner_0.2.0_{foreign}.deb")), "x").unwrap();
        sign_dir(other.path(), &signing_key(), KEY_ID);
        assert_eq!(code(other.path(), "0.2.0", "0.1.0"), "update_wrong_architecture");
    }

    #[test]
    fn a_downgrade_needs_the_release_to_sign_it() {
        let d = tempfile::tempdir().unwrap();
        release(d.path(), "0.1.0", &[(DOWNGRADE, "replaces 0.2.0\n")]);
        let r = verify(d.path(), &public_key(), "0.1.0", "0.2.0").unwrap();
        assert_eq!(r.replaces, ["0.2.0"]);
        assert_eq!(code(d.path(), "0.1.0", "0.3.0"), "update_not_newer");
        // A DOWNGRADE file the signature does not cover is not read.
        let u = tempfile::tempdir().unwrap();
        release(u.path(), "0.1.0", &[]);
        std::fs::write(u.path().join(DOWNGRADE), "replaces 0.2.0\n").unwrap();
        assert_eq!(code(u.path(), "0.1.0", "0.2.0"), "update_not_newer");
    }

    #[test]
    fn a_rotation_the_pinned_key_signs_lets_the_new_key_sign_the_release() {
        let d = tempfile::tempdir().unwrap();
        let (next, next_id) = (ed25519_dalek::SigningKey::from_bytes(&[8; 32]), [0x77; 8]);
        let (next_line, _) = minisign::sign(&next, next_id, b"", "");
        let statement = format!("untrusted comment: the next release key\n{next_line}\n");
        std::fs::write(d.path().join("byoc-runner_0.2.0_".to_string() + host_arch() + ".deb"), "p").unwrap();
        sign_dir(d.path(), &next, next_id);
        // Without the statement the new key's signature is another key's.
        assert_eq!(code(d.path(), "0.2.0", "0.1.0"), "update_signature_invalid");
        std::fs::write(d.path().join(NEW_KEY), &statement).unwrap();
        let (_, by_pinned) = minisign::sign(&signing_key(), KEY_ID, statement.as_bytes(), "rotation");
        std::fs::write(d.path().join(NEW_KEY_SIG), &by_pinned).unwrap();
        sign_dir(d.path(), &next, next_id);
        let r = verify(d.path(), &public_key(), "0.2.0", "0.1.0").unwrap();
        assert_eq!(r.rotated_key.as_deref(), Some(next_line.as_str()));
        // A statement the pinned key did not sign (here: the new key signed itself in).
        let (_, by_itself) = minisign::sign(&next, next_id, statement.as_bytes(), "rotation");
        std::fs::write(d.path().join(NEW_KEY_SIG), by_itself).unwrap();
        sign_dir(d.path(), &next, next_id);
        assert_eq!(code(d.path(), "0.2.0", "0.1.0"), "update_key_rotation_invalid");
    }

    #[test]
    fn hostile_sums_and_links_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let package = release(d.path(), "0.2.0", &[]);
        for sums in [
            format!("{}  ../{package}\n", "0".repeat(64)),
            format!("{}  {package}\n{}  {package}\n", "0".repeat(64), "1".repeat(64)),
            "nonsense\n".to_string(),
            String::new(),
        ] {
            std::fs::write(d.path().join(SUMS), &sums).unwrap();
            let (_, sig) = minisign::sign(&signing_key(), KEY_ID, sums.as_bytes(), "c");
            std::fs::write(d.path().join(SUMS_SIG), sig).unwrap();
            assert_eq!(code(d.path(), "0.2.0", "0.1.0"), "update_release_invalid", "{sums:?}");
        }
        let l = tempfile::tempdir().unwrap();
        let package = release(l.path(), "0.2.0", &[]);
        let outside = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(outside.path(), "package 0.2.0").unwrap();
        std::fs::remove_file(l.path().join(&package)).unwrap();
        std::os::unix::fs::symlink(outside.path(), l.path().join(&package)).unwrap();
        assert_eq!(code(l.path(), "0.2.0", "0.1.0"), "update_release_incomplete");
    }
}
