//! All SQL on `dead_letters`: the runtime's insert, the queries, and the
//! state changes (replay through the outbox, discard, purge, reap).

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use lapin::BasicProperties;
use lapin::protocol::basic::{gen_properties, parse_properties};
use sqlx::{PgPool, Postgres, QueryBuilder, Row};

use super::{
    Filter, Group, Letter, LetterDetail, ReplayOptions, ReplayReport, fingerprint::fingerprint,
};
use crate::amqp::DeadLetter;
use crate::inbox::{self, Claim};
use crate::outbox::{self, OutboxMessage};
use crate::runtime::headers::json_headers;
use crate::runtime::letters::{LetterStore, NewLetter};
use crate::{Error, Result};

/// A letter's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LetterState {
    /// Waiting for an operator.
    Live,
    /// Staged in the outbox by a replay.
    Replayed,
    /// Discarded: kept for audit until reaped.
    Discarded,
}

impl LetterState {
    /// As stored: `live`, `replayed`, `discarded`.
    pub fn as_str(self) -> &'static str {
        match self {
            LetterState::Live => "live",
            LetterState::Replayed => "replayed",
            LetterState::Discarded => "discarded",
        }
    }
}

/// A timestamp as RFC 3339 text, UTC, milliseconds.
const RFC3339: &str = "to_char({} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')";

fn rfc3339(column: &str) -> String {
    RFC3339.replace("{}", column)
}

/// The columns of a [`Letter`].
fn letter_columns() -> String {
    format!(
        "id, consumer, queue, message_id, reason, error, fingerprint, attempts, deliveries, \
         {} AS first_failed_at, {} AS last_failed_at, state, replay_count, \
         {} AS replayed_at, replayed_by, replayed_to, {} AS discarded_at, discarded_by, \
         length(body)::int8 AS body_bytes",
        rfc3339("first_failed_at"),
        rfc3339("last_failed_at"),
        rfc3339("replayed_at"),
        rfc3339("discarded_at"),
    )
}

fn letter(row: &sqlx::postgres::PgRow) -> std::result::Result<Letter, sqlx::Error> {
    Ok(Letter {
        id: row.try_get("id")?,
        consumer: row.try_get("consumer")?,
        queue: row.try_get("queue")?,
        message_id: row.try_get("message_id")?,
        reason: row.try_get("reason")?,
        error: row.try_get("error")?,
        fingerprint: row.try_get("fingerprint")?,
        attempts: row.try_get("attempts")?,
        deliveries: row.try_get("deliveries")?,
        first_failed_at: row.try_get("first_failed_at")?,
        last_failed_at: row.try_get("last_failed_at")?,
        state: row.try_get("state")?,
        replay_count: row.try_get("replay_count")?,
        replayed_at: row.try_get("replayed_at")?,
        replayed_by: row.try_get("replayed_by")?,
        replayed_to: row.try_get("replayed_to")?,
        discarded_at: row.try_get("discarded_at")?,
        discarded_by: row.try_get("discarded_by")?,
        body_bytes: row.try_get("body_bytes")?,
    })
}

/// PostgreSQL text cannot hold NUL: the lossless copy is in `properties`.
fn text(s: &str) -> Cow<'_, str> {
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

fn epoch(t: SystemTime) -> f64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

