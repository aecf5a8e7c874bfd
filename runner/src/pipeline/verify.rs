//! Stage 2: verify the envelope before anything else happens. Signature by a pinned
//! key, addressed to this runner and install, inside its validity window, nonce never
//! seen, job not already finished, kind known and spec valid, size bounded.
//!
//! A rejection carries a reason code; the caller journals and reports it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use byoc_job_executors::{Executor, SpecError};
use byoc_protocol::{JobPayload, MAX_PAYLOAD_BYTES, RejectReason, sha256_hex, unb64};
use ed25519_dalek::VerifyingKey;

use super::PolledJob;
use crate::journal::{Index, Phase};

pub struct VerifiedJob {
    pub delivery_id: String,
    pub payload: JobPayload,
    pub payload_sha256: String,
    pub executor: Box<dyn Executor>,
    pub timeout: Duration,
    pub received_at: Instant,
    /// The role the precedence chain derived (and the control plane proposed); `None`
    /// when the job asked for none.
    pub role: Option<crate::roles::chain::Derived>,
    /// The customer's secrets the app config declares (docs/SECRETS.md), checked
    /// against the secrets the job names.
    pub secrets: Vec<byoc_job_executors::secrets::Declared>,
    /// The envelope as delivered: kept (durably) while the job is held by the
    /// customer's guardrails, so a restart can verify and resume it.
    pub envelope: byoc_protocol::JobEnvelope,
    pub origin: super::Origin,
}

/// Why a job is refused, before it is a `Rejection` (the delivery's and the job's ids
/// added).
type Refused = (RejectReason, String);

#[derive(Debug, Clone)]
pub struct Rejection {
    pub delivery_id: String,
    pub reason: RejectReason,
    pub detail: String,
    /// Known only when the payload was authentic and parsed.
    pub job_id: Option<String>,
    pub nonce: Option<String>,
    pub expires_at: Option<i64>,
}

pub struct Verifier<'a> {
    pub keys: &'a BTreeMap<String, VerifyingKey>,
    pub runner_id: &'a str,
    pub install_id: &'a str,
    pub max_skew: Duration,
    pub max_timeout: Duration,
    /// Unix seconds.
    pub now: i64,
    /// Install values for role-name templates.
    pub install: &'a crate::roles::template::InstallState,
    /// The customer's pause, if in force: authentic new jobs are refused with `paused`.
    pub paused: Option<&'a crate::roles::pause::Pause>,
    /// Why the state dir's disk cannot take a new job (`disk_low`), if it cannot.
    pub disk_low: Option<&'a str>,
    /// Whether this host can build the job's sandbox as documented right now (its
    /// network boundary, its limits): `None` when it can.
    pub readiness: &'a (dyn Fn(&dyn Executor) -> Option<byoc_job_executors::Refusal> + Sync),
    /// Where the runner may connect for a job: registries (`[oci] registry_endpoints`
    /// as configured) and cluster API servers (`[kubernetes] allowed_servers`).
    pub registries: byoc_oci_sync::Reach,
    pub clusters: byoc_oci_sync::Reach,
    /// Terraform jobs may bring their own provider mirror (`[terraform]
    /// job_provider_mirrors`).
    pub job_provider_mirrors: bool,
    /// Recovery only: accept the envelope of a job the journal shows held by the
    /// guardrails (its nonce is its own). Never set for a delivery.
    pub resume_held: bool,
    /// The customer's `[update]` terms and the state dir (its pin), for `runner.update`
    /// jobs; `None`: every update is refused.
    pub update: Option<(&'a crate::config::UpdateConfig, &'a std::path::Path)>,
}

/// A job id names files and URL segments: keep it to a safe alphabet.
pub fn valid_job_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

