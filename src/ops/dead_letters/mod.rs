//! Dead letters, one API whichever store keeps them: the `dead_letters`
//! table (a consumer with [`DeadLetters::Table`](crate::consumer::DeadLetters),
//! or imported, [`Services::import_dead_letters`](super::Services::import_dead_letters)) or the work queue's RabbitMQ DLQ (`<queue>.dlq`).
//!
//! [`DeadLetterStore::open`] picks the store ([`Store::Auto`]: the table
//! when it holds letters of the queue, else the DLQ); the same calls then
//! [list](DeadLetterStore::list), [show](DeadLetterStore::show),
//! [replay](DeadLetterStore::replay) and [purge](DeadLetterStore::purge)
//! either. The `idempo dlq` commands and the dashboard are thin clients of
//! this module.
//!
//! # The two stores
//! - **The table** answers queries with an index, groups letters by cause
//!   ([`DeadLetterStore::groups`]), keeps replayed and discarded letters
//!   for audit, and replays **exactly once**: per batch, one transaction
//!   stages each letter in the outbox under its original message id and
//!   marks it replayed; the relay publishes it after the commit. A replay
//!   killed anywhere leaves each letter replayed *and* staged, or untouched.
//! - **A RabbitMQ DLQ** is read with `basic.get`, each letter held
//!   unacknowledged while an operation runs, so none comes twice. A replay
//!   publishes each copy with confirms and acks the letter only after the
//!   confirm (a crash in between leaves both, and the consumer drops the
//!   second copy as a duplicate). Letters an operation read and did not
//!   delete are published again to the back of the DLQ, confirmed, then
//!   acked: handed back, a quorum queue's letter would spend a delivery
//!   attempt (its `delivery-limit`, 20 on RabbitMQ 4.x, would drop it).
//!   Only the queue, message ids, reason, `until` and `limit` select there.
//!
//! ```no_run
//! use idempo::ops::Services;
//! use idempo::ops::dead_letters::{DeadLetterStore, Filter, ReplayOptions, Store};
//!
//! # async fn doc(services: Services) -> Result<(), idempo::ops::OpsError> {
//! let store = DeadLetterStore::open(&services, "payments", Store::Auto).await?;
//! for letter in store.list(&Filter::queue("payments")).await? {
//!     println!("{:?}: {} ({:?})", letter.message_id, letter.reason, letter.error);
//! }
//! let failed = Filter { reason: Some("max attempts exceeded".into()), ..Filter::queue("payments") };
//! let report = store.replay(&failed, &ReplayOptions::by("alice"), |_| {}).await?;
//! println!("{} replayed, {} skipped", report.replayed, report.skipped_total());
//! # Ok(()) }
//! ```

mod dlq;
mod import;
mod plan;
mod queue;
mod queue_purge;
mod queue_replay;
mod source;
mod table;

use std::fmt;

pub use crate::dead_letters::model::{
    Filter, Group, Letter, LetterCount, LetterDetail, LetterRef, LetterState, Refusal, ReplayEvent,
    ReplayOptions, ReplayReport,
};
pub use import::ImportReport;
pub use plan::PurgePlan;

use super::{OpsError, Result, Services};
use queue::QueueSource;
use source::Source;
use table::TableSource;

/// Where [`DeadLetterStore::open`] finds the dead letters of a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Store {
    /// The table when it holds letters of the queue (in any state), else
    /// the RabbitMQ DLQ (also when PostgreSQL cannot be asked).
    #[default]
    Auto,
    /// The `dead_letters` table.
    Table,
    /// The RabbitMQ queue `<queue>.dlq`.
    Queue,
}

/// The dead letters of one work queue, in the table or its RabbitMQ DLQ.
pub struct DeadLetterStore {
    source: Sources,
}

enum Sources {
    Table(TableSource),
    Queue(QueueSource),
}

impl fmt::Debug for DeadLetterStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadLetterStore")
            .field("location", &self.location())
            .finish()
    }
}

/// One call on whichever source the store has.
macro_rules! on_source {
    ($store:expr, $s:ident => $call:expr) => {
        match &$store.source {
            Sources::Table($s) => $call,
            Sources::Queue($s) => $call,
        }
    };
}

