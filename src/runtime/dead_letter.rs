//! Why a delivery is dead-lettered ([`DeadLetterReason`]). What a dead
//! letter says about itself is read in `dead_letters/view.rs`.

use std::fmt;

/// Why a delivery went to the dead-letter queue. Each one is final:
/// redelivering the same message cannot change the outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// No message id could be found.
    MissingMessageId,
    /// The message id is empty or longer than 255 bytes.
    InvalidMessageId,
    /// The body could not be decoded into the handler's type.
    UndecodableBody,
    /// A property or header name is not valid UTF-8, so the AMQP client
    /// could not parse the delivery at all.
    UndecodableProperties,
    /// The id was already processed with a different body.
    PayloadMismatch,
    /// The handler returned a permanent error.
    PermanentError,
    /// Transient failures used up the [`RedeliveryPolicy`](crate::runtime::redelivery::RedeliveryPolicy)'s attempts.
    AttemptsExhausted,
    /// A retry copy with the failure headers added would not fit one frame
    /// of the connection (its own headers are too large), so it cannot be
    /// retried through a delay queue.
    HeadersTooLarge,
}

impl DeadLetterReason {
    /// The value of the `x-idempo-reason` header.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::MissingMessageId => "missing message id",
            DeadLetterReason::InvalidMessageId => "invalid message id",
            DeadLetterReason::UndecodableBody => "undecodable body",
            DeadLetterReason::UndecodableProperties => "undecodable properties",
            DeadLetterReason::PayloadMismatch => "message id reused with a different payload",
            DeadLetterReason::PermanentError => "permanent handler error",
            DeadLetterReason::AttemptsExhausted => "max attempts exceeded",
            DeadLetterReason::HeadersTooLarge => "headers too large to retry",
        }
    }
}

impl DeadLetterReason {
    /// The reason whose [`as_str`](Self::as_str) is `s` (a stored letter's).
    pub(crate) fn from_str_value(s: &str) -> Option<Self> {
        [
            DeadLetterReason::MissingMessageId,
            DeadLetterReason::InvalidMessageId,
            DeadLetterReason::UndecodableBody,
            DeadLetterReason::UndecodableProperties,
            DeadLetterReason::PayloadMismatch,
            DeadLetterReason::PermanentError,
            DeadLetterReason::AttemptsExhausted,
            DeadLetterReason::HeadersTooLarge,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }

    /// The reason as an OpenTelemetry `error.type`: a short identifier.
    pub(crate) fn error_type(self) -> &'static str {
        match self {
            DeadLetterReason::MissingMessageId => "missing_message_id",
            DeadLetterReason::InvalidMessageId => "invalid_message_id",
            DeadLetterReason::UndecodableBody => "undecodable_body",
            DeadLetterReason::UndecodableProperties => "undecodable_properties",
            DeadLetterReason::PayloadMismatch => "payload_mismatch",
            DeadLetterReason::PermanentError => "permanent_error",
            DeadLetterReason::AttemptsExhausted => "attempts_exhausted",
            DeadLetterReason::HeadersTooLarge => "headers_too_large",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
