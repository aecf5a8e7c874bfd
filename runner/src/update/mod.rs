//! The runner's own updates (docs/OPERATIONS.md, "Updates"): a signed release, on the
//! customer's terms, applied by a separate updater that rolls back on its own.
//!
//! A `runner.update` job's path: its version is held to the customer's terms before the
//! claim (`check_terms`: `[update] mode`, the pin, newer than the running version);
//! `mode = "approve"` holds it for a local admin like an approval rule; windows apply as
//! to any job. When it runs, the release artifact is fetched from the install's
//! registry by digest, verified with the pinned release key (`release.rs`) and staged
//! (`stage.rs`): the files in `<state dir>/update/staged/`, then `request.json`
//! (fsynced), which starts `byoc-runner-update.service` through its path unit. The
//! updater (`apply.rs`, root) verifies everything again itself, drains the daemon,
//! keeps the current package, installs the new one, restarts and waits for health
//! (`health.json`, written by the new daemon after its first answered poll); without
//! it, it reinstalls the kept package. Its outcome (`outcome.json`) is audited by the
//! daemon that runs afterwards (`record_outcome`), whichever version that is.

pub mod stage;

pub use byoc_updater::{
    Health, LAST_FILE, Outcome, PACKAGED_BINARY, PIN_FILE, PinRecord, Request, RollbackRequest,
    UPDATER_BINARY, UPDATER_DIR, UpdateApproval, dir, dpkg_status, health_path, installed_version, last_path,
    minisign, outcomes_dir, pin_path, plain_job_id, release, request_path, rollback_path, staged_dir,
    terms_dir, update_approval_path, updater_dir, version,
};

use std::path::{Path, PathBuf};

use byoc_protocol::RejectReason;

use crate::config::{UpdateConfig, UpdateMode};

/// In `<state dir>/update`: the name of the last outcome the daemon audited.
const AUDITED_FILE: &str = "audited";

/// The pin shown: the CLI's, else the config's (both hold: see [`check_terms`]). A pin
/// file that cannot be read or parsed pins to nothing (the customer meant to hold
/// updates back).
pub fn effective_pin(config: &UpdateConfig, terms_dir: &Path) -> Result<Option<version::Pin>, String> {
    match std::fs::read(pin_path(terms_dir)) {
        Ok(bytes) => serde_json::from_slice::<PinRecord>(&bytes)
            .map_err(|e| {
                format!(
                    "the pin file {} is damaged ({e}): no update is allowed",
                    pin_path(terms_dir).display()
                )
            })
            .and_then(|r| version::Pin::parse(&r.pin).map(Some)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(config.pin.clone()),
        Err(e) => Err(format!(
            "the pin file {} is unreadable ({e}): no update is allowed",
            pin_path(terms_dir).display()
        )),
    }
}

/// The version this runner runs as: the installed package's when it is the package's
/// binary (dpkg's status), else the version it was built as.
pub fn running_version() -> &'static str {
    static V: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        std::env::current_exe()
            .ok()
            .and_then(|exe| package_root(&exe).and_then(|root| installed_version(&dpkg_status(root))))
            .unwrap_or_else(|| env!("CARGO_PKG_VERSION").to_string())
    })
}

/// The root a packaged binary was installed under: `/` for `/usr/bin/byoc-runner`,
/// `DIR` for `DIR/usr/bin/byoc-runner` (installed with `dpkg --root=DIR`, as the demo
/// and throwaway installs do). Anywhere else the binary is no package's.
pub fn package_root(exe: &Path) -> Option<&Path> {
    (exe.is_absolute() && exe.ends_with(PACKAGED_BINARY.trim_start_matches('/')))
        .then(|| exe.ancestors().nth(3))
        .flatten()
}

/// What a `runner.update` job asks, as its spec says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked<'a> {
    pub version: &'a str,
    pub downgrade: bool,
}

