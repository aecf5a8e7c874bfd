//! The wire protocol between byoc-runner and the vendor's control plane.
//!
//! Both ends link this crate so the signing rules (domain-separated messages, key ids,
//! the exact bytes that are signed) cannot drift apart. See `docs/PROTOCOL.md`.

pub mod app_dir;
pub mod backoff;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use ed25519_dalek::{Signature, Signer as _, SigningKey, Verifier as _, VerifyingKey};
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// Prefix of every signed job payload, so a job signature can never be replayed as
/// any other kind of signature made with the same key (and vice versa).
pub const JOB_SIGNING_CONTEXT: &[u8] = b"byoc-runner/job/v1\n";
/// Prefix of the runner's signature over a server challenge.
pub const AUTH_SIGNING_CONTEXT: &[u8] = b"byoc-runner/auth/v1\n";
/// Largest decoded job payload the runner accepts.
pub const MAX_PAYLOAD_BYTES: usize = 256 * 1024;
/// Header carrying the byte offset of a log chunk (and the server's offset on a 416).
pub const LOG_OFFSET_HEADER: &str = "x-log-offset";
/// The fencing epoch of the runner's lease on a job (from its claim), on every
/// heartbeat, log upload and result: a control plane that gave the job to another runner
/// since refuses them as `fenced`.
pub const LEASE_EPOCH_HEADER: &str = "x-lease-epoch";
/// The error code (`{"error": "fenced", …}`, HTTP 409) of a request under a lease the
/// control plane has given to another runner.
pub const FENCED: &str = "fenced";

/// Job ids of the runner's own checks (drift checks it starts on the customer's
/// schedule or command). A control plane never issues them; a delivery using one is
/// refused.
pub const LOCAL_JOB_PREFIX: &str = "local-";

/// Entities and the operations each has (a role request's `entity_name.operation`);
/// `artifact.sync` is OCI artifact sync.
pub const OPERATIONS: &[(&str, &[&str])] = &[
    ("sandbox", &["provision", "reprovision", "deprovision"]),
    // `drift`: a check that never changes anything (docs/DRIFT.md).
    ("component", &["deploy", "teardown", "drift"]),
    ("action", &["trigger"]),
    ("artifact", &["sync"]),
    // `sync`: the customer's secrets written where the app config declares (docs/SECRETS.md).
    ("secret", &["sync"]),
    // `update`: the runner's own package replaced by a signed release (docs/OPERATIONS.md).
    ("runner", &["update"]),
];

pub fn known_operation(entity: &str, operation: &str) -> bool {
    OPERATIONS.iter().any(|(e, ops)| *e == entity && ops.contains(&operation))
}

/// What a job does, as the runner derives it from the job's kind and spec (never from a
/// label the vendor chose). Customer rules can match it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    /// Reads and decides, changes nothing (a plan, a drift check, a noop).
    Read,
    /// Creates or changes infrastructure or cluster objects (an apply, an upgrade, a
    /// secret written).
    Change,
    /// Deletes what a deploy made (`plan -destroy` applied, an uninstall, a delete).
    Destroy,
    /// Copies an artifact into the install's registry.
    Copy,
    /// Runs the vendor's code (a script, a container): what it does is not derived, and
    /// no plan is decided for it.
    Run,
    /// Replaces the runner itself with a signed release.
    Update,
}

impl Effect {
    pub const ALL: &'static [Effect] =
        &[Effect::Read, Effect::Change, Effect::Destroy, Effect::Copy, Effect::Run, Effect::Update];

    pub fn as_str(self) -> &'static str {
        match self {
            Effect::Read => "read",
            Effect::Change => "change",
            Effect::Destroy => "destroy",
            Effect::Copy => "copy",
            Effect::Run => "run",
            Effect::Update => "update",
        }
    }

    pub fn parse(s: &str) -> Option<Effect> {
        Effect::ALL.iter().copied().find(|e| e.as_str() == s)
    }

    /// The operations (`entity.operation`) a job with this effect may run as. Reading
    /// is harmless under any; a change is a provision or a deploy (or a secret's sync);
    /// a destruction is a deprovision or a teardown; a copy is an artifact sync; the
    /// vendor's code runs as an action or at a point of the lifecycle.
    pub fn operations(self) -> &'static [&'static str] {
        match self {
            Effect::Read => &[
                "sandbox.provision",
                "sandbox.reprovision",
                "sandbox.deprovision",
                "component.deploy",
                "component.teardown",
                "component.drift",
                "action.trigger",
                "artifact.sync",
                "secret.sync",
            ],
            Effect::Change => {
                &["sandbox.provision", "sandbox.reprovision", "component.deploy", "secret.sync"]
            }
            Effect::Destroy => &["sandbox.deprovision", "component.teardown"],
            Effect::Copy => &["artifact.sync"],
            Effect::Update => &["runner.update"],
            Effect::Run => &[
                "action.trigger",
                "sandbox.provision",
                "sandbox.reprovision",
                "sandbox.deprovision",
                "component.deploy",
                "component.teardown",
            ],
        }
    }

    /// Whether a job with this effect may run as `entity.operation`.
    pub fn allows(self, entity: &str, operation: &str) -> bool {
        let op = format!("{entity}.{operation}");
        self.operations().contains(&op.as_str())
    }
}

