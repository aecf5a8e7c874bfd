//! Control-plane state and the protocol rules it enforces.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use byoc_protocol::{
    JobEnvelope, JobPayload, JobResult, PollRequest, RejectReason, generate_signing_key, random_hex,
};
use ed25519_dalek::{SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

pub fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Failure switches. `error_rate` and `cut_rate` are probabilities per runner request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Runner API refuses connections (the listener is closed).
    pub down: bool,
    /// Fraction of runner requests answered 503, half before and half after the
    /// handler ran (so the runner must cope with effects it never saw confirmed).
    pub error_rate: f64,
    /// Delay added to every runner request, milliseconds.
    pub slow_ms: u64,
    /// Fraction of runner responses whose body is cut off half-way.
    pub cut_rate: f64,
    /// The next N log appends are stored but answered 503, so the runner retries at a
    /// stale offset and must recover from the 416 that follows.
    pub lose_log_acks: u32,
    /// The next N claims are answered 503 without effect (the offer then times out and
    /// the job is offered again while the runner still retries its claim).
    pub fail_claims: u32,
}

/// Ways to make a job envelope bad on purpose, one per rejection reason.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Tamper {
    /// Sign with a key the runner has never been given.
    pub unknown_key: bool,
    /// Flip a byte of the signature.
    pub bad_signature: bool,
    /// Put this runner id in the payload (the delivery still goes to the real runner).
    pub payload_runner_id: Option<String>,
    pub payload_install_id: Option<String>,
    /// Override issued_at / expires_at relative to now, seconds.
    pub issued_offset_secs: Option<i64>,
    pub expires_offset_secs: Option<i64>,
    /// Reuse this nonce.
    pub nonce: Option<String>,
    /// Reuse this job id.
    pub job_id: Option<String>,
    /// Send bytes that are not a payload at all.
    pub malformed: bool,
    /// Pad the spec so the payload exceeds the runner's size limit.
    pub oversize: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnqueueRequest {
    pub kind: String,
    #[serde(default = "default_operation")]
    pub operation: String,
    #[serde(default = "default_entity")]
    pub entity: String,
    #[serde(default)]
    pub spec: serde_json::Value,
    #[serde(default = "default_timeout")]
    pub timeout_secs: u64,
    #[serde(default)]
    pub requested_role: Option<String>,
    /// The app's role files and matrix, signed with the job.
    #[serde(default)]
    pub app_config: Option<byoc_protocol::AppConfig>,
    #[serde(default)]
    pub role_request: Option<byoc_protocol::RoleRequest>,
    /// Runner to deliver to; defaults to the only enrolled runner.
    #[serde(default)]
    pub runner_id: Option<String>,
    #[serde(default = "default_ttl")]
    pub ttl_secs: i64,
    #[serde(default)]
    pub tamper: Tamper,
}

fn default_operation() -> String {
    "trigger".into()
}
fn default_entity() -> String {
    "action".into()
}
fn default_timeout() -> u64 {
    600
}
fn default_ttl() -> i64 {
    300
}

