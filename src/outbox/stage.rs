//! Staging: [`stage`] and [`stage_all`] write messages as `outbox` rows in
//! the caller's transaction; all staging SQL on the table lives here.

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, Postgres, Transaction};

use super::unit::UnitOutbox;
use super::{OutboxError, OutboxMessage, current_traceparent, packed};
use crate::headers::TRACEPARENT_HEADER;

/// The first key of the advisory locks that order staging per ordering key
/// (the second is the key's hash): "outb".
const ORDERING_LOCK_SPACE: i32 = 0x6f75_7462;

/// A connection inside a transaction that messages can be staged on: a
/// `&mut` of a [`sqlx::Transaction`], a [`PgConnection`], a pooled
/// connection, or the [`TxGuard`](crate::TxGuard) of a handler's [`Tx`](crate::Tx).
///
/// A consumer handler's guard is the fast path: messages without an ordering
/// key staged through it are written by the statement that checks the
/// message's claim before `COMMIT`, so forwarding costs no round trip of its
/// own, and the consumer's relay is woken right after the commit.
pub trait StageTarget: sealed::Sealed + Send {
    /// The connection, and the consumer unit's outbox buffer when this is a
    /// handler's guard.
    #[doc(hidden)]
    fn target(&mut self) -> (&mut PgConnection, Option<&UnitOutbox>);
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for sqlx::PgConnection {}
    impl Sealed for sqlx::Transaction<'_, sqlx::Postgres> {}
    impl Sealed for sqlx::pool::PoolConnection<sqlx::Postgres> {}
    #[cfg(any(idempo_runtime, feature = "http", feature = "saga"))]
    impl Sealed for crate::TxGuard<'_> {}
}

impl StageTarget for PgConnection {
    fn target(&mut self) -> (&mut PgConnection, Option<&UnitOutbox>) {
        (self, None)
    }
}

impl StageTarget for Transaction<'_, Postgres> {
    fn target(&mut self) -> (&mut PgConnection, Option<&UnitOutbox>) {
        (self, None)
    }
}

impl StageTarget for PoolConnection<Postgres> {
    fn target(&mut self) -> (&mut PgConnection, Option<&UnitOutbox>) {
        (self, None)
    }
}

// The guard of a transaction a runtime owns: a consumer unit's carries its
// outbox buffer.
#[cfg(any(idempo_runtime, feature = "http", feature = "saga"))]
impl StageTarget for crate::TxGuard<'_> {
    fn target(&mut self) -> (&mut PgConnection, Option<&UnitOutbox>) {
        let (conn, attachment) = self.split();
        (
            conn,
            attachment.and_then(|a| a.downcast_ref::<UnitOutbox>()),
        )
    }
}

/// Stages one message in the transaction behind `conn`; returns its message
/// id. The message is published after the transaction commits, never if it
/// rolls back.
///
/// `conn` is a transaction's connection (see [`StageTarget`]): `&mut tx` of
/// a `sqlx::Transaction`, or `&mut guard` of a
/// [`Tx::try_lock`](crate::Tx::try_lock) guard. Outside a transaction the
/// row commits at once, which is rarely what you want.
///
/// # Errors
/// [`OutboxError`]: an invalid message (oversized body, bad id or field), or
/// the insert failed.
pub async fn stage(
    conn: &mut impl StageTarget,
    message: OutboxMessage,
) -> Result<String, OutboxError> {
    let mut ids = stage_all(conn, [message]).await?;
    Ok(ids.pop().expect("one message staged"))
}

