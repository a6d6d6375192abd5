//! **All DDL on `processed_messages`'s partitions**: the switch from the
//! plain table, partitions created ahead, partitions retired.
//!
//! Lock levels (PostgreSQL 15), and why no claim waits long:
//! - a partition is created as a table of its own (with its primary key and
//!   a `CHECK` of its bounds, so nothing is scanned) and then `ATTACH`ed:
//!   `SHARE UPDATE EXCLUSIVE` on the parent, which claims (`ROW EXCLUSIVE`,
//!   `ACCESS SHARE`) do not conflict with. `CREATE TABLE ... PARTITION OF`
//!   would take `ACCESS EXCLUSIVE` on the parent, and is not used;
//! - a partition is retired by `DETACH PARTITION ... CONCURRENTLY` (again
//!   `SHARE UPDATE EXCLUSIVE`; it waits for the transactions that may use
//!   it, without blocking new claims), then `DROP TABLE` of what is by then
//!   a table no claim reads. `DROP TABLE` of an attached partition would
//!   take `ACCESS EXCLUSIVE` on the parent. `CONCURRENTLY` refuses a table
//!   with a `DEFAULT` partition, so there is none: partitions are created
//!   ahead instead;
//! - every statement runs with a `lock_timeout`, so even a lock queued behind
//!   a long transaction gives up (and the next pass tries again) rather than
//!   hold the claims queued behind it.
//!
//! One maintainer at a time: a session advisory lock per schema, *tried*, so
//! a second instance skips the pass ([`Maintained::skipped`]) instead of
//! waiting. The pass unlocks and returns its pooled connection when it
//! ends; a pass that fails or is cancelled midway closes the connection
//! instead, so the lock cannot be left behind.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};

use super::{PartitionError, Partitioning};
use crate::error::Result;
use crate::inbox::Inbox;

/// How long a DDL statement waits for a lock before it gives up.
const LOCK_TIMEOUT: &str = "2s";

/// The maintainers' advisory lock: one per schema.
const LOCK_KEY: &str =
    "hashtextextended('idempo processed_messages partitions ' || current_schema(), 28)";

/// One partition of `processed_messages`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Partition {
    /// Its table's name.
    pub name: String,
    /// Its upper bound (exclusive), in seconds since the Unix epoch; `None`
    /// for an unbounded one (never created by idempo).
    pub upper_epoch_secs: Option<f64>,
    /// A `DETACH ... CONCURRENTLY` was interrupted: the next [`Inbox::maintain`]
    /// finishes it.
    pub detach_pending: bool,
}

/// What one [`Inbox::maintain`] pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Maintained {
    /// Another instance held the maintainers' lock: nothing was done.
    pub skipped: bool,
    /// The partitions created.
    pub created: Vec<String>,
    /// The partitions detached and dropped.
    pub dropped: Vec<String>,
    /// The consumers whose retention no longer counted: not seen (no
    /// maintenance pass of theirs) for longer than that retention.
    pub forgotten: Vec<String>,
}

/// What [`Partitioning::switch`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Switched {
    /// `processed_messages` was partitioned already: nothing was done.
    pub already: bool,
    /// The plain table's new name, now the oldest partition (every claim
    /// made before the switch), retired like the others.
    pub before: Option<String>,
    /// The partitions created for claims after the switch.
    pub created: Vec<String>,
}

impl Partitioning {
    /// Whether `processed_messages` (in the connection's `search_path`) is
    /// partitioned already.
    ///
    /// # Errors
    /// [`PartitionError::MissingTable`] (in [`Error::Other`](crate::Error::Other))
    /// when it does not exist; [`Error::Database`](crate::Error::Database).
    pub async fn table_is_partitioned(pool: &PgPool) -> Result<bool> {
        is_partitioned(pool).await
    }

    /// Turns a plain `processed_messages` into the partitioned one, cut by
    /// these settings, keeping every claim; `retention` is the longest any
    /// consumer keeps its claims (`None`: forever). Idempotent: a
    /// partitioned table is left alone. The steps and their locks are in
    /// the [module's documentation](super#switching).
    ///
    /// Stop the consumers first (or let their claims fail and be retried
    /// for the length of the switch), then start them in the partitioned
    /// mode.
    ///
    /// # Errors
    /// [`PartitionError::MissingTable`] (in [`Error::Other`](crate::Error::Other));
    /// [`Error::Database`](crate::Error::Database) when a step fails: the steps
    /// before it stay done, and running the switch again finishes it.
    pub async fn switch(&self, pool: &PgPool, retention: Option<Duration>) -> Result<Switched> {
        switch_to_partitioned(pool, self, retention).await
    }
}

