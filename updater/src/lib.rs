//! byoc-runner's updater: the only part of byoc-runner that runs as root
//! (`byoc-runner-updater`, started by `byoc-runner-update.service`). It links the
//! release verification (`minisign`, `release`, `version`), the customer's terms
//! (`terms`), the state layer's durable writes and the dpkg/systemctl calls (`apply`);
//! nothing of the daemon's.
//!
//! Everything under the runner's state dir is hostile to it: the runner's user (the uid
//! every job's sandbox maps to) can write there. It reads those files only through
//! [`hostile`] (no link followed, regular files only, capped), copies a staged release
//! into its own root-owned directory before it verifies anything, verifies, inspects
//! and installs only that copy, and never chowns, chmods, removes or writes anything
//! in the runner's directories: what it did is in its own directory
//! (`/var/lib/byoc-runner-update/last.json`, readable by the runner).
//!
//! The daemon (`byoc-runner`) uses this crate's library for the same release checks
//! when it stages a release, and for the types both sides read.

pub mod apply;
pub mod hostile;
pub mod minisign;
pub mod place;
pub mod release;
pub mod terms;
pub mod version;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where the updater keeps installed releases, its progress and its outcomes (root's,
/// `0711`: the runner can read `last.json` by name, nothing else).
pub const UPDATER_DIR: &str = "/var/lib/byoc-runner-update";
/// The package's daemon binary; a runner started from anywhere else is not a package's.
pub const PACKAGED_BINARY: &str = "/usr/bin/byoc-runner";
/// The package's updater binary (not on `PATH`: only its unit runs it).
pub const UPDATER_BINARY: &str = "/usr/lib/byoc-runner/byoc-runner-updater";
/// The admin's pin, in the updater's `terms/` directory.
pub const PIN_FILE: &str = "update-pin.json";

/// In the updater's directory: the last outcome (`0644`, for the runner and `update
/// status`).
pub const LAST_FILE: &str = "last.json";
/// In the updater's directory: root's rollback request (`byoc-runner update rollback`).
pub const ROLLBACK_FILE: &str = "rollback.json";

/// `<state dir>/update`: the runner's, where it stages a release for the updater.
pub fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join("update")
}

pub fn request_path(state_dir: &Path) -> PathBuf {
    dir(state_dir).join("request.json")
}

pub fn health_path(state_dir: &Path) -> PathBuf {
    dir(state_dir).join("health.json")
}

pub fn staged_dir(state_dir: &Path) -> PathBuf {
    dir(state_dir).join("staged")
}

/// The customer's own update terms on the VM, where the runner's user cannot write:
/// `<updater dir>/terms/` (root's; group-writable by `roles.admin_group` when there is
/// one): the admin's pin and people's approvals of updates.
pub fn terms_dir(updater_dir: &Path) -> PathBuf {
    updater_dir.join("terms")
}

/// The admin's pin (`byoc-runner update pin`), in [`terms_dir`].
pub fn pin_path(terms_dir: &Path) -> PathBuf {
    terms_dir.join(PIN_FILE)
}

/// The updater's directory for a package installed under `root`.
pub fn updater_dir(root: &Path) -> PathBuf {
    root.join(UPDATER_DIR.trim_start_matches('/'))
}

/// The last outcome, in the updater's directory under `updater_dir`.
pub fn last_path(updater_dir: &Path) -> PathBuf {
    updater_dir.join(LAST_FILE)
}

/// Root's rollback request, in the updater's directory.
pub fn rollback_path(updater_dir: &Path) -> PathBuf {
    updater_dir.join(ROLLBACK_FILE)
}

/// Every outcome, one file each, named so that they sort in order
/// (`<at_ms, 15 digits>-<n>-<refused|installed>.json`; `0755`: the runner audits each one).
pub fn outcomes_dir(updater_dir: &Path) -> PathBuf {
    updater_dir.join("outcomes")
}

/// A person's approval of a `runner.update` job and version, left by `byoc-runner
/// approve JOB --version V` (root or the admin group) in [`terms_dir`]: in `mode =
/// "approve"` the updater installs a release only with one, once.
pub fn update_approval_path(terms_dir: &Path, job_id: &str) -> PathBuf {
    terms_dir.join(format!("update-approval-{job_id}.json"))
}

/// See [`update_approval_path`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateApproval {
    pub job_id: String,
    pub version: String,
    pub by: String,
    pub uid: u32,
    pub at_ms: u64,
}

/// A verified release the runner staged for the updater.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub job_id: String,
    pub version: String,
    pub from_version: String,
    pub package: String,
    pub package_sha256: String,
    pub sums_sha256: String,
    /// Read for requests staged by earlier versions; never believed (a rollback floor
    /// from a job spec could veto the customer's own rollback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_rollback_version: Option<String>,
    /// A rollback: only root asks for one (`rollback.json` in the updater's directory);
    /// a request in the runner's directory saying so is refused.
    #[serde(default)]
    pub rollback: bool,
    pub staged_at_ms: u64,
}

/// Root's rollback request (`byoc-runner update rollback`, in the updater's directory).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    /// A kept version.
    pub version: String,
    /// Who asked (the CLI's user, root).
    pub by: String,
    pub at_ms: u64,
}

/// What the updater did, for the daemon that runs next to audit and report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// `applied`, `rolled_back` or `refused` (nothing installed).
    pub result: String,
    pub job_id: String,
    pub from_version: String,
    pub to_version: String,
    #[serde(default)]
    pub from_package_sha256: Option<String>,
    pub to_package_sha256: String,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub code: Option<String>,
    pub at_ms: u64,
    /// SHA-256 of the request it answers (`request.json`'s bytes, or root's rollback
    /// request's): the runner removes its request once an outcome names it.
    #[serde(default)]
    pub request_sha256: Option<String>,
}

/// What a daemon says of itself once its first poll was answered: the updater's
/// evidence that a new version is healthy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    pub version: String,
    pub pid: u32,
    pub first_poll_ms: u64,
    /// SHA-256 of the identity's public key: the audit chain continues with it.
    pub key_sha256: String,
}

/// The customer's pin set on the VM (`byoc-runner update pin`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinRecord {
    pub pin: String,
    pub by: String,
    pub at_ms: u64,
}

/// dpkg's status file for packages installed under `root`.
pub fn dpkg_status(root: &Path) -> PathBuf {
    root.join("var/lib/dpkg/status")
}

/// The installed byoc-runner package's version in a dpkg status file.
pub fn installed_version(status_file: &Path) -> Option<String> {
    let text = std::fs::read_to_string(status_file).ok()?;
    text.split("\n\n").find_map(|stanza| {
        let field = |name: &str| {
            stanza.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(':')).map(str::trim))
        };
        (field("Package") == Some("byoc-runner") && field("Status") == Some("install ok installed"))
            .then(|| field("Version").map(str::to_string))
            .flatten()
    })
}

/// Whether `job_id` is a job id (`[A-Za-z0-9._-]`, not starting with a dot): it names files.
pub fn plain_job_id(job_id: &str) -> bool {
    !job_id.is_empty()
        && job_id.len() <= 128
        && !job_id.starts_with('.')
        && job_id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
