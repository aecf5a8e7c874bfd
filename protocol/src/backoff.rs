//! Jittered exponential backoff, the one schedule both ends of every retry in the
//! workspace use: the runner's control-plane calls (the protocol re-polls at once, and
//! backs off only on errors) and the artifact copier's registry requests.

use std::time::Duration;

/// Delays that double from `initial` up to `max`, each drawn uniformly from
/// [delay/2, delay] so that many retrying clients do not move in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Backoff { initial, max, current: initial }
    }

    /// Back to `initial` (after a success).
    pub fn reset(&mut self) {
        self.current = self.initial;
    }

    /// The next delay; the one after it doubles (capped at `max`).
    pub fn next_delay(&mut self) -> Duration {
        let base = self.current.min(self.max);
        self.current = (self.current * 2).min(self.max);
        let half = base / 2;
        half + half.mul_f64(unit_random())
    }
}

/// Uniform in [0, 1). A failed random source only loses the jitter, never the delay.
fn unit_random() -> f64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        return 0.5;
    }
    (u64::from_le_bytes(b) >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_cap_jitter_and_reset() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        let delays: Vec<Duration> = (0..6).map(|_| b.next_delay()).collect();
        for (d, cap) in delays.iter().zip([100u64, 200, 400, 800, 800, 800]) {
            assert!(
                *d <= Duration::from_millis(cap) && *d >= Duration::from_millis(cap / 2),
                "{d:?} vs {cap}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
        // Jitter: many draws at the same step are not all equal.
        let draws: std::collections::BTreeSet<Duration> = (0..20)
            .map(|_| Backoff::new(Duration::from_secs(1), Duration::from_secs(1)).next_delay())
            .collect();
        assert!(draws.len() > 1);
    }

    #[test]
    fn an_initial_delay_above_the_cap_is_capped() {
        let mut b = Backoff::new(Duration::from_secs(10), Duration::from_secs(1));
        assert!(b.next_delay() <= Duration::from_secs(1));
    }
}
