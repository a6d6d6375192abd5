//! The loop behind the stores' `run_cleanup` methods, and the counts of
//! live and expired entries they report.

use std::future::Future;
use std::time::Duration;

use crate::error::Result;

/// How many entries of one state a PostgreSQL store holds, live and expired
/// (expired entries stay until a cleanup deletes them). Returned by
/// `PostgresStore::count_by_state` (feature `http`) and
/// `PostgresWindow::count_by_state` (feature `window`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct StateCount {
    /// The state as stored (`in_progress`, `complete`; `pending`, `seen`).
    pub state: String,
    /// Entries that have not expired.
    pub live: i64,
    /// Entries that expired and wait for a cleanup.
    pub expired: i64,
}

/// Counts the entries of `table` (one with `state` and `expires_at`
/// columns) per state.
pub(crate) async fn count_by_state(
    pool: &sqlx::PgPool,
    table: &'static str,
) -> Result<Vec<StateCount>> {
    let sql = format!(
        "SELECT state, count(*) FILTER (WHERE expires_at > clock_timestamp()), \
                count(*) FILTER (WHERE expires_at <= clock_timestamp()) \
         FROM {table} GROUP BY state ORDER BY state"
    );
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .fetch_all(pool)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(state, live, expired)| StateCount {
            state,
            live,
            expired,
        })
        .collect())
}

/// Rows deleted per statement.
const BATCH: usize = 1_000;

/// Every `every`, calls `delete(BATCH)` until a batch comes back short;
/// forever. Errors are logged and retried at the next tick.
pub(crate) async fn delete_expired_forever<F, Fut>(
    what: &'static str,
    every: Duration,
    mut delete: F,
) where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Result<u64>>,
{
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        loop {
            match delete(BATCH).await {
                Ok(n) if n as usize == BATCH => continue,
                Ok(n) => {
                    if n > 0 {
                        tracing::debug!(deleted = n, what, "expired entries deleted");
                    }
                    break;
                }
                Err(error) => {
                    tracing::warn!(%error, what, "deleting expired entries failed");
                    break;
                }
            }
        }
    }
}
