//! The retention reaper: deletes a consumer's old `processed_messages` rows,
//! or, in the partitioned mode, maintains the partitions, periodically.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::inbox;
use crate::inbox::partitioned::Partitioning;
use crate::runtime::letters::LetterStore;

/// Rows per `DELETE`: small enough that each statement is short and holds few
/// locks, large enough to keep up.
pub(crate) const BATCH: i64 = 5_000;

/// Deletes rows older than `retention` now and every `interval`, until
/// `stop`; with `letters`, also the consumer's replayed and discarded
/// dead letters settled longer ago than the duration beside the store. With `partitioning`, runs
/// [`Inbox::maintain`](crate::inbox::Inbox::maintain) instead of the delete, at least twice a period
/// (`retention` `None`: partitions are created, none retired).
pub(crate) async fn reap_periodically(
    pool: PgPool,
    consumer: String,
    retention: Option<Duration>,
    partitioning: Option<Partitioning>,
    mut interval: Duration,
    letters: Option<(Arc<dyn LetterStore>, Duration)>,
    stop: CancellationToken,
) {
    loop {
        if let Some((store, keep)) = &letters {
            match store.reap(&consumer, *keep).await {
                Ok(0) => {}
                Ok(deleted) => {
                    tracing::info!(%consumer, deleted, "retention: deleted settled dead letters")
                }
                Err(e) => {
                    tracing::warn!(%consumer, error = %e, "retention: cannot delete dead letters")
                }
            }
        }
        if let Some(partitioning) = &partitioning {
            let period = Duration::from_secs(partitioning.period_secs(retention) as u64);
            interval = interval.min(period / 2).max(Duration::from_millis(100));
            match inbox::Inbox::new(consumer.as_str())
                .maintain(&pool, retention, partitioning)
                .await
            {
                Ok(done) if done.created.is_empty() && done.dropped.is_empty() => {}
                Ok(done) => tracing::info!(
                    %consumer, created = ?done.created, dropped = ?done.dropped,
                    "retention: partitions of processed_messages maintained"
                ),
                Err(e) => {
                    tracing::warn!(%consumer, error = %e, "retention: cannot maintain partitions")
                }
            }
        } else if let Some(retention) = retention {
            reap_rows(&pool, &consumer, retention).await;
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = stop.cancelled() => return,
        }
    }
}

/// One round of the plain table's delete.
async fn reap_rows(pool: &PgPool, consumer: &str, retention: Duration) {
    {
        match inbox::Inbox::new(consumer)
            .delete_processed_before(pool, retention, BATCH)
            .await
        {
            Ok(0) => {}
            Ok(deleted) => {
                tracing::info!(%consumer, deleted, "retention: deleted old processed_messages rows")
            }
            // The database may be down; the next round tries again.
            Err(e) => tracing::warn!(%consumer, error = %e, "retention: cannot delete old rows"),
        }
    }
}
