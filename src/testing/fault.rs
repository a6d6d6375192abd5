//! Faults the harness injects on demand: around the user's handler (each
//! class of handler failure), and at the commit (a connection that dies in
//! `COMMIT`, through a deferred trigger in the harness's own schema).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::Tx;
use crate::amqp::{DecodeError, HandlerError, Message};
use crate::runtime::handler::{Call, Prepare};

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
}

/// The handler faults planned per message id, applied to every handler run
/// that includes one of those ids while the delivery lasts.
#[derive(Default)]
pub(crate) struct Plan {
    faults: Mutex<HashMap<String, Fault>>,
}

impl Plan {
    pub(crate) fn set(&self, id: &str, fault: Fault) {
        self.lock().insert(id.to_owned(), fault);
    }

    pub(crate) fn clear(&self, id: &str) {
        self.lock().remove(id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Fault>> {
        self.faults.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn handler_fault(&self, messages: &[Message]) -> Option<Fault> {
        let faults = self.lock();
        messages
            .iter()
            .filter_map(|m| faults.get(m.id()).copied())
            .find(|f| *f != Fault::CommitConnectionLost)
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

/// The harness schema's objects for [`Fault::CommitConnectionLost`]: a cut
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
