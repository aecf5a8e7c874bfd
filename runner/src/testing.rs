//! Fakes for every trait where a job's stages meet the outside (control plane,
//! journal, audit sink, clock, STS, switch source) and a [`Runtime`] built on them, so
//! each stage has unit tests of its own, error paths included. The real
//! implementations are tested against real servers by the end-to-end suites.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use byoc_audit::log::{AuditError, Record};
use byoc_protocol::{
    AuditUploadRequest, AuditUploadResponse, ClaimResponse, JobHeartbeatResponse, JobPayload, JobResult,
    PollRequest, PollResponse, RejectReason,
};
use tokio_util::sync::CancellationToken;

use crate::audit::AuditSink;
use crate::clock::FixedClock;
use crate::config::Config;
use crate::control_plane::{ClientError, ControlPlane, CpFuture};
use crate::journal::{Event, Index, JobJournal, Line, RecordError};
use crate::pipeline::VerifiedJob;
use crate::roles::chain::{Derived, Step};
use crate::roles::model::{RoleDef, RoleType};
use crate::roles::sts::{AssumeFuture, Assumer, Credentials, SessionParams, StsError};
use crate::roles::switches::{FileRole, Snapshot, SwitchError, SwitchFile, SwitchSource};
use crate::runtime::{Rt, Runtime};

/// Lock, surviving a panicked test thread.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A 503: transient, worth retrying.
pub fn unavailable(op: &'static str) -> ClientError {
    ClientError::Status { op, status: 503, body: "try later".into() }
}

/// A 409: refused for good.
pub fn conflict(op: &'static str, body: &str) -> ClientError {
    ClientError::Conflict { op, body: body.into() }
}

/// A control plane that answers from scripts (one queue per endpoint; an empty queue
/// answers success) and records every call in order.
#[derive(Default)]
pub struct FakeControlPlane {
    pub claims: Mutex<VecDeque<Result<ClaimResponse, ClientError>>>,
    pub results: Mutex<VecDeque<Result<(), ClientError>>>,
    pub rejects: Mutex<VecDeque<Result<(), ClientError>>>,
    pub heartbeats: Mutex<VecDeque<Result<JobHeartbeatResponse, ClientError>>>,
    /// `claim job-1`, `result job-1 succeeded`, `reject dl-1 role_disabled`, …
    pub calls: Mutex<Vec<String>>,
    /// Every log byte the runner uploaded, by offset.
    pub log: Mutex<Vec<u8>>,
    pub reported: Mutex<Vec<JobResult>>,
}

impl FakeControlPlane {
    pub fn calls(&self) -> Vec<String> {
        lock(&self.calls).clone()
    }
    fn call(&self, c: String) {
        lock(&self.calls).push(c);
    }
    pub fn script_claims(&self, answers: impl IntoIterator<Item = Result<ClaimResponse, ClientError>>) {
        lock(&self.claims).extend(answers);
    }
    pub fn script_results(&self, answers: impl IntoIterator<Item = Result<(), ClientError>>) {
        lock(&self.results).extend(answers);
    }
    pub fn script_rejects(&self, answers: impl IntoIterator<Item = Result<(), ClientError>>) {
        lock(&self.rejects).extend(answers);
    }
}

