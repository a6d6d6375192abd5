//! Exponential backoff with full jitter: the one implementation behind the
//! consumer's reconnects, the database gate's probes and the retrying client.

use std::time::Duration;

/// The most the `n`-th wait (1-based) can be: `base · 2^(n-1)`, capped at `max`.
pub(crate) fn ceiling(base: Duration, max: Duration, n: u32) -> Duration {
    let factor = 2u32.saturating_pow(n.saturating_sub(1));
    base.saturating_mul(factor).min(max)
}

/// A wait drawn uniformly from `[0, ceiling]` ("full jitter"), so that many
/// clients that failed together do not come back in lockstep.
pub(crate) fn full_jitter(ceiling: Duration) -> Duration {
    let nanos = ceiling.as_nanos().min(u128::from(u64::MAX)) as u64;
    Duration::from_nanos(fastrand::u64(0..=nanos))
}

/// Successive jittered waits under a doubling ceiling, never shorter than
/// `min`; [`reset`](Backoff::reset) after a success.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    failures: u32,
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

    /// Back to the shortest pause, after a success.
    pub(crate) fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_doubles_up_to_the_max() {
        let (base, max) = (Duration::from_millis(200), Duration::from_secs(30));
        assert_eq!(ceiling(base, max, 1), base);
        assert_eq!(ceiling(base, max, 3), Duration::from_millis(800));
        assert_eq!(ceiling(base, max, 40), max);
        assert_eq!(ceiling(base, max, u32::MAX), max);
    }

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
        b.reset();
        assert!(b.next_delay() <= min);
    }

    #[test]
    fn full_jitter_never_exceeds_its_ceiling() {
        for _ in 0..1000 {
            assert!(full_jitter(Duration::from_millis(5)) <= Duration::from_millis(5));
        }
        assert_eq!(full_jitter(Duration::ZERO), Duration::ZERO);
    }
}