/// Stages many messages with one statement (for batch handlers); returns
/// their message ids in order. All or nothing: one invalid message refuses
/// the lot before anything is written.
///
/// # Errors
/// As [`stage`].
pub async fn stage_all(
    conn: &mut impl StageTarget,
    messages: impl IntoIterator<Item = OutboxMessage>,
) -> Result<Vec<String>, OutboxError> {
    let mut messages: Vec<OutboxMessage> = messages.into_iter().collect();
    if messages.is_empty() {
        return Ok(Vec::new());
    }
    let traceparent = current_traceparent();
    for m in &mut messages {
        if m.message_id.is_none() {
            m.message_id = Some(crate::random::uuid_v7()?);
        }
        if let Some(tp) = &traceparent {
            m.headers
                .entry(TRACEPARENT_HEADER)
                .or_insert_with(|| tp.clone().into());
        }
        // With its id and trace context: the header frame as it will go out.
        m.validate()?;
    }
    let (conn, unit) = conn.target();
    // Through a consumer's guard, a message goes out on the consumer's
    // transport unless it names another.
    if let Some(unit) = unit {
        for m in &mut messages {
            m.transport
                .get_or_insert_with(|| unit.transport().to_owned());
        }
    }
    // On a consumer unit's guard, unkeyed messages wait for the unit's
    // commit, which writes them: no round trip here.
    if let Some(unit) = unit
        && unit.defer(&messages)
    {
        return Ok(staged(messages));
    }
    let quiet = unit.is_some_and(UnitOutbox::staged_now);
    let mut keys: Vec<&str> = messages
        .iter()
        .filter_map(|m| m.ordering_key.as_deref())
        .collect();
    let one_transport = messages
        .iter()
        .all(|m| m.transport_or_default() == messages[0].transport_or_default());
    if keys.is_empty() && messages.len() > 1 && one_transport {
        // One row for the lot: a fraction of the writes of a row each.
        insert_packed(conn, &messages, quiet).await?;
        return Ok(staged(messages));
    }
    if !keys.is_empty() {
        // Held until commit: the next transaction staging this key gets a
        // larger id only after this one committed, so id order is commit
        // order per key. Sorted, so two stagers cannot deadlock.
        keys.sort_unstable();
        keys.dedup();
        sqlx::query(
            "SELECT count(pg_advisory_xact_lock($1, hashtext(k))) \
             FROM (SELECT k FROM unnest($2::text[]) AS k ORDER BY k) AS keys",
        )
        .bind(ORDERING_LOCK_SPACE)
        .bind(&keys)
        .execute(&mut *conn)
        .await?;
    }
    match messages.as_slice() {
        // One message: a plain insert, cheaper than unnesting arrays.
        [m] => insert_one(conn, m, quiet).await?,
        _ => insert_rows(conn, &messages, quiet).await?,
    };
    Ok(staged(messages))
}

/// The statements that write the messages a consumer unit's handler
/// deferred, which the unit's commit runs just before `COMMIT`, in the same
/// round trip (`runtime::unit_tx::commit`). Empty when none.
///
/// # Errors
/// A message whose fields cannot be written as literals.
#[cfg(idempo_runtime)]
pub(crate) fn deferred_statements(unit: &UnitOutbox) -> crate::Result<String> {
    let (deferred, quiet) = unit.take_deferred();
    deferred_rows(&deferred, quiet)
}

/// The statements that write a unit's deferred messages, as SQL text with
/// literals (they travel in one simple query with the unit's
/// `COMMIT`): a row, or a packed row for several. Empty when none.
#[cfg(idempo_runtime)]
fn deferred_rows(deferred: &[OutboxMessage], quiet: bool) -> crate::Result<String> {
    use crate::literal::{bytes, optional_text, text};
    let mut sql = String::new();
    if deferred.is_empty() {
        return Ok(sql);
    }
    if quiet {
        sql.push_str("SELECT set_config('idempo.outbox_notify', 'off', true); ");
    }
    // A row (or a packed row) per run of messages of one transport: a
    // packed row's messages share its transport.
    for run in deferred.chunk_by(|a, b| a.transport_or_default() == b.transport_or_default()) {
        match run {
            [m] => {
                sql.push_str(
                    "INSERT INTO outbox (exchange, routing_key, message_id, body, content_type, \
                                         correlation_id, persistent, headers, envelope, \
                                         transport) VALUES (",
                );
                let values = [
                    text("exchange", &m.exchange)?,
                    text("routing key", &m.routing_key)?,
                    optional_text("message id", m.message_id.as_deref())?,
                    bytes(&m.body),
                    optional_text("content type", m.content_type.as_deref())?,
                    optional_text("correlation id", m.correlation_id.as_deref())?,
                    m.persistent.to_string(),
                    format!("{}::jsonb", text("headers", &m.headers_text())?),
                    m.exact_encoded()
                        .map_or_else(|| "NULL".to_owned(), |e| bytes(&e)),
                    text("transport", m.transport_or_default())?,
                ];
                sql.push_str(&values.join(", "));
            }
            many => {
                sql.push_str(
                    "INSERT INTO outbox (exchange, routing_key, message_id, body, packed, \
                                         messages, transport) VALUES ('', '', ",
                );
                sql.push_str(&text(
                    "message id",
                    many[0].message_id.as_deref().unwrap_or_default(),
                )?);
                sql.push_str(", ''::bytea, ");
                sql.push_str(&bytes(&packed::encode(many)));
                sql.push_str(&format!(", {}, ", many.len()));
                sql.push_str(&text("transport", many[0].transport_or_default())?);
            }
        }
        sql.push_str("); ");
    }
    Ok(sql)
}

