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

pub(crate) mod model;
pub(crate) mod queries;
pub(crate) mod replay;
pub(crate) mod view;
