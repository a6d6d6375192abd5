//! The transport seam (public as [`crate::consumer::transport`], where its
//! documentation is): the [`Transport`] trait and what crosses it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::dead_letter::DeadLetterReason;
use super::message::HeaderValue;
use super::message::Message;
use super::redelivery::RedeliveryPolicy;
use crate::Result;

pub use super::dispatch::{Deliveries, Feed, FeedEnd};

/// A broker adapter, seen from the runtime. See the
/// [module docs](crate::consumer::transport).
///
/// Each settling method settles one delivery, named by its message and the
/// transport's [`Receipt`](Transport::Receipt); the runtime calls exactly
/// one of them per delivery, or none when it leaves the delivery unsettled
/// on purpose (shutdown: the broker redelivers it).
pub trait Transport: Sized + Send + Sync + 'static {
    /// The transport's own options, set through the builder's methods for
    /// this transport (the queue or stream, the broker's address, ...).
    type Options: Send + 'static;

    /// One delivery's handle (AMQP: its channel's acker and delivery tag).
    type Receipt: Send + Sync + 'static;

    /// The transport's name, as the outbox, the dead-letter table and the
    /// heartbeats record it (`amqp`, `nats`): lowercase letters, digits,
    /// `-` and `_`.
    const NAME: &'static str;

    /// Whether a message's attempts are the broker's count of its
    /// deliveries (JetStream), which also grows when a delivery ends
    /// without an outcome, rather than idempo's header on a copy.
    const COUNTS_DELIVERIES: bool = false;

    /// Whether the transport keeps dead letters of its own
    /// ([`dead_letter`](Transport::dead_letter) can take one); without, the
    /// `dead_letters` table is the only store.
    const OWN_DEAD_LETTERS: bool;

    /// Checks the options against what the consumer will do and builds the
    /// transport.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) (or the transport's own
    /// error) for an option that cannot work.
    fn build(options: Self::Options, setup: &Setup<'_>) -> Result<Self>;

    /// The queue or stream the consumer reads: the default consumer name,
    /// and what heartbeats, dead letters and spans name.
    fn source(&self) -> &str;

    /// Receives deliveries until the consumer stops: connects (waiting
    /// while the broker is away), declares what it needs, and hands each
    /// session's deliveries to [`Deliveries::dispatch`]; reconnects when a
    /// session is lost. Returns once [`Deliveries::dispatch`] said
    /// [`FeedEnd::Stopped`] (after letting the units in flight finish with
    /// [`Deliveries::drain`] where the broker must hear of their settlement
    /// before the session closes).
    ///
    /// # Errors
    /// A configuration error no reconnect can fix (refused credentials at
    /// start, a conflicting topology): the consumer stops with it.
    fn consume(
        self: Arc<Self>,
        deliveries: &mut Deliveries<Self>,
    ) -> impl Future<Output = Result<()>> + Send;

    /// The span a unit of deliveries is processed in, by the messaging
    /// conventions for this broker (the runtime records the outcome on it).
    fn span(&self, consumer: &str, messages: &[Message]) -> tracing::Span;

    /// Runs beside a unit while it is decided and settled, and is dropped
    /// when it is done (JetStream: in-progress acks, so that a long handler
    /// keeps its messages). Nothing by default.
    fn while_running(
        &self,
        receipts: &[Self::Receipt],
    ) -> impl Future<Output = ()> + Send + 'static {
        let _ = receipts;
        std::future::pending()
    }

    /// A probe that says when a delivery can no longer be settled (AMQP:
    /// its channel closed): a unit waiting for the database then gives up
    /// on it, since the broker redelivers it anyway. None by default: a
    /// delivery stays valid until the consumer stops.
    fn gone(&self, receipt: &Self::Receipt) -> Option<Box<dyn Fn() -> bool + Send + Sync>> {
        let _ = receipt;
        None
    }

    /// How long after its last attempt a delivery may still come back
    /// (RabbitMQ: its consumer timeout): the retention of claims must cover
    /// it and the retry schedule.
    fn redelivery_horizon(&self) -> Duration {
        Duration::ZERO
    }

    /// The outbox relay this transport runs beside a consumer, publishing
    /// what its handlers stage (feature `outbox`). idempo's transports start
    /// one (the relay's broker side is sealed); any other has none, the
    /// default.
    #[doc(hidden)]
    #[cfg(feature = "outbox")]
    fn relay(&self, context: RelayContext<'_>) -> Option<RelayTask> {
        let _ = context;
        None
    }

    /// Delivers `message` again after `later.delay`.
    fn retry_later(
        &self,
        message: &Message,
        receipt: &Self::Receipt,
        later: Later<'_>,
    ) -> impl Future<Output = std::result::Result<(), Refused>> + Send;

    /// Moves `message` into the transport's own dead-letter store; returns
    /// the headers it had to drop to fit (name, bytes). Called only when
    /// [`OWN_DEAD_LETTERS`](Transport::OWN_DEAD_LETTERS), or when the
    /// dead-letter table refused the letter (then refuse it too when there
    /// is no store of its own: the delivery is handed back).
    fn dead_letter(
        &self,
        message: &Message,
        receipt: &Self::Receipt,
        letter: Letter<'_>,
    ) -> impl Future<Output = std::result::Result<Vec<(String, usize)>, Refused>> + Send;

    /// The runtime stored `message`'s `letter` in the `dead_letters` table:
    /// the delivery is done (acknowledge it).
    fn letter_stored(
        &self,
        message: &Message,
        receipt: &Self::Receipt,
        letter: Letter<'_>,
    ) -> impl Future<Output = ()> + Send;

    /// Hands `message` back, unchanged, to be delivered again after `pause`
    /// (it failed with `error`, or its copy could not be sent).
    fn requeue(
        &self,
        message: &Message,
        receipt: &Self::Receipt,
        pause: Duration,
        error: &str,
    ) -> impl Future<Output = ()> + Send;

    /// Lets the broker's own dead-lettering take `message` as it is, when
    /// not even idempo's headers fit a copy (AMQP: reject without requeue).
    fn reject(&self, receipt: &Self::Receipt) -> impl Future<Output = ()> + Send;

    /// The unit is settled: acknowledges what is to be acknowledged (AMQP
    /// batch mode: one multiple ack over the unit's tags).
    fn finish(&self, unit: Vec<Finished<Self::Receipt>>) -> impl Future<Output = ()> + Send;
}

