//! The PostgreSQL dedup window: the `dedup_window` table.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::{PgPool, Row};

use super::store::{Insertion, Reservation, WindowStore, bounded, check_key, check_value};
use crate::probe::{self, Probe};
use crate::{Error, Result};

/// How long one store call may take, by default.
pub(crate) const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest a timed-out call then spends finding out why.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Seen ids in the `dedup_window` table (created by [`migrate`](crate::migrate)).
///
/// Each step is one statement: an insert takes over an expired row in the
/// same statement (`ON CONFLICT DO UPDATE ... WHERE expires_at <= now`), so
/// the primary key serializes concurrent inserts of one id. Durable and
/// shared; slower than Redis.
///
/// ```no_run
/// # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use idempo::window::{DedupWindow, PostgresWindow, WindowStore};
///
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
/// idempo::migrate(&pool).await?;
/// let store = PostgresWindow::new(pool).timeout(Duration::from_secs(2));
/// // Expired rows stay until deleted: one cleanup task per database.
/// let cleanup = tokio::spawn(store.clone().run_cleanup(Duration::from_secs(60)));
/// let window = DedupWindow::new(store);
/// # cleanup.abort();
/// # Ok(()) }
/// ```
///
/// # Cleanup
/// Expired rows stay until [`delete_expired`](WindowStore::delete_expired)
/// removes them: spawn [`run_cleanup`](super::WindowStore::run_cleanup) as above.
///
/// # Timeouts
/// Each call takes at most the store timeout (5 s,
/// 5 s; see [`timeout`](Self::timeout)), waiting for a pool connection
/// included. When it runs out (or the pool gives up first, which it reports
/// only as "pool timed out"), one direct connection attempt of at most 2 s
/// finds out why: its error is returned ([`Error::Database`], for example
/// "connection refused" for a wrong port), or [`StoreError::Timeout`](crate::StoreError::Timeout) when
/// that attempt gets no answer either (a blackholed address) or connects
/// (the pool is exhausted, or a statement waits on a lock).
///
/// # Limits
/// Keys longer than 2,048 bytes and keys or
/// values holding a NUL byte are refused with [`Error::Config`] before the
/// database is asked.
#[derive(Debug, Clone)]
pub struct PostgresWindow {
    pool: PgPool,
    timeout: Duration,
    /// Set while a timed-out call probes the database: the calls that time
    /// out meanwhile skip their own probe, so an outage under load does not
    /// become a storm of connection attempts.
    probing: Arc<AtomicBool>,
}

impl PostgresWindow {
    /// A window on `pool`; run [`migrate`](crate::migrate) on it first.
    pub fn new(pool: PgPool) -> Self {
        PostgresWindow {
            pool,
            timeout: DEFAULT_STORE_TIMEOUT,
            probing: Arc::default(),
        }
    }

    /// How long one store call may take (at least 1 ms; default
    /// 5 s, 5 s): see [Timeouts](Self#timeouts).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.clamp(Duration::from_millis(1), super::store::MAX_WINDOW);
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// How many entries there are per state (`pending`, `seen`), live and
    /// expired: for dashboards and the `idempo status` command. Not bounded
    /// by the store timeout.
    ///
    /// # Errors
    /// [`Error::Database`] when the query fails (also when the table does
    /// not exist: run [`migrate`](crate::migrate)).
    pub async fn count_by_state(&self) -> Result<Vec<crate::StateCount>> {
        crate::cleanup::count_by_state(&self.pool, "dedup_window").await
    }

