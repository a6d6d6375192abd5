//! [`Relay`]: publishes the [outbox](crate::outbox)'s committed rows of one
//! transport to its broker (RabbitMQ: [`amqp::Relay`](crate::amqp::Relay);
//! JetStream: `nats::Relay`), and deletes each only after the broker
//! confirmed it. One relay, written once: the wake-ups, the batches, the
//! failures and the health are the same for every transport; each
//! transport publishes a batch in its own terms.
//!
//! One batch is one PostgreSQL transaction:
//!
//! 1. lock up to `batch_size` due pending rows, lowest id first, `FOR UPDATE
//!    SKIP LOCKED` (another relay's rows are skipped, not waited for);
//! 2. of each ordering key, keep only the rows that no earlier pending row of
//!    the same key precedes (that one is another relay's, or waits for a
//!    retry): the relay holding a key's first row is the only one that
//!    publishes that key;
//! 3. publish them with confirms in flight together (`mandatory`);
//! 4. delete the confirmed rows (or mark them done), record failures with a
//!    backoff, commit.
//!
//! A crash before the commit rolls it all back: the rows are published again
//! with the same ids. `idle_in_transaction_session_timeout` bounds how long a
//! relay whose host vanished keeps its locks.

mod heartbeat;
mod publish;
pub(crate) mod running;
pub(crate) mod said;

use std::fmt;
use std::time::Duration;

use sqlx::PgPool;

use crate::outbox::batch::RetrySchedule;
use crate::outbox::{OutboxStatus, RelayLink};
pub use crate::runtime::health::RelayState;
use crate::runtime::shutdown::ShutdownHandle;
use crate::runtime::watched::Watched;
pub(crate) use publish::sealed as publish_sealed;
pub(crate) use publish::{Link, Publish};

/// A snapshot of a relay's health.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RelaySnapshot {
    /// Where the relay is.
    pub state: RelayState,
    /// Rows this relay published (confirmed by the broker).
    pub published: u64,
    /// Rows this relay gave up on (marked failed).
    pub failed: u64,
    /// The outbox when last counted (at most once a second while busy).
    pub outbox: OutboxStatus,
    /// The last error the relay met, if any.
    pub last_error: Option<String>,
    /// The broker's reason while it blocks the relay's connection
    /// (`connection.blocked`, e.g. `"low on memory"`); also the gauge
    /// `idempo_broker_blocked` (1 while blocked).
    pub broker_blocked: Option<String>,
}

/// Live health of a [`Relay`]: [`snapshot`](Watched::snapshot) and
/// [`wait_for`](Watched::wait_for). Cheap to clone.
pub type RelayHealth = Watched<RelaySnapshot>;

fn relay_health(state: RelayState) -> RelayHealth {
    Watched::new(RelaySnapshot {
        state,
        published: 0,
        failed: 0,
        outbox: OutboxStatus::default(),
        last_error: None,
        broker_blocked: None,
    })
}

/// Publishes the outbox's committed rows of the transport `T`: run one (or
/// several, on several hosts) per database and transport. Every
/// [`Consumer`](crate::consumer::Consumer) runs one for its pool unless
/// [`ConsumerBuilder::relay`](crate::consumer::ConsumerBuilder::relay)
/// turns it off; run one yourself in a process that stages without
/// consuming (an axum service). Build one with its transport's `new`
/// ([`amqp::Relay::new`](crate::amqp::Relay::new), `nats::Relay::new`).
///
/// ```no_run
/// use idempo::amqp::Relay;
///
/// # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
/// let relay = Relay::new("amqp://guest:guest@127.0.0.1:5672/%2f", pool)?;
/// let stop = relay.shutdown_handle();
/// let running = tokio::spawn(relay.run());
/// // ... serve requests that stage messages ...
/// stop.shutdown(); // finishes the batch in flight, drains what is pending
/// running.await.expect("relay task")?;
/// # Ok(()) }
/// ```
///
/// # Default
/// - batches of 500 rows; confirms awaited together, within 10 s;
/// - wakes on `NOTIFY idempo_outbox` (sent when a staging transaction
///   commits), and polls every 5 s as a fallback;
/// - a refused (nacked) or unroutable message is retried with exponential
///   backoff (1 s doubling to 5 min, jittered), and after 10 attempts marked
///   `failed` with its reason ([`FailedMessage::list`](crate::outbox::FailedMessage::list), [`FailedMessage::retry`](crate::outbox::FailedMessage::retry));
/// - a message over which the broker closes the channel (`NOT_FOUND`: a
///   missing exchange; `PRECONDITION_FAILED`) is refused the same way: the
///   batch's unanswered messages are published again one at a time, on a
///   new channel after each close, so the refusal is that message's attempt
///   and the others go out; one whose properties and headers do not fit in
///   the connection's `frame_max` is never sent (the broker would close the
///   whole connection) and is `failed` at once;
/// - while the broker blocks the connection (`connection.blocked`: a memory
///   or disk alarm), rows wait without using attempts:
///   [`RelayState::Blocked`], [`RelaySnapshot::broker_blocked`], the gauge
///   `idempo_broker_blocked`, one warning; the outbox gauges keep counting;
/// - published rows are deleted at once (see [`keep_published`](Self::keep_published));
/// - takeover: a relay whose host vanished mid-batch loses its row locks after
///   15 s (`idle_in_transaction_session_timeout`); a killed relay's locks go at
///   once. Another relay picks the rows up at its next wake, within the poll
///   interval.
///
/// # Connections
/// One PostgreSQL connection of its own for `LISTEN`, and one of the pool's
/// for the length of each batch. One connection to the broker.
pub struct Relay<T: Publish> {
    pub(crate) target: T::Target,
    pub(crate) pool: PgPool,
    batch_size: usize,
    poll_interval: Duration,
    max_attempts: u32,
    retry_min: Duration,
    retry_max: Duration,
    confirm_timeout: Duration,
    takeover_after: Duration,
    keep_published: Option<Duration>,
    pub(crate) connection_name: Option<String>,
    dormant: bool,
    link: RelayLink,
    pub(crate) shutdown: ShutdownHandle,
    pub(crate) health: RelayHealth,
}

