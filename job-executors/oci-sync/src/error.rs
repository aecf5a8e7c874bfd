//! Errors a sync can end with. Each names the side (source or destination) and the
//! registry, and has a stable reason code for results and audit records.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("{side} registry {registry} refused the credential for {what} (HTTP 401): {hint}")]
    Unauthorized { side: Side, registry: String, what: String, hint: String },
    #[error("{side} registry {registry} denied {what} (HTTP 403): the credential is not allowed to do this")]
    Forbidden { side: Side, registry: String, what: String },
    #[error("{side} registry {registry}: {what} not found (HTTP 404)")]
    NotFound { side: Side, registry: String, what: String },
    #[error("the {side} credential expired at unix time {at}: ask the control plane for a new sync job")]
    Expired { side: Side, at: i64 },
    #[error(
        "{what} from the {side} registry {registry} does not match its digest: expected {expected}, got {actual}; nothing was tagged"
    )]
    DigestMismatch { side: Side, registry: String, what: String, expected: String, actual: String },
    #[error("{side} registry {registry}: {what}: HTTP {status}: {body}")]
    Status { side: Side, registry: String, what: String, status: u16, body: String },
    #[error("{side} registry {registry}: {what}: {reason}")]
    Transport { side: Side, registry: String, what: String, reason: String },
    #[error("{what}: {reason}")]
    Invalid { what: String, reason: String },
    #[error("{what}: {reason}")]
    Aws { what: String, reason: String },
    #[error("{side} registry {registry}: {reason}")]
    Refused { side: Side, registry: String, reason: crate::reach::Refused },
    #[error("the sync was cancelled")]
    Cancelled,
    /// The source's token service refused the job's one-time grant (used before,
    /// expired, for another repository or scope): `GRANT_REFUSED` in its answer.
    #[error("{side} registry {registry}: its token service refused the job's grant: {reason}")]
    GrantRefused { side: Side, registry: String, reason: String },
}

impl SyncError {
    /// Stable reason code (results, audit records, `--output json`).
    pub fn code(&self) -> String {
        let sided = |side: &Side, what: &str| format!("{side}_{what}");
        match self {
            SyncError::Unauthorized { side, .. } => sided(side, "unauthorized"),
            SyncError::Forbidden { side, .. } => sided(side, "forbidden"),
            SyncError::NotFound { side, .. } => sided(side, "not_found"),
            SyncError::Expired { side, .. } => sided(side, "credential_expired"),
            SyncError::DigestMismatch { side, .. } => sided(side, "digest_mismatch"),
            SyncError::Status { side, .. } => sided(side, "http_error"),
            SyncError::Transport { side, .. } => sided(side, "unreachable"),
            SyncError::Invalid { .. } => "invalid_artifact".into(),
            SyncError::Aws { .. } => "ecr_error".into(),
            SyncError::Refused { .. } => "endpoint_refused".into(),
            SyncError::Cancelled => "cancelled".into(),
            SyncError::GrantRefused { side, .. } => sided(side, "grant_refused"),
        }
    }
}
