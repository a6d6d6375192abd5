//! The JetStream transport (feature `nats`): the same handlers, extractors,
//! inbox and retry policy as on RabbitMQ ([`crate::amqp`]), on a NATS
//! JetStream stream, through the runtime's transport seam.
//!
//! A [`Consumer`] reads one stream (created when missing) through a durable
//! pull consumer named after the idempo consumer, so that competing
//! processes share its deliveries. Each delivery's id comes from its
//! `Nats-Msg-Id` header by default (the id JetStream deduplicates
//! publishes on), or from another
//! [`MessageIdSource`](crate::consumer::MessageIdSource); it is claimed in
//! the handler's transaction, and the message is acknowledged only after
//! the commit, with a confirmed ack (double ack).
//!
//! | What happens | On JetStream |
//! |---|---|
//! | processed, or a duplicate | `+ACK`, confirmed by the server |
//! | transient failure | `-NAK` with the [`RedeliveryPolicy`](crate::consumer::RedeliveryPolicy)'s delay; the attempt is JetStream's delivery count |
//! | last attempt failed, or poison | a row in the `dead_letters` table, then `+ACK` |
//! | the handler runs long | `+WPI` (in progress) every third of the ack wait |
//! | the process dies | JetStream redelivers after the ack wait; the claim decides |
//!
//! Dead letters go to the PostgreSQL table (JetStream has no dead-letter
//! stream): `idempo dlq list|show|replay` work on them as on RabbitMQ's.
//!
//! # Example
//! See [`Consumer`]; the `payments` example runs on NATS with
//! `PAYMENTS_TRANSPORT=nats`.

mod builder;
mod connect;
mod consumer;
#[cfg(feature = "ops")]
pub(crate) mod depth;
mod envelope;
mod error;
mod feed;
mod names;
mod options;
mod pipeline;
mod relay;
mod telemetry;
mod topology;
mod transport;

pub use envelope::JetStreamDelivery;
pub use error::NatsError;
/// The outbox relay to JetStream: the relay on [`Nats`].
pub type Relay = crate::relay::Relay<Nats>;
pub use transport::Nats;

/// A consumer of a JetStream stream: the runtime's consumer on [`Nats`].
pub type Consumer = crate::runtime::consumer::Consumer<Nats>;

/// Configures a JetStream [`Consumer`]: the runtime's builder on [`Nats`],
/// with the options of every transport and JetStream's own (`stream`,
/// `subject`, `ack_wait`, `duplicate_window`, `relay_stream`, ...).
///
/// # JetStream's defaults
/// - stream: the one named with
///   [`stream`](crate::consumer::ConsumerBuilder::stream), created (file
///   storage, limits retention, taking the subject) when missing;
/// - subject: the stream's name;
/// - the durable JetStream consumer: named after the idempo consumer;
/// - `ack_wait`: 30 s (a running handler's messages are kept with
///   in-progress acks every third of it);
/// - the duplicate window of the streams idempo creates: JetStream's (2 min).
pub type ConsumerBuilder<Mode = crate::runtime::mode::NoHandler> =
    crate::runtime::builder::ConsumerBuilder<Nats, Mode>;

pub use async_nats;