impl Partition {
    /// The partitions of `processed_messages`, oldest first.
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    pub async fn list(pool: &PgPool) -> Result<Vec<Partition>> {
        let mut conn = pool.acquire().await?;
        list(&mut conn).await
    }
}

impl Inbox {
    /// One pass of the partitioned inbox's maintenance for this consumer:
    /// registers its `retention` (`None`: keep forever), creates the
    /// partitions up to [`Partitioning::ahead`] periods after the current
    /// one, and retires the partitions whose upper bound is older than the
    /// longest retention any consumer registered. Run it periodically (at
    /// most every period; the AMQP consumer does) from every instance: one
    /// at a time does the work, the others skip.
    ///
    /// # Cancel safety
    /// Cancel-safe: the maintainers' lock goes with its connection, and a
    /// detach cut short is finished by the next pass.
    ///
    /// # Errors
    /// [`PartitionError::NotPartitioned`] (in [`Error::Other`](crate::Error::Other));
    /// [`Error::Database`](crate::Error::Database) when a statement fails, a
    /// lock timeout included: the next pass tries again.
    pub async fn maintain(
        &self,
        pool: &PgPool,
        retention: Option<Duration>,
        partitioning: &Partitioning,
    ) -> Result<Maintained> {
        maintain(pool, self.consumer(), retention, partitioning).await
    }
}

/// Whether `processed_messages` is partitioned ([`Partitioning::table_is_partitioned`]).
pub(crate) async fn is_partitioned<'e>(executor: impl sqlx::PgExecutor<'e>) -> Result<bool> {
    let kind: Option<String> = sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class WHERE oid = to_regclass('processed_messages')",
    )
    .fetch_optional(executor)
    .await?;
    match kind.as_deref() {
        None => Err(PartitionError::MissingTable.into()),
        Some("p") => Ok(true),
        Some(_) => Ok(false),
    }
}

async fn list(conn: &mut PgConnection) -> Result<Vec<Partition>> {
    let rows: Vec<(String, Option<f64>, bool)> = sqlx::query_as(
        "SELECT c.relname::text, \
                extract(epoch FROM (regexp_match(pg_get_expr(c.relpartbound, c.oid), \
                    'TO \\(''([^'']+)''\\)'))[1]::timestamptz)::float8, \
                i.inhdetachpending \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass('processed_messages') \
         ORDER BY 2 NULLS LAST",
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, upper_epoch_secs, detach_pending)| Partition {
            name,
            upper_epoch_secs,
            detach_pending,
        })
        .collect())
}

/// [`Inbox::maintain`] for `consumer`.
pub(crate) async fn maintain(
    pool: &PgPool,
    consumer: &str,
    retention: Option<Duration>,
    partitioning: &Partitioning,
) -> Result<Maintained> {
    if !is_partitioned(pool).await? {
        return Err(PartitionError::NotPartitioned.into());
    }
    let keep = retention.map_or(f64::INFINITY, |r| r.as_secs_f64());
    sqlx::query(
        "INSERT INTO processed_messages_retention (consumer, retention_secs) VALUES ($1, $2) \
         ON CONFLICT (consumer) DO UPDATE SET retention_secs = $2, seen_at = now()",
    )
    .bind(consumer)
    .bind(keep)
    .execute(pool)
    .await?;
    let Some(mut conn) = maintainer(pool, false).await? else {
        return Ok(Maintained {
            skipped: true,
            ..Maintained::default()
        });
    };
    let created =
        create_ahead(&mut conn, partitioning.period_secs(retention), partitioning).await?;
    // A consumer not seen for longer than its own retention: every claim it
    // made is past that retention already, so its registration no longer
    // holds partitions for anyone (forever: never forgotten).
    let forgotten: Vec<String> = sqlx::query_scalar(
        "DELETE FROM processed_messages_retention \
         WHERE CASE WHEN retention_secs = 'Infinity' THEN false \
                    ELSE seen_at < now() - make_interval(secs => retention_secs) END \
         RETURNING consumer",
    )
    .fetch_all(&mut *conn)
    .await?;
    if !forgotten.is_empty() {
        tracing::info!(
            ?forgotten,
            "partitioned inbox: forgot consumers gone longer than their retention"
        );
    }
    let keep: f64 = sqlx::query_scalar(
        "SELECT coalesce(max(retention_secs), $1) FROM processed_messages_retention",
    )
    .bind(keep)
    .fetch_one(&mut *conn)
    .await?;
    let dropped = retire(&mut conn, keep).await?;
    conn.release().await;
    Ok(Maintained {
        skipped: false,
        created,
        dropped,
        forgotten,
    })
}

