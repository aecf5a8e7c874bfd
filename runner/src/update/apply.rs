//! The updater (`byoc-runner update apply`, run as root by `byoc-runner-update.service`
//! when `request.json` appears). It trusts nothing the daemon wrote: it verifies the
//! staged release again with the pinned key, holds it to the customer's terms, checks
//! the package's own control fields, and refuses to go on without a kept copy of the
//! running version to go back to. Then: drain (stop) the daemon, install, start, wait
//! for health (READY, the first answered poll by the new version with the same
//! identity key, `config check`); without it, reinstall the kept package and start it.
//!
//! `progress.json` (fsynced before the daemon is stopped) makes a reset or a killed
//! updater resumable: at the next start (the request is still there, so the path unit
//! starts the updater again) it installs the new package again and checks health, and
//! rolls back as above if it does not come.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::release::{self, Release};
use super::{Health, Outcome, Request, health_path, outcome_path, request_path, staged_dir};
use crate::config::{Config, UpdateMode};

/// What the updater does to the machine: systemd and dpkg on a VM, a fake in tests.
pub trait Host {
    /// dpkg's installed byoc-runner version.
    fn installed_version(&self) -> Option<String>;
    /// `Package`, `Version`, `Architecture` of a .deb (dpkg-deb -f).
    fn package_fields(&self, deb: &Path) -> Result<[String; 3], String>;
    /// Stop the daemon (it drains: running jobs finish, new ones are not taken).
    fn stop_runner(&self) -> Result<(), String>;
    fn install(&self, deb: &Path) -> Result<(), String>;
    /// Start the daemon; returns when it reports READY (Type=notify) or fails.
    fn start_runner(&self) -> Result<(), String>;
    fn config_check(&self) -> Result<(), String>;
    fn now_ms(&self) -> u64;
    fn wait(&self, d: Duration);
}

/// Where the updater keeps what it needs across a reset.
#[derive(Debug, Clone)]
pub struct Paths {
    pub state_dir: PathBuf,
    /// `/var/lib/byoc-runner-update`: `releases/<version>/`, `progress.json`, `last.json`.
    pub updater_dir: PathBuf,
}

impl Paths {
    pub fn releases(&self) -> PathBuf {
        self.updater_dir.join("releases")
    }
    fn progress(&self) -> PathBuf {
        self.updater_dir.join("progress.json")
    }
    pub fn last(&self) -> PathBuf {
        self.updater_dir.join("last.json")
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Progress {
    request: Request,
    previous_version: String,
    previous_sha256: String,
    key_sha256: Option<String>,
    /// The release rotates the release key to this one (pinned once it is installed).
    #[serde(default)]
    rotated_key: Option<String>,
    started_ms: u64,
}

/// A kept release's note: when it was installed and the oldest version it lets the
/// customer roll back to.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Kept {
    #[serde(default)]
    pub min_rollback_version: Option<String>,
    /// The key it was verified with when kept (a later rotation does not strand it).
    #[serde(default)]
    pub release_key: Option<String>,
}

/// The key a kept release verifies with: the one it was kept under, else the pinned one.
pub fn kept_key(
    paths: &Paths,
    version: &str,
    pinned: &super::minisign::PublicKey,
) -> super::minisign::PublicKey {
    read_kept(paths, version)
        .release_key
        .and_then(|k| super::minisign::PublicKey::parse(&k).ok())
        .unwrap_or_else(|| pinned.clone())
}

/// Run the update `request.json` asks for, if any; its outcome is also written for the
/// daemon to audit. `None`: nothing was asked.
pub fn run(host: &dyn Host, config: &Config, paths: &Paths) -> Option<Outcome> {
    let request: Request = match std::fs::read(request_path(&paths.state_dir)) {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(r) => r,
            Err(e) => {
                // Nothing can be installed from it; the refusal is audited all the same.
                let unreadable = Request {
                    job_id: "unknown".into(),
                    version: "unknown".into(),
                    from_version: host.installed_version().unwrap_or_default(),
                    package: String::new(),
                    package_sha256: String::new(),
                    sums_sha256: String::new(),
                    min_rollback_version: None,
                    rollback: false,
                    staged_at_ms: 0,
                };
                let outcome =
                    refused(host, &unreadable, "update_request_invalid", format!("request.json: {e}"));
                finish(paths, &outcome, config.update.keep_releases);
                return Some(outcome);
            }
        },
        Err(_) => return None,
    };
    let resumed: Option<Progress> = std::fs::read(paths.progress())
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .filter(|p: &Progress| p.request == request);
    let outcome = match resumed {
        Some(progress) => {
            tracing::warn!(version = %request.version, "An update was interrupted; resuming it.");
            install_and_watch(host, config, paths, &progress)
        }
        None => match check(host, config, paths, &request) {
            Ok((new, previous)) => start(host, config, paths, &request, &new, &previous),
            Err((code, why)) => refused(host, &request, code, why),
        },
    };
    finish(paths, &outcome, config.update.keep_releases);
    Some(outcome)
}

