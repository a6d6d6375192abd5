//! Dead letters kept in PostgreSQL (features `amqp` + `outbox`): the
//! `dead_letters` table a consumer configured with
//! [`DeadLetters::Table`] writes, its queries and its replay; and the one
//! model of a dead letter whichever store keeps it. Operators reach them
//! through [`idempo::ops::dead_letters`](crate::ops::dead_letters) (feature
//! `ops`), which reads a RabbitMQ DLQ behind the same API.
//!
//! # Why a table
//! A RabbitMQ dead-letter queue can only be read by taking messages off it
//! (and on RabbitMQ 4.x every such read of a quorum queue spends one of its
//! delivery attempts). A table answers "which letters of this queue failed
//! with this cause since 03:00" with an index, groups them by
//! **fingerprint** (the reason and the error text with ids, numbers and
//! quoted values masked), and makes a replay exactly once by construction:
//! each batch is one transaction that locks its letters (`FOR UPDATE SKIP
//! LOCKED`), stages each in the [outbox](crate::outbox) under its original
//! message id, and marks it replayed.

mod fingerprint;
#[cfg(feature = "ops")]
pub(crate) mod model;
#[cfg(feature = "ops")]
pub(crate) mod queries;
#[cfg(feature = "ops")]
pub(crate) mod replay;
pub(crate) mod table;
#[cfg(feature = "ops")]
pub(crate) mod view;

#[cfg(feature = "ops")]
pub(crate) use fingerprint::fingerprint;
pub(crate) use table::{Row, TableStore, insert};

/// Where a consumer puts its dead letters
/// ([`ConsumerBuilder::dead_letters`](crate::amqp::ConsumerBuilder::dead_letters)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeadLetters {
    /// The RabbitMQ queue `<queue>.dlq` (or the one configured): the default.
    #[default]
    Queue,
    /// The `dead_letters` table, in a transaction of its own; the delivery
    /// is acked only after that commit, and waits while PostgreSQL cannot
    /// take it.
    Table,
}
