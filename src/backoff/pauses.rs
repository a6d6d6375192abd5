//! [`Backoff`]: successive pauses on the schedule, for a loop that waits
//! out failures.

use std::time::Duration;

use super::{ceiling, full_jitter};

/// Successive jittered waits under a doubling ceiling, never shorter than
/// `min`.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    /// Failures so far (a reconnect loop sets it back after a success).
    pub(super) failures: u32,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max,
            failures: 0,
        }
    }

    /// The next pause: at least `min`, jittered below the current ceiling.
    pub(crate) fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        full_jitter(ceiling(self.min, self.max, self.failures)).max(self.min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_within_min_and_a_doubling_ceiling() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(2));
        let mut b = Backoff::new(min, max);
        let mut top = min;
        for _ in 0..10 {
            let d = b.next_delay();
            assert!(d >= min && d <= top, "{d:?} outside [{min:?}, {top:?}]");
            top = (top * 2).min(max);
        }
    }
}