impl ControlPlane for FakeControlPlane {
    fn poll<'a>(&'a self, _req: &'a PollRequest) -> CpFuture<'a, Option<PollResponse>> {
        self.call("poll".into());
        Box::pin(async { Ok(None) })
    }
    fn reject<'a>(
        &'a self,
        delivery_id: &'a str,
        reason: RejectReason,
        _detail: &'a str,
    ) -> CpFuture<'a, ()> {
        self.call(format!("reject {delivery_id} {}", reason.code()));
        let answer = lock(&self.rejects).pop_front().unwrap_or(Ok(()));
        Box::pin(async move { answer })
    }
    fn claim<'a>(
        &'a self,
        job_id: &'a str,
        _delivery_id: &'a str,
        lease_bound: bool,
    ) -> CpFuture<'a, ClaimResponse> {
        // The offer to hold the job to its lease shows only when made.
        self.call(format!("claim {job_id}{}", if lease_bound { " lease_bound" } else { "" }));
        let answer = lock(&self.claims).pop_front().unwrap_or(Ok(ClaimResponse {
            lease_secs: 60,
            epoch: 0,
            lease_bound: false,
        }));
        Box::pin(async move { answer })
    }
    fn heartbeat<'a>(
        &'a self,
        job_id: &'a str,
        waiting: Option<&'a byoc_protocol::JobWaiting>,
    ) -> CpFuture<'a, JobHeartbeatResponse> {
        match waiting {
            Some(w) => self.call(format!("heartbeat {job_id} {}", w.state)),
            None => self.call(format!("heartbeat {job_id}")),
        }
        let answer = lock(&self.heartbeats)
            .pop_front()
            .unwrap_or(Ok(JobHeartbeatResponse { lease_secs: 60, cancel: false }));
        Box::pin(async move { answer })
    }
    fn append_log<'a>(&'a self, _job_id: &'a str, offset: u64, bytes: &'a [u8]) -> CpFuture<'a, u64> {
        let mut log = lock(&self.log);
        let answer = if offset as usize == log.len() {
            log.extend_from_slice(bytes);
            Ok(log.len() as u64)
        } else {
            Err(ClientError::LogOffset { server_offset: log.len() as u64 })
        };
        Box::pin(async move { answer })
    }
    fn audit<'a>(&'a self, _req: &'a AuditUploadRequest) -> CpFuture<'a, AuditUploadResponse> {
        Box::pin(async { Err(ClientError::Protocol("the fake control plane keeps no audit log".into())) })
    }
    fn result<'a>(&'a self, job_id: &'a str, result: &'a JobResult) -> CpFuture<'a, ()> {
        self.call(format!("result {job_id} {}", result.status.as_str()));
        let answer = lock(&self.results).pop_front().unwrap_or(Ok(()));
        if answer.is_ok() {
            lock(&self.reported).push(result.clone());
        }
        Box::pin(async move { answer })
    }
}

/// An in-memory journal with the real index; appends can be made to fail (a full disk).
#[derive(Default)]
pub struct FakeJournal {
    index: Mutex<Index>,
    pub events: Mutex<Vec<Event>>,
    pub fail_appends: AtomicBool,
}

impl FakeJournal {
    pub fn events(&self) -> Vec<Event> {
        lock(&self.events).clone()
    }
}

impl JobJournal for FakeJournal {
    fn append(&self, event: Event) -> Result<(), RecordError> {
        if self.fail_appends.load(Ordering::SeqCst) {
            return Err(RecordError::Append {
                path: "fake-journal".into(),
                source: std::io::Error::other("no space left on device"),
            });
        }
        lock(&self.index).apply(&Line { ts: crate::clock::now_ms(), event: event.clone() });
        lock(&self.events).push(event);
        Ok(())
    }
    fn visit_index(&self, f: &mut dyn FnMut(&Index)) {
        f(&lock(&self.index))
    }
}

/// Keeps records in memory; can be made to fail.
#[derive(Default)]
pub struct FakeAudit {
    pub records: Mutex<Vec<Record>>,
    pub fail: AtomicBool,
}

impl FakeAudit {
    pub fn events(&self) -> Vec<String> {
        lock(&self.records).iter().map(|r| r.event.clone()).collect()
    }
}

impl AuditSink for FakeAudit {
    fn record(&self, r: Record) -> Result<u64, AuditError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(AuditError::Io {
                op: "appending to",
                path: "fake-audit".into(),
                source: std::io::Error::other("no space left on device"),
            });
        }
        let mut records = lock(&self.records);
        records.push(r);
        Ok(records.len() as u64 - 1)
    }
}

/// STS that counts calls and answers with fixed credentials or an error.
#[derive(Default)]
pub struct FakeSts {
    pub calls: AtomicUsize,
    pub params: Mutex<Vec<SessionParams>>,
    pub fail_with: Mutex<Option<String>>,
}

