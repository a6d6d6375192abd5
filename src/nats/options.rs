//! [`NatsOptions`]: what only a JetStream consumer has (its stream, subject,
//! ack wait, the streams its relay creates), set through
//! `ConsumerBuilder<Nats, _>`'s methods (`builder.rs`).

use std::time::Duration;

/// A JetStream consumer's own options, set with the methods of
/// [`ConsumerBuilder<Nats, _>`](crate::nats::ConsumerBuilder).
///
/// (Their defaults: [`ConsumerBuilder`](super::ConsumerBuilder)'s docs.)
#[derive(Debug)]
pub struct NatsOptions {
    pub(crate) url: String,
    pub(crate) stream: Option<String>,
    pub(crate) subject: Option<String>,
    pub(crate) create_stream: bool,
    pub(crate) ack_wait: Duration,
    pub(crate) duplicate_window: Option<Duration>,
    pub(crate) relay_streams: Vec<String>,
}

impl NatsOptions {
    /// The defaults, for a consumer on the server at `url`.
    pub(crate) fn new(url: String) -> Self {
        NatsOptions {
            url,
            stream: None,
            subject: None,
            create_stream: true,
            ack_wait: Duration::from_secs(30),
            duplicate_window: None,
            relay_streams: Vec::new(),
        }
    }
}
