//! The customer's terms, as the updater reads them: `[update]` and `[runner] state_dir`
//! of `runner.toml` (root's), and the admin's pin in the runner's `control/` directory
//! (read without following a link). Anything it cannot read or understand refuses every
//! update: the updater never installs on terms it could not check.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::minisign::PublicKey;
use crate::version::Pin;

pub const DEFAULT_STATE_DIR: &str = "/var/lib/byoc-runner";
/// Largest pin file and config file the updater reads.
const MAX_PIN_BYTES: u64 = 4 << 10;
const MAX_CONFIG_BYTES: u64 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpdateMode {
    /// An update the terms allow is applied when it arrives (windows still apply).
    Auto,
    /// Each update waits for a local admin's approval (`byoc-runner approve JOB`).
    #[default]
    Approve,
    /// Every update is refused (`update_disabled`).
    Off,
}

impl UpdateMode {
    pub fn as_str(self) -> &'static str {
        match self {
            UpdateMode::Auto => "auto",
            UpdateMode::Approve => "approve",
            UpdateMode::Off => "off",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(UpdateMode::Auto),
            "approve" => Ok(UpdateMode::Approve),
            "off" => Ok(UpdateMode::Off),
            other => Err(format!("update.mode: {other:?} is not one of auto, approve, off")),
        }
    }
}

/// What the updater holds every request to.
#[derive(Debug, Clone)]
pub struct Terms {
    /// The config file they were read from (a release rotating the key rewrites it).
    pub source: PathBuf,
    pub state_dir: PathBuf,
    pub mode: UpdateMode,
    pub release_key: Option<PublicKey>,
    pub pin: Option<Pin>,
    pub health_timeout: Duration,
    pub keep_releases: usize,
    /// The runner's user; `None`: the state directory's owner (the tests name one).
    pub runner_uid: Option<u32>,
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct UpdateTable {
    mode: Option<String>,
    release_public_key: Option<String>,
    pin: Option<String>,
    health_timeout_secs: Option<u64>,
    keep_releases: Option<u64>,
}

impl Terms {
    /// Read from `path` (no link followed). The runner's own parser checks the same
    /// table the same way; where they could differ, this one refuses.
    pub fn load(path: &Path) -> Result<Terms, String> {
        let fail = |e: String| format!("{}: {e}", path.display());
        let bytes = crate::hostile::read_path(path, MAX_CONFIG_BYTES)
            .map_err(|e| fail(e.to_string()))?
            .ok_or_else(|| fail("does not exist".into()))?;
        let text = String::from_utf8(bytes).map_err(|_| fail("is not UTF-8".into()))?;
        let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| fail(e.message().into()))?;
        let state_dir = match table.get("runner").and_then(|r| r.get("state_dir")) {
            None => PathBuf::from(DEFAULT_STATE_DIR),
            Some(toml::Value::String(s)) if Path::new(s).is_absolute() => PathBuf::from(s),
            Some(other) => return Err(fail(format!("runner.state_dir: {other} is not an absolute path"))),
        };
        let update: UpdateTable = match table.remove("update") {
            None => UpdateTable::default(),
            Some(v) => {
                v.try_into().map_err(|e: toml::de::Error| fail(format!("[update]: {}", e.message())))?
            }
        };
        let mode =
            update.mode.as_deref().map(UpdateMode::parse).transpose().map_err(fail)?.unwrap_or_default();
        let release_key = update
            .release_public_key
            .as_deref()
            .map(PublicKey::parse)
            .transpose()
            .map_err(|e| fail(format!("update.release_public_key: {e}")))?;
        let pin = update
            .pin
            .as_deref()
            .map(Pin::parse)
            .transpose()
            .map_err(|e| fail(format!("update.pin: {e}")))?;
        let health_timeout = match update.health_timeout_secs.unwrap_or(180) {
            s @ 10..=3600 => Duration::from_secs(s),
            s => return Err(fail(format!("update.health_timeout_secs: {s} is not within 10..=3600"))),
        };
        let keep_releases = match update.keep_releases.unwrap_or(2) {
            n @ 2..=10 => n as usize,
            n => return Err(fail(format!("update.keep_releases: {n} is not within 2..=10"))),
        };
        Ok(Terms {
            source: path.to_path_buf(),
            state_dir,
            mode,
            release_key,
            pin,
            health_timeout,
            keep_releases,
            runner_uid: None,
        })
    }

    /// Whether a file in the runner's `control/` was written by someone the customer
    /// put there (root or the admin group), not by the runner's own user: `control/` is
    /// the runner's directory, so only the file's owner as the kernel reports it tells.
    /// A runner that runs as root cannot be told apart: everything counts then.
    fn written_by_a_person(&self, owner: u32) -> bool {
        match self.runner_uid.map_or_else(|| crate::hostile::dir_owner(&self.state_dir), Ok) {
            Ok(runner) => runner == 0 || owner != runner,
            Err(_) => false,
        }
    }