/// `WHERE …` for `filter` (the table's alias is none).
fn push_filter(q: &mut QueryBuilder<Postgres>, filter: &Filter) {
    q.push(" WHERE true");
    if !filter.any_state {
        let state = filter.state.unwrap_or(LetterState::Live);
        q.push(" AND state = ").push_bind(state.as_str());
    }
    if let Some(consumer) = &filter.consumer {
        q.push(" AND consumer = ").push_bind(consumer.clone());
    }
    if let Some(queue) = &filter.queue {
        q.push(" AND queue = ").push_bind(queue.clone());
    }
    if let Some(reason) = &filter.reason {
        q.push(" AND reason = ").push_bind(reason.clone());
    }
    if let Some(fingerprint) = &filter.fingerprint {
        q.push(" AND fingerprint = ").push_bind(fingerprint.clone());
    }
    if !filter.message_ids.is_empty() {
        q.push(" AND message_id = ANY(")
            .push_bind(filter.message_ids.clone())
            .push(")");
    }
    if !filter.ids.is_empty() {
        q.push(" AND id = ANY(")
            .push_bind(filter.ids.clone())
            .push(")");
    }
    if let Some(since) = filter.since {
        q.push(" AND last_failed_at >= to_timestamp(")
            .push_bind(epoch(since))
            .push(")");
    }
    if let Some(until) = filter.until {
        q.push(" AND last_failed_at < to_timestamp(")
            .push_bind(epoch(until))
            .push(")");
    }
    if let Some(path) = &filter.body_path {
        q.push(" AND body_json IS NOT NULL AND jsonb_path_exists(body_json, ")
            .push_bind(path.clone())
            .push("::jsonpath)");
    }
    if let Some(after) = filter.after_id {
        q.push(" AND id > ").push_bind(after);
    }
}

/// Stores a dead letter, in a transaction of its own. The same message
/// (consumer, queue, id, body) dead-lettered again while its letter is
/// live updates that letter (a lost ack brings a dead letter back).
///
/// # Errors
/// [`Error::Database`] when PostgreSQL refuses or cannot be reached.
pub(crate) async fn insert(pool: &PgPool, letter: &NewLetter<'_>) -> Result<()> {
    let properties = match gen_properties(letter.properties)(Vec::new().into()) {
        Ok(written) => written.write,
        Err(e) => {
            return Err(Error::Config(format!(
                "cannot encode the dead letter's properties: {e}"
            )));
        }
    };
    let headers = letter
        .properties
        .headers()
        .as_ref()
        .map(|h| serde_json::Value::Object(json_headers(h)))
        .unwrap_or_else(|| serde_json::json!({}));
    let body_json = serde_json::from_slice::<serde_json::Value>(letter.body)
        .ok()
        .filter(|v| v.is_object() || v.is_array())
        .map(|v| jsonb_text(&v));
    // An id PostgreSQL text cannot hold is stored as missing.
    let message_id = (!letter.message_id.is_empty() && !letter.message_id.contains('\0'))
        .then_some(letter.message_id);
    sqlx::query(
        "INSERT INTO dead_letters (consumer, queue, message_id, payload_sha256, exchange, \
             routing_key, properties, headers, body, body_json, reason, error, fingerprint, \
             attempts, first_failed_at, last_failed_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8::text::jsonb, $9, $10::text::jsonb, $11, $12, \
             $13, $14, coalesce($15::text::timestamptz, now()), coalesce($16::text::timestamptz, now())) \
         ON CONFLICT (consumer, queue, message_id, payload_sha256) WHERE state = 'live' \
         DO UPDATE SET deliveries = dead_letters.deliveries + 1, \
             attempts = greatest(dead_letters.attempts, excluded.attempts), \
             last_failed_at = greatest(dead_letters.last_failed_at, excluded.last_failed_at), \
             reason = excluded.reason, error = excluded.error, \
             fingerprint = excluded.fingerprint, properties = excluded.properties, \
             headers = excluded.headers",
    )
    .bind(text(letter.consumer).as_ref())
    .bind(text(letter.queue).as_ref())
    .bind(message_id)
    .bind(inbox::payload_sha256(letter.body).to_vec())
    .bind(text(letter.exchange).as_ref())
    .bind(text(letter.routing_key).as_ref())
    .bind(properties)
    .bind(jsonb_text(&headers))
    .bind(letter.body)
    .bind(body_json)
    .bind(text(letter.reason).as_ref())
    .bind(text(letter.error).as_ref())
    .bind(fingerprint(letter.reason, letter.error))
    .bind(i32::try_from(letter.attempts).unwrap_or(i32::MAX))
    .bind((!letter.first_failed_at.is_empty()).then_some(letter.first_failed_at))
    .bind((!letter.last_failed_at.is_empty()).then_some(letter.last_failed_at))
    .execute(pool)
    .await?;
    Ok(())
}