impl Verifier<'_> {
    pub fn verify(&self, polled: PolledJob, journal: &Index) -> Result<VerifiedJob, Rejection> {
        let delivery_id = polled.delivery_id.clone();
        let reject = |reason, detail: String| Rejection {
            delivery_id: delivery_id.clone(),
            reason,
            detail,
            job_id: None,
            nonce: None,
            expires_at: None,
        };
        let env = &polled.envelope;
        // Base64 is 4/3 of the bytes: refuse before decoding anything huge.
        if env.payload.len() > MAX_PAYLOAD_BYTES / 3 * 4 + 4 {
            return Err(reject(
                RejectReason::OversizePayload,
                format!("payload is about {} bytes, limit {MAX_PAYLOAD_BYTES}", env.payload.len() / 4 * 3),
            ));
        }
        let bytes = unb64("payload", &env.payload)
            .map_err(|e| reject(RejectReason::MalformedEnvelope, e.to_string()))?;
        if bytes.len() > MAX_PAYLOAD_BYTES {
            return Err(reject(
                RejectReason::OversizePayload,
                format!("payload is {} bytes, limit {MAX_PAYLOAD_BYTES}", bytes.len()),
            ));
        }
        let Some(key) = self.keys.get(&env.key_id) else {
            return Err(reject(
                RejectReason::UnknownKey,
                format!("key id {:?} is not pinned on this runner", truncate(&env.key_id, 64)),
            ));
        };
        let sig = unb64("signature", &env.signature)
            .map_err(|e| reject(RejectReason::BadSignature, e.to_string()))?;
        if !byoc_protocol::verify_job_signature(key, &bytes, &sig) {
            return Err(reject(
                RejectReason::BadSignature,
                format!("signature does not verify under key {}", env.key_id),
            ));
        }
        // Authentic from here on; still parsed strictly.
        let payload: JobPayload = serde_json::from_slice(&bytes)
            .map_err(|e| reject(RejectReason::MalformedEnvelope, format!("payload: {e}")))?;
        if payload.job_id.starts_with(byoc_protocol::LOCAL_JOB_PREFIX) {
            return Err(reject(
                RejectReason::MalformedEnvelope,
                format!(
                    "job ids starting with {:?} are the runner's own checks",
                    byoc_protocol::LOCAL_JOB_PREFIX
                ),
            ));
        }
        self.admit(payload, sha256_hex(&bytes), polled, journal, super::Origin::Remote)
    }

    /// The checks of an authentic payload, and the job they admit. Deliveries come here
    /// once their signature verifies; the runner's own drift checks (`crate::drift`)
    /// come here with a payload built from a deploy whose signature verified.
    pub fn admit(
        &self,
        payload: JobPayload,
        payload_sha256: String,
        polled: PolledJob,
        journal: &Index,
        origin: super::Origin,
    ) -> Result<VerifiedJob, Rejection> {
        let delivery_id = polled.delivery_id.clone();
        let (job_id, nonce, expires_at) = (
            valid_job_id(&payload.job_id).then(|| payload.job_id.clone()),
            payload.nonce.clone(),
            payload.expires_at,
        );
        let refuse = |(reason, detail): Refused| Rejection {
            delivery_id: delivery_id.clone(),
            reason,
            detail,
            job_id: job_id.clone(),
            nonce: Some(nonce.clone()),
            expires_at: Some(expires_at),
        };
        self.check_addressed(&payload).map_err(refuse)?;
        self.check_not_seen(&payload, &payload_sha256, journal).map_err(refuse)?;
        let (executor, timeout) = self.build_executor(&payload).map_err(refuse)?;
        self.check_runner_can_take(executor.as_ref()).map_err(refuse)?;
        let (secrets, role) = self.check_app(&payload, executor.as_ref()).map_err(refuse)?;
        Ok(VerifiedJob {
            delivery_id: polled.delivery_id,
            envelope: polled.envelope,
            payload,
            payload_sha256,
            executor,
            timeout,
            received_at: polled.received_at,
            role,
            secrets,
            origin,
        })
    }

    /// Well formed, for this runner and install, within its validity window.
    fn check_addressed(&self, payload: &JobPayload) -> Result<(), Refused> {
        if !valid_job_id(&payload.job_id) {
            return Err((
                RejectReason::MalformedEnvelope,
                format!(
                    "job id {:?} is not 1-128 characters of [A-Za-z0-9._-]",
                    truncate(&payload.job_id, 64)
                ),
            ));
        }
        if payload.nonce.is_empty() || payload.nonce.len() > 128 {
            return Err((RejectReason::MalformedEnvelope, "nonce must be 1-128 characters".into()));
        }
        if payload.runner_id != self.runner_id {
            return Err((
                RejectReason::WrongRunner,
                format!(
                    "job is for runner {:?}, this is {}",
                    truncate(&payload.runner_id, 64),
                    self.runner_id
                ),
            ));
        }
        if payload.install_id != self.install_id {
            return Err((
                RejectReason::WrongInstall,
                format!(
                    "job is for install {:?}, this is {}",
                    truncate(&payload.install_id, 64),
                    self.install_id
                ),
            ));
        }
        let skew = self.max_skew.as_secs() as i64;
        if self.now > payload.expires_at.saturating_add(skew) {
            return Err((RejectReason::Expired, format!("expired {}s ago", self.now - payload.expires_at)));
        }
        if payload.issued_at > self.now.saturating_add(skew) {
            return Err((
                RejectReason::NotYetValid,
                format!("issued {}s in the future (allowed skew {skew}s)", payload.issued_at - self.now),
            ));
        }
        Ok(())
    }

    /// Neither this job nor its nonce has been here before (unless it is the same
    /// envelope of a job received and never claimed, or a held job resuming).
    fn check_not_seen(
        &self,
        payload: &JobPayload,
        payload_sha256: &str,
        journal: &Index,
    ) -> Result<(), Refused> {
        if let Some(job) = journal.jobs.get(&payload.job_id) {
            match job.phase {
                Phase::Finished | Phase::Reported | Phase::ClaimRefused | Phase::Refused | Phase::Fenced => {
                    return Err((
                        RejectReason::AlreadyFinished,
                        format!("job {} already ended here ({})", payload.job_id, job.phase.as_str()),
                    ));
                }
                // The same envelope again after we received it but never claimed (we
                // crashed, or the offer timed out): accepting it runs the job once.
                Phase::Received if job.payload_sha256 == *payload_sha256 => {}
                Phase::WaitingWindow | Phase::AwaitingApproval
                    if self.resume_held && job.payload_sha256 == *payload_sha256 => {}
                phase => {
                    return Err((
                        RejectReason::ReplayedNonce,
                        format!("job {} is already {} here", payload.job_id, phase.as_str()),
                    ));
                }
            }
        } else if let Some((other_job, _)) = journal.nonces.get(&payload.nonce) {
            return Err((
                RejectReason::ReplayedNonce,
                format!("nonce was already used by job {other_job:?}"),
            ));
        }
        Ok(())
    }

    /// The job's executor from its kind and spec, held to what it does (its effect) and
    /// to what it may reach; and its timeout.
    fn build_executor(&self, payload: &JobPayload) -> Result<(Box<dyn Executor>, Duration), Refused> {
        let timeout = Duration::from_secs(payload.timeout_secs);
        if timeout.is_zero() || timeout > self.max_timeout {
            return Err((
                RejectReason::InvalidSpec,
                format!("timeout_secs {} must be 1..={}", payload.timeout_secs, self.max_timeout.as_secs()),
            ));
        }
        let executor = match byoc_job_executors::build(&payload.kind, &payload.spec) {
            Ok(e) => e,
            Err(SpecError::UnknownKind(k)) => {
                return Err((
                    RejectReason::UnknownKind,
                    format!("kind {:?} is not supported", truncate(&k, 64)),
                ));
            }
            Err(e @ SpecError::Invalid { .. }) => {
                return Err((RejectReason::InvalidSpec, e.to_string()));
            }
        };
        if let Err(why) =
            byoc_job_executors::check_drift_operation(&payload.entity, &payload.operation, executor.as_ref())
        {
            return Err((RejectReason::InvalidSpec, why.to_string()));
        }
        // What the job does is the runner's to say, not a label's: its operation must be
        // one that effect may run as (a terraform apply is not an `action.trigger`).
        let effect = executor.effect();
        if !effect.allows(&payload.entity, &payload.operation) {
            return Err((
                RejectReason::OperationMismatch,
                truncate(
                    &format!(
                        "a {} job whose effect is {effect} cannot run as {}.{}; it runs as {}",
                        payload.kind,
                        payload.entity,
                        payload.operation,
                        effect.operations().join(", ")
                    ),
                    1000,
                ),
            ));
        }
        // Nothing the job names is reached on the host's loopback, link-local, metadata
        // or own addresses, or over plain HTTP, unless the customer configured it.
        if let Some(why) =
            byoc_job_executors::endpoint_refusal(executor.as_ref(), &self.registries, &self.clusters)
        {
            return Err((RejectReason::InvalidSpec, truncate(&why, 1000)));
        }
        if executor.names_provider_mirror() && !self.job_provider_mirrors {
            return Err((
                RejectReason::ProviderMirrorNotAllowed,
                byoc_job_executors::terraform::providers::MIRROR_REFUSED.to_string(),
            ));
        }
        Ok((executor, timeout))
    }

    /// Whether this runner takes the job now: not paused, room on disk, its sandbox
    /// buildable as documented.
    fn check_runner_can_take(&self, executor: &dyn Executor) -> Result<(), Refused> {
        if let Some(p) = self.paused {
            return Err((
                RejectReason::Paused,
                format!(
                    "the customer paused this runner{}{}; it takes no new jobs until `byoc-runner resume`",
                    if p.by.is_empty() { String::new() } else { format!(" ({})", p.by) },
                    p.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
                ),
            ));
        }
        if let Some(why) = self.disk_low {
            return Err((RejectReason::DiskLow, why.to_string()));
        }
        if let Some(refusal) = (self.readiness)(executor) {
            return Err(match refusal {
                byoc_job_executors::Refusal::NetworkUnavailable(why) => (
                    RejectReason::SandboxNetworkUnavailable,
                    format!("the job's network boundary cannot be built on this runner: {why}"),
                ),
                byoc_job_executors::Refusal::LimitsUnavailable(why) => (
                    RejectReason::SandboxLimitsUnavailable,
                    format!("the job's resource limits cannot be applied on this runner: {why}"),
                ),
                byoc_job_executors::Refusal::OutputUnavailable(why) => (
                    RejectReason::ContainerOutputUnavailable,
                    format!("the container's output cannot be recorded on this runner: {why}"),
                ),
            });
        }
        if let Some(ask) = executor.runner_update() {
            let Some((terms, terms_dir)) = self.update else {
                return Err((RejectReason::UpdateDisabled, "this runner takes no updates here".into()));
            };
            let asked = crate::update::Asked { version: &ask.version, downgrade: ask.downgrade };
            crate::update::check_terms(terms, terms_dir, &asked, crate::update::running_version())?;
        }
        Ok(())
    }

    /// What the app config says of the job: its policies parse, its secrets are
    /// declared, and the role the runner derives (a deprovision role never changes or
    /// copies).
    fn check_app(
        &self,
        payload: &JobPayload,
        executor: &dyn Executor,
    ) -> Result<(Vec<byoc_job_executors::secrets::Declared>, Option<crate::roles::chain::Derived>), Refused>
    {
        // The vendor's policy declarations: one that cannot apply to anything is an
        // error of the app config, never skipped.
        if let Some(app) = &payload.app_config
            && let Err(problems) = crate::app_policies::parse(app)
        {
            return Err((
                RejectReason::InvalidSpec,
                truncate(&format!("app config policies: {}", problems.join("; ")), 1000),
            ));
        }
        // Secrets go only where the app config declares them.
        let secrets = crate::secrets::check_job(payload, executor, self.install).map_err(|e| match e {
            crate::secrets::UseRefused::Declarations(_) => {
                (RejectReason::InvalidSpec, truncate(&e.to_string(), 1000))
            }
            crate::secrets::UseRefused::NotDeclared(why) => {
                (RejectReason::SecretTargetNotDeclared, truncate(&why, 1000))
            }
        })?;
        // The vendor proposes a role; the runner derives its own and compares.
        let role =
            crate::roles::chain::derive_for_job(payload, self.install).map_err(|e| (e.reason, e.detail))?;
        // A deprovision role is for taking things down: a change or a copy under it would
        // be decided as a deprovision (where deleting a database is expected).
        let effect = executor.effect();
        if let Some(r) = &role
            && r.role.role_type == crate::roles::model::RoleType::Deprovision
            && matches!(effect, byoc_protocol::Effect::Change | byoc_protocol::Effect::Copy)
        {
            return Err((
                RejectReason::OperationMismatch,
                format!(
                    "a {} job whose effect is {effect} cannot run under the deprovision-type role {:?}",
                    payload.kind, r.role.name
                ),
            ));
        }
        Ok((secrets, role))
    }
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use byoc_protocol::{JobEnvelope, generate_signing_key, key_id};

    struct Fixture {
        key: ed25519_dalek::SigningKey,
        keys: BTreeMap<String, VerifyingKey>,
        job_provider_mirrors: bool,
    }

    fn fixture() -> Fixture {
        let key = generate_signing_key();
        let keys = [(key_id(&key.verifying_key()), key.verifying_key())].into_iter().collect();
        Fixture { key, keys, job_provider_mirrors: true }
    }

    fn payload() -> JobPayload {
        JobPayload {
            job_id: "job-1".into(),
            runner_id: "rn-1".into(),
            install_id: "inst-1".into(),
            issued_at: 1000,
            expires_at: 1300,
            nonce: "nonce-1".into(),
            attempt: 1,
            kind: "runner.noop".into(),
            operation: "trigger".into(),
            entity: "action".into(),
            requested_role: None,
            timeout_secs: 60,
            spec: serde_json::Value::Null,
            app_config: None,
            role_request: None,
        }
    }

    fn install() -> crate::roles::template::InstallState {
        crate::roles::template::InstallState::new("inst-1", None, None, None)
    }

    fn verify(f: &Fixture, env: JobEnvelope, index: &Index, now: i64) -> Result<VerifiedJob, Rejection> {
        verify_paused(f, env, index, now, None)
    }

    fn verify_on_low_disk(f: &Fixture, env: JobEnvelope, why: &str) -> Result<VerifiedJob, Rejection> {
        verify_with(f, env, &Index::default(), 1100, None, Some(why))
    }

    #[test]
    fn a_low_disk_refuses_authentic_jobs_only() {
        let f = fixture();
        let r =
            verify_on_low_disk(&f, JobEnvelope::sign(&payload(), &f.key), "only 3 MiB free").err().unwrap();
        assert_eq!(r.reason, RejectReason::DiskLow);
        assert_eq!(r.detail, "only 3 MiB free");
        let r =
            verify_on_low_disk(&f, JobEnvelope::sign(&payload(), &generate_signing_key()), "only 3 MiB free")
                .err()
                .unwrap();
        assert_eq!(r.reason, RejectReason::UnknownKey);
    }

    fn verify_paused(
        f: &Fixture,
        env: JobEnvelope,
        index: &Index,
        now: i64,
        paused: Option<&crate::roles::pause::Pause>,
    ) -> Result<VerifiedJob, Rejection> {
        verify_with(f, env, index, now, paused, None)
    }

    fn verify_with(
        f: &Fixture,
        env: JobEnvelope,
        index: &Index,
        now: i64,
        paused: Option<&crate::roles::pause::Pause>,
        disk_low: Option<&str>,
    ) -> Result<VerifiedJob, Rejection> {
        let v = Verifier {
            keys: &f.keys,
            runner_id: "rn-1",
            install_id: "inst-1",
            max_skew: Duration::from_secs(30),
            max_timeout: Duration::from_secs(3600),
            now,
            install: &install(),
            paused,
            disk_low,
            readiness: &|_| None,
            update: None,
            registries: byoc_oci_sync::Reach::guarded(["registry.allowed.test:5000"]),
            clusters: byoc_oci_sync::Reach::guarded(Vec::<String>::new()),
            job_provider_mirrors: f.job_provider_mirrors,
            resume_held: false,
        };
        v.verify(PolledJob { delivery_id: "dl-1".into(), envelope: env, received_at: Instant::now() }, index)
    }

    fn reason(f: &Fixture, p: JobPayload, now: i64) -> RejectReason {
        verify(f, JobEnvelope::sign(&p, &f.key), &Index::default(), now).err().expect("rejected").reason
    }

    #[test]
    fn a_pause_refuses_authentic_jobs_only() {
        let f = fixture();
        let pause =
            crate::roles::pause::Pause { paused_at_ms: 1, reason: Some("freeze".into()), by: "alice".into() };
        let r =
            verify_paused(&f, JobEnvelope::sign(&payload(), &f.key), &Index::default(), 1100, Some(&pause))
                .err()
                .unwrap();
        assert_eq!(r.reason, RejectReason::Paused);
        assert!(r.detail.contains("alice") && r.detail.contains("freeze"), "{}", r.detail);
        // A forgery is still named as such.
        let rogue = generate_signing_key();
        let r =
            verify_paused(&f, JobEnvelope::sign(&payload(), &rogue), &Index::default(), 1100, Some(&pause))
                .err()
                .unwrap();
        assert_eq!(r.reason, RejectReason::UnknownKey);
    }

    #[test]
    fn the_proposed_role_is_checked_before_anything_is_journaled() {
        let f = fixture();
        let app = crate::roles::model::tests::app();
        let with_role = |role: &str| JobPayload {
            entity: "component".into(),
            operation: "deploy".into(),
            requested_role: Some(role.into()),
            app_config: Some(app.clone()),
            role_request: Some(byoc_protocol::RoleRequest {
                entity_name: "api".into(),
                ..Default::default()
            }),
            ..payload()
        };
        let ok =
            verify(&f, JobEnvelope::sign(&with_role("inst-1-maintenance"), &f.key), &Index::default(), 1100)
                .ok()
                .unwrap();
        assert_eq!(ok.role.unwrap().role.name, "inst-1-maintenance");
        assert_eq!(reason(&f, with_role("inst-1-provision"), 1100), RejectReason::RoleMismatch);
        assert_eq!(
            reason(&f, JobPayload { app_config: None, ..with_role("inst-1-maintenance") }, 1100),
            RejectReason::RoleUnknown
        );
    }

    #[test]
    fn secrets_go_only_where_the_app_config_declares_them() {
        let f = fixture();
        let job = |secrets: &str, spec: serde_json::Value| JobPayload {
            kind: "secrets.sync".into(),
            entity: "secret".into(),
            operation: "sync".into(),
            spec,
            app_config: Some(byoc_protocol::AppConfig {
                secrets: Some(secrets.into()),
                ..Default::default()
            }),
            ..payload()
        };
        let declared = "[[secret]]\nname = \"db\"\nkubernetes_sync = true\nkubernetes_secret_namespace = \"app\"\nkubernetes_secret_name = \"db\"\n";
        let named =
            |secrets: serde_json::Value| serde_json::json!({"kubeconfig": KUBECONFIG, "secrets": secrets});
        let ok = verify(
            &f,
            JobEnvelope::sign(&job(declared, named(serde_json::json!(["db"]))), &f.key),
            &Index::default(),
            1100,
        )
        .ok()
        .unwrap();
        assert_eq!(ok.secrets.len(), 1);
        let elsewhere = serde_json::json!([{"name": "db", "kubernetes": {"namespace": "vendor", "name": "db", "key": "value"}}]);
        assert_eq!(reason(&f, job(declared, named(elsewhere)), 1100), RejectReason::SecretTargetNotDeclared);
        assert_eq!(
            reason(&f, job(declared, named(serde_json::json!(["other"]))), 1100),
            RejectReason::SecretTargetNotDeclared
        );
        // Declarations the runner cannot read refuse the job, whatever it names.
        assert_eq!(
            reason(&f, job("[[secret]]\nname = \"db\"\nbogus = 1\n", named(serde_json::json!([]))), 1100),
            RejectReason::InvalidSpec
        );
    }

    #[test]
    fn accepts_a_good_envelope() {
        let f = fixture();
        let v = verify(&f, JobEnvelope::sign(&payload(), &f.key), &Index::default(), 1100).ok().unwrap();
        assert_eq!(v.payload.job_id, "job-1");
    }

    #[test]
    fn each_field_check_has_its_reason() {
        let f = fixture();
        assert_eq!(
            reason(&f, JobPayload { runner_id: "rn-2".into(), ..payload() }, 1100),
            RejectReason::WrongRunner
        );
        assert_eq!(
            reason(&f, JobPayload { install_id: "x".into(), ..payload() }, 1100),
            RejectReason::WrongInstall
        );
        assert_eq!(reason(&f, payload(), 1331), RejectReason::Expired);
        // Inside the allowed skew on both edges.
        assert!(verify(&f, JobEnvelope::sign(&payload(), &f.key), &Index::default(), 1329).is_ok());
        assert!(verify(&f, JobEnvelope::sign(&payload(), &f.key), &Index::default(), 971).is_ok());
        assert_eq!(reason(&f, payload(), 969), RejectReason::NotYetValid);
        assert_eq!(
            reason(&f, JobPayload { kind: "x.y".into(), ..payload() }, 1100),
            RejectReason::UnknownKind
        );
        assert_eq!(
            reason(&f, JobPayload { job_id: "../etc".into(), ..payload() }, 1100),
            RejectReason::MalformedEnvelope
        );
        assert_eq!(reason(&f, JobPayload { timeout_secs: 0, ..payload() }, 1100), RejectReason::InvalidSpec);
        assert_eq!(
            reason(
                &f,
                JobPayload {
                    kind: "action.script".into(),
                    spec: serde_json::json!({"nope": 1}),
                    ..payload()
                },
                1100
            ),
            RejectReason::InvalidSpec
        );
    }

    #[test]
    fn a_delivery_may_not_use_the_runners_own_job_ids() {
        let f = fixture();
        let r = verify(
            &f,
            JobEnvelope::sign(&JobPayload { job_id: "local-drift-x".into(), ..payload() }, &f.key),
            &Index::default(),
            1100,
        )
        .err()
        .expect("refused");
        assert_eq!(r.reason, RejectReason::MalformedEnvelope);
        assert!(r.detail.contains("the runner's own checks"), "{}", r.detail);
    }

    #[test]
    fn only_a_drift_check_runs_as_component_drift_and_it_runs_as_nothing_else() {
        let f = fixture();
        let terraform = |mode: &str, operation: &str| JobPayload {
            kind: "terraform".into(),
            entity: "component".into(),
            operation: operation.into(),
            spec: serde_json::json!({"mode": mode, "workspace": "net", "files": {"main.tf": ""}}),
            ..payload()
        };
        let refused =
            verify(&f, JobEnvelope::sign(&terraform("apply", "drift"), &f.key), &Index::default(), 1100)
                .err()
                .expect("an apply passing as a drift check");
        assert_eq!(refused.reason, RejectReason::InvalidSpec);
        assert!(refused.detail.contains("only a drift check"), "{}", refused.detail);
        assert_eq!(reason(&f, terraform("drift", "deploy"), 1100), RejectReason::InvalidSpec);
        assert!(
            verify(&f, JobEnvelope::sign(&terraform("drift", "drift"), &f.key), &Index::default(), 1100)
                .is_ok()
        );
        assert!(
            verify(&f, JobEnvelope::sign(&terraform("apply", "deploy"), &f.key), &Index::default(), 1100)
                .is_ok()
        );
    }

    #[test]
    fn envelope_level_failures() {
        let f = fixture();
        let good = JobEnvelope::sign(&payload(), &f.key);
        let check =
            |env: JobEnvelope| verify(&f, env, &Index::default(), 1100).err().expect("rejected").reason;

        let rogue = generate_signing_key();
        assert_eq!(check(JobEnvelope::sign(&payload(), &rogue)), RejectReason::UnknownKey);

        let mut forged = JobEnvelope::sign(&payload(), &rogue);
        forged.key_id = good.key_id.clone();
        assert_eq!(check(forged), RejectReason::BadSignature);

        let mut tampered = good.clone();
        let mut bytes = unb64("p", &tampered.payload).unwrap();
        bytes[10] ^= 1;
        tampered.payload = byoc_protocol::b64(&bytes);
        assert_eq!(check(tampered), RejectReason::BadSignature);

        let mut not_b64 = good.clone();
        not_b64.payload = "***".into();
        assert_eq!(check(not_b64), RejectReason::MalformedEnvelope);

        assert_eq!(
            check(JobEnvelope::sign_bytes(b"{\"job_id\": 1}", &f.key)),
            RejectReason::MalformedEnvelope
        );

        let big = JobPayload { spec: serde_json::json!({"p": "x".repeat(MAX_PAYLOAD_BYTES)}), ..payload() };
        assert_eq!(check(JobEnvelope::sign(&big, &f.key)), RejectReason::OversizePayload);
    }

    #[test]
    fn journal_history_decides_replays() {
        use crate::journal::JobRecord;
        let f = fixture();
        let env = JobEnvelope::sign(&payload(), &f.key);
        let sha = sha256_hex(&unb64("p", &env.payload).unwrap());
        let mut index = Index::default();
        index.nonces.insert("nonce-1".into(), ("job-0".into(), 1300));
        let other = JobPayload { job_id: "job-2".into(), ..payload() };
        let r = verify(&f, JobEnvelope::sign(&other, &f.key), &index, 1100).err().unwrap();
        assert_eq!(r.reason, RejectReason::ReplayedNonce);

        let record = |phase| JobRecord {
            job_id: "job-1".into(),
            delivery_id: "dl-0".into(),
            kind: "runner.noop".into(),
            operation: "trigger".into(),
            entity: "action".into(),
            nonce: "nonce-1".into(),
            payload_sha256: sha.clone(),
            phase,
            received_at_ms: 0,
            started_at_ms: None,
            finished: None,
            detail: None,
            state_workspace: None,
            effect: None,
            component: None,
            local: false,
            lease_epoch: 0,
        };
        for (phase, expect) in [
            (Phase::Finished, Some(RejectReason::AlreadyFinished)),
            (Phase::Reported, Some(RejectReason::AlreadyFinished)),
            (Phase::Started, Some(RejectReason::ReplayedNonce)),
            (Phase::Claimed, Some(RejectReason::ReplayedNonce)),
            (Phase::Received, None),
        ] {
            index.jobs.insert("job-1".into(), record(phase));
            let got = verify(&f, env.clone(), &index, 1100).err().map(|r| r.reason);
            assert_eq!(got, expect, "phase {phase:?}");
        }
    }

    const KUBECONFIG: &str = "clusters: [{name: c, cluster: {server: 'https://api.example.com'}}]\nusers: [{name: u, user: {token: t}}]\n";

    /// What a job names for the runner itself to reach (cluster API servers, registries)
    /// is refused before the claim when it is plain HTTP, the host's loopback, link-local
    /// or metadata addresses, or a kubeconfig that names a command or a file, naming the
    /// field; an endpoint the customer's configuration names is reached.
    #[test]
    fn a_provider_mirror_the_customer_does_not_allow_is_refused_before_the_claim() {
        let mut f = fixture();
        let tf = |providers: Option<&str>| {
            let mut spec = serde_json::json!({"mode": "apply", "workspace": "net", "files": {"main.tf": ""}});
            if let Some(p) = providers {
                spec["providers"] = p.into();
            }
            JobPayload {
                kind: "terraform".into(),
                spec,
                entity: "component".into(),
                operation: "deploy".into(),
                ..payload()
            }
        };
        let mirror = format!("registry.allowed.test:5000/vendor/providers@sha256:{}", "b".repeat(64));
        let sign = |p: &JobPayload| JobEnvelope::sign(p, &f.key);
        assert!(verify(&f, sign(&tf(Some(&mirror))), &Index::default(), 1100).is_ok());
        f.job_provider_mirrors = false;
        let r = verify(&f, sign(&tf(Some(&mirror))), &Index::default(), 1100).err().expect("refused");
        assert_eq!(r.reason, RejectReason::ProviderMirrorNotAllowed);
        assert!(r.detail.contains("job_provider_mirrors"), "{}", r.detail);
        // A job without one is not concerned.
        assert!(verify(&f, sign(&tf(None)), &Index::default(), 1100).is_ok());
    }

    #[test]
    fn endpoints_a_job_names_are_checked_before_the_claim() {
        let f = fixture();
        let job = |kind: &str, spec: serde_json::Value| {
            let (entity, operation) =
                if kind == "oci.sync" { ("artifact", "sync") } else { ("component", "teardown") };
            JobPayload {
                kind: kind.into(),
                spec,
                entity: entity.into(),
                operation: operation.into(),
                ..payload()
            }
        };
        let kube = |server: &str| {
            serde_json::json!({"action": "delete", "component": "api", "namespace": "acme",
                "kubeconfig": KUBECONFIG.replace("https://api.example.com", server)})
        };
        let sync = |source: &str| {
            serde_json::json!({"source": format!("{source}/vendor/api@sha256:{}", "a".repeat(64)),
                "destination": {"repository": "api"}})
        };
        for (kind, spec, field) in [
            ("kubernetes", kube("https://169.254.169.254"), "clusters[0].cluster.server"),
            ("kubernetes", kube("https://127.0.0.1:6443"), "loopback"),
            ("kubernetes", kube("https://[fd00:ec2::254]"), "metadata"),
            ("kubernetes", kube("https://localhost:6443"), "loopback name"),
            ("kubernetes", kube("http://api.example.com"), "https:// only"),
            ("oci.sync", sync("127.0.0.1:5000"), "source"),
            ("oci.sync", sync("169.254.169.254"), "link-local"),
        ] {
            let r = verify(&f, JobEnvelope::sign(&job(kind, spec.clone()), &f.key), &Index::default(), 1100)
                .err()
                .expect("refused");
            assert_eq!(r.reason, RejectReason::InvalidSpec, "{spec}");
            assert!(r.detail.contains(field), "{field}: {}", r.detail);
        }
        let exec = KUBECONFIG.replace("{token: t}", "{exec: {command: sh, args: [-c, 'id > /tmp/x']}}");
        let spec = serde_json::json!({"action": "delete", "component": "api", "namespace": "acme", "kubeconfig": exec});
        let r = verify(&f, JobEnvelope::sign(&job("kubernetes", spec), &f.key), &Index::default(), 1100)
            .err()
            .expect("refused");
        assert_eq!(r.reason, RejectReason::InvalidSpec);
        assert!(r.detail.contains("users[0].user.exec") && r.detail.contains("command"), "{}", r.detail);
        // Allowed by the verifier's configuration (see `verify_with`), or elsewhere.
        for (kind, spec) in [
            ("oci.sync", sync("registry.allowed.test:5000")),
            ("oci.sync", sync("registry.vendor.example")),
            ("kubernetes", kube("https://api.example.com:6443")),
        ] {
            verify(&f, JobEnvelope::sign(&job(kind, spec.clone()), &f.key), &Index::default(), 1100)
                .unwrap_or_else(|r| panic!("{spec}: {r:?}"));
        }
    }

    /// A settled job's envelope delivered again after journal compaction: refused at
    /// every moment up to its expiry plus the allowed skew, and expired after that.
    #[test]
    fn an_envelope_delivered_again_after_compaction_is_never_accepted() {
        use crate::journal::{Event, Journal};
        let f = fixture();
        let env = JobEnvelope::sign(&payload(), &f.key);
        let dir = tempfile::tempdir().expect("dir");
        let (journal, _) = Journal::open(dir.path()).expect("journal");
        let settle = |id: &str, nonce: &str| {
            for e in [
                Event::Received {
                    job_id: id.into(),
                    delivery_id: "dl-0".into(),
                    nonce: nonce.into(),
                    expires_at: 1300,
                    kind: "runner.noop".into(),
                    operation: "trigger".into(),
                    entity: "action".into(),
                    payload_sha256: "00".into(),
                    timeout_secs: 60,
                    effect: None,
                    component: None,
                    local: false,
                },
                Event::Claimed { job_id: id.into(), lease_secs: 60, epoch: 0 },
                Event::Reported { job_id: id.into() },
            ] {
                journal.append(e).expect("append");
            }
        };
        settle("job-1", "nonce-1");
        for i in 0..40 {
            settle(&format!("later-{i:02}"), &format!("n-{i}"));
        }
        // The verifier (`verify_with`) allows 30 s of skew; compaction is told the same.
        let skew = Duration::from_secs(30);
        for now in [1301, 1315, 1330] {
            let compacted = journal
                .compact(10, crate::journal::nonce_horizon_secs(now as u64 * 1000, skew))
                .expect("compact");
            assert!(compacted.is_none(), "at {now} every nonce may still be presented");
            let r = journal.with_index(|i| verify(&f, env.clone(), i, now)).err().map(|r| r.reason);
            assert_eq!(r, Some(RejectReason::AlreadyFinished), "at {now}");
        }
        let later = 1332;
        let c = journal
            .compact(10, crate::journal::nonce_horizon_secs(later as u64 * 1000, skew))
            .expect("compact");
        assert!(c.is_some_and(|c| c.jobs > 0), "past the horizon the settled jobs go");
        assert!(journal.with_index(|i| !i.nonces.contains_key("nonce-1")));
        let r = journal.with_index(|i| verify(&f, env.clone(), i, later)).err().map(|r| r.reason);
        assert_eq!(r, Some(RejectReason::Expired));
    }

    /// The runner derives what a job does from its kind and spec; the operation must be
    /// one that effect may run as, and a change never runs under a deprovision role.
    #[test]
    fn a_job_whose_operation_does_not_fit_what_it_does_is_refused() {
        let f = fixture();
        let tf = |mode: &str, entity: &str, operation: &str| JobPayload {
            kind: "terraform".into(),
            entity: entity.into(),
            operation: operation.into(),
            spec: serde_json::json!({"mode": mode, "workspace": "api", "files": {"main.tf": ""}}),
            ..payload()
        };
        let check = |p: JobPayload| verify(&f, JobEnvelope::sign(&p, &f.key), &Index::default(), 1100);
        for (mode, entity, operation) in [
            ("apply", "action", "trigger"),
            ("apply", "component", "teardown"),
            ("apply", "artifact", "sync"),
            ("destroy", "component", "deploy"),
            ("destroy", "action", "trigger"),
            ("apply", "component", "rollout"),
        ] {
            let r = check(tf(mode, entity, operation)).err().expect("refused");
            assert_eq!(
                r.reason,
                RejectReason::OperationMismatch,
                "{mode} as {entity}.{operation}: {}",
                r.detail
            );
            assert!(r.detail.contains(&format!("{entity}.{operation}")), "{}", r.detail);
        }
        for (mode, entity, operation) in [
            ("apply", "component", "deploy"),
            ("apply", "sandbox", "provision"),
            ("destroy", "component", "teardown"),
            ("destroy", "sandbox", "deprovision"),
            ("plan", "action", "trigger"),
        ] {
            check(tf(mode, entity, operation))
                .unwrap_or_else(|r| panic!("{mode} as {entity}.{operation}: {r:?}"));
        }
        // Scripts run at any point of the lifecycle, but never as a sync.
        let script = |entity: &str, operation: &str| JobPayload {
            kind: "action.script".into(),
            entity: entity.into(),
            operation: operation.into(),
            spec: serde_json::json!({"script": "true"}),
            ..payload()
        };
        assert!(check(script("sandbox", "provision")).is_ok());
        assert_eq!(
            check(script("artifact", "sync")).err().map(|r| r.reason),
            Some(RejectReason::OperationMismatch)
        );
    }
}