/// Whether the customer's terms let `asked` in, before the job is claimed.
pub fn check_terms(
    config: &UpdateConfig,
    terms_dir: &Path,
    asked: &Asked<'_>,
    current: &str,
) -> Result<(), (RejectReason, String)> {
    if config.mode == UpdateMode::Off {
        return Err((
            RejectReason::UpdateDisabled,
            "updates are switched off here ([update] mode = \"off\")".into(),
        ));
    }
    if config.release_key.is_none() {
        return Err((
            RejectReason::UpdateDisabled,
            "no release key is pinned ([update] release_public_key): a release cannot be verified".into(),
        ));
    }
    match effective_pin(config, terms_dir) {
        Err(e) => return Err((RejectReason::UpdatePinned, e)),
        Ok(Some(pin)) if !pin.allows(asked.version) => {
            return Err((
                RejectReason::UpdatePinned,
                format!("{} is outside the customer's pin {:?}", asked.version, pin.as_str()),
            ));
        }
        Ok(_) => {}
    }
    // Root's `[update] pin` holds too: the admin's pin narrows it, never widens it (the
    // updater checks both again).
    if let Some(pin) = &config.pin
        && !pin.allows(asked.version)
    {
        return Err((
            RejectReason::UpdatePinned,
            format!("{} is outside [update] pin {:?}", asked.version, pin.as_str()),
        ));
    }
    let newer = version::compare(asked.version, current) == std::cmp::Ordering::Greater;
    if !newer && !asked.downgrade {
        return Err((
            RejectReason::UpdateNotNewer,
            format!(
                "{} is not newer than the running {current} (a downgrade must say so, and its release sign it)",
                asked.version
            ),
        ));
    }
    Ok(())
}

/// The synthetic approval rule `mode = "approve"` puts on every update.
pub fn approval_rule() -> crate::guardrails::ApprovalRule {
    crate::guardrails::ApprovalRule {
        name: "update.mode = \"approve\"".into(),
        scope: crate::guardrails::JobSelector {
            kinds: vec![byoc_protocol::JobKind::RunnerUpdate.as_str().into()],
            ..Default::default()
        },
        expires_secs: crate::guardrails::APPROVAL_EXPIRES_SECS,
        on: crate::guardrails::ApprovalPoint::Job,
        when_warn: false,
        policies: Vec::new(),
    }
}

/// The version a staged update goes to, if one waits for the updater.
pub fn pending(state_dir: &Path) -> Option<String> {
    let bytes = std::fs::read(request_path(state_dir)).ok()?;
    serde_json::from_slice::<Request>(&bytes).ok().map(|r| r.version)
}

/// Once, after the daemon's first answered poll: the updater's evidence of health.
pub fn record_health(state_dir: &Path, key_sha256: &str, at_ms: u64) {
    let health = Health {
        version: running_version().to_string(),
        pid: std::process::id(),
        first_poll_ms: at_ms,
        key_sha256: key_sha256.into(),
    };
    let dir = dir(state_dir);
    let written = std::fs::create_dir_all(&dir).and_then(|()| {
        crate::state_dir::write(
            &health_path(state_dir),
            &serde_json::to_vec(&health).unwrap_or_default(),
            0o644,
        )
    });
    if let Err(e) = written {
        tracing::warn!(error = %e, "Could not record the runner's health for the updater: {e}.");
    }
}

/// The updater's directory of the package this daemon was installed with.
pub fn own_updater_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| package_root(&exe).map(updater_dir))
        .unwrap_or_else(|| PathBuf::from(UPDATER_DIR))
}

/// Largest outcome the daemon reads.
const MAX_OUTCOME_BYTES: u64 = 64 << 10;

/// The updater's outcomes named after `after`, oldest first: (file name, bytes). Only
/// those are read (the daemon looks at every answered poll).
fn outcomes(updater_dir: &Path, after: &str) -> Vec<(String, Vec<u8>)> {
    let dir = outcomes_dir(updater_dir);
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json") && !n.starts_with('.') && n.as_str() > after)
        .collect();
    names.sort();
    // Up to the first one that cannot be read: none is passed over (the next look tries
    // it again).
    let read = |n: &str| -> std::io::Result<Vec<u8>> {
        use std::io::Read as _;
        let mut bytes = Vec::new();
        std::fs::File::open(dir.join(n))?.take(MAX_OUTCOME_BYTES).read_to_end(&mut bytes)?;
        Ok(bytes)
    };
    names.into_iter().map_while(|n| read(&n).ok().map(|bytes| (n, bytes))).collect()
}

