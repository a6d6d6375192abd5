//! The consumer, written once for every transport: what a handler receives
//! and returns, the retry policy, the consumer's health, counters and
//! shutdown. A transport ([`amqp`](crate::amqp), [`nats`](crate::nats))
//! carries the deliveries; everything between a delivery and its settlement
//! lives here.
//!
//! A consumer takes each delivery through one PostgreSQL transaction: claim
//! the message id in the [inbox](crate::inbox), run the handler on the same
//! transaction, commit, and only then acknowledge. The broker delivers at
//! least once; the committed claim makes every further copy a no-op, so the
//! handler's *database writes* happen exactly once. Effects outside the
//! transaction (an HTTP call, an e-mail) stay at-least-once unless they carry
//! a key derived from the message id.
//!
//! What happens on each failure:
//!
//! | failure | outcome |
//! |---|---|
//! | handler returns a transient error, panics or times out | rollback; redelivered later per the [`RedeliveryPolicy`] |
//! | transient failures use up `max_attempts` | dead-lettered with reason `max attempts exceeded` |
//! | handler returns a permanent error | rollback; dead-lettered with its reason |
//! | undecodable body, missing/empty/over-255-byte id | dead-lettered with its reason |
//! | same id, different body | handler not run; dead-lettered as "message id reused with a different payload" |
//! | commit fails | not acknowledged; retried |
//! | database unreachable, backend killed | rollback; the delivery waits until the database answers, then runs again |
//! | broker connection lost | reconnect with backoff; the redelivery is deduplicated |
//! | crash after commit, before the ack | redelivered, claimed as a duplicate, acknowledged |
//!
//! # Batch mode
//!
//! Per-message mode (`handler`) runs one transaction per delivery: the
//! lowest latency. Batch mode (`batch_handler`, or `.handler(h).batch(n)`)
//! trades a few milliseconds for throughput: up to `size` deliveries (or
//! those that arrived within `batch_linger`, 5 ms by default) share one
//! transaction. Both go through the same steps: a batch is one *unit*, a
//! delivery on its own is a unit of one. All their ids are claimed in one
//! statement, sorted so that concurrent batches cannot deadlock; the handler
//! runs once (a batch handler gets all fresh messages, so it can write them
//! with bulk statements) or once per fresh message (a per-message handler);
//! one commit; then the acks. Duplicates are acknowledged without running the
//! handler; poison and reused ids are dead-lettered as in per-message mode.
//! If the batch fails, it rolls back and each of its deliveries is processed
//! on its own, so only the failing one is retried or dead-lettered. Two
//! batches are in flight at once, each on its own database connection.
//!
//! ## Words
//!
//! A *dead letter* is a delivery put aside for good; it goes to the
//! transport's own store (RabbitMQ: the queue `<queue>.dlq`) or to the
//! `dead_letters` table ([`DeadLetters`]). A *redelivery* is a consumer's
//! second try of a delivery that failed transiently ([`RedeliveryPolicy`]);
//! *retry* is the outgoing side's word (`idempo::retry` for HTTP calls).

pub use crate::runtime::builder::ConsumerBuilder;
pub use crate::runtime::consumer::Consumer;
pub use crate::runtime::dead_letter::DeadLetterReason;
pub use crate::runtime::handler::{ErrorKind, Handler, HandlerError, ResultExt};
pub use crate::runtime::health::{Health, HealthSnapshot, RuntimeState};
pub use crate::runtime::heartbeat;
pub use crate::runtime::letters::DeadLetters;
pub use crate::runtime::message::{DecodeError, FromMessage, JsonBody, Message};
pub use crate::runtime::message_id::MessageIdSource;
pub use crate::runtime::redelivery::RedeliveryPolicy;
pub use crate::runtime::shutdown::ShutdownHandle;
pub use crate::runtime::stats::{Stats, StatsSnapshot};
pub use crate::runtime::watched::Watched;
#[cfg(feature = "window")]
#[cfg_attr(docsrs, doc(cfg(feature = "window")))]
pub use crate::runtime::window_mode::WindowHandler;

pub mod mode;
pub mod transport;
