//! A job held to its lease: when the control plane may give a job to another runner of
//! the install once this runner's lease runs out, the job's processes must be gone by
//! then, whatever happens to the runner (frozen, hung, cut off). The runner cannot
//! promise that itself (a frozen runner does nothing), so the sandbox's helper, a
//! separate process, keeps the deadline: the runner writes each renewed deadline on a
//! pipe ([`LEASE_FD`](crate::spec::LEASE_FD)); when one passes without a newer one the
//! helper stops the job (SIGTERM through init, SIGKILL of the whole pid namespace after
//! the grace) and exits with [`EXIT_LEASE_EXPIRED`](crate::helper::EXIT_LEASE_EXPIRED).
//!
//! Deadlines are `CLOCK_MONOTONIC` nanoseconds: one clock for the runner and the helper
//! on one host, immune to changes of the wall clock.

use std::os::fd::{AsFd as _, OwnedFd};
use std::sync::Mutex;
use std::time::Duration;

/// Now, in `CLOCK_MONOTONIC` nanoseconds.
pub fn monotonic_now_ns() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(t) => (t.tv_sec() as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec() as u64),
        // Never fails on Linux; were it to, every deadline is already past (fail closed).
        Err(_) => u64::MAX,
    }
}

/// How a lease of `lease` granted at `sent_ns` (when the request that got it was sent,
/// which is before the control plane counted it from) bounds the job: stop it at the
/// returned deadline and kill what is left a grace later, both a sixth of the lease
/// apart and the kill a sixth before the control plane's own end of the lease.
pub fn bounds(sent_ns: u64, lease: Duration) -> (u64, Duration) {
    let lease_ns = lease.as_nanos().min(u64::MAX as u128) as u64;
    (sent_ns.saturating_add(lease_ns / 3 * 2), lease / 6)
}

/// The runner's side: the job's current deadline and the pipes of its live sandboxes.
#[derive(Debug)]
pub struct LeaseBinding {
    grace: Duration,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    deadline_ns: u64,
    pipes: Vec<OwnedFd>,
}

impl LeaseBinding {
    pub fn new(deadline_ns: u64, grace: Duration) -> LeaseBinding {
        LeaseBinding { grace, inner: Mutex::new(Inner { deadline_ns, pipes: Vec::new() }) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn grace(&self) -> Duration {
        self.grace
    }

    pub fn deadline_ns(&self) -> u64 {
        self.lock().deadline_ns
    }

    /// The deadline passed without a renewal.
    pub fn expired(&self) -> bool {
        monotonic_now_ns() >= self.deadline_ns()
    }

    /// A renewed lease: later deadlines only (an answer that arrives late never shortens
    /// it). Every live sandbox learns it; a pipe whose helper has gone is dropped.
    pub fn renew(&self, deadline_ns: u64) {
        let mut inner = self.lock();
        if deadline_ns <= inner.deadline_ns {
            return;
        }
        inner.deadline_ns = deadline_ns;
        let bytes = deadline_ns.to_le_bytes();
        inner.pipes.retain(|fd| nix::unistd::write(fd.as_fd(), &bytes).is_ok_and(|n| n == bytes.len()));
    }

    /// A pipe for a new sandbox, its current deadline already in it: the read end goes
    /// to the helper at `LEASE_FD`.
    pub fn attach(&self) -> std::io::Result<OwnedFd> {
        use nix::fcntl::OFlag;
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        // Never block the runner: a helper that stopped reading has 64 KiB (8,192
        // renewals) of slack, and a full pipe only drops the pipe.
        nix::fcntl::fcntl(&write, nix::fcntl::FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
        let mut inner = self.lock();
        nix::unistd::write(&write, &inner.deadline_ns.to_le_bytes())?;
        inner.pipes.push(write);
        Ok(read)
    }
}

/// The helper's side: the latest deadline read from the pipe.
pub struct LeaseWatch {
    pipe: OwnedFd,
    pub deadline_ns: u64,
    pub grace: Duration,
    /// The runner closed its end (it exited; its death signal reaches us too): the last
    /// deadline stays.
    closed: bool,
    partial: Vec<u8>,
}

impl LeaseWatch {
    pub fn new(pipe: OwnedFd, grace: Duration) -> LeaseWatch {
        // The first deadline was written before the helper started; until it is read,
        // none has passed.
        LeaseWatch { pipe, deadline_ns: u64::MAX, grace, closed: false, partial: Vec::new() }
    }

    pub fn pipe(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        (!self.closed).then(|| self.pipe.as_fd())
    }

    /// Read what the runner wrote (call when the pipe is readable).
    pub fn read(&mut self) {
        let mut buf = [0u8; 512];
        match nix::unistd::read(&self.pipe, &mut buf) {
            Ok(0) => self.closed = true,
            Ok(n) => {
                self.partial.extend_from_slice(&buf[..n]);
                let whole = self.partial.len() / 8 * 8;
                for chunk in self.partial[..whole].chunks_exact(8) {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(chunk);
                    let first = self.deadline_ns == u64::MAX;
                    let d = u64::from_le_bytes(b);
                    if first || d > self.deadline_ns {
                        self.deadline_ns = d;
                    }
                }
                self.partial.drain(..whole);
            }
            Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
            Err(_) => self.closed = true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_helper_reads_the_latest_deadline_and_a_late_answer_never_shortens_it() {
        let binding = LeaseBinding::new(1_000, Duration::from_millis(5));
        let read = binding.attach().unwrap();
        let mut watch = LeaseWatch::new(read, binding.grace());
        watch.read();
        assert_eq!(watch.deadline_ns, 1_000);
        binding.renew(5_000);
        binding.renew(4_000); // an answer to an older heartbeat, arriving late
        watch.read();
        assert_eq!(watch.deadline_ns, 5_000);
        assert_eq!(binding.deadline_ns(), 5_000);
        drop(binding);
        watch.read();
        assert!(watch.pipe().is_none(), "the runner's end closed");
        assert_eq!(watch.deadline_ns, 5_000, "the last deadline stays");
    }

    #[test]
    fn a_sandbox_that_is_gone_is_dropped_from_the_renewals() {
        let binding = LeaseBinding::new(monotonic_now_ns(), Duration::ZERO);
        drop(binding.attach().unwrap());
        binding.renew(monotonic_now_ns() + 1_000_000_000);
        assert!(binding.lock().pipes.is_empty());
        assert!(!binding.expired());
    }

    #[test]
    fn the_job_stops_a_third_of_the_lease_early_and_is_killed_a_sixth_before_it_ends() {
        let (deadline, grace) = bounds(10_000_000_000, Duration::from_secs(60));
        assert_eq!(deadline, 50_000_000_000);
        assert_eq!(grace, Duration::from_secs(10));
    }
}
