//! The one way the runner retries a control-plane call: jittered exponential backoff
//! between attempts, an optional attempt limit, and a token that stops the waiting
//! (a drain, an abort, the daemon's end). The caller's attempt decides what is worth
//! retrying: it returns `Ok` for anything final (success or a refusal for good) and
//! `Err` for a transient failure.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use byoc_protocol::backoff::Backoff;

/// How a retried call ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Retried<T, E> {
    /// An attempt returned something final.
    Done(T),
    /// The stop token fired while waiting to try again.
    Stopped,
    /// The attempt limit was reached; the last transient failure.
    Exhausted(E),
}

/// Retry policy: backoff bounds and an optional attempt limit.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub initial: Duration,
    pub max: Duration,
    pub max_attempts: Option<u32>,
}

impl Policy {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Policy { initial, max, max_attempts: None }
    }
    pub fn attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }
}

/// Run `attempt` (given the attempt number, from 1) until it returns `Ok`, the attempt
/// limit is reached, or `stop` fires while waiting.
pub async fn retry<T, E, F, Fut>(policy: Policy, stop: &CancellationToken, mut attempt: F) -> Retried<T, E>
where
    F: FnMut(u32) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let mut backoff = Backoff::new(policy.initial, policy.max);
    let mut n = 0;
    loop {
        n += 1;
        let err = match attempt(n).await {
            Ok(v) => return Retried::Done(v),
            Err(e) => e,
        };
        if policy.max_attempts.is_some_and(|max| n >= max) {
            return Retried::Exhausted(err);
        }
        let delay = backoff.next_delay();
        tracing::debug!(error = %err, attempt = n, retry_in_ms = delay.as_millis() as u64, "Retrying: {err}.");
        if !sleep_unless_stopped(delay, stop).await {
            return Retried::Stopped;
        }
    }
}

/// Sleep for `delay`; false if `stop` fired first.
pub async fn sleep_unless_stopped(delay: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(delay) => true,
        _ = stop.cancelled() => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast() -> Policy {
        Policy::new(Duration::from_millis(1), Duration::from_millis(2))
    }

    #[tokio::test]
    async fn retries_transient_failures_until_an_attempt_is_final() {
        let stop = CancellationToken::new();
        let got =
            retry(fast(), &stop, |n| async move { if n < 3 { Err(format!("try {n}")) } else { Ok(n) } })
                .await;
        assert_eq!(got, Retried::Done(3));
    }

    #[tokio::test]
    async fn gives_up_after_the_attempt_limit_with_the_last_error() {
        let stop = CancellationToken::new();
        let got: Retried<(), String> =
            retry(fast().attempts(4), &stop, |n| async move { Err(format!("try {n}")) }).await;
        assert_eq!(got, Retried::Exhausted("try 4".into()));
    }

    #[tokio::test]
    async fn a_stop_ends_the_wait() {
        let stop = CancellationToken::new();
        stop.cancel();
        let slow = Policy::new(Duration::from_secs(3600), Duration::from_secs(3600));
        let got: Retried<(), String> = retry(slow, &stop, |_| async { Err("down".to_string()) }).await;
        assert_eq!(got, Retried::Stopped);
    }
}
