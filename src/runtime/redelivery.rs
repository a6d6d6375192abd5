//! What happens to a delivery after a transient failure: [`RedeliveryPolicy`]
//! (delay queues, or nack-requeue).

use std::time::Duration;

/// How transiently failed deliveries are retried.
///
/// # Delayed retries (the default)
/// The delivery is republished to a *delay queue* `<queue>.retry.<delay>`
/// (for example `payments.retry.30s`): a durable queue with `x-message-ttl`
/// that dead-letters expired messages back into the work queue. The copy
/// carries the attempt count in the `x-idempo-attempts` header, and the
/// original is acked only after the broker confirmed the copy. The count
/// lives in the message, so it survives consumer restarts, and no
/// nack-requeue loop is involved. The n-th retry waits `delays[n - 1]` (the
/// last delay repeats). After `max_attempts` failed attempts the delivery is
/// dead-lettered with reason `max attempts exceeded`.
///
/// A handler can ask for a delay with
/// [`HandlerError::retry_after`](crate::consumer::HandlerError::retry_after): the
/// smallest configured delay that is at least as long is used (the longest if
/// none is), since delay queues are per tier, not per message.
///
/// # Requeue
/// [`RedeliveryPolicy::requeue`] hands the delivery back with
/// `basic.nack(requeue = true)` after a pause instead. Attempts are not
/// counted, so a message that always fails transiently is retried forever
/// (unless a broker-side delivery limit intervenes).
///
/// # Default
/// Delayed, with delays 1 s, 5 s, 30 s, 2 min, 10 min, and at most 10
/// attempts: the last retry comes about 53 min after the first failure (90
/// min at worst, if every retry asks for the longest delay).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedeliveryPolicy {
    pub(crate) mode: Mode,
    pub(crate) max_attempts: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Mode {
    Delayed(Vec<Duration>),
    Requeue(Duration),
}

/// RabbitMQ's `x-message-ttl` is a non-negative 32-bit count of milliseconds.
const MAX_DELAY: Duration = Duration::from_millis(u32::MAX as u64);

impl Default for RedeliveryPolicy {
    fn default() -> Self {
        RedeliveryPolicy::delayed([
            Duration::from_secs(1),
            Duration::from_secs(5),
            Duration::from_secs(30),
            Duration::from_secs(120),
            Duration::from_secs(600),
        ])
    }
}

impl RedeliveryPolicy {
    /// Broker-owned delayed retries with these delay tiers (one delay queue
    /// each), and the default of 10 attempts.
    pub fn delayed(delays: impl IntoIterator<Item = Duration>) -> Self {
        let mut delays: Vec<Duration> = delays.into_iter().collect();
        delays.dedup();
        RedeliveryPolicy {
            mode: Mode::Delayed(delays),
            max_attempts: 10,
        }
    }

    /// `basic.nack(requeue = true)` after `pause`; attempts are not counted.
    pub fn requeue(pause: Duration) -> Self {
        RedeliveryPolicy {
            mode: Mode::Requeue(pause),
            max_attempts: u32::MAX,
        }
    }

    /// How many failed attempts dead-letter a delivery (delayed mode; at least 1).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The delay tiers (empty in requeue mode).
    pub fn delays(&self) -> &[Duration] {
        match &self.mode {
            Mode::Delayed(delays) => delays,
            Mode::Requeue(_) => &[],
        }
    }

    /// The longest a delivery can spend waiting between its first failure and
    /// its last attempt: every retry at the longest delay (a handler may ask
    /// for it with `retry_after`). Retention must be longer than this.
    pub fn total_delay(&self) -> Duration {
        let longest = self.delays().iter().copied().max().unwrap_or_default();
        longest * self.max_attempts.saturating_sub(1)
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        match &self.mode {
            Mode::Delayed(delays) => {
                if delays.is_empty() {
                    return Err("a delayed retry policy needs at least one delay".into());
                }
                if let Some(d) = delays
                    .iter()
                    .find(|d| d.is_zero() || **d > MAX_DELAY || d.subsec_nanos() % 1_000_000 != 0)
                {
                    return Err(format!(
                        "retry delay {d:?} must be a whole number of milliseconds between 1 ms and {MAX_DELAY:?}"
                    ));
                }
                if self.max_attempts == 0 {
                    return Err("max_attempts must be at least 1".into());
                }
                Ok(())
            }
            Mode::Requeue(_) => Ok(()),
        }
    }

    /// The delay before retry number `retry` (1-based), or the tier that
    /// covers `requested`.
    pub(crate) fn delay_for(&self, retry: u32, requested: Option<Duration>) -> Duration {
        let delays = self.delays();
        match requested {
            Some(wanted) => delays
                .iter()
                .copied()
                .filter(|d| *d >= wanted)
                .min()
                .unwrap_or_else(|| delays.iter().copied().max().unwrap_or_default()),
            None => delays[(retry.max(1) as usize - 1).min(delays.len() - 1)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn retries_walk_the_tiers_and_repeat_the_last() {
        let p = RedeliveryPolicy::default();
        let got: Vec<_> = (1..=7).map(|n| p.delay_for(n, None)).collect();
        assert_eq!(got, [1, 5, 30, 120, 600, 600, 600].map(secs));
    }

    #[test]
    fn a_requested_delay_rounds_up_to_a_tier() {
        let p = RedeliveryPolicy::default();
        assert_eq!(p.delay_for(1, Some(secs(10))), secs(30));
        assert_eq!(p.delay_for(1, Some(secs(5))), secs(5));
        assert_eq!(
            p.delay_for(1, Some(secs(7200))),
            secs(600),
            "capped at the longest"
        );
    }

    #[test]
    fn the_worst_case_wait_is_every_retry_at_the_longest_delay() {
        // 9 retries of 10 minutes.
        assert_eq!(RedeliveryPolicy::default().total_delay(), secs(5400));
        assert_eq!(
            RedeliveryPolicy::requeue(secs(1)).total_delay(),
            Duration::ZERO
        );
    }

    #[test]
    fn impossible_policies_are_refused() {
        assert!(RedeliveryPolicy::delayed([]).validate().is_err());
        assert!(
            RedeliveryPolicy::delayed([Duration::ZERO])
                .validate()
                .is_err()
        );
        assert!(
            RedeliveryPolicy::delayed([Duration::from_micros(1500)])
                .validate()
                .is_err()
        );
        assert!(
            RedeliveryPolicy::default()
                .max_attempts(0)
                .validate()
                .is_err()
        );
        assert!(RedeliveryPolicy::default().validate().is_ok());
    }
}