impl std::fmt::Display for Effect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The job kinds this protocol version defines. A runner rejects anything else
/// (`unknown_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    Noop,
    ActionScript,
    ActionContainer,
    Terraform,
    Helm,
    Kubernetes,
    OciSync,
    SecretsSync,
    RunnerUpdate,
}

impl JobKind {
    pub const ALL: [JobKind; 9] = [
        JobKind::Noop,
        JobKind::ActionScript,
        JobKind::ActionContainer,
        JobKind::Terraform,
        JobKind::Helm,
        JobKind::Kubernetes,
        JobKind::OciSync,
        JobKind::SecretsSync,
        JobKind::RunnerUpdate,
    ];

    pub fn parse(kind: &str) -> Option<JobKind> {
        JobKind::ALL.into_iter().find(|k| k.as_str() == kind)
    }

    /// The wire name (`kind` of the payload).
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Noop => "runner.noop",
            JobKind::ActionScript => "action.script",
            JobKind::ActionContainer => "action.container",
            JobKind::Terraform => "terraform",
            JobKind::Helm => "helm",
            JobKind::Kubernetes => "kubernetes",
            JobKind::OciSync => "oci.sync",
            JobKind::SecretsSync => "secrets.sync",
            JobKind::RunnerUpdate => "runner.update",
        }
    }

    /// Its concurrency group: jobs in different groups run side by side, each group has
    /// its own limit (deploys one at a time, actions and syncs alongside them).
    pub fn group(self) -> &'static str {
        match self {
            JobKind::Terraform | JobKind::Helm | JobKind::Kubernetes => "deploys",
            JobKind::OciSync | JobKind::SecretsSync | JobKind::RunnerUpdate => "syncs",
            JobKind::Noop | JobKind::ActionScript | JobKind::ActionContainer => "actions",
        }
    }

    /// Whether its changes are decided by policy before they are made.
    pub fn decided_by_policy(self) -> bool {
        matches!(self, JobKind::Terraform | JobKind::Helm | JobKind::Kubernetes)
    }
}

/// Concurrency group of a job kind (see [`JobKind::group`]); a kind this version does
/// not define is counted with the actions (it is rejected anyway).
pub fn job_group(kind: &str) -> &'static str {
    JobKind::parse(kind).map(JobKind::group).unwrap_or("actions")
}

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("invalid base64 in {field}")]
    Base64 { field: &'static str },
    #[error("invalid {field}: expected {expected} bytes, got {got}")]
    Length { field: &'static str, expected: usize, got: usize },
    #[error("invalid Ed25519 public key")]
    PublicKey,
}

pub fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

pub fn unb64(field: &'static str, s: &str) -> Result<Vec<u8>, ProtocolError> {
    B64.decode(s.as_bytes()).map_err(|_| ProtocolError::Base64 { field })
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Key id: the first 8 bytes of SHA-256 over the raw public key, hex.
pub fn key_id(key: &VerifyingKey) -> String {
    hex::encode(&Sha256::digest(key.as_bytes())[..8])
}

pub fn parse_public_key(b64_key: &str) -> Result<VerifyingKey, ProtocolError> {
    let raw = unb64("public_key", b64_key.trim())?;
    let arr: [u8; 32] = raw.as_slice().try_into().map_err(|_| ProtocolError::Length {
        field: "public_key",
        expected: 32,
        got: raw.len(),
    })?;
    VerifyingKey::from_bytes(&arr).map_err(|_| ProtocolError::PublicKey)
}

/// Generate a fresh Ed25519 key from the OS CSPRNG.
pub fn generate_signing_key() -> SigningKey {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).expect("OS random number generator unavailable");
    SigningKey::from_bytes(&seed)
}

/// Random bytes as lowercase hex (nonces, tokens, challenges).
pub fn random_hex(n: usize) -> String {
    let mut buf = vec![0u8; n];
    getrandom::fill(&mut buf).expect("OS random number generator unavailable");
    hex::encode(buf)
}

fn with_context(context: &[u8], msg: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(context.len() + msg.len());
    m.extend_from_slice(context);
    m.extend_from_slice(msg);
    m
}

/// What the control plane signs. Field order is fixed by this struct, but the runner
/// never re-serialises: it verifies the exact bytes it received, then parses them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobPayload {
    pub job_id: String,
    pub runner_id: String,
    pub install_id: String,
    /// Unix seconds.
    pub issued_at: i64,
    /// Unix seconds.
    pub expires_at: i64,
    pub nonce: String,
    pub attempt: u32,
    pub kind: String,
    pub operation: String,
    pub entity: String,
    #[serde(default)]
    pub requested_role: Option<String>,
    /// Wall-clock limit for the job, seconds.
    pub timeout_secs: u64,
    /// Executor-specific specification (see `job-executors`).
    #[serde(default)]
    pub spec: serde_json::Value,
    /// The app's role definitions and operation-role matrix, signed with the job. Needed
    /// when `requested_role` is set: the runner re-derives the role from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_config: Option<AppConfig>,
    /// The role inputs that belong to this job rather than the app (see docs/ROLES.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role_request: Option<RoleRequest>,
}

