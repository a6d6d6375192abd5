//! The delivery runtime: what happens to a message between its transport and
//! its settlement, whatever the broker.
//!
//! A delivery gets its id ([`message_id`]), is decoded ([`message`]),
//! claimed, handled and committed in one transaction ([`steps`], over the
//! [inbox](crate::inbox)), and its outcome ([`outcome`]) becomes a route
//! ([`route`]: acknowledge, redeliver later per the [`redelivery`] policy,
//! or dead-letter, into the table store or the transport's). Deliveries wait
//! at the [`database_gate`] while PostgreSQL is away. What the runtime counts
//! and reports lives in [`stats`], [`health`] and [`heartbeat`].
//!
//! Today this room still speaks AMQP's types (a [`Message`] carries lapin's
//! properties and field tables); the transport itself — connections,
//! sessions, topology, confirms, reconnects — lives in [`crate::amqp`].

pub(crate) mod copy;
pub(crate) mod database_gate;
pub(crate) mod dead_letter;
pub(crate) mod handler;
pub(crate) mod headers;
pub(crate) mod health;
pub mod heartbeat;
pub(crate) mod letters;
pub(crate) mod message;
pub(crate) mod message_id;
pub(crate) mod outcome;
pub(crate) mod redelivery;
pub(crate) mod retention;
pub(crate) mod route;
pub(crate) mod seal;
pub(crate) mod settle;
pub(crate) mod shutdown;
pub(crate) mod stats;
pub(crate) mod steps;
pub(crate) mod transport;
pub(crate) mod watched;
