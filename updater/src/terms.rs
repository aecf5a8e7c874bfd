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
    /// `[roles] admin_group`: whose members, besides root, may pin and approve.
    pub admin_group: Option<String>,
    /// The runner's user; `None`: the user `byoc-runner`, else the state directory's
    /// owner (the tests name one).
    pub runner_uid: Option<u32>,
    /// The admin group's members by uid; `None`: from the system's group database (the
    /// tests name them).
    pub admin_uids: Option<Vec<u32>>,
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
        let admin_group = match table.get("roles").and_then(|r| r.get("admin_group")) {
            None => None,
            Some(toml::Value::String(g)) if g.is_empty() => None,
            Some(toml::Value::String(g)) => Some(g.clone()),
            Some(other) => return Err(fail(format!("roles.admin_group: {other} is not a group name"))),
        };
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
            admin_group,
            runner_uid: None,
            admin_uids: None,
        })
    }

    /// The runner's user: `byoc-runner`, else the state directory's owner.
    fn runner_uid(&self) -> Option<u32> {
        self.runner_uid.or_else(|| {
            nix::unistd::User::from_name(byoc_statefs::SERVICE_USER)
                .ok()
                .flatten()
                .map(|u| u.uid.as_raw())
                .or_else(|| crate::hostile::dir_owner(&self.state_dir).ok())
        })
    }

    /// Whether `uid` is a member of `[roles] admin_group` (a listed member, or the group
    /// is the user's own).
    fn is_admin(&self, uid: u32) -> bool {
        if let Some(uids) = &self.admin_uids {
            return uids.contains(&uid);
        }
        let Some(name) = &self.admin_group else { return false };
        let Ok(Some(group)) = nix::unistd::Group::from_name(name) else { return false };
        let Ok(Some(user)) = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) else {
            return false;
        };
        user.gid == group.gid || group.mem.contains(&user.name)
    }

    /// Whether a file in the terms directory was written by someone the customer put
    /// there: root, or a member of the admin group who is not the runner's user.
    fn written_by_a_person(&self, owner: u32) -> bool {
        owner == 0 || (Some(owner) != self.runner_uid() && self.is_admin(owner))
    }

    /// A file of the terms directory, with its owner; `None`: not there. The directory
    /// must be root's and writable by nobody else but its group (the admin group).
    fn read_term(&self, terms_dir: &Path, name: &str) -> Result<Option<(Vec<u8>, u32)>, String> {
        let dir = match crate::hostile::open_dir(terms_dir) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", terms_dir.display())),
        };
        let st = nix::sys::stat::fstat(&dir).map_err(|e| format!("{}: {e}", terms_dir.display()))?;
        // Root's (the updater's own user's) and written by nobody outside its group.
        if st.st_uid != nix::unistd::geteuid().as_raw() || st.st_mode & 0o002 != 0 {
            return Err(format!(
                "{} is not root's alone (owner uid {}, mode {:o}): its files are not believed",
                terms_dir.display(),
                st.st_uid,
                st.st_mode & 0o7777
            ));
        }
        match crate::hostile::open_file(&dir, name, MAX_PIN_BYTES) {
            Ok(file) => {
                use std::io::Read as _;
                let owner = std::os::unix::fs::MetadataExt::uid(&file.metadata().map_err(|e| e.to_string())?);
                let mut bytes = Vec::new();
                file.take(MAX_PIN_BYTES).read_to_end(&mut bytes).map_err(|e| format!("{name}: {e}"))?;
                Ok(Some((bytes, owner)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", terms_dir.join(name).display())),
        }
    }

    /// Whether `version` is inside every pin: `[update] pin` (root's) and the admin's
    /// `byoc-runner update pin` (in the terms directory), both. A pin file that cannot be
    /// read or parsed, or that someone other than root or the admin group wrote, holds
    /// every update.
    pub fn pins_allow(&self, terms_dir: &Path, version: &str) -> Result<(), String> {
        if let Some(pin) = &self.pin
            && !pin.allows(version)
        {
            return Err(format!("{version} is outside [update] pin {:?}", pin.as_str()));
        }
        let path = crate::pin_path(terms_dir);
        let (bytes, owner) = match self.read_term(terms_dir, crate::PIN_FILE) {
            Ok(None) => return Ok(()),
            Ok(Some(found)) => found,
            Err(e) => return Err(format!("the pin cannot be read ({e}): no update is allowed")),
        };
        if !self.written_by_a_person(owner) {
            return Err(format!(
                "the pin file {} was written by uid {owner}, neither root nor the admin group: no update is allowed",
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

    /// In `mode = "approve"`: a person's approval of this job and version (`byoc-runner
    /// approve JOB --version V`, root or the admin group, in the terms directory), made
    /// within the last 7 days and not in the future. Its digest, for using it once.
    pub fn approved(
        &self,
        terms_dir: &Path,
        job_id: &str,
        version: &str,
        now_ms: u64,
    ) -> Result<String, String> {
        if !crate::plain_job_id(job_id) {
            return Err(format!("{job_id:?} is not a job id"));
        }
        let path = crate::update_approval_path(terms_dir, job_id);
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let (bytes, owner) = self
            .read_term(terms_dir, &name)?
            .ok_or_else(|| format!("nobody approved job {job_id} for {version} (`byoc-runner approve {job_id} --version {version}`)"))?;
        if !self.written_by_a_person(owner) {
            return Err(format!(
                "the approval {} was written by uid {owner}, neither root nor the admin group",
                path.display()
            ));
        }
        let note: crate::UpdateApproval =
            serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        if note.job_id != job_id || note.version != version || note.uid != owner {
            return Err(format!(
                "job {job_id} was approved for {} {} by uid {}, not {version} (file of uid {owner})",
                note.job_id, note.version, note.uid
            ));
        }
        if note.at_ms > now_ms + CLOCK_SKEW_MS {
            return Err(format!("the approval of job {job_id} is dated in the future"));
        }
        if now_ms.saturating_sub(note.at_ms) > APPROVAL_VALID_MS {
            return Err(format!("the approval of job {job_id} by {} is more than 7 days old", note.by));
        }
        Ok(crate::sha256_hex(&bytes))
    }
}

/// How far ahead of the updater's clock an approval may be dated.
const CLOCK_SKEW_MS: u64 = 5 * 60 * 1000;
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