/// Whether the `dead_letters` table exists (idempo's migrations ran).
///
/// # Errors
/// [`Error::Database`] when the query fails.
#[cfg(feature = "ops")]
pub(crate) async fn table_exists(pool: &PgPool) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT to_regclass('dead_letters') IS NOT NULL")
            .fetch_one(pool)
            .await?,
    )
}

/// Whether any letter (in any state) of `queue` is in the table.
///
/// # Errors
/// [`Error::Database`] when the query fails.
#[cfg(feature = "ops")]
pub(crate) async fn holds(pool: &PgPool, queue: &str) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM dead_letters WHERE queue = $1)")
            .bind(queue)
            .fetch_one(pool)
            .await?,
    )
}

/// Live letters per consumer, queue and cause, for `idempo status`.
///
/// # Errors
/// [`Error::Database`] when the query fails (the table missing too).
#[cfg(feature = "ops")]
pub(crate) async fn counts(pool: &PgPool) -> Result<Vec<super::LetterCount>> {
    let rows: Vec<(String, String, String, String, i64)> = sqlx::query_as(
        "SELECT consumer, queue, fingerprint, min(reason), count(*) FROM dead_letters \
         WHERE state = 'live' GROUP BY consumer, queue, fingerprint \
         ORDER BY consumer, queue, count(*) DESC",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(consumer, queue, fingerprint, reason, count)| super::LetterCount {
                consumer,
                queue,
                fingerprint,
                reason,
                count,
            },
        )
        .collect())
}

/// How many letters `filter` selects (its limit and paging ignored).
///
/// # Errors
/// As [`list`].
pub async fn count(pool: &PgPool, filter: &Filter) -> Result<u64> {
    let whole = Filter {
        limit: None,
        after_id: None,
        ..filter.clone()
    };
    let mut q = QueryBuilder::new("SELECT count(*) FROM dead_letters");
    push_filter(&mut q, &whole);
    let count: i64 = q.build_query_scalar().fetch_one(pool).await?;
    Ok(u64::try_from(count).unwrap_or_default())
}

/// The letters of `filter`, oldest first (at most `limit`, 100 by default).
///
/// # Errors
/// [`Error::Database`] when the query fails (a malformed `body_path` too).
pub async fn list(pool: &PgPool, filter: &Filter) -> Result<Vec<Letter>> {
    let mut q = QueryBuilder::new(format!("SELECT {} FROM dead_letters", letter_columns()));
    push_filter(&mut q, filter);
    q.push(" ORDER BY id LIMIT ")
        .push_bind(filter.limit.unwrap_or(100));
    let rows = q.build().fetch_all(pool).await?;
    Ok(rows
        .iter()
        .map(letter)
        .collect::<std::result::Result<_, _>>()?)
}

/// The letters of `filter` grouped by queue and fingerprint, the largest
/// group first.
///
/// # Errors
/// As [`list`].
pub async fn groups(pool: &PgPool, filter: &Filter) -> Result<Vec<Group>> {
    let mut q = QueryBuilder::new(format!(
        "SELECT fingerprint, queue, min(reason) AS reason, count(*) AS count, \
             {} AS first_seen, {} AS last_seen, \
             (array_agg(error ORDER BY last_failed_at DESC, id DESC))[1] AS sample_error \
         FROM dead_letters",
        rfc3339("min(first_failed_at)"),
        rfc3339("max(last_failed_at)")
    ));
    push_filter(&mut q, filter);
    q.push(" GROUP BY queue, fingerprint ORDER BY count(*) DESC, max(last_failed_at) DESC");
    if let Some(limit) = filter.limit {
        q.push(" LIMIT ").push_bind(limit);
    }
    let rows = q.build().fetch_all(pool).await?;
    let mut groups = Vec::with_capacity(rows.len());
    for row in rows {
        groups.push(Group {
            fingerprint: row.try_get("fingerprint")?,
            queue: row.try_get("queue")?,
            reason: row.try_get("reason")?,
            count: row.try_get("count")?,
            first_seen: row.try_get("first_seen")?,
            last_seen: row.try_get("last_seen")?,
            sample_error: row.try_get("sample_error")?,
        });
    }
    Ok(groups)
}

