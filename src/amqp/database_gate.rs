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

use super::backoff::Backoff;
use super::health::Health;
use super::stats::{Counter, Stats};

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

/// Whether `error` means "the database (or the connection to it) is gone",
/// as opposed to a problem with this statement or this message.
pub(crate) fn is_connection_error(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // Class 08: connection exception (but 08P01, protocol violation, is
        // also what a wrong number of bind parameters gets: a bug, not an
        // outage); 57P01-57P03: admin shutdown (pg_terminate_backend), crash
        // shutdown, cannot connect now.
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            (code.starts_with("08") && code != "08P01")
                || matches!(&*code, "57P01" | "57P02" | "57P03")
        }),
        _ => false,
    }
}

/// [`is_connection_error`] for an error of any type that may wrap a sqlx error.
pub(crate) fn is_connection_failure(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(sqlx) = e.downcast_ref::<sqlx::Error>() {
            return is_connection_error(sqlx);
        }
        if let Some(crate::Error::Database(sqlx)) = e.downcast_ref::<crate::Error>() {
            return is_connection_error(sqlx);
        }
        current = e.source();
    }
    false
}
