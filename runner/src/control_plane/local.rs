//! The runner's own drift checks (`crate::drift`) run the same path as the vendor's
//! jobs, but the control plane never sent them (`pipeline::Origin::Local`): what the
//! path asks of a control plane for them is answered here (a claim granted, no cancel,
//! the log kept on the VM, the result settled locally). The control plane learns of
//! such a check from the audit log it receives (`drift_checked`, the job's records).

use byoc_protocol::{
    AuditUploadRequest, AuditUploadResponse, ClaimResponse, JobHeartbeatResponse, JobResult, JobWaiting,
    PollRequest, PollResponse, RejectReason,
};

use super::{ClientError, ControlPlane, CpFuture};

pub struct LocalChecks;

/// A local check's lease never runs out: nobody else could take it over.
const LOCAL_LEASE_SECS: u64 = 86_400;

impl ControlPlane for LocalChecks {
    fn poll<'a>(&'a self, _req: &'a PollRequest) -> CpFuture<'a, Option<PollResponse>> {
        Box::pin(async { Ok(None) })
    }
    fn reject<'a>(
        &'a self,
        _delivery_id: &'a str,
        _reason: RejectReason,
        _detail: &'a str,
    ) -> CpFuture<'a, ()> {
        Box::pin(async { Ok(()) })
    }
    fn claim<'a>(
        &'a self,
        _job_id: &'a str,
        _delivery_id: &'a str,
        _lease_bound: bool,
    ) -> CpFuture<'a, ClaimResponse> {
        Box::pin(async { Ok(ClaimResponse { lease_secs: LOCAL_LEASE_SECS, epoch: 0, lease_bound: false }) })
    }
    fn heartbeat<'a>(
        &'a self,
        _job_id: &'a str,
        _waiting: Option<&'a JobWaiting>,
    ) -> CpFuture<'a, JobHeartbeatResponse> {
        Box::pin(async { Ok(JobHeartbeatResponse { lease_secs: LOCAL_LEASE_SECS, cancel: false }) })
    }
    fn append_log<'a>(&'a self, _job_id: &'a str, offset: u64, bytes: &'a [u8]) -> CpFuture<'a, u64> {
        let end = offset + bytes.len() as u64;
        Box::pin(async move { Ok(end) })
    }
    fn audit<'a>(&'a self, _req: &'a AuditUploadRequest) -> CpFuture<'a, AuditUploadResponse> {
        // The audit log goes to the control plane, whatever job made its records.
        Box::pin(async {
            Err(ClientError::Protocol("the audit log is not uploaded through a local check".into()))
        })
    }
    fn result<'a>(&'a self, _job_id: &'a str, _result: &'a JobResult) -> CpFuture<'a, ()> {
        Box::pin(async { Ok(()) })
    }
}
