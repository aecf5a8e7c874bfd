//! `[update]`: the customer's terms for the runner's own updates (docs/OPERATIONS.md).

use std::time::Duration;

use super::fields::Fields;
use crate::update::minisign::PublicKey;
use crate::update::version::Pin;

/// The same modes the updater reads (it parses `[update]` again itself).
pub use byoc_updater::terms::UpdateMode;

#[derive(Debug, Clone, Default)]
pub struct UpdateConfig {
    pub mode: UpdateMode,
    /// The minisign key releases are signed with (the one user-data verified the
    /// installed release with). Without it every update is refused.
    pub release_key: Option<PublicKey>,
    /// Versions the customer lets in (the CLI's pin, in `control/`, takes precedence).
    pub pin: Option<Pin>,
    /// How long the updater waits for the new version to be healthy before it rolls back.
    pub health_timeout: Duration,
    /// How many installed releases the updater keeps for rollback.
    pub keep_releases: usize,
}

impl UpdateConfig {
    pub(super) fn parse(table: toml::Table, problems: &mut Vec<String>) -> Self {
        let mut f = Fields::new("update", table, problems);
        let mode: Option<String> = f.get("mode");
        let key: Option<String> = f.get("release_public_key");
        let pin: Option<String> = f.get("pin");
        let health_timeout = f.secs("health_timeout_secs", 180, 10..=3600);
        let keep_releases = f.ranged("keep_releases", 2, 2..=10) as usize;
        let problems = f.finish();
        let mode = match mode.as_deref() {
            None => UpdateMode::default(),
            Some("auto") => UpdateMode::Auto,
            Some("approve") => UpdateMode::Approve,
            Some("off") => UpdateMode::Off,
            Some(other) => {
                problems.push(format!("update.mode: {other:?} is not one of auto, approve, off"));
                UpdateMode::Off
            }
        };
        let release_key = key.and_then(|k| match PublicKey::parse(&k) {
            Ok(k) => Some(k),
            Err(e) => {
                problems.push(format!("update.release_public_key: {e}"));
                None
            }
        });
        let pin = pin.and_then(|p| match Pin::parse(&p) {
            Ok(p) => Some(p),
            Err(e) => {
                problems.push(format!("update.pin: {e}"));
                None
            }
        });
        UpdateConfig { mode, release_key, pin, health_timeout, keep_releases }
    }
}
