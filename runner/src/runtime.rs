//! What every stage of a job's path may use: the runner's shared, read-mostly context
//! (`Runtime`), built once by the daemon, and how the configuration becomes sandbox and
//! container settings.

use std::path::PathBuf;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::audit::AuditSink;
use crate::config::Config;
use crate::control_plane::ControlPlane;
use crate::journal::JobJournal;
use crate::state_dir::StateDir;

/// What every stage may use: shared, read-mostly runner context.
pub struct Runtime {
    pub config: Config,
    pub runner_id: String,
    pub install_id: String,
    pub state_dir: PathBuf,
    /// The customer's update terms on the VM, where the runner's user cannot write (the
    /// admin's pin; `update::terms_dir`).
    pub update_terms_dir: PathBuf,
    /// Where the stages meet the outside: each a trait, so every stage can be unit
    /// tested against fakes (the `testing` module).
    pub journal: Arc<dyn JobJournal>,
    pub audit: Arc<dyn AuditSink>,
    /// The control plane. A job's path reaches it through `plane(origin)`.
    pub client: Arc<dyn ControlPlane>,
    /// Cancelled on the second SIGTERM: every running job is cancelled.
    pub abort: CancellationToken,
    /// How process jobs are sandboxed (None: disabled by configuration).
    pub sandbox: Option<byoc_job_executors::SandboxSettings>,
    pub containers: Option<byoc_job_executors::ContainerSettings>,
    /// Lifecycle roles: switches, STS, the credential endpoint.
    pub roles: crate::roles::Roles,
    /// The pause as last audited, and what the CLI last put on record of it.
    pub pause: std::sync::Mutex<PauseSeen>,
    /// Held while the honoured allowances are brought up to date (one audit each).
    pub allowances_sync: std::sync::Mutex<()>,
    /// Cancelled when the daemon stops for good: reporting loops give up (the journal
    /// keeps what was not reported, for the next start).
    pub stop_reporting: CancellationToken,
    /// The clock decisions are made by (envelope validity, claim expiry).
    pub clock: Arc<dyn crate::clock::Clock>,
    /// Jobs held to their leases (their sandboxes stop when a lease runs out).
    pub leases: crate::leases::LeaseBook,
}

pub type Rt = Arc<Runtime>;

impl Runtime {
    /// Journal a job transition, then audit it; both are fsynced before the caller acts.
    pub fn transition(&self, event: crate::journal::Event) -> Result<(), crate::journal::RecordError> {
        let record = crate::audit::record_for(&event);
        self.journal.append(event)?;
        self.audit.record(record).map_err(|e| crate::journal::RecordError::Audit(e.to_string()))?;
        Ok(())
    }

    /// Append one of the runner's own records to the audit log. A failure is logged
    /// (`Could not audit {what}`) and returned as `false`: the caller decides whether
    /// what it records may go on without it.
    pub fn audit_or_log(&self, record: byoc_audit::log::Record, what: &str) -> bool {
        let record_copy = record.clone();
        match self.audit.record(record) {
            Ok(_) => true,
            Err(e) => {
                // The record was to be this step's one entry: its words go here instead.
                tracing::error!(error = %e, "Could not audit {what} ({}): {e}.", crate::logging::audit_sentence(0, &record_copy).trim_start_matches("Audit record 0, "));
                false
            }
        }
    }

    /// Whom a job's path answers to: the control plane for a delivery, the VM itself
    /// for one of the runner's own checks.
    pub fn plane(&self, origin: crate::pipeline::Origin) -> &dyn ControlPlane {
        match origin {
            crate::pipeline::Origin::Remote => self.client.as_ref(),
            crate::pipeline::Origin::Local => &crate::control_plane::local::LocalChecks,
        }
    }
}

impl Runtime {
    /// The local allowances the daemon honours: each one in `control/allowances.json`
    /// it had not seen is audited first (`allowance_seen`, its writer as the kernel
    /// reports it, capped at seven days); see `roles::allowance::sync`.
    pub fn honoured_allowances(
        &self,
    ) -> Result<
        std::collections::BTreeMap<String, crate::roles::allowance::Allowance>,
        crate::roles::allowance::AllowancesError,
    > {
        use crate::roles::allowance;
        // One sync at a time: two would audit the same allowance twice.
        let _held = self.allowances_sync.lock().unwrap_or_else(|e| e.into_inner());
        allowance::sync(&self.state_dir, self.clock.now_ms(), &mut |role, a, note| {
            let record = crate::audit_records::allowance_seen(role, a, note.as_deref());
            self.audit.record(record).map(drop).map_err(|e| e.to_string())
        })
    }

