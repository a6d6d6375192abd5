//! What operators read and do on the outbox table: its status, the pending
//! groups, the failed rows (retried or discarded). The `idempo outbox`
//! command and the dashboard call these.

use std::time::Duration;

use sqlx::PgPool;

/// The outbox at one instant, for dashboards and alerts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Messages waiting to be published (including ones waiting for a
    /// retry; a packed row counts its messages).
    pub pending: i64,
    /// Messages that used up their attempts: kept, visible, re-triable with
    /// [`FailedMessage::retry`].
    pub failed: i64,
    /// How long the oldest pending row has waited: the lag to alert on.
    pub oldest_pending_age: Option<Duration>,
}

/// Pending messages of one destination and ordering key.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[non_exhaustive]
pub struct PendingGroup {
    /// The transport whose relay publishes them (`amqp`, `nats`).
    pub transport: String,
    /// The exchange (empty: the default exchange, or rows packed together).
    pub exchange: String,
    /// The routing key (empty for rows packed together).
    pub routing_key: String,
    /// The ordering key, if any.
    pub ordering_key: Option<String>,
    /// How many messages.
    pub messages: i64,
    /// How long the oldest has waited, in seconds.
    pub oldest_secs: f64,
}

/// A message the relay gave up on.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
#[non_exhaustive]
pub struct FailedMessage {
    /// The row's id.
    pub id: i64,
    /// The transport whose relay gave up (`amqp`, `nats`).
    pub transport: String,
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

impl OutboxStatus {
    /// Counts pending and failed messages and the age of the oldest pending one.
    ///
    /// # Errors
    /// The query failed.
    pub async fn read(pool: &PgPool) -> Result<OutboxStatus, sqlx::Error> {
        let (pending, failed, oldest): (i64, i64, Option<f64>) = sqlx::query_as(
            "SELECT coalesce(sum(messages) FILTER (WHERE state = 'pending'), 0)::bigint, \
                    coalesce(sum(messages) FILTER (WHERE state = 'failed'), 0)::bigint, \
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
}

impl PendingGroup {
    /// Pending messages per destination and ordering key, the oldest first.
    ///
    /// # Errors
    /// The query failed.
    pub async fn list(pool: &PgPool, limit: i64) -> Result<Vec<PendingGroup>, sqlx::Error> {
        sqlx::query_as(
            "SELECT transport, exchange, routing_key, ordering_key, \
                    sum(messages)::int8 AS messages, \
                    extract(epoch FROM now() - min(created_at))::float8 AS oldest_secs \
             FROM outbox WHERE state = 'pending' \
             GROUP BY transport, exchange, routing_key, ordering_key \
             ORDER BY min(created_at) LIMIT $1",
        )
        .bind(limit)
        .fetch_all(pool)
        .await
    }
}

impl FailedMessage {
    /// The failed rows, oldest first.
    ///
    /// # Errors
    /// The query failed.
    pub async fn list(pool: &PgPool, limit: i64) -> Result<Vec<FailedMessage>, sqlx::Error> {
        sqlx::query_as(
            "SELECT id, transport, message_id, exchange, routing_key, ordering_key, attempts, \
                    last_error \
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
    pub async fn retry(pool: &PgPool, ids: Option<&[i64]>) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(
            "UPDATE outbox SET state = 'pending', attempts = 0, next_attempt_at = now() \
             WHERE state = 'failed' AND ($1::bigint[] IS NULL OR id = ANY($1))",
        )
        .bind(ids)
        .execute(pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Deletes failed rows (all of them when `ids` is `None`): an operator
    /// decided they must not be published; returns how many rows.
    ///
    /// # Errors
    /// The delete failed.
    pub async fn discard(pool: &PgPool, ids: Option<&[i64]>) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(
            "DELETE FROM outbox WHERE state = 'failed' AND ($1::bigint[] IS NULL OR id = ANY($1))",
        )
        .bind(ids)
        .execute(pool)
        .await?;
        Ok(done.rows_affected())
    }
}
