//! The database gate: deliveries wait here while PostgreSQL is unreachable.
//!
//! An outage of the database is not a property of a message: it must not use
//! up retry attempts, dead-letter anything, or spin through redeliveries. A
//! delivery that meets a connection-level error rolls back, reports it here,
//! waits until a probe (`SELECT 1`, with exponential backoff) succeeds, and
//! then runs again from the claim. It is never acked in between.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::health::Health;
use super::stats::{Counter, Stats};
use crate::backoff::Backoff;

pub(crate) struct DatabaseGate {
    pool: PgPool,
    available: watch::Sender<bool>,
    health: Health,
    stats: Stats,
    /// Ends the probe when the consumer stops.
    stop: CancellationToken,
}

impl DatabaseGate {
    pub(crate) fn new(
        pool: PgPool,
        health: Health,
        stats: Stats,
        stop: CancellationToken,
    ) -> Arc<Self> {
        Arc::new(DatabaseGate {
            pool,
            available: watch::Sender::new(true),
            health,
            stats,
            stop,
        })
    }

    /// Records that the database is unreachable and, if it was believed up,
    /// starts probing it.
    pub(crate) fn report_down(self: &Arc<Self>, error: &dyn std::fmt::Display) {
        let was_up = self.available.send_replace(false);
        if was_up {
            tracing::error!(%error, "database unreachable; deliveries wait until it returns");
            self.stats.incr(Counter::DatabaseOutages);
            self.health
                .set_database(false, Some(format!("database unreachable: {error}")));
            let gate = self.clone();
            tokio::spawn(async move { gate.probe().await });
        }
    }

    /// Whether the database is believed reachable.
    #[cfg(test)]
    pub(crate) fn is_available(&self) -> bool {
        *self.available.borrow()
    }

    /// Returns once the database is believed reachable.
    pub(crate) async fn wait_available(&self) {
        let mut available = self.available.subscribe();
        let _ = available.wait_for(|up| *up).await;
    }

    async fn probe(&self) {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
        loop {
            tokio::select! {
                () = tokio::time::sleep(backoff.next_delay()) => {}
                () = self.stop.cancelled() => return,
            }
            match sqlx::query("SELECT 1").execute(&self.pool).await {
                Ok(_) => {
                    tracing::info!("database reachable again");
                    self.health.set_database(true, None);
                    self.available.send_replace(true);
                    return;
                }
                Err(e) => tracing::debug!(error = %e, "database still unreachable"),
            }
        }
    }
}
