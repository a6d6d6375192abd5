//! The transport seam: what the runtime asks of a broker adapter once it has
//! decided how each delivery ends.
//!
//! The runtime decides ([`Route`](super::route::Route)); a transport carries
//! out the decision in its broker's terms. The AMQP adapter republishes a
//! copy to a delay queue or the DLQ (confirmed) and then acks; a JetStream
//! adapter would NAK with a delay, or TERM; [`idempo::testing`](crate::testing)
//! records the decision as a value. Everything around those calls (the
//! dead-letter table, counting, health, what to do when a copy is refused)
//! is the runtime's, written once in `settle.rs`.

use std::future::Future;
use std::time::Duration;

use super::dead_letter::DeadLetterReason;
use super::headers::HeaderValue;
use super::message::Message;

/// A copy the transport could not send.
#[derive(Debug)]
pub(crate) enum Refused {
    /// The copy's headers do not fit what the transport carries: sending it
    /// can never succeed.
    TooLarge(String),
    /// Anything else (not confirmed, no such queue, connection lost): the
    /// original is handed back instead.
    Failed(String),
}

/// A delivery to be delivered again after `delay`.
// Each transport reads what its broker needs (AMQP the queue and headers,
// the testing recorder everything).
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
#[derive(Debug)]
pub(crate) struct Later<'a> {
    /// Where the copy waits (AMQP: the delay queue).
    pub(crate) queue: &'a str,
    pub(crate) delay: Duration,
    /// The attempts used so far, this one included.
    pub(crate) attempts: u32,
    pub(crate) error: &'a str,
    /// idempo's failure headers for the copy.
    pub(crate) headers: Vec<(&'static str, HeaderValue)>,
}

/// A delivery put aside for good, into the transport's own store (or the
/// runtime's letter store).
#[derive(Debug)]
pub(crate) struct Letter<'a> {
    pub(crate) reason: DeadLetterReason,
    pub(crate) error: &'a str,
    /// idempo's failure headers for the letter, its reason included.
    pub(crate) headers: Vec<(&'static str, HeaderValue)>,
}

/// How one delivery of a unit ended, handed to [`Transport::finish`].
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
#[derive(Debug)]
pub(crate) enum Finished<R> {
    /// To acknowledge: processed, or a duplicate.
    Ack { receipt: R, duplicate: bool },
    /// Already settled by one of the transport's calls.
    Settled(R),
    /// Left unsettled on purpose: it comes back when its channel closes.
    Abandoned(R),
}

/// A broker adapter, seen from the runtime. Each method settles one
/// delivery, identified by the message and the transport's `Receipt`. (The
/// transport also tells the runtime when a unit's deliveries are beyond
/// settling, through the unit's [`Abandon`](super::outcome::Abandon).)
pub(crate) trait Transport: Send + Sync {
    /// One delivery's handle (AMQP: the acker and its delivery tag).
    type Receipt: Send + Sync;

    /// Delivers `message` again after `later.delay`. AMQP: a confirmed copy
    /// to `later.queue`, then ack.
    fn retry_later(
        &self,
        message: &Message,
        receipt: &Self::Receipt,
        later: Later<'_>,
    ) -> impl Future<Output = Result<(), Refused>> + Send;

    /// Moves `message` into the transport's dead-letter store; returns the
    /// headers it had to drop to fit (name, bytes). AMQP: a confirmed copy
    /// to the DLQ, trimmed to the frame, then ack.
    fn dead_letter(
        &self,
        message: &Message,
        receipt: &Self::Receipt,
        letter: Letter<'_>,
    ) -> impl Future<Output = Result<Vec<(String, usize)>, Refused>> + Send;

    /// The runtime stored `message`'s letter itself (the dead-letter
    /// table): the delivery is done (AMQP: ack).
    fn letter_stored(
        &self,
        message: &Message,
        receipt: &Self::Receipt,
        letter: Letter<'_>,
    ) -> impl Future<Output = ()> + Send;

    /// Hands `message` back to be delivered again after `pause`, unchanged
    /// (AMQP: nack with requeue).
    fn requeue(
        &self,
        message: &Message,
        receipt: &Self::Receipt,
        pause: Duration,
        error: &str,
    ) -> impl Future<Output = ()> + Send;

    /// Lets the broker's own dead-lettering take `message` as it is, when
    /// not even idempo's headers fit a copy (AMQP: reject, no requeue).
    fn reject(&self, receipt: &Self::Receipt) -> impl Future<Output = ()> + Send;

    /// The unit is settled: acknowledges what is to be acknowledged (AMQP
    /// batch mode: one multiple ack over the unit's tags).
    fn finish(&self, unit: Vec<Finished<Self::Receipt>>) -> impl Future<Output = ()> + Send;
}
