//! The updater's run (`byoc-runner-updater`, root, started by
//! `byoc-runner-update.service`). It trusts nothing the daemon wrote: the staged release
//! is copied out of the runner's directory (no link followed, each file read once)
//! into the updater's own `incoming/`, and only that copy is verified with the pinned
//! key, held to the customer's terms, inspected (the package's control fields) and
//! kept; it refuses to go on without a kept copy of the running version to go back
//! to. Then: drain (stop) the daemon, re-hash the kept package against its signed
//! digest, install, start, wait for health (READY, the first answered poll by the new
//! version with the same identity key, `config check`); without it, re-hash and
//! reinstall the kept package and start it.
//!
//! Requests: the runner's `request.json` (an update a job asked for; bound by
//! `[update] mode` and the pin; a rollback there is refused), or root's
//! `rollback.json` in the updater's own directory (`byoc-runner update rollback`).
//! A request is answered once: its digest is kept in `handled.json`, and the outcome
//! (`last.json`, naming the request's digest) is the runner's signal to remove it.
//!
//! `progress.json` (fsynced before the daemon is stopped) makes a reset or a killed
//! updater resumable: at the next start (its path unit watches it) the updater installs
//! the new package again and checks health, and rolls back as above if it does not come.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::release::{self, Release};
use crate::terms::{Terms, UpdateMode};
use crate::{Health, Outcome, Request, RollbackRequest, health_path, hostile, request_path, staged_dir};

/// Largest request, health or note the updater reads.
const MAX_NOTE_BYTES: u64 = 64 << 10;
/// Largest package the updater copies out of the runner's directory.
const MAX_PACKAGE_BYTES: u64 = 1 << 30;
/// How many answered requests' digests `handled.json` keeps.
const HANDLED_KEPT: usize = 32;

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

/// Where the updater reads requests and keeps what it needs across a reset.
#[derive(Debug, Clone)]
pub struct Paths {
    /// The runner's (hostile): `update/request.json`, `update/staged/`, `update/health.json`.
    pub state_dir: PathBuf,
    /// `/var/lib/byoc-runner-update` (root's): `releases/<version>/`, `incoming/`,
    /// `progress.json`, `handled.json`, `rollback.json`, `last.json`.
    pub updater_dir: PathBuf,
}

impl Paths {
    pub fn releases(&self) -> PathBuf {
        self.updater_dir.join("releases")
    }
    fn incoming(&self) -> PathBuf {
        self.updater_dir.join("incoming")
    }
    fn progress(&self) -> PathBuf {
        self.updater_dir.join("progress.json")
    }
    fn handled(&self) -> PathBuf {
        self.updater_dir.join("handled.json")
    }
    pub fn last(&self) -> PathBuf {
        crate::last_path(&self.updater_dir)
    }
    pub fn rollback(&self) -> PathBuf {
        crate::rollback_path(&self.updater_dir)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Progress {
    request: Request,
    /// The digest of the request it answers.
    request_sha256: String,
    /// Root's rollback (`rollback.json` goes when it is answered).
    #[serde(default)]
    from_root: bool,
    previous_version: String,
    previous_sha256: String,
    key_sha256: Option<String>,
    /// The release rotates the release key to this one (pinned once it is installed).
    #[serde(default)]
    rotated_key: Option<String>,
    started_ms: u64,
    /// Installs of the new release begun (a reset or a killed updater interrupts one):
    /// after two, the updater goes back to the kept release instead.
    #[serde(default)]
    attempts: u32,
}

/// Installs of a release begun before the updater gives up on it and goes back.
const MAX_ATTEMPTS: u32 = 2;

/// A kept release's note: the key it was verified with when kept (a later rotation
/// does not strand it) and its package's digest.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Kept {
    #[serde(default)]
    pub release_key: Option<String>,
    #[serde(default)]
    pub package_sha256: Option<String>,
}

/// The key a kept release verifies with: the one it was kept under, else the pinned one.
pub fn kept_key(
    paths: &Paths,
    version: &str,
    pinned: &crate::minisign::PublicKey,
) -> crate::minisign::PublicKey {
    read_kept(paths, version)
        .release_key
        .and_then(|k| crate::minisign::PublicKey::parse(&k).ok())
        .unwrap_or_else(|| pinned.clone())
}

/// A request to answer, and where it came from.
struct Asked {
    request: Request,
    sha256: String,
    from_root: bool,
}

type Refusal = (&'static str, String);

/// Answer the request there is, if any: an interrupted update first, then root's
/// rollback, then the runner's request. The outcome is also written to `last.json`.
/// `None`: nothing was asked (or the runner's request was answered already).
pub fn run(host: &dyn Host, terms: &Terms, paths: &Paths) -> Option<Outcome> {
    match hostile::read_path(&paths.progress(), MAX_NOTE_BYTES) {
        Ok(None) => {}
        Ok(Some(bytes)) => match serde_json::from_slice::<Progress>(&bytes) {
            Ok(progress) => return Some(resume(host, terms, paths, progress)),
            Err(e) => return Some(progress_damaged(host, paths, e.to_string())),
        },
        Err(e) => return Some(progress_damaged(host, paths, e.to_string())),
    }
    let asked = match next_request(host, paths) {
        Ok(Some(asked)) => asked,
        Ok(None) => return None,
        Err(refusal) => {
            let (sha256, from_root, outcome) = *refusal;
            finish(paths, &outcome, terms.keep_releases, &sha256, from_root);
            return Some(outcome);
        }
    };
    let checked = if asked.from_root {
        check_rollback(host, terms, paths, &asked.request)
    } else {
        check(host, terms, paths, &asked.request)
    };
    let outcome = match checked {
        Ok((new, previous)) => start(host, terms, paths, &asked, &new, &previous),
        Err((code, why)) => refused(host, &asked.request, code, why),
    };
    finish(paths, &outcome, terms.keep_releases, &asked.sha256, asked.from_root);
    Some(outcome)
}

/// An update a reset or a killed updater interrupted: installed again and watched, or
/// after [`MAX_ATTEMPTS`], the kept release installed again instead.
fn resume(host: &dyn Host, terms: &Terms, paths: &Paths, mut progress: Progress) -> Outcome {
    let request = progress.request.clone();
    let outcome = if progress.attempts >= MAX_ATTEMPTS {
        tracing::error!(version = %request.version, "An update was interrupted {} times; going back to {}.", progress.attempts, progress.previous_version);
        let reason = match roll_back(host, terms, paths, &progress) {
            Ok(()) => format!("interrupted {} times while installing it", progress.attempts),
            Err(e) => format!(
                "interrupted {} times while installing it; and {} is not healthy again either: {e}",
                progress.attempts, progress.previous_version
            ),
        };
        Outcome {
            result: "rolled_back".into(),
            job_id: request.job_id.clone(),
            from_version: progress.previous_version.clone(),
            to_version: request.version.clone(),
            from_package_sha256: Some(progress.previous_sha256.clone()),
            to_package_sha256: request.package_sha256.clone(),
            reason: Some(reason),
            code: None,
            at_ms: host.now_ms(),
            request_sha256: None,
        }
    } else {
        tracing::warn!(version = %request.version, "An update was interrupted; resuming it.");
        progress.attempts += 1;
        match write_own(&paths.progress(), &serde_json::to_vec(&progress).unwrap_or_default(), 0o600) {
            Ok(()) => install_and_watch(host, terms, paths, &progress),
            // Uncounted, an attempt could repeat without end: go back instead.
            Err(e) => {
                progress.attempts = MAX_ATTEMPTS;
                tracing::error!(error = %e, "Could not count the attempt: {e}; going back.");
                return resume(host, terms, paths, progress);
            }
        }
    };
    finish(paths, &outcome, terms.keep_releases, &progress.request_sha256, progress.from_root);
    outcome
}

/// A progress file the updater cannot read: set aside (so that its path unit does not
/// start it again and again), the runner started on whatever is installed, and said.
fn progress_damaged(host: &dyn Host, paths: &Paths, why: String) -> Outcome {
    let aside = paths.updater_dir.join(format!("progress.json.damaged-{}", host.now_ms()));
    if let Err(e) = std::fs::rename(paths.progress(), &aside) {
        tracing::error!(error = %e, "Could not set the damaged progress aside: {e}.");
    }
    if let Err(e) = host.start_runner() {
        tracing::error!(error = %e, "Starting the runner: {e}.");
    }
    let current = host.installed_version().unwrap_or_default();
    let outcome = Outcome {
        result: "refused".into(),
        job_id: "unknown".into(),
        from_version: current.clone(),
        to_version: current,
        from_package_sha256: None,
        to_package_sha256: String::new(),
        reason: Some(format!(
            "the update's progress is unreadable ({why}); set aside as {}",
            aside.display()
        )),
        code: Some("update_progress_unreadable".into()),
        at_ms: host.now_ms(),
        request_sha256: None,
    };
    finish(paths, &outcome, 0, "", false);
    outcome
}

/// Root's rollback request, else the runner's request unless it was answered already.
/// An unreadable or refused request: its digest and the refusal.
/// A request refused before it is checked: its digest, whether it is root's, the outcome.
type Unanswerable = Box<(String, bool, Outcome)>;

fn unanswerable(sha256: String, from_root: bool, outcome: Outcome) -> Unanswerable {
    Box::new((sha256, from_root, outcome))
}

fn next_request(host: &dyn Host, paths: &Paths) -> Result<Option<Asked>, Unanswerable> {
    let current = || host.installed_version().unwrap_or_default();
    let unknown = |job_id: &str| Request {
        job_id: job_id.into(),
        version: "unknown".into(),
        from_version: current(),
        package: String::new(),
        package_sha256: String::new(),
        sums_sha256: String::new(),
        min_rollback_version: None,
        rollback: false,
        staged_at_ms: 0,
    };
    match hostile::read_path(&paths.rollback(), MAX_NOTE_BYTES) {
        Ok(None) => {}
        Ok(Some(bytes)) => {
            let sha256 = crate::sha256_hex(&bytes);
            return match serde_json::from_slice::<RollbackRequest>(&bytes) {
                Ok(r) => Ok(Some(Asked {
                    request: Request {
                        version: r.version,
                        rollback: true,
                        staged_at_ms: r.at_ms,
                        ..unknown(&format!("local-rollback-{}", r.at_ms))
                    },
                    sha256,
                    from_root: true,
                })),
                Err(e) => Err(unanswerable(
                    sha256,
                    true,
                    refused(
                        host,
                        &unknown("local-rollback"),
                        "update_request_invalid",
                        format!("{ROLLBACK}: {e}"),
                    ),
                )),
            };
        }
        Err(e) => {
            let why = format!("{}: {e}", paths.rollback().display());
            return Err(unanswerable(
                String::new(),
                true,
                refused(host, &unknown("local-rollback"), "update_request_invalid", why),
            ));
        }
    }
    let bytes = match hostile::read_path(&request_path(&paths.state_dir), MAX_NOTE_BYTES) {
        Ok(None) => return Ok(None),
        Ok(Some(bytes)) => bytes,
        Err(e) => {
            // Not a regular file, a link, too large: nothing can be installed from it,
            // and it is not answered again until it changes.
            let sha256 = crate::sha256_hex(e.to_string().as_bytes());
            if handled(paths).contains(&sha256) {
                return Ok(None);
            }
            let why = format!("request.json: {e}");
            return Err(unanswerable(
                sha256,
                false,
                refused(host, &unknown("unknown"), "update_request_invalid", why),
            ));
        }
    };
    let sha256 = crate::sha256_hex(&bytes);
    if handled(paths).contains(&sha256) {
        return Ok(None);
    }
    match serde_json::from_slice::<Request>(&bytes) {
        Ok(r) if r.rollback => {
            let why =
                "a rollback is root's to ask (`byoc-runner update rollback`), not the runner's".to_string();
            Err(unanswerable(sha256, false, refused(host, &r, "update_rollback_refused", why)))
        }
        Ok(r) => Ok(Some(Asked { request: r, sha256, from_root: false })),
        Err(e) => Err(unanswerable(
            sha256,
            false,
            refused(host, &unknown("unknown"), "update_request_invalid", format!("request.json: {e}")),
        )),
    }
}

const ROLLBACK: &str = crate::ROLLBACK_FILE;

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
        request_sha256: None,
    }
}

