//! Exponential backoff with full jitter, for reconnecting and for probing the database.

use std::time::Duration;

/// Delays that double from `min` up to `max`, each drawn uniformly from
/// `[0, current]` ("full jitter"), so that many consumers that lost the same
/// broker do not come back in lockstep.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max,
            current: min,
        }
    }

    /// The next pause: at least `min`, jittered below the current ceiling.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let ceiling = self.current;
        self.current = (self.current * 2).min(self.max);
        let jittered = ceiling.mul_f64(fastrand::f64());
        jittered.max(self.min)
    }

    /// Back to the shortest pause, after a success.
    pub(crate) fn reset(&mut self) {
        self.current = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_within_min_and_a_doubling_ceiling() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(2));
        let mut b = Backoff::new(min, max);
        let mut ceiling = min;
        for _ in 0..10 {
            let d = b.next_delay();
            assert!(
                d >= min && d <= ceiling,
                "{d:?} outside [{min:?}, {ceiling:?}]"
            );
            ceiling = (ceiling * 2).min(max);
        }
        b.reset();
        assert!(b.next_delay() <= min);
    }
}