    /// Whether `version` is inside every pin: `[update] pin` (root's) and the admin's
    /// `byoc-runner update pin`, both. A pin file that cannot be read or parsed, or that
    /// the runner's own user wrote, holds every update.
    pub fn pins_allow(&self, version: &str) -> Result<(), String> {
        if let Some(pin) = &self.pin
            && !pin.allows(version)
        {
            return Err(format!("{version} is outside [update] pin {:?}", pin.as_str()));
        }
        let path = crate::pin_path(&self.state_dir);
        let (bytes, owner) = match crate::hostile::read_owned(&path, MAX_PIN_BYTES) {
            Ok(None) => return Ok(()),
            Ok(Some(found)) => found,
            Err(e) => {
                return Err(format!(
                    "the pin file {} is unreadable ({e}): no update is allowed",
                    path.display()
                ));
            }
        };
        if !self.written_by_a_person(owner) {
            return Err(format!(
                "the pin file {} was written by the runner's own user (uid {owner}), not by `byoc-runner update pin`: no update is allowed",
                path.display()
            ));
        }
        let pin = serde_json::from_slice::<crate::PinRecord>(&bytes)
            .map_err(|e| format!("the pin file {} is damaged ({e}): no update is allowed", path.display()))
            .and_then(|r| Pin::parse(&r.pin))?;
        if pin.allows(version) {
            Ok(())
        } else {
            Err(format!("{version} is outside the pin {:?} (`byoc-runner update pin`)", pin.as_str()))
        }
    }

    /// In `mode = "approve"`: a person's approval of this job and version, left by
    /// `byoc-runner approve` and written by root or the admin group, within a week.
    pub fn approved(&self, job_id: &str, version: &str, now_ms: u64) -> Result<(), String> {
        let plain =
            !job_id.is_empty() && job_id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !plain || job_id.starts_with('.') {
            return Err(format!("{job_id:?} is not a job id"));
        }
        let path = crate::update_approval_path(&self.state_dir, job_id);
        let (bytes, owner) = crate::hostile::read_owned(&path, MAX_PIN_BYTES)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .ok_or_else(|| format!("nobody approved job {job_id} (`byoc-runner approve {job_id}`)"))?;
        if !self.written_by_a_person(owner) {
            return Err(format!(
                "the approval {} was written by the runner's own user, not a person",
                path.display()
            ));
        }
        let note: crate::UpdateApproval =
            serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        if note.job_id != job_id || note.version != version {
            return Err(format!(
                "job {job_id} was approved for {} {}, not {version}",
                note.job_id, note.version
            ));
        }
        if now_ms.saturating_sub(note.at_ms) > APPROVAL_VALID_MS {
            return Err(format!("the approval of job {job_id} by {} is more than 7 days old", note.by));
        }
        Ok(())
    }
}

/// How long a person's approval of an update stays good for the updater.
const APPROVAL_VALID_MS: u64 = 7 * 24 * 3600 * 1000;

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Terms, String> {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("runner.toml");
        std::fs::write(&path, text).unwrap();
        Terms::load(&path)
    }

    #[test]
    fn the_terms_are_read_with_the_runners_defaults() {
        let t = load("[runner]\ninstall_id = \"i\"\n[control_plane]\nurl = \"x\"\n").unwrap();
        assert_eq!(t.mode, UpdateMode::Approve);
        assert_eq!(t.state_dir, PathBuf::from(DEFAULT_STATE_DIR));
        assert!(t.release_key.is_none() && t.pin.is_none());
        assert_eq!((t.health_timeout.as_secs(), t.keep_releases), (180, 2));
        let t =
            load("[runner]\nstate_dir = \"/srv/r\"\n[update]\nmode = \"off\"\npin = \"0.2.0\"\n").unwrap();
        assert_eq!((t.mode, t.state_dir.as_path()), (UpdateMode::Off, Path::new("/srv/r")));
    }

    #[test]
    fn terms_it_cannot_understand_refuse_instead_of_defaulting() {
        for bad in [
            "[update]\nmode = \"sometimes\"\n",
            "[update]\nmod = \"off\"\n",
            "[update]\nrelease_public_key = \"not a key\"\n",
            "[update]\npin = \"<<\"\n",
            "[update]\nhealth_timeout_secs = 1\n",
            "[runner]\nstate_dir = \"relative\"\n",
            "[update\n",
        ] {
            assert!(load(bad).is_err(), "accepted: {bad}");
        }
    }
}
