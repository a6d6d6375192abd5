//! The transactional outbox (feature `outbox`, on by default): messages a
//! transaction emits exactly when it commits.
//!
//! A handler that publishes to the broker directly emits a phantom event when
//! its transaction later rolls back, and loses the event when the process dies
//! between commit and publish. [`stage`] instead writes the message as a row
//! of the `outbox` table **in the caller's transaction**: it commits or rolls
//! back with the caller's writes. A relay ([`amqp::Relay`](crate::amqp::Relay),
//! run by every [`Consumer`](crate::amqp::Consumer) by default) publishes
//! committed rows with publisher confirms and `mandatory`, and deletes each
//! row only after the broker confirmed it. A crash anywhere leads to a resend
//! of the same `message_id`, never to a loss, and an idempo consumer
//! downstream deduplicates the resend: consume → write → emit → the next
//! consumer has exactly-once effects end to end.
//!
//! Staging works on any `&mut PgConnection` in a transaction: the
//! [`Tx`](crate::Tx) of an AMQP handler or of an HTTP handler behind the
//! idempotency layer, or your own `pool.begin()`.
//!
//! ```no_run
//! use idempo::outbox::{self, OutboxMessage};
//!
//! #[derive(serde::Serialize)]
//! struct Receipt { account: String, amount_cents: i64 }
//!
//! # async fn doc(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let mut tx = pool.begin().await?;
//! sqlx::query("UPDATE balances SET cents = cents + 250 WHERE account = 'alice'")
//!     .execute(&mut *tx)
//!     .await?;
//! outbox::stage(
//!     &mut tx,
//!     OutboxMessage::json("", "receipts", &Receipt { account: "alice".into(), amount_cents: 250 })?,
//! )
//! .await?;
//! tx.commit().await?; // the receipt is published now, once, by a relay
//! # Ok(()) }
//! ```
//!
//! What is guaranteed, exactly: a staged message is published **at least
//! once** after its transaction commits and **never** if it rolls back; every
//! copy carries the id fixed at staging, so a deduplicating consumer applies
//! it exactly once. Messages with the same [ordering
//! key](OutboxMessage::ordering_key) are published in commit order.

mod message;
#[cfg_attr(not(feature = "amqp"), allow(dead_code))]
pub(crate) mod packed;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;

pub use message::{DEFAULT_MAX_BODY_SIZE, OutboxMessage, TRACEPARENT_HEADER};

/// The channel the staging trigger notifies on commit.
#[cfg_attr(not(feature = "amqp"), allow(dead_code))]
pub(crate) const NOTIFY_CHANNEL: &str = "idempo_outbox";

/// The first key of the advisory locks that order staging per ordering key
/// (the second is the key's hash): "outb".
const ORDERING_LOCK_SPACE: i32 = 0x6f75_7462;