/// The app config files that decide roles, as the vendor wrote them (TOML text).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppConfig {
    /// Role files (`permissions/*.toml`: provision, maintenance, deprovision, custom),
    /// by file name.
    #[serde(default)]
    pub permissions: BTreeMap<String, String>,
    /// The single-file layout, `permissions.toml`: `[provision_role]`,
    /// `[maintenance_role]`, `[deprovision_role]`, `[[custom_roles]]` (or `[[roles]]`
    /// with a `type` each). An app uses it or `permissions/`, not both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions_toml: Option<String>,
    /// `break_glass.toml` (`[[role]]` entries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub break_glass: Option<String>,
    /// `operation_roles.toml`: defaults per operation and principal/operation rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_roles: Option<String>,
    /// The vendor's policies (Rego, conftest-compatible), by file name. They are
    /// evaluated with the built-in pack and the customer's own; they cannot switch
    /// either off.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub policies: BTreeMap<String, VendorPolicy>,
    /// `policies.toml` as the modelled system's app configs write it: `[[policy]]` with
    /// `type`, `engine`, `contents` (a path among `files`) and `components`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policies_toml: Option<String>,
    /// Files of the app config that declarations refer to by path (policy contents,
    /// role policies' `contents`, permissions boundaries), by path from the app's root.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, String>,
    /// `secrets.toml` (`[[secret]]` tables): the customer's secrets the install uses
    /// (docs/SECRETS.md). Only names and targets: values never travel in a job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets: Option<String>,
    /// One file per secret, by path under the app config (`secrets/<group>/<name>.toml`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secret_files: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VendorPolicy {
    pub rego: String,
    /// `mandatory` (default: violations deny) or `advisory` (they warn).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<String>,
}

/// Per-job role inputs, highest precedence first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleRequest {
    /// The entity's name (`api` of component `api`): principals are `entity:name`.
    #[serde(default)]
    pub entity_name: String,
    /// A role named when the job was triggered (honoured only if the customer enabled it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_override: Option<String>,
    /// The action's break-glass role (actions only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub break_glass_role: Option<String>,
    /// The role the entity's own config names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entity_role: Option<String>,
}

/// Signed job envelope as delivered by a poll.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobEnvelope {
    /// Base64 of the canonical payload bytes (JSON).
    pub payload: String,
    /// Base64 Ed25519 signature over `JOB_SIGNING_CONTEXT || payload bytes`.
    pub signature: String,
    pub key_id: String,
}

impl JobEnvelope {
    pub fn sign(payload: &JobPayload, key: &SigningKey) -> Self {
        let bytes = serde_json::to_vec(payload).expect("payload serialises");
        Self::sign_bytes(&bytes, key)
    }

    pub fn sign_bytes(bytes: &[u8], key: &SigningKey) -> Self {
        let sig = key.sign(&with_context(JOB_SIGNING_CONTEXT, bytes));
        JobEnvelope {
            payload: b64(bytes),
            signature: b64(&sig.to_bytes()),
            key_id: key_id(&key.verifying_key()),
        }
    }
}