impl EnqueueRequest {
    pub fn new(kind: &str, spec: serde_json::Value) -> Self {
        EnqueueRequest {
            kind: kind.into(),
            operation: default_operation(),
            entity: default_entity(),
            spec,
            timeout_secs: default_timeout(),
            requested_role: None,
            app_config: None,
            role_request: None,
            runner_id: None,
            ttl_secs: default_ttl(),
            tamper: Tamper::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Pending,
    Offered,
    Claimed,
    Rejected,
    Finished,
}

fn log_digest(job: &Job) -> String {
    hex::encode(sha2::Digest::finalize(job.log_hasher.clone()))
}

#[derive(Debug)]
struct Job {
    job_id: String,
    kind: String,
    nonce: String,
    state: JobState,
    enqueued_ms: u64,
    offered_at: Option<Instant>,
    claimed_by: Option<String>,
    cancel_requested: bool,
    log: Vec<u8>,
    /// The logs of earlier leases (epoch, bytes): a job leased anew starts its log
    /// again, since the new runner's log is a new run's.
    earlier_logs: Vec<(u64, Vec<u8>)>,
    /// Running digest of `log`: views are taken on every change, and hashing a large log
    /// each time (under the state lock) would make the server, not the runner, the
    /// bottleneck of every log-heavy test and benchmark.
    log_hasher: sha2::Sha256,
    result: Option<JobResult>,
    rejections: Vec<(RejectReason, String)>,
    result_posts: u32,
    claims: u32,
    heartbeats: u32,
    log_416s: u32,
    /// What the runner last said holds the job back (cleared by a plain heartbeat).
    waiting: Option<byoc_protocol::JobWaiting>,
    /// Every distinct waiting report, in order.
    waited: Vec<byoc_protocol::JobWaiting>,
    /// What was signed for the first delivery (re-signed for another runner when the
    /// job is leased anew); `None` for a tampered envelope.
    payload: Option<JobPayload>,
    group: &'static str,
    /// The current lease's fencing epoch (1 for the first).
    epoch: u64,
    /// When the current lease runs out without a heartbeat.
    lease_until: Option<Instant>,
    /// Every lease given: runner and epoch, in order.
    leases: Vec<(String, u64)>,
    /// Requests refused as fenced: runner, the epoch it sent (0: none), what.
    fenced: Vec<(String, u64, String)>,
    /// The vendor says the runner holding the job stopped: it may be leased anew even
    /// if it changes or destroys.
    released: bool,
    /// The current lease holds the job to it (the runner offered, another runner of
    /// the install could take it): its processes are gone once the lease runs out.
    lease_bound: bool,
}

impl Job {
    /// A script, a container, a noop or an artifact copy may run again elsewhere once
    /// its lease expired (a copy by digest is idempotent; the vendor's own code must be
    /// written to be re-run). Terraform, helm, kubernetes, secrets and updates can change
    /// or destroy: they wait until the first runner is known to have stopped: the lease
    /// held the job (its processes ended with it), or the vendor says so
    /// (`release_lease`); terraform's state lock keeps two applies apart even then.
    fn reofferable(&self) -> bool {
        self.released
            || self.lease_bound
            || matches!(self.kind.as_str(), "action.script" | "action.container" | "runner.noop" | "oci.sync")
    }
}

struct Delivery {
    job_id: String,
    target_runner: String,
    group: &'static str,
    envelope: JobEnvelope,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobView {
    pub job_id: String,
    pub kind: String,
    pub state: JobState,
    pub nonce: String,
    pub cancel_requested: bool,
    pub result: Option<JobResult>,
    pub rejections: Vec<(RejectReason, String)>,
    pub log_size: u64,
    pub log_sha256: String,
    pub result_posts: u32,
    pub claims: u32,
    pub heartbeats: u32,
    pub log_416s: u32,
    /// The runner holds the job back (a maintenance window): what it last reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<byoc_protocol::JobWaiting>,
    /// Every distinct waiting report the runner sent for this job.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waited: Vec<byoc_protocol::JobWaiting>,
    /// The runner holding the current lease, and its fencing epoch.
    pub claimed_by: Option<String>,
    pub epoch: u64,
    /// Every lease given (runner, epoch), in order.
    pub leases: Vec<(String, u64)>,
    /// The current lease holds the job to it (see `Job::lease_bound`).
    #[serde(default)]
    pub lease_bound: bool,
    /// Requests refused as fenced: runner, epoch, what.
    pub fenced: Vec<(String, u64, String)>,
    /// Enqueue → the runner started the job (from the result's `started_at_ms`).
    pub pickup_ms: Option<u64>,
    pub duration_ms: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunnerView {
    pub runner_id: String,
    pub hostname: String,
    /// The version the runner last said it runs, and a staged update it has not applied.
    pub version: Option<String>,
    pub pending_update: Option<String>,
    pub last_poll: Option<PollRequest>,
    pub polls: u64,
    pub retired: bool,
}

/// A release of the runner the vendor published: its artifact by digest in the install's
/// registry (SHA256SUMS, its signature and the package as one layer), and its terms.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    pub version: String,
    /// `<install registry>/<repository>@sha256:…`.
    pub reference: String,
    #[serde(default)]
    pub min_rollback_version: Option<String>,
    /// Older than what runners run: applied only where the release signs the downgrade.
    #[serde(default)]
    pub downgrade: bool,
}

/// `POST /admin/runners/{runner}/update`: send a published release to a runner.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct UpdateRunner {
    pub version: String,
    /// The role the release is fetched from the install's registry under.
    #[serde(default)]
    pub requested_role: Option<String>,
    #[serde(default)]
    pub app_config: Option<byoc_protocol::AppConfig>,
}

struct Runner {
    public_key: VerifyingKey,
    hostname: String,
    last_poll: Option<PollRequest>,
    polls: u64,
    /// The install token it enrolled with (none: a one-time token).
    install_token: Option<String>,
    /// It left the install (its instance went away after draining, or the vendor said
    /// so): it is refused from now on, and its place is free for a replacement.
    retired: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum CpError {
    #[error("unauthorized: {0}")]
    Unauthorized(&'static str),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("log offset mismatch")]
    LogOffset { server_offset: u64 },
    /// A request under a lease the job has since been given away from.
    #[error("fenced: {0}")]
    Fenced(String),
}

pub struct State {
    pub install_id: String,
    pub signing_key: SigningKey,
    /// A key the runner never trusts, for `Tamper::unknown_key`.
    rogue_key: SigningKey,
    pub lease_secs: u64,
    pub offer_timeout: Duration,
    pub token_ttl: Duration,
    pub faults: Faults,
    bootstrap_tokens: HashSet<String>,
    /// Install tokens: each enrolls up to this many runners not retired at once.
    install_tokens: HashMap<String, usize>,
    runners: BTreeMap<String, Runner>,
    challenges: HashMap<String, (String, Instant)>,
    tokens: HashMap<String, (String, Instant)>,
    jobs: BTreeMap<String, Job>,
    job_order: Vec<String>,
    deliveries: HashMap<String, Delivery>,
    queue: VecDeque<String>,
    pub requests: BTreeMap<String, u64>,
    /// Acknowledged audit records per runner (leaf hashes and the record lines).
    audit: HashMap<String, AuditCopy>,
    /// Published runner releases, by version.
    releases: BTreeMap<String, Release>,
    /// The token service that honours the one-time source grants jobs carry.
    pub registry_tokens: Option<std::sync::Arc<crate::grants::RegistryTokens>>,
}

#[derive(Default)]
struct AuditCopy {
    leaves: Vec<byoc_audit::merkle::Hash>,
    /// The acknowledged leaves' Merkle frontier: an upload's root without hashing the
    /// whole log again (that made a long soak quadratic).
    frontier: byoc_audit::merkle::Frontier,
    records: Vec<String>,
}

impl State {
    pub fn new(install_id: String, lease_secs: u64, offer_timeout: Duration) -> Self {
        State {
            install_id,
            signing_key: generate_signing_key(),
            rogue_key: generate_signing_key(),
            lease_secs,
            offer_timeout,
            token_ttl: Duration::from_secs(3600),
            faults: Faults::default(),
            bootstrap_tokens: HashSet::new(),
            install_tokens: HashMap::new(),
            runners: BTreeMap::new(),
            challenges: HashMap::new(),
            tokens: HashMap::new(),
            jobs: BTreeMap::new(),
            job_order: Vec::new(),
            deliveries: HashMap::new(),
            queue: VecDeque::new(),
            requests: BTreeMap::new(),
            audit: HashMap::new(),
            releases: BTreeMap::new(),
            registry_tokens: None,
        }
    }

    /// `GET /admin/grants`: which grant was used by which runner, and when.
    pub fn grant_report(&self) -> serde_json::Value {
        let Some(tokens) = &self.registry_tokens else {
            return serde_json::json!({"grants": [], "exchanges": []});
        };
        let grants: Vec<serde_json::Value> = tokens
            .grants()
            .into_iter()
            .map(|(sha256, g)| {
                let runner = self.jobs.get(&g.job_id).and_then(|j| j.claimed_by.clone());
                serde_json::json!({"grant_sha256": sha256, "runner": runner, "grant": g})
            })
            .collect();
        serde_json::json!({"grants": grants, "exchanges": tokens.exchanges()})
    }

    /// `"source_grant": {"ttl_secs": N}` in a job's spec: a one-time grant minted for
    /// this job, bound to its source's repository and digest, in its place as the
    /// source credential.
    fn mint_source_grant(&self, job_id: &str, spec: &mut serde_json::Value) -> Result<(), CpError> {
        let Some(asked) = spec.as_object_mut().and_then(|o| o.remove("source_grant")) else { return Ok(()) };
        let tokens = self.registry_tokens.as_ref().ok_or_else(|| {
            CpError::BadRequest("source_grant: this control plane runs no registry token service".into())
        })?;
        let source = spec["source"].as_str().unwrap_or_default().to_string();
        let (name, digest) = source
            .split_once('@')
            .ok_or_else(|| CpError::BadRequest(format!("source_grant: source {source:?} names no digest")))?;
        let path = name.split_once('/').map(|(_, p)| p).unwrap_or_default();
        // `repo[:tag]`: a tag's colon comes after the last slash.
        let repository = match path.rsplit_once(':') {
            Some((repo, tag)) if !tag.contains('/') => repo,
            _ => path,
        };
        let ttl = asked["ttl_secs"].as_i64().unwrap_or(300);
        let grant = tokens.mint(job_id, &self.install_id, repository, digest, ttl);
        spec["source_credential"] = serde_json::json!({
            "username": crate::grants::GRANT_USER, "token": grant, "expires_at": unix_now() + ttl,
        });
        Ok(())
    }

    pub fn new_bootstrap_token(&mut self) -> String {
        let t = format!("bt-{}", random_hex(24));
        self.bootstrap_tokens.insert(t.clone());
        t
    }

    /// A token for an install stack of `runners` instances (an Auto Scaling group): it
    /// enrolls each new instance, replacements included, as long as fewer than
    /// `runners` of the runners it enrolled are still serving (not retired).
    pub fn new_install_token(&mut self, runners: usize) -> String {
        let t = format!("bt-{}", random_hex(24));
        self.install_tokens.insert(t.clone(), runners.max(1));
        t
    }

    pub fn enroll(
        &mut self,
        token: &str,
        public_key: VerifyingKey,
        hostname: String,
    ) -> Result<String, CpError> {
        let install_token = if self.bootstrap_tokens.remove(token) {
            None
        } else if let Some(&places) = self.install_tokens.get(token) {
            let serving = self
                .runners
                .values()
                .filter(|r| !r.retired && r.install_token.as_deref() == Some(token))
                .count();
            if serving >= places {
                return Err(CpError::Unauthorized(
                    "bootstrap token: all the install's runners are serving (a replacement enrolls once one is retired)",
                ));
            }
            Some(token.to_string())
        } else {
            return Err(CpError::Unauthorized("bootstrap token unknown or already used"));
        };
        let runner_id = format!("rn-{}", random_hex(8));
        self.runners.insert(
            runner_id.clone(),
            Runner { public_key, hostname, last_poll: None, polls: 0, install_token, retired: false },
        );
        Ok(runner_id)
    }

    /// The runner leaves the install: refused from now on, its place free. What it
    /// still held may go to another runner at once: a runner retires itself only once
    /// drained (what it could not finish stopped), and the vendor only for one that is
    /// gone.
    pub fn retire(&mut self, runner_id: &str) -> Result<(), CpError> {
        let runner = self.runners.get_mut(runner_id).ok_or_else(|| CpError::NotFound(runner_id.into()))?;
        runner.retired = true;
        self.tokens.retain(|_, (owner, _)| owner != runner_id);
        let now = Instant::now();
        for job in self.jobs.values_mut() {
            if job.claimed_by.as_deref() == Some(runner_id) && job.result.is_none() {
                job.released = true;
                job.lease_until = Some(now);
            }
        }
        Ok(())
    }

    pub fn challenge(&mut self, runner_id: &str) -> Result<String, CpError> {
        match self.runners.get(runner_id) {
            None => return Err(CpError::Unauthorized("unknown runner")),
            Some(r) if r.retired => return Err(CpError::Unauthorized("runner retired")),
            Some(_) => {}
        }
        let now = Instant::now();
        self.challenges.retain(|_, (_, exp)| *exp > now);
        let c = random_hex(32);
        self.challenges.insert(c.clone(), (runner_id.to_string(), now + Duration::from_secs(60)));
        Ok(c)
    }

    pub fn token(&mut self, runner_id: &str, challenge: &str, signature: &str) -> Result<String, CpError> {
        let Some((owner, exp)) = self.challenges.remove(challenge) else {
            return Err(CpError::Unauthorized("challenge unknown, used or expired"));
        };
        if owner != runner_id || exp < Instant::now() {
            return Err(CpError::Unauthorized("challenge unknown, used or expired"));
        }
        let runner = self.runners.get(runner_id).ok_or(CpError::Unauthorized("unknown runner"))?;
        if !byoc_protocol::verify_challenge(&runner.public_key, challenge, signature) {
            return Err(CpError::Unauthorized("challenge signature does not verify"));
        }
        let now = Instant::now();
        self.tokens.retain(|_, (_, exp)| *exp > now);
        let t = format!("at-{}", random_hex(32));
        self.tokens.insert(t.clone(), (runner_id.to_string(), now + self.token_ttl));
        Ok(t)
    }

    pub fn authenticate(&self, token: &str) -> Result<String, CpError> {
        match self.tokens.get(token) {
            Some((runner, exp)) if *exp > Instant::now() => Ok(runner.clone()),
            _ => Err(CpError::Unauthorized("access token unknown or expired")),
        }
    }

    pub fn count_request(&mut self, what: &str) {
        *self.requests.entry(what.to_string()).or_default() += 1;
    }

    fn only_runner(&self) -> Result<String, CpError> {
        let mut ids = self.runners.iter().filter(|(_, r)| !r.retired).map(|(id, _)| id);
        match (ids.next(), ids.next()) {
            (Some(id), None) => Ok(id.clone()),
            (None, _) => Err(CpError::BadRequest("no runner enrolled yet".into())),
            _ => Err(CpError::BadRequest("several runners enrolled: name runner_id".into())),
        }
    }

    pub fn enqueue(&mut self, req: EnqueueRequest) -> Result<String, CpError> {
        let target = match &req.runner_id {
            Some(r) => r.clone(),
            None => self.only_runner()?,
        };
        let t = &req.tamper;
        let job_id = t.job_id.clone().unwrap_or_else(|| format!("job-{}", random_hex(8)));
        let nonce = t.nonce.clone().unwrap_or_else(|| random_hex(16));
        let now = unix_now();
        let mut spec = req.spec.clone();
        self.mint_source_grant(&job_id, &mut spec)?;
        if t.oversize {
            spec = serde_json::json!({ "padding": "x".repeat(byoc_protocol::MAX_PAYLOAD_BYTES + 1) });
        }
        let payload = JobPayload {
            job_id: job_id.clone(),
            runner_id: t.payload_runner_id.clone().unwrap_or_else(|| target.clone()),
            install_id: t.payload_install_id.clone().unwrap_or_else(|| self.install_id.clone()),
            issued_at: now + t.issued_offset_secs.unwrap_or(0),
            expires_at: now + t.expires_offset_secs.unwrap_or(req.ttl_secs),
            nonce: nonce.clone(),
            attempt: 1,
            kind: req.kind.clone(),
            operation: req.operation.clone(),
            entity: req.entity.clone(),
            requested_role: req.requested_role.clone(),
            timeout_secs: req.timeout_secs,
            spec,
            app_config: req.app_config.clone(),
            role_request: req.role_request.clone(),
        };
        let bytes = if t.malformed {
            b"{\"this is\": not a payload".to_vec()
        } else {
            serde_json::to_vec(&payload).map_err(|e| CpError::BadRequest(e.to_string()))?
        };
        let key = if t.unknown_key { &self.rogue_key } else { &self.signing_key };
        let mut envelope = JobEnvelope::sign_bytes(&bytes, key);
        if t.bad_signature {
            let mut sig = byoc_protocol::unb64("signature", &envelope.signature)
                .map_err(|e| CpError::BadRequest(e.to_string()))?;
            sig[0] ^= 0xff;
            envelope.signature = byoc_protocol::b64(&sig);
        }
        let group = byoc_protocol::job_group(&req.kind);
        if let Some(existing) = self.jobs.get(&job_id) {
            // A deliberate re-use of a job id (replay test): deliver again, keep the record.
            let _ = existing;
        } else {
            self.jobs.insert(
                job_id.clone(),
                Job {
                    job_id: job_id.clone(),
                    kind: req.kind.clone(),
                    nonce,
                    state: JobState::Pending,
                    enqueued_ms: unix_ms(),
                    offered_at: None,
                    claimed_by: None,
                    cancel_requested: false,
                    log: Vec::new(),
                    earlier_logs: Vec::new(),
                    log_hasher: sha2::Sha256::default(),
                    result: None,
                    rejections: Vec::new(),
                    result_posts: 0,
                    claims: 0,
                    heartbeats: 0,
                    log_416s: 0,
                    waiting: None,
                    waited: Vec::new(),
                    payload: (!t.malformed && !t.bad_signature && !t.unknown_key).then(|| payload.clone()),
                    group,
                    epoch: 1,
                    lease_until: None,
                    leases: Vec::new(),
                    fenced: Vec::new(),
                    released: false,
                    lease_bound: false,
                },
            );
            self.job_order.push(job_id.clone());
        }
        let delivery_id = format!("dl-{}", random_hex(8));
        self.deliveries.insert(
            delivery_id.clone(),
            Delivery { job_id: job_id.clone(), target_runner: target, group, envelope },
        );
        self.queue.push_back(delivery_id);
        Ok(job_id)
    }

    /// Deliver the exact envelope of an earlier job again (a replay).
    pub fn redeliver(&mut self, job_id: &str) -> Result<(), CpError> {
        let original = self
            .deliveries
            .values()
            .find(|d| d.job_id == job_id)
            .ok_or_else(|| CpError::NotFound(job_id.into()))?;
        let copy = Delivery {
            job_id: original.job_id.clone(),
            target_runner: original.target_runner.clone(),
            group: original.group,
            envelope: original.envelope.clone(),
        };
        let id = format!("dl-{}", random_hex(8));
        self.deliveries.insert(id.clone(), copy);
        self.queue.push_back(id);
        Ok(())
    }

    /// Test support: the runner took this delivery and its claim arrived, but the runner
    /// died before it heard the answer. Returns the delivery id.
    pub fn simulate_lost_claim_answer(&mut self, job_id: &str) -> Result<String, CpError> {
        let (id, target) = self
            .deliveries
            .iter()
            .find(|(_, d)| d.job_id == job_id)
            .map(|(id, d)| (id.clone(), d.target_runner.clone()))
            .ok_or_else(|| CpError::NotFound(job_id.into()))?;
        self.queue.retain(|q| *q != id);
        let job = self.jobs.get_mut(job_id).ok_or_else(|| CpError::NotFound(job_id.into()))?;
        job.state = JobState::Claimed;
        job.claimed_by = Some(target);
        job.claims += 1;
        Ok(id)
    }

    pub fn record_poll(&mut self, runner_id: &str, poll: &PollRequest) {
        if let Some(r) = self.runners.get_mut(runner_id) {
            r.last_poll = Some(poll.clone());
            r.polls += 1;
        }
    }

    /// Take the next delivery for this runner whose group has a free slot. Offers that
    /// were never claimed or rejected go back to the queue after `offer_timeout`.
    pub fn next_delivery(
        &mut self,
        runner_id: &str,
        free_groups: &[String],
    ) -> Option<(String, JobEnvelope)> {
        let now = Instant::now();
        self.lease_anew_to(runner_id, now);
        for job in self.jobs.values_mut() {
            if job.state == JobState::Offered
                && job.offered_at.is_some_and(|t| now.duration_since(t) > self.offer_timeout)
            {
                job.state = JobState::Pending;
                if let Some((id, _)) = self.deliveries.iter().find(|(_, d)| d.job_id == job.job_id) {
                    // Re-offer the same envelope: a runner that saw it but crashed before
                    // claiming may accept the identical delivery again.
                    self.queue.push_back(id.clone());
                }
            }
        }
        let pos = self.queue.iter().position(|id| {
            self.deliveries.get(id).is_some_and(|d| {
                d.target_runner == runner_id
                    && free_groups.iter().any(|g| g == d.group)
                    && self
                        .jobs
                        .get(&d.job_id)
                        .is_none_or(|j| !j.cancel_requested || j.state != JobState::Pending)
            })
        })?;
        let id = self.queue.remove(pos)?;
        let d = self.deliveries.get(&id)?;
        if let Some(job) = self.jobs.get_mut(&d.job_id)
            && job.state == JobState::Pending
        {
            job.state = JobState::Offered;
            job.offered_at = Some(now);
        }
        Some((id, d.envelope.clone()))
    }

    /// Jobs whose lease ran out on another runner of the install (no heartbeat for
    /// `lease_secs`) are offered to `runner_id` under a new epoch: a new envelope, signed
    /// for it, with a new nonce. The first runner's requests are fenced from now on.
    fn lease_anew_to(&mut self, runner_id: &str, now: Instant) {
        let mut fresh = Vec::new();
        for job in self.jobs.values_mut() {
            let expired = job.state == JobState::Claimed
                && job.result.is_none()
                && !job.cancel_requested
                && job.claimed_by.as_deref().is_some_and(|r| r != runner_id)
                // Never back to a runner that held it: it was fenced and has settled it.
                && !job.leases.iter().any(|(r, _)| r == runner_id)
                && job.lease_until.is_some_and(|t| now >= t)
                && job.reofferable();
            let Some(payload) = job.payload.as_ref().filter(|_| expired) else { continue };
            let ttl = payload.expires_at - payload.issued_at;
            let issued = unix_now();
            let payload = JobPayload {
                runner_id: runner_id.to_string(),
                nonce: random_hex(16),
                attempt: payload.attempt + 1,
                issued_at: issued,
                expires_at: issued + ttl,
                ..payload.clone()
            };
            let Ok(bytes) = serde_json::to_vec(&payload) else { continue };
            job.earlier_logs.push((job.epoch, std::mem::take(&mut job.log)));
            job.log_hasher = sha2::Sha256::default();
            job.epoch += 1;
            job.lease_bound = false;
            job.claimed_by = None;
            job.lease_until = None;
            job.state = JobState::Offered;
            job.offered_at = Some(now);
            job.nonce = payload.nonce.clone();
            fresh.push((job.job_id.clone(), job.group, JobEnvelope::sign_bytes(&bytes, &self.signing_key)));
        }
        for (job_id, group, envelope) in fresh {
            let id = format!("dl-{}", random_hex(8));
            self.deliveries.insert(
                id.clone(),
                Delivery { job_id, target_runner: runner_id.to_string(), group, envelope },
            );
            self.queue.push_front(id);
        }
    }

    /// The vendor says the runner holding the job has stopped: its lease ends now and
    /// the job may go to another runner of the install, whatever it does.
    pub fn release_lease(&mut self, job_id: &str) -> Result<(), CpError> {
        let job = self.jobs.get_mut(job_id).ok_or_else(|| CpError::NotFound(job_id.into()))?;
        job.released = true;
        job.lease_until = Some(Instant::now());
        Ok(())
    }

    fn delivery_job(&self, delivery_id: &str, runner_id: &str) -> Result<String, CpError> {
        let d = self
            .deliveries
            .get(delivery_id)
            .ok_or_else(|| CpError::NotFound(format!("delivery {delivery_id}")))?;
        if d.target_runner != runner_id {
            return Err(CpError::NotFound(format!("delivery {delivery_id}")));
        }
        Ok(d.job_id.clone())
    }

    pub fn reject(
        &mut self,
        runner_id: &str,
        delivery_id: &str,
        reason: RejectReason,
        detail: String,
    ) -> Result<(), CpError> {
        let job_id = self.delivery_job(delivery_id, runner_id)?;
        let job = self.jobs.get_mut(&job_id).ok_or_else(|| CpError::NotFound(job_id.clone()))?;
        job.rejections.push((reason, detail));
        // A runner may also refuse a job it claimed but never started: one that
        // expired while it waited for the customer's maintenance window.
        let claimed_unfinished = job.state == JobState::Claimed
            && job.claimed_by.as_deref() == Some(runner_id)
            && job.result.is_none();
        if matches!(job.state, JobState::Pending | JobState::Offered) || claimed_unfinished {
            job.state = JobState::Rejected;
            job.waiting = None;
        }
        Ok(())
    }

    /// The lease's seconds and fencing epoch.
    /// `offer`: the runner can hold the job to its lease; taken when another runner of
    /// the install could take the job over. Answers (lease secs, epoch, bound).
    pub fn claim(
        &mut self,
        runner_id: &str,
        job_id: &str,
        delivery_id: &str,
        offer: bool,
    ) -> Result<(u64, u64, bool), CpError> {
        if self.delivery_job(delivery_id, runner_id)? != job_id {
            return Err(CpError::BadRequest("delivery is for another job".into()));
        }
        let lease = self.lease_secs;
        let bound = offer && self.runners.values().filter(|r| !r.retired).count() > 1;
        let job = self.jobs.get_mut(job_id).ok_or_else(|| CpError::NotFound(job_id.into()))?;
        job.claims += 1;
        match job.state {
            _ if job.cancel_requested && job.claimed_by.is_none() => {
                job.state = JobState::Finished;
                Err(CpError::Conflict("job was cancelled before it was claimed".into()))
            }
            // An old delivery to a runner whose lease was given away.
            JobState::Offered | JobState::Pending if job.leases.iter().any(|(r, _)| r == runner_id) => Err(
                CpError::Fenced(format!("job {job_id} was leased to another runner (epoch {})", job.epoch)),
            ),
            JobState::Offered | JobState::Pending => {
                job.state = JobState::Claimed;
                job.claimed_by = Some(runner_id.to_string());
                job.lease_until = Some(Instant::now() + Duration::from_secs(lease));
                job.leases.push((runner_id.to_string(), job.epoch));
                job.lease_bound = bound;
                Ok((lease, job.epoch, bound))
            }
            // A retried claim whose first answer was lost.
            JobState::Claimed if job.claimed_by.as_deref() == Some(runner_id) => {
                Ok((lease, job.epoch, job.lease_bound))
            }
            s => Err(CpError::Conflict(format!("job is {s:?}"))),
        }
    }

    /// The job under this runner's lease. `epoch`: the one the runner claims under
    /// (`None` from a runner that predates fencing); a lease given away since is fenced.
    fn claimed_job(
        &mut self,
        runner_id: &str,
        job_id: &str,
        epoch: Option<u64>,
        what: &str,
    ) -> Result<&mut Job, CpError> {
        let job = self.jobs.get_mut(job_id).ok_or_else(|| CpError::NotFound(job_id.into()))?;
        let held = job.claimed_by.as_deref() == Some(runner_id) && epoch.is_none_or(|e| e == job.epoch);
        if !held {
            let had = job.leases.iter().find(|(r, e)| r == runner_id && epoch.is_none_or(|x| x == *e));
            if let Some((_, old)) = had {
                let old = *old;
                // The epoch the request carried (0: none), as evidence of what it claimed.
                job.fenced.push((runner_id.to_string(), epoch.unwrap_or(0), what.to_string()));
                return Err(CpError::Fenced(format!(
                    "job {job_id}: the lease of epoch {old} was given to another runner (epoch {})",
                    job.epoch
                )));
            }
            return Err(CpError::Conflict("job is not claimed by this runner".into()));
        }
        Ok(job)
    }

    pub fn heartbeat(
        &mut self,
        runner_id: &str,
        job_id: &str,
        epoch: Option<u64>,
        waiting: Option<byoc_protocol::JobWaiting>,
    ) -> Result<(u64, bool), CpError> {
        let lease = self.lease_secs;
        let job = self.claimed_job(runner_id, job_id, epoch, "heartbeat")?;
        job.heartbeats += 1;
        job.lease_until = Some(Instant::now() + Duration::from_secs(lease));
        if let Some(w) = &waiting
            && job.waited.last() != Some(w)
        {
            job.waited.push(w.clone());
        }
        job.waiting = waiting;
        Ok((lease, job.cancel_requested))
    }

    pub fn append_log(
        &mut self,
        runner_id: &str,
        job_id: &str,
        epoch: Option<u64>,
        offset: u64,
        bytes: &[u8],
    ) -> Result<u64, CpError> {
        let job = self.claimed_job(runner_id, job_id, epoch, "log")?;
        let have = job.log.len() as u64;
        if offset != have {
            job.log_416s += 1;
            return Err(CpError::LogOffset { server_offset: have });
        }
        if job.result.is_some() && !bytes.is_empty() {
            return Err(CpError::Conflict("log is sealed by the job's result".into()));
        }
        job.log.extend_from_slice(bytes);
        sha2::Digest::update(&mut job.log_hasher, bytes);
        Ok(job.log.len() as u64)
    }

    /// Returns true when this exact result was already recorded (an idempotent retry).
    pub fn result(
        &mut self,
        runner_id: &str,
        job_id: &str,
        epoch: Option<u64>,
        result: JobResult,
    ) -> Result<bool, CpError> {
        let job = self.claimed_job(runner_id, job_id, epoch, "result")?;
        job.result_posts += 1;
        if let Some(existing) = &job.result {
            if *existing == result {
                return Ok(true);
            }
            return Err(CpError::Conflict("a different result was already recorded".into()));
        }
        if result.log_size != job.log.len() as u64 || result.log_sha256 != log_digest(job) {
            return Err(CpError::Conflict(format!(
                "log mismatch: server has {} bytes; upload the rest before the result",
                job.log.len()
            )));
        }
        job.result = Some(result);
        job.state = JobState::Finished;
        job.waiting = None;
        Ok(false)
    }

    pub fn cancel(&mut self, job_id: &str) -> Result<(), CpError> {
        let job = self.jobs.get_mut(job_id).ok_or_else(|| CpError::NotFound(job_id.into()))?;
        job.cancel_requested = true;
        Ok(())
    }

    /// Check new audit records and the runner's checkpoint, then cosign it: records
    /// continue exactly from what was acknowledged, the checkpoint is signed by the
    /// runner's identity key, its root is the tree of every record received, and the
    /// consistency proof links it to the previous acknowledged checkpoint.
    pub fn audit_upload(
        &mut self,
        runner_id: &str,
        req: byoc_protocol::AuditUploadRequest,
    ) -> Result<byoc_protocol::AuditUploadResponse, CpError> {
        use byoc_audit::{merkle, note};
        let key = self.runners.get(runner_id).ok_or(CpError::Unauthorized("unknown runner"))?.public_key;
        let copy = self.audit.entry(runner_id.to_string()).or_default();
        let acked = copy.leaves.len() as u64;
        if req.from > acked {
            return Err(CpError::Conflict(format!("acknowledged size is {acked}, not {}", req.from)));
        }
        // A runner that lost our last answer (killed before storing the cosignature)
        // sends from an older size: the overlap must be byte-identical.
        let mut frontier = copy.frontier.clone();
        let mut fresh = Vec::new();
        for (i, line) in req.records.iter().enumerate() {
            let idx = req.from + i as u64;
            let r: byoc_audit::log::Record =
                serde_json::from_str(line).map_err(|e| CpError::BadRequest(format!("record {idx}: {e}")))?;
            if r.seq != idx {
                return Err(CpError::BadRequest(format!("record {idx} carries seq {}", r.seq)));
            }
            let h = merkle::leaf_hash(line.as_bytes());
            if idx < acked {
                if copy.leaves[idx as usize] != h {
                    return Err(CpError::Conflict(format!("record {idx} differs from the one acknowledged")));
                }
            } else {
                frontier.push(h);
                fresh.push(h);
            }
        }
        // Signed under its origin's name, or as logs written before were.
        let names =
            [format!("byoc-runner/{}/{runner_id}", self.install_id), format!("byoc-runner/{runner_id}")];
        let cp = note::open(&req.checkpoint, &[(&names[0], &key)])
            .or_else(|_| note::open(&req.checkpoint, &[(&names[1], &key)]))
            .map_err(|e| CpError::BadRequest(format!("checkpoint: {e}")))?;
        if cp.size != frontier.size() || cp.root != frontier.root() {
            return Err(CpError::BadRequest("checkpoint does not match the records".into()));
        }
        let proof: Vec<merkle::Hash> = req
            .proof
            .iter()
            .map(|h| byoc_protocol::unb64("proof", h).ok().and_then(|b| b.try_into().ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| CpError::BadRequest("bad proof hash".into()))?;
        let from = req.from;
        let root_at_from =
            if from == acked { copy.frontier.root() } else { merkle::root(&copy.leaves[..from as usize]) };
        if from > 0 && !merkle::verify_consistency(from, cp.size, &root_at_from, &cp.root, &proof) {
            return Err(CpError::BadRequest("consistency proof does not verify".into()));
        }
        copy.leaves.extend(fresh);
        copy.frontier = frontier;
        let skip = (acked - from) as usize;
        copy.records.extend(req.records.into_iter().skip(skip));
        let cosigned =
            note::cosign(&req.checkpoint, byoc_audit::log::CONTROL_PLANE_KEY_NAME, &self.signing_key)
                .map_err(|e| CpError::BadRequest(e.to_string()))?;
        Ok(byoc_protocol::AuditUploadResponse { cosigned })
    }

    /// How many audit records of this runner were acknowledged.
    pub fn audit_size(&self, runner_id: &str) -> u64 {
        self.audit.get(runner_id).map(|a| a.leaves.len() as u64).unwrap_or(0)
    }

    pub fn view(&self, job_id: &str) -> Option<JobView> {
        let j = self.jobs.get(job_id)?;
        let started_ms = j.result.as_ref().and_then(|r| r.started_at_ms);
        let finished_ms = j.result.as_ref().and_then(|r| r.finished_at_ms);
        Some(JobView {
            job_id: j.job_id.clone(),
            kind: j.kind.clone(),
            state: j.state,
            nonce: j.nonce.clone(),
            cancel_requested: j.cancel_requested,
            result: j.result.clone(),
            rejections: j.rejections.clone(),
            log_size: j.log.len() as u64,
            log_sha256: log_digest(j),
            result_posts: j.result_posts,
            claims: j.claims,
            heartbeats: j.heartbeats,
            log_416s: j.log_416s,
            waiting: j.waiting.clone(),
            waited: j.waited.clone(),
            claimed_by: j.claimed_by.clone(),
            epoch: j.epoch,
            leases: j.leases.clone(),
            lease_bound: j.lease_bound,
            fenced: j.fenced.clone(),
            pickup_ms: started_ms.map(|s| s.saturating_sub(j.enqueued_ms)),
            duration_ms: started_ms.zip(finished_ms).map(|(s, f)| f.saturating_sub(s)),
        })
    }

    pub fn log(&self, job_id: &str) -> Option<Vec<u8>> {
        self.jobs.get(job_id).map(|j| j.log.clone())
    }

    /// The logs of the job's earlier leases, (epoch, bytes), oldest first.
    pub fn earlier_logs(&self, job_id: &str) -> Vec<(u64, Vec<u8>)> {
        self.jobs.get(job_id).map(|j| j.earlier_logs.clone()).unwrap_or_default()
    }

    pub fn jobs(&self) -> Vec<JobView> {
        self.job_order.iter().filter_map(|id| self.view(id)).collect()
    }

    pub fn publish_release(&mut self, release: Release) -> Result<(), CpError> {
        if release.version.is_empty() || !release.reference.contains("@sha256:") {
            return Err(CpError::BadRequest("a release names its version and its artifact by digest".into()));
        }
        self.releases.insert(release.version.clone(), release);
        Ok(())
    }

    pub fn releases(&self) -> Vec<Release> {
        self.releases.values().cloned().collect()
    }

    /// Enqueue a `runner.update` of a published release for `runner_id`.
    pub fn update_runner(&mut self, runner_id: &str, req: UpdateRunner) -> Result<String, CpError> {
        let release = self
            .releases
            .get(&req.version)
            .cloned()
            .ok_or_else(|| CpError::NotFound(format!("release {}", req.version)))?;
        let mut spec = serde_json::json!({"release": release.reference, "version": release.version});
        if let Some(min) = &release.min_rollback_version {
            spec["min_rollback_version"] = min.clone().into();
        }
        if release.downgrade {
            spec["downgrade"] = true.into();
        }
        self.enqueue(EnqueueRequest {
            kind: "runner.update".into(),
            operation: "update".into(),
            entity: "runner".into(),
            spec,
            timeout_secs: 600,
            requested_role: req.requested_role,
            app_config: req.app_config,
            role_request: None,
            runner_id: Some(runner_id.to_string()),
            ttl_secs: default_ttl(),
            tamper: Tamper::default(),
        })
    }

    pub fn runners(&self) -> Vec<RunnerView> {
        self.runners
            .iter()
            .map(|(id, r)| RunnerView {
                runner_id: id.clone(),
                hostname: r.hostname.clone(),
                version: r.last_poll.as_ref().map(|p| p.version.clone()),
                pending_update: r.last_poll.as_ref().and_then(|p| p.pending_update.clone()),
                last_poll: r.last_poll.clone(),
                polls: r.polls,
                retired: r.retired,
            })
            .collect()
    }
}

#[cfg(test)]
mod audit_tests {
    use base64::Engine as _;
    use byoc_audit::log::{AuditWriter, Record};

    use super::*;

    fn request(w: &AuditWriter, from: u64, to: u64) -> byoc_protocol::AuditUploadRequest {
        byoc_protocol::AuditUploadRequest {
            from,
            records: w.read_lines(from, to).unwrap(),
            checkpoint: w.sign_at(to).unwrap(),
            proof: w
                .consistency_proof(from, to)
                .unwrap()
                .iter()
                .map(|h| base64::engine::general_purpose::STANDARD.encode(h))
                .collect(),
        }
    }

    fn append(w: &mut AuditWriter, n: usize) {
        for i in 0..n {
            w.append(Record { event: format!("e{i}"), ..Default::default() }).unwrap();
        }
    }

    #[test]
    fn uploads_extend_the_copy_and_a_resent_overlap_must_match() {
        let dir = tempfile::tempdir().unwrap();
        let key = generate_signing_key();
        let mut state = State::new("inst".into(), 60, Duration::from_secs(5));
        let token = state.new_bootstrap_token();
        let runner = state.enroll(&token, key.verifying_key(), "host".into()).unwrap();
        let (mut w, _) = AuditWriter::open(dir.path(), key, &runner, "inst", &[]).unwrap();
        append(&mut w, 5);
        let first = w.size();
        state.audit_upload(&runner, request(&w, 0, first)).unwrap();
        append(&mut w, 4);
        let second = w.size();
        state.audit_upload(&runner, request(&w, first, second)).unwrap();
        assert_eq!(state.audit_size(&runner), second);

        // A runner that lost the last answer sends again from an older size.
        state.audit_upload(&runner, request(&w, 3, second)).unwrap();
        assert_eq!(state.audit_size(&runner), second);
        let mut changed = request(&w, 3, second);
        changed.records[1] = changed.records[1].replace(":\"e", ":\"x");
        assert_ne!(changed.records[1], request(&w, 3, second).records[1]);
        assert!(matches!(state.audit_upload(&runner, changed), Err(CpError::Conflict(_))));

        // Records that do not make the signed checkpoint's tree, and a gap.
        append(&mut w, 2);
        let third = w.size();
        let mut short = request(&w, second, third);
        short.records.pop();
        assert!(matches!(state.audit_upload(&runner, short), Err(CpError::BadRequest(_))));
        let gap = request(&w, second + 1, third);
        assert!(matches!(state.audit_upload(&runner, gap), Err(CpError::Conflict(_))));
        state.audit_upload(&runner, request(&w, second, third)).unwrap();
        assert_eq!(state.audit_size(&runner), third);
    }
}

#[cfg(test)]
mod lease_tests {
    use super::*;

    fn two_runners(lease_secs: u64) -> (State, String, String) {
        let mut state = State::new("inst".into(), lease_secs, Duration::from_secs(5));
        let enroll = |s: &mut State| {
            let token = s.new_bootstrap_token();
            s.enroll(&token, generate_signing_key().verifying_key(), "host".into()).unwrap()
        };
        let a = enroll(&mut state);
        let b = enroll(&mut state);
        (state, a, b)
    }

    fn claimed_by(state: &mut State, runner: &str, kind: &str) -> String {
        let job = state
            .enqueue(EnqueueRequest {
                runner_id: Some(runner.into()),
                ..EnqueueRequest::new(kind, serde_json::json!({}))
            })
            .unwrap();
        let groups: Vec<String> = GROUPS.iter().map(|g| g.to_string()).collect();
        let (delivery, _) = state.next_delivery(runner, &groups).unwrap();
        assert_eq!(state.claim(runner, &job, &delivery, false).unwrap().1, 1, "the first lease's epoch");
        job
    }

    const GROUPS: [&str; 3] = ["actions", "deploys", "syncs"];

    fn offer_to(state: &mut State, runner: &str) -> Option<JobEnvelope> {
        let groups: Vec<String> = GROUPS.iter().map(|g| g.to_string()).collect();
        state.next_delivery(runner, &groups).map(|(_, e)| e)
    }

    #[test]
    fn an_expired_lease_goes_to_another_runner_under_a_higher_epoch_and_fences_the_first() {
        let (mut state, a, b) = two_runners(0);
        let job = claimed_by(&mut state, &a, "action.script");
        // The lease of 0 s has run out: B polls and is offered the job, signed for B.
        let envelope = offer_to(&mut state, &b).expect("offered to B");
        let bytes = byoc_protocol::unb64("payload", &envelope.payload).unwrap();
        let payload: JobPayload = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            (payload.job_id.as_str(), payload.runner_id.as_str(), payload.attempt),
            (job.as_str(), b.as_str(), 2)
        );
        // A's requests under epoch 1 are fenced from now on, before B even claims.
        assert!(matches!(state.heartbeat(&a, &job, Some(1), None), Err(CpError::Fenced(_))));
        let delivery =
            state.deliveries.iter().find(|(_, d)| d.target_runner == b).map(|(id, _)| id.clone()).unwrap();
        assert_eq!(state.claim(&b, &job, &delivery, false).unwrap(), (0, 2, false));
        // B's lease runs out too: it never goes back to A, which was fenced.
        assert!(offer_to(&mut state, &a).is_none());
        assert!(matches!(state.append_log(&a, &job, Some(1), 0, b"late"), Err(CpError::Fenced(_))));
        let result = JobResult {
            status: byoc_protocol::JobStatus::Succeeded,
            exit_code: Some(0),
            log_size: 0,
            log_sha256: hex::encode(sha2::Digest::finalize(sha2::Sha256::default())),
            log_omitted_bytes: 0,
            error: None,
            started_at_ms: None,
            finished_at_ms: None,
            outputs: serde_json::Value::Null,
        };
        assert!(matches!(state.result(&a, &job, Some(1), result.clone()), Err(CpError::Fenced(_))));
        // Without an epoch (a runner before fencing) A is refused too: it no longer holds it.
        assert!(matches!(state.result(&a, &job, None, result.clone()), Err(CpError::Fenced(_))));
        assert!(!state.result(&b, &job, Some(2), result).unwrap());
        let view = state.view(&job).unwrap();
        assert_eq!(view.leases, [(a.clone(), 1), (b.clone(), 2)]);
        let sent: Vec<u64> = view.fenced.iter().map(|(_, e, _)| *e).collect();
        assert_eq!(sent, [1, 1, 1, 0]);
    }

    #[test]
    fn a_live_lease_stays_and_a_change_waits_for_the_vendors_release() {
        let (mut state, a, b) = two_runners(60);
        let job = claimed_by(&mut state, &a, "action.script");
        assert!(offer_to(&mut state, &b).is_none(), "the lease has not run out");
        assert_eq!(state.heartbeat(&a, &job, Some(1), None).unwrap(), (60, false));

        let (mut state, a, b) = two_runners(0);
        let job = claimed_by(&mut state, &a, "terraform");
        assert!(offer_to(&mut state, &b).is_none(), "an apply is not leased anew on a timeout alone");
        state.release_lease(&job).unwrap();
        assert!(offer_to(&mut state, &b).is_some(), "the vendor said A stopped");
        // A lease that held the apply (A offered it, B exists) ends with A's processes.
        let (mut state, a, b) = two_runners(0);
        let job = state
            .enqueue(EnqueueRequest {
                runner_id: Some(a.clone()),
                ..EnqueueRequest::new("terraform", serde_json::json!({}))
            })
            .unwrap();
        let groups: Vec<String> = GROUPS.iter().map(|g| g.to_string()).collect();
        let (delivery, _) = state.next_delivery(&a, &groups).unwrap();
        assert_eq!(state.claim(&a, &job, &delivery, true).unwrap(), (0, 1, true));
        assert!(offer_to(&mut state, &b).is_some(), "its processes ended with the lease");
        // A lone runner's offer is not taken: nothing could take the job over.
        let mut lone = State::new("inst".into(), 0, Duration::from_secs(5));
        let token = lone.new_bootstrap_token();
        let only = lone.enroll(&token, generate_signing_key().verifying_key(), "host".into()).unwrap();
        let job = lone.enqueue(EnqueueRequest::new("terraform", serde_json::json!({}))).unwrap();
        let (delivery, _) = lone.next_delivery(&only, &groups).unwrap();
        assert_eq!(lone.claim(&only, &job, &delivery, true).unwrap(), (0, 1, false));
        // And never back to the runner whose lease it was, nor to it again on its poll.
        let (mut state, a, _) = two_runners(0);
        let _ = claimed_by(&mut state, &a, "action.script");
        assert!(offer_to(&mut state, &a).is_none());
    }

    #[test]
    fn an_install_token_enrolls_its_runners_and_each_replacement_once_one_retires() {
        let mut state = State::new("inst".into(), 60, Duration::from_secs(5));
        let token = state.new_install_token(2);
        let enroll = |s: &mut State| s.enroll(&token, generate_signing_key().verifying_key(), "host".into());
        let a = enroll(&mut state).unwrap();
        let _b = enroll(&mut state).unwrap();
        assert!(matches!(enroll(&mut state), Err(CpError::Unauthorized(_))), "both places are taken");
        // A holds a job when its instance goes: drained, it retires.
        let job = claimed_by(&mut state, &a, "terraform");
        state.retire(&a).unwrap();
        assert!(matches!(state.challenge(&a), Err(CpError::Unauthorized("runner retired"))));
        let c = enroll(&mut state).expect("the replacement takes A's place");
        // What A held goes to the replacement at once, an apply included.
        let envelope = offer_to(&mut state, &c).expect("offered to the replacement");
        let payload: JobPayload =
            serde_json::from_slice(&byoc_protocol::unb64("payload", &envelope.payload).unwrap()).unwrap();
        assert_eq!((payload.job_id, payload.runner_id), (job, c));
        assert!(state.runners().iter().any(|r| r.runner_id == a && r.retired));
        // A one-time token still enrolls once.
        let once = state.new_bootstrap_token();
        assert!(state.enroll(&once, generate_signing_key().verifying_key(), "h".into()).is_ok());
        assert!(state.enroll(&once, generate_signing_key().verifying_key(), "h".into()).is_err());
    }
}