/// Audit what the updater did, each outcome once: its `outcomes/` (root's, one file an
/// answer, named in order), the name of the last one audited kept in `update/audited`.
/// An outcome that answers the staged request ends it: the daemon removes its own
/// request and staged release (the updater touches nothing of the runner's).
pub fn record_outcome(state_dir: &Path, updater_dir: &Path, audit: &dyn crate::audit::AuditSink) {
    let audited_path = dir(state_dir).join(AUDITED_FILE);
    let audited = std::fs::read_to_string(&audited_path).unwrap_or_default().trim().to_string();
    for (name, bytes) in outcomes(updater_dir, &audited) {
        let outcome = serde_json::from_slice::<Outcome>(&bytes);
        let record = match &outcome {
            Ok(o) => outcome_record(o),
            Err(e) => crate::audit_records::note("update_outcome_unreadable", format!("{name}: {e}")),
        };
        if let Err(e) = audit.record(record) {
            tracing::error!(error = %e, "Could not audit the update's outcome: {e}.");
            return;
        }
        let noted = std::fs::create_dir_all(dir(state_dir))
            .and_then(|()| crate::state_dir::write(&audited_path, name.as_bytes(), 0o600));
        if let Err(e) = noted {
            tracing::error!(error = %e, "Could not note the update's outcome as audited: {e}.");
            return;
        }
        let answered = outcome.ok().and_then(|o| o.request_sha256);
        let staged = std::fs::read(request_path(state_dir)).ok().map(|b| byoc_protocol::sha256_hex(&b));
        if answered.is_some() && answered == staged {
            let _ = std::fs::remove_file(request_path(state_dir));
            let _ = std::fs::remove_dir_all(staged_dir(state_dir));
        }
    }
}

/// At the daemon's start: a request staged but never answered (the machine reset before
/// the updater started) is written again, which starts the updater (its path unit
/// watches the request for changes).
pub fn announce_pending(state_dir: &Path, updater_dir: &Path) {
    let Ok(bytes) = std::fs::read(request_path(state_dir)) else { return };
    let digest = byoc_protocol::sha256_hex(&bytes);
    let answered = outcomes(updater_dir, "").iter().any(|(_, b)| {
        serde_json::from_slice::<Outcome>(b).ok().and_then(|o| o.request_sha256).as_deref()
            == Some(digest.as_str())
    });
    if answered {
        return;
    }
    if let Err(e) = crate::state_dir::write(&request_path(state_dir), &bytes, 0o644) {
        tracing::warn!(error = %e, "Could not announce the staged update again: {e}.");
    }
}

