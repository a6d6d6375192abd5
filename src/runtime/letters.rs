//! The runtime's own store of dead letters, beside the transport's: what a
//! letter is, and the small trait a store implements (the `dead_letters`
//! table is one, feature `outbox`). The runtime routes to it without knowing
//! which store it is.

use std::time::Duration;

use futures::future::BoxFuture;

use super::message::HeaderValue;
use super::message::Message;
use crate::Result;

/// A dead letter as the runtime writes it.
pub(crate) struct NewLetter<'a> {
    /// The transport the message came from: where its replay goes.
    pub(crate) transport: &'static str,
    pub(crate) consumer: &'a str,
    pub(crate) queue: &'a str,
    /// The original, as delivered (its id, body, exchange, envelope).
    pub(crate) message: &'a Message,
    /// The routing key it was first published with.
    pub(crate) routing_key: &'a str,
    /// idempo's failure headers, to add to the original's.
    pub(crate) headers: &'a [(&'static str, HeaderValue)],
    pub(crate) reason: &'a str,
    pub(crate) error: &'a str,
    pub(crate) attempts: u32,
    /// RFC 3339.
    pub(crate) first_failed_at: &'a str,
    pub(crate) last_failed_at: &'a str,
}

/// Where the runtime keeps dead letters instead of the transport's store.
pub(crate) trait LetterStore: Send + Sync {
    /// Stores `letter`, durably, or fails: [`Error::is_unavailable`]
    /// (crate::Error::is_unavailable) errors are waited out by the caller.
    /// A message processed already gets no letter: [`Filing::Processed`].
    fn insert<'a>(&'a self, letter: &'a NewLetter<'a>) -> BoxFuture<'a, Result<Filing>>;

    /// Deletes `consumer`'s letters replayed or discarded more than
    /// `older_than` ago; returns how many.
    fn reap<'a>(&'a self, consumer: &'a str, older_than: Duration) -> BoxFuture<'a, Result<u64>>;
}

/// What a [`LetterStore`] did with a letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Filing {
    /// Stored, its message's claim held.
    Filed,
    /// Not stored: the message was processed already.
    Processed,
}

/// What became of a dead letter sent to the letter store.
pub(crate) enum Stored {
    /// Committed: the delivery is done.
    Yes,
    /// Not stored, the message was processed already: the delivery is a
    /// duplicate, acknowledged.
    Processed,
    /// Shutdown, or the delivery's channel closed, while the store could not
    /// take it: leave the delivery unsettled.
    Abandoned,
    /// Refused for a reason of its own: the transport's store takes it.
    Refused(crate::Error),
}

/// Where a consumer puts its dead letters
/// ([`ConsumerBuilder::dead_letters`](crate::consumer::ConsumerBuilder::dead_letters)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeadLetters {
    /// The transport's own store (RabbitMQ: the queue `<queue>.dlq`, or
    /// the one configured): the default where the transport has one.
    #[default]
    Queue,
    /// The `dead_letters` table, in a transaction of its own; the delivery
    /// is acked only after that commit, and waits while PostgreSQL cannot
    /// take it.
    Table,
}