    /// Each local allowance that ran out since the last look, audited once
    /// (`allowance_expired`).
    fn audit_expired_allowances(&self) {
        use crate::roles::allowance;
        let Ok(honoured) = self.honoured_allowances() else { return };
        let expired = allowance::newly_expired(&self.state_dir, &honoured, self.clock.now_ms());
        if expired.is_empty() {
            return;
        }
        let mut done = Vec::new();
        for (role, a) in expired {
            tracing::info!(role = %role, "A local allowance expired.");
            if !self.audit_or_log(crate::audit_records::allowance_expired(&role, &a), "an expired allowance")
            {
                break;
            }
            done.push((role, a));
        }
        if let Err(e) = allowance::mark_expired_audited(&self.state_dir, &honoured, &done) {
            tracing::warn!(error = %e, "Could not note audited allowance expiries; they may be audited again: {e}.");
        }
    }

    /// What the customer did with the CLI since the last look, audited (the CLI cannot
    /// write the daemon's audit log): its inbox records, then the pause as of now.
    pub fn check_customer_controls(&self) -> Option<crate::roles::pause::Pause> {
        // The last pause or resume the CLI put on record (it does, with who, before it
        // touches the pause file).
        let mut recorded_paused = None;
        crate::roles::inbox::drain(&self.state_dir, |r| {
            let paused = match r.event.as_str() {
                "runner_paused" => Some(true),
                "runner_resumed" => Some(false),
                _ => None,
            };
            self.audit.record(r).map(|_| recorded_paused = paused.or(recorded_paused))
        });
        self.audit_expired_allowances();
        let now = crate::roles::pause::read(&self.state_dir);
        let mut seen = self.pause.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(paused) = recorded_paused {
            seen.claim = Some(Claim { paused, looked: false });
        }
        let record = seen.look(&now);
        if let Some(record) = record
            && self.audit_or_log(record, "a pause change")
        {
            seen.last = now.clone();
        }
        now
    }
}

/// The pause as the daemon last audited it, and the CLI's last record of a change.
#[derive(Debug, Default)]
pub struct PauseSeen {
    pub last: Option<crate::roles::pause::Pause>,
    claim: Option<Claim>,
}

/// A pause or resume the CLI recorded (with who) and the daemon has not seen take
/// effect yet: the CLI records before it touches the file, so at one look the file
/// may not have changed yet.
#[derive(Debug, Clone, Copy)]
struct Claim {
    paused: bool,
    looked: bool,
}

impl PauseSeen {
    /// What to audit of the pause as it is `now`, if anything. A change the CLI
    /// recorded is not recorded twice (the journal has it, with who, once); a change
    /// nobody recorded is recorded as seen; a recorded change that has not taken effect
    /// by the next look is corrected by the pause as it stands.
    fn look(&mut self, now: &Option<crate::roles::pause::Pause>) -> Option<byoc_audit::log::Record> {
        if let Some(claim) = self.claim {
            if claim.paused == now.is_some() {
                self.claim = None;
                self.last = now.clone();
                return None;
            }
            if !claim.looked {
                self.claim = Some(Claim { looked: true, ..claim });
                return (self.last != *now).then(|| crate::audit_records::pause_changed(now.as_ref()));
            }
            self.claim = None;
            let mut record = crate::audit_records::pause_changed(now.as_ref());
            record.detail = Some(format!(
                "{}{}the {} recorded before did not take effect",
                record.detail.as_deref().unwrap_or(""),
                if record.detail.is_some() { "; " } else { "" },
                if claim.paused { "pause" } else { "resume" }
            ));
            return Some(record);
        }
        (self.last != *now).then(|| crate::audit_records::pause_changed(now.as_ref()))
    }
}

