//! [`Tx`]: an owned handle to an open PostgreSQL transaction, shared by the
//! AMQP runtime's handlers and the HTTP layer's atomic phase.

use std::any::Any;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sqlx::{PgConnection, Postgres, Transaction};
use tokio::sync::{Mutex, MutexGuard};

/// A handle to an open PostgreSQL transaction that idempo owns and finishes:
///
/// - in an [AMQP handler](crate::amqp), the delivery's transaction, in which
///   the message's id was claimed;
/// - in an HTTP handler behind the idempotency layer (feature `http`, as an
///   axum extractor), the transaction that also completes the
///   `Idempotency-Key` record with the response.
///
/// Everything written through it commits or rolls back together with that
/// claim or record. Clone it freely within the handler.
///
/// # Why a handle and not `&mut Transaction`
/// A closure whose returned future borrows its argument (`|tx: &mut Transaction, msg| async
/// move { ... }`) cannot be written on stable Rust so that the future is also
/// `Send`, which the runtime needs to run handlers on tokio's worker threads.
/// Async closures (`async |tx, msg| ...`) borrow fine but give no way to require
/// a `Send` future either. So the handler gets an owned, `'static` [`Tx`] handle
/// to the transaction and locks it where it issues statements:
///
/// ```
/// use idempo::Tx;
///
/// async fn record_seen(tx: Tx, account: String) -> idempo::Result<()> {
///     let mut conn = tx.try_lock()?;          // a guard that derefs to PgConnection
///     sqlx::query("INSERT INTO seen (account) VALUES ($1)")
///         .bind(&account)
///         .execute(&mut *conn)                 // `&mut *conn` is an Executor
///         .await?;
///     Ok(())
/// }
/// ```
///
/// idempo takes the transaction back when the handler's future completes
/// and commits or rolls it back; a `Tx` clone kept beyond that point only
/// yields [`Error::TransactionFinished`](crate::error::Error::TransactionFinished).
#[derive(Clone)]
pub struct Tx {
    inner: Arc<Mutex<Option<Transaction<'static, Postgres>>>>,
    attachment: Option<Attachment>,
}

/// What the runtime that owns a transaction attaches to it for the code
/// that runs on it (a consumer unit's outbox buffer, say), read by the
/// module that defined its type. Set when the [`Tx`] is made; read-only
/// afterwards.
pub(crate) type Attachment = Arc<dyn Any + Send + Sync>;

impl fmt::Debug for Tx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}

impl Tx {
    /// The handle of `tx`, with what its owner attaches for the code that
    /// runs on it.
    pub(crate) fn new(tx: Transaction<'static, Postgres>, attachment: Option<Attachment>) -> Self {
        Tx {
            inner: Arc::new(Mutex::new(Some(tx))),
            attachment,
        }
    }

    /// Locks the transaction for issuing statements, **without waiting**;
    /// `&mut *guard` is a `&mut PgConnection`, which sqlx accepts as an
    /// executor.
    ///
    /// A transaction is one connection, so its statements run one after the
    /// other: hold one guard and reuse it for several statements. Taking a
    /// second guard while one is held fails at once instead of waiting
    /// (waiting would deadlock a handler that still holds the first), and
    /// so does locking from two futures polled together (`join!`): run
    /// statements of one transaction in sequence.
    ///
    /// # Errors
    /// - [`Error::TransactionBusy`](crate::error::Error::TransactionBusy) when a guard
    ///   is already held;
    /// - [`Error::TransactionFinished`](crate::error::Error::TransactionFinished) when
    ///   called after the handler returned.
    pub fn try_lock(&self) -> crate::error::Result<TxGuard<'_>> {
        let guard = self
            .inner
            .try_lock()
            .map_err(|_| crate::error::Error::TransactionBusy)?;
        if guard.is_none() {
            return Err(crate::error::Error::TransactionFinished);
        }
        Ok(TxGuard {
            guard,
            attachment: self.attachment.as_deref(),
        })
    }

    /// Takes the transaction back for commit or rollback once the handler
    /// finished. `None` if a guard outlived the handler (held by a task it
    /// spawned): that transaction rolls back when the guard drops.
    pub(crate) fn take(&self) -> Option<Transaction<'static, Postgres>> {
        self.inner.try_lock().ok()?.take()
    }
}

/// The locked transaction; dereferences to [`PgConnection`].
pub struct TxGuard<'a> {
    guard: MutexGuard<'a, Option<Transaction<'static, Postgres>>>,
    attachment: Option<&'a (dyn Any + Send + Sync)>,
}

impl fmt::Debug for TxGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxGuard").finish_non_exhaustive()
    }
}

impl<'a> TxGuard<'a> {
    /// The transaction itself, e.g. to pass to [`Inbox::claim`](crate::inbox::Inbox::claim)
    /// or to open a savepoint with `begin()`.
    pub fn transaction(&mut self) -> &mut Transaction<'static, Postgres> {
        self.guard.as_mut().expect("checked in Tx::try_lock")
    }

    /// The connection, and what the transaction's owner attached to it.
    pub(crate) fn split(&mut self) -> (&mut PgConnection, Option<&'a (dyn Any + Send + Sync)>) {
        let conn = self.guard.as_mut().expect("checked in Tx::try_lock");
        (conn, self.attachment)
    }
}

impl Deref for TxGuard<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.guard.as_ref().expect("checked in Tx::try_lock")
    }
}

impl DerefMut for TxGuard<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.split().0
    }
}