fn refused(host: &dyn Host, request: &Request, code: &str, why: String) -> Outcome {
    tracing::error!(code, "Update refused: {why}.");
    Outcome {
        result: "refused".into(),
        job_id: request.job_id.clone(),
        from_version: request.from_version.clone(),
        to_version: request.version.clone(),
        from_package_sha256: None,
        to_package_sha256: request.package_sha256.clone(),
        reason: Some(why),
        code: Some(code.into()),
        at_ms: host.now_ms(),
    }
}

/// Everything checked again, as root, from the pinned key and the customer's config.
/// Returns the release to install and the kept one to go back to.
fn check(
    host: &dyn Host,
    config: &Config,
    paths: &Paths,
    request: &Request,
) -> Result<(Release, Release), (&'static str, String)> {
    let key = config
        .update
        .release_key
        .as_ref()
        .ok_or(("update_disabled", "no release key is pinned".to_string()))?;
    let current = host
        .installed_version()
        .ok_or(("update_no_rollback_package", "byoc-runner is not installed by dpkg".to_string()))?;
    let staged = staged_dir(&paths.state_dir);
    let new = if request.rollback {
        let kept = kept_key(paths, &request.version, key);
        let new = release::verify_signed(&staged, &kept, &request.version)
            .map_err(|e| (e.code(), e.to_string()))?;
        let min = read_kept(paths, &current).min_rollback_version;
        if min
            .as_deref()
            .is_some_and(|m| super::version::compare(&request.version, m) == std::cmp::Ordering::Less)
        {
            return Err((
                "update_pinned",
                format!("{current} may not be rolled back past {}", min.unwrap_or_default()),
            ));
        }
        new
    } else {
        if config.update.mode == UpdateMode::Off {
            return Err((
                "update_disabled",
                "updates are switched off here ([update] mode = \"off\")".into(),
            ));
        }
        match super::effective_pin(&config.update, &paths.state_dir) {
            Err(e) => return Err(("update_pinned", e)),
            Ok(Some(pin)) if !pin.allows(&request.version) => {
                return Err((
                    "update_pinned",
                    format!("{} is outside the pin {:?}", request.version, pin.as_str()),
                ));
            }
            Ok(_) => {}
        }
        release::verify(&staged, key, &request.version, &current).map_err(|e| (e.code(), e.to_string()))?
    };
    if new.package_sha256 != request.package_sha256 {
        return Err(("update_digest_mismatch", "the staged package is not the one the job verified".into()));
    }
    let [package, version, arch] =
        host.package_fields(&new.package_path()).map_err(|e| ("update_release_invalid", e))?;
    if package != "byoc-runner" || version != new.version || (arch != release::host_arch() && arch != "all") {
        return Err((
            "update_release_invalid",
            format!(
                "the package's control fields say {package} {version} {arch}, its name says byoc-runner {} {}",
                new.version, new.arch
            ),
        ));
    }
    let previous_key = kept_key(paths, &current, key);
    let previous = release::verify_signed(&paths.releases().join(&current), &previous_key, &current)
        .map_err(|e| {
            (
                "update_no_rollback_package",
                format!("the running version {current} is not kept to roll back to ({e})"),
            )
        })?;
    Ok((new, previous))
}

