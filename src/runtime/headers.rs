//! The failure history idempo writes on retried and dead-lettered copies,
//! in the headers named in `header_names.rs`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::runtime::header_names::{
    ATTEMPTS_HEADER, FIRST_FAILURE_HEADER, LAST_FAILURE_HEADER, ROUTING_KEY_HEADER,
};
use crate::runtime::message::{HeaderValue, Message};

/// The failure history a message carries, updated with the current failure.
#[derive(Debug, Clone)]
pub(crate) struct Failures {
    /// Failed attempts including the current one.
    pub(crate) attempts: u32,
    pub(crate) first_failure: String,
    pub(crate) last_failure: String,
}

impl Failures {
    /// Reads the history of `message` and adds a failure happening now. The
    /// routing key of the first delivery is kept too, since a retried copy
    /// arrives with the delay queue's.
    pub(crate) fn record(message: &Message) -> Failures {
        let now = rfc3339(SystemTime::now());
        let previous = message.failed_attempts();
        let first_failure = message
            .header_text(FIRST_FAILURE_HEADER)
            .unwrap_or_else(|| now.clone());
        Failures {
            attempts: previous.saturating_add(1),
            first_failure,
            last_failure: now,
        }
    }

    /// The headers to write on the republished copy.
    pub(crate) fn headers(&self) -> [(&'static str, HeaderValue); 3] {
        [
            (ATTEMPTS_HEADER, HeaderValue::Integer(self.attempts.into())),
            (
                FIRST_FAILURE_HEADER,
                HeaderValue::Text(self.first_failure.clone()),
            ),
            (
                LAST_FAILURE_HEADER,
                HeaderValue::Text(self.last_failure.clone()),
            ),
        ]
    }
}

/// The routing key a message was first published with: kept in a header
/// across retries, whose copies carry the delay queue's name instead.
pub(crate) fn original_routing_key(message: &Message) -> String {
    message
        .header_text(ROUTING_KEY_HEADER)
        .unwrap_or_else(|| message.routing_key().to_owned())
}

/// `2026-12-01T02:19:47.123Z`. A time RFC 3339 cannot write (a clock set
/// wrong: before 1970, which humantime refuses, or after 9999) is clamped.
pub(crate) fn rfc3339(t: SystemTime) -> String {
    const LAST_MILLIS: u64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z
    let t = t.max(UNIX_EPOCH);
    let t = UNIX_EPOCH
        .checked_add(Duration::from_millis(LAST_MILLIS))
        .map_or(t, |last| t.min(last));
    humantime::format_rfc3339_millis(t).to_string()
}

/// `text`, cut at a character boundary to at most `max` bytes (a frame
/// carries the headers whole, so long texts in them are bounded).
pub(crate) fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_formats_utc_with_milliseconds() {
        let t = UNIX_EPOCH + Duration::from_millis(1_796_091_587_123);
        assert_eq!(rfc3339(t), "2026-12-01T02:19:47.123Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        // A leap day.
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00.000Z"
        );
        // Sub-millisecond digits are cut, not rounded; a time before the
        // epoch (a clock set wrong) is written as the epoch.
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_nanos(1_999_999)),
            "1970-01-01T00:00:00.001Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH - Duration::from_secs(1)),
            "1970-01-01T00:00:00.000Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(400 * 146_097 * 86_400)),
            "9999-12-31T23:59:59.999Z"
        );
    }
}