/// Why a message could not be staged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The body could not be serialised.
    #[error("cannot serialise the message body: {0}")]
    Serialize(#[source] serde_json::Error),
    /// The body is larger than the limit (see [`OutboxMessage::max_body_size`]).
    #[error("the message body is {size} bytes, above the limit of {limit} bytes")]
    TooLarge {
        /// The body's size.
        size: usize,
        /// The limit it broke.
        limit: usize,
    },
    /// The message id is empty or longer than 255 bytes.
    #[error(transparent)]
    InvalidMessageId(#[from] crate::inbox::InvalidMessageId),
    /// A field the broker or PostgreSQL would refuse.
    #[error("invalid {field}: {reason}")]
    InvalidField {
        /// Which field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The insert failed (connection lost, no `outbox` table: run
    /// [`idempo::migrate`](crate::migrate)).
    #[error("cannot stage the message: {0}")]
    Database(#[from] sqlx::Error),
}

impl OutboxError {
    /// Whether staging the same message again can never succeed (a bad
    /// message, not a lost connection): a handler returning it is
    /// dead-lettered rather than retried.
    pub fn is_permanent(&self) -> bool {
        !matches!(self, OutboxError::Database(_))
    }
}

/// Stages one message in the transaction behind `conn`; returns its message
/// id. The message is published after the transaction commits, never if it
/// rolls back.
///
/// `conn` is anything that dereferences to a [`PgConnection`] inside a
/// transaction: `&mut tx` of a `sqlx::Transaction`, or `&mut guard` of a
/// [`Tx::try_lock`](crate::Tx::try_lock) guard. Outside a transaction the
/// row commits at once, which is rarely what you want.
///
/// # Errors
/// [`OutboxError`]: an invalid message (oversized body, bad id or field), or
/// the insert failed.
pub async fn stage(conn: &mut PgConnection, message: OutboxMessage) -> Result<String, OutboxError> {
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
    conn: &mut PgConnection,
    messages: impl IntoIterator<Item = OutboxMessage>,
) -> Result<Vec<String>, OutboxError> {
    let mut messages: Vec<OutboxMessage> = messages.into_iter().collect();
    if messages.is_empty() {
        return Ok(Vec::new());
    }
    let traceparent = current_traceparent();
    for m in &mut messages {
        m.validate()?;
        if m.message_id.is_none() {
            m.message_id = Some(crate::random::uuid_v7());
        }
        if let Some(tp) = &traceparent {
            m.headers
                .entry(TRACEPARENT_HEADER)
                .or_insert_with(|| tp.clone().into());
        }
    }
    // Inside a consumer's unit whose relay runs in this process, the runtime
    // wakes the relay after the commit: no NOTIFY (see the migration).
    // On the unit's own transaction and without ordering keys, the rows are
    // written by the commit's claim check (`commit_unit`): no round trip here.
    let address = &*conn as *const PgConnection as usize;
    let deferred = UNIT
        .try_with(|unit| unit.defer(address, &messages))
        .unwrap_or(false);
    if deferred {
        return Ok(staged(messages));
    }
    let quiet = UNIT
        .try_with(|unit| unit.staged.store(true, Ordering::Relaxed))
        .is_ok()
        && LOCAL_RELAYS.load(Ordering::Relaxed) > 0;
    let mut keys: Vec<&str> = messages
        .iter()
        .filter_map(|m| m.ordering_key.as_deref())
        .collect();
    if keys.is_empty() && messages.len() > 1 {
        // One row for the lot: a fraction of the writes of a row each.
        insert_packed(conn, &messages, quiet, None).await?;
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
        [m] => insert_one(conn, m, quiet, None).await?,
        _ => insert_rows(conn, &messages, quiet).await?,
    };
    Ok(staged(messages))
}

/// Commits a consumer's unit whose handler staged `messages` on it: the
/// claim check of [`inbox::commit`](crate::inbox::commit) and the outbox rows
/// in ONE statement (the rows are written only if the claim is still there),
/// then `COMMIT`. Forwarding then costs no round trip of its own.
#[cfg_attr(not(feature = "amqp"), allow(dead_code))]
pub(crate) async fn commit_unit(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    consumer: &str,
    message_id: &str,
    messages: Vec<OutboxMessage>,
) -> crate::Result<()> {
    let quiet = LOCAL_RELAYS.load(Ordering::Relaxed) > 0;
    let claim = Some((consumer, message_id));
    let written = match messages.as_slice() {
        [m] => insert_one(&mut tx, m, quiet, claim).await?,
        _ => insert_packed(&mut tx, &messages, quiet, claim).await?,
    };
    if written == 0 {
        return Err(crate::Error::ClaimLost {
            message_id: message_id.to_owned(),
        });
    }
    tx.commit().await?;
    Ok(())
}

// The three ways a row gets into the outbox. Each turns the staging
// trigger's NOTIFY off for the transaction when `quiet` (a relay of this
// process is woken after the commit instead: see the migration), and with a
// `claim` (consumer, message id) writes only while that claim stands: the
// claim check of a unit's commit and its rows in one statement.

/// `set_config`'s value for `idempo.outbox_notify`.
fn notify_setting(quiet: bool) -> &'static str {
    if quiet { "off" } else { "" }
}

/// One message, one row; returns the rows written (0: the claim is gone).
async fn insert_one(
    conn: &mut PgConnection,
    m: &OutboxMessage,
    quiet: bool,
    claim: Option<(&str, &str)>,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, content_type, \
                             correlation_id, persistent, headers, ordering_key) \
         SELECT $1, $2, $3, $4, $5, $6, $7, $8::text::jsonb, $9 \
         FROM (SELECT set_config('idempo.outbox_notify', $10, true)) AS notify \
         WHERE $11::text IS NULL OR EXISTS ( \
             SELECT 1 FROM processed_messages WHERE consumer = $11 AND message_id = $12)",
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
    .bind(claim.map(|(consumer, _)| consumer))
    .bind(claim.map(|(_, id)| id))
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Several unkeyed messages in one packed row (`packed.rs`); returns the
/// rows written (0: the claim is gone).
async fn insert_packed(
    conn: &mut PgConnection,
    messages: &[OutboxMessage],
    quiet: bool,
    claim: Option<(&str, &str)>,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, packed, messages) \
         SELECT '', '', $1, ''::bytea, $2, $3 \
         FROM (SELECT set_config('idempo.outbox_notify', $4, true)) AS notify \
         WHERE $5::text IS NULL OR EXISTS ( \
             SELECT 1 FROM processed_messages WHERE consumer = $5 AND message_id = $6)",
    )
    .bind(messages[0].message_id.as_deref().unwrap_or_default())
    .bind(packed::encode(messages))
    .bind(messages.len() as i32)
    .bind(notify_setting(quiet))
    .bind(claim.map(|(consumer, _)| consumer))
    .bind(claim.map(|(_, id)| id))
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
                             correlation_id, persistent, headers, ordering_key) \
         SELECT e, r, i, b, c, k, p, h::jsonb, o \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], \
                     $6::text[], $7::bool[], $8::text[], $9::text[]) \
              WITH ORDINALITY AS t(e, r, i, b, c, k, p, h, o, n), \
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
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Counts what was staged, wakes a dormant relay, returns the ids.
fn staged(messages: Vec<OutboxMessage>) -> Vec<String> {
    metrics::counter!("idempo_outbox_staged_total").increment(messages.len() as u64);
    staged_in_process().notify_waiters();
    messages
        .into_iter()
        .map(|m| m.message_id.expect("set at staging"))
        .collect()
}

