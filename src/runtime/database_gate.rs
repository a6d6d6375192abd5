//! The database gate: deliveries wait here while PostgreSQL is unreachable.
//!
//! An outage of the database is not a property of a message: it must not use
//! up retry attempts, dead-letter anything, or spin through redeliveries. A
//! delivery that meets a database that cannot take writes
//! ([`Error::is_unavailable`](crate::Error::is_unavailable): unreachable,
//! read-only, out of disk, shutting down) rolls back, reports it here, waits
//! until a probe *write* succeeds (with exponential backoff), and then runs
//! again from the claim. It is never acked in between.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::runtime::health::Health;
use crate::runtime::stats::{Counter, Stats};

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
        // The delivery that reported the outage just met it: pause first.
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
            () = self.stop.cancelled() => return,
        }
        let waited = crate::wait::until_database_answers(
            "the database cannot take writes",
            (Duration::from_millis(100), Duration::from_secs(30)),
            self.stop.cancelled(),
            || probe_write(&self.pool),
            |_| true,
        )
        .await;
        if let crate::wait::Waited::Done(()) = waited {
            tracing::info!("database takes writes again");
            self.health.set_database(true, None);
            self.available.send_replace(true);
        }
    }
}

/// Whether the database takes a write: a temporary table created and rolled
/// back (`SELECT 1` answers on a read-only server too). A connection whose
/// session is read-only (`default_transaction_read_only` set when it was
/// opened, or a standby behind a failover address) stays so until it is
/// closed: it is closed, and the next one from the pool is tried, so that
/// the pool's connections follow the server back to writable.
async fn probe_write(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut last = None;
    for _ in 0..=pool.options().get_max_connections() {
        let mut conn = pool.acquire().await?;
        let written = async {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            sqlx::query("CREATE TEMPORARY TABLE idempo_gate_probe ()")
                .execute(&mut *tx)
                .await?;
            tx.rollback().await
        }
        .await;
        match written {
            Ok(()) => return Ok(()),
            Err(e) if crate::sqlstate::is(&e, crate::sqlstate::READ_ONLY) => {
                conn.close_on_drop();
                last = Some(e);
            }
            // The server answers and refuses for another reason than an
            // outage (a role without TEMPORARY): it takes statements.
            Err(e) if !crate::sqlstate::is_unavailable(&e) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    Err(last.expect("the loop ran at least once"))
}

/// Migrates or checks idempo's schema as configured; while the database is
/// unreachable, waits for it (`false`: shutdown came first).
pub(crate) async fn schema_ready(
    schema: &crate::Schema,
    pool: &PgPool,
    shutdown: &crate::runtime::shutdown::ShutdownHandle,
) -> crate::Result<bool> {
    let waited = crate::wait::until_database_answers(
        "cannot reach PostgreSQL to check idempo's schema",
        (Duration::from_millis(200), Duration::from_secs(10)),
        shutdown.graceful_token().cancelled(),
        || schema.apply(pool),
        crate::Error::is_connection_error,
    )
    .await;
    match waited {
        crate::wait::Waited::Done(()) => Ok(true),
        crate::wait::Waited::Failed(e) => Err(e),
        crate::wait::Waited::Stopped => Ok(false),
    }
}
