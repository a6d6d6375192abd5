//! The PostgreSQL idempotency store: the `idempotency_keys` table.

use std::time::Duration;

use futures::future::BoxFuture;
use http::StatusCode;
use sqlx::{PgConnection, PgPool, Row};

use super::record::{Fingerprint, RecordKey, StoredResponse};
use super::store::{AtomicStore, Begin, FencingToken, IdempotencyStore, Operation};
use crate::{Error, Result};

/// Records in the `idempotency_keys` table (created by [`migrate`](crate::migrate)).
///
/// Every method is one statement, so it is atomic by itself; the primary key
/// on the record's digest serializes concurrent starts. Durable and shared by
/// every instance of the app. This is the store that offers the *atomic
/// phase*: a handler that extracts a [`Tx`](crate::Tx) writes in the same
/// transaction that completes the record, so the effect and the stored
/// response commit together or not at all.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    /// A store on `pool`; run [`migrate`](crate::migrate) on it first.
    pub fn new(pool: PgPool) -> Self {
        PostgresStore { pool }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// How many records there are per state (`in_progress`, `complete`),
    /// live and expired: for dashboards and the `idempo status` command.
    ///
    /// # Errors
    /// [`Error::Database`] when the query fails (also when the table does
    /// not exist: run [`migrate`](crate::migrate)).
    pub async fn count_by_state(&self) -> Result<Vec<crate::StateCount>> {
        crate::cleanup::count_by_state(&self.pool, "idempotency_keys").await
    }
}

/// An interval parameter in milliseconds.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// How many times `begin` re-reads a record that changed between its two
/// statements (deleted, expired, or its lease ran out) before answering
/// "in progress".
const BEGIN_PASSES: usize = 4;

impl IdempotencyStore for PostgresStore {
    async fn begin(&self, operation: Operation<'_>) -> Result<Begin> {
        let key = operation.key;
        for _ in 0..BEGIN_PASSES {
            // Insert, or take over a record that expired or whose lease ran
            // out with the same fingerprint. When the WHERE fails, nothing is
            // returned and the record is read below.
            let started: Option<i64> = sqlx::query_scalar(
                "INSERT INTO idempotency_keys AS k
                     (record_key, idempotency_key, user_id, method, path, request_hash,
                      state, fencing_token, locked_until, expires_at)
                 VALUES ($1, $2, $3, $4, $5, $6, 'in_progress',
                         nextval('idempotency_fencing_tokens'),
                         clock_timestamp() + $7::bigint * interval '1 millisecond',
                         clock_timestamp() + greatest($7, $8)::bigint * interval '1 millisecond')
                 ON CONFLICT (record_key) DO UPDATE SET
                     request_hash = EXCLUDED.request_hash,
                     state = 'in_progress',
                     fencing_token = EXCLUDED.fencing_token,
                     locked_until = EXCLUDED.locked_until,
                     expires_at = greatest(k.expires_at, EXCLUDED.expires_at),
                     status_code = NULL, response_headers = NULL, response_body = NULL,
                     completed_at = NULL, created_at = clock_timestamp()
                 WHERE k.expires_at <= clock_timestamp()
                    OR (k.state = 'in_progress' AND k.locked_until <= clock_timestamp()
                        AND k.request_hash = EXCLUDED.request_hash)
                 RETURNING fencing_token",
            )
            .bind(&key.digest()[..])
            .bind(key.key())
            .bind(key.user().unwrap_or(""))
            .bind(key.method())
            .bind(key.path())
            .bind(&operation.fingerprint.as_bytes()[..])
            .bind(millis(operation.lease))
            .bind(millis(operation.ttl))
            .fetch_optional(&self.pool)
            .await?;
            if let Some(token) = started {
                return Ok(Begin::Started(FencingToken::new(token)));
            }

            let row = sqlx::query(
                "SELECT request_hash, state, status_code, response_headers, response_body,
                        expires_at <= clock_timestamp() AS expired,
                        coalesce(locked_until <= clock_timestamp(), false) AS lease_over,
                        greatest(0, extract(epoch FROM locked_until - clock_timestamp()) * 1000)::bigint
                            AS lease_left_ms
                 FROM idempotency_keys WHERE record_key = $1",
            )
            .bind(&key.digest()[..])
            .fetch_optional(&self.pool)
            .await?;
            let Some(row) = row else { continue }; // released meanwhile
            if row.get::<bool, _>("expired") {
                continue;
            }
            if Fingerprint::from_slice(row.get("request_hash"))? != *operation.fingerprint {
                return Ok(Begin::Mismatch);
            }
            match row.get::<&str, _>("state") {
                "complete" => {
                    let status: i16 = row.get("status_code");
                    let status = StatusCode::from_u16(status as u16)
                        .map_err(|e| Error::CorruptRecord(format!("stored status: {e}")))?;
                    let headers = StoredResponse::decode_headers(row.get("response_headers"))?;
                    let body: Vec<u8> = row.get("response_body");
                    return Ok(Begin::Completed(StoredResponse::new(
                        status,
                        headers,
                        body.into(),
                    )));
                }
                _ if row.get::<bool, _>("lease_over") => continue,
                _ => {
                    let left: Option<i64> = row.get("lease_left_ms");
                    let lease_left = left
                        .and_then(|ms| u64::try_from(ms).ok())
                        .map(Duration::from_millis);
                    return Ok(Begin::InProgress { lease_left });
                }
            }
        }
        // The record keeps changing under us: someone else is working on it.
        Ok(Begin::InProgress { lease_left: None })
    }

