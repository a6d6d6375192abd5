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
//! This room names no broker: a [`Message`] carries its transport's part
//! as an envelope the runtime reads headers and the producer's id through,
//! and copies' headers are [`headers::HeaderValue`]s each transport writes in
//! its own types. The AMQP transport (connections, sessions, topology,
//! confirms, reconnects, the AMQP copy) lives in [`crate::amqp`].

pub(crate) mod builder;
pub(crate) mod consumer;
pub(crate) mod database_gate;
pub(crate) mod dead_letter;
pub(crate) mod dispatch;
pub(crate) mod fingerprint;
pub(crate) mod forwarding;
pub(crate) mod handler;
pub(crate) mod header_names;
pub(crate) mod headers;
pub(crate) mod health;
pub mod heartbeat;
pub(crate) mod letter_hold;
pub(crate) mod letter_table;
pub(crate) mod letters;
pub(crate) mod message;
pub(crate) mod message_id;
pub(crate) mod mode;
pub(crate) mod outcome;
pub(crate) mod redelivery;
#[cfg(feature = "outbox")]
pub(crate) mod relay_task;
pub(crate) mod retention;
pub(crate) mod route;
pub(crate) mod seal;
pub(crate) mod settle;
pub(crate) mod shutdown;
pub(crate) mod stats;
pub(crate) mod steps;
pub(crate) mod trace;
pub(crate) mod transport;
pub(crate) mod unit_tx;
pub(crate) mod units;
pub(crate) mod watched;
#[cfg(feature = "window")]
pub(crate) mod window_mode;
