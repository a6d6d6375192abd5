//! The operators' SQL on `dead_letters`: filters, lists, groups, one
//! letter, counts, discard and purge (feature `ops`).

use std::time::SystemTime;

use sqlx::{PgPool, Postgres, QueryBuilder, Row};

use super::model::{Filter, Group, Letter, LetterCount, LetterDetail, LetterState, from_micros};
use crate::Result;
use crate::properties::Properties;
use crate::runtime::letter_table::text;

/// A timestamp column as microseconds since the epoch (a [`SystemTime`]
/// once read: no time formatting in SQL).
fn micros(column: &str) -> String {
    format!("(extract(epoch FROM {column}) * 1000000)::int8")
}

/// The columns of a [`Letter`].
fn letter_columns() -> String {
    format!(
        "id, consumer, queue, routing_key, message_id, reason, error, fingerprint, attempts, \
         deliveries, {} AS first_failed_at, {} AS last_failed_at, state, replay_count, \
         {} AS replayed_at, replayed_by, replayed_to, {} AS discarded_at, discarded_by, \
         length(body)::int8 AS body_bytes, headers ? 'x-idempo-reason' AS idempo, transport",
        micros("first_failed_at"),
        micros("last_failed_at"),
        micros("replayed_at"),
        micros("discarded_at"),
    )
}

fn time(
    row: &sqlx::postgres::PgRow,
    column: &str,
) -> std::result::Result<Option<SystemTime>, sqlx::Error> {
    Ok(row.try_get::<Option<i64>, _>(column)?.map(from_micros))
}

fn count_of(n: i32) -> u32 {
    u32::try_from(n).unwrap_or_default()
}

fn letter(row: &sqlx::postgres::PgRow) -> std::result::Result<Letter, sqlx::Error> {
    let state: String = row.try_get("state")?;
    Ok(Letter {
        id: Some(row.try_get("id")?),
        consumer: Some(row.try_get("consumer")?),
        queue: Some(row.try_get("queue")?),
        routing_key: row.try_get("routing_key")?,
        message_id: row.try_get("message_id")?,
        reason: row.try_get("reason")?,
        error: Some(row.try_get("error")?),
        fingerprint: row.try_get("fingerprint")?,
        attempts: Some(count_of(row.try_get("attempts")?)),
        deliveries: count_of(row.try_get("deliveries")?),
        first_failed_at: time(row, "first_failed_at")?,
        last_failed_at: time(row, "last_failed_at")?,
        state: LetterState::parse(&state).unwrap_or(LetterState::Live),
        replay_count: count_of(row.try_get("replay_count")?),
        replayed_at: time(row, "replayed_at")?,
        replayed_by: row.try_get("replayed_by")?,
        replayed_to: row.try_get("replayed_to")?,
        discarded_at: time(row, "discarded_at")?,
        discarded_by: row.try_get("discarded_by")?,
        body_bytes: u64::try_from(row.try_get::<i64, _>("body_bytes")?).unwrap_or_default(),
        foreign: !row.try_get::<Option<bool>, _>("idempo")?.unwrap_or(false),
        transport: row.try_get("transport")?,
    })
}

fn epoch(t: SystemTime) -> f64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

