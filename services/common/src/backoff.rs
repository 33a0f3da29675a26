//! The one way a background loop waits between retries: a pause that
//! doubles after each failure up to a ceiling, and starts over after a
//! success.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Pauses between retries.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    first: Duration,
    most: Duration,
    next: Duration,
}

impl Default for Backoff {
    /// 100 ms, doubling to 5 s: what reconnecting to a sibling service waits.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

impl Backoff {
    /// Starts at `first`, doubling up to `most`.
    pub fn new(first: Duration, most: Duration) -> Self {
        Self {
            first,
            most: most.max(first),
            next: first,
        }
    }

    /// Returns the next pause; the one after is twice as long, up to the ceiling.
    pub fn next_pause(&mut self) -> Duration {
        let pause = self.next;
        self.next = (self.next * 2).min(self.most);
        pause
    }

    /// Starts over: the next pause is the first.
    pub fn reset(&mut self) {
        self.next = self.first;
    }

    /// Sleeps the next pause; `false` when `shutdown` came first.
    pub async fn wait(&mut self, shutdown: &CancellationToken) -> bool {
        let pause = self.next_pause();
        tokio::select! {
            () = shutdown.cancelled() => false,
            () = tokio::time::sleep(pause) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_to_the_ceiling_and_start_over_after_a_success() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let pauses: Vec<u128> = (0..5).map(|_| backoff.next_pause().as_millis()).collect();
        assert_eq!(pauses, [100, 200, 400, 500, 500]);
        backoff.reset();
        assert_eq!(backoff.next_pause(), Duration::from_millis(100));
        assert_eq!(Backoff::default().next_pause(), Duration::from_millis(100));
    }

    #[tokio::test]
    async fn a_shutdown_ends_the_wait() {
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let mut backoff = Backoff::new(Duration::from_secs(3600), Duration::from_secs(3600));
        assert!(!backoff.wait(&shutdown).await);
    }
}