// The three ways a row gets into the outbox at staging. Each turns the
// staging trigger's NOTIFY off for the transaction when `quiet` (the
// consumer's own relay is woken after the commit instead: see the migration).

/// `set_config`'s value for `idempo.outbox_notify`.
fn notify_setting(quiet: bool) -> &'static str {
    if quiet { "off" } else { "" }
}

/// One message, one row.
async fn insert_one(
    conn: &mut PgConnection,
    m: &OutboxMessage,
    quiet: bool,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, content_type, \
                             correlation_id, persistent, headers, ordering_key, envelope, \
                             transport) \
         SELECT $1, $2, $3, $4, $5, $6, $7, $8::text::jsonb, $9, $11, $12 \
         FROM (SELECT set_config('idempo.outbox_notify', $10, true)) AS notify",
    )
    .bind(&m.exchange)
    .bind(&m.routing_key)
    .bind(&m.message_id)
    .bind(&m.body)
    .bind(&m.content_type)
    .bind(&m.correlation_id)
    .bind(m.persistent)
    .bind(m.headers_text())
    .bind(&m.ordering_key)
    .bind(notify_setting(quiet))
    .bind(m.exact_encoded())
    .bind(m.transport_or_default())
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Several unkeyed messages in one packed row (`packed.rs`).
async fn insert_packed(
    conn: &mut PgConnection,
    messages: &[OutboxMessage],
    quiet: bool,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, packed, messages, \
                             transport) \
         SELECT '', '', $1, ''::bytea, $2, $3, $5 \
         FROM (SELECT set_config('idempo.outbox_notify', $4, true)) AS notify",
    )
    .bind(messages[0].message_id.as_deref().unwrap_or_default())
    .bind(packed::encode(messages))
    .bind(messages.len() as i32)
    .bind(notify_setting(quiet))
    .bind(messages[0].transport_or_default())
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Several messages, a row each, in staging order (messages with ordering
/// keys: each row is published on its own).
async fn insert_rows(
    conn: &mut PgConnection,
    messages: &[OutboxMessage],
    quiet: bool,
) -> Result<u64, sqlx::Error> {
    let column = |f: fn(&OutboxMessage) -> Option<&str>| -> Vec<Option<&str>> {
        messages.iter().map(f).collect()
    };
    let bodies: Vec<&[u8]> = messages.iter().map(|m| m.body.as_slice()).collect();
    let persistent: Vec<bool> = messages.iter().map(|m| m.persistent).collect();
    let headers: Vec<String> = messages.iter().map(OutboxMessage::headers_text).collect();
    let done = sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, content_type, \
                             correlation_id, persistent, headers, ordering_key, envelope, \
                             transport) \
         SELECT e, r, i, b, c, k, p, h::jsonb, o, pr, tr \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], \
                     $6::text[], $7::bool[], $8::text[], $9::text[], $11::bytea[], $12::text[]) \
              WITH ORDINALITY AS t(e, r, i, b, c, k, p, h, o, pr, tr, n), \
              (SELECT set_config('idempo.outbox_notify', $10, true)) AS notify \
         ORDER BY n",
    )
    .bind(column(|m| Some(&m.exchange)))
    .bind(column(|m| Some(&m.routing_key)))
    .bind(column(|m| m.message_id.as_deref()))
    .bind(&bodies)
    .bind(column(|m| m.content_type.as_deref()))
    .bind(column(|m| m.correlation_id.as_deref()))
    .bind(&persistent)
    .bind(&headers)
    .bind(column(|m| m.ordering_key.as_deref()))
    .bind(notify_setting(quiet))
    .bind(
        messages
            .iter()
            .map(OutboxMessage::exact_encoded)
            .collect::<Vec<_>>(),
    )
    .bind(column(|m| Some(m.transport_or_default())))
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Counts what was staged and returns the ids.
fn staged(messages: Vec<OutboxMessage>) -> Vec<String> {
    metrics::counter!("idempo_outbox_staged_total").increment(messages.len() as u64);
    messages
        .into_iter()
        .map(|m| m.message_id.expect("set at staging"))
        .collect()
}