/// `WHERE …` for `filter` (the table's alias is none).
pub(super) fn push_filter(q: &mut QueryBuilder<Postgres>, filter: &Filter) {
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

/// Whether the `dead_letters` table exists (idempo's migrations ran).
///
/// # Errors
/// [`Error::Database`] when the query fails.
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
pub(crate) async fn counts(pool: &PgPool) -> Result<Vec<LetterCount>> {
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
            |(consumer, queue, fingerprint, reason, count)| LetterCount {
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
pub(crate) async fn count(pool: &PgPool, filter: &Filter) -> Result<u64> {
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
pub(crate) async fn list(pool: &PgPool, filter: &Filter) -> Result<Vec<Letter>> {
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
pub(crate) async fn groups(pool: &PgPool, filter: &Filter) -> Result<Vec<Group>> {
    let mut q = QueryBuilder::new(format!(
        "SELECT fingerprint, queue, min(reason) AS reason, count(*) AS count, \
             {} AS first_seen, {} AS last_seen, \
             (array_agg(error ORDER BY last_failed_at DESC, id DESC))[1] AS sample_error \
         FROM dead_letters",
        micros("min(first_failed_at)"),
        micros("max(last_failed_at)")
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
            count: u64::try_from(row.try_get::<i64, _>("count")?).unwrap_or_default(),
            first_seen: time(&row, "first_seen")?,
            last_seen: time(&row, "last_seen")?,
            sample_error: row.try_get("sample_error")?,
        });
    }
    Ok(groups)
}

/// One letter whole, by row id, whatever its state.
///
/// # Errors
/// [`Error::Database`] when the query fails.
pub(crate) async fn show(pool: &PgPool, id: i64) -> Result<Option<LetterDetail>> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {}, exchange, headers::text AS headers_json, envelope, properties, body \
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
    let properties = stored(row.try_get("envelope")?, row.try_get("properties")?);
    Ok(Some(LetterDetail {
        letter: letter(&row)?,
        exchange: row.try_get("exchange")?,
        headers: serde_json::from_str(&headers).unwrap_or_default(),
        properties: serde_json::Value::Object(
            properties.map(|p| p.fields_json()).unwrap_or_default(),
        ),
        body: row.try_get("body")?,
    }))
}

/// A letter's properties and headers: from `envelope` (idempo's encoding),
/// or from `properties` (AMQP's, letters stored before); `None` when
/// neither reads.
pub(super) fn stored(envelope: Option<Vec<u8>>, amqp: Option<Vec<u8>>) -> Option<Properties> {
    match (envelope, amqp) {
        (Some(envelope), _) => Properties::decode(&envelope).ok(),
        (None, Some(amqp)) => legacy(&amqp),
        (None, None) => None,
    }
}

/// AMQP's encoding of a letter's properties, stored before `envelope`.
#[cfg(feature = "amqp")]
fn legacy(amqp: &[u8]) -> Option<Properties> {
    let (_, properties) = lapin::protocol::basic::parse_properties(amqp).ok()?;
    Some(crate::amqp::stored::to_stored(&properties))
}

/// Without the AMQP client, a letter stored in AMQP's encoding is read from
/// its readable columns only.
#[cfg(not(feature = "amqp"))]
fn legacy(_amqp: &[u8]) -> Option<Properties> {
    None
}

/// Marks the live letters of `filter` discarded by `who` (kept for audit
/// until [`reap`]ed); returns how many.
///
/// # Errors
/// [`Error::Database`] when the update fails.
pub(crate) async fn discard(pool: &PgPool, filter: &Filter, who: &str) -> Result<u64> {
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
pub(crate) async fn purge(pool: &PgPool, filter: &Filter) -> Result<u64> {
    let mut q = QueryBuilder::new("DELETE FROM dead_letters");
    push_filter(&mut q, filter);
    Ok(q.build().execute(pool).await?.rows_affected())
}

/// The work queues of the live letters of `transport` that `filter` selects.
///
/// # Errors
/// [`crate::Error::Database`] when the query fails.
pub(crate) async fn queues(pool: &PgPool, filter: &Filter, transport: &str) -> Result<Vec<String>> {
    let live = Filter {
        state: Some(LetterState::Live),
        any_state: false,
        limit: None,
        after_id: None,
        ..filter.clone()
    };
    let mut q = QueryBuilder::new("SELECT DISTINCT queue FROM dead_letters");
    push_filter(&mut q, &live);
    q.push(" AND transport = ").push_bind(transport.to_owned());
    Ok(q.build_query_scalar().fetch_all(pool).await?)
}
