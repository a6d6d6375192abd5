//! [`RetryPolicy`]: how many retries, how long between them, which answers.

use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

/// When and how often to retry: exponential backoff with full jitter.
///
/// # Default
/// 3 retries (4 attempts); base delay 200 ms; max delay 30 s; retryable
/// statuses 408, 409 (an idempotent server reporting the first request in
/// progress), 429, 500, 502, 503, 504; no deadline.
///
/// The wait before retry *n* is uniform in `[0, min(max_delay, base_delay ·
/// 2^(n-1))]` ("full jitter", so that clients that failed together do not
/// retry together), unless the server sent `Retry-After`: then that, capped by
/// `max_delay`.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub(crate) max_retries: u32,
    pub(crate) base_delay: Duration,
    pub(crate) max_delay: Duration,
    pub(crate) retryable: Vec<u16>,
    pub(crate) deadline: Option<Duration>,
    pub(crate) cancel: Option<CancellationToken>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_retries: 3,
            base_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(30),
            retryable: vec![408, 409, 429, 500, 502, 503, 504],
            deadline: None,
            cancel: None,
        }
    }
}

impl RetryPolicy {
    /// The [default](Self#default) policy.
    pub fn new() -> Self {
        Self::default()
    }

    /// Retries after the first attempt (0: try once).
    #[must_use]
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.max_retries = retries;
        self
    }

    /// The ceiling of the first retry's wait; doubled for each next one.
    #[must_use]
    pub fn base_delay(mut self, delay: Duration) -> Self {
        self.base_delay = delay;
        self
    }

    /// The longest wait, also for a server's `Retry-After`.
    #[must_use]
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// The HTTP statuses worth retrying.
    #[must_use]
    pub fn retryable_statuses(mut self, statuses: impl IntoIterator<Item = u16>) -> Self {
        self.retryable = statuses.into_iter().collect();
        self
    }

    /// Gives up when the next attempt could not start within `deadline` of
    /// the first; an attempt in flight at the deadline is cut off.
    ///
    /// A deadline beyond the clock's range (`Duration::MAX`) is no deadline.
    /// The [`RetryingClient`](super::RetryingClient)'s attempt timeout (10 s
    /// by default) should be shorter, or one hung attempt uses it all.
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Stops (between attempts, or by dropping the one in flight) when
    /// `token` is cancelled.
    #[must_use]
    pub fn cancel_on(mut self, token: CancellationToken) -> Self {
        self.cancel = Some(token);
        self
    }

    /// Whether `status` is worth retrying.
    pub fn is_retryable(&self, status: u16) -> bool {
        self.retryable.contains(&status)
    }

    /// The most the wait before retry `retry` (1-based) can be.
    pub fn ceiling(&self, retry: u32) -> Duration {
        crate::backoff::ceiling(self.base_delay, self.max_delay, retry)
    }

    /// The wait before retry `retry`: full jitter under [`ceiling`](Self::ceiling),
    /// or the server's `Retry-After` capped by the max delay.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        match retry_after {
            Some(asked) => asked.min(self.max_delay),
            None => crate::backoff::full_jitter(self.ceiling(retry)),
        }
    }
}

/// Reads a `Retry-After` value: delta-seconds (`"120"`) or an HTTP-date in
/// any of the three formats a recipient must accept (RFC 9110 §5.6.7):
/// IMF-fixdate `"Sun, 06 Nov 1994 08:49:37 GMT"`, RFC 850 `"Sunday,
/// 06-Nov-94 08:49:37 GMT"` and asctime `"Sun Nov  6 08:49:37 1994"`,
/// measured from `now` (a date in the past is zero). `None` for anything
/// else.
pub(crate) fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Too many seconds for a u64 is "a very long time" (the max delay caps it).
        return Some(
            value
                .parse::<u64>()
                .map_or(Duration::MAX, Duration::from_secs),
        );
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_jitter_stays_under_the_exponential_ceiling() {
        let policy = RetryPolicy::new();
        assert_eq!(policy.ceiling(1), Duration::from_millis(200));
        assert_eq!(policy.ceiling(3), Duration::from_millis(800));
        assert_eq!(policy.ceiling(40), Duration::from_secs(30));
        for retry in 1..6 {
            for _ in 0..200 {
                assert!(policy.delay(retry, None) <= policy.ceiling(retry));
            }
        }
        assert_eq!(
            policy.delay(1, Some(Duration::from_secs(90))),
            Duration::from_secs(30)
        );
    }

    #[test]
    fn retry_after_as_seconds_or_any_of_the_three_http_date_formats() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_470);
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:27:00 GMT", now),
            Some(Duration::ZERO)
        );
        // The two obsolete formats HTTP still requires recipients to read.
        assert_eq!(
            parse_retry_after("Wednesday, 21-Oct-15 07:28:00 GMT", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_retry_after("Wed Oct 21 07:28:00 2015", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_retry_after("Wed Oct  1 07:28:00 2025", now),
            Some(Duration::from_secs(313_891_210)),
            "asctime pads a one-digit day with a space"
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(
            parse_retry_after("99999999999999999999999", now),
            Some(Duration::MAX)
        );
        assert_eq!(parse_retry_after("-1", now), None);
    }
}