/// Verify a job signature over the raw payload bytes.
pub fn verify_job_signature(key: &VerifyingKey, payload: &[u8], signature: &[u8]) -> bool {
    let Ok(sig) = Signature::from_slice(signature) else {
        return false;
    };
    key.verify(&with_context(JOB_SIGNING_CONTEXT, payload), &sig).is_ok()
}

pub fn sign_challenge(key: &SigningKey, challenge: &str) -> String {
    b64(&key.sign(&with_context(AUTH_SIGNING_CONTEXT, challenge.as_bytes())).to_bytes())
}

pub fn verify_challenge(key: &VerifyingKey, challenge: &str, signature_b64: &str) -> bool {
    let Ok(raw) = unb64("signature", signature_b64) else {
        return false;
    };
    let Ok(sig) = Signature::from_slice(&raw) else {
        return false;
    };
    key.verify(&with_context(AUTH_SIGNING_CONTEXT, challenge.as_bytes()), &sig).is_ok()
}

/// Why a runner refused a job. The string forms are the wire reason codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    MalformedEnvelope,
    OversizePayload,
    UnknownKey,
    BadSignature,
    WrongRunner,
    WrongInstall,
    Expired,
    NotYetValid,
    ReplayedNonce,
    AlreadyFinished,
    UnknownKind,
    InvalidSpec,
    /// The role the control plane proposed is not what the customer's chain yields.
    RoleMismatch,
    /// The role is switched off by the customer (or break-glass not switched on).
    RoleDisabled,
    /// The role is not defined, or the install stack has no ARN for it.
    RoleUnknown,
    /// The customer paused this runner.
    Paused,
    /// The job's network boundary cannot be built here (user-mode stack or TUN device
    /// missing): a networked job would run with less isolation than promised.
    SandboxNetworkUnavailable,
    /// The job's cgroup limits cannot be applied (and the customer requires them).
    SandboxLimitsUnavailable,
    /// A container job's output cannot be relayed to the runner (no static busybox):
    /// it would run unrecorded.
    ContainerOutputUnavailable,
    /// Free space on the runner's state dir is under the customer's threshold.
    DiskLow,
    /// The customer's maintenance windows do not allow this job now, and its rule
    /// refuses rather than waits.
    OutsideWindow,
    /// A local admin denied the approval the customer's rules require.
    ApprovalDenied,
    /// Nobody approved the job before its approval request expired.
    ApprovalExpired,
    /// The job would send a customer secret somewhere the app config does not declare
    /// for it (or names a secret the app config does not declare).
    SecretTargetNotDeclared,
    /// What the job does (its effect, derived by the runner from kind and spec) is not
    /// what its operation or the type of its role is for: a terraform apply labelled
    /// `action.trigger`, a deploy under a deprovision role, an unknown operation.
    OperationMismatch,
    /// A `runner.update` while the customer has updates switched off (`[update] mode`).
    UpdateDisabled,
    /// A `runner.update` to a version outside the customer's pin or range.
    UpdatePinned,
    /// A `runner.update` to a version not newer than the running one, without a
    /// downgrade the release signs.
    UpdateNotNewer,
    /// A terraform job names its own provider mirror where the customer's
    /// configuration does not allow one (`[terraform] job_provider_mirrors`).
    ProviderMirrorNotAllowed,
}

