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
use crate::literal;
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
    /// How its commits travel.
    pub(crate) commit: CommitShape,
}

/// A round trip at least this long makes the commit save one
/// ([`CommitShape::OneTrip`]): beyond it, waiting costs more than
/// PostgreSQL's parsing of a literal check (tens of µs, measured).
#[cfg(feature = "amqp")]
const FAR: std::time::Duration = std::time::Duration::from_micros(500);

/// Asks one of `pool`'s connections for its default isolation level, and
/// times three trivial round trips on it (the fastest counts: a scheduler's
/// hiccup is not distance).
#[cfg(feature = "amqp")]
pub(crate) async fn sessions(pool: &PgPool) -> Result<Sessions> {
    let mut conn = pool.acquire().await?;
    let level: String =
        sqlx::query_scalar("SELECT current_setting('default_transaction_isolation')")
            .fetch_one(&mut *conn)
            .await?;
    let mut fastest = std::time::Duration::MAX;
    for _ in 0..3 {
        let sent = std::time::Instant::now();
        sqlx::raw_sql("").execute(&mut *conn).await?;
        fastest = fastest.min(sent.elapsed());
    }
    Ok(Sessions {
        read_committed: level == "read committed",
        commit: if fastest >= FAR {
            CommitShape::OneTrip
        } else {
            CommitShape::Prepared
        },
    })
}

/// How [`commit_with`] sends the claim check and `COMMIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommitShape {
    /// The check as a prepared statement, then `COMMIT`: two round trips,
    /// nothing parsed or planned again (a database close by).
    Prepared,
    /// The check with literals and `COMMIT AND CHAIN` in one simple query:
    /// one round trip, parsed and planned each time (a database far away,
    /// or staged outbox rows to send with them anyway).
    // Only the consumer runtime measures its database's distance.
    #[cfg(feature = "amqp")]
    OneTrip,
}

/// Opens a claim's transaction on `pool`: READ COMMITTED whatever the
/// session's default, unless that is known to be it.
pub(crate) async fn begin(
    pool: &PgPool,
    isolation: Isolation,
) -> Result<Transaction<'static, Postgres>> {
    let begin = match isolation {
        Isolation::Set => "BEGIN ISOLATION LEVEL READ COMMITTED",
        #[cfg(feature = "amqp")]
        Isolation::Default => "BEGIN",
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
/// [module docs](super#the-wire-shape)).
pub(crate) async fn commit(
    tx: Transaction<'_, Postgres>,
    consumer: &str,
    message_id: &str,
) -> Result<()> {
    commit_with(tx, consumer, message_id, "", CommitShape::Prepared).await
}

/// The claim check: divides by zero when the claim is gone, so a simple
/// query stops there and its `COMMIT` never runs. `processed_at = now()`:
/// the claim was made in this transaction (its default is the
/// transaction's start), and on a partitioned table PostgreSQL reads only
/// the partition it went to instead of every one. [`literal_check`] is its
/// twin for a simple query.
const CHECK: &str = "SELECT 1 / count(*) FROM processed_messages \
     WHERE consumer = $1 AND message_id = $2 AND processed_at = now()";

/// [`CHECK`] with its values as literals, followed by `; `.
fn literal_check(consumer: &str, message_id: &str) -> Result<String> {
    Ok(format!(
        "SELECT 1 / count(*) FROM processed_messages \
         WHERE consumer = {} AND message_id = {} AND processed_at = now(); ",
        literal::text("consumer", consumer)?,
        literal::text("message id", message_id)?,
    ))
}

/// [`commit`] with `statements` (SQL of idempo's own, literals only, each
/// followed by `; `) run between the claim check and `COMMIT`, in the same
/// round trip. The consumer's outbox writes a unit's forwarded messages this
/// way, so forwarding costs no round trip of its own. Without statements,
/// `shape` says whether the check and `COMMIT` travel apart or together.
pub(crate) async fn commit_with(
    mut tx: Transaction<'_, Postgres>,
    consumer: &str,
    message_id: &str,
    statements: &str,
    shape: CommitShape,
) -> Result<()> {
    validate_message_id(message_id)?;
    let claim_lost = |e: sqlx::Error| {
        if crate::sqlstate::is(&e, crate::sqlstate::DIVISION_BY_ZERO) {
            Error::ClaimLost {
                message_id: message_id.to_owned(),
            }
        } else {
            Error::Database(e)
        }
    };
    if PgTransactionManager::get_transaction_depth(&tx) == 1
        && statements.is_empty()
        && shape == CommitShape::Prepared
    {
        // Prepared once per connection: PostgreSQL neither parses nor plans
        // it again, which costs more than the round trip it adds.
        sqlx::query(CHECK)
            .bind(consumer)
            .bind(message_id)
            .execute(&mut *tx)
            .await
            .map_err(claim_lost)?;
        tx.commit().await?;
        return Ok(());
    }
    let check = literal_check(consumer, message_id)?;
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
