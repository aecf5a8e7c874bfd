//! Everything that talks to the vendor's control plane: the HTTP client (`client`),
//! the one retry/backoff helper every caller uses (`retry`), and the [`ControlPlane`]
//! trait the job's stages see, so each stage can be tested against a fake.

pub mod client;
pub mod local;
pub mod retry;

use std::future::Future;
use std::pin::Pin;

use byoc_protocol::{
    AuditUploadRequest, AuditUploadResponse, ClaimResponse, JobHeartbeatResponse, JobResult, JobWaiting,
    PollRequest, PollResponse, RejectReason,
};

pub use client::{ClientError, CpClient};
pub use retry::{Backoff, Retried, retry, sleep_unless_stopped};

pub type CpFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ClientError>> + Send + 'a>>;

/// The calls a job's path makes to the control plane once the runner is enrolled
/// (enrollment and the reachability probe stay on [`CpClient`]: they happen before any
/// stage runs). One method per endpoint; see docs/PROTOCOL.md.
pub trait ControlPlane: Send + Sync {
    /// Long poll. `Ok(None)` when the server held the request and had nothing.
    fn poll<'a>(&'a self, req: &'a PollRequest) -> CpFuture<'a, Option<PollResponse>>;
    /// Tell the control plane why a delivery was refused.
    fn reject<'a>(&'a self, delivery_id: &'a str, reason: RejectReason, detail: &'a str) -> CpFuture<'a, ()>;
    /// `lease_bound`: the runner offers to hold the job to its lease.
    fn claim<'a>(
        &'a self,
        job_id: &'a str,
        delivery_id: &'a str,
        lease_bound: bool,
    ) -> CpFuture<'a, ClaimResponse>;
    /// Renew the lease; `waiting` says the job is held back by the customer's guardrails.
    fn heartbeat<'a>(
        &'a self,
        job_id: &'a str,
        waiting: Option<&'a JobWaiting>,
    ) -> CpFuture<'a, JobHeartbeatResponse>;
    /// Append log bytes at `offset`; the server's new offset.
    fn append_log<'a>(&'a self, job_id: &'a str, offset: u64, bytes: &'a [u8]) -> CpFuture<'a, u64>;
    fn audit<'a>(&'a self, req: &'a AuditUploadRequest) -> CpFuture<'a, AuditUploadResponse>;
    /// Idempotent: the same result twice is a no-op on the server.
    fn result<'a>(&'a self, job_id: &'a str, result: &'a JobResult) -> CpFuture<'a, ()>;
    /// After a restart: the fencing epoch the journal holds for a claimed job.
    fn remember_lease(&self, _job_id: &str, _epoch: u64) {}
    /// This runner leaves the install for good (see [`CpClient::retire`]).
    fn retire(&self) -> CpFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
}

/// Whether the control plane refused a request because the job's lease was given to
/// another runner (`{"error": "fenced"}`): this runner must stop the job and never
/// report it.
pub fn is_fenced(e: &ClientError) -> bool {
    match e {
        ClientError::Conflict { body, .. } => {
            serde_json::from_str::<serde_json::Value>(body).is_ok_and(|v| v["error"] == byoc_protocol::FENCED)
        }
        _ => false,
    }
}

impl ControlPlane for CpClient {
    fn poll<'a>(&'a self, req: &'a PollRequest) -> CpFuture<'a, Option<PollResponse>> {
        Box::pin(CpClient::poll(self, req))
    }
    fn reject<'a>(&'a self, delivery_id: &'a str, reason: RejectReason, detail: &'a str) -> CpFuture<'a, ()> {
        Box::pin(CpClient::reject(self, delivery_id, reason, detail))
    }
    fn claim<'a>(
        &'a self,
        job_id: &'a str,
        delivery_id: &'a str,
        lease_bound: bool,
    ) -> CpFuture<'a, ClaimResponse> {
        Box::pin(CpClient::claim(self, job_id, delivery_id, lease_bound))
    }
    fn heartbeat<'a>(
        &'a self,
        job_id: &'a str,
        waiting: Option<&'a JobWaiting>,
    ) -> CpFuture<'a, JobHeartbeatResponse> {
        Box::pin(CpClient::heartbeat(self, job_id, waiting))
    }
    fn append_log<'a>(&'a self, job_id: &'a str, offset: u64, bytes: &'a [u8]) -> CpFuture<'a, u64> {
        Box::pin(CpClient::append_log(self, job_id, offset, bytes))
    }
    fn audit<'a>(&'a self, req: &'a AuditUploadRequest) -> CpFuture<'a, AuditUploadResponse> {
        Box::pin(CpClient::audit(self, req))
    }
    fn retire(&self) -> CpFuture<'_, ()> {
        Box::pin(CpClient::retire(self))
    }
    fn result<'a>(&'a self, job_id: &'a str, result: &'a JobResult) -> CpFuture<'a, ()> {
        Box::pin(CpClient::result(self, job_id, result))
    }
    fn remember_lease(&self, job_id: &str, epoch: u64) {
        CpClient::remember_lease(self, job_id, epoch);
    }
}
