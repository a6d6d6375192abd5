//! The PostgreSQL dedup window: the `dedup_window` table.

use std::time::Duration;

use sqlx::{PgPool, Row};

use super::store::{Reservation, WindowStore};
use crate::Result;

/// Seen ids in the `dedup_window` table (created by [`migrate`](crate::migrate)).
///
/// Each step is one statement: an insert takes over an expired row in the
/// same statement (`ON CONFLICT DO UPDATE ... WHERE expires_at <= now`), so
/// the primary key serializes concurrent inserts of one id. Durable and
/// shared; slower than Redis. Expired rows stay until
/// [`delete_expired`](WindowStore::delete_expired) removes them: spawn
/// [`run_cleanup`](super::run_cleanup).
#[derive(Debug, Clone)]
pub struct PostgresWindow {
    pool: PgPool,
}

impl PostgresWindow {
    /// A window on `pool`; run [`migrate`](crate::migrate) on it first.
    pub fn new(pool: PgPool) -> Self {
        PostgresWindow { pool }
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Inserts (or takes over an expired row); returns whether it did.
const UPSERT: &str = "INSERT INTO dedup_window AS w (key, state, token, value, expires_at)
     VALUES ($1, $2, $3, $4, clock_timestamp() + $5::bigint * interval '1 millisecond')
     ON CONFLICT (key) DO UPDATE SET
         state = EXCLUDED.state, token = EXCLUDED.token, value = EXCLUDED.value,
         expires_at = EXCLUDED.expires_at
     WHERE w.expires_at <= clock_timestamp()
     RETURNING true";

/// How often `reserve` re-reads a row that vanished or expired between its
/// two statements before answering "pending".
const RESERVE_PASSES: usize = 4;

impl WindowStore for PostgresWindow {
    async fn insert(&self, key: &str, value: &str, window: Duration) -> Result<bool> {
        let inserted: Option<bool> = sqlx::query_scalar(UPSERT)
            .bind(key)
            .bind("seen")
            .bind(None::<i64>)
            .bind(value)
            .bind(millis(window))
            .fetch_optional(&self.pool)
            .await?;
        Ok(inserted.is_some())
    }

    async fn reserve(&self, key: &str, lease: Duration) -> Result<Reservation> {
        let token = crate::random::token();
        for _ in 0..RESERVE_PASSES {
            let reserved: Option<bool> = sqlx::query_scalar(UPSERT)
                .bind(key)
                .bind("pending")
                .bind(token)
                .bind(None::<String>)
                .bind(millis(lease))
                .fetch_optional(&self.pool)
                .await?;
            if reserved.is_some() {
                return Ok(Reservation::Reserved { token });
            }
            let row = sqlx::query(
                "SELECT state, value FROM dedup_window
                 WHERE key = $1 AND expires_at > clock_timestamp()",
            )
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
            match row {
                None => continue, // released or expired meanwhile
                Some(row) if row.get::<&str, _>("state") == "seen" => {
                    let value: Option<String> = row.get("value");
                    return Ok(Reservation::Seen(value.unwrap_or_default()));
                }
                Some(_) => return Ok(Reservation::Pending),
            }
        }
        Ok(Reservation::Pending)
    }

    async fn record(&self, key: &str, token: i64, value: &str, window: Duration) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE dedup_window
             SET state = 'seen', token = NULL, value = $3,
                 expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond'
             WHERE key = $1 AND token = $2 AND state = 'pending'
               AND expires_at > clock_timestamp()",
        )
        .bind(key)
        .bind(token)
        .bind(value)
        .bind(millis(window))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, key: &str, token: i64) -> Result<bool> {
        let done = sqlx::query(
            "DELETE FROM dedup_window WHERE key = $1 AND token = $2 AND state = 'pending'",
        )
        .bind(key)
        .bind(token)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn delete_expired(&self, limit: usize) -> Result<u64> {
        let done = sqlx::query(
            "DELETE FROM dedup_window WHERE key IN (
                 SELECT key FROM dedup_window WHERE expires_at <= clock_timestamp()
                 LIMIT $1 FOR UPDATE SKIP LOCKED)",
        )
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}
