//! The transactional inbox: claim a message id inside the caller's transaction.
//!
//! This is the transport-agnostic core of idempo. A *claim* inserts
//! `(consumer, message_id)` into `processed_messages` in the same PostgreSQL
//! transaction as the business writes. If the transaction commits, the message
//! is recorded as processed together with its effects; if it rolls back, neither
//! survives. The table's primary key is the lock: two workers claiming one id
//! at once serialize on the unique index, so exactly one of them gets
//! [`Claim::Fresh`]. There is no separate "processing" mark and no
//! check-then-insert.
//!
//! The claim stores the SHA-256 of the body, so a *different* message reusing
//! an id is detected ([`Claim::Mismatch`]) instead of being silently dropped.
//!
//! # Example: any worker loop (Kafka, NATS, cron, ...)
//! ```no_run
//! use idempo::inbox::{self, Begun};
//!
//! # async fn doc(pool: sqlx::PgPool, id: &str, body: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! // BEGIN and the claim travel together: one round trip.
//! match inbox::begin_claim(&pool, "billing", id, body).await? {
//!     Begun::Fresh(mut tx) => {
//!         sqlx::query("UPDATE accounts SET balance = balance + 10 WHERE id = 1")
//!             .execute(&mut *tx)
//!             .await?;
//!         // The claim check and COMMIT travel together too. Effects and claim
//!         // commit together; an aborted transaction (a failed statement that
//!         // was ignored) is an error, not a silent rollback.
//!         inbox::commit(tx, "billing", id).await?;
//!     }
//!     Begun::Duplicate => {} // already applied: just acknowledge
//!     Begun::Mismatch => {
//!         // the id was reused for a different body: park the message for a human
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! [`claim`] does the same inside a transaction the caller opened.
//!
//! # The wire shape
//! A fresh message costs two round trips of idempo's own around the
//! caller's statements, fewer than a careful hand-written loop (`BEGIN`,
//! claim, ..., `COMMIT`):
//!
//! 1. `SET TRANSACTION ISOLATION LEVEL READ COMMITTED; INSERT INTO
//!    processed_messages ...; BEGIN` as one simple query. The insert has no
//!    `ON CONFLICT`: a committed claim of the id fails it (`23505`), which ends
//!    the implicit transaction of the message before its `BEGIN` runs, so the
//!    connection is left idle, never inside a failed transaction. A duplicate
//!    then costs one more round trip, the read of the stored body hash.
//! 2. `SELECT 1 / count(*) FROM processed_messages WHERE <the claim>; COMMIT
//!    AND CHAIN`. PostgreSQL stops a simple query at its first error: in an
//!    aborted transaction the `SELECT` fails (`25P02`), and when the claim is
//!    gone (the caller rolled back) it divides by zero, so in neither case
//!    does `COMMIT` run. `AND CHAIN` leaves an empty transaction open for the
//!    `ROLLBACK` that sqlx's `Transaction` sends when dropped; it travels with
//!    the pool's check of the returned connection, not on the message's path.
//!
//! Values travel in the SQL text as literals (`src/literal.rs`): validated,
//! quoted by libpq's rules, bytes as hex digits.

use std::collections::HashMap;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::postgres::PgTransactionManager;
use sqlx::{AssertSqlSafe, PgExecutor, PgPool, Postgres, Transaction};
use sqlx_core::transaction::TransactionManager;

use crate::error::{Error, Result};
use crate::literal;
pub use crate::message_id::{InvalidMessageId, MAX_MESSAGE_ID_LEN, validate_message_id};

pub mod partitioned;

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Claim {
    /// First time this consumer sees the id: do the work in this transaction,
    /// then commit.
    Fresh,
    /// Already processed (committed) by this consumer with the same body: roll
    /// back and acknowledge.
    Duplicate,
    /// Already processed, but with a *different* body: the id was reused.
    /// Nothing should run; report it.
    Mismatch,
}

/// SHA-256 of a message body: what the inbox stores to detect a reused id.
pub fn payload_sha256(body: &[u8]) -> [u8; 32] {
    Sha256::digest(body).into()
}