impl Assumer for FakeSts {
    fn assume<'a>(&'a self, params: &'a SessionParams) -> AssumeFuture<'a> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        lock(&self.params).push(params.clone());
        let answer = match lock(&self.fail_with).clone() {
            Some(message) => Err(StsError { role_arn: params.role_arn.clone(), message }),
            None => Ok(Credentials {
                access_key_id: "ASIAFAKEKEY".into(),
                secret_access_key: "fake-secret-key".into(),
                session_token: "fake-session-token".into(),
                expiration: crate::clock::unix_now() + params.duration_secs as i64,
            }),
        };
        Box::pin(async move { answer })
    }
}

/// Switches read from memory; reads can fail, and are counted.
#[derive(Default)]
pub struct FakeSwitches {
    pub roles: Mutex<Vec<FileRole>>,
    pub reads: AtomicUsize,
    pub unreadable: AtomicBool,
}

impl FakeSwitches {
    pub fn set(&self, name: &str, enabled: bool) {
        let mut roles = lock(&self.roles);
        roles.retain(|r| r.name != name);
        roles.push(FileRole {
            name: name.into(),
            arn: Some(format!("arn:aws:iam::123456789012:role/{name}")),
            enabled,
        });
    }
}

impl SwitchSource for FakeSwitches {
    fn read(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Snapshot, SwitchError>> + Send + '_>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        let answer = if self.unreadable.load(Ordering::SeqCst) {
            Err(SwitchError::File { path: "fake-switches".into(), message: "permission denied".into() })
        } else {
            Ok(Snapshot::File {
                path: "fake-switches".into(),
                file: SwitchFile { role: lock(&self.roles).clone() },
            })
        };
        Box::pin(async move { answer })
    }
    fn describe(&self) -> String {
        "fake switches".into()
    }
}

/// Shares a fake with the runtime that owns it as a trait object.
struct Shared<T>(Arc<T>);