impl RejectReason {
    pub fn code(self) -> &'static str {
        match self {
            Self::MalformedEnvelope => "malformed_envelope",
            Self::OversizePayload => "oversize_payload",
            Self::UnknownKey => "unknown_key",
            Self::BadSignature => "bad_signature",
            Self::WrongRunner => "wrong_runner",
            Self::WrongInstall => "wrong_install",
            Self::Expired => "expired",
            Self::NotYetValid => "not_yet_valid",
            Self::ReplayedNonce => "replayed_nonce",
            Self::AlreadyFinished => "already_finished",
            Self::UnknownKind => "unknown_kind",
            Self::InvalidSpec => "invalid_spec",
            Self::RoleMismatch => "role_mismatch",
            Self::RoleDisabled => "role_disabled",
            Self::RoleUnknown => "role_unknown",
            Self::Paused => "paused",
            Self::SandboxNetworkUnavailable => "sandbox_network_unavailable",
            Self::SandboxLimitsUnavailable => "sandbox_limits_unavailable",
            Self::ContainerOutputUnavailable => "container_output_unavailable",
            Self::DiskLow => "disk_low",
            Self::OutsideWindow => "outside_window",
            Self::ApprovalDenied => "approval_denied",
            Self::ApprovalExpired => "approval_expired",
            Self::SecretTargetNotDeclared => "secret_target_not_declared",
            Self::OperationMismatch => "operation_mismatch",
            Self::UpdateDisabled => "update_disabled",
            Self::UpdatePinned => "update_pinned",
            Self::UpdateNotNewer => "update_not_newer",
            Self::ProviderMirrorNotAllowed => "provider_mirror_not_allowed",
        }
    }

    pub const ALL: &'static [RejectReason] = &[
        Self::MalformedEnvelope,
        Self::OversizePayload,
        Self::UnknownKey,
        Self::BadSignature,
        Self::WrongRunner,
        Self::WrongInstall,
        Self::Expired,
        Self::NotYetValid,
        Self::ReplayedNonce,
        Self::AlreadyFinished,
        Self::UnknownKind,
        Self::InvalidSpec,
        Self::RoleMismatch,
        Self::RoleDisabled,
        Self::RoleUnknown,
        Self::Paused,
        Self::SandboxNetworkUnavailable,
        Self::SandboxLimitsUnavailable,
        Self::ContainerOutputUnavailable,
        Self::DiskLow,
        Self::OutsideWindow,
        Self::ApprovalDenied,
        Self::ApprovalExpired,
        Self::SecretTargetNotDeclared,
        Self::OperationMismatch,
        Self::UpdateDisabled,
        Self::UpdatePinned,
        Self::UpdateNotNewer,
        Self::ProviderMirrorNotAllowed,
    ];
}

impl std::fmt::Display for RejectReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.code())
    }
}