impl<T: Publish> fmt::Debug for Relay<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("transport", &T::NAME)
            .field("target", &self.target)
            .field("batch_size", &self.batch_size)
            .field("poll_interval", &self.poll_interval)
            .field("max_attempts", &self.max_attempts)
            .finish_non_exhaustive()
    }
}

/// Rows per cleanup `DELETE` of kept published rows.
const CLEANUP_BATCH: i64 = 5_000;

/// How long the relay waits, once a local consumer committed, for more of
/// its commits before publishing: fewer, larger batches under load.
const LOCAL_LINGER: Duration = Duration::from_millis(10);

/// How long a relay waits before retrying a key whose first row another
/// relay holds.
const CONTENDED_RETRY: Duration = Duration::from_millis(50);

impl<T: Publish> Relay<T> {
    /// A relay publishing to `target` (what the transport's `new` builds).
    pub(crate) fn with_target(target: T::Target, pool: PgPool) -> Self {
        Relay {
            target,
            pool,
            batch_size: 500,
            poll_interval: Duration::from_secs(5),
            max_attempts: 10,
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(300),
            confirm_timeout: Duration::from_secs(10),
            takeover_after: Duration::from_secs(15),
            keep_published: None,
            connection_name: None,
            dormant: false,
            link: RelayLink::default(),
            shutdown: ShutdownHandle::default(),
            health: relay_health(RelayState::Connecting),
        }
    }

    /// This relay as the one a consumer runs, woken through `link`: dormant
    /// until the consumer's handlers stage a message or pending rows show up.
    pub(crate) fn for_consumer(self, consumer: &str, link: RelayLink) -> Self {
        let mut relay = self;
        relay.dormant = true;
        relay.link = link;
        relay.health = relay_health(RelayState::Dormant);
        relay.connection_name = Some(format!("idempo-relay:{consumer}:{}", std::process::id()));
        relay
    }

    /// Rows per batch (default: 500).
    #[must_use]
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.batch_size = rows;
        self
    }

    /// The fallback poll, for missed notifications and a lost `LISTEN`
    /// connection (default: 5 s).
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Attempts before a refused or unroutable message is marked failed
    /// (default: 10).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The backoff between attempts of a refused or unroutable message:
    /// `min` doubling up to `max`, jittered (default: 1 s to 5 min).
    #[must_use]
    pub fn retry_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.retry_min = min;
        self.retry_max = max;
        self
    }

    /// How long the confirms of one batch may take (default: 10 s). Keep it
    /// below [`takeover_after`](Self::takeover_after).
    #[must_use]
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// How long PostgreSQL lets a silent relay keep its rows locked before it
    /// ends the session, so another relay can take over (default: 15 s).
    #[must_use]
    pub fn takeover_after(mut self, timeout: Duration) -> Self {
        self.takeover_after = timeout;
        self
    }

    /// Keep published rows (state `done`) this long for audit, then delete
    /// them in bounded batches (default: delete at once).
    #[must_use]
    pub fn keep_published(mut self, keep: Duration) -> Self {
        self.keep_published = Some(keep);
        self
    }

    /// The name of its connection to the broker, shown by the broker's
    /// tools (default: `idempo-relay:<pid>`).
    #[must_use]
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// A handle that stops the relay from another task.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// The relay's live health.
    pub fn health(&self) -> RelayHealth {
        self.health.clone()
    }

    pub(crate) fn set_state(&self, state: RelayState) {
        self.health.update(|s| s.state = state);
    }

    /// How refused messages are retried.
    fn schedule(&self) -> RetrySchedule {
        RetrySchedule {
            max_attempts: self.max_attempts,
            min: self.retry_min,
            max: self.retry_max,
        }
    }
}
