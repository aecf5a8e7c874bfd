//! The runner's own drift checks (`crate::drift`) run the same path as the vendor's
//! jobs, but the control plane never sent them: what the path asks of the control plane
//! for a job of [`LOCAL_JOB_PREFIX`] is answered here (a claim granted, no cancel, the
//! log kept on the VM, the result settled locally), and everything else goes on to the
//! real one. The control plane learns of such a check from the audit log it receives
//! (`drift_checked`, the job's records).

use std::sync::Arc;

use byoc_protocol::{
    AuditUploadRequest, AuditUploadResponse, ClaimResponse, JobHeartbeatResponse, JobResult, JobWaiting,
    LOCAL_JOB_PREFIX, PollRequest, PollResponse, RejectReason,
};

use super::{ControlPlane, CpFuture};

pub struct Routed {
    pub remote: Arc<dyn ControlPlane>,
}

fn local(id: &str) -> bool {
    id.starts_with(LOCAL_JOB_PREFIX)
}

/// A local check's lease never runs out: nobody else could take it over.
const LOCAL_LEASE_SECS: u64 = 86_400;

impl ControlPlane for Routed {
    fn poll<'a>(&'a self, req: &'a PollRequest) -> CpFuture<'a, Option<PollResponse>> {
        self.remote.poll(req)
    }
    fn reject<'a>(&'a self, delivery_id: &'a str, reason: RejectReason, detail: &'a str) -> CpFuture<'a, ()> {
        if local(delivery_id) {
            return Box::pin(async { Ok(()) });
        }
        self.remote.reject(delivery_id, reason, detail)
    }
    fn claim<'a>(&'a self, job_id: &'a str, delivery_id: &'a str) -> CpFuture<'a, ClaimResponse> {
        if local(job_id) {
            return Box::pin(async { Ok(ClaimResponse { lease_secs: LOCAL_LEASE_SECS }) });
        }
        self.remote.claim(job_id, delivery_id)
    }
    fn heartbeat<'a>(
        &'a self,
        job_id: &'a str,
        waiting: Option<&'a JobWaiting>,
    ) -> CpFuture<'a, JobHeartbeatResponse> {
        if local(job_id) {
            return Box::pin(async {
                Ok(JobHeartbeatResponse { lease_secs: LOCAL_LEASE_SECS, cancel: false })
            });
        }
        self.remote.heartbeat(job_id, waiting)
    }
    fn append_log<'a>(&'a self, job_id: &'a str, offset: u64, bytes: &'a [u8]) -> CpFuture<'a, u64> {
        if local(job_id) {
            let end = offset + bytes.len() as u64;
            return Box::pin(async move { Ok(end) });
        }
        self.remote.append_log(job_id, offset, bytes)
    }
    fn audit<'a>(&'a self, req: &'a AuditUploadRequest) -> CpFuture<'a, AuditUploadResponse> {
        self.remote.audit(req)
    }
    fn result<'a>(&'a self, job_id: &'a str, result: &'a JobResult) -> CpFuture<'a, ()> {
        if local(job_id) {
            return Box::pin(async { Ok(()) });
        }
        self.remote.result(job_id, result)
    }
}
