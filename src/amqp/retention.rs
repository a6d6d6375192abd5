//! The retention reaper: deletes a consumer's old `processed_messages` rows, periodically.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::inbox;

/// Rows per `DELETE`: small enough that each statement is short and holds few
/// locks, large enough to keep up.
pub(crate) const BATCH: i64 = 5_000;

/// Deletes rows older than `retention` now and every `interval`, until
/// `stop`; with `dead_letters`, also the consumer's replayed and discarded
/// dead letters settled longer ago than that.
pub(crate) async fn reap_periodically(
    pool: PgPool,
    consumer: String,
    retention: Duration,
    interval: Duration,
    dead_letters: Option<Duration>,
    stop: CancellationToken,
) {
    loop {
        #[cfg(feature = "outbox")]
        if let Some(keep) = dead_letters {
            match super::dead_letters::reap(&pool, Some(&consumer), keep, BATCH).await {
                Ok(0) => {}
                Ok(deleted) => {
                    tracing::info!(%consumer, deleted, "retention: deleted settled dead letters")
                }
                Err(e) => {
                    tracing::warn!(%consumer, error = %e, "retention: cannot delete dead letters")
                }
            }
        }
        #[cfg(not(feature = "outbox"))]
        let _ = dead_letters;
        match inbox::delete_processed_before(&pool, &consumer, retention, BATCH).await {
            Ok(0) => {}
            Ok(deleted) => {
                tracing::info!(%consumer, deleted, "retention: deleted old processed_messages rows")
            }
            // The database may be down; the next round tries again.
            Err(e) => tracing::warn!(%consumer, error = %e, "retention: cannot delete old rows"),
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = stop.cancelled() => return,
        }
    }
}