/// Keep the new release, write the progress (fsynced), then install and watch.
fn start(
    host: &dyn Host,
    config: &Config,
    paths: &Paths,
    request: &Request,
    new: &Release,
    previous: &Release,
) -> Outcome {
    let Some(pinned) = config.update.release_key.as_ref() else {
        return refused(host, request, "update_disabled", "no release key is pinned".into());
    };
    let verified_with =
        if request.rollback { kept_key(paths, &request.version, pinned) } else { pinned.clone() };
    // The running version's package stays verifiable under the key it was verified
    // with, even once this release rotates the pinned key away from it.
    let mut note = read_kept(paths, &previous.version);
    if note.release_key.is_none() {
        note.release_key = Some(kept_key(paths, &previous.version, pinned).line());
        let written = serde_json::to_vec(&note).map_err(std::io::Error::other).and_then(|b| {
            crate::state_dir::write(&paths.releases().join(&previous.version).join("kept.json"), &b, 0o600)
        });
        if let Err(e) = written {
            return refused(
                host,
                request,
                "update_staging_failed",
                format!("noting the kept release's key: {e}"),
            );
        }
    }
    let kept = match keep(paths, new, request.min_rollback_version.clone(), &verified_with) {
        Ok(k) => k,
        Err(e) => {
            return refused(host, request, "update_staging_failed", format!("keeping the release: {e}"));
        }
    };
    let key_sha256 = read_health(&paths.state_dir).map(|h| h.key_sha256);
    let progress = Progress {
        request: Request { package: kept.package.clone(), ..request.clone() },
        previous_version: previous.version.clone(),
        previous_sha256: previous.package_sha256.clone(),
        key_sha256,
        rotated_key: new.rotated_key.clone(),
        started_ms: host.now_ms(),
    };
    if let Err(e) =
        crate::state_dir::write(&paths.progress(), &serde_json::to_vec(&progress).unwrap_or_default(), 0o600)
    {
        return refused(
            host,
            request,
            "update_staging_failed",
            format!("recording the update's progress: {e}"),
        );
    }
    install_and_watch(host, config, paths, &progress)
}

fn install_and_watch(host: &dyn Host, config: &Config, paths: &Paths, progress: &Progress) -> Outcome {
    let request = &progress.request;
    let new_deb = paths.releases().join(&request.version).join(&request.package);
    let outcome = |result: &str, reason: Option<String>| Outcome {
        result: result.into(),
        job_id: request.job_id.clone(),
        from_version: progress.previous_version.clone(),
        to_version: request.version.clone(),
        from_package_sha256: Some(progress.previous_sha256.clone()),
        to_package_sha256: request.package_sha256.clone(),
        reason,
        code: None,
        at_ms: host.now_ms(),
    };
    tracing::info!(from = %progress.previous_version, to = %request.version, "Updating: draining the runner.");
    if let Err(e) = host.stop_runner() {
        tracing::warn!(error = %e, "Stopping the runner: {e}; installing anyway.");
    }
    let mut key_before = None;
    let applied = host
        .install(&new_deb)
        .map_err(|e| format!("installing {}: {e}", request.version))
        .and_then(|()| match &progress.rotated_key {
            Some(new) => set_release_key(&config.source, new).map(|old| key_before = Some(old)),
            None => Ok(()),
        })
        .and_then(|()| healthy(host, config, paths, &request.version, progress.key_sha256.as_deref()));
    match applied {
        Ok(()) => {
            tracing::info!(version = %request.version, "Update applied and healthy.");
            outcome("applied", None)
        }
        Err(why) => {
            tracing::error!(version = %request.version, "Update failed ({why}); rolling back to {}.", progress.previous_version);
            if let Some(old) = &key_before
                && let Err(e) = set_release_key(&config.source, old)
            {
                tracing::error!(error = %e, "Could not pin the previous release key again: {e}.");
            }
            let back = roll_back(host, config, paths, progress);
            let reason = match back {
                Ok(()) => why,
                Err(e) => {
                    format!("{why}; and {} is not healthy again either: {e}", progress.previous_version)
                }
            };
            outcome("rolled_back", Some(reason))
        }
    }
}