/// A pooled connection holding the maintainers' lock, with the DDL's lock
/// timeout; `None` when `wait` is false and another instance holds the
/// lock (the connection goes back to the pool).
async fn maintainer(pool: &PgPool, wait: bool) -> Result<Option<Maintainer>> {
    let mut conn = pool.acquire().await?;
    let sql = if wait {
        format!("SELECT pg_advisory_lock({LOCK_KEY}) IS NOT NULL")
    } else {
        format!("SELECT pg_try_advisory_lock({LOCK_KEY})")
    };
    let locked: bool = sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(&mut *conn)
        .await?;
    if !locked {
        return Ok(None);
    }
    // From here on a failure drops the guard, which closes the connection
    // and with it the lock.
    let mut maintainer = Maintainer { conn: Some(conn) };
    maintainer
        .execute(AssertSqlSafe(format!(
            "SET lock_timeout = '{LOCK_TIMEOUT}'"
        )))
        .await?;
    Ok(Some(maintainer))
}

/// The maintainers' lock on a pooled connection. [`release`](Self::release)
/// unlocks it and returns the connection to the pool; dropped otherwise (an
/// error, a pass cancelled midway), the connection is detached from the pool
/// and closed, so the lock cannot outlive the pass nor reach another
/// borrower. (Each pass once detached its connection, making the pool open
/// a new one every interval on every instance.)
struct Maintainer {
    conn: Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
}

impl Maintainer {
    /// Unlocks, restores the session's lock timeout and returns the
    /// connection to the pool; on a failure the connection is closed
    /// instead, which unlocks too.
    async fn release(mut self) {
        let released = sqlx::raw_sql(AssertSqlSafe(format!(
            "RESET lock_timeout; SELECT pg_advisory_unlock({LOCK_KEY})"
        )))
        .execute(&mut *self)
        .await;
        if released.is_ok() {
            // Back to the pool, lock released.
            drop(self.conn.take());
        }
    }
}

impl Maintainer {
    /// Closes the connection (and with it the lock) instead of returning it:
    /// after the switch, whose DDL renamed the table its statements knew.
    async fn close(mut self) {
        if let Some(conn) = self.conn.take() {
            let _ = conn.close().await;
        }
    }
}

impl std::ops::Deref for Maintainer {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn.as_ref().expect("held until released or dropped")
    }
}

impl std::ops::DerefMut for Maintainer {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("held until released or dropped")
    }
}

impl Drop for Maintainer {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Closing the socket ends the session and its advisory lock.
            drop(conn.detach());
        }
    }
}

/// Creates the partitions from the newest one's upper bound (or the start
/// of the current period) to `ahead` periods after now; each as a table of
/// its own with its key and a `CHECK` of its bounds, then attached. Inside
/// a transaction when `conn` is in one.
async fn create_ahead(
    conn: &mut PgConnection,
    period: i64,
    partitioning: &Partitioning,
) -> Result<Vec<String>> {
    let now: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
        .fetch_one(&mut *conn)
        .await?;
    let now = now.floor() as i64;
    let newest = list(conn)
        .await?
        .iter()
        .filter_map(|p| p.upper_epoch_secs)
        .fold(None, |a: Option<f64>, u| Some(a.map_or(u, |a| a.max(u))));
    let mut from = (now - now.rem_euclid(period)).max(newest.map_or(i64::MIN, |u| u.ceil() as i64));
    let until = now + partitioning.ahead_periods() * period;
    let mut created = Vec::new();
    while from <= until {
        let to = from - from.rem_euclid(period) + period;
        let name = format!("processed_messages_{from}");
        conn.execute(AssertSqlSafe(format!(
            "CREATE TABLE {name} (LIKE processed_messages INCLUDING DEFAULTS); \
             ALTER TABLE {name} ADD PRIMARY KEY (consumer, message_id), \
                 ADD CONSTRAINT {name}_bounds \
                 CHECK (processed_at >= to_timestamp({from}) AND processed_at < to_timestamp({to})); \
             ALTER TABLE processed_messages ATTACH PARTITION {name} \
                 FOR VALUES FROM (to_timestamp({from})) TO (to_timestamp({to}))"
        )))
        .await?;
        created.push(name);
        from = to;
    }
    Ok(created)
}

