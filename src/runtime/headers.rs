//! The failure history idempo writes on retried and dead-lettered copies,
//! in the headers named in [`crate::headers`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::runtime::message::{HeaderRef, Message};

// The headers of idempo's copies (documented in `crate::headers`'s table).

/// Why the message was dead-lettered (one of `DeadLetterReason::as_str`, feature `amqp`).
pub(crate) const REASON_HEADER: &str = "x-idempo-reason";
/// The text of the last error.
pub(crate) const ERROR_HEADER: &str = "x-idempo-error";
/// The consumer that retried or dead-lettered the message.
pub(crate) const CONSUMER_HEADER: &str = "x-idempo-consumer";
/// The queue the message was consumed from.
pub(crate) const QUEUE_HEADER: &str = "x-idempo-original-queue";
/// The routing key the message was originally published with.
pub(crate) const ROUTING_KEY_HEADER: &str = "x-idempo-original-routing-key";
/// The original per-message TTL, which republished copies drop (a dead letter
/// must not expire out of the DLQ, a retry must not expire in its delay queue).
pub(crate) const ORIGINAL_EXPIRATION_HEADER: &str = "x-idempo-original-expiration";
/// The id idempo deduplicated the original on, written on every copy (with
/// [`MESSAGE_ID_SEAL_HEADER`]): a copy's properties differ from the
/// original's (routing key, expiration), so an id derived from them must not
/// be derived again. Not written when the original had no usable id.
pub(crate) const MESSAGE_ID_HEADER: &str = "x-idempo-message-id";
/// The seal of [`MESSAGE_ID_HEADER`]: an HMAC-SHA256 (hex) of the consumer,
/// the id and the body's hash under a per-consumer secret. Only an id with a
/// valid seal is carried forward; a header without one is ignored.
pub(crate) const MESSAGE_ID_SEAL_HEADER: &str = "x-idempo-message-id-seal";
/// The headers removed from a dead letter so that it fits the broker's frame
/// size, as `name=bytes` pairs, largest first (for example
/// `x-pad=130811`). RabbitMQ closes the connection on a larger header frame,
/// so a copy that would not fit is trimmed: first the largest headers that
/// are not idempo's, then the error text and the replay history.
pub(crate) const TRIMMED_HEADERS_HEADER: &str = "x-idempo-trimmed-headers";
/// How many attempts have failed so far (an integer).
pub(crate) const ATTEMPTS_HEADER: &str = "x-idempo-attempts";
/// When the first attempt failed (RFC 3339, UTC).
pub(crate) const FIRST_FAILURE_HEADER: &str = "x-idempo-first-failure";
/// When the last attempt failed (RFC 3339, UTC).
pub(crate) const LAST_FAILURE_HEADER: &str = "x-idempo-last-failure";

/// The header a replayed copy carries its failure history in: a JSON array
/// of replay records (reason, error, attempts, first and last failure,
/// replayed at), one per replay, oldest first, of the last
/// `dead_letters::view::MAX_REPLAY_HISTORY` replays only (the header would otherwise grow
/// with every replay until the message no longer fits a frame). Written by
/// the replay (`dead_letters/view.rs`), which reads it too.
pub(crate) const REPLAY_HISTORY_HEADER: &str = "x-idempo-replay-history";

/// A header value idempo writes on a copy (its failure history); each
/// transport writes it in its own type (AMQP: a long string, a long-long
/// integer; JetStream: text).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderValue {
    /// Text.
    Text(String),
    /// A whole number (the attempts).
    Integer(i64),
}

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
        let previous = Self::previous_attempts(message);
        let first_failure = message
            .header_text(FIRST_FAILURE_HEADER)
            .unwrap_or_else(|| now.clone());
        Failures {
            attempts: previous.saturating_add(1),
            first_failure,
            last_failure: now,
        }
    }

    /// The failed attempts before this delivery, as its copy's header says:
    /// 0 for a first delivery.
    pub(crate) fn previous_attempts(message: &Message) -> u32 {
        // Any integer type counts; text does not.
        match message.header_ref(ATTEMPTS_HEADER) {
            Some(HeaderRef::Integer(n)) => u32::try_from(n).unwrap_or(0),
            _ => 0,
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
