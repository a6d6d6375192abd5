//! The claim's SQL: every statement that claims, checks or commits a claim
//! in `processed_messages`, plain or partitioned, and the round trips that
//! carry them (the wire shape is in the [module docs](super)). The public
//! face is [`Inbox`](super::Inbox).

use std::collections::HashMap;

use sqlx::postgres::PgTransactionManager;
use sqlx::{AssertSqlSafe, PgExecutor, PgPool, Postgres, Transaction};
use sqlx_core::transaction::TransactionManager;

use super::partitioned::PartitionError;
use super::{Claim, payload_sha256};
use crate::error::{Error, Result};
use crate::message_id::validate_message_id;

/// Claims `message_id` for `consumer` inside the caller's transaction.
pub(crate) async fn claim(
    tx: &mut Transaction<'_, Postgres>,
    consumer: &str,
    message_id: &str,
    body: &[u8],
) -> Result<Claim> {
    validate_message_id(message_id)?;
    let hash = payload_sha256(body);
    // Bounded: the row we conflicted with can only vanish if retention deleted
    // it in between, and then the next insert succeeds.
    for _ in 0..3 {
        let inserted = sqlx::query(
            "INSERT INTO processed_messages (consumer, message_id, payload_sha256) \
             VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
        )
        .bind(consumer)
        .bind(message_id)
        .bind(&hash[..])
        .execute(&mut **tx)
        .await?
        .rows_affected();
        if inserted == 1 {
            return Ok(Claim::Fresh);
        }
        // A new statement takes a new snapshot (READ COMMITTED), so it sees the
        // row that the conflicting transaction committed.
        let stored = stored_hash(&mut **tx, consumer, message_id).await?;
        if let Some(claim) = compare(stored.as_ref(), &hash) {
            return Ok(claim);
        }
    }
    Err(vanished())
}

/// Never guess "duplicate" for a row that keeps vanishing: that would
/// acknowledge unprocessed work.
fn vanished() -> Error {
    sqlx::Error::Protocol("the conflicting processed_messages row vanished three times".into())
        .into()
}

/// Claims many message ids for `consumer` in one statement (plus one to read
/// the stored hashes of those already there), inside the caller's
/// transaction: [`claim`] for a batch. Returns one [`Claim`] per entry of
/// `messages` (`(message id, body)` pairs), in order.
pub(crate) async fn claim_batch(
    tx: &mut Transaction<'_, Postgres>,
    consumer: &str,
    messages: &[(&str, &[u8])],
) -> Result<Vec<Claim>> {
    for (id, _) in messages {
        validate_message_id(id)?;
    }
    let mut claims: Vec<Option<Claim>> = vec![None; messages.len()];
    // Bounded, as in `claim`: a row we conflicted with vanishes only when
    // retention deleted it in between; those ids are claimed again.
    for _ in 0..3 {
        let open: Vec<usize> = (0..messages.len())
            .filter(|&i| claims[i].is_none())
            .collect();
        if open.is_empty() {
            break;
        }
        let ids: Vec<&str> = open.iter().map(|&i| messages[i].0).collect();
        let hashes: Vec<Vec<u8>> = open
            .iter()
            .map(|&i| payload_sha256(messages[i].1).to_vec())
            .collect();
        // Ties in the sort are broken by position, so the first copy of a
        // repeated id is the one inserted; the others conflict with it.
        let inserted: Vec<String> = sqlx::query_scalar(
            "INSERT INTO processed_messages (consumer, message_id, payload_sha256) \
             SELECT $1, id, hash FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS t(id, hash, ord) \
             ORDER BY id, ord \
             ON CONFLICT DO NOTHING RETURNING message_id",
        )
        .bind(consumer)
        .bind(&ids)
        .bind(&hashes)
        .fetch_all(&mut **tx)
        .await?;
        let mut fresh: HashMap<String, bool> = inserted.into_iter().map(|id| (id, false)).collect();
        let mut stored: HashMap<String, Option<Vec<u8>>> = HashMap::new();
        if fresh.len() < ids.len() {
            // Also returns what this statement inserted, for ids that occur twice.
            stored.extend(stored_hashes(&mut **tx, consumer, &ids).await?);
        }
        for (&i, hash) in open.iter().zip(&hashes) {
            let id = messages[i].0;
            let stored_hash = stored.get(id);
            if let Some(taken) = fresh.get_mut(id)
                && !*taken
                && stored_hash.is_none_or(|s| s.as_deref() == Some(hash.as_slice()))
            {
                *taken = true;
                claims[i] = Some(Claim::Fresh);
                continue;
            }
            // None: vanished, claimed again in the next round.
            claims[i] = compare(stored_hash, hash);
        }
    }
    claims
        .into_iter()
        .map(|claim| claim.ok_or_else(vanished))
        .collect()
}