    /// Runs one store call within the store timeout; when it runs out, says why.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = std::result::Result<T, sqlx::Error>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            // sqlx retries a refused connection silently until its acquire
            // timeout and then reports only this: the probe says why.
            Ok(Err(sqlx::Error::PoolTimedOut)) | Err(_) => Err(self.why_unanswered().await),
            Ok(Err(e)) => Err(Error::Database(e)),
        }
    }

    /// One direct connection attempt with the pool's options
    /// ([`probe`](crate::probe)): its error is the reason the pool could
    /// not answer.
    async fn why_unanswered(&self) -> Error {
        let timed_out: Error = crate::StoreError::Timeout(self.timeout).into();
        if self.probing.swap(true, Ordering::AcqRel) {
            return timed_out;
        }
        let options = self.pool.connect_options();
        let (host, port) = (options.get_host().to_owned(), options.get_port());
        let probe = probe::probe(&options, PROBE_TIMEOUT.min(self.timeout)).await;
        self.probing.store(false, Ordering::Release);
        match probe {
            Probe::Failed(e) => {
                tracing::warn!(%host, port, error = %e, "the dedup window's database cannot be reached");
                Error::Database(e)
            }
            Probe::Answers => {
                tracing::warn!(%host, port, timeout = ?self.timeout,
                    "the dedup window's database accepts connections but the call did not finish in time \
                     (pool exhausted, or a statement waiting on a lock)");
                timed_out
            }
            Probe::Silent => {
                tracing::warn!(%host, port, timeout = ?self.timeout,
                    "the dedup window's database does not answer a connection attempt");
                timed_out
            }
        }
    }

    /// The live entry of `key`, if any (`None`: absent, or expired).
    async fn live(&self, key: &str) -> std::result::Result<Option<Insertion>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT state, value FROM dedup_window
             WHERE key = $1 AND expires_at > clock_timestamp()",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|row| {
            if row.get::<&str, _>("state") == "seen" {
                Insertion::Seen(row.get::<Option<String>, _>("value").unwrap_or_default())
            } else {
                Insertion::Pending
            }
        }))
    }

    /// The upsert, then (if the key was present) what is there. A row that
    /// vanished or expired between the two statements is tried again.
    async fn upsert(
        &self,
        key: &str,
        state: &str,
        token: Option<i64>,
        value: Option<&str>,
        ttl: Duration,
    ) -> std::result::Result<Insertion, sqlx::Error> {
        for _ in 0..RESERVE_PASSES {
            let inserted: Option<bool> = sqlx::query_scalar(UPSERT)
                .bind(key)
                .bind(state)
                .bind(token)
                .bind(value)
                .bind(millis(ttl))
                .fetch_optional(&self.pool)
                .await?;
            if inserted.is_some() {
                return Ok(Insertion::New);
            }
            if let Some(live) = self.live(key).await? {
                return Ok(live);
            }
        }
        Ok(Insertion::Pending)
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(bounded(d).as_millis()).unwrap_or(i64::MAX)
}

/// Inserts (or takes over an expired row); returns whether it did.
const UPSERT: &str = "INSERT INTO dedup_window AS w (key, state, token, value, expires_at)
     VALUES ($1, $2, $3, $4, clock_timestamp() + $5::bigint * interval '1 millisecond')
     ON CONFLICT (key) DO UPDATE SET
         state = EXCLUDED.state, token = EXCLUDED.token, value = EXCLUDED.value,
         expires_at = EXCLUDED.expires_at
     WHERE w.expires_at <= clock_timestamp()
     RETURNING true";

/// How often an insert or a reservation re-reads a row that vanished or
/// expired between its two statements before answering "pending".
const RESERVE_PASSES: usize = 4;

impl WindowStore for PostgresWindow {
    async fn insert(&self, key: &str, value: &str, window: Duration) -> Result<Insertion> {
        check_key(key)?;
        check_value(value)?;
        self.bounded(self.upsert(key, "seen", None, Some(value), window))
            .await
    }

    async fn reserve(&self, key: &str, lease: Duration) -> Result<Reservation> {
        check_key(key)?;
        let token = crate::random::token()?;
        let found = self
            .bounded(self.upsert(key, "pending", Some(token), None, lease))
            .await?;
        Ok(match found {
            Insertion::New => Reservation::Reserved { token },
            Insertion::Seen(value) => Reservation::Seen(value),
            Insertion::Pending => Reservation::Pending,
        })
    }

    async fn record(&self, key: &str, token: i64, value: &str, window: Duration) -> Result<bool> {
        check_key(key)?;
        check_value(value)?;
        let done = self
            .bounded(
                sqlx::query(
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
                .execute(&self.pool),
            )
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, key: &str, token: i64) -> Result<bool> {
        check_key(key)?;
        let done = self
            .bounded(
                sqlx::query(
                    "DELETE FROM dedup_window WHERE key = $1 AND token = $2 AND state = 'pending'",
                )
                .bind(key)
                .bind(token)
                .execute(&self.pool),
            )
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn delete_expired(&self, limit: usize) -> Result<u64> {
        let done = self
            .bounded(
                sqlx::query(
                    "DELETE FROM dedup_window WHERE key IN (
                         SELECT key FROM dedup_window WHERE expires_at <= clock_timestamp()
                         LIMIT $1 FOR UPDATE SKIP LOCKED)",
                )
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .execute(&self.pool),
            )
            .await?;
        Ok(done.rows_affected())
    }
}