/// Prove the sandbox can be built here before taking any job.
pub async fn sandbox_self_test(
    settings: &byoc_job_executors::SandboxSettings,
    state_dir: &std::path::Path,
) -> Result<(), byoc_job_executors::sandboxed::SelfTestError> {
    byoc_job_executors::sandboxed::self_test(settings, &StateDir::of(state_dir).roots()).await
}

/// Container settings from the configuration (limits shared with the sandbox).
pub fn container_settings(config: &Config) -> Option<byoc_job_executors::ContainerSettings> {
    let c = &config.containers;
    c.enabled.then(|| byoc_job_executors::ContainerSettings {
        docker_socket: c.docker_socket.clone(),
        memory_bytes: config.sandbox.memory_mib * 1024 * 1024,
        pids: config.sandbox.pids,
        uid: config.sandbox.uid,
        gid: config.sandbox.gid,
        busybox: config.roles.busybox.clone(),
        network: config.sandbox.egress.clone(),
        owner: String::new(),
        prepare_networks: false,
    })
}

/// Sandbox settings from the configuration: the helper is this very binary.
pub fn sandbox_settings(
    config: &Config,
    helper: std::path::PathBuf,
) -> Option<byoc_job_executors::SandboxSettings> {
    let s = &config.sandbox;
    if !s.enabled {
        return None;
    }
    let state_dir = config.runner.state_dir.clone();
    let mut hidden = vec![state_dir.clone(), PathBuf::from("/etc/byoc-runner")];
    if let Some(dir) = config.source.parent().filter(|d| d.is_absolute()) {
        hidden.push(dir.to_path_buf());
    }
    Some(byoc_job_executors::SandboxSettings {
        helper,
        helper_args: vec!["sandbox-exec".into()],
        roots_dir: StateDir::of(&state_dir).roots(),
        limits: byoc_sandbox::cgroup::Limits {
            memory_bytes: s.memory_mib * 1024 * 1024,
            pids: s.pids,
            cpu_millis: s.cpu_percent * 10,
        },
        cgroups: s.cgroups,
        tmp_size_mib: s.tmp_size_mib,
        nofile: s.nofile,
        ro_paths: s.extra_ro_paths.clone(),
        hidden_paths: hidden,
        host_uid: s.uid,
        host_gid: s.gid,
        network: s.egress.clone(),
        require_limits: s.require_limits,
    })
}

#[cfg(test)]
mod tests {
    use super::{Claim, PauseSeen};
    use crate::roles::pause::Pause;

    fn paused() -> Option<Pause> {
        Some(Pause { paused_at_ms: 1, reason: Some("freeze".into()), by: "alice".into() })
    }

    fn event(r: Option<byoc_audit::log::Record>) -> Option<String> {
        r.map(|r| r.event)
    }

    #[test]
    fn a_change_the_cli_recorded_is_not_recorded_again_even_if_seen_a_look_later() {
        // Recorded and in effect at the same look.
        let mut seen = PauseSeen { claim: Some(Claim { paused: true, looked: false }), ..Default::default() };
        assert_eq!(event(seen.look(&paused())), None);
        assert_eq!(seen.last, paused());
        // Recorded, the file not yet removed at this look, removed by the next.
        seen.claim = Some(Claim { paused: false, looked: false });
        assert_eq!(event(seen.look(&paused())), None);
        assert_eq!(event(seen.look(&None)), None);
        assert_eq!(seen.last, None);
        // Paused and resumed between two looks: both recorded by the CLI, nothing seen.
        seen.claim = Some(Claim { paused: false, looked: false });
        assert_eq!(event(seen.look(&None)), None);
    }

    #[test]
    fn a_recorded_change_that_did_not_take_effect_is_corrected_and_an_unrecorded_one_is_seen() {
        let mut seen = PauseSeen { last: paused(), claim: Some(Claim { paused: false, looked: false }) };
        assert_eq!(event(seen.look(&paused())), None, "the CLI may still be removing the file");
        let r = seen.look(&paused()).expect("a correction");
        assert_eq!(r.event, "runner_paused");
        assert!(r.detail.unwrap().contains("the resume recorded before did not take effect"));
        // The file removed by hand, with no record: audited as seen, once.
        let mut seen = PauseSeen { last: paused(), claim: None };
        assert_eq!(event(seen.look(&None)), Some("runner_resumed".into()));
    }
}
