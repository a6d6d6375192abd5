//! The `dead_letters` table as the runtime's letter store: the insert of a
//! letter (the runtime's, a DLQ's import, the quarantine's) and the
//! reaping of settled letters. The operators' reads and replays are
//! `crate::dead_letters`'s.

use std::borrow::Cow;
use std::time::Duration;

use sqlx::{PgConnection, PgPool};

use super::fingerprint::fingerprint;
use super::letter_hold;
use super::letters::{Filing, LetterStore, NewLetter};
use crate::inbox;
use crate::properties::Properties;
use crate::{Error, Result};

/// PostgreSQL text cannot hold NUL: the lossless copy is in `envelope`.
pub(crate) fn text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{fffd}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// JSON text that `jsonb` accepts (it refuses `\u0000`).
fn jsonb_text(value: &serde_json::Value) -> String {
    value.to_string().replace("\\u0000", "\\ufffd")
}

/// A row of `dead_letters` as it is inserted: the letter's final
/// properties and headers, in idempo's encoding, whoever built them (the
/// runtime's copy, a DLQ's import, the quarantine's mended properties).
pub(crate) struct Row<'a> {
    /// The transport the message came from, where a replay sends it.
    pub(crate) transport: &'a str,
    pub(crate) consumer: &'a str,
    pub(crate) queue: &'a str,
    pub(crate) message_id: &'a str,
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    pub(crate) properties: &'a Properties,
    pub(crate) body: &'a [u8],
    pub(crate) reason: &'a str,
    pub(crate) error: &'a str,
    pub(crate) attempts: u32,
    /// RFC 3339.
    pub(crate) first_failed_at: &'a str,
    pub(crate) last_failed_at: &'a str,
}

/// Stores a dead letter, in a transaction of its own that also claims the
/// message for its consumer on the letter's behalf (a later delivery is a
/// duplicate of the letter, never also applied; a replay releases it). The
/// same message (consumer, queue, id, body) dead-lettered again while its
/// letter is live updates that letter (a lost ack brings a dead letter
/// back). A message processed already is not dead-lettered: nothing is
/// stored and [`Filing::Processed`] says so (a copy delivered too often, or
/// whose failure outlived its processing).
///
/// # Errors
/// [`Error::Database`] when PostgreSQL refuses or cannot be reached.
pub(crate) async fn insert(pool: &PgPool, letter: &Row<'_>) -> Result<Filing> {
    let partitioned = inbox::partitioned::Partitioning::table_is_partitioned(pool).await?;
    let claims = inbox::Inbox::new(letter.consumer).partitioned(partitioned);
    let mut tx = inbox::claim::begin(pool).await?;
    insert_row(&mut tx, letter).await?;
    let held = letter_hold::hold(&mut tx, &claims, letter.message_id, letter.body).await?;
    if held == letter_hold::LetterHold::Processed {
        tx.rollback().await?;
        return Ok(Filing::Processed);
    }
    tx.commit().await?;
    Ok(Filing::Filed)
}

async fn insert_row(tx: &mut PgConnection, letter: &Row<'_>) -> Result<()> {
    let envelope = letter.properties.encode();
    let headers = serde_json::Value::Object(letter.properties.headers_json());
    let body_json = serde_json::from_slice::<serde_json::Value>(letter.body)
        .ok()
        .filter(|v| v.is_object() || v.is_array())
        .map(|v| jsonb_text(&v));
    // An id PostgreSQL text cannot hold is stored as missing.
    let message_id = (!letter.message_id.is_empty() && !letter.message_id.contains('\0'))
        .then_some(letter.message_id);
    sqlx::query(
        "INSERT INTO dead_letters (consumer, queue, message_id, payload_sha256, exchange, \
             routing_key, envelope, headers, body, body_json, reason, error, fingerprint, \
             attempts, first_failed_at, last_failed_at, transport) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8::text::jsonb, $9, $10::text::jsonb, $11, $12, \
             $13, $14, coalesce($15::text::timestamptz, now()), coalesce($16::text::timestamptz, now()), \
             $17) \
         ON CONFLICT (consumer, queue, message_id, payload_sha256) WHERE state = 'live' \
         DO UPDATE SET deliveries = dead_letters.deliveries + 1, \
             attempts = greatest(dead_letters.attempts, excluded.attempts), \
             last_failed_at = greatest(dead_letters.last_failed_at, excluded.last_failed_at), \
             reason = excluded.reason, error = excluded.error, \
             fingerprint = excluded.fingerprint, envelope = excluded.envelope, \
             properties = NULL, headers = excluded.headers",
    )
    .bind(text(letter.consumer).as_ref())
    .bind(text(letter.queue).as_ref())
    .bind(message_id)
    .bind(inbox::payload_sha256(letter.body).to_vec())
    .bind(text(letter.exchange).as_ref())
    .bind(text(letter.routing_key).as_ref())
    .bind(envelope)
    .bind(jsonb_text(&headers))
    .bind(letter.body)
    .bind(body_json)
    .bind(text(letter.reason).as_ref())
    .bind(text(letter.error).as_ref())
    .bind(fingerprint(letter.reason, letter.error))
    .bind(i32::try_from(letter.attempts).unwrap_or(i32::MAX))
    .bind((!letter.first_failed_at.is_empty()).then_some(letter.first_failed_at))
    .bind((!letter.last_failed_at.is_empty()).then_some(letter.last_failed_at))
    .bind(letter.transport)
    .execute(tx)
    .await?;
    Ok(())
}

