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
//! | `traceparent`, `tracestate` | a message staged in the outbox inside a traced span | the outbox |
//! | `Idempotency-Key`, `Idempotent-Replayed` | HTTP requests and replayed answers | the `http` layer, the `retry` client |
//!
//! The headers idempo writes on the copies it makes (the `x-idempo-*` rows
//! but the dedup id) are its wire format, not an API: read them through
//! `ops::dead_letters::Letter`, which parses them. The constants below are
//! the headers a producer or client sets; the dedup window's are
//! `amqp::window::Outgoing::{DEDUP_ID_HEADER, GROUP_ID_HEADER}` and the
//! replayed answer's `http::IdempotencyKey::REPLAYED_HEADER`.

/// The header that carries a W3C trace context: a message's creation
/// context (see [`otel`](crate::otel), feature `otel`).
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// The header that carries the vendor part of a W3C trace context, beside
/// [`TRACEPARENT_HEADER`].
pub const TRACESTATE_HEADER: &str = "tracestate";

/// The request header that carries an idempotency key: read by the
/// `http` layer, sent by the `retry` client.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
