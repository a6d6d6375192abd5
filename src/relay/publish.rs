//! What the relay asks of a transport: how to run its sessions with the
//! broker, and, within one, how to publish a batch and what the broker said
//! of each message. The wake-ups, the batches, the failures and the health
//! are the relay's, written once (`running.rs`).

use std::fmt;
use std::future::Future;

use super::Relay;
use super::running::Running;
use super::said::{Envelope, Said};
use crate::Result;

/// A transport whose broker the outbox relay publishes to (RabbitMQ,
/// JetStream). Sealed: only idempo's transports have a relay.
pub trait Publish: Sized + Send + Sync + 'static + sealed::Sealed {
    /// Where and how the relay publishes (RabbitMQ: the broker's nodes;
    /// JetStream: the server's URL and the streams to create).
    #[doc(hidden)]
    type Target: fmt::Debug + Send + Sync;

    /// The transport's name: the relay takes the outbox rows of this
    /// transport only.
    #[doc(hidden)]
    const NAME: &'static str;

    /// Runs sessions with the broker until the relay stops: each one
    /// connects, then hands itself to [`Running::publish_until_stopped`];
    /// a lost one is reported and followed by another after a backoff.
    ///
    /// # Errors
    /// A configuration error no reconnect can fix (a refused stream).
    #[doc(hidden)]
    fn sessions(
        relay: &Relay<Self>,
        running: &Running<'_, Self>,
    ) -> impl Future<Output = Result<()>> + Send;
}

/// One session with the broker, as the relay's batches use it.
pub(crate) trait Link: Send {
    /// Publishes the envelopes' messages; what the broker said of each.
    fn publish(&mut self, envelopes: &[Envelope]) -> impl Future<Output = Vec<Vec<Said>>> + Send;

    /// The broker's reason while it blocks publishing (a resource alarm).
    fn blocked(&self) -> Option<String> {
        None
    }

    /// Waits until the broker unblocks publishing, or the session is lost.
    fn unblocked(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Readies the session for the next batch (AMQP: a channel the broker
    /// closed over a row is opened again); `Err` when it is lost.
    fn prepare(&mut self) -> impl Future<Output = std::result::Result<(), String>> + Send {
        async { Ok(()) }
    }

    /// Whether the session is still up.
    fn is_connected(&self) -> bool {
        true
    }

    /// A batch went unanswered on a live session: whatever is late on it
    /// must not be credited to what comes next (AMQP: a new channel).
    fn after_unanswered(&mut self) -> impl Future<Output = std::result::Result<(), String>> + Send {
        async { Ok(()) }
    }
}

pub(crate) mod sealed {
    /// Only idempo's transports publish the outbox.
    pub trait Sealed {}
}
