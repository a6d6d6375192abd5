//! The migrations' state ([`migrate_status`](Services::migrate_status), [`migrate`](Services::migrate)) and the
//! retention and expiry deletes, run once ([`reap`](Services::reap), [`cleanup`](Services::cleanup)). The
//! partitioned inbox's switch and maintenance are
//! [`inbox::partitioned`](crate::inbox::partitioned)'s.

use std::time::Duration;

use serde::Serialize;

use super::{OpsError, Result, Services, missing_table};
use crate::http::IdempotencyStore;
use crate::inbox::partitioned;
use crate::window::WindowStore;

/// One of idempo's migrations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Migration {
    /// Its version.
    pub version: i64,
    /// What it does.
    pub description: String,
}

/// Which of idempo's migrations ran.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationStatus {
    /// The versions applied, in order.
    pub applied: Vec<i64>,
    /// The migrations not applied yet, in order.
    pub pending: Vec<Migration>,
}

impl MigrationStatus {
    /// Whether every migration ran.
    pub fn is_up_to_date(&self) -> bool {
        self.pending.is_empty()
    }
}

impl Services {
    /// Which of idempo's migrations (the crate's `migrations/`) ran in the database.
    ///
    /// # Errors
    /// Connection and query errors.
    pub async fn migrate_status(&self) -> Result<MigrationStatus> {
        let pool = self.database().await?;
        let applied = crate::migrate::applied_versions(pool).await?;
        let pending = crate::migrate::migrator()
            .iter()
            .filter(|m| m.migration_type.is_up_migration())
            .filter(|m| !applied.contains(&m.version))
            .map(|m| Migration {
                version: m.version,
                description: m.description.to_string(),
            })
            .collect();
        Ok(MigrationStatus { applied, pending })
    }

    /// Applies idempo's migrations ([`crate::migrate`]); returns those that
    /// were pending.
    ///
    /// # Errors
    /// [`OpsError::Migrate`]; connection and query errors.
    pub async fn migrate(&self) -> Result<Vec<Migration>> {
        let status = self.migrate_status().await?;
        crate::migrate(self.database().await?)
            .await
            .map_err(OpsError::Migrate)?;
        Ok(status.pending)
    }
}

/// What [`reap`](Services::reap) and [`cleanup`](Services::cleanup) deleted from one consumer or table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Deleted {
    /// The consumer ([`reap`](Services::reap)) or the table ([`cleanup`](Services::cleanup)).
    pub name: String,
    /// How many rows went.
    pub deleted: u64,
}

/// What [`reap`](Services::reap) and [`cleanup`](Services::cleanup) report as they go.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Progress<'a> {
    /// Starting on a consumer or table.
    Started {
        /// The consumer or table.
        name: &'a str,
    },
    /// A batch went: `deleted` rows so far.
    Batch {
        /// The table.
        name: &'a str,
        /// Rows deleted so far.
        deleted: u64,
    },
    /// Done with a consumer or table.
    Done(&'a Deleted),
}

impl Services {
    /// Deletes the claims older than `older_than` of `consumers` (every
    /// consumer with claims when empty), `batch` rows per statement: the
    /// retention reaper, once ([`Inbox::delete_processed_before`](crate::inbox::Inbox::delete_processed_before)).
    ///
    /// Delete only what can no longer be redelivered: see the redelivery horizon
    /// in [`Services::status`].
    ///
    /// # Errors
    /// [`OpsError::Idempo`] for a `batch` below 1; [`OpsError::Reap`] names
    /// the consumer whose delete failed (those before it are reaped);
    /// connection and query errors.
    pub async fn reap(
        &self,
        consumers: &[String],
        older_than: Duration,
        batch: i64,
        mut on_progress: impl FnMut(Progress<'_>),
    ) -> Result<Vec<Deleted>> {
        if batch < 1 {
            return Err(OpsError::Idempo(crate::Error::Config(
                "the batch size must be at least 1".into(),
            )));
        }
        let pool = self.database().await?;
        if partitioned::Partitioning::table_is_partitioned(pool)
            .await
            .unwrap_or(false)
        {
            return Err(OpsError::Idempo(crate::Error::Config(
                "processed_messages is partitioned: its claims go with their partitions \
             (`idempo partitions maintain`), not by DELETE"
                    .into(),
            )));
        }
        let consumers = if consumers.is_empty() {
            consumers_with_claims(pool).await?
        } else {
            consumers.to_vec()
        };
        let mut reaped = Vec::new();
        for consumer in consumers {
            on_progress(Progress::Started { name: &consumer });
            let deleted = crate::inbox::Inbox::new(consumer.as_str())
                .delete_processed_before(pool, older_than, batch)
                .await
                .map_err(|source| OpsError::Reap {
                    consumer: consumer.clone(),
                    source,
                })?;
            let done = Deleted {
                name: consumer,
                deleted,
            };
            on_progress(Progress::Done(&done));
            reaped.push(done);
        }
        Ok(reaped)
    }

    /// Deletes the expired HTTP idempotency keys (`idempotency_keys`) and
    /// deduplication window entries (`dedup_window`), `batch` rows per statement:
    /// the stores' cleanups, once. A table that does not exist is skipped.
    ///
    /// # Errors
    /// Connection and query errors.
    pub async fn cleanup(
        &self,
        batch: usize,
        mut on_progress: impl FnMut(Progress<'_>),
    ) -> Result<Vec<Deleted>> {
        let pool = self.database().await?;
        let batch = batch.max(1);
        let mut results = Vec::new();
        let keys = crate::http::PostgresStore::new(pool.clone());
        if let Some(n) = in_batches("idempotency_keys", batch, &mut on_progress, || {
            keys.delete_expired(batch)
        })
        .await?
        {
            results.push(n);
        }
        let window = crate::window::PostgresWindow::new(pool.clone());
        if let Some(n) = in_batches("dedup_window", batch, &mut on_progress, || {
            window.delete_expired(batch)
        })
        .await?
        {
            results.push(n);
        }
        Ok(results)
    }
}

/// Calls `delete` (one bounded batch) until a batch comes back short;
/// `None` when the table does not exist.
async fn in_batches<F, Fut>(
    table: &str,
    batch: usize,
    on_progress: &mut impl FnMut(Progress<'_>),
    mut delete: F,
) -> Result<Option<Deleted>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = crate::Result<u64>>,
{
    let mut n = 0;
    let mut first = true;
    loop {
        let deleted = match delete().await {
            Ok(deleted) => deleted,
            Err(e) if first && missing_table(&e) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        if std::mem::take(&mut first) {
            on_progress(Progress::Started { name: table });
        }
        n += deleted;
        on_progress(Progress::Batch {
            name: table,
            deleted: n,
        });
        if deleted < batch as u64 {
            break;
        }
    }
    let done = Deleted {
        name: table.to_owned(),
        deleted: n,
    };
    on_progress(Progress::Done(&done));
    Ok(Some(done))
}

/// The consumers that hold claims, in order.
async fn consumers_with_claims(pool: &sqlx::PgPool) -> crate::Result<Vec<String>> {
    Ok(
        sqlx::query_scalar("SELECT DISTINCT consumer FROM processed_messages ORDER BY 1")
            .fetch_all(pool)
            .await?,
    )
}
