//! The runner's one clock. Code that decides by time (envelope expiry, lease and
//! session lifetimes) takes a `&dyn Clock` where a test must fix the time; everything
//! else reads `now_ms()`/`unix_now()`, which are the system clock.

/// Wall-clock time, injectable.
pub trait Clock: Send + Sync {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
    /// Seconds since the Unix epoch.
    fn unix_now(&self) -> i64 {
        (self.now_ms() / 1000) as i64
    }
}

/// The system's clock (the same one the audit log stamps records with).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        byoc_audit::log::now_ms()
    }
}

/// A clock that says what a test tells it to.
#[derive(Debug, Default)]
pub struct FixedClock(pub std::sync::atomic::AtomicU64);

impl FixedClock {
    pub fn at_secs(secs: i64) -> Self {
        FixedClock(std::sync::atomic::AtomicU64::new(secs as u64 * 1000))
    }
    pub fn advance_secs(&self, secs: u64) {
        self.0.fetch_add(secs * 1000, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Clock for FixedClock {
    fn now_ms(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

pub fn now_ms() -> u64 {
    SystemClock.now_ms()
}

pub fn unix_now() -> i64 {
    SystemClock.unix_now()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_clock_advances_and_system_clock_is_recent() {
        let c = FixedClock::at_secs(1_000);
        c.advance_secs(5);
        assert_eq!(c.unix_now(), 1_005);
        // 2024-01-01: the system clock is not an epoch-zero fallback.
        assert!(unix_now() > 1_704_067_200);
    }
}