/// A message id derived from the id of the message being handled and a
/// purpose (`"receipt"`): the same inputs give the same id in every process,
/// different purposes give different ids. A UUID-shaped string of 128 bits of
/// SHA-256 (version 8), well within the 255 bytes an idempo consumer accepts.
pub fn derived_message_id(incoming_id: &str, purpose: &str) -> String {
    let digest = Sha256::new()
        .chain_update(incoming_id.as_bytes())
        .chain_update([0])
        .chain_update(purpose.as_bytes())
        .finalize();
    let b: [u8; 16] = digest[..16].try_into().expect("16 of 32 bytes");
    uuid::Builder::from_custom_bytes(b).into_uuid().to_string()
}

tokio::task_local! {
    static TRACEPARENT: Option<String>;
    static UNIT: Arc<UnitStaging>;
}

/// Whether a consumer's unit (one delivery, or a batch) staged anything, so
/// that the runtime wakes the local relay after the commit.
#[derive(Debug, Default)]
pub(crate) struct UnitStaging {
    staged: AtomicBool,
    /// The address of the unit's connection (0: none): only what is staged
    /// on it is deferred to the commit, not what a handler stages on a
    /// transaction of its own.
    connection: AtomicUsize,
    deferred: std::sync::Mutex<Vec<OutboxMessage>>,
}