impl DeadLetterStore {
    /// The dead letters of `queue` (a work queue, or its `.dlq`) in `store`.
    /// With [`Store::Auto`], a table that cannot be asked (PostgreSQL away)
    /// means the DLQ, with a warning logged.
    ///
    /// # Errors
    /// [`OpsError::DatabaseUnreachable`] for [`Store::Table`];
    /// [`OpsError::DeadLetterQueueNotFound`] is reported by the first
    /// operation on a DLQ that does not exist.
    pub async fn open(services: &Services, queue: &str, store: Store) -> Result<Self> {
        let work = crate::amqp::Amqp::work_queue(queue).to_owned();
        let table = match store {
            Store::Table => true,
            Store::Queue => false,
            Store::Auto => match TableSource::holds(services, &work).await {
                Ok(holds) => holds,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot look for dead letters in PostgreSQL; reading the RabbitMQ DLQ");
                    false
                }
            },
        };
        let source = if table {
            Sources::Table(TableSource::new(
                services.database().await?.clone(),
                work,
                Some(services.clone()),
            ))
        } else {
            Sources::Queue(QueueSource::new(services.clone(), queue))
        };
        Ok(DeadLetterStore { source })
    }

    /// The letters of the `dead_letters` table in `pool` (every queue's:
    /// filters name the queue). Without a broker, a replay does not check
    /// that its queues exist ([`open`](Self::open) does).
    pub fn table(pool: sqlx::PgPool) -> Self {
        DeadLetterStore {
            source: Sources::Table(TableSource::new(pool, String::new(), None)),
        }
    }

    /// Whether the letters are in the table (else in a RabbitMQ DLQ).
    pub fn is_table(&self) -> bool {
        matches!(self.source, Sources::Table(_))
    }

    /// Where the letters are: `the dead_letters table` or the DLQ's name.
    pub fn location(&self) -> String {
        match &self.source {
            Sources::Table(_) => "the dead_letters table".into(),
            Sources::Queue(q) => q.dlq().to_owned(),
        }
    }

    /// The letters `filter` selects, oldest first (in a DLQ: in its order),
    /// at most `filter.limit` (100 by default). Letters of a DLQ stay there.
    ///
    /// # Errors
    /// [`OpsError::NeedsTable`] for a filter a DLQ cannot apply; connection,
    /// channel and query errors (a malformed body path too).
    pub async fn list(&self, filter: &Filter) -> Result<Vec<Letter>> {
        on_source!(self, s => s.list(filter).await)
    }

    /// The letters `filter` selects grouped by queue and cause, the largest
    /// group first.
    ///
    /// # Errors
    /// [`OpsError::NeedsTable`] on a DLQ; query errors.
    pub async fn groups(&self, filter: &Filter) -> Result<Vec<Group>> {
        on_source!(self, s => s.groups(filter).await)
    }

    /// One letter whole (its latest letter, for a message id), or `None`.
    ///
    /// # Errors
    /// [`OpsError::NeedsTable`] for a row on a DLQ; connection and query
    /// errors.
    pub async fn show(&self, which: &LetterRef) -> Result<Option<LetterDetail>> {
        on_source!(self, s => s.show(which).await)
    }

    /// How many letters `filter` selects (its limit ignored). On a DLQ this
    /// reads every letter (and puts each back).
    ///
    /// # Errors
    /// As [`list`](Self::list).
    pub async fn count(&self, filter: &Filter) -> Result<u64> {
        on_source!(self, s => s.count(filter).await)
    }

    /// Replays the live letters `filter` selects to their work queue (or
    /// `options.to`), each once, with its id, body and properties, its
    /// failure counters moved into its replay history so that its consumer
    /// retries it afresh. `on_event` hears of each letter as it goes.
    /// Letters whose id the consumer already processed are skipped unless
    /// `options.force`; see [the module docs](self) for each store's
    /// guarantee.
    ///
    /// # Errors
    /// [`OpsError::NothingSelected`] when neither the filter nor
    /// `options.all` says what to replay; [`OpsError::NotConfirmed`];
    /// connection and query errors. What was replayed before the error
    /// stays replayed. A letter that cannot be replayed is not an error: it
    /// stays, and the report counts it under its [`Refusal`] (its queue
    /// does not exist, its copy is too large or refused by the outbox, its
    /// id was processed), while the others are replayed.
    pub async fn replay(
        &self,
        filter: &Filter,
        options: &ReplayOptions,
        on_event: impl FnMut(ReplayEvent<'_>) + Send,
    ) -> Result<ReplayReport> {
        if !options.all && !filter.selects() {
            return Err(OpsError::NothingSelected);
        }
        on_source!(self, s => s.replay(filter, options, on_event).await)
    }

    /// Picks the letters `filter` selects for deletion and holds them:
    /// nothing is deleted until [`PurgePlan::delete`]; [`PurgePlan::keep`]
    /// lets them be.
    ///
    /// # Errors
    /// As [`list`](Self::list).
    pub async fn purge(&self, filter: &Filter) -> Result<PurgePlan> {
        on_source!(self, s => s.purge(filter).await.map(PurgePlan::from))
    }

    /// Deletes the letters `filter` selects now, without a plan (a DLQ is
    /// walked holding one letter at a time, however large); returns how
    /// many.
    ///
    /// # Errors
    /// As [`list`](Self::list); those deleted before an error stay deleted.
    pub async fn purge_now(&self, filter: &Filter) -> Result<u64> {
        on_source!(self, s => s.purge_now(filter).await)
    }

    /// Marks the live letters `filter` selects discarded by `who`: kept for
    /// audit until reaped. Returns how many.
    ///
    /// # Errors
    /// [`OpsError::NothingSelected`] for a filter that selects nothing but
    /// the queue; [`OpsError::NeedsTable`] on a DLQ (it can only be purged).
    pub async fn discard(&self, filter: &Filter, who: &str, all: bool) -> Result<u64> {
        if !all && !filter.selects() {
            return Err(OpsError::NothingSelected);
        }
        on_source!(self, s => s.discard(filter, who).await)
    }

    /// Deletes the table's replayed and discarded letters (of `consumer`,
    /// or of every consumer) settled more than `older_than` ago, `batch`
    /// rows per statement, as a consumer's retention does; returns how
    /// many. Live letters are never reaped.
    ///
    /// # Errors
    /// [`OpsError::NeedsTable`] on a DLQ; a `batch` below 1; query errors.
    pub async fn reap(
        &self,
        consumer: Option<&str>,
        older_than: std::time::Duration,
        batch: i64,
    ) -> Result<u64> {
        match &self.source {
            Sources::Table(t) => t.reap(consumer, older_than, batch).await,
            Sources::Queue(q) => Err(q.needs_table("reaping")),
        }
    }
}
