//! Every header name idempo reads or writes, in one place: what a client in
//! another language (or an operator reading a queue) needs to know of
//! idempo's wire format.
//!
//! | header | written on | by |
//! |---|---|---|
//! | `x-idempo-reason`, `x-idempo-error`, `x-idempo-attempts`, `x-idempo-first-failure`, `x-idempo-last-failure` | retried and dead-lettered copies | the consumer runtime |
//! | `x-idempo-consumer`, `x-idempo-original-queue`, `x-idempo-original-routing-key`, `x-idempo-original-expiration` | the same copies: where the original came from | the consumer runtime |
//! | `x-idempo-message-id`, `x-idempo-message-id-seal` | every copy with a usable id | the consumer runtime |
//! | `x-idempo-trimmed-headers` | a dead letter trimmed to fit the frame | the consumer runtime |
//! | `x-idempo-replay-history`, `x-idempo-replay-count` | a replayed dead letter | `idempo dlq replay` |
//! | `x-idempo-dedup-id`, `x-group-id` | a message sent through the dedup window | `DedupPublisher` |
//! | `traceparent` | a message staged in the outbox inside a traced span | the outbox |
//! | `Idempotency-Key`, `Idempotent-Replayed` | HTTP requests and replayed answers | the `http` layer, the `retry` client |
//!
//! Read the failure headers of a dead letter through `ops::dead_letters::Letter`
//! rather than by name: it parses them.

/// Why the message was dead-lettered (one of `DeadLetterReason::as_str`, feature `amqp`).
pub const REASON_HEADER: &str = "x-idempo-reason";
/// The text of the last error.
pub const ERROR_HEADER: &str = "x-idempo-error";
/// The consumer that retried or dead-lettered the message.
pub const CONSUMER_HEADER: &str = "x-idempo-consumer";
/// The queue the message was consumed from.
pub const QUEUE_HEADER: &str = "x-idempo-original-queue";
/// The routing key the message was originally published with.
pub const ROUTING_KEY_HEADER: &str = "x-idempo-original-routing-key";
/// The original per-message TTL, which republished copies drop (a dead letter
/// must not expire out of the DLQ, a retry must not expire in its delay queue).
pub const ORIGINAL_EXPIRATION_HEADER: &str = "x-idempo-original-expiration";
/// The id idempo deduplicated the original on, written on every copy (with
/// [`MESSAGE_ID_SEAL_HEADER`]): a copy's properties differ from the
/// original's (routing key, expiration), so an id derived from them must not
/// be derived again. Not written when the original had no usable id.
pub const MESSAGE_ID_HEADER: &str = "x-idempo-message-id";
/// The seal of [`MESSAGE_ID_HEADER`]: an HMAC-SHA256 (hex) of the consumer,
/// the id and the body's hash under a per-consumer secret. Only an id with a
/// valid seal is carried forward; a header without one is ignored.
pub const MESSAGE_ID_SEAL_HEADER: &str = "x-idempo-message-id-seal";
/// The headers removed from a dead letter so that it fits the broker's frame
/// size, as `name=bytes` pairs, largest first (for example
/// `x-pad=130811`). RabbitMQ closes the connection on a larger header frame,
/// so a copy that would not fit is trimmed: first the largest headers that
/// are not idempo's, then the error text and the replay history.
pub const TRIMMED_HEADERS_HEADER: &str = "x-idempo-trimmed-headers";
/// How many attempts have failed so far (an integer).
pub const ATTEMPTS_HEADER: &str = "x-idempo-attempts";
/// When the first attempt failed (RFC 3339, UTC).
pub const FIRST_FAILURE_HEADER: &str = "x-idempo-first-failure";
/// When the last attempt failed (RFC 3339, UTC).
pub const LAST_FAILURE_HEADER: &str = "x-idempo-last-failure";

/// The header a replayed copy carries its failure history in: a JSON array
/// of replay records (reason, error, attempts, first and last failure,
/// replayed at), one per replay, oldest first, of the last
/// `MAX_REPLAY_HISTORY` replays only (the header would otherwise grow
/// with every replay until the message no longer fits a frame). Written by
/// `DeadLetter::replay_properties`, read by `DeadLetter::replay_history`.
pub const REPLAY_HISTORY_HEADER: &str = "x-idempo-replay-history";

/// How many times the message was replayed in all (an integer), including
/// the replays whose records left the [`REPLAY_HISTORY_HEADER`].
pub const REPLAY_COUNT_HEADER: &str = "x-idempo-replay-count";

/// The header that carries a message's dedup id (`DedupPublisher`, features
/// `amqp` + `window`).
pub const DEDUP_ID_HEADER: &str = "x-idempo-dedup-id";

/// The header that carries a message's group id (SQS's `MessageGroupId`).
pub const GROUP_ID_HEADER: &str = "x-group-id";

/// The header that carries a W3C trace context.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// The request header that carries an idempotency key: read by the
/// `http` layer, sent by the `retry` client.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// The response header that marks an answer replayed from the idempotency
/// store (`Idempotent-Replayed: true`) rather than produced by the handler.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