// ---- request / response bodies -------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EnrollRequest {
    pub bootstrap_token: String,
    /// Base64 raw Ed25519 public key of the runner's identity.
    pub public_key: String,
    pub hostname: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EnrollResponse {
    pub runner_id: String,
    pub install_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChallengeRequest {
    pub runner_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChallengeResponse {
    pub challenge: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenRequest {
    pub runner_id: String,
    pub challenge: String,
    /// Base64 signature over `AUTH_SIGNING_CONTEXT || challenge`.
    pub signature: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenResponse {
    pub access_token: String,
    pub expires_in_secs: u64,
}

/// A poll also serves as the runner's heartbeat: it carries the runner's state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PollRequest {
    /// How long the server may hold the request, seconds (it caps this).
    pub wait_secs: u64,
    /// Job groups that have a free slot; the server only offers jobs of these groups.
    pub free_groups: Vec<String>,
    pub running_jobs: Vec<String>,
    pub draining: bool,
    pub version: String,
    /// A release staged for the updater and not yet applied or rolled back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_update: Option<String>,
    /// The customer paused this runner on the VM (it refuses new jobs with `paused`).
    #[serde(default)]
    pub paused: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PollResponse {
    /// Identifies this delivery (outside the signature) so a rejection can be
    /// addressed even when the payload cannot be parsed.
    pub delivery_id: String,
    pub envelope: JobEnvelope,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClaimRequest {
    pub delivery_id: String,
    /// The runner can hold the job to its lease: its processes are stopped, whatever
    /// becomes of the runner, before the lease ends unrenewed (a sandboxed process job
    /// on a runner whose sandbox is on).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lease_bound: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClaimResponse {
    pub lease_secs: u64,
    /// The lease's fencing epoch: higher each time the job is leased anew (to another
    /// runner after this one's lease expired). 0: a control plane without fencing.
    #[serde(default)]
    pub epoch: u64,
    /// Hold the job to its lease (only when the claim offered it): the lease may pass to
    /// another runner of the install once it runs out, whatever the job changes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lease_bound: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RejectRequest {
    pub reason: RejectReason,
    pub detail: String,
}

/// A job heartbeat's body: what the job is doing when it is not running yet.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobHeartbeatRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<JobWaiting>,
}

/// A claimed job held back by the customer's guardrails.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobWaiting {
    /// `waiting_window`.
    pub state: String,
    /// When the job can run (unix seconds), if known: the next window's start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<i64>,
    /// For people: which rule and window.
    pub detail: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobHeartbeatResponse {
    pub lease_secs: u64,
    /// The control plane asks the runner to cancel this job.
    pub cancel: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogAppendResponse {
    /// Server's log length after the append.
    pub offset: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    Succeeded,
    Failed,
    Cancelled,
    TimedOut,
    /// The runner died or restarted while the job ran; it was not re-run.
    Interrupted,
}

impl JobStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::TimedOut => "timed_out",
            Self::Interrupted => "interrupted",
        }
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobResult {
    pub status: JobStatus,
    pub exit_code: Option<i32>,
    pub log_size: u64,
    /// SHA-256 of the log as kept: with `log_omitted_bytes`, of the head, the omission
    /// marker and the tail.
    pub log_sha256: String,
    /// Output the runner did not keep because the job's log reached its cap
    /// (`jobs.log_max_mib`); 0: the log is complete.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub log_omitted_bytes: u64,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub outputs: serde_json::Value,
    /// When the runner started the job's process, Unix milliseconds (pickup latency).
    #[serde(default)]
    pub started_at_ms: Option<u64>,
    #[serde(default)]
    pub finished_at_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload() -> JobPayload {
        JobPayload {
            job_id: "j1".into(),
            runner_id: "r1".into(),
            install_id: "i1".into(),
            issued_at: 1,
            expires_at: 2,
            nonce: "n".into(),
            attempt: 1,
            kind: "runner.noop".into(),
            operation: "trigger".into(),
            entity: "action".into(),
            requested_role: None,
            timeout_secs: 10,
            spec: serde_json::Value::Null,
            app_config: None,
            role_request: None,
        }
    }

    #[test]
    fn envelope_signature_verifies_and_tampering_breaks_it() {
        let key = generate_signing_key();
        let env = JobEnvelope::sign(&payload(), &key);
        let bytes = unb64("payload", &env.payload).unwrap();
        let sig = unb64("signature", &env.signature).unwrap();
        assert!(verify_job_signature(&key.verifying_key(), &bytes, &sig));
        let mut tampered = bytes.clone();
        tampered[5] ^= 1;
        assert!(!verify_job_signature(&key.verifying_key(), &tampered, &sig));
        let other = generate_signing_key();
        assert!(!verify_job_signature(&other.verifying_key(), &bytes, &sig));
        assert_eq!(env.key_id, key_id(&key.verifying_key()));
    }

    #[test]
    fn job_signature_is_not_a_challenge_signature() {
        // Domain separation: a signed job must not double as an auth response.
        let key = generate_signing_key();
        let challenge = "abc";
        let env = JobEnvelope::sign_bytes(challenge.as_bytes(), &key);
        assert!(!verify_challenge(&key.verifying_key(), challenge, &env.signature));
        let auth = sign_challenge(&key, challenge);
        assert!(verify_challenge(&key.verifying_key(), challenge, &auth));
    }

    #[test]
    fn reason_codes_round_trip_through_serde() {
        for r in RejectReason::ALL {
            let s = serde_json::to_string(r).unwrap();
            assert_eq!(s, format!("\"{}\"", r.code()));
            let back: RejectReason = serde_json::from_str(&s).unwrap();
            assert_eq!(back, *r);
        }
    }

    #[test]
    fn groups_separate_deploys_from_actions() {
        for (kind, group) in [
            ("terraform", "deploys"),
            ("helm", "deploys"),
            ("kubernetes", "deploys"),
            ("action.script", "actions"),
            ("action.container", "actions"),
            ("runner.noop", "actions"),
            ("oci.sync", "syncs"),
            ("secrets.sync", "syncs"),
            ("no.such.kind", "actions"),
        ] {
            assert_eq!(job_group(kind), group, "{kind}");
        }
    }

    #[test]
    fn job_kinds_round_trip_and_know_what_policy_decides() {
        for k in JobKind::ALL {
            assert_eq!(JobKind::parse(k.as_str()), Some(k));
        }
        assert_eq!(JobKind::parse("terraform.apply"), None);
        let decided: Vec<&str> =
            JobKind::ALL.iter().filter(|k| k.decided_by_policy()).map(|k| k.as_str()).collect();
        assert_eq!(decided, ["terraform", "helm", "kubernetes"]);
    }
}

/// New audit records for the control plane to acknowledge (`POST /v1/audit`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AuditUploadRequest {
    /// The acknowledged size these records continue from.
    pub from: u64,
    /// Record lines exactly as in the runner's log (their bytes are the leaves).
    pub records: Vec<String>,
    /// The runner's signed checkpoint (C2SP signed note) at `from + records.len()`.
    pub checkpoint: String,
    /// Consistency proof (base64 hashes) from the acknowledged checkpoint to this one.
    pub proof: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AuditUploadResponse {
    /// The same checkpoint with the control plane's cosignature line added.
    pub cosigned: String,
}
