//! [`OpsError`]: why an operation failed.

use crate::amqp::PublishError;

/// A specialized `Result` whose error defaults to [`OpsError`].
pub(crate) type Result<T, E = OpsError> = std::result::Result<T, E>;

/// Why an operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// PostgreSQL could not be reached (the URL without its password).
    #[error("cannot connect to PostgreSQL at {url}")]
    DatabaseUnreachable {
        /// The database URL, without its password.
        url: String,
        /// Why.
        #[source]
        source: sqlx::Error,
    },
    /// The broker URLs do not parse.
    #[error("AMQP_URL {urls} is invalid")]
    InvalidBrokerUrl {
        /// The URLs, without their passwords.
        urls: String,
        /// Why.
        #[source]
        source: crate::Error,
    },
    /// No broker node could be reached.
    #[error("cannot connect to RabbitMQ at {urls}")]
    BrokerUnreachable {
        /// The URLs, without their passwords.
        urls: String,
        /// Why (the last node's error).
        #[source]
        source: crate::Error,
    },
    /// RabbitMQ's management API did not answer as expected.
    #[error("RabbitMQ's management API at {url}: {message}")]
    Management {
        /// Where it was asked, without credentials.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// A queue named by the caller does not exist.
    #[error("queue {queue:?} does not exist")]
    QueueNotFound {
        /// The queue.
        queue: String,
    },
    /// The dead-letter queue of a queue does not exist.
    #[error("queue {dlq:?} does not exist (is {queue:?} the right queue, on the right vhost?)")]
    DeadLetterQueueNotFound {
        /// The queue the caller named.
        queue: String,
        /// Its dead-letter queue.
        dlq: String,
    },
    /// A passive declare failed for another reason than a missing queue.
    #[error("cannot inspect queue {queue:?}")]
    InspectQueue {
        /// The queue.
        queue: String,
        /// Why.
        #[source]
        source: lapin::Error,
    },
    /// Fetching from a queue failed.
    #[error("cannot read {queue}")]
    ReadQueue {
        /// The queue.
        queue: String,
        /// Why.
        #[source]
        source: lapin::Error,
    },
    /// No dead letter has this message id.
    #[error("no dead letter with message id {message_id:?} in {dlq}")]
    DeadLetterNotFound {
        /// The id asked for.
        message_id: String,
        /// The dead-letter queue searched.
        dlq: String,
    },
    /// An operation asked a RabbitMQ DLQ for what only the table store
    /// answers (a filter it cannot apply, grouping, discarding, a row).
    #[error(
        "{what} needs the table store: the dead letters are in the RabbitMQ queue {dlq:?} (keep them in PostgreSQL with DeadLetters::Table, or move them there with `idempo dlq import`)"
    )]
    NeedsTable {
        /// What was asked.
        what: &'static str,
        /// The DLQ.
        dlq: String,
    },
    /// A replay must select its dead letters: by id, by reason, or all of them.
    #[error("say which dead letters to replay: by id, by reason, or all")]
    NothingSelected,
    /// The work queue a dead letter would be replayed to does not exist.
    #[error(
        "the work queue {queue:?} does not exist: start its consumer (which declares it) or name another target"
    )]
    TargetQueueNotFound {
        /// The work queue.
        queue: String,
    },
    /// The broker did not confirm a replayed copy: the dead letter stays in
    /// its DLQ (the copy may or may not be in the work queue; a consumer
    /// drops a second copy as a duplicate).
    #[error(
        "the broker did not confirm the copy of {message_id:?} to {queue:?}; it stays in the DLQ"
    )]
    NotConfirmed {
        /// The dead letter's id.
        message_id: Option<String>,
        /// The work queue.
        queue: String,
        /// Why.
        #[source]
        source: Box<PublishError>,
    },
    /// Acknowledging (deleting) a replayed dead letter failed: the copy is in
    /// the work queue and the dead letter back in the DLQ.
    #[error("acking the replayed dead letter")]
    Ack(#[source] lapin::Error),
    /// Reaping one consumer's claims failed.
    #[error("reaping {consumer}")]
    Reap {
        /// The consumer.
        consumer: String,
        /// Why.
        #[source]
        source: crate::Error,
    },
    /// Applying the migrations failed.
    #[error("migrating failed")]
    Migrate(#[source] crate::Error),
    /// A channel operation failed.
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    /// A query failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// A library call failed.
    #[error(transparent)]
    Idempo(#[from] crate::Error),
}
