//! The crate's error type, and the checks that classify it.

use std::error::Error as StdError;

/// A specialized `Result` whose error defaults to [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in idempo's own machinery.
///
/// Errors raised *by handlers* are a different thing: see
/// `amqp::HandlerError`. Code that must decide what to do with an error asks
/// it: [`is_connection_error`](Error::is_connection_error),
/// [`is_aborted_transaction`](Error::is_aborted_transaction),
/// [`is_too_many_clients`](Error::is_too_many_clients).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A statement against PostgreSQL failed (connection lost, constraint, ...).
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),

    /// Applying idempo's migrations failed.
    #[error("migration error: {0}")]
    Migrate(#[from] Box<sqlx::migrate::MigrateError>),

    /// A record read back from a store is not in the format idempo writes.
    #[error("corrupt record in the store: {0}")]
    CorruptRecord(String),

    /// A message id is missing, empty or too long.
    #[error(transparent)]
    InvalidMessageId(#[from] crate::message_id::InvalidMessageId),

    /// The claim of a message id was no longer in the transaction at commit:
    /// the caller ended the transaction itself (`ROLLBACK`, `COMMIT`). Nothing
    /// was committed by [`Inbox::commit`](crate::inbox::Inbox::commit).
    #[error("the claim of {message_id:?} was gone at commit: the transaction was ended by hand")]
    ClaimLost {
        /// The message id whose claim was checked.
        message_id: String,
    },

    /// A TLS handshake was refused (a wrong CA, a host name the certificate
    /// does not name, a port that does not speak TLS): a configuration error
    /// that no retry can fix, reported at once.
    #[error("TLS to {service} failed: {reason}")]
    Tls {
        /// The service (`RabbitMQ`, `PostgreSQL`, `Redis`).
        service: String,
        /// Why, per address.
        reason: String,
    },

    /// A certificate or key file is missing or unusable: the error names the
    /// file and what is wrong with it.
    #[error(transparent)]
    Certificate(#[from] crate::certificate::CertificateError),

    /// Some of idempo's migrations are not applied to the database, and this
    /// process was told not to apply them (`Schema::Check`).
    #[error(
        "idempo's schema is behind: migration(s) {missing:?} not applied; run `idempo migrate` \
         (or `idempo::migrate`) as a role that may create tables"
    )]
    SchemaBehind {
        /// The versions that are missing.
        missing: Vec<i64>,
    },

    /// The operating system gave no random bytes for a key, token or id
    /// (`getrandom` failed): idempo refuses to make them from a weaker source.
    #[error("the operating system gave no random bytes: {0}")]
    Randomness(#[source] std::io::Error),

    /// A builder was given an impossible configuration.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// An error of one of idempo's feature modules, kept whole (the
    /// outbox's `OutboxError` when a staging is refused, say): ask it with
    /// [`downcast_ref`](Error::downcast_ref).
    /// The ground floor names no feature, so this is how `?` carries their
    /// errors into an `idempo::Error`.
    #[error(transparent)]
    Other(Box<dyn StdError + Send + Sync + 'static>),

    /// [`Tx::try_lock`](crate::Tx::try_lock) was called while a guard of the
    /// same transaction was still held.
    #[error("the transaction is already locked: hold one guard at a time")]
    TransactionBusy,

    /// A [`Tx`](crate::Tx) handle was used after its handler returned:
    /// the transaction was already committed or rolled back.
    #[error("the transaction was already finished: a Tx handle outlived its handler")]
    TransactionFinished,
}

/// `getrandom` failed: [`Error::Randomness`] (and the outbox's) once it
/// leaves the crate.
#[derive(Debug)]
pub(crate) struct RandomnessUnavailable(pub(crate) getrandom::Error);

impl From<RandomnessUnavailable> for std::io::Error {
    fn from(e: RandomnessUnavailable) -> Self {
        e.0.into()
    }
}

impl From<RandomnessUnavailable> for Error {
    fn from(e: RandomnessUnavailable) -> Self {
        Error::Randomness(e.into())
    }
}

impl From<sqlx::migrate::MigrateError> for Error {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        Error::Migrate(Box::new(e))
    }
}

impl Error {
    /// The error of a feature module inside [`Error::Other`], if it is a `T`.
    pub fn downcast_ref<T: StdError + 'static>(&self) -> Option<&T> {
        match self {
            Error::Other(e) => e.downcast_ref(),
            _ => None,
        }
    }

    /// Whether the database (or the connection to it) is gone or refuses us,
    /// as opposed to a problem with one statement or one message: I/O and
    /// TLS errors, pool timeouts, every error PostgreSQL reports as `FATAL`
    /// (a refused login, 28000; a database in maintenance that does not
    /// accept connections, 55000; a terminated backend, 57P01; ...), SQLSTATE
    /// class 08 except 08P01, 57P01–57P03 and 53300 (no connection slot left:
    /// [`is_too_many_clients`](Error::is_too_many_clients)).
    ///
    /// A statement that fails this way may or may not have taken effect (a
    /// `COMMIT` whose answer was lost): find out before acting on it again.
    pub fn is_connection_error(&self) -> bool {
        match self {
            Error::Database(e) => crate::sqlstate::is_connection_error(e),
            _ => false,
        }
    }

    /// Whether the database cannot take this write *now*, for a reason that
    /// is the server's and not the statement's: every
    /// [connection error](Error::is_connection_error), and these SQLSTATEs
    /// (whatever the severity):
    ///
    /// | SQLSTATE | meaning | what it looks like |
    /// |---|---|---|
    /// | `08xxx` but `08P01` | connection exception | a server gone, a refused or lost connection |
    /// | `25006` | read-only SQL transaction | a demoted primary, a replica behind a failover address, `default_transaction_read_only` |
    /// | `53xxx` | insufficient resources | disk full (53100), out of memory (53200), too many clients (53300), a configuration limit (53400) |
    /// | `57P01`–`57P05` | operator intervention | admin or crash shutdown, cannot connect now, database dropped, idle session timeout |
    /// | `58xxx` | system error | an I/O error (58030), a missing file (58P01) |
    ///
    /// A delivery of the AMQP consumer that meets one waits at the database
    /// gate: no attempt is spent, nothing is dead-lettered; the HTTP layer
    /// answers 503. Unlike a connection error, a statement refused this way
    /// took no effect.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Error::Database(e) => crate::sqlstate::is_unavailable(e),
            _ => false,
        }
    }

    /// Whether PostgreSQL refused the statement itself, for its text or its
    /// data (SQLSTATE class `22` data exception, `23` integrity constraint
    /// violation, `42` syntax error or access rule): the same statement on
    /// the same data fails again, so running it again is pointless (the
    /// consumer dead-letters a handler's error of this kind at once). False
    /// for every error that is not the database's.
    pub fn is_permanent(&self) -> bool {
        match self {
            Error::Database(e) => crate::sqlstate::is_permanent(e),
            _ => false,
        }
    }

    /// Whether a statement ran in a transaction that an earlier failed
    /// statement had aborted (SQLSTATE 25P02): nothing of that transaction
    /// can commit.
    pub fn is_aborted_transaction(&self) -> bool {
        self.is_sqlstate(crate::sqlstate::IN_FAILED_TRANSACTION)
    }

    /// Whether PostgreSQL refused a connection because it has no slot left
    /// (`FATAL: sorry, too many clients already`, SQLSTATE 53300): the server
    /// is up, its `max_connections` is used up.
    pub fn is_too_many_clients(&self) -> bool {
        self.is_sqlstate(crate::sqlstate::TOO_MANY_CONNECTIONS)
    }

    fn is_sqlstate(&self, code: &str) -> bool {
        matches!(self, Error::Database(e) if crate::sqlstate::is(e, code))
    }
}