/// Of `asked` (message ids and bodies), the reason and error of each that
/// has a live letter of `consumer` (same id, same body), in order: a
/// redelivery whose dead-lettering was stored but not settled.
///
/// # Errors
/// The database's.
pub(crate) async fn live(
    conn: &mut PgConnection,
    consumer: &str,
    asked: &[(&str, &[u8])],
) -> sqlx::Result<Vec<Option<(String, String)>>> {
    let ids: Vec<&str> = asked.iter().map(|(id, _)| *id).collect();
    let rows: Vec<(String, Vec<u8>, String, String)> = sqlx::query_as(
        "SELECT message_id, payload_sha256, reason, error FROM dead_letters \
         WHERE message_id = ANY($2) AND consumer = $1 AND state = 'live'",
    )
    .bind(text(consumer).as_ref())
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?;
    Ok(asked
        .iter()
        .map(|(id, body)| {
            let hash = inbox::payload_sha256(body);
            rows.iter()
                .find(|(m, h, _, _)| m == id && h[..] == hash[..])
                .map(|(_, _, reason, error)| (reason.clone(), error.clone()))
        })
        .collect())
}

/// Deletes replayed and discarded letters (of `consumer`, or of every
/// consumer) settled more than `older_than` ago, `batch` rows per
/// statement; returns how many.
///
/// # Errors
/// [`Error::Config`] for a `batch` below 1; [`Error::Database`] when a
/// delete fails.
pub(crate) async fn reap(
    pool: &PgPool,
    consumer: Option<&str>,
    older_than: Duration,
    batch: i64,
) -> Result<u64> {
    if batch < 1 {
        return Err(Error::Config("the reap batch must be at least 1".into()));
    }
    let mut total = 0;
    loop {
        let deleted = sqlx::query(
            "DELETE FROM dead_letters WHERE id IN (SELECT id FROM dead_letters \
                 WHERE state <> 'live' AND ($3::text IS NULL OR consumer = $3) \
                   AND coalesce(replayed_at, discarded_at) < now() - make_interval(secs => $1) \
                 LIMIT $2 FOR UPDATE SKIP LOCKED)",
        )
        .bind(older_than.as_secs_f64())
        .bind(batch)
        .bind(consumer)
        .execute(pool)
        .await?
        .rows_affected();
        total += deleted;
        if deleted < batch as u64 {
            return Ok(total);
        }
    }
}

/// Letters per `DELETE` of the consumer's periodic reaping.
const REAP_BATCH: i64 = 5_000;

/// The `dead_letters` table as the runtime's letter store.
pub(crate) struct TableStore {
    pub(crate) pool: PgPool,
}

impl LetterStore for TableStore {
    fn insert<'a>(
        &'a self,
        letter: &'a NewLetter<'a>,
    ) -> futures::future::BoxFuture<'a, Result<Filing>> {
        Box::pin(async move {
            // The letter is the original's copy, with idempo's headers.
            let message = letter.message;
            let properties = message.stored_properties(letter.headers);
            let row = Row {
                transport: letter.transport,
                consumer: letter.consumer,
                queue: letter.queue,
                message_id: message.id(),
                exchange: message.exchange(),
                routing_key: letter.routing_key,
                properties: &properties,
                body: message.body(),
                reason: letter.reason,
                error: letter.error,
                attempts: letter.attempts,
                first_failed_at: letter.first_failed_at,
                last_failed_at: letter.last_failed_at,
            };
            insert(&self.pool, &row).await
        })
    }

    fn reap<'a>(
        &'a self,
        consumer: &'a str,
        older_than: Duration,
    ) -> futures::future::BoxFuture<'a, Result<u64>> {
        Box::pin(reap(&self.pool, Some(consumer), older_than, REAP_BATCH))
    }
}