    async fn extend(&self, key: &RecordKey, token: FencingToken, lease: Duration) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE idempotency_keys
             SET locked_until = clock_timestamp() + $3::bigint * interval '1 millisecond',
                 expires_at = greatest(expires_at,
                                       clock_timestamp() + $3::bigint * interval '1 millisecond')
             WHERE record_key = $1 AND fencing_token = $2 AND state = 'in_progress'",
        )
        .bind(&key.digest()[..])
        .bind(token.get())
        .bind(millis(lease))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool> {
        let mut conn = self.pool.acquire().await?;
        complete_on(&mut conn, key, token, response, ttl).await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<bool> {
        let done = sqlx::query(
            "DELETE FROM idempotency_keys
             WHERE record_key = $1 AND fencing_token = $2 AND state = 'in_progress'",
        )
        .bind(&key.digest()[..])
        .bind(token.get())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn delete_expired(&self, limit: usize) -> Result<u64> {
        // SKIP LOCKED: a record being taken over right now is not waited for.
        let done = sqlx::query(
            "DELETE FROM idempotency_keys WHERE record_key IN (
                 SELECT record_key FROM idempotency_keys
                 WHERE expires_at <= clock_timestamp()
                 LIMIT $1 FOR UPDATE SKIP LOCKED)",
        )
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    fn atomic(&self) -> Option<&dyn AtomicStore> {
        Some(self)
    }
}

impl AtomicStore for PostgresStore {
    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn complete_in<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        key: &'a RecordKey,
        token: FencingToken,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(complete_on(tx, key, token, response, ttl))
    }
}

/// Completes a record on `conn`: through the pool, or inside the handler's
/// transaction (the atomic phase), where a stale token makes the caller roll
/// back the handler's writes.
async fn complete_on(
    conn: &mut PgConnection,
    key: &RecordKey,
    token: FencingToken,
    response: &StoredResponse,
    ttl: Duration,
) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE idempotency_keys
         SET state = 'complete', status_code = $3, response_headers = $4, response_body = $5,
             locked_until = NULL, completed_at = clock_timestamp(),
             expires_at = clock_timestamp() + $6::bigint * interval '1 millisecond'
         WHERE record_key = $1 AND fencing_token = $2 AND state = 'in_progress'",
    )
    .bind(&key.digest()[..])
    .bind(token.get())
    .bind(response.status().as_u16() as i16)
    .bind(response.encode_headers())
    .bind(&response.body()[..])
    .bind(millis(ttl))
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}