/// One letter whole, by row id, whatever its state.
///
/// # Errors
/// [`Error::Database`] when the query fails.
pub async fn show(pool: &PgPool, id: i64) -> Result<Option<LetterDetail>> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {}, exchange, routing_key, headers::text AS headers_json, properties, body \
         FROM dead_letters WHERE id = $1",
        letter_columns()
    )))
    .bind(id)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let headers: String = row.try_get("headers_json")?;
    let encoded: Vec<u8> = row.try_get("properties")?;
    Ok(Some(LetterDetail {
        letter: letter(&row)?,
        exchange: row.try_get("exchange")?,
        routing_key: row.try_get("routing_key")?,
        headers: serde_json::from_str(&headers).unwrap_or_default(),
        properties: decode_properties(&encoded).unwrap_or_default(),
        body: row.try_get("body")?,
    }))
}

fn decode_properties(encoded: &[u8]) -> Option<BasicProperties> {
    parse_properties(encoded).ok().map(|(_, p)| p)
}

/// Replays the live letters of `filter` exactly once: per batch, one
/// transaction stages each letter in the outbox (its original message id,
/// body and properties, its failure history moved into the replay
/// headers) and marks it replayed; `progress` sees the report after each
/// batch. Letters whose id the consumer already processed are skipped
/// unless `options.force`.
///
/// # Errors
/// [`Error::Database`] when a batch fails (the batches before it are
/// replayed; that batch is untouched).
pub async fn replay(
    pool: &PgPool,
    filter: &Filter,
    options: &ReplayOptions,
    mut progress: impl FnMut(&ReplayReport),
) -> Result<ReplayReport> {
    let mut report = ReplayReport::default();
    let mut skipped_ids: Vec<i64> = Vec::new();
    let live = Filter {
        state: Some(LetterState::Live),
        any_state: false,
        ..filter.clone()
    };
    if options.dry_run {
        report.replayed = count(pool, &live).await?;
        return Ok(report);
    }
    let batch = options.batch_size.max(1);
    let mut left = filter.limit;
    loop {
        let take = left.map_or(batch, |l| l.min(batch));
        if take <= 0 {
            break;
        }
        let mut tx = pool.begin().await?;
        let mut q = QueryBuilder::new(
            "SELECT id, consumer, queue, message_id, properties, body FROM dead_letters",
        );
        push_filter(&mut q, &live);
        q.push(" AND NOT (id = ANY(")
            .push_bind(skipped_ids.clone())
            .push(")) ORDER BY id LIMIT ")
            .push_bind(take)
            .push(" FOR UPDATE SKIP LOCKED");
        let rows = q.build().fetch_all(&mut *tx).await?;
        if rows.is_empty() {
            tx.rollback().await?;
            break;
        }
        let mut messages = Vec::with_capacity(rows.len());
        let mut replayed = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.try_get("id")?;
            let consumer: String = row.try_get("consumer")?;
            let queue: String = row.try_get("queue")?;
            let message_id: Option<String> = row.try_get("message_id")?;
            let encoded: Vec<u8> = row.try_get("properties")?;
            let body: Vec<u8> = row.try_get("body")?;
            if let (Some(mid), false) = (&message_id, options.force) {
                let claim = inbox::Inbox::new(consumer.as_str())
                    .lookup(pool, mid, &body)
                    .await?;
                if claim != Claim::Fresh {
                    let why = match claim {
                        Claim::Mismatch => "its id was processed with another body (use force)",
                        _ => "its id was processed since (use force)",
                    };
                    skipped_ids.push(id);
                    report.skipped.push((id, why.into()));
                    continue;
                }
            }
            let Some(properties) = decode_properties(&encoded) else {
                skipped_ids.push(id);
                report
                    .skipped
                    .push((id, "its stored properties cannot be decoded".into()));
                continue;
            };
            let to = options.to.clone().unwrap_or(queue);
            messages.push(replay_message(&properties, message_id, &to, body)?);
            replayed.push((id, to));
        }
        if !messages.is_empty() {
            outbox::stage_all(&mut *tx, messages)
                .await
                .map_err(|e| Error::Other(Box::new(e)))?;
            let ids: Vec<i64> = replayed.iter().map(|(id, _)| *id).collect();
            let targets: Vec<String> = replayed.into_iter().map(|(_, to)| to).collect();
            sqlx::query(
                "UPDATE dead_letters d SET state = 'replayed', replay_count = replay_count + 1, \
                     replayed_at = now(), replayed_by = $3, replayed_to = t.target \
                 FROM unnest($1::int8[], $2::text[]) AS t(id, target) WHERE d.id = t.id",
            )
            .bind(&ids)
            .bind(&targets)
            .bind(text(&options.by).as_ref())
            .execute(&mut *tx)
            .await?;
            report.replayed += ids.len() as u64;
            if let Some(l) = left.as_mut() {
                *l -= ids.len() as i64;
            }
        }
        tx.commit().await?;
        progress(&report);
        if let Some(pause) = options.throttle {
            tokio::time::sleep(pause).await;
        }
    }
    Ok(report)
}

