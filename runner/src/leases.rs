//! Jobs held to their leases. A claim offers it for a job whose processes all run in
//! the sandbox; when the control plane takes the offer (the lease may pass to another
//! runner of the install once it runs out), every sandbox of the job gets the lease's
//! deadline, renewed by each answered heartbeat, and stops the job by itself when it
//! passes (`byoc_sandbox::lease`): a frozen, hung or cut-off runner leaves nothing of
//! the job running by the time another runner may take it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use byoc_job_executors::Placement;
use byoc_sandbox::lease::{LeaseBinding, bounds, monotonic_now_ns};

#[derive(Default)]
pub struct LeaseBook {
    /// Each bound job's binding and the length of its last lease.
    held: Mutex<HashMap<String, (Arc<LeaseBinding>, u64)>>,
}

/// Whether this runner can hold a job placed so to its lease: only the sandbox's
/// helper outlives a frozen runner to stop what it runs.
pub fn can_bind(placement: Placement, sandboxed: bool) -> bool {
    sandboxed && matches!(placement, Placement::Sandbox { .. })
}

impl LeaseBook {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Arc<LeaseBinding>, u64)>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The control plane took the offer: a lease of `lease_secs` from the claim sent at
    /// `sent_ns` (`CLOCK_MONOTONIC`).
    pub fn bind(&self, job_id: &str, sent_ns: u64, lease_secs: u64) {
        let (deadline, grace) = bounds(sent_ns, Duration::from_secs(lease_secs));
        self.lock().insert(job_id.to_string(), (Arc::new(LeaseBinding::new(deadline, grace)), lease_secs));
    }

    /// A heartbeat sent at `sent_ns` was answered with a lease of `lease_secs`.
    pub fn renewed(&self, job_id: &str, sent_ns: u64, lease_secs: u64) {
        if let Some((binding, lease)) = self.lock().get_mut(job_id) {
            binding.renew(bounds(sent_ns, Duration::from_secs(lease_secs)).0);
            *lease = lease_secs;
        }
    }

    pub fn get(&self, job_id: &str) -> Option<Arc<LeaseBinding>> {
        self.lock().get(job_id).map(|(binding, _)| binding.clone())
    }

    /// The job ended here: nothing of it is left to hold.
    pub fn release(&self, job_id: &str) {
        self.lock().remove(job_id);
    }

    /// How often to heartbeat a job: as configured, but for a job held to its lease
    /// often enough that one lost answer never stops it (at least four renewals in the
    /// two thirds of the lease the job may run unrenewed).
    pub fn heartbeat_every(&self, job_id: &str, configured: Duration) -> Duration {
        match self.lock().get(job_id) {
            Some((_, lease_secs)) => configured
                .min(Duration::from_millis(lease_secs.saturating_mul(1000) / 6))
                .max(Duration::from_millis(100)),
            None => configured,
        }
    }
}

/// Now, on the clock leases are kept by.
pub fn now_ns() -> u64 {
    monotonic_now_ns()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sandboxed_process_jobs_are_offered() {
        assert!(can_bind(Placement::Sandbox { network: true }, true));
        assert!(!can_bind(Placement::Sandbox { network: true }, false), "the sandbox switched off");
        assert!(!can_bind(Placement::Container { network: true }, true), "the engine's, not ours");
        assert!(!can_bind(Placement::InRunner, true), "nothing outlives the runner to stop it");
    }

    #[test]
    fn a_bound_job_is_renewed_by_heartbeats_and_released_when_it_ends() {
        let book = LeaseBook::default();
        book.renewed("job-1", now_ns(), 60); // not bound: nothing to renew
        assert!(book.get("job-1").is_none());
        let sent = now_ns();
        book.bind("job-1", sent, 3);
        let first = book.get("job-1").unwrap().deadline_ns();
        assert_eq!(first, sent + 2_000_000_000);
        book.renewed("job-1", sent + 1_000_000_000, 3);
        assert_eq!(book.get("job-1").unwrap().deadline_ns(), first + 1_000_000_000);
        assert_eq!(book.heartbeat_every("job-1", Duration::from_secs(15)), Duration::from_millis(500));
        assert_eq!(book.heartbeat_every("job-2", Duration::from_secs(15)), Duration::from_secs(15));
        book.release("job-1");
        assert!(book.get("job-1").is_none());
    }
}
