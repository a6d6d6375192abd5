//! A consumer's modes, as the state of its builder: per message or batched.
//! Each transport's builder moves between them (the AMQP builder's
//! documentation, with what does not compile, is at [`crate::consumer::mode`]);
//! a mode becomes a [`Dispatch`]: how its deliveries are decided.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::Result;
use crate::runtime::database_gate::DatabaseGate;
use crate::runtime::forwarding::Forwarding;
use crate::runtime::handler::Prepare;
use crate::runtime::outcome::Decide;
use crate::runtime::stats::Stats;
use crate::runtime::steps::InboxSteps;

/// The builder's state before a handler is set: only the common options,
/// and the methods that choose a mode.
#[derive(Debug)]
pub struct NoHandler(pub(crate) ());

/// Per-message mode: one transaction per delivery, up to `concurrency` at once.
pub struct PerMessage {
    pub(crate) handler: Arc<dyn Prepare>,
    pub(crate) groups: Option<String>,
}

/// Batch mode: up to `size` deliveries per transaction (see the
/// [batch mode](crate::amqp#batch-mode) docs).
pub struct Batched {
    pub(crate) handler: Arc<dyn Prepare>,
    pub(crate) size: usize,
    pub(crate) linger: Duration,
}

impl fmt::Debug for PerMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PerMessage")
            .field("groups", &self.groups)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Batched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batched")
            .field("size", &self.size)
            .field("linger", &self.linger)
            .finish_non_exhaustive()
    }
}

/// What a mode needs from the rest of the configuration to become runnable.
pub(crate) struct Parts<'a> {
    pub(crate) consumer: &'a str,
    /// The queue or stream, the dedup window's default scope.
    #[cfg(feature = "window")]
    pub(crate) queue: &'a str,
    pub(crate) pool: &'a PgPool,
    pub(crate) prefetch: u16,
    pub(crate) handler_timeout: Duration,
    pub(crate) gate: &'a Arc<DatabaseGate>,
    pub(crate) stats: &'a Stats,
    pub(crate) forwarding: &'a Arc<Forwarding>,
    /// Claims in the partitioned `processed_messages`.
    pub(crate) partitioned: bool,
    /// Every unit's connection through the pool's acquire-time checks.
    pub(crate) checked_acquire: bool,
    /// The consumer's dead letters are in the `dead_letters` table.
    pub(crate) letters_in_table: bool,
}

/// A mode, ready to run: how deliveries are decided and dispatched.
pub(crate) struct Dispatch {
    pub(crate) decide: Arc<dyn Decide>,
    /// Batch mode: up to this many deliveries per unit, collected within the linger.
    pub(crate) batch: Option<(usize, Duration)>,
    /// Message groups: the header that names a delivery's group.
    pub(crate) groups: Option<String>,
}

/// Turns a mode into its [`Dispatch`], checking what only it can check.
pub(crate) trait IntoDispatch {
    fn into_dispatch(self, parts: &Parts<'_>) -> Result<Dispatch>;

    /// Batch mode's batch size, which the transport may check its limits against.
    fn batch_size(&self) -> Option<usize> {
        None
    }
}

fn inbox(handler: Arc<dyn Prepare>, parts: &Parts<'_>) -> Arc<dyn Decide> {
    Arc::new(InboxSteps {
        consumer: parts.consumer.to_owned(),
        pool: parts.pool.clone(),
        handler,
        handler_timeout: parts.handler_timeout,
        gate: parts.gate.clone(),
        stats: parts.stats.clone(),
        forwarding: parts.forwarding.clone(),
        sessions: tokio::sync::OnceCell::new(),
        inbox: crate::inbox::Inbox::new(parts.consumer).partitioned(parts.partitioned),
        checked_acquire: parts.checked_acquire,
        letters_in_table: parts.letters_in_table,
    })
}

impl IntoDispatch for PerMessage {
    fn into_dispatch(self, parts: &Parts<'_>) -> Result<Dispatch> {
        Ok(Dispatch {
            decide: inbox(self.handler, parts),
            batch: None,
            groups: self.groups,
        })
    }
}

impl IntoDispatch for Batched {
    fn batch_size(&self) -> Option<usize> {
        Some(self.size)
    }

    fn into_dispatch(self, parts: &Parts<'_>) -> Result<Dispatch> {
        if self.size == 0 {
            return Err(crate::Error::Config(
                "the batch size must be at least 1".into(),
            ));
        }
        if usize::from(parts.prefetch) < self.size {
            return Err(crate::Error::Config(format!(
                "prefetch ({}) must be at least the batch size ({}); three times is better",
                parts.prefetch, self.size
            )));
        }
        Ok(Dispatch {
            decide: inbox(self.handler, parts),
            batch: Some((self.size, self.linger)),
            groups: None,
        })
    }
}