impl UnitStaging {
    /// Marks `connection` as the unit's transaction.
    #[cfg_attr(not(feature = "amqp"), allow(dead_code))]
    pub(crate) fn on(connection: &PgConnection) -> Self {
        let unit = UnitStaging::default();
        unit.connection.store(
            connection as *const PgConnection as usize,
            Ordering::Relaxed,
        );
        unit
    }

    /// Keeps unkeyed messages staged on the unit's connection for the commit.
    fn defer(&self, connection: usize, messages: &[OutboxMessage]) -> bool {
        if connection != self.connection.load(Ordering::Relaxed)
            || messages.iter().any(|m| m.ordering_key.is_some())
        {
            return false;
        }
        self.staged.store(true, Ordering::Relaxed);
        self.deferred
            .lock()
            .expect("not poisoned")
            .extend_from_slice(messages);
        true
    }

    /// The messages kept for the commit.
    #[cfg_attr(not(feature = "amqp"), allow(dead_code))]
    pub(crate) fn take_deferred(&self) -> Vec<OutboxMessage> {
        std::mem::take(&mut *self.deferred.lock().expect("not poisoned"))
    }

    #[cfg_attr(not(feature = "amqp"), allow(dead_code))]
    pub(crate) fn staged(&self) -> bool {
        self.staged.load(Ordering::Relaxed)
    }
}

/// Runs a consumer unit's handler with `unit` as its staging record.
#[cfg_attr(not(feature = "amqp"), allow(dead_code))]
pub(crate) async fn in_unit<F: Future>(unit: Arc<UnitStaging>, future: F) -> F::Output {
    UNIT.scope(unit, future).await
}

/// Relays running in this process (connected, publishing).
static LOCAL_RELAYS: AtomicUsize = AtomicUsize::new(0);

/// Counts a running relay in this process while it lives.
#[cfg_attr(not(feature = "amqp"), allow(dead_code))]
pub(crate) struct LocalRelay(());

impl LocalRelay {
    #[cfg_attr(not(feature = "amqp"), allow(dead_code))]
    pub(crate) fn running() -> Self {
        LOCAL_RELAYS.fetch_add(1, Ordering::Relaxed);
        LocalRelay(())
    }
}

impl Drop for LocalRelay {
    fn drop(&mut self) {
        LOCAL_RELAYS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Woken (with a stored permit) after a consumer committed a unit that
/// staged: the local relay's replacement for `NOTIFY`.
#[cfg_attr(not(feature = "amqp"), allow(dead_code))]
pub(crate) fn committed_in_process() -> &'static Notify {
    static COMMITTED: OnceLock<Notify> = OnceLock::new();
    COMMITTED.get_or_init(Notify::new)
}

/// Runs `future` with a W3C `traceparent` that [`stage`] copies into the
/// headers of every message staged inside it (unless the message has its
/// own). The AMQP consumer runs each per-message handler this way with the
/// incoming message's `traceparent` header; call it yourself around an HTTP
/// handler, with the one from the request or from your OpenTelemetry context.
pub async fn with_traceparent<F: Future>(traceparent: Option<String>, future: F) -> F::Output {
    TRACEPARENT.scope(traceparent, future).await
}

/// The `traceparent` set by the innermost [`with_traceparent`], if any.
pub fn current_traceparent() -> Option<String> {
    TRACEPARENT.try_with(Clone::clone).ok().flatten()
}

/// Woken whenever this process stages something, so that a dormant relay
/// wakes up (it then learns of the commit through `NOTIFY`).
pub(crate) fn staged_in_process() -> &'static Notify {
    static STAGED: OnceLock<Notify> = OnceLock::new();
    STAGED.get_or_init(Notify::new)
}