/// Pin `key` as the release key in the runner's config (the `release_public_key` line of
/// `[update]`, rewritten in place, owner and mode kept); the key it replaces.
fn set_release_key(config_path: &Path, key: &str) -> Result<String, String> {
    use std::os::unix::fs::MetadataExt as _;
    let fail = |e: String| format!("pinning the rotated release key in {}: {e}", config_path.display());
    let text = std::fs::read_to_string(config_path).map_err(|e| fail(e.to_string()))?;
    let meta = std::fs::metadata(config_path).map_err(|e| fail(e.to_string()))?;
    let mut old = None;
    let lines: Vec<String> = text
        .lines()
        .map(|l| match l.trim_start().strip_prefix("release_public_key") {
            Some(rest) if old.is_none() && rest.trim_start().starts_with('=') => {
                old = Some(rest.trim_start()[1..].trim().trim_matches('"').to_string());
                format!("release_public_key = \"{key}\"")
            }
            _ => l.to_string(),
        })
        .collect();
    let old = old.ok_or_else(|| fail("no release_public_key line".into()))?;
    crate::state_dir::write(config_path, (lines.join("\n") + "\n").as_bytes(), meta.mode() & 0o7777)
        .map_err(|e| fail(e.to_string()))?;
    let (uid, gid) = (nix::unistd::Uid::from_raw(meta.uid()), nix::unistd::Gid::from_raw(meta.gid()));
    nix::unistd::chown(config_path, Some(uid), Some(gid)).map_err(|e| fail(e.to_string()))?;
    Ok(old)
}

fn roll_back(host: &dyn Host, config: &Config, paths: &Paths, progress: &Progress) -> Result<(), String> {
    let _ = host.stop_runner();
    let dir = paths.releases().join(&progress.previous_version);
    let deb = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| format!("no package in {}", dir.display()))?;
    host.install(&deb)?;
    healthy(host, config, paths, &progress.previous_version, progress.key_sha256.as_deref())
}

/// Started (READY), then the first answered poll by `version` with the same identity
/// key, within the bound; then `config check`.
fn healthy(
    host: &dyn Host,
    config: &Config,
    paths: &Paths,
    version: &str,
    key_sha256: Option<&str>,
) -> Result<(), String> {
    let since = host.now_ms();
    let _ = std::fs::remove_file(health_path(&paths.state_dir));
    host.start_runner().map_err(|e| format!("{version} did not start: {e}"))?;
    let bound = config.update.health_timeout;
    let deadline = since + bound.as_millis() as u64;
    let health = loop {
        match read_health(&paths.state_dir) {
            Some(h) if h.version == version && h.first_poll_ms >= since => break h,
            Some(h) if h.version != version => {
                return Err(format!("the runner says it is {}, not {version}", h.version));
            }
            _ if host.now_ms() >= deadline => {
                return Err(format!("{version} did not poll the control plane within {}s", bound.as_secs()));
            }
            _ => host.wait(Duration::from_millis(500)),
        }
    };
    if let Some(before) = key_sha256
        && health.key_sha256 != before
    {
        return Err(format!("{version} runs with another identity key: its audit chain would not continue"));
    }
    host.config_check().map_err(|e| format!("config check fails under {version}: {e}"))
}

fn read_health(state_dir: &Path) -> Option<Health> {
    std::fs::read(health_path(state_dir)).ok().and_then(|b| serde_json::from_slice(&b).ok())
}