/// Detaches (concurrently) and drops the partitions whose upper bound is
/// more than `keep` seconds old; finishes detaches left pending.
async fn retire(conn: &mut PgConnection, keep: f64) -> Result<Vec<String>> {
    if !keep.is_finite() {
        return Ok(Vec::new());
    }
    let now: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
        .fetch_one(&mut *conn)
        .await?;
    let mut dropped = Vec::new();
    for p in list(conn).await? {
        if !p.upper_epoch_secs.is_some_and(|u| u <= now - keep) {
            continue;
        }
        let name = &p.name;
        let detach = if p.detach_pending {
            "FINALIZE"
        } else {
            "CONCURRENTLY"
        };
        conn.execute(AssertSqlSafe(format!(
            "ALTER TABLE processed_messages DETACH PARTITION \"{name}\" {detach}"
        )))
        .await?;
        conn.execute(AssertSqlSafe(format!("DROP TABLE \"{name}\"")))
            .await?;
        dropped.push(p.name);
    }
    Ok(dropped)
}

/// [`Partitioning::switch`].
async fn switch_to_partitioned(
    pool: &PgPool,
    partitioning: &Partitioning,
    retention: Option<Duration>,
) -> Result<Switched> {
    let Some(mut conn) = maintainer(pool, true).await? else {
        return Err(
            sqlx::Error::Protocol("pg_advisory_lock returned without the lock".into()).into(),
        );
    };
    if is_partitioned(pool).await? {
        conn.close().await;
        return Ok(Switched {
            already: true,
            before: None,
            created: Vec::new(),
        });
    }
    // The switch itself waits as long as it must for the claims in flight.
    conn.execute("SET lock_timeout = 0").await?;
    let existing: Option<i32> = sqlx::query_scalar(
        "SELECT 1 FROM pg_constraint \
         WHERE conrelid = to_regclass('processed_messages') \
           AND conname = 'processed_messages_before_switch'",
    )
    .fetch_optional(&mut *conn)
    .await?;
    if existing.is_none() {
        let mut tx = conn.begin().await?;
        tx.execute("LOCK TABLE processed_messages IN ACCESS EXCLUSIVE MODE")
            .await?;
        // After the lock: every committed claim began before this instant.
        let t: i64 =
            sqlx::query_scalar("SELECT floor(extract(epoch FROM clock_timestamp()))::int8 + 1")
                .fetch_one(&mut *tx)
                .await?;
        tx.execute(AssertSqlSafe(format!(
            "ALTER TABLE processed_messages \
                 ADD COLUMN IF NOT EXISTS claimed_under_lock boolean NOT NULL DEFAULT true, \
                 ADD CONSTRAINT processed_messages_before_switch \
                 CHECK (processed_at < to_timestamp({t})) NOT VALID; \
             ALTER TABLE processed_messages ALTER COLUMN claimed_under_lock DROP DEFAULT"
        )))
        .await?;
        tx.commit().await?;
    }
    conn.execute(
        "ALTER TABLE processed_messages VALIDATE CONSTRAINT processed_messages_before_switch",
    )
    .await?;
    let t: i64 = sqlx::query_scalar(
        "SELECT (regexp_match(pg_get_constraintdef(oid), 'to_timestamp\\(\\(?(\\d+)'))[1]::int8 \
         FROM pg_constraint WHERE conrelid = to_regclass('processed_messages') \
           AND conname = 'processed_messages_before_switch'",
    )
    .fetch_one(&mut *conn)
    .await?;
    let before = format!("processed_messages_before_{t}");
    let mut tx = conn.begin().await?;
    tx.execute(AssertSqlSafe(format!(
        "LOCK TABLE processed_messages IN ACCESS EXCLUSIVE MODE; \
         ALTER TABLE processed_messages RENAME TO {before}; \
         CREATE TABLE processed_messages ( \
             consumer           text        NOT NULL, \
             message_id         text        NOT NULL, \
             payload_sha256     bytea, \
             processed_at       timestamptz NOT NULL DEFAULT now(), \
             claimed_under_lock boolean     NOT NULL, \
             lettered           boolean     NOT NULL DEFAULT false \
         ) PARTITION BY RANGE (processed_at); \
         ALTER TABLE processed_messages ATTACH PARTITION {before} \
             FOR VALUES FROM (MINVALUE) TO (to_timestamp({t}))"
    )))
    .await?;
    let created = create_ahead(&mut tx, partitioning.period_secs(retention), partitioning).await?;
    tx.commit().await?;
    conn.close().await;
    Ok(Switched {
        already: false,
        before: Some(before),
        created,
    })
}