/// The runner's request, checked again as root from the pinned key and the customer's
/// terms, on the updater's own copy of the staged release. Returns the release to
/// install (in `incoming/`) and the kept one to go back to.
fn check(
    host: &dyn Host,
    terms: &Terms,
    paths: &Paths,
    request: &Request,
) -> Result<(Release, Release), Refusal> {
    let key =
        terms.release_key.as_ref().ok_or(("update_disabled", "no release key is pinned".to_string()))?;
    if terms.mode == UpdateMode::Off {
        return Err(("update_disabled", "updates are switched off here ([update] mode = \"off\")".into()));
    }
    let terms_dir = crate::terms_dir(&paths.updater_dir);
    terms.pins_allow(&terms_dir, &request.version).map_err(|e| ("update_pinned", e))?;
    // The daemon held the job for a person; the runner's user could stage one it never
    // held. Root asks for the person's own record, and uses it once.
    if terms.mode == UpdateMode::Approve {
        let approval = terms
            .approved(&terms_dir, &request.job_id, &request.version, host.now_ms())
            .map_err(|e| ("update_not_approved", e))?;
        spend_approval(paths, &approval).map_err(|e| ("update_not_approved", e))?;
    }
    let current = host
        .installed_version()
        .ok_or(("update_no_rollback_package", "byoc-runner is not installed by dpkg".to_string()))?;
    let copy = copy_staged(paths, &request.package).map_err(|e| ("update_release_invalid", e))?;
    let new =
        release::verify(&copy, key, &request.version, &current).map_err(|e| (e.code(), e.to_string()))?;
    // Never over the running version (a signed DOWNGRADE may name it, as dpkg orders
    // versions): keeping it would replace the copy to go back to.
    if crate::version::compare(&new.version, &current) == std::cmp::Ordering::Equal {
        return Err(("update_not_newer", format!("{current} is the running version")));
    }
    if new.package_sha256 != request.package_sha256 {
        return Err(("update_digest_mismatch", "the staged package is not the one the job verified".into()));
    }
    inspect(host, &new)?;
    Ok((new, previous_release(paths, key, &current)?))
}

