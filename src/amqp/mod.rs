//! The RabbitMQ consumer runtime (feature `amqp`).
//!
//! A [`Consumer`] takes each delivery through one PostgreSQL transaction:
//! claim the message id in the [inbox](crate::inbox), run the handler on the
//! same transaction, commit, and only then acknowledge. RabbitMQ delivers at
//! least once; the committed claim makes every further copy a no-op, so the
//! handler's *database writes* happen exactly once. Effects outside the
//! transaction (an HTTP call, an e-mail) stay at-least-once unless they carry
//! a key derived from the message id.
//!
//! What happens on each failure:
//!
//! | failure | outcome |
//! |---|---|
//! | handler returns a transient error, panics or times out | rollback; republished to a delay queue per the [`RedeliveryPolicy`], then acked |
//! | transient failures use up `max_attempts` | dead-lettered with reason `max attempts exceeded` |
//! | handler returns a permanent error | rollback; published to the DLQ with header `x-idempo-reason`, then acked |
//! | undecodable body, missing/empty/over-255-byte id | published to the DLQ with its reason, then acked |
//! | same id, different body | handler not run; DLQ with reason "message id reused with a different payload" |
//! | commit fails | not acked; retried |
//! | database unreachable, backend killed | rollback; the delivery waits until the database answers, then runs again |
//! | broker connection lost, consumer cancelled | reconnect with backoff; the redelivery is deduplicated |
//! | crash after commit, before ack | redelivered, claimed as duplicate, acked |
//!
//! # Batch mode
//!
//! Per-message mode ([`ConsumerBuilder::handler`]) runs one transaction per
//! delivery: the lowest latency. Batch mode ([`ConsumerBuilder::batch_handler`],
//! or `.handler(h).batch(n)`) trades a few milliseconds for throughput: up to
//! `size` deliveries (or those that arrived within
//! [`batch_linger`](ConsumerBuilder::batch_linger), 5 ms by default) share one
//! transaction. Both go through the same steps (`src/amqp/delivery.rs`): a
//! batch is one *unit*, a delivery on its own is a unit of one. All their ids are claimed in one statement, sorted so that
//! concurrent batches cannot deadlock; the handler runs once (a
//! [`batch_handler`](ConsumerBuilder::batch_handler) gets all fresh messages,
//! so it can write them with bulk statements) or once per fresh message (a
//! per-message [`handler`](ConsumerBuilder::handler)); one commit; then the
//! acks. Duplicates are acked without running the handler; poison and reused
//! ids are dead-lettered as in per-message mode. There are no savepoints on
//! the happy path: if the batch fails, it rolls back and each of its
//! deliveries is processed on its own, so only the failing one is retried or
//! dead-lettered. Two batches are in flight at once, each on its own
//! database connection, so the next batch is collected and claimed while the
//! previous one commits.
//!
//! See <https://www.rabbitmq.com/docs/confirms> for RabbitMQ's acknowledgement semantics.
//!
//! ## Words
//!
//! A *dead letter* is a delivery put aside for good; it goes to the **DLQ**
//! (`<queue>.dlq`, the RabbitMQ queue that holds a consumer's dead letters)
//! or to the `dead_letters` table (`idempo::ops::dead_letters` reads it, feature `ops`).
//! A *redelivery* is a consumer's second try of a delivery that failed
//! transiently ([`RedeliveryPolicy`]); *retry* is the outgoing side's word
//! (`idempo::retry` for HTTP calls).

/// The transport's name in the outbox, the dead-letter table and the
/// heartbeats.
pub(crate) const TRANSPORT: &str = "amqp";

mod acks;
pub(crate) mod broker;
pub(crate) mod builder;
pub(crate) mod config;
mod consumer;
mod consumer_relay;
pub(crate) mod copy;
pub(crate) mod delivery;
mod dispatch;
mod error;
pub(crate) mod fields;
pub(crate) mod fit;
mod message;
pub(crate) mod publish;
mod quarantine;
pub(crate) mod reconnect;
pub(crate) mod republish;
mod session;
pub(crate) mod telemetry;
pub(crate) mod topology;
pub(crate) mod urls;
#[cfg(feature = "window")]
#[cfg_attr(docsrs, doc(cfg(feature = "window")))]
pub mod window;

#[cfg(feature = "ops")]
pub(crate) use crate::runtime::seal::consumers_with_keys;
pub use broker::{
    AMQP_CA_FILE, AMQP_CLIENT_CERT_FILE, AMQP_CLIENT_KEY_FILE, Broker, DEFAULT_CONNECTION_TIMEOUT,
};
pub use builder::ConsumerBuilder;
pub use consumer::Consumer;
pub use error::{AmqpError, NodeFailure};
pub use publish::PublishError;
pub use topology::{QueueType, dead_letter_queue, work_queue};

pub use lapin;
