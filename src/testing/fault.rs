//! Faults the harness injects on demand: around the user's handler (each
//! class of handler failure), and the database's (a connection that dies in
//! `COMMIT`, a database that cannot take work), through triggers in the
//! harness's own schema.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sqlx::{AssertSqlSafe, PgPool};

use crate::consumer::{DecodeError, HandlerError, Message};
use crate::runtime::handler::{Call, Prepare};
use crate::{Result, Tx};

/// A fault for [`Harness::deliver_with`](super::Harness::deliver_with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The handler runs, then fails with a transient error
    /// ([`HandlerError::transient`]): its writes roll back, the delivery is retried.
    Transient,
    /// The handler runs, then fails with a permanent error
    /// ([`HandlerError::permanent`]): its writes roll back, the delivery is dead-lettered.
    Permanent,
    /// The handler runs, then panics: caught, rolled back, retried.
    Panic,
    /// The handler runs, then never returns: the consumer's
    /// [`handler_timeout`](crate::amqp::ConsumerBuilder::handler_timeout)
    /// ends it (set a short one in the harness), rolled back, retried.
    Timeout,
    /// The handler succeeds, and the database connection dies in the
    /// `COMMIT` (the backend is terminated before the commit is durable):
    /// the outcome is unknown to the consumer, which waits at the database
    /// gate, claims the id again and runs the handler again. Its writes
    /// happen once.
    CommitConnectionLost,
    /// The database cannot take writes (read-only, as a standby after a
    /// failover): the consumer waits at the database gate, and after the
    /// harness's [`hold_timeout`](super::HarnessBuilder::hold_timeout) the
    /// delivery is [`Held`](super::Delivered::Held), unacked, nothing
    /// written. An outage is the database's: every delivery of this harness
    /// meets it while this delivery lasts.
    DatabaseUnavailable,
}

/// The handler faults planned per delivery (its delivery tag: a copy of
/// the same id delivered at the same time is another delivery), applied to
/// every handler run that includes one of them while the delivery lasts.
#[derive(Default)]
pub(crate) struct Plan {
    faults: Mutex<HashMap<u64, Fault>>,
}

impl Plan {
    pub(crate) fn set(&self, delivery_tag: u64, fault: Fault) {
        self.lock().insert(delivery_tag, fault);
    }

    pub(crate) fn clear(&self, delivery_tag: u64) {
        self.lock().remove(&delivery_tag);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Fault>> {
        self.faults.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn handler_fault(&self, messages: &[Message]) -> Option<Fault> {
        let faults = self.lock();
        messages
            .iter()
            .filter_map(|m| faults.get(&m.delivery_tag()).copied())
            .find(|f| f.in_handler())
    }
}

impl Fault {
    /// Whether the handler's wrapper injects it (the others are the
    /// database's, set up in the harness's schema).
    fn in_handler(self) -> bool {
        !matches!(
            self,
            Fault::CommitConnectionLost | Fault::DatabaseUnavailable
        )
    }
}

/// The user's handler with the planned faults around it.
pub(crate) struct Faulty {
    pub(crate) inner: Arc<dyn Prepare>,
    pub(crate) plan: Arc<Plan>,
}

impl Prepare for Faulty {
    fn prepare(&self, messages: &[Message]) -> Result<Call, (usize, DecodeError)> {
        let call = self.inner.prepare(messages)?;
        let Some(fault) = self.plan.handler_fault(messages) else {
            return Ok(call);
        };
        Ok(Box::new(move |tx: Tx| {
            Box::pin(async move {
                call(tx).await?;
                match fault {
                    Fault::Transient => Err(HandlerError::transient("injected transient fault")),
                    Fault::Permanent => Err(HandlerError::permanent("injected permanent fault")),
                    Fault::Panic => panic!("injected panic"),
                    _ => std::future::pending().await,
                }
            })
        }))
    }
}

/// The harness schema's objects for the database's faults. For
/// [`Fault::CommitConnectionLost`]: a cut
/// is a row naming the id and a sequence of its own, and a deferred trigger
/// on the claims terminates its own backend at `COMMIT` the first time
/// (`nextval` is not rolled back, so the second run commits).
pub(crate) const CUT_SETUP: &str = "\
CREATE TABLE idempo_harness_cuts (message_id text PRIMARY KEY, counter text NOT NULL);
CREATE FUNCTION idempo_harness_cut() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  c text;
BEGIN
  SELECT counter INTO c FROM idempo_harness_cuts WHERE message_id = NEW.message_id;
  IF c IS NOT NULL AND nextval(c::regclass) = 1 THEN
    PERFORM pg_terminate_backend(pg_backend_pid());
  END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER idempo_harness_cut AFTER INSERT ON processed_messages
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION idempo_harness_cut();";

/// Plans a cut of the connection in the `COMMIT` of the claim of `id`
/// (sequence number `n` of this harness).
pub(crate) async fn plan_cut(pool: &PgPool, id: &str, n: u64) -> Result<()> {
    let counter = format!("idempo_harness_cut_{n}");
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SEQUENCE {counter}")))
        .execute(pool)
        .await?;
    sqlx::query(
        "INSERT INTO idempo_harness_cuts (message_id, counter) VALUES ($1, $2) \
         ON CONFLICT (message_id) DO UPDATE SET counter = excluded.counter",
    )
    .bind(id)
    .bind(&counter)
    .execute(pool)
    .await?;
    Ok(())
}

/// Ends the cut planned for `id`.
pub(crate) async fn end_cut(pool: &PgPool, id: &str) -> Result<()> {
    sqlx::query("DELETE FROM idempo_harness_cuts WHERE message_id = $1")
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}

/// [`Fault::DatabaseUnavailable`]: while on, every connection of the
/// harness's pool is read-only (`default_transaction_read_only`, set as it
/// is opened or handed out), so the claim and the database gate's write
/// probe are refused as by a server that cannot take writes.
#[derive(Default)]
pub(crate) struct Outage {
    on: AtomicBool,
    /// Whether an outage ever began: until then no connection needs the
    /// setting (no round trip).
    ever: AtomicBool,
}

impl Outage {
    pub(crate) fn set(&self, on: bool) {
        self.ever.fetch_or(on, Ordering::Relaxed);
        self.on.store(on, Ordering::Relaxed);
    }

    /// Gives `conn` the setting the outage asks for now.
    pub(crate) async fn apply(&self, conn: &mut sqlx::PgConnection) -> sqlx::Result<()> {
        if !self.ever.load(Ordering::Relaxed) {
            return Ok(());
        }
        let on = if self.on.load(Ordering::Relaxed) {
            "on"
        } else {
            "off"
        };
        sqlx::query("SELECT set_config('default_transaction_read_only', $1, false)")
            .bind(on)
            .execute(conn)
            .await?;
        Ok(())
    }
}