/// Root's rollback: to a kept release (verified with the key it was kept under, its
/// package's digest the one on record), from a kept current one.
fn check_rollback(
    host: &dyn Host,
    terms: &Terms,
    paths: &Paths,
    request: &Request,
) -> Result<(Release, Release), Refusal> {
    let key =
        terms.release_key.as_ref().ok_or(("update_disabled", "no release key is pinned".to_string()))?;
    let current = host
        .installed_version()
        .ok_or(("update_no_rollback_package", "byoc-runner is not installed by dpkg".to_string()))?;
    if !crate::version::valid(&request.version) || request.version == current {
        return Err((
            "update_request_invalid",
            format!("{:?} is not a version to go back to from {current}", request.version),
        ));
    }
    let dir = paths.releases().join(&request.version);
    let target = release::verify_signed(&dir, &kept_key(paths, &request.version, key), &request.version)
        .map_err(|e| {
            ("update_no_rollback_package", format!("{} is not kept to roll back to ({e})", request.version))
        })?;
    if read_kept(paths, &request.version).package_sha256.is_some_and(|d| d != target.package_sha256) {
        return Err((
            "update_digest_mismatch",
            format!("the kept {} is not the package on record", request.version),
        ));
    }
    inspect(host, &target)?;
    Ok((target, previous_release(paths, key, &current)?))
}

/// The package's own control fields say what its name says.
fn inspect(host: &dyn Host, new: &Release) -> Result<(), Refusal> {
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
    Ok(())
}

/// The running version, kept to go back to.
fn previous_release(
    paths: &Paths,
    key: &crate::minisign::PublicKey,
    current: &str,
) -> Result<Release, Refusal> {
    let previous_key = kept_key(paths, current, key);
    release::verify_signed(&paths.releases().join(current), &previous_key, current).map_err(|e| {
        (
            "update_no_rollback_package",
            format!("the running version {current} is not kept to roll back to ({e})"),
        )
    })
}

/// The staged release's files, copied out of the runner's directory into a fresh
/// `incoming/` (root's): each opened once, beneath the staged directory's descriptor,
/// no link followed, regular files only. Everything after reads the copy.
fn copy_staged(paths: &Paths, package: &str) -> Result<PathBuf, String> {
    let incoming = paths.incoming();
    remove_own(&incoming).map_err(|e| format!("clearing {}: {e}", incoming.display()))?;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&incoming)
        .map_err(|e| format!("creating {}: {e}", incoming.display()))?;
    let staged =
        hostile::open_dir(&staged_dir(&paths.state_dir)).map_err(|e| format!("the staged release: {e}"))?;
    let names = [
        (release::SUMS, MAX_NOTE_BYTES, true),
        (release::SUMS_SIG, MAX_NOTE_BYTES, true),
        (package, MAX_PACKAGE_BYTES, true),
        (release::DOWNGRADE, MAX_NOTE_BYTES, false),
        (release::NEW_KEY, MAX_NOTE_BYTES, false),
        (release::NEW_KEY_SIG, MAX_NOTE_BYTES, false),
    ];
    for (name, max, required) in names {
        match hostile::copy_out(&staged, name, &incoming.join(name), max) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {}
            Err(e) => return Err(format!("the staged release: {e}")),
        }
    }
    sync_dir(&incoming).map_err(|e| format!("syncing {}: {e}", incoming.display()))?;
    Ok(incoming)
}

/// How many spent approvals the updater remembers.
const SPENT_KEPT: usize = 256;

/// An approval is used once: a second request under it (the runner's user staging the
/// same job again after a rollback, say) needs a person again.
fn spend_approval(paths: &Paths, digest: &str) -> Result<(), String> {
    let path = paths.updater_dir.join("spent-approvals.json");
    let mut spent: Vec<String> = read_json(&path).unwrap_or_default();
    if spent.iter().any(|d| d == digest) {
        return Err("that approval was used already: approve the job again".into());
    }
    spent.push(digest.to_string());
    let drop = spent.len().saturating_sub(SPENT_KEPT);
    spent.drain(..drop);
    write_own(&path, &serde_json::to_vec(&spent).unwrap_or_default(), 0o600)
        .map_err(|e| format!("recording the approval as used: {e}"))
}

/// Remove a directory of the updater's own (root's, so nothing in it was planted).
fn remove_own(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

use std::os::unix::fs::DirBuilderExt as _;

/// Keep the new release, write the progress (fsynced), then install and watch.
fn start(
    host: &dyn Host,
    terms: &Terms,
    paths: &Paths,
    asked: &Asked,
    new: &Release,
    previous: &Release,
) -> Outcome {
    let request = &asked.request;
    let Some(pinned) = terms.release_key.as_ref() else {
        return refused(host, request, "update_disabled", "no release key is pinned".into());
    };
    let verified_with =
        if asked.from_root { kept_key(paths, &request.version, pinned) } else { pinned.clone() };
    // The running version's package stays verifiable under the key it was verified
    // with, even once this release rotates the pinned key away from it.
    let mut note = read_kept(paths, &previous.version);
    if note.release_key.is_none() || note.package_sha256.is_none() {
        note.release_key.get_or_insert_with(|| kept_key(paths, &previous.version, pinned).line());
        note.package_sha256.get_or_insert_with(|| previous.package_sha256.clone());
        let written = serde_json::to_vec(&note)
            .map_err(std::io::Error::other)
            .and_then(|b| write_own(&paths.releases().join(&previous.version).join("kept.json"), &b, 0o600));
        if let Err(e) = written {
            return refused(host, request, "update_staging_failed", format!("noting the kept release: {e}"));
        }
    }
    let kept = match keep(paths, new, &verified_with) {
        Ok(k) => k,
        Err(e) => {
            return refused(host, request, "update_staging_failed", format!("keeping the release: {e}"));
        }
    };
    let key_sha256 = read_health(&paths.state_dir).map(|h| h.key_sha256);
    let progress = Progress {
        request: Request {
            package: kept.package.clone(),
            package_sha256: kept.package_sha256.clone(),
            from_version: previous.version.clone(),
            ..request.clone()
        },
        request_sha256: asked.sha256.clone(),
        from_root: asked.from_root,
        previous_version: previous.version.clone(),
        previous_sha256: previous.package_sha256.clone(),
        key_sha256,
        rotated_key: new.rotated_key.clone(),
        started_ms: host.now_ms(),
        attempts: 1,
    };
    if let Err(e) = write_own(&paths.progress(), &serde_json::to_vec(&progress).unwrap_or_default(), 0o600) {
        return refused(
            host,
            request,
            "update_staging_failed",
            format!("recording the update's progress: {e}"),
        );
    }
    install_and_watch(host, terms, paths, &progress)
}

/// Install the kept package of `version` after hashing it again: the bytes dpkg gets
/// are the ones whose digest the signed sums name.
fn install_kept(host: &dyn Host, paths: &Paths, version: &str, sha256: &str) -> Result<(), String> {
    let dir = paths.releases().join(version);
    let deb = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| format!("no package in {}", dir.display()))?;
    let found = release::sha256_file(&deb).map_err(|e| e.to_string())?;
    if found != sha256 {
        return Err(format!(
            "the kept package {} is not the verified one (sha256 {found}, not {sha256})",
            deb.display()
        ));
    }
    host.install(&deb)
}