/// How [`begin_claims`] gets its transaction to READ COMMITTED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    /// `BEGIN ISOLATION LEVEL READ COMMITTED`, whatever the session's
    /// default.
    Set,
    /// The caller checked that the pool's sessions default to READ
    /// COMMITTED ([`reads_committed_by_default`]): one statement less, which
    /// PostgreSQL's end of transaction does not have to undo.
    // Only the consumer runtime knows its sessions' default.
    #[cfg(feature = "amqp")]
    Default,
}

/// What the consumer runtime learns once of its pool's sessions.
#[cfg(feature = "amqp")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sessions {
    /// They default to READ COMMITTED (PostgreSQL's own default).
    pub(crate) read_committed: bool,
}

/// Asks one of `pool`'s connections for its default isolation level.
#[cfg(feature = "amqp")]
pub(crate) async fn sessions(pool: &PgPool) -> Result<Sessions> {
    let level: String =
        sqlx::query_scalar("SELECT current_setting('default_transaction_isolation')")
            .fetch_one(pool)
            .await?;
    Ok(Sessions {
        read_committed: level == "read committed",
    })
}

/// Opens a claim's transaction on `pool`: READ COMMITTED whatever the
/// session's default, unless that is known to be it; then, with
/// `idle_first`, on an idle connection without the pool's checks when there
/// is one.
// Without the consumer runtime, every claim sets its level.
#[cfg_attr(not(feature = "amqp"), allow(unused_variables))]
pub(crate) async fn begin(
    pool: &PgPool,
    isolation: Isolation,
    idle_first: bool,
) -> Result<Transaction<'static, Postgres>> {
    let begin = match isolation {
        Isolation::Set => "BEGIN ISOLATION LEVEL READ COMMITTED",
        #[cfg(feature = "amqp")]
        Isolation::Default => {
            // An idle connection as it is: `try_begin` skips the pool's
            // acquire-time ping (and its `before_acquire` hook), a round trip
            // per message. A connection that died while idle only fails this
            // `BEGIN`, which wrote nothing: the pool's checked path follows.
            if idle_first {
                match pool.try_begin().await {
                    Ok(Some(tx)) => return Ok(tx),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "an idle connection failed BEGIN; taking another");
                    }
                }
            }
            "BEGIN"
        }
    };
    Ok(pool.begin_with(begin).await?)
}

/// What a stored claim says of a message with `hash`: `None` when there is
/// no claim (it vanished), or a row without a hash (written by hand), which
/// cannot be compared and counts as the same message.
fn compare(stored: Option<&Option<Vec<u8>>>, hash: &[u8]) -> Option<Claim> {
    match stored? {
        Some(s) if s != hash => Some(Claim::Mismatch),
        _ => Some(Claim::Duplicate),
    }
}

/// The stored body hashes of those of `ids` that `consumer` claimed.
async fn stored_hashes<'e>(
    executor: impl PgExecutor<'e>,
    consumer: &str,
    ids: &[&str],
) -> Result<HashMap<String, Option<Vec<u8>>>> {
    // A join with unnest, not `= ANY($2)`: the generic plan of the latter
    // can scan the whole table.
    let rows: Vec<(String, Option<Vec<u8>>)> = sqlx::query_as(
        "SELECT p.message_id, p.payload_sha256 FROM unnest($2::text[]) AS t(id) \
         JOIN processed_messages p ON p.consumer = $1 AND p.message_id = t.id",
    )
    .bind(consumer)
    .bind(ids)
    .fetch_all(executor)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Commits a transaction in which `message_id` was claimed, after checking
/// that the claim is still in it: the check, then `COMMIT` (see the
/// [module docs](super#the-wire-shape)). `tx` may be a savepoint: then it
/// is released.
pub(crate) async fn commit(
    mut tx: Transaction<'_, Postgres>,
    consumer: &str,
    message_id: &str,
) -> Result<()> {
    validate_message_id(message_id)?;
    // Prepared once per connection: PostgreSQL neither parses nor plans it
    // again, which costs more than the round trip it adds.
    sqlx::query(CHECK)
        .bind(consumer)
        .bind(message_id)
        .execute(&mut *tx)
        .await
        .map_err(lost_on(crate::sqlstate::DIVISION_BY_ZERO, message_id))?;
    tx.commit().await?;
    Ok(())
}

/// The claim check: divides by zero when the claim is gone, and fails in
/// an aborted transaction. `processed_at = now()`: the claim was made in
/// this transaction (its default is the transaction's start), and on a
/// partitioned table PostgreSQL reads only the partition it went to
/// instead of every one.
const CHECK: &str = "SELECT 1 / count(*) FROM processed_messages \
     WHERE consumer = $1 AND message_id = $2 AND processed_at = now()";

/// The consumer runtime's commit of a unit it claimed itself (so every
/// claim is in `tx` unless the handler ended the transaction), with
/// `statements` (SQL of idempo's own, literals only, each followed by `; `)
/// run just before `COMMIT`: one simple query, one round trip,
/// `SELECT; <statements>COMMIT AND CHAIN`. Nothing in it reads a table or
/// needs planning, so PostgreSQL's parse costs less than the round trip of
/// [`commit`]'s prepared check. It commits nothing:
/// - in an aborted transaction (the handler ignored a failed statement):
///   `SELECT` fails (`25P02`), and a simple query stops at its first error;
/// - when the handler ended the transaction itself: the statements run in
///   an implicit transaction, where `COMMIT AND CHAIN` fails (`25P01`) and
///   takes them with it; reported as [`Error::ClaimLost`].
///
/// `message_id` names the unit in that error. The empty transaction the
/// chain opens is rolled back when `tx` is dropped, with the pool's check
/// of the released connection: no round trip of its own.
// Only the consumer runtime commits units.
#[cfg_attr(not(feature = "amqp"), allow(dead_code))]
pub(crate) async fn commit_unit(
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
    .map_err(lost_on(crate::sqlstate::NO_ACTIVE_TRANSACTION, message_id))?;
    Ok(())
}

/// A database error, read as [`Error::ClaimLost`] when its SQLSTATE is
/// `code` (how that commit learns the claim is gone).
fn lost_on<'a>(code: &'static str, message_id: &'a str) -> impl FnOnce(sqlx::Error) -> Error + 'a {
    move |e| {
        if crate::sqlstate::is(&e, code) {
            Error::ClaimLost {
                message_id: message_id.to_owned(),
            }
        } else {
            Error::Database(e)
        }
    }
}

/// What a [`claim`] of `message_id` by `consumer` with `body` would find
/// now, without claiming anything: [`Claim::Fresh`] when the id was not
/// processed (or its claim was reaped), [`Claim::Duplicate`] when it was,
/// with this body (or by a row without a hash), [`Claim::Mismatch`] when it
/// was processed with another body. One primary-key lookup; the answer can
/// change as soon as it is given (a consumer may claim the id meanwhile).
pub(crate) async fn lookup<'e>(
    executor: impl PgExecutor<'e>,
    consumer: &str,
    message_id: &str,
    body: &[u8],
) -> Result<Claim> {
    let stored = stored_hash(executor, consumer, message_id).await?;
    Ok(compare(stored.as_ref(), &payload_sha256(body)).unwrap_or(Claim::Fresh))
}

