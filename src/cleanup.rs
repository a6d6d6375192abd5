//! The loop behind the stores' `run_cleanup` functions.

use std::future::Future;
use std::time::Duration;

use crate::Result;

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