/// What a transport's [`build`](Transport::build) may check against: the
/// consumer's settings that bear on the broker.
#[derive(Debug)]
pub struct Setup<'a> {
    pub(crate) pool: &'a sqlx::PgPool,
    pub(crate) consumer: Option<&'a str>,
    pub(crate) prefetch: u16,
    pub(crate) concurrency: usize,
    pub(crate) batch: Option<usize>,
    pub(crate) redelivery: &'a RedeliveryPolicy,
    pub(crate) handler_timeout: Duration,
    pub(crate) letters_in_table: bool,
    pub(crate) claim_retention: Option<Duration>,
}

impl Setup<'_> {
    /// The consumer's pool (a transport that writes dead letters of its
    /// own, such as AMQP's quarantine, writes them there).
    pub fn pool(&self) -> &sqlx::PgPool {
        self.pool
    }

    /// The consumer name, when one was set (else the source's name).
    pub fn consumer(&self) -> Option<&str> {
        self.consumer
    }

    /// Deliveries the broker may hand this consumer before it acknowledges.
    pub fn prefetch(&self) -> u16 {
        self.prefetch
    }

    /// Handlers running at once (per-message mode).
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// Batch mode's batch size.
    pub fn batch(&self) -> Option<usize> {
        self.batch
    }

    /// The retry policy.
    pub fn redelivery(&self) -> &RedeliveryPolicy {
        self.redelivery
    }

    /// How long one handler may run.
    pub fn handler_timeout(&self) -> Duration {
        self.handler_timeout
    }

    /// Whether dead letters go to the `dead_letters` table.
    pub fn letters_in_table(&self) -> bool {
        self.letters_in_table
    }

    /// How long claims are kept (`None`: never reaped). A message delivered
    /// again after its claim was reaped runs again: a transport that can
    /// send old messages anew (a JetStream durable set up again) checks
    /// against it.
    pub fn claim_retention(&self) -> Option<Duration> {
        self.claim_retention
    }
}

/// A copy the transport could not send.
#[derive(Debug)]
#[non_exhaustive]
pub enum Refused {
    /// The copy's headers do not fit what the transport carries: sending it
    /// can never succeed.
    TooLarge(String),
    /// Anything else (not confirmed, no such queue, connection lost): the
    /// original is handed back instead.
    Failed(String),
}

/// A delivery to be delivered again after `delay`.
#[derive(Debug)]
#[non_exhaustive]
pub struct Later<'a> {
    /// How long it waits.
    pub delay: Duration,
    /// The attempts used so far, this one included.
    pub attempts: u32,
    /// The failure.
    pub error: &'a str,
    /// idempo's failure headers for a copy (the transport's copy carries
    /// them; a transport that redelivers the original unchanged need not).
    pub headers: Vec<(&'static str, HeaderValue)>,
}

/// A delivery put aside for good.
#[derive(Debug)]
#[non_exhaustive]
pub struct Letter<'a> {
    /// Why.
    pub reason: DeadLetterReason,
    /// The failure.
    pub error: &'a str,
    /// idempo's failure headers for the letter, its reason included.
    pub headers: Vec<(&'static str, HeaderValue)>,
}

/// How one delivery of a unit ended, handed to [`Transport::finish`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Finished<R> {
    /// To acknowledge: processed, or a duplicate.
    Ack {
        /// The delivery.
        receipt: R,
        /// Whether it was a duplicate (its handler did not run).
        duplicate: bool,
    },
    /// Already settled by one of the transport's calls.
    Settled(R),
    /// Left unsettled on purpose: the broker delivers it again.
    Abandoned(R),
}

#[cfg(feature = "outbox")]
pub(crate) use super::relay_task::{RelayContext, RelayTask};
