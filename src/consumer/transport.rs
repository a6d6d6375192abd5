//! The transport seam: what a broker adapter implements so that the
//! consumer, written once, runs on its broker.
//!
//! The runtime owns everything between a delivery and its settlement: the
//! builder and its checks, start-up (the schema, the database's TLS, the
//! partitioned inbox), the claim, the handler and the commit, the route of
//! each outcome, the dead-letter table, retention, heartbeats, health,
//! telemetry and shutdown. A transport does only what its broker decides:
//!
//! - **build**: check its own options ([`Transport::build`]);
//! - **receive**: connect, declare what it needs, and hand each session's
//!   deliveries to the runtime as a [`Feed`] ([`Transport::consume`],
//!   [`Deliveries::dispatch`]); reconnect when a session is lost;
//! - **settle**: carry out what the runtime decided for each delivery
//!   ([`retry_later`](Transport::retry_later), [`dead_letter`](Transport::dead_letter),
//!   [`letter_stored`](Transport::letter_stored), [`requeue`](Transport::requeue),
//!   [`reject`](Transport::reject), [`finish`](Transport::finish));
//! - the few facts only it knows: its name, the span of a unit, what keeps a
//!   long unit's deliveries (JetStream's in-progress acks), how long a
//!   redelivery may take to come back.
//!
//! RabbitMQ ([`crate::amqp::Amqp`]) republishes a copy to a delay queue or the
//! DLQ and acks; JetStream ([`crate::nats::Nats`]) NAKs with a delay or
//! acks after the dead-letter table took the letter; `idempo::testing`
//! records each decision as a value. The conformance kit
//! (`idempo::testing::conformance`) says what every transport must show.

pub use crate::runtime::message::HeaderValue;
pub use crate::runtime::transport::{
    Deliveries, Feed, FeedEnd, Finished, Later, Letter, Refused, Setup, Transport,
};