impl SwitchSource for Shared<FakeSwitches> {
    fn read(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Snapshot, SwitchError>> + Send + '_>> {
        self.0.read()
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}

/// A runtime on fakes, with its state dir in a temp dir, and the fakes to script.
pub struct Fakes {
    pub rt: Rt,
    pub cp: Arc<FakeControlPlane>,
    pub journal: Arc<FakeJournal>,
    pub audit: Arc<FakeAudit>,
    pub clock: Arc<FixedClock>,
    pub sts: Arc<FakeSts>,
    pub switches: Arc<FakeSwitches>,
    pub dir: tempfile::TempDir,
    /// The control plane's job-signing key (its public half is pinned in the config).
    pub signing_key: ed25519_dalek::SigningKey,
}

impl Fakes {
    /// A delivery of `payload`, signed by the pinned key.
    pub fn delivery(&self, payload: &JobPayload) -> crate::pipeline::PolledJob {
        crate::pipeline::PolledJob {
            delivery_id: format!("dl-{}", payload.job_id),
            envelope: byoc_protocol::JobEnvelope::sign(payload, &self.signing_key),
            received_at: Instant::now(),
        }
    }
}

/// The fixed clock's start: jobs from [`payload`] are valid at it.
pub const NOW: i64 = 1_900_000_000;

pub async fn runtime() -> Fakes {
    runtime_with("").await
}

/// [`runtime`] with more configuration (whole sections, e.g. `[[guardrails.window]]`).
pub async fn runtime_with(extra: &str) -> Fakes {
    let dir = tempfile::tempdir().expect("temp dir");
    let signing_key = byoc_protocol::generate_signing_key();
    let key = byoc_protocol::b64(signing_key.verifying_key().as_bytes());
    let text = format!(
        "[control_plane]\nurl = \"https://cp.example.com\"\npublic_keys = [\"{key}\"]\n\
         [runner]\ninstall_id = \"inst-1\"\nstate_dir = \"{}\"\n\
         [poll]\nbackoff_initial_ms = 10\nbackoff_max_secs = 1\n[jobs]\nheartbeat_secs = 1\n\
         [sandbox]\nenabled = false\n[containers]\nenabled = false\n{extra}",
        dir.path().display()
    );
    let config = Config::parse(&text, "test", []).expect("test config");
    crate::daemon::prepare_state_dir(dir.path()).expect("state dir");
    let mut roles =
        crate::roles::Roles::from_config(&config, "inst-1", dir.path()).await.expect("roles from config");
    let sts = Arc::new(FakeSts::default());
    let switches = Arc::new(FakeSwitches::default());
    roles.assumer = Some(sts.clone() as Arc<dyn Assumer>);
    roles.source = Box::new(Shared(switches.clone()));
    roles.region = Some("us-east-1".into());
    let (cp, journal, audit) = (
        Arc::new(FakeControlPlane::default()),
        Arc::new(FakeJournal::default()),
        Arc::new(FakeAudit::default()),
    );
    let clock = Arc::new(FixedClock::at_secs(NOW));
    let rt = Arc::new(Runtime {
        runner_id: "rn-1".into(),
        install_id: "inst-1".into(),
        state_dir: dir.path().to_path_buf(),
        update_terms_dir: dir.path().join("update-terms"),
        journal: journal.clone(),
        audit: audit.clone(),
        client: cp.clone(),
        abort: CancellationToken::new(),
        sandbox: None,
        containers: None,
        roles,
        pause: Mutex::new(Default::default()),
        allowances_sync: Mutex::new(()),
        stop_reporting: CancellationToken::new(),
        clock: clock.clone(),
        leases: Default::default(),
        config,
    });
    Fakes { rt, cp, journal, audit, clock, sts, switches, dir, signing_key }
}

/// A payload for this runner, valid at [`NOW`] for five minutes.
pub fn payload(job_id: &str) -> JobPayload {
    JobPayload {
        job_id: job_id.into(),
        runner_id: "rn-1".into(),
        install_id: "inst-1".into(),
        issued_at: NOW - 10,
        expires_at: NOW + 300,
        nonce: format!("nonce-{job_id}"),
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

/// A verified noop job, with the role the precedence chain would have derived.
pub fn verified(job_id: &str, role: Option<&str>) -> VerifiedJob {
    let payload = payload(job_id);
    VerifiedJob {
        delivery_id: format!("dl-{job_id}"),
        payload_sha256: byoc_protocol::sha256_hex(job_id.as_bytes()),
        executor: byoc_job_executors::build(&payload.kind, &payload.spec).expect("noop builds"),
        timeout: Duration::from_secs(payload.timeout_secs),
        received_at: Instant::now(),
        role: role.map(|name| Derived {
            role: RoleDef {
                name: name.into(),
                name_template: name.into(),
                role_type: RoleType::Maintenance,
                key: "Maintenance".into(),
                display_name: None,
                description: None,
                defined_in: "permissions/maintenance.toml".into(),
                policies: 0,
                plan_actions: Vec::new(),
            },
            step: Step::Default,
            reference: "maintenance".into(),
        }),
        secrets: Vec::new(),
        envelope: byoc_protocol::JobEnvelope::sign(&payload, &byoc_protocol::generate_signing_key()),
        payload,
        origin: crate::pipeline::Origin::Remote,
    }
}

/// Journal a job as received (as `accept` does), so later stages find it.
pub fn receive(f: &Fakes, job: &VerifiedJob) {
    crate::pipeline::record_received(&f.rt, job).expect("journal");
}

/// The event names journaled so far (`received`, `claimed`, …).
pub fn journaled(f: &Fakes) -> Vec<String> {
    f.journal
        .events()
        .iter()
        .map(|e| {
            serde_json::to_value(e)
                .ok()
                .and_then(|v| v.get("event").and_then(|e| e.as_str()).map(str::to_string))
                .unwrap_or_default()
        })
        .collect()
}