/// The stored body hash of `consumer`'s claim of `message_id`: `None`
/// without a claim, `Some(None)` for a row without a hash.
async fn stored_hash<'e>(
    executor: impl PgExecutor<'e>,
    consumer: &str,
    message_id: &str,
) -> Result<Option<Option<Vec<u8>>>> {
    Ok(sqlx::query_scalar(
        "SELECT payload_sha256 FROM processed_messages WHERE consumer = $1 AND message_id = $2",
    )
    .bind(consumer)
    .bind(message_id)
    .fetch_optional(executor)
    .await?)
}

// ------------------------------------------------------------- partitioned

/// [`claim_batch`] on a partitioned `processed_messages`: one round trip.
/// `processed_messages`: one [`Claim`] per message, in order; an id that
/// occurs twice is claimed by its first occurrence. One round trip.
pub(crate) async fn partitioned_claim_batch(
    tx: &mut Transaction<'_, Postgres>,
    consumer: &str,
    messages: &[(&str, &[u8])],
) -> Result<Vec<Claim>> {
    let mut firsts: HashMap<&str, usize> = HashMap::with_capacity(messages.len());
    let mut ids = Vec::with_capacity(messages.len());
    let mut hashes = Vec::with_capacity(messages.len());
    for (i, (id, body)) in messages.iter().enumerate() {
        validate_message_id(id)?;
        if !firsts.contains_key(id) {
            firsts.insert(id, i);
            ids.push(*id);
            hashes.push(payload_sha256(body).to_vec());
        }
    }
    let stored: HashMap<String, Option<Vec<u8>>> = sqlx::query_as::<_, (String, Option<Vec<u8>>)>(
        "SELECT claimed_id, stored_sha256 FROM idempo_claim_partitioned($1, $2, $3, false)",
    )
    .bind(consumer)
    .bind(&ids)
    .bind(&hashes)
    .fetch_all(&mut **tx)
    .await
    .map_err(|e| refusal(e.into()))?
    .into_iter()
    .collect();
    messages
        .iter()
        .enumerate()
        .map(|(i, (id, body))| {
            let hash = payload_sha256(body);
            let first = firsts[id];
            Ok(match compare(stored.get(*id), &hash) {
                Some(claim) => claim,
                None if first == i => Claim::Fresh,
                None if payload_sha256(messages[first].1) == hash => Claim::Duplicate,
                None => Claim::Mismatch,
            })
        })
        .collect()
}

/// IDP01 from the claim function as the typed refusal.
fn refusal(e: Error) -> Error {
    match &e {
        Error::Database(db) if crate::sqlstate::is(db, crate::sqlstate::ISOLATION_REFUSED) => {
            let level = db
                .as_database_error()
                .and_then(|d| d.message().rsplit_once(", not ").map(|(_, l)| l.to_owned()))
                .unwrap_or_default();
            PartitionError::NotReadCommitted { level }.into()
        }
        _ => e,
    }
}