/// The outbox message that replays a letter: through the default exchange
/// to `to`, with the letter's id, body and properties, its failure history
/// in the replay headers (as [`DeadLetter::replay_properties`] writes them).
fn replay_message(
    properties: &BasicProperties,
    message_id: Option<String>,
    to: &str,
    body: Vec<u8>,
) -> Result<OutboxMessage> {
    let replayed = DeadLetter::new(properties).replay_properties();
    let mut message = OutboxMessage::new("", to, body);
    if let Some(id) = message_id {
        message = message.message_id(id);
    }
    if let Some(content_type) = replayed.content_type() {
        message = message.content_type(content_type.as_str());
    }
    if let Some(correlation_id) = replayed.correlation_id() {
        message = message.correlation_id(correlation_id.as_str());
    }
    if replayed.delivery_mode() == &Some(1) {
        message = message.transient();
    }
    if let Some(headers) = replayed.headers() {
        for (name, value) in json_headers(headers) {
            message = message.header(name, value);
        }
    }
    Ok(message)
}

/// Marks the live letters of `filter` discarded by `who` (kept for audit
/// until [`reap`]ed); returns how many.
///
/// # Errors
/// [`Error::Database`] when the update fails.
pub async fn discard(pool: &PgPool, filter: &Filter, who: &str) -> Result<u64> {
    let live = Filter {
        state: Some(LetterState::Live),
        any_state: false,
        ..filter.clone()
    };
    let mut q = QueryBuilder::new(
        "UPDATE dead_letters SET state = 'discarded', discarded_at = now(), discarded_by = ",
    );
    q.push_bind(text(who).into_owned());
    push_filter(&mut q, &live);
    Ok(q.build().execute(pool).await?.rows_affected())
}

/// Deletes the letters of `filter` (live ones unless the filter says
/// otherwise); returns how many.
///
/// # Errors
/// [`Error::Database`] when the delete fails.
pub async fn purge(pool: &PgPool, filter: &Filter) -> Result<u64> {
    let mut q = QueryBuilder::new("DELETE FROM dead_letters");
    push_filter(&mut q, filter);
    Ok(q.build().execute(pool).await?.rows_affected())
}

/// Deletes replayed and discarded letters (of `consumer`, or of every
/// consumer) settled more than `older_than` ago, `batch` rows per
/// statement; returns how many.
///
/// # Errors
/// [`Error::Config`] for a `batch` below 1; [`Error::Database`] when a
/// delete fails.
pub async fn reap(
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

/// The `dead_letters` table as the runtime's letter store.
pub(crate) struct TableStore {
    pub(crate) pool: PgPool,
}

impl LetterStore for TableStore {
    fn insert<'a>(
        &'a self,
        letter: &'a NewLetter<'a>,
    ) -> futures::future::BoxFuture<'a, Result<()>> {
        Box::pin(insert(&self.pool, letter))
    }
}