pub fn read_kept(paths: &Paths, version: &str) -> Kept {
    std::fs::read(paths.releases().join(version).join("kept.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Copy a verified release into `releases/<version>/` (fsynced), for rollback later.
pub fn keep(
    paths: &Paths,
    release: &Release,
    min_rollback_version: Option<String>,
    verified_with: &super::minisign::PublicKey,
) -> std::io::Result<Release> {
    let dir = paths.releases().join(&release.version);
    if dir != release.dir {
        let tmp = paths.releases().join(format!(".{}.tmp", release.version));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        for name in release.files() {
            let from = release.dir.join(name);
            if from.exists() {
                std::fs::copy(&from, tmp.join(name))?;
                std::fs::File::open(tmp.join(name))?.sync_all()?;
            }
        }
        let release_key = Some(release.rotated_key.clone().unwrap_or_else(|| verified_with.line()));
        let note = serde_json::to_vec(&Kept { min_rollback_version, release_key }).unwrap_or_default();
        std::fs::write(tmp.join("kept.json"), note)?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir)?;
        std::fs::File::open(paths.releases())?.sync_all()?;
    }
    Ok(Release { dir, ..release.clone() })
}

/// The outcome where the daemon and `update status` find it; the request and the
/// progress go, so the path unit does not start the updater again.
fn finish(paths: &Paths, outcome: &Outcome, keep: usize) {
    let bytes = serde_json::to_vec_pretty(outcome).unwrap_or_default();
    for path in [outcome_path(&paths.state_dir), paths.last()] {
        if let Err(e) = crate::state_dir::write(&path, &bytes, 0o644) {
            tracing::error!(error = %e, path = %path.display(), "Could not record the update's outcome: {e}.");
        }
    }
    let _ = std::fs::remove_file(request_path(&paths.state_dir));
    let _ = std::fs::remove_file(paths.progress());
    if outcome.result == "applied" {
        prune(paths, &outcome.to_version, &outcome.from_version, keep);
    }
}

/// Keep the current and the previous release, and the newest others up to `keep` in all.
fn prune(paths: &Paths, current: &str, previous: &str, keep: usize) {
    let Ok(entries) = std::fs::read_dir(paths.releases()) else { return };
    let mut versions: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|v| super::version::valid(v) && v != current && v != previous)
        .collect();
    versions.sort_by(|a, b| super::version::compare(b, a));
    for old in versions.into_iter().skip(keep.saturating_sub(2)) {
        let _ = std::fs::remove_dir_all(paths.releases().join(old));
    }
}

/// The real machine: systemctl and dpkg; `config check` as the runner's user, with
/// this configuration. With a `root` other than `/`, the package lives under it
/// (`dpkg --root`, the way a throwaway or demo install is made) and `config check` runs
/// that root's binary as the updater's own user.
pub struct SystemHost {
    pub config: PathBuf,
    pub root: PathBuf,
    /// The `systemctl` to stop and start `byoc-runner.service` with: the real one on a
    /// VM; the demo's stand-in, which supervises the runner process itself.
    pub systemctl: PathBuf,
}

impl SystemHost {
    fn is_system_root(&self) -> bool {
        self.root == Path::new("/")
    }

    fn systemctl(&self, args: &[&str]) -> Result<(), String> {
        command(&self.systemctl.to_string_lossy(), args).map(drop)
    }
}

fn command(program: &str, args: &[&str]) -> Result<String, String> {
    let out =
        std::process::Command::new(program).args(args).output().map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Err(format!("{program} {}: {} {}", args.join(" "), out.status, err.trim()))
    }
}