fn outcome_record(o: &Outcome) -> byoc_audit::log::Record {
    let event = match o.result.as_str() {
        "applied" => "update_applied",
        "refused" => "update_refused",
        _ => "update_rolled_back",
    };
    let detail = format!(
        "{} -> {}{}{}",
        o.from_version,
        o.to_version,
        o.code.as_deref().map(|c| format!(" ({c})")).unwrap_or_default(),
        o.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
    );
    let mut r =
        crate::audit_records::about_job(event, [&o.job_id, "runner.update", "runner.update"], None, detail);
    if let Some(d) = &o.from_package_sha256 {
        r.digests.insert("from_package_sha256".into(), d.clone());
    }
    r.digests.insert("to_package_sha256".into(), o.to_package_sha256.clone());
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The updater's outcomes (root's directory) are audited once each, however many
    /// came since the daemon last looked; the runner's request and staged release go
    /// only once an outcome names that very request.
    #[test]
    fn the_updaters_outcomes_are_audited_once_each_and_end_only_the_request_they_answer() {
        let (state, updater) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let audit = crate::testing::FakeAudit::default();
        record_outcome(state.path(), updater.path(), &audit);
        assert!(audit.events().is_empty(), "no outcome yet");
        std::fs::create_dir_all(staged_dir(state.path())).unwrap();
        std::fs::create_dir_all(outcomes_dir(updater.path())).unwrap();
        std::fs::write(request_path(state.path()), b"{\"the\": \"request\"}").unwrap();
        let outcome = |result: &str, request_sha256: Option<String>, at_ms| Outcome {
            result: result.into(),
            job_id: "j".into(),
            from_version: "0.1.0".into(),
            to_version: "0.2.0".into(),
            from_package_sha256: None,
            to_package_sha256: "d".into(),
            reason: Some("why".into()),
            code: Some("update_disabled".into()),
            at_ms,
            request_sha256,
        };
        let put = |name: &str, o: &Outcome| {
            std::fs::write(outcomes_dir(updater.path()).join(name), serde_json::to_vec(o).unwrap()).unwrap()
        };
        // An install, then refusals of other requests before the daemon looked: every
        // one is audited, in order; the staged request stays.
        put("000000000000001-a.json", &outcome("applied", Some("1".repeat(64)), 1));
        put("000000000000002-b.json", &outcome("refused", Some("0".repeat(64)), 2));
        put("000000000000003-c.json", &outcome("refused", Some("0".repeat(64)), 3));
        announce_pending(state.path(), updater.path());
        record_outcome(state.path(), updater.path(), &audit);
        record_outcome(state.path(), updater.path(), &audit);
        assert_eq!(audit.events(), ["update_applied", "update_refused", "update_refused"], "each once");
        assert!(request_path(state.path()).exists() && staged_dir(state.path()).exists());
        // The outcome for this request ends it.
        let digest = byoc_protocol::sha256_hex(&std::fs::read(request_path(state.path())).unwrap());
        put("000000000000004-d.json", &outcome("refused", Some(digest), 4));
        record_outcome(state.path(), updater.path(), &audit);
        assert_eq!(audit.events().len(), 4);
        assert!(!request_path(state.path()).exists() && !staged_dir(state.path()).exists());
    }

    fn config(mode: UpdateMode, pin: Option<&str>) -> UpdateConfig {
        UpdateConfig {
            mode,
            release_key: Some(release::fixture::public_key()),
            pin: pin.map(|p| version::Pin::parse(p).unwrap()),
            ..Default::default()
        }
    }

    fn code(c: &UpdateConfig, dir: &Path, version: &str, downgrade: bool) -> Option<RejectReason> {
        check_terms(c, dir, &Asked { version, downgrade }, "0.2.0").err().map(|(r, _)| r)
    }

    #[test]
    fn the_customers_terms_decide_before_the_claim() {
        let d = tempfile::tempdir().unwrap();
        let auto = config(UpdateMode::Auto, None);
        assert_eq!(code(&auto, d.path(), "0.3.0", false), None);
        assert_eq!(
            code(&config(UpdateMode::Off, None), d.path(), "0.3.0", false),
            Some(RejectReason::UpdateDisabled)
        );
        let unkeyed = UpdateConfig { release_key: None, ..auto.clone() };
        assert_eq!(code(&unkeyed, d.path(), "0.3.0", false), Some(RejectReason::UpdateDisabled));
        assert_eq!(code(&auto, d.path(), "0.2.0", false), Some(RejectReason::UpdateNotNewer));
        assert_eq!(code(&auto, d.path(), "0.1.0", true), None, "the release decides a downgrade");
        let pinned = config(UpdateMode::Auto, Some(">= 0.2.0, < 0.3.0"));
        assert_eq!(code(&pinned, d.path(), "0.3.0", false), Some(RejectReason::UpdatePinned));
        assert_eq!(code(&pinned, d.path(), "0.2.5", false), None);
    }

    #[test]
    fn the_pin_set_on_the_vm_narrows_the_configs_and_a_damaged_one_holds_everything() {
        let d = tempfile::tempdir().unwrap();
        let pinned = config(UpdateMode::Auto, Some(">= 0.2.0"));
        let rec = PinRecord { pin: "0.2.1".into(), by: "root".into(), at_ms: 1 };
        std::fs::write(pin_path(d.path()), serde_json::to_vec(&rec).unwrap()).unwrap();
        assert_eq!(code(&pinned, d.path(), "0.3.0", false), Some(RejectReason::UpdatePinned));
        assert_eq!(code(&pinned, d.path(), "0.2.1", false), None);
        // Wider than root's [update] pin: root's still holds.
        let rec = PinRecord { pin: ">= 0.1.0".into(), by: "admin".into(), at_ms: 1 };
        std::fs::write(pin_path(d.path()), serde_json::to_vec(&rec).unwrap()).unwrap();
        let narrow = config(UpdateMode::Auto, Some(">= 0.2.0, < 0.3.0"));
        assert_eq!(code(&narrow, d.path(), "0.4.0", false), Some(RejectReason::UpdatePinned));
        std::fs::write(pin_path(d.path()), "{").unwrap();
        assert_eq!(code(&pinned, d.path(), "0.2.1", false), Some(RejectReason::UpdatePinned));
    }

    #[test]
    fn the_installed_version_is_read_from_dpkgs_status() {
        let d = tempfile::tempdir().unwrap();
        let status = d.path().join("status");
        std::fs::write(
            &status,
            "Package: other\nStatus: install ok installed\nVersion: 9\n\nPackage: byoc-runner\nStatus: install ok installed\nVersion: 0.1.0-vm2\n\n",
        )
        .unwrap();
        assert_eq!(installed_version(&status).as_deref(), Some("0.1.0-vm2"));
        std::fs::write(&status, "Package: byoc-runner\nStatus: deinstall ok config-files\nVersion: 1\n")
            .unwrap();
        assert_eq!(installed_version(&status), None);
    }

    #[test]
    fn a_packaged_binary_names_its_install_root() {
        assert_eq!(package_root(Path::new("/usr/bin/byoc-runner")), Some(Path::new("/")));
        assert_eq!(
            package_root(Path::new("/tmp/demo/root/usr/bin/byoc-runner")),
            Some(Path::new("/tmp/demo/root"))
        );
        assert_eq!(dpkg_status(Path::new("/tmp/r")), Path::new("/tmp/r/var/lib/dpkg/status"));
        assert_eq!(updater_dir(Path::new("/")), Path::new(UPDATER_DIR));
        for not_packaged in
            ["/work/target/debug/byoc-runner", "usr/bin/byoc-runner", "/usr/local/bin/byoc-runner"]
        {
            assert_eq!(package_root(Path::new(not_packaged)), None, "{not_packaged}");
        }
    }
}

