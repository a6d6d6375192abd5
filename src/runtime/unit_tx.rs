//! A unit's transaction, the consumer runtime's own way: how it begins
//! (plain `BEGIN` once the pool's sessions are known to default to READ
//! COMMITTED, on an idle connection first) and how it commits (the claims'
//! check, the deferred statements and `COMMIT AND CHAIN` in one round trip).
//! The claims in between are the [inbox](crate::inbox)'s; the wire shape is
//! in its module docs.

use sqlx::postgres::PgTransactionManager;
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};
use sqlx_core::transaction::TransactionManager;

use crate::error::Result;

/// `no_active_sql_transaction`: how a unit's commit finds the transaction
/// its handler ended.
const NO_ACTIVE_TRANSACTION: &str = "25P01";

/// How [`begin`] gets its transaction to READ COMMITTED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    /// `BEGIN ISOLATION LEVEL READ COMMITTED`, whatever the session's
    /// default.
    Set,
    /// The pool's sessions are known to default to READ COMMITTED
    /// ([`sessions`]): one statement less, which PostgreSQL's end of
    /// transaction does not have to undo.
    Default,
}

/// What the consumer runtime learns once of its pool's sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sessions {
    /// They default to READ COMMITTED (PostgreSQL's own default).
    pub(crate) read_committed: bool,
}

/// Asks one of `pool`'s connections for its default isolation level.
pub(crate) async fn sessions(pool: &PgPool) -> Result<Sessions> {
    let level: String =
        sqlx::query_scalar("SELECT current_setting('default_transaction_isolation')")
            .fetch_one(pool)
            .await?;
    Ok(Sessions {
        read_committed: level == "read committed",
    })
}

/// Opens a unit's transaction on `pool`: READ COMMITTED whatever the
/// session's default, unless that is known to be it; then, with
/// `idle_first`, on an idle connection without the pool's checks when there
/// is one.
pub(crate) async fn begin(
    pool: &PgPool,
    isolation: Isolation,
    idle_first: bool,
) -> Result<Transaction<'static, Postgres>> {
    if isolation == Isolation::Set {
        return crate::inbox::claim::begin(pool).await;
    }
    // An idle connection as it is: `try_begin` skips the pool's
    // acquire-time ping (and its `before_acquire` hook), a round trip per
    // message. A connection that died while idle only fails this `BEGIN`,
    // which wrote nothing: the pool's checked path follows.
    if idle_first {
        match pool.try_begin().await {
            Ok(Some(tx)) => return Ok(tx),
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(error = %e, "an idle connection failed BEGIN; taking another");
            }
        }
    }
    Ok(pool.begin_with("BEGIN").await?)
}

/// The commit of a unit the runtime claimed itself (so every claim is in
/// `tx` unless the handler ended the transaction), with `statements` (SQL
/// of idempo's own, literals only, each followed by `; `) run just before
/// `COMMIT`: one simple query, one round trip,
/// `SELECT; <statements>COMMIT AND CHAIN`. Nothing in it reads a table or
/// needs planning, so PostgreSQL's parse costs less than the round trip of
/// [`Inbox::commit`](crate::inbox::Inbox::commit)'s prepared check. It
/// commits nothing:
/// - in an aborted transaction (the handler ignored a failed statement):
///   `SELECT` fails (`25P02`), and a simple query stops at its first error;
/// - when the handler ended the transaction itself: the statements run in
///   an implicit transaction, where `COMMIT AND CHAIN` fails (`25P01`) and
///   takes them with it; reported as
///   [`Error::ClaimLost`](crate::Error::ClaimLost).
///
/// `message_id` names the unit in that error. The empty transaction the
/// chain opens is rolled back when `tx` is dropped, with the pool's check
/// of the released connection: no round trip of its own.
pub(crate) async fn commit(
    mut tx: Transaction<'static, Postgres>,
    message_id: &str,
    statements: &str,
) -> Result<()> {
    if PgTransactionManager::get_transaction_depth(&tx) != 1 {
        // Not a unit's transaction: a savepoint's release cannot chain.
        return Err(sqlx::Error::Protocol("a unit commits its own transaction".into()).into());
    }
    sqlx::raw_sql(AssertSqlSafe(format!(
        "SELECT; {statements}COMMIT AND CHAIN"
    )))
    .execute(&mut *tx)
    .await
    .map_err(crate::inbox::claim::lost_on(
        NO_ACTIVE_TRANSACTION,
        message_id,
    ))?;
    Ok(())
}
