//! [`NatsError`]: what the JetStream transport refuses at start, each a
//! configuration error no retry can fix.

use crate::Error;

/// A JetStream transport error. Reaches callers inside [`Error::Other`]
/// (ask it with [`Error::downcast_ref`]); each is returned by
/// [`Consumer::run`](super::Consumer::run) before anything is consumed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// A stream, subject or consumer name NATS would refuse.
    #[error("the {what} name {name:?} is not valid on NATS: {reason}")]
    InvalidName {
        /// `stream`, `subject` or `consumer`.
        what: &'static str,
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The server answers, but JetStream is not enabled on it (start
    /// `nats-server` with `-js`).
    #[error("JetStream is not available on {url}: {reason} (start nats-server with -js)")]
    NoJetStream {
        /// The server.
        url: String,
        /// What it said.
        reason: String,
    },

    /// The server refused the connection for good (credentials, TLS).
    #[error("NATS at {url} refused the connection: {reason}")]
    Refused {
        /// The server.
        url: String,
        /// What it said.
        reason: String,
    },

    /// The stream exists with settings the consumer cannot work with (its
    /// subjects do not take the consumed subject, it does not acknowledge
    /// publishes, or its limits delete messages the consumer has not
    /// acknowledged: `max_msgs`, `max_bytes` or `max_msgs_per_subject` with
    /// discard=old).
    #[error("the stream {stream:?} cannot be consumed as configured: {reason}")]
    StreamConflict {
        /// The stream.
        stream: String,
        /// What conflicts.
        reason: String,
    },

    /// The durable consumer exists with settings the runtime cannot work
    /// with (push delivery, another filter, no explicit acks, a
    /// `MaxDeliver` that would drop messages before they are dead-lettered,
    /// an ack wait shorter than the consumer's, a deliver policy that skips
    /// what the stream held).
    #[error("the JetStream consumer {consumer:?} on {stream:?} conflicts: {reason}")]
    ConsumerConflict {
        /// The stream.
        stream: String,
        /// The durable consumer.
        consumer: String,
        /// What conflicts.
        reason: String,
    },

    /// JetStream did not answer in time, or said it is briefly unavailable
    /// (a leader election, a server restarting): the consumer asks again
    /// with backoff, at start as after a reconnect, until it answers.
    #[error("JetStream did not answer {action}: {reason}")]
    Unavailable {
        /// What was asked.
        action: String,
        /// What happened.
        reason: String,
    },

    /// A JetStream API call failed at start for another reason.
    #[error("JetStream refused {action}: {reason}")]
    Api {
        /// What was asked.
        action: String,
        /// What it said.
        reason: String,
    },
}

impl From<NatsError> for Error {
    fn from(e: NatsError) -> Self {
        Error::Other(Box::new(e))
    }
}
