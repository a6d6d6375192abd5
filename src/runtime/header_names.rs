//! The names of the headers idempo writes on the copies it makes (retries,
//! dead letters, replays): its wire format, documented in
//! [`crate::headers`]'s table. Read by the runtime, the transports and the
//! dead-letter views.

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
/// The id idempo deduplicated the original on, written on every copy (with
/// [`MESSAGE_ID_SEAL_HEADER`]): a copy's properties differ from the
/// original's (routing key, expiration), so an id derived from them must not
/// be derived again. Not written when the original had no usable id.
pub(crate) const MESSAGE_ID_HEADER: &str = "x-idempo-message-id";
/// The seal of [`MESSAGE_ID_HEADER`]: an HMAC-SHA256 (hex) of the consumer,
/// the id and the body's hash under a per-consumer secret. Only an id with a
/// valid seal is carried forward; a header without one is ignored.
pub(crate) const MESSAGE_ID_SEAL_HEADER: &str = "x-idempo-message-id-seal";
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