/// The outbox at one instant, for dashboards and alerts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Rows waiting to be published (including ones waiting for a retry).
    pub pending: i64,
    /// Rows that used up their attempts: kept, visible, re-triable with
    /// [`retry_failed`].
    pub failed: i64,
    /// How long the oldest pending row has waited: the lag to alert on.
    pub oldest_pending_age: Option<Duration>,
}

/// Counts pending and failed rows and the age of the oldest pending one.
///
/// # Errors
/// The query failed.
pub async fn status(pool: &PgPool) -> Result<OutboxStatus, sqlx::Error> {
    let (pending, failed, oldest): (i64, i64, Option<f64>) = sqlx::query_as(
        "SELECT coalesce(sum(messages) FILTER (WHERE state = 'pending'), 0)::bigint, \
                count(*) FILTER (WHERE state = 'failed'), \
                extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'pending'))::float8 \
         FROM outbox WHERE state <> 'done'",
    )
    .fetch_one(pool)
    .await?;
    Ok(OutboxStatus {
        pending,
        failed,
        oldest_pending_age: oldest.map(|s| Duration::from_secs_f64(s.max(0.0))),
    })
}

/// A message the relay gave up on.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
#[non_exhaustive]
pub struct FailedMessage {
    /// The row's id.
    pub id: i64,
    /// The AMQP message id.
    pub message_id: String,
    /// Where it was to go.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// Its ordering key.
    pub ordering_key: Option<String>,
    /// How many times the relay tried.
    pub attempts: i32,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
}

/// The failed rows, oldest first.
///
/// # Errors
/// The query failed.
pub async fn failed(pool: &PgPool, limit: i64) -> Result<Vec<FailedMessage>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, message_id, exchange, routing_key, ordering_key, attempts, last_error \
         FROM outbox WHERE state = 'failed' ORDER BY id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Puts failed rows back to pending with their attempts reset (all of them
/// when `ids` is `None`); returns how many. A re-tried row of an ordering
/// key is published after the ones that overtook it while it was failed.
///
/// # Errors
/// The update failed.
pub async fn retry_failed(pool: &PgPool, ids: Option<&[i64]>) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE outbox SET state = 'pending', attempts = 0, next_attempt_at = now() \
         WHERE state = 'failed' AND ($1::bigint[] IS NULL OR id = ANY($1))",
    )
    .bind(ids)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// Deletes up to `batch` published rows kept longer than `keep` (rows are
/// kept only with [`Relay::keep_published`](crate::amqp::Relay::keep_published));
/// returns how many. The relay calls it in bounded batches.
///
/// # Errors
/// The delete failed.
pub async fn delete_published_before(
    pool: &PgPool,
    keep: Duration,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM outbox WHERE id IN ( \
             SELECT id FROM outbox \
             WHERE state = 'done' AND published_at < now() - make_interval(secs => $1) \
             ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
    )
    .bind(keep.as_secs_f64())
    .bind(batch)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_ids_are_stable_and_distinct_per_purpose() {
        let a = derived_message_id("payment-1", "receipt");
        assert_eq!(a, derived_message_id("payment-1", "receipt"));
        assert_ne!(a, derived_message_id("payment-1", "audit"));
        assert_ne!(a, derived_message_id("payment-2", "receipt"));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(derived_message_id("ab", "c"), derived_message_id("a", "bc"));
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "8");
        // Derived ids are stored (in inboxes, in other systems): the same
        // inputs give this very string in every build.
        assert_eq!(a, "d835c9a6-9b8d-85af-aef1-80933421cea5");
    }

    #[tokio::test]
    async fn the_traceparent_is_scoped_to_the_future() {
        assert_eq!(current_traceparent(), None);
        let inside = with_traceparent(Some("00-abc-def-01".into()), async {
            current_traceparent()
        })
        .await;
        assert_eq!(inside.as_deref(), Some("00-abc-def-01"));
        assert_eq!(current_traceparent(), None);
    }
}