/// A `runner.update` delivery through the pipeline, against fakes.
#[cfg(test)]
mod pipeline_tests {
    use super::*;
    use crate::pipeline::{Accepted, JobsInHand, accept, run_job};
    use crate::testing::{self, journaled};

    fn update_job(job_id: &str, version: &str) -> byoc_protocol::JobPayload {
        let mut p = testing::payload(job_id);
        p.kind = "runner.update".into();
        p.entity = "runner".into();
        p.operation = "update".into();
        p.spec = serde_json::json!({
            "release": format!("123456789012.dkr.ecr.us-east-1.amazonaws.com/byoc-runner@sha256:{}", "a".repeat(64)),
            "version": version,
        });
        p
    }

    fn terms(mode: &str) -> String {
        let (line, _) = minisign::sign(&release::fixture::signing_key(), release::fixture::KEY_ID, b"", "");
        format!("[update]\nmode = \"{mode}\"\nrelease_public_key = \"{line}\"\n")
    }

    fn refused(f: &testing::Fakes, payload: byoc_protocol::JobPayload) -> crate::pipeline::Rejection {
        match accept(&f.rt, f.delivery(&payload), &JobsInHand::default()) {
            Accepted::Rejected(r) => r,
            _ => panic!("accepted"),
        }
    }

    #[tokio::test]
    async fn updates_switched_off_or_unkeyed_are_refused_before_the_claim() {
        let f = testing::runtime_with(&terms("off")).await;
        let r = refused(&f, update_job("job-1", "99.0.0"));
        assert_eq!(r.reason, RejectReason::UpdateDisabled);
        assert!(f.cp.calls().is_empty(), "nothing claimed: {:?}", f.cp.calls());
        assert!(!request_path(&f.rt.state_dir).exists());
        // The default terms pin no key: nothing can be verified, nothing is taken.
        let f = testing::runtime().await;
        let r = refused(&f, update_job("job-1", "99.0.0"));
        assert_eq!(r.reason, RejectReason::UpdateDisabled);
        assert!(r.detail.contains("release_public_key"), "{}", r.detail);
    }