fn install_and_watch(host: &dyn Host, terms: &Terms, paths: &Paths, progress: &Progress) -> Outcome {
    let request = &progress.request;
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
        request_sha256: None,
    };
    tracing::info!(from = %progress.previous_version, to = %request.version, "Updating: draining the runner.");
    if let Err(e) = host.stop_runner() {
        tracing::warn!(error = %e, "Stopping the runner: {e}; installing anyway.");
    }
    let mut key_before = None;
    let applied = install_kept(host, paths, &request.version, &request.package_sha256)
        .map_err(|e| format!("installing {}: {e}", request.version))
        .and_then(|()| match &progress.rotated_key {
            Some(new) => set_release_key(&terms.source, new).map(|old| key_before = Some(old)),
            None => Ok(()),
        })
        .and_then(|()| healthy(host, terms, paths, &request.version, progress.key_sha256.as_deref()));
    match applied {
        Ok(()) => {
            tracing::info!(version = %request.version, "Update applied and healthy.");
            outcome("applied", None)
        }
        Err(why) => {
            tracing::error!(version = %request.version, "Update failed ({why}); rolling back to {}.", progress.previous_version);
            if let Some(old) = &key_before
                && let Err(e) = set_release_key(&terms.source, old)
            {
                tracing::error!(error = %e, "Could not pin the previous release key again: {e}.");
            }
            let back = roll_back(host, terms, paths, progress);
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
    let text = hostile::read_path(config_path, 1 << 20)
        .map_err(|e| fail(e.to_string()))?
        .ok_or_else(|| fail("it does not exist".into()))?;
    let text = String::from_utf8(text).map_err(|_| fail("not UTF-8".into()))?;
    let meta = std::fs::symlink_metadata(config_path).map_err(|e| fail(e.to_string()))?;
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
    byoc_statefs::write(
        config_path,
        (lines.join("\n") + "\n").as_bytes(),
        byoc_statefs::Options::mode(meta.mode() & 0o7777),
    )
    .map_err(|e| fail(e.to_string()))?;
    std::os::unix::fs::lchown(config_path, Some(meta.uid()), Some(meta.gid()))
        .map_err(|e| fail(e.to_string()))?;
    Ok(old)
}

fn roll_back(host: &dyn Host, terms: &Terms, paths: &Paths, progress: &Progress) -> Result<(), String> {
    let _ = host.stop_runner();
    install_kept(host, paths, &progress.previous_version, &progress.previous_sha256)?;
    healthy(host, terms, paths, &progress.previous_version, progress.key_sha256.as_deref())
}

/// Started (READY), then the first answered poll by `version` with the same identity
/// key, within the bound; then `config check`.
fn healthy(
    host: &dyn Host,
    terms: &Terms,
    paths: &Paths,
    version: &str,
    key_sha256: Option<&str>,
) -> Result<(), String> {
    let since = host.now_ms();
    host.start_runner().map_err(|e| format!("{version} did not start: {e}"))?;
    let deadline = since + terms.health_timeout.as_millis() as u64;
    let health = loop {
        match read_health(&paths.state_dir) {
            Some(h) if h.version == version && h.first_poll_ms >= since => break h,
            Some(h) if h.version != version && h.first_poll_ms >= since => {
                return Err(format!("the runner says it is {}, not {version}", h.version));
            }
            _ if host.now_ms() >= deadline => {
                return Err(format!(
                    "{version} did not poll the control plane within {}s",
                    terms.health_timeout.as_secs()
                ));
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
    let bytes = hostile::read_path(&health_path(state_dir), MAX_NOTE_BYTES).ok()??;
    serde_json::from_slice(&bytes).ok()
}

/// A JSON file of the updater's own.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Option<T> {
    let bytes = hostile::read_path(path, MAX_NOTE_BYTES).ok()??;
    serde_json::from_slice(&bytes).ok()
}

pub fn read_kept(paths: &Paths, version: &str) -> Kept {
    read_json(&paths.releases().join(version).join("kept.json")).unwrap_or_default()
}

/// Digests of the requests answered already (newest last).
fn handled(paths: &Paths) -> Vec<String> {
    read_json(&paths.handled()).unwrap_or_default()
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// A file of the updater's own, durably (exclusive temporary file, fsync, rename).
fn write_own(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    byoc_statefs::write(path, bytes, byoc_statefs::Options::mode(mode))
}

/// Move the verified copy in `incoming/` to `releases/<version>/` (fsynced), for
/// install now and rollback later. A release verified in place (a kept one) stays.
pub fn keep(
    paths: &Paths,
    release: &Release,
    verified_with: &crate::minisign::PublicKey,
) -> std::io::Result<Release> {
    let dir = paths.releases().join(&release.version);
    if dir != release.dir {
        std::fs::create_dir_all(paths.releases())?;
        let release_key = Some(release.rotated_key.clone().unwrap_or_else(|| verified_with.line()));
        let note = Kept { release_key, package_sha256: Some(release.package_sha256.clone()) };
        write_own(&release.dir.join("kept.json"), &serde_json::to_vec(&note).unwrap_or_default(), 0o600)?;
        remove_own(&dir)?;
        std::fs::rename(&release.dir, &dir)?;
        sync_dir(&paths.releases())?;
    }
    Ok(Release { dir, ..release.clone() })
}

/// The outcome where the runner and `update status` find it (`last.json`, naming the
/// request it answers); the request marked answered, root's rollback request and the
/// progress removed. Nothing in the runner's directory is touched.
fn finish(paths: &Paths, outcome: &Outcome, keep: usize, request_sha256: &str, from_root: bool) {
    let outcome = Outcome { request_sha256: Some(request_sha256.to_string()), ..outcome.clone() };
    if !from_root && !request_sha256.is_empty() {
        let mut done = handled(paths);
        done.push(request_sha256.to_string());
        let drop = done.len().saturating_sub(HANDLED_KEPT);
        done.drain(..drop);
        if let Err(e) = write_own(&paths.handled(), &serde_json::to_vec(&done).unwrap_or_default(), 0o600) {
            tracing::error!(error = %e, "Could not record the request as answered: {e}.");
        }
    }
    let bytes = serde_json::to_vec_pretty(&outcome).unwrap_or_default();
    if let Err(e) = keep_outcome(paths, &outcome, &bytes) {
        tracing::error!(error = %e, "Could not record the update's outcome: {e}.");
    }
    if let Err(e) = write_own(&paths.last(), &bytes, 0o644) {
        tracing::error!(error = %e, "Could not record the update's last outcome: {e}.");
    }
    if from_root {
        let _ = std::fs::remove_file(paths.rollback());
    }
    let _ = std::fs::remove_file(paths.progress());
    let _ = remove_own(&paths.incoming());
    if outcome.result == "applied" {
        prune(paths, &outcome.to_version, &outcome.from_version, keep);
    }
}

/// How many refusals `outcomes/` keeps (the daemon audits each within seconds; installs
/// and rollbacks are all kept).
const OUTCOMES_KEPT: usize = 1000;

/// Every outcome gets a file of its own, named in order, so that none can be lost to the
/// next one before the daemon audits it.
fn keep_outcome(paths: &Paths, outcome: &Outcome, bytes: &[u8]) -> std::io::Result<()> {
    let dir = crate::outcomes_dir(&paths.updater_dir);
    std::fs::DirBuilder::new().recursive(true).mode(0o755).create(&dir)?;
    let names = || -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&dir)
            .map(|entries| {
                entries.filter_map(Result::ok).map(|e| e.file_name().to_string_lossy().into_owned()).collect()
            })
            .unwrap_or_default();
        v.retain(|n| n.ends_with(".json") && !n.starts_with('.'));
        v.sort();
        v
    };
    // After the last name whatever the clock says (it may have gone back).
    let last = names().pop();
    let last_ms = last.as_deref().and_then(|n| n.get(..15)).and_then(|m| m.parse::<u64>().ok()).unwrap_or(0);
    let base = outcome.at_ms.max(last_ms);
    // The result in the name: only refusals are ever pruned.
    let result = if outcome.result == "refused" { "refused" } else { "installed" };
    let name = (0..10_000u32)
        .map(|n| format!("{base:015}-{n:04}-{result}.json"))
        .find(|candidate| last.as_ref().is_none_or(|l| candidate > l))
        .unwrap_or_else(|| format!("{:015}-0000-{result}.json", base + 1));
    write_own(&dir.join(name), bytes, 0o644)?;
    // The oldest refusals beyond the bound go; an install or a rollback never does.
    let refusals: Vec<String> = names().into_iter().filter(|n| n.ends_with("-refused.json")).collect();
    for old in refusals.iter().take(refusals.len().saturating_sub(OUTCOMES_KEPT)) {
        let _ = std::fs::remove_file(dir.join(old));
    }
    Ok(())
}

/// Keep the current and the previous release, and the newest others up to `keep` in all.
fn prune(paths: &Paths, current: &str, previous: &str, keep: usize) {
    let Ok(entries) = std::fs::read_dir(paths.releases()) else { return };
    let mut versions: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|v| crate::version::valid(v) && v != current && v != previous)
        .collect();
    versions.sort_by(|a, b| crate::version::compare(b, a));
    for old in versions.into_iter().skip(keep.saturating_sub(2)) {
        let _ = std::fs::remove_dir_all(paths.releases().join(old));
    }
}

/// Longest `config check` the updater waits for (seconds, for `timeout`).
const CONFIG_CHECK_SECS: &str = "300";

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
        crate::installed_version(&crate::dpkg_status(&self.root))
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
            let binary = self.root.join(crate::PACKAGED_BINARY.trim_start_matches('/'));
            return command(&binary.to_string_lossy(), &["config", "check", "--config", &config]).map(drop);
        }
        // Bounded (killed at the limit), and with no pipe back to the updater: a process
        // of the runner's user could hold a pipe's other end open (it is the same user as
        // the check) and the updater would wait for it without end. Its output goes to a
        // file of the updater's own (its unit's private /tmp).
        let log = std::env::temp_dir().join(format!("byoc-config-check-{}.log", std::process::id()));
        let _ = std::fs::remove_file(&log);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&log)
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let status = std::process::Command::new("timeout")
            .args(["-k", "10", CONFIG_CHECK_SECS, "runuser", "-u", "byoc-runner", "--"])
            .args([crate::PACKAGED_BINARY, "config", "check", "--config", &config])
            .stdin(std::process::Stdio::null())
            .stdout(file.try_clone().map_err(|e| e.to_string())?)
            .stderr(file)
            .status()
            .map_err(|e| format!("timeout runuser: {e}"))?;
        let output = crate::hostile::read_path(&log, 64 << 10).ok().flatten().unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        if status.success() {
            Ok(())
        } else {
            let text = String::from_utf8_lossy(&output);
            let failed: Vec<&str> = text.lines().filter(|l| l.starts_with("FAIL")).collect();
            let said = if failed.is_empty() { text.trim().to_string() } else { failed.join("; ") };
            Err(format!("{status}: {said}"))
        }
    }
    fn now_ms(&self) -> u64 {
        crate::now_ms()
    }
    fn wait(&self, d: Duration) {
        std::thread::sleep(d);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::release::fixture;
    use crate::{last_path, rollback_path};

    /// dpkg and systemd in memory: `start_runner` writes the health a daemon of the
    /// installed version would, unless that version is one that never gets healthy.
    /// `install` records the digest of the bytes it was given.
    struct FakeHost {
        state_dir: PathBuf,
        installed: RefCell<String>,
        unhealthy: Vec<String>,
        fail_install: Vec<String>,
        calls: RefCell<Vec<String>>,
        installed_sha256: RefCell<Vec<String>>,
        now: RefCell<u64>,
        /// Run when the package is inspected: the runner's user acting mid-update.
        on_inspect: Option<Box<dyn Fn()>>,
    }

    impl FakeHost {
        fn new(state_dir: &Path, installed: &str) -> Self {
            FakeHost {
                state_dir: state_dir.into(),
                installed: RefCell::new(installed.into()),
                unhealthy: Vec::new(),
                fail_install: Vec::new(),
                calls: RefCell::default(),
                installed_sha256: RefCell::default(),
                now: RefCell::new(1_000),
                on_inspect: None,
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
            if let Some(act) = &self.on_inspect {
                act();
            }
            Ok(["byoc-runner".into(), Self::version_of(deb), release::host_arch().into()])
        }
        fn stop_runner(&self) -> Result<(), String> {
            self.calls.borrow_mut().push("stop".into());
            Ok(())
        }
        fn install(&self, deb: &Path) -> Result<(), String> {
            let v = Self::version_of(deb);
            self.calls.borrow_mut().push(format!("install {v}"));
            self.installed_sha256.borrow_mut().push(crate::sha256_hex(&std::fs::read(deb).unwrap()));
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
                std::fs::create_dir_all(crate::dir(&self.state_dir)).unwrap();
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
        terms: Terms,
    }

    /// The release in `tree`, staged as the daemon stages it (its files in `staged/`,
    /// then `request.json`).
    fn stage(paths: &Paths, tree: &Path, version: &str, job_id: &str) -> Request {
        let found = release::verify_signed(tree, &fixture::public_key(), version)
            .or_else(|_| release::verify_signed(tree, &rotated_key(), version))
            .unwrap();
        let staged = staged_dir(&paths.state_dir);
        let _ = std::fs::remove_dir_all(&staged);
        std::fs::create_dir_all(&staged).unwrap();
        for e in std::fs::read_dir(tree).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, staged.join(p.file_name().unwrap())).unwrap();
        }
        let request = Request {
            job_id: job_id.into(),
            version: version.into(),
            from_version: "0.1.0".into(),
            package: found.package.clone(),
            package_sha256: found.package_sha256.clone(),
            sums_sha256: found.sums_sha256.clone(),
            min_rollback_version: None,
            rollback: false,
            staged_at_ms: 1,
        };
        std::fs::write(request_path(&paths.state_dir), serde_json::to_vec(&request).unwrap()).unwrap();
        request
    }

    fn stage_0_2_0(paths: &Paths, job_id: &str) -> Request {
        let tree = tempfile::tempdir().unwrap();
        fixture::release(tree.path(), "0.2.0", &[]);
        stage(paths, tree.path(), "0.2.0", job_id)
    }

    /// Version 0.1.0 installed and kept; 0.2.0 staged by the daemon.
    fn setup(mode: &str) -> Setup {
        let (state, updater) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let paths = Paths { state_dir: state.path().into(), updater_dir: updater.path().into() };
        let kept = paths.releases().join("0.1.0");
        std::fs::create_dir_all(&kept).unwrap();
        fixture::release(&kept, "0.1.0", &[]);
        stage_0_2_0(&paths, "job-1");
        let (line, _) = minisign_line();
        let text = format!(
            "[control_plane]\nurl = \"https://cp.example.com\"\n[runner]\ninstall_id = \"i\"\nstate_dir = \"{}\"\n[update]\nmode = \"{mode}\"\nrelease_public_key = \"{line}\"\nhealth_timeout_secs = 10\n",
            paths.state_dir.display()
        );
        let config_path = paths.updater_dir.join("runner.toml");
        std::fs::write(&config_path, &text).unwrap();
        // The runner is someone else, this process's user an admin: what the test writes
        // counts as a person's.
        let me = nix::unistd::geteuid().as_raw();
        let terms = Terms {
            runner_uid: Some(me + 4242),
            admin_uids: Some(vec![me]),
            ..Terms::load(&config_path).unwrap()
        };
        std::fs::create_dir_all(crate::terms_dir(&paths.updater_dir)).unwrap();
        Setup { _dirs: (state, updater), paths, terms }
    }

    fn minisign_line() -> (String, String) {
        crate::minisign::sign(&fixture::signing_key(), fixture::KEY_ID, b"", "")
    }

    fn last(paths: &Paths) -> Outcome {
        serde_json::from_slice(&std::fs::read(last_path(&paths.updater_dir)).unwrap()).unwrap()
    }

    /// Every file under `dir` with its bytes, mode and owner (links as their target).
    fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>, u32, u32)> {
        use std::os::unix::fs::MetadataExt as _;
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let m = std::fs::symlink_metadata(&p).unwrap();
                if m.is_dir() {
                    stack.push(p.clone());
                }
                let bytes = if m.is_file() { std::fs::read(&p).unwrap() } else { Vec::new() };
                out.push((p, bytes, m.mode(), m.uid()));
            }
        }
        out.sort();
        out
    }

    #[test]
    fn a_good_update_is_installed_watched_kept_and_answered_once() {
        let s = setup("auto");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let before = snapshot(&s.paths.state_dir);
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(
            (out.result.as_str(), out.from_version.as_str(), out.to_version.as_str()),
            ("applied", "0.1.0", "0.2.0")
        );
        assert_eq!(*host.calls.borrow(), ["stop", "install 0.2.0", "start 0.2.0"]);
        assert!(s.paths.releases().join("0.2.0").is_dir() && s.paths.releases().join("0.1.0").is_dir());
        let request = std::fs::read(request_path(&s.paths.state_dir)).unwrap();
        let written = last(&s.paths);
        assert_eq!(written.request_sha256.as_deref(), Some(crate::sha256_hex(&request).as_str()));
        assert_eq!(Outcome { request_sha256: None, ..written }, out);
        // The runner's directory is as the runner left it but for the daemon's health.
        let after: Vec<_> =
            snapshot(&s.paths.state_dir).into_iter().filter(|f| !f.0.ends_with("health.json")).collect();
        assert_eq!(after, before, "the updater wrote in the runner's directory");
        assert!(run(&host, &s.terms, &s.paths).is_none(), "a request is answered once");
        assert_eq!(host.calls.borrow().len(), 3);
    }

    #[test]
    fn a_release_that_never_gets_healthy_is_rolled_back_within_the_bound() {
        let s = setup("auto");
        let mut host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        host.unhealthy = vec!["0.2.0".into()];
        let out = run(&host, &s.terms, &s.paths).unwrap();
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
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.result, "rolled_back");
        assert!(out.reason.as_deref().unwrap().contains("No space left"), "{out:?}");
        assert_eq!(*host.installed.borrow(), "0.1.0");
    }

    #[test]
    fn the_updater_holds_the_release_to_the_terms_itself() {
        // Switched off after the daemon staged it: nothing is stopped or installed.
        let s = setup("off");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!((out.result.as_str(), out.code.as_deref()), ("refused", Some("update_disabled")));
        assert!(host.calls.borrow().is_empty());
        // The admin's pin, written after the daemon staged it.
        let s = setup("auto");
        let pin = crate::PinRecord { pin: "0.1.0".into(), by: "root".into(), at_ms: 1 };
        let pin_file = crate::pin_path(&crate::terms_dir(&s.paths.updater_dir));
        std::fs::write(pin_file, serde_json::to_vec(&pin).unwrap()).unwrap();
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_pinned"));
        // A staged package swapped after the daemon verified it.
        let s = setup("auto");
        let staged = staged_dir(&s.paths.state_dir);
        let deb = std::fs::read_dir(&staged)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .unwrap();
        std::fs::write(&deb, "evil").unwrap();
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_digest_mismatch"));
        assert!(host.calls.borrow().is_empty());
    }

    /// The runner's user swaps the staged package (and plants links for everything)
    /// after the updater read it: what is installed is the verified copy, byte for byte.
    #[test]
    fn a_package_swapped_after_it_was_copied_out_is_never_installed() {
        let s = setup("auto");
        let staged = staged_dir(&s.paths.state_dir);
        let request: Request =
            serde_json::from_slice(&std::fs::read(request_path(&s.paths.state_dir)).unwrap()).unwrap();
        let mut host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let swap = staged.clone();
        let package = request.package.clone();
        host.on_inspect = Some(Box::new(move || {
            std::fs::write(swap.join(&package), "unsigned package").unwrap();
        }));
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.result, "applied", "{out:?}");
        assert_eq!(host.installed_sha256.borrow().as_slice(), std::slice::from_ref(&request.package_sha256));
        assert_ne!(
            crate::sha256_hex(&std::fs::read(staged.join(&request.package)).unwrap()),
            request.package_sha256
        );
    }

    /// Links where the updater reads: to a root-only file, a directory elsewhere; a
    /// FIFO. Refused, nothing installed, the targets untouched.
    #[test]
    fn links_and_fifos_planted_in_the_runners_directory_are_never_followed() {
        let s = setup("auto");
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("root-only");
        std::fs::write(&secret, "root's").unwrap();
        let staged = staged_dir(&s.paths.state_dir);
        let request: Request =
            serde_json::from_slice(&std::fs::read(request_path(&s.paths.state_dir)).unwrap()).unwrap();
        // The package a link to a file with the same (signed) bytes elsewhere.
        let elsewhere = outside.path().join("pkg");
        std::fs::rename(staged.join(&request.package), &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, staged.join(&request.package)).unwrap();
        std::os::unix::fs::symlink(&secret, staged.join("extra")).unwrap();
        let before = snapshot(outside.path());
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_release_invalid"), "{out:?}");
        assert!(out.reason.as_deref().unwrap().contains("not followed"), "{out:?}");
        assert!(host.calls.borrow().is_empty());
        // The staged directory itself a link to a directory elsewhere.
        std::fs::remove_dir_all(&staged).unwrap();
        std::os::unix::fs::symlink(outside.path(), &staged).unwrap();
        std::fs::write(
            request_path(&s.paths.state_dir),
            serde_json::to_vec(&Request { job_id: "job-2".into(), ..request }).unwrap(),
        )
        .unwrap();
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_release_invalid"), "{out:?}");
        // The request a FIFO: refused at once, not waited on.
        std::fs::remove_file(request_path(&s.paths.state_dir)).unwrap();
        nix::unistd::mkfifo(
            &request_path(&s.paths.state_dir),
            nix::sys::stat::Mode::from_bits_truncate(0o666),
        )
        .unwrap();
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_request_invalid"), "{out:?}");
        assert!(run(&host, &s.terms, &s.paths).is_none(), "answered once");
        assert!(host.calls.borrow().is_empty());
        assert_eq!(snapshot(outside.path()), before, "something outside was changed");
    }

    /// A rotation statement signed by the pinned key for the key `[8; 32]`.
    fn rotated_key() -> crate::minisign::PublicKey {
        let (line, _) =
            crate::minisign::sign(&ed25519_dalek::SigningKey::from_bytes(&[8; 32]), [0x77; 8], b"", "");
        crate::minisign::PublicKey::parse(&line).unwrap()
    }

    /// A release whose key rotation the pinned key signed: installed, and the new key is
    /// pinned in the config the new version starts with; rolled back, the old one again.
    fn rotating(s: &Setup, job_id: &str) -> String {
        let (next, next_id) = (ed25519_dalek::SigningKey::from_bytes(&[8; 32]), [0x77; 8]);
        let (next_line, _) = crate::minisign::sign(&next, next_id, b"", "");
        let tree = tempfile::tempdir().unwrap();
        std::fs::write(tree.path().join(format!("byoc-runner_0.2.0_{}.deb", release::host_arch())), "p2")
            .unwrap();
        let statement = format!("{next_line}\n");
        std::fs::write(tree.path().join(release::NEW_KEY), &statement).unwrap();
        let (_, sig) =
            crate::minisign::sign(&fixture::signing_key(), fixture::KEY_ID, statement.as_bytes(), "r");
        std::fs::write(tree.path().join(release::NEW_KEY_SIG), sig).unwrap();
        fixture::sign_dir(tree.path(), &next, next_id);
        stage(&s.paths, tree.path(), "0.2.0", job_id);
        next_line
    }

    fn ask_rollback(paths: &Paths, version: &str) {
        let r = RollbackRequest { version: version.into(), by: "root".into(), at_ms: 7 };
        std::fs::write(rollback_path(&paths.updater_dir), serde_json::to_vec(&r).unwrap()).unwrap();
    }

    #[test]
    fn a_rotated_release_key_is_pinned_with_the_release_and_unpinned_with_a_rollback() {
        let s = setup("auto");
        let next = rotating(&s, "job-2");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        assert_eq!(run(&host, &s.terms, &s.paths).unwrap().result, "applied");
        let text = std::fs::read_to_string(&s.terms.source).unwrap();
        assert!(text.contains(&format!("release_public_key = \"{next}\"")), "{text}");
        // Root's rollback to the release from before the rotation: it verifies with the
        // key it was kept under, not the one pinned now.
        let rotated = Terms {
            runner_uid: s.terms.runner_uid,
            admin_uids: s.terms.admin_uids.clone(),
            ..Terms::load(&s.terms.source).unwrap()
        };
        ask_rollback(&s.paths, "0.1.0");
        let out = run(&host, &rotated, &s.paths).unwrap();
        assert_eq!((out.result.as_str(), out.to_version.as_str()), ("applied", "0.1.0"), "{out:?}");
        assert!(!rollback_path(&s.paths.updater_dir).exists(), "root's request is spent");

        let s = setup("auto");
        let before = std::fs::read_to_string(&s.terms.source).unwrap();
        rotating(&s, "job-3");
        let mut host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        host.unhealthy = vec!["0.2.0".into()];
        assert_eq!(run(&host, &s.terms, &s.paths).unwrap().result, "rolled_back");
        assert_eq!(std::fs::read_to_string(&s.terms.source).unwrap(), before);
    }

    /// A rollback request written by the runner's user (with updates switched off):
    /// refused, nothing installed. Root's goes to a kept release even with `mode = "off"`.
    #[test]
    fn a_rollback_is_roots_alone() {
        let s = setup("auto");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        assert_eq!(run(&host, &s.terms, &s.paths).unwrap().result, "applied");
        let off = setup("off");
        let s = Setup { terms: Terms { state_dir: s.paths.state_dir.clone(), ..off.terms.clone() }, ..s };
        let kept = release::verify_signed(&s.paths.releases().join("0.1.0"), &fixture::public_key(), "0.1.0")
            .unwrap();
        let hostile = Request {
            job_id: "local-rollback-9".into(),
            version: "0.1.0".into(),
            from_version: "0.2.0".into(),
            package: kept.package.clone(),
            package_sha256: kept.package_sha256.clone(),
            sums_sha256: kept.sums_sha256.clone(),
            min_rollback_version: None,
            rollback: true,
            staged_at_ms: 2,
        };
        std::fs::write(request_path(&s.paths.state_dir), serde_json::to_vec(&hostile).unwrap()).unwrap();
        let calls = host.calls.borrow().len();
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!((out.result.as_str(), out.code.as_deref()), ("refused", Some("update_rollback_refused")));
        assert_eq!(host.calls.borrow().len(), calls, "nothing was stopped or installed");
        assert_eq!(*host.installed.borrow(), "0.2.0");
        // Root's own: to a kept release, whatever the mode.
        ask_rollback(&s.paths, "0.1.0");
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!((out.result.as_str(), out.to_version.as_str()), ("applied", "0.1.0"), "{out:?}");
        // A kept package changed on disk is not installed.
        let deb =
            s.paths.releases().join("0.2.0").join(format!("byoc-runner_0.2.0_{}.deb", release::host_arch()));
        std::fs::write(&deb, "changed").unwrap();
        ask_rollback(&s.paths, "0.2.0");
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.result, "refused", "{out:?}");
        assert_eq!(*host.installed.borrow(), "0.1.0");
        // A version that is not kept.
        ask_rollback(&s.paths, "0.0.9");
        assert_eq!(
            run(&host, &s.terms, &s.paths).unwrap().code.as_deref(),
            Some("update_no_rollback_package")
        );
    }

    #[test]
    fn a_damaged_request_is_refused_and_answered_once() {
        let s = setup("auto");
        std::fs::write(request_path(&s.paths.state_dir), "{").unwrap();
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!((out.result.as_str(), out.code.as_deref()), ("refused", Some("update_request_invalid")));
        assert!(host.calls.borrow().is_empty());
        assert!(run(&host, &s.terms, &s.paths).is_none(), "the path unit would start the updater again");
    }

    #[test]
    fn without_a_kept_package_to_go_back_to_nothing_is_installed() {
        let s = setup("auto");
        std::fs::remove_dir_all(s.paths.releases().join("0.1.0")).unwrap();
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_no_rollback_package"));
        assert!(host.calls.borrow().is_empty());
    }

    /// As `start` leaves it at the moment of a reset, after `attempts` installs begun: the
    /// staged release kept and the progress written.
    fn interrupted(s: &Setup, host: &FakeHost, attempts: u32) {
        let bytes = std::fs::read(request_path(&s.paths.state_dir)).unwrap();
        let request: Request = serde_json::from_slice(&bytes).unwrap();
        let (new, previous) = check(host, &s.terms, &s.paths, &request).unwrap();
        let kept = keep(&s.paths, &new, &fixture::public_key()).unwrap();
        let progress = Progress {
            request: Request { package: kept.package.clone(), ..request },
            request_sha256: crate::sha256_hex(&bytes),
            from_root: false,
            previous_version: previous.version.clone(),
            previous_sha256: previous.package_sha256.clone(),
            key_sha256: None,
            rotated_key: None,
            started_ms: 1,
            attempts,
        };
        std::fs::write(s.paths.progress(), serde_json::to_vec(&progress).unwrap()).unwrap();
    }

    #[test]
    fn an_interrupted_update_is_resumed_at_the_next_start() {
        let s = setup("auto");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        interrupted(&s, &host, 1);
        // dpkg was half-way: the runner's files are neither version's.
        *host.installed.borrow_mut() = "0.2.0".into();
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.result, "applied");
        assert_eq!(*host.calls.borrow(), ["stop", "install 0.2.0", "start 0.2.0"]);
        assert!(!s.paths.progress().exists());
        assert!(run(&host, &s.terms, &s.paths).is_none(), "the request it answered is not answered again");
    }
    /// Terms under which `file` is the runner's own user's: as root, the file is given to
    /// a uid that plays the runner's; otherwise the runner is this process's user.
    fn owned_by_the_runner(s: &Setup, file: &Path) -> Terms {
        let me = nix::unistd::geteuid().as_raw();
        let runner = if me == 0 {
            std::os::unix::fs::chown(file, Some(4242), None).unwrap();
            4242
        } else {
            me
        };
        Terms { runner_uid: Some(runner), admin_uids: Some(vec![me, runner]), ..s.terms.clone() }
    }

    /// `mode = "approve"`: root installs only a release a person approved, for that job
    /// and version, in a file the runner's own user did not write.
    #[test]
    fn in_approve_mode_root_installs_only_what_a_person_approved() {
        let s = setup("approve");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_not_approved"), "{out:?}");
        assert!(host.calls.borrow().is_empty());
        let approval_path = crate::update_approval_path(&crate::terms_dir(&s.paths.updater_dir), "job-2");
        let approve = |version: &str| {
            let path = approval_path.clone();
            let note = crate::UpdateApproval {
                job_id: "job-2".into(),
                version: version.into(),
                by: "alice".into(),
                uid: nix::unistd::geteuid().as_raw(),
                at_ms: host.now_ms(),
            };
            let _ = std::fs::remove_file(&path);
            std::fs::write(path, serde_json::to_vec(&note).unwrap()).unwrap();
        };
        // Approved for another version: refused.
        approve("0.3.0");
        stage_0_2_0(&s.paths, "job-2");
        assert_eq!(run(&host, &s.terms, &s.paths).unwrap().code.as_deref(), Some("update_not_approved"));
        // Written by the runner's own user: refused.
        approve("0.2.0");
        let as_runner = owned_by_the_runner(&s, &approval_path);
        let bytes = std::fs::read(request_path(&s.paths.state_dir)).unwrap();
        std::fs::write(request_path(&s.paths.state_dir), [bytes.as_slice(), b" "].concat()).unwrap();
        let out = run(&host, &as_runner, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_not_approved"), "{out:?}");
        assert!(out.reason.unwrap().contains("neither root nor the admin group"));
        approve("0.2.0");
        // A person's, for this job and version: installed.
        std::fs::write(request_path(&s.paths.state_dir), [bytes.as_slice(), b"  "].concat()).unwrap();
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.result, "applied", "{out:?}");
        // Once: the same job staged again (after a rollback, say) needs a person again.
        let back = crate::RollbackRequest { version: "0.1.0".into(), by: "root".into(), at_ms: 9 };
        std::fs::write(crate::rollback_path(&s.paths.updater_dir), serde_json::to_vec(&back).unwrap())
            .unwrap();
        assert_eq!(run(&host, &s.terms, &s.paths).unwrap().to_version, "0.1.0");
        std::fs::write(request_path(&s.paths.state_dir), [bytes.as_slice(), b"   "].concat()).unwrap();
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_not_approved"), "{out:?}");
        assert!(out.reason.unwrap().contains("used already"));
        assert_eq!(*host.installed.borrow(), "0.1.0");
    }

    /// The pin in root's config and the admin's pin both hold; a pin file the runner's
    /// own user wrote holds everything.
    #[test]
    fn every_pin_holds_and_a_pin_the_runner_wrote_holds_everything() {
        let s = setup("auto");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let config_pinned =
            Terms { pin: Some(crate::version::Pin::parse("0.1.5").unwrap()), ..s.terms.clone() };
        let pin_file = crate::pin_path(&crate::terms_dir(&s.paths.updater_dir));
        let pin = crate::PinRecord { pin: ">= 0.0.1".into(), by: "root".into(), at_ms: 1 };
        std::fs::write(&pin_file, serde_json::to_vec(&pin).unwrap()).unwrap();
        let out = run(&host, &config_pinned, &s.paths).unwrap();
        assert_eq!(
            out.code.as_deref(),
            Some("update_pinned"),
            "the admin's pin does not widen root's: {out:?}"
        );
        let bytes = std::fs::read(request_path(&s.paths.state_dir)).unwrap();
        std::fs::write(request_path(&s.paths.state_dir), [bytes.as_slice(), b" "].concat()).unwrap();
        let as_runner = owned_by_the_runner(&s, &pin_file);
        let out = run(&host, &as_runner, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_pinned"), "{out:?}");
        assert!(out.reason.unwrap().contains("neither root nor the admin group"));
        assert!(host.calls.borrow().is_empty());
    }

    /// Each outcome is a file of its own, in order: a flood of refusals after an install
    /// cannot hide the install from the daemon's audit.
    #[test]
    fn every_outcome_is_kept_in_order() {
        let s = setup("auto");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        assert_eq!(run(&host, &s.terms, &s.paths).unwrap().result, "applied");
        for i in 0..3 {
            std::fs::write(request_path(&s.paths.state_dir), format!("garbage {i}")).unwrap();
            assert_eq!(run(&host, &s.terms, &s.paths).unwrap().result, "refused");
        }
        let dir = crate::outcomes_dir(&s.paths.updater_dir);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let results: Vec<String> = names
            .iter()
            .map(|n| serde_json::from_slice::<Outcome>(&std::fs::read(dir.join(n)).unwrap()).unwrap().result)
            .collect();
        assert_eq!(results, ["applied", "refused", "refused", "refused"]);
    }

    /// A release signed to replace the running version by itself (a DOWNGRADE naming
    /// it): refused, and the kept copy to go back to stays as it was.
    #[test]
    fn the_running_version_is_never_installed_over_its_kept_copy() {
        let s = setup("auto");
        let kept = std::fs::read_dir(s.paths.releases().join("0.1.0")).unwrap().count();
        let tree = tempfile::tempdir().unwrap();
        std::fs::write(tree.path().join(format!("byoc-runner_0.1.0_{}.deb", release::host_arch())), "other")
            .unwrap();
        std::fs::write(tree.path().join(release::DOWNGRADE), "replaces 0.1.0\n").unwrap();
        fixture::sign_dir(tree.path(), &fixture::signing_key(), fixture::KEY_ID);
        stage(&s.paths, tree.path(), "0.1.0", "job-3");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_not_newer"), "{out:?}");
        assert!(host.calls.borrow().is_empty());
        assert_eq!(std::fs::read_dir(s.paths.releases().join("0.1.0")).unwrap().count(), kept);
        assert!(
            release::verify_signed(&s.paths.releases().join("0.1.0"), &fixture::public_key(), "0.1.0")
                .is_ok()
        );
    }

    /// Interrupted twice (a reset each time): the third start goes back to the kept
    /// release instead of installing the new one again. A progress file that cannot be
    /// read is set aside, not started on again and again.
    #[test]
    fn an_update_interrupted_twice_goes_back_and_damaged_progress_is_set_aside() {
        let s = setup("auto");
        let host = FakeHost::new(&s.paths.state_dir, "0.1.0");
        interrupted(&s, &host, MAX_ATTEMPTS);
        *host.installed.borrow_mut() = "0.2.0".into();
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.result, "rolled_back", "{out:?}");
        assert_eq!(*host.calls.borrow(), ["stop", "install 0.1.0", "start 0.1.0"]);
        assert!(!s.paths.progress().exists());

        std::fs::write(s.paths.progress(), b"{ damaged").unwrap();
        let out = run(&host, &s.terms, &s.paths).unwrap();
        assert_eq!(out.code.as_deref(), Some("update_progress_unreadable"), "{out:?}");
        assert!(!s.paths.progress().exists(), "set aside");
        assert_eq!(host.calls.borrow().last().map(String::as_str), Some("start 0.1.0"));
    }
}