/// Claims `message_id` for `consumer` inside the caller's transaction.
///
/// `body` is the message's raw bytes: its SHA-256 is stored with the claim,
/// so that a later message reusing the id with another body is reported as
/// [`Claim::Mismatch`].
///
/// On [`Claim::Fresh`] the claim row is written in `tx`: commit `tx` after the
/// work, or roll it back to release the id. On [`Claim::Duplicate`] and
/// [`Claim::Mismatch`] nothing was written; roll back.
///
/// Costs one round trip for a fresh id; a duplicate costs a second one to read
/// the stored hash.
///
/// # Concurrency
/// A concurrent claim of the same `(consumer, message_id)` blocks on this
/// transaction's uncommitted row until it commits (the other side then sees
/// `Duplicate`) or rolls back (the other side then gets `Fresh`). Run the
/// transaction at the default READ COMMITTED level; under REPEATABLE READ a
/// concurrent claim fails with a serialization error, which is safe to retry.
///
/// # Errors
/// [`Error::InvalidMessageId`] for an empty or
/// oversized id, [`Error::Database`] when a statement
/// fails.
pub async fn claim(
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
        let stored: Option<Option<Vec<u8>>> = sqlx::query_scalar(
            "SELECT payload_sha256 FROM processed_messages WHERE consumer = $1 AND message_id = $2",
        )
        .bind(consumer)
        .bind(message_id)
        .fetch_optional(&mut **tx)
        .await?;
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
///
/// The ids are inserted in sorted order, so that two batches (or a batch and
/// a single claim) that share ids take their row locks in the same order and
/// cannot deadlock. An id that occurs twice in `messages` is `Fresh` for its
/// first occurrence with the inserted body and `Duplicate` (same body) or
/// `Mismatch` (other body) for the others, as if they had come one by one.
///
/// # Errors
/// As [`claim`].
pub async fn claim_batch(
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

/// What [`begin_claim`] found, with the transaction it opened for a fresh
/// claim.
#[derive(Debug)]
#[must_use]
pub enum Begun {
    /// First time this consumer sees the id: the claim is in this open
    /// transaction (READ COMMITTED). Do the work in it, then [`commit`].
    Fresh(Transaction<'static, Postgres>),
    /// Already processed with the same body: acknowledge. No transaction is
    /// open.
    Duplicate,
    /// Already processed with a *different* body: the id was reused. No
    /// transaction is open.
    Mismatch,
}

/// What [`begin_claim_batch`] found.
#[derive(Debug)]
#[non_exhaustive]
pub struct ClaimedBatch {
    /// One claim per message, in order.
    pub claims: Vec<Claim>,
    /// The open transaction that holds the fresh claims; `None` when no
    /// claim is fresh.
    pub tx: Option<Transaction<'static, Postgres>>,
}

/// Opens a transaction on `pool` with `message_id` claimed in it, in **one
/// round trip**: [`claim`] without a `BEGIN` of its own. A duplicate costs a
/// second round trip (the read of the stored body hash) and leaves no
/// transaction open.
///
/// Commit a [`Begun::Fresh`] transaction with [`commit`] (one more round
/// trip), or drop it to roll back. How the statements travel, and why every
/// guarantee of [`claim`] and [`commit`] holds, is in the [module
/// docs](self#the-wire-shape).
///
/// # Errors
/// As [`claim`].
pub async fn begin_claim(
    pool: &PgPool,
    consumer: &str,
    message_id: &str,
    body: &[u8],
) -> Result<Begun> {
    let mut claimed = begin_claim_batch(pool, consumer, &[(message_id, body)]).await?;
    Ok(match (claimed.claims[0], claimed.tx.take()) {
        (Claim::Fresh, Some(tx)) => Begun::Fresh(tx),
        (Claim::Mismatch, _) => Begun::Mismatch,
        _ => Begun::Duplicate,
    })
}

/// [`begin_claim`] for many messages (`(message id, body)` pairs): one round
/// trip opens the transaction with every claim in it, in sorted id order
/// (two batches sharing ids cannot deadlock). When some ids were processed
/// already, their stored hashes are read and the rest claimed again: a
/// batch with duplicates costs two round trips more.
///
/// An id that occurs twice in `messages` is claimed by its first occurrence
/// and the others are `Duplicate` (same body) or `Mismatch` (other body), as
/// with [`claim_batch`].
///
/// # Errors
/// As [`claim`].
pub async fn begin_claim_batch(
    pool: &PgPool,
    consumer: &str,
    messages: &[(&str, &[u8])],
) -> Result<ClaimedBatch> {
    begin_claims(pool, consumer, messages, Isolation::Set).await
}

/// How [`begin_claims`] gets its transaction to READ COMMITTED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
// Only the consumer runtime knows its sessions' default.
#[cfg_attr(not(feature = "amqp"), allow(dead_code))]
pub(crate) enum Isolation {
    /// `SET TRANSACTION ISOLATION LEVEL READ COMMITTED` first, whatever the
    /// session's default.
    Set,
    /// The caller checked that the pool's sessions default to READ
    /// COMMITTED ([`reads_committed_by_default`]): one statement less, which
    /// PostgreSQL's end of transaction does not have to undo.
    Default,
}

/// Whether sessions of `pool` default to READ COMMITTED (PostgreSQL's own
/// default), asked once on one of its connections.
///
/// # Errors
/// [`Error::Database`] when the query fails.
#[cfg_attr(not(feature = "amqp"), allow(dead_code))]
pub(crate) async fn reads_committed_by_default(pool: &PgPool) -> Result<bool> {
    let level: String =
        sqlx::query_scalar("SELECT current_setting('default_transaction_isolation')")
            .fetch_one(pool)
            .await?;
    Ok(level == "read committed")
}

/// [`begin_claim_batch`], with the isolation level set or known.
pub(crate) async fn begin_claims(
    pool: &PgPool,
    consumer: &str,
    messages: &[(&str, &[u8])],
    isolation: Isolation,
) -> Result<ClaimedBatch> {
    let sql = |consumer: &str, rows: &[&Row<'_>]| claim_then_begin(consumer, rows, isolation);
    begin_claims_by(
        pool,
        consumer,
        messages,
        sql,
        crate::sqlstate::UNIQUE_VIOLATION,
    )
    .await
}

/// An id to claim and its body's hash.
type Row<'a> = (&'a str, [u8; 32]);

/// The round trips of [`begin_claims`]: `sql` makes the simple query that
/// claims the consumer's (literal) rows and opens the transaction, and
/// fails with `conflict` (SQLSTATE) when some id was claimed already.
/// The partitioned mode claims through the same loop with its own query.
async fn begin_claims_by(
    pool: &PgPool,
    consumer: &str,
    messages: &[(&str, &[u8])],
    sql: impl Fn(&str, &[&Row<'_>]) -> Result<String>,
    conflict: &str,
) -> Result<ClaimedBatch> {
    let consumer_literal = literal::text("consumer", consumer)?;
    let mut rows = Vec::with_capacity(messages.len());
    for (id, body) in messages {
        validate_message_id(id)?;
        rows.push((*id, payload_sha256(body)));
    }
    // The first occurrence of each id is claimed; the others follow it.
    let mut firsts: HashMap<&str, usize> = HashMap::with_capacity(rows.len());
    for (i, (id, _)) in rows.iter().enumerate() {
        firsts.entry(id).or_insert(i);
    }
    let mut open: Vec<usize> = firsts.values().copied().collect();
    open.sort_unstable_by_key(|&i| rows[i].0);
    let mut claims: Vec<Option<Claim>> = vec![None; rows.len()];
    let mut stored: HashMap<String, Option<Vec<u8>>> = HashMap::new();
    let mut tx = None;
    // Bounded: each round decides the ids it conflicted on, unless their
    // rows vanished (retention deleted them) in between.
    for _ in 0..3 {
        if open.is_empty() {
            break;
        }
        let claimed: Vec<&Row<'_>> = open.iter().map(|&i| &rows[i]).collect();
        match pool
            .begin_with(AssertSqlSafe(sql(&consumer_literal, &claimed)?))
            .await
        {
            Ok(begun) => {
                for &i in &open {
                    claims[i] = Some(Claim::Fresh);
                }
                open.clear();
                tx = Some(begun);
                break;
            }
            Err(e) if crate::sqlstate::is(&e, conflict) => {
                // The claim's implicit transaction failed before its BEGIN:
                // nothing is open. A new statement sees the committed rows.
                let ids: Vec<&str> = open.iter().map(|&i| rows[i].0).collect();
                stored.extend(stored_hashes(pool, consumer, &ids).await?);
                for &i in &open {
                    claims[i] = compare(stored.get(rows[i].0), &rows[i].1);
                }
                open.retain(|&i| claims[i].is_none());
            }
            Err(e) => return Err(e.into()),
        }
    }
    if !open.is_empty() {
        return Err(vanished());
    }
    for (i, (id, hash)) in rows.iter().enumerate() {
        let first = firsts[id];
        if first != i {
            claims[i] = Some(match claims[first] {
                Some(Claim::Fresh) if rows[first].1 == *hash => Claim::Duplicate,
                Some(Claim::Fresh) => Claim::Mismatch,
                _ => compare(stored.get(*id), hash).ok_or_else(vanished)?,
            });
        }
    }
    Ok(ClaimedBatch {
        claims: claims
            .into_iter()
            .map(|claim| claim.ok_or_else(vanished))
            .collect::<Result<_>>()?,
        tx,
    })
}

/// The simple query of [`begin_claim_batch`]: the claims, then `BEGIN`,
/// which takes them into its transaction (statements before a `BEGIN` in
/// one simple query are part of the block it opens).
fn claim_then_begin(consumer: &str, rows: &[&Row<'_>], isolation: Isolation) -> Result<String> {
    let mut sql = String::new();
    if isolation == Isolation::Set {
        sql.push_str("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; ");
    }
    sql.push_str("INSERT INTO processed_messages (consumer, message_id, payload_sha256) ");
    if rows.len() == 1 {
        for (id, hash) in rows {
            sql.push_str(&format!(
                "VALUES ({consumer}, {}, {})",
                literal::text("message id", id)?,
                literal::bytes(hash)
            ));
        }
    } else {
        // Not a VALUES row each: PostgreSQL plans every row of a VALUES
        // list, while an array is one constant. The hashes travel as one
        // bytea, 32 bytes per id, in the ids' order.
        let mut ids = Vec::with_capacity(rows.len());
        let mut hashes = Vec::with_capacity(rows.len() * 32);
        for (id, hash) in rows {
            ids.push(literal::text("message id", id)?);
            hashes.extend_from_slice(hash);
        }
        sql.push_str(&format!(
            "SELECT {consumer}, id, substring(h FROM n::int * 32 - 31 FOR 32) \
             FROM unnest(ARRAY[{}]::text[]) WITH ORDINALITY AS t(id, n), {} AS h \
             ORDER BY n",
            ids.join(", "),
            literal::bytes(&hashes)
        ));
    }
    sql.push_str("; BEGIN");
    Ok(sql)
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
/// that the claim is still in it: **one round trip**, the check and `COMMIT`
/// sent together (see the [module docs](self#the-wire-shape)).
///
/// Why not just `tx.commit()`: PostgreSQL answers `COMMIT` of an *aborted*
/// transaction (one in which a statement failed, even if the caller ignored
/// the error) with `ROLLBACK`, and sqlx reports success. The message would
/// then be acknowledged with its effects and its claim rolled back: lost.
/// And if the caller ended the transaction itself (`ROLLBACK`), there is
/// nothing left to commit. The check is a primary-key lookup on the same
/// connection that fails in an aborted transaction and when the claim is
/// gone, and `COMMIT` runs only when it passed.
///
/// `tx` may be a savepoint (a transaction begun inside another): then the
/// check runs, and the savepoint is released, not committed.
///
/// # Errors
/// - [`Error::ClaimLost`] when the claim is no longer in the transaction;
/// - [`Error::Database`] for which [`Error::is_aborted_transaction`] holds
///   when a statement had failed in it;
/// - other [`Error::Database`] errors when the `COMMIT` failed (a deferred
///   constraint, a serialization failure): nothing was committed;
/// - an error for which [`Error::is_connection_error`] holds: **the outcome
///   is unknown** if it came from the `COMMIT`; a new claim of the id tells
///   (duplicate: it committed).
pub async fn commit(tx: Transaction<'_, Postgres>, consumer: &str, message_id: &str) -> Result<()> {
    commit_with(tx, consumer, message_id, "").await
}

/// [`commit`] with `statements` (SQL of idempo's own, literals only, each
/// followed by `; `) run between the claim check and `COMMIT`, in the same
/// round trip. The consumer's outbox writes a unit's forwarded messages this
/// way, so forwarding costs no round trip of its own.
///
/// # Errors
/// As [`commit`].
pub(crate) async fn commit_with(
    mut tx: Transaction<'_, Postgres>,
    consumer: &str,
    message_id: &str,
    statements: &str,
) -> Result<()> {
    validate_message_id(message_id)?;
    // Divides by zero when the claim is gone: the simple query stops there.
    let check = format!(
        "SELECT 1 / count(*) FROM processed_messages WHERE consumer = {} AND message_id = {}; ",
        literal::text("consumer", consumer)?,
        literal::text("message id", message_id)?,
    );
    let claim_lost = |e: sqlx::Error| {
        if crate::sqlstate::is(&e, crate::sqlstate::DIVISION_BY_ZERO) {
            Error::ClaimLost {
                message_id: message_id.to_owned(),
            }
        } else {
            Error::Database(e)
        }
    };
    if PgTransactionManager::get_transaction_depth(&tx) == 1 {
        let sql = format!("{check}{statements}COMMIT AND CHAIN");
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut *tx)
            .await
            .map_err(claim_lost)?;
        // Dropped: its ROLLBACK ends the empty chained transaction.
        return Ok(());
    }
    sqlx::raw_sql(AssertSqlSafe(format!("{check}{statements}")))
        .execute(&mut *tx)
        .await
        .map_err(claim_lost)?;
    tx.commit().await?;
    Ok(())
}

/// Deletes `consumer`'s claims older than `age`, `batch` rows per statement,
/// and returns how many rows went. A partitioned `processed_messages` loses
/// nothing here (`ONLY`: a ctid names no row across partitions); its claims
/// go with their partitions ([`partitioned::maintain`]).
///
/// Each statement is its own short transaction and skips rows that another
/// reaper has locked, so replicas reaping at once neither wait for nor
/// deadlock with each other. Delete only what can no longer be redelivered: a
/// redelivery that arrives after its claim is gone is processed again.
///
/// # Errors
/// [`Error::Database`] when a statement fails.
pub async fn delete_processed_before(
    pool: &PgPool,
    consumer: &str,
    age: Duration,
    batch: i64,
) -> Result<u64> {
    let mut total = 0;
    loop {
        let deleted = sqlx::query(
            "DELETE FROM ONLY processed_messages WHERE ctid = ANY(ARRAY(\
                 SELECT ctid FROM ONLY processed_messages \
                 WHERE consumer = $1 AND processed_at < now() - make_interval(secs => $2) \
                 LIMIT $3 FOR UPDATE SKIP LOCKED))",
        )
        .bind(consumer)
        .bind(age.as_secs_f64())
        .bind(batch)
        .execute(pool)
        .await?
        .rows_affected();
        total += deleted;
        if deleted < batch.max(1) as u64 {
            return Ok(total);
        }
    }
}

// ---------------------------------------------------------------- inspection
//
// Read-only views of the inbox for operations tools (`idempo::ops`, the
// `idempo` command): every statement on `processed_messages` lives in this
// file.

/// One consumer's claims: how many, and how old the oldest and newest are.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerClaims {
    /// The consumer's name (for the AMQP runtime: its queue).
    pub consumer: String,
    /// How many claims it holds.
    pub claims: i64,
    /// How long ago its oldest claim was made.
    pub oldest: Option<Duration>,
    /// How long ago its newest claim was made.
    pub newest: Option<Duration>,
}

/// The claims of every consumer that has some (only those in `only`, unless
/// it is empty), ordered by consumer. Scans the claims of the consumers
/// asked about: meant for an operator's status command, not a hot path.
///
/// ```no_run
/// # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
/// for c in idempo::inbox::claims_per_consumer(&pool, &[]).await? {
///     println!("{}: {} claims, oldest {:?} ago", c.consumer, c.claims, c.oldest);
/// }
/// # Ok(()) }
/// ```
///
/// How many claims were ever inserted into the `processed_messages` table
/// of the connection's schema, from PostgreSQL's statistics (cheap; counts
/// claims whose transaction rolled back too, and restarts at a statistics
/// reset): the difference of two readings is a claim rate, for dashboards.
/// A partitioned table's partitions are summed (a partition dropped takes
/// its count with it).
///
/// # Errors
/// [`Error::Database`] when the query fails.
pub async fn claims_inserted(pool: &PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar(
        // pg_partition_tree is empty for a plain table.
        "SELECT coalesce(sum(n_tup_ins), 0)::int8 FROM pg_stat_user_tables \
         WHERE relid = to_regclass('processed_messages') \
            OR relid IN (SELECT relid FROM pg_partition_tree(to_regclass('processed_messages')))",
    )
    .fetch_one(pool)
    .await?)
}

/// # Errors
/// [`Error::Database`] when the query fails (also when the table does not
/// exist: run [`migrate`](crate::migrate)).
pub async fn claims_per_consumer(pool: &PgPool, only: &[String]) -> Result<Vec<ConsumerClaims>> {
    let rows: Vec<(String, i64, Option<f64>, Option<f64>)> = sqlx::query_as(
        "SELECT consumer, count(*), \
                extract(epoch FROM now() - min(processed_at))::float8, \
                extract(epoch FROM now() - max(processed_at))::float8 \
         FROM processed_messages \
         WHERE cardinality($1::text[]) = 0 OR consumer = ANY($1) \
         GROUP BY consumer ORDER BY consumer",
    )
    .bind(only)
    .fetch_all(pool)
    .await?;
    let age = |secs: Option<f64>| secs.map(|s| Duration::from_secs_f64(s.max(0.0)));
    Ok(rows
        .into_iter()
        .map(|(consumer, claims, oldest, newest)| ConsumerClaims {
            consumer,
            claims,
            oldest: age(oldest),
            newest: age(newest),
        })
        .collect())
}

/// The consumers that hold claims, in order.
///
/// # Errors
/// [`Error::Database`] when the query fails.
pub async fn consumers(pool: &PgPool) -> Result<Vec<String>> {
    Ok(
        sqlx::query_scalar("SELECT DISTINCT consumer FROM processed_messages ORDER BY 1")
            .fetch_all(pool)
            .await?,
    )
}

/// What a [`claim`] of `message_id` by `consumer` with `body` would find
/// now, without claiming anything: [`Claim::Fresh`] when the id was not
/// processed (or its claim was reaped), [`Claim::Duplicate`] when it was,
/// with this body (or by a row without a hash), [`Claim::Mismatch`] when it
/// was processed with another body. One primary-key lookup; the answer can
/// change as soon as it is given (a consumer may claim the id meanwhile).
///
/// Used before replaying a dead letter: a mismatch would be dead-lettered
/// again.
///
/// ```no_run
/// use idempo::inbox::{self, Claim};
/// # async fn doc(pool: sqlx::PgPool, body: &[u8]) -> idempo::Result<()> {
/// if inbox::lookup(&pool, "billing", "pay-1", body).await? == Claim::Mismatch {
///     println!("pay-1 was processed with another body");
/// }
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::Database`] when the query fails.
pub async fn lookup(pool: &PgPool, consumer: &str, message_id: &str, body: &[u8]) -> Result<Claim> {
    let stored: Option<Option<Vec<u8>>> = sqlx::query_scalar(
        "SELECT payload_sha256 FROM processed_messages WHERE consumer = $1 AND message_id = $2",
    )
    .bind(consumer)
    .bind(message_id)
    .fetch_optional(pool)
    .await?;
    Ok(compare(stored.as_ref(), &payload_sha256(body)).unwrap_or(Claim::Fresh))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_hash_is_sha256() {
        let h = payload_sha256(b"abc");
        assert_eq!(h[..4], [0xba, 0x78, 0x16, 0xbf]);
    }
}