    #[tokio::test]
    async fn a_pin_set_on_the_vm_and_an_older_version_are_refused() {
        let f = testing::runtime_with(&terms("auto")).await;
        std::fs::create_dir_all(&f.rt.update_terms_dir).unwrap();
        let pin = PinRecord { pin: ">= 99.0.0, < 99.1.0".into(), by: "root".into(), at_ms: 0 };
        std::fs::write(pin_path(&f.rt.update_terms_dir), serde_json::to_vec(&pin).unwrap()).unwrap();
        assert_eq!(refused(&f, update_job("job-1", "99.1.0")).reason, RejectReason::UpdatePinned);
        assert_eq!(refused(&f, update_job("job-2", "0.0.1")).reason, RejectReason::UpdatePinned);
        std::fs::remove_file(pin_path(&f.rt.update_terms_dir)).unwrap();
        assert_eq!(refused(&f, update_job("job-3", "0.0.1")).reason, RejectReason::UpdateNotNewer);
        // An update's operation is only `runner.update`, and nothing else is one.
        let mut mislabelled = update_job("job-4", "99.0.0");
        mislabelled.entity = "component".into();
        mislabelled.operation = "deploy".into();
        assert_eq!(refused(&f, mislabelled).reason, RejectReason::OperationMismatch);
    }

    #[tokio::test]
    async fn mode_approve_holds_an_update_for_a_person() {
        let f = testing::runtime_with(&terms("approve")).await;
        let Accepted::Job(job, _mark) =
            accept(&f.rt, f.delivery(&update_job("job-1", "99.0.0")), &JobsInHand::default())
        else {
            panic!("not accepted")
        };
        let rule = crate::pipeline::approval::approval_rule(&f.rt, &job).expect("an approval rule");
        assert_eq!(rule.name, "update.mode = \"approve\"");
        let task = tokio::spawn(run_job(f.rt.clone(), *job, ()));
        let mut asked = None;
        for _ in 0..500 {
            asked = crate::approvals::requests(&f.rt.state_dir).into_iter().next();
            if asked.is_some() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let (request, _) = asked.expect("an approval request");
        assert_eq!((request.kind.as_str(), request.operation.as_str()), ("runner.update", "runner.update"));
        // The person is shown the version; their approval of it is what the updater needs.
        assert_eq!(request.update_version.as_deref(), Some("99.0.0"));
        let decision = crate::approvals::Decision {
            approved: false,
            by: "alice".into(),
            uid: 0,
            reason: None,
            at_ms: 0,
            plan_digest: None,
        };
        crate::approvals::decide(&f.rt.state_dir, "job-1", decision, 0).expect("decide");
        task.await.expect("task").expect("journal");
        assert_eq!(f.cp.calls().last().map(String::as_str), Some("reject dl-job-1 approval_denied"));
        assert!(!journaled(&f).iter().any(|e| e == "started"), "{:?}", journaled(&f));
        assert!(!request_path(&f.rt.state_dir).exists());
    }

    #[tokio::test]
    async fn an_update_outside_the_customers_window_waits_for_it() {
        let opens = testing::NOW + 3600;
        let window = format!(
            "[[guardrails.window]]\nname = \"updates\"\nonce = [\"{}/1h\"]\n\
             [[guardrails.window_rule]]\nname = \"updates\"\nwindows = [\"updates\"]\neffects = [\"update\"]\n",
            crate::clock::rfc3339(opens)
        );
        let f = testing::runtime_with(&format!("{}{window}", terms("auto"))).await;
        let mut payload = update_job("job-1", "99.0.0");
        payload.expires_at = testing::NOW + 7200;
        let Accepted::Job(job, _mark) = accept(&f.rt, f.delivery(&payload), &JobsInHand::default()) else {
            panic!("not accepted")
        };
        let task = tokio::spawn(run_job(f.rt.clone(), *job, ()));
        for _ in 0..500 {
            if journaled(&f).iter().any(|e| e == "waiting") {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(f.rt.journal.job("job-1").map(|j| j.phase), Some(crate::journal::Phase::WaitingWindow));
        assert!(!journaled(&f).iter().any(|e| e == "started"));
        f.clock.advance_secs(3600);
        task.await.expect("task").expect("journal");
        assert_eq!(journaled(&f), ["received", "claimed", "waiting", "started", "finished", "reported"]);
        assert!(f.cp.calls().contains(&"heartbeat job-1 waiting_window".to_string()), "{:?}", f.cp.calls());
    }
}
