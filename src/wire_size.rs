//! The frame of AMQP 0-9-1's wire format that idempo checks before it
//! sends: a message's properties travel in one frame. The AMQP adapter
//! measures lapin's own encoding against it (`amqp/fit.rs`); the outbox,
//! which knows no lapin, measures its messages' own (`outbox/wire_size.rs`).

/// RabbitMQ's default `frame_max` (128 KiB), also what a negotiated `0` (no
/// limit, which RabbitMQ never negotiates) reads as: a message's properties
/// and headers travel in one frame no larger than the connection's, and a
/// broker that receives a larger one closes the whole connection
/// (`FRAME_ERROR`).
pub(crate) const DEFAULT_FRAME_MAX: usize = 131_072;

/// A content header frame's bytes besides the properties: type, channel and
/// size (7), class and weight (4), body size (8), frame end (1).
pub(crate) const HEADER_FRAME_OVERHEAD: usize = 20;
