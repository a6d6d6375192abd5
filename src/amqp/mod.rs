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
//! | handler returns a transient error, panics or times out | rollback; republished to a delay queue per the [`RetryPolicy`], then acked |
//! | transient failures use up `max_attempts` | dead-lettered with reason `max attempts exceeded` |
//! | handler returns a permanent error | rollback; published to the DLQ with header `x-idempo-reason`, then acked |
//! | undecodable body, missing/empty/over-255-byte id | published to the DLQ with its reason, then acked |
//! | same id, different body | handler not run; DLQ with reason "message id reused with a different payload" |
//! | commit fails | not acked; retried |
//! | database unreachable, backend killed | rollback; the delivery waits until the database answers, then runs again |
//! | broker connection lost, consumer cancelled | reconnect with backoff; the redelivery is deduplicated |
//! | crash after commit, before ack | redelivered, claimed as duplicate, acked |
//!
//! See <https://www.rabbitmq.com/docs/confirms> for RabbitMQ's acknowledgement semantics.

mod backoff;
mod builder;
mod consumer;
mod database_gate;
mod dead_letter;
mod delivery;
mod handler;
mod headers;
mod health;
mod message;
mod message_id;
mod republish;
mod retention;
mod retry;
mod stats;
mod topology;

pub use builder::ConsumerBuilder;
pub use consumer::{Consumer, ShutdownHandle};
pub use dead_letter::DeadLetterReason;
pub use handler::{ErrorKind, HandlerError, ResultExt, Tx, TxGuard};
pub use headers::{
    ATTEMPTS_HEADER, CONSUMER_HEADER, ERROR_HEADER, FIRST_FAILURE_HEADER, LAST_FAILURE_HEADER,
    MESSAGE_ID_HEADER, ORIGINAL_EXPIRATION_HEADER, QUEUE_HEADER, REASON_HEADER, ROUTING_KEY_HEADER,
};
pub use health::{Health, HealthSnapshot, RuntimeState};
pub use message::{DecodeError, FromMessage, Json, Message};
pub use message_id::{IdFn, MessageIdSource};
pub use retry::RetryPolicy;
pub use stats::{Stats, StatsSnapshot};
pub use topology::QueueType;

pub use lapin;
