//! The crate's error type.

/// A specialized `Result` whose error defaults to [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in idempo's own machinery.
///
/// Errors raised *by handlers* are a different thing: see
/// [`HandlerError`](crate::amqp::HandlerError).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A statement against PostgreSQL failed (connection lost, constraint, ...).
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),

    /// Applying idempo's migrations failed.
    #[error("migration error: {0}")]
    Migrate(#[from] Box<sqlx::migrate::MigrateError>),

    /// The AMQP connection or channel failed.
    #[cfg(feature = "amqp")]
    #[error("amqp error: {0}")]
    Amqp(#[from] lapin::Error),

    /// A Redis command failed (connection lost, timeout, script error).
    #[cfg(feature = "redis")]
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),

    /// A record read back from a store is not in the format idempo writes.
    #[error("corrupt record in the store: {0}")]
    CorruptRecord(String),

    /// A bounded in-memory window is full of live ids: refusing is safer
    /// than forgetting one (its duplicate would pass).
    #[error("the dedup window is full ({capacity} live ids)")]
    WindowFull {
        /// The window's capacity.
        capacity: usize,
    },

    /// A deduplication id was refused.
    #[cfg(feature = "window")]
    #[error(transparent)]
    InvalidDedupId(#[from] crate::window::InvalidDedupId),

    /// The broker did not confirm a publish (nacked, unroutable, timed out).
    #[error("publish not confirmed: {0}")]
    PublishNotConfirmed(String),

    /// A message id is missing, empty or too long.
    #[error(transparent)]
    InvalidMessageId(#[from] crate::inbox::InvalidMessageId),

    /// The broker cancelled our consumer (for example: the queue was deleted).
    #[error("the broker cancelled the consumer of queue {queue:?}")]
    ConsumerCancelled {
        /// The queue that was being consumed.
        queue: String,
    },

    /// A builder was given an impossible configuration.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// [`Tx::lock`](crate::Tx::lock) was called while a guard of the same
    /// transaction was still held.
    #[error("the transaction is already locked: hold one guard at a time")]
    TransactionBusy,

    /// A [`Tx`](crate::Tx) handle was used after its handler returned:
    /// the transaction was already committed or rolled back.
    #[error("the transaction was already finished: a Tx handle outlived its handler")]
    TransactionFinished,
}

impl From<sqlx::migrate::MigrateError> for Error {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        Error::Migrate(Box::new(e))
    }
}