impl Host for SystemHost {
    fn installed_version(&self) -> Option<String> {
        super::installed_version(&super::dpkg_status(&self.root))
    }
    fn package_fields(&self, deb: &Path) -> Result<[String; 3], String> {
        let path = deb.to_string_lossy();
        let out = command("dpkg-deb", &["--field", &path, "Package", "Version", "Architecture"])?;
        let field = |name: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(':')))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        Ok([field("Package"), field("Version"), field("Architecture")])
    }
    fn stop_runner(&self) -> Result<(), String> {
        self.systemctl(&["stop", "byoc-runner.service"])
    }
    fn install(&self, deb: &Path) -> Result<(), String> {
        let deb = deb.to_string_lossy();
        if self.is_system_root() {
            // A reset mid-install leaves dpkg's database half-done: finish it first.
            let _ = command("dpkg", &["--configure", "-a"]);
            return command("dpkg", &["--force-confold", "-i", &deb]).map(drop);
        }
        // As user-data installs into a root: the maintainer scripts run outside it with
        // DPKG_ROOT set, and the root's database has no libc to depend on.
        let root = format!("--root={}", self.root.display());
        let flags = ["--force-script-chrootless", "--force-not-root", "--force-depends", "--force-confold"];
        let _ = command("dpkg", &[&root, flags[0], flags[1], flags[2], "--configure", "-a"]);
        command("dpkg", &[&root, flags[0], flags[1], flags[2], flags[3], "-i", &deb]).map(drop)
    }
    fn start_runner(&self) -> Result<(), String> {
        self.systemctl(&["start", "byoc-runner.service"])
    }
    fn config_check(&self) -> Result<(), String> {
        let config = self.config.to_string_lossy();
        if !self.is_system_root() {
            let binary = self.root.join(super::PACKAGED_BINARY.trim_start_matches('/'));
            return command(&binary.to_string_lossy(), &["config", "check", "--config", &config]).map(drop);
        }
        let args =
            ["-u", "byoc-runner", "--", super::PACKAGED_BINARY, "config", "check", "--config", &config];
        command("runuser", &args).map(drop)
    }
    fn now_ms(&self) -> u64 {
        crate::clock::now_ms()
    }
    fn wait(&self, d: Duration) {
        std::thread::sleep(d);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::super::release::fixture;
    use super::*;

    /// dpkg and systemd in memory: `start_runner` writes the health a daemon of the
    /// installed version would, unless that version is one that never gets healthy.
    struct FakeHost {
        state_dir: PathBuf,
        installed: RefCell<String>,
        unhealthy: Vec<String>,
        fail_install: Vec<String>,
        calls: RefCell<Vec<String>>,
        now: RefCell<u64>,
    }

    impl FakeHost {
        fn new(state_dir: &Path, installed: &str) -> Self {
            FakeHost {
                state_dir: state_dir.into(),
                installed: RefCell::new(installed.into()),
                unhealthy: Vec::new(),
                fail_install: Vec::new(),
                calls: RefCell::default(),
                now: RefCell::new(1_000),
            }
        }
        fn version_of(deb: &Path) -> String {
            let name = deb.file_name().unwrap().to_string_lossy().into_owned();
            name.trim_start_matches("byoc-runner_").split('_').next().unwrap().to_string()
        }
    }

    impl Host for FakeHost {
        fn installed_version(&self) -> Option<String> {
            Some(self.installed.borrow().clone())
        }
        fn package_fields(&self, deb: &Path) -> Result<[String; 3], String> {
            Ok(["byoc-runner".into(), Self::version_of(deb), release::host_arch().into()])
        }
        fn stop_runner(&self) -> Result<(), String> {
            self.calls.borrow_mut().push("stop".into());
            Ok(())
        }
        fn install(&self, deb: &Path) -> Result<(), String> {
            let v = Self::version_of(deb);
            self.calls.borrow_mut().push(format!("install {v}"));
            if self.fail_install.contains(&v) {
                return Err("dpkg: No space left on device".into());
            }
            *self.installed.borrow_mut() = v;
            Ok(())
        }
        fn start_runner(&self) -> Result<(), String> {
            let v = self.installed.borrow().clone();
            self.calls.borrow_mut().push(format!("start {v}"));
            if !self.unhealthy.contains(&v) {
                *self.now.borrow_mut() += 10;
                let h =
                    Health { version: v, pid: 1, first_poll_ms: *self.now.borrow(), key_sha256: "k".into() };
                std::fs::create_dir_all(super::super::dir(&self.state_dir)).unwrap();
                std::fs::write(health_path(&self.state_dir), serde_json::to_vec(&h).unwrap()).unwrap();
            }
            Ok(())
        }
        fn config_check(&self) -> Result<(), String> {
            Ok(())
        }
        fn now_ms(&self) -> u64 {
            *self.now.borrow()
        }
        fn wait(&self, d: Duration) {
            *self.now.borrow_mut() += d.as_millis() as u64;
        }
    }

    struct Setup {
        _dirs: (tempfile::TempDir, tempfile::TempDir),
        paths: Paths,
        config: Config,
    }

    /// The release 0.2.0 in `tree`, staged as the daemon stages it under 0.1.0.
    fn stage_0_2_0(paths: &Paths, tree: &Path, job_id: &str) {
        let stager = super::super::stage::Stager {
            state_dir: paths.state_dir.clone(),
            key: Some(fixture::public_key()),
            current: "0.1.0".into(),
            audit: None,
        };
        let ask = byoc_job_executors::runner_update::UpdateAsk {
            version: "0.2.0".into(),
            downgrade: false,
            min_rollback_version: None,
        };
        byoc_job_executors::runner_update::ReleaseStager::stage(&stager, job_id, tree, &ask).unwrap();
    }

    /// Version 0.1.0 installed and kept; 0.2.0 staged by the daemon.
    fn setup(mode: &str) -> Setup {
        let (state, updater) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let paths = Paths { state_dir: state.path().into(), updater_dir: updater.path().into() };
        let kept = paths.releases().join("0.1.0");
        std::fs::create_dir_all(&kept).unwrap();
        fixture::release(&kept, "0.1.0", &[]);
        let tree = tempfile::tempdir().unwrap();
        fixture::release(tree.path(), "0.2.0", &[]);
        stage_0_2_0(&paths, tree.path(), "job-1");
        let (line, _) = minisign_line();
        let text = format!(
            "[control_plane]\nurl = \"https://cp.example.com\"\npublic_keys = [\"{}\"]\n[runner]\ninstall_id = \"i\"\n[update]\nmode = \"{mode}\"\nrelease_public_key = \"{line}\"\nhealth_timeout_secs = 10\n",
            byoc_protocol::b64(byoc_protocol::generate_signing_key().verifying_key().as_bytes())
        );
        let config_path = paths.updater_dir.join("runner.toml");
        std::fs::write(&config_path, &text).unwrap();
        let config = Config::load(&config_path).unwrap();
        Setup { _dirs: (state, updater), paths, config }
    }

    fn minisign_line() -> (String, String) {
        super::super::minisign::sign(&fixture::signing_key(), fixture::KEY_ID, b"", "")
    }

    #[test]
    fn a_good_update_is_installed_watched_and_kept() {
        let s = setup("auto");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let out = run(&host, &s.config, &s.paths).unwrap();
        assert_eq!(
            (out.result.as_str(), out.from_version.as_str(), out.to_version.as_str()),
            ("applied", "0.1.0", "0.2.0")
        );
        assert_eq!(*host.calls.borrow(), ["stop", "install 0.2.0", "start 0.2.0"]);
        assert!(s.paths.releases().join("0.2.0").is_dir() && s.paths.releases().join("0.1.0").is_dir());
        assert!(!request_path(&s.paths.state_dir).exists(), "the request is spent");
        let written: Outcome =
            serde_json::from_slice(&std::fs::read(outcome_path(&s.paths.state_dir)).unwrap()).unwrap();
        assert_eq!(written, out);
        assert!(run(&host, &s.config, &s.paths).is_none(), "nothing asked any more");
    }

    #[test]
    fn a_release_that_never_gets_healthy_is_rolled_back_within_the_bound() {
        let s = setup("auto");
        let mut host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        host.unhealthy = vec!["0.2.0".into()];
        let out = run(&host, &s.config, &s.paths).unwrap();
        assert_eq!(out.result, "rolled_back");
        assert!(
            out.reason.as_deref().unwrap().contains("did not poll the control plane within 10s"),
            "{out:?}"
        );
        assert_eq!(
            *host.calls.borrow(),
            ["stop", "install 0.2.0", "start 0.2.0", "stop", "install 0.1.0", "start 0.1.0"]
        );
        assert_eq!(*host.installed.borrow(), "0.1.0");
        assert!(*host.now.borrow() <= 1_000 + 10_000 + 2_000, "gave up at the bound");
    }

    #[test]
    fn a_failed_install_disk_full_goes_back_to_the_kept_package() {
        let s = setup("auto");
        let mut host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        host.fail_install = vec!["0.2.0".into()];
        let out = run(&host, &s.config, &s.paths).unwrap();
        assert_eq!(out.result, "rolled_back");
        assert!(out.reason.as_deref().unwrap().contains("No space left"), "{out:?}");
        assert_eq!(*host.installed.borrow(), "0.1.0");
    }

    #[test]
    fn the_updater_holds_the_release_to_the_terms_itself() {
        // Switched off after the daemon staged it: nothing is stopped or installed.
        let s = setup("off");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let out = run(&host, &s.config, &s.paths).unwrap();
        assert_eq!((out.result.as_str(), out.code.as_deref()), ("refused", Some("update_disabled")));
        assert!(host.calls.borrow().is_empty());
        // A staged package swapped after the daemon verified it.
        let s = setup("auto");
        let staged = staged_dir(&s.paths.state_dir);
        let deb = std::fs::read_dir(&staged)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .unwrap();
        std::fs::write(&deb, "evil").unwrap();
        let out = run(&host, &s.config, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_digest_mismatch"));
        assert!(host.calls.borrow().is_empty());
    }

    /// A release whose key rotation the pinned key signed: installed, and the new key is
    /// pinned in the config the new version starts with; rolled back, the old one again.
    fn rotating(s: &Setup) -> String {
        let (next, next_id) = (ed25519_dalek::SigningKey::from_bytes(&[8; 32]), [0x77; 8]);
        let (next_line, _) = super::super::minisign::sign(&next, next_id, b"", "");
        let tree = tempfile::tempdir().unwrap();
        std::fs::write(tree.path().join(format!("byoc-runner_0.2.0_{}.deb", release::host_arch())), "p2")
            .unwrap();
        let statement = format!("{next_line}\n");
        std::fs::write(tree.path().join(release::NEW_KEY), &statement).unwrap();
        let (_, sig) =
            super::super::minisign::sign(&fixture::signing_key(), fixture::KEY_ID, statement.as_bytes(), "r");
        std::fs::write(tree.path().join(release::NEW_KEY_SIG), sig).unwrap();
        fixture::sign_dir(tree.path(), &next, next_id);
        stage_0_2_0(&s.paths, tree.path(), "job-2");
        next_line
    }

    #[test]
    fn a_rotated_release_key_is_pinned_with_the_release_and_unpinned_with_a_rollback() {
        let s = setup("auto");
        let next = rotating(&s);
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        assert_eq!(run(&host, &s.config, &s.paths).unwrap().result, "applied");
        let text = std::fs::read_to_string(&s.config.source).unwrap();
        assert!(text.contains(&format!("release_public_key = \"{next}\"")), "{text}");
        // Back to the release from before the rotation: it verifies with the key it was
        // kept under, not the one pinned now.
        let rotated = Config::load(&s.config.source).unwrap();
        // As `update rollback` stages it: a fresh directory with the kept files.
        let staged = staged_dir(&s.paths.state_dir);
        let _ = std::fs::remove_dir_all(&staged);
        std::fs::create_dir_all(&staged).unwrap();
        let kept = s.paths.releases().join("0.1.0");
        for e in std::fs::read_dir(&kept).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, staged.join(p.file_name().unwrap())).unwrap();
        }
        let found = release::verify_signed(&kept, &fixture::public_key(), "0.1.0").unwrap();
        let request = Request {
            job_id: "local-rollback-1".into(),
            version: "0.1.0".into(),
            from_version: "0.2.0".into(),
            package: found.package.clone(),
            package_sha256: found.package_sha256.clone(),
            sums_sha256: found.sums_sha256.clone(),
            min_rollback_version: None,
            rollback: true,
            staged_at_ms: 1,
        };
        std::fs::write(request_path(&s.paths.state_dir), serde_json::to_vec(&request).unwrap()).unwrap();
        let out = run(&host, &rotated, &s.paths).unwrap();
        assert_eq!((out.result.as_str(), out.to_version.as_str()), ("applied", "0.1.0"), "{out:?}");

        let s = setup("auto");
        let before = std::fs::read_to_string(&s.config.source).unwrap();
        rotating(&s);
        let mut host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        host.unhealthy = vec!["0.2.0".into()];
        assert_eq!(run(&host, &s.config, &s.paths).unwrap().result, "rolled_back");
        assert_eq!(std::fs::read_to_string(&s.config.source).unwrap(), before);
    }

    #[test]
    fn a_damaged_request_is_refused_and_spent() {
        let s = setup("auto");
        std::fs::write(request_path(&s.paths.state_dir), "{").unwrap();
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let out = run(&host, &s.config, &s.paths).unwrap();
        assert_eq!((out.result.as_str(), out.code.as_deref()), ("refused", Some("update_request_invalid")));
        assert!(host.calls.borrow().is_empty());
        assert!(!request_path(&s.paths.state_dir).exists(), "the path unit would start the updater again");
    }

    #[test]
    fn without_a_kept_package_to_go_back_to_nothing_is_installed() {
        let s = setup("auto");
        std::fs::remove_dir_all(s.paths.releases().join("0.1.0")).unwrap();
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let out = run(&host, &s.config, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_no_rollback_package"));
        assert!(host.calls.borrow().is_empty());
    }

    #[test]
    fn an_interrupted_update_is_resumed_at_the_next_start() {
        let s = setup("auto");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let request: Request =
            serde_json::from_slice(&std::fs::read(request_path(&s.paths.state_dir)).unwrap()).unwrap();
        let (new, previous) = check(&host, &s.config, &s.paths, &request).unwrap();
        // As `start` does up to the moment of a reset: kept, progress written, then gone.
        let kept = keep(&s.paths, &new, None, &fixture::public_key()).unwrap();
        let progress = Progress {
            request: Request { package: kept.package.clone(), ..request },
            previous_version: previous.version.clone(),
            previous_sha256: previous.package_sha256.clone(),
            key_sha256: None,
            rotated_key: None,
            started_ms: 1,
        };
        std::fs::write(s.paths.progress(), serde_json::to_vec(&progress).unwrap()).unwrap();
        // dpkg was half-way: the runner's files are neither version's.
        *host.installed.borrow_mut() = "0.2.0".into();
        let out = run(&host, &s.config, &s.paths).unwrap();
        assert_eq!(out.result, "applied");
        assert_eq!(*host.calls.borrow(), ["stop", "install 0.2.0", "start 0.2.0"]);
        assert!(!s.paths.progress().exists());
    }
}
