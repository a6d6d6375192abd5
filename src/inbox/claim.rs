//! The claim's SQL: every statement that claims, checks or commits a claim
//! in `processed_messages`, plain or partitioned, and the round trips that
//! carry them (the wire shape is in the [module docs](super)). The public
//! face is [`Inbox`](super::Inbox).

use std::collections::HashMap;

use sqlx::{PgExecutor, PgPool, Postgres, Transaction};

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

/// Opens a claim's transaction on `pool` at READ COMMITTED, whatever the
/// session's default.
pub(crate) async fn begin(pool: &PgPool) -> Result<Transaction<'static, Postgres>> {
    Ok(pool
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await?)
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

/// A database error, read as [`Error::ClaimLost`] when its SQLSTATE is
/// `code` (how a commit learns the claim is gone).
pub(crate) fn lost_on<'a>(
    code: &'static str,
    message_id: &'a str,
) -> impl FnOnce(sqlx::Error) -> Error + 'a {
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
///
/// A claim a dead letter holds (its `lettered` flag, set by the runtime) is no processing:
/// it reads as `Fresh`.
pub(crate) async fn lookup<'e>(
    executor: impl PgExecutor<'e>,
    consumer: &str,
    message_id: &str,
    body: &[u8],
) -> Result<Claim> {
    let stored: Option<Option<Vec<u8>>> = sqlx::query_scalar(
        "SELECT payload_sha256 FROM processed_messages \
         WHERE consumer = $1 AND message_id = $2 AND NOT lettered",
    )
    .bind(consumer)
    .bind(message_id)
    .fetch_optional(executor)
    .await?;
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
