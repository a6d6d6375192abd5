//! [`UnitOutbox`]: what a consumer unit's handler staged through its own
//! guard, kept for the unit's commit (`deferred_statements`).
//! The consumer runtime attaches one to each unit's [`Tx`](crate::Tx) (see
//! `amqp::outbox`); staging finds it there ([`StageTarget`](super::StageTarget)).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use super::OutboxMessage;

/// A consumer unit's outbox buffer (one delivery, or a batch).
#[derive(Debug)]
#[doc(hidden)]
pub struct UnitOutbox {
    /// The consumer's relay publishes in this process: it is woken after
    /// the commit, so the staging trigger need not NOTIFY.
    quiet: bool,
    /// The consumer's transport: what its handler stages goes out there
    /// unless a message names another.
    transport: &'static str,
    /// Something was staged (deferred or written at once).
    staged: AtomicBool,
    /// Unkeyed messages, written by the unit's commit.
    deferred: Mutex<Vec<OutboxMessage>>,
}

/// The staging side: what [`stage_all`](super::stage_all) does with the
/// buffer it finds behind a handler's guard.
impl UnitOutbox {
    /// The consumer's transport.
    pub(crate) fn transport(&self) -> &'static str {
        self.transport
    }

    /// Keeps `messages` for the commit, unless one has an ordering key
    /// (those take the key's lock now, at staging).
    pub(crate) fn defer(&self, messages: &[OutboxMessage]) -> bool {
        if messages.iter().any(|m| m.ordering_key.is_some()) {
            return false;
        }
        self.staged.store(true, Ordering::Relaxed);
        self.deferred
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(messages);
        true
    }

    /// Records that messages are written now; whether they may skip NOTIFY.
    pub(crate) fn staged_now(&self) -> bool {
        self.staged.store(true, Ordering::Relaxed);
        self.quiet
    }
}

/// The consumer runtime's side: it makes a unit's buffer and commits what
/// was deferred in it.
#[cfg(idempo_runtime)]
impl UnitOutbox {
    pub(crate) fn new(quiet: bool, transport: &'static str) -> Self {
        UnitOutbox {
            quiet,
            transport,
            staged: AtomicBool::new(false),
            deferred: Mutex::new(Vec::new()),
        }
    }

    /// Whether the unit staged anything: its relay is then woken after the
    /// commit.
    pub(crate) fn staged(&self) -> bool {
        self.staged.load(Ordering::Relaxed)
    }

    /// The messages kept for the commit, and whether they may skip NOTIFY.
    pub(crate) fn take_deferred(&self) -> (Vec<OutboxMessage>, bool) {
        let deferred =
            std::mem::take(&mut *self.deferred.lock().unwrap_or_else(|p| p.into_inner()));
        (deferred, self.quiet)
    }
}
