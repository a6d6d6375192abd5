//! A JetStream delivery as the runtime's [`Message`]: its headers, its
//! `Nats-Msg-Id` (the transport's own id) and, from its metadata, how many
//! times it was delivered before; and [`Message::jetstream`], the accessor
//! that says it is JetStream's.

use async_nats::HeaderMap;

use crate::runtime::header_names::ATTEMPTS_HEADER;
use crate::runtime::message::{Envelope, HeaderRef, Message};

/// The header JetStream deduplicates publishes on, and the id a
/// [`MessageIdSource::Property`](crate::consumer::MessageIdSource::Property)
/// reads on NATS.
pub(crate) const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// What JetStream said of a delivery beyond what every transport has: its
/// subject, headers, stream sequence and delivery count. Read it with
/// [`Message::jetstream`].
#[derive(Debug)]
pub struct JetStreamDelivery {
    subject: String,
    headers: Option<HeaderMap>,
    /// Deliveries before this one, as JetStream counts them.
    previous: i128,
    stream_sequence: u64,
}

impl JetStreamDelivery {
    /// The subject it was published on.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Its NATS headers, as they arrived.
    pub fn headers(&self) -> Option<&HeaderMap> {
        self.headers.as_ref()
    }

    /// Its sequence number in the stream.
    pub fn stream_sequence(&self) -> u64 {
        self.stream_sequence
    }

    /// How many times JetStream delivered it, this time included.
    pub fn delivered(&self) -> i64 {
        i64::try_from(self.previous)
            .unwrap_or(i64::MAX)
            .saturating_add(1)
    }
}

impl Message {
    /// JetStream's side of this delivery (its subject, headers, stream
    /// sequence); `None` when another transport delivered it.
    pub fn jetstream(&self) -> Option<&JetStreamDelivery> {
        self.envelope::<JetStreamDelivery>()
    }
}

impl Envelope for JetStreamDelivery {
    fn message_id(&self) -> Option<&str> {
        Some(self.headers.as_ref()?.get(MSG_ID_HEADER)?.as_str())
    }

    fn header(&self, name: &str) -> Option<HeaderRef<'_>> {
        // A NAK redelivers the message unchanged: the attempts are the
        // broker's delivery count, not a header a copy would carry.
        if name == ATTEMPTS_HEADER {
            return (self.previous > 0).then_some(HeaderRef::Integer(self.previous));
        }
        let value = self.headers.as_ref()?.get(name)?;
        Some(HeaderRef::Bytes(value.as_str().as_bytes()))
    }

    fn content_type(&self) -> Option<&str> {
        Some(self.headers.as_ref()?.get("Content-Type")?.as_str())
    }

    fn headers(&self) -> Vec<(&str, HeaderRef<'_>)> {
        let Some(headers) = &self.headers else {
            return Vec::new();
        };
        let mut all: Vec<(&str, HeaderRef<'_>)> = headers
            .iter()
            .flat_map(|(name, values)| {
                // A repeated header keeps its last value, as `get` reads it.
                values
                    .last()
                    .map(|v| (name.as_ref(), HeaderRef::Bytes(v.as_str().as_bytes())))
            })
            .collect();
        // The map's order is random: sorted, a letter's headers are stable.
        all.sort_by(|a, b| a.0.cmp(b.0));
        all
    }
}

/// The runtime's message for a JetStream delivery: `subject` as its routing
/// key, `delivered` (JetStream's count, 1 for a first delivery) as its
/// attempts, the stream sequence as its delivery tag.
pub(crate) fn message(
    subject: &str,
    body: Vec<u8>,
    headers: Option<HeaderMap>,
    delivered: i64,
    stream_sequence: u64,
) -> Message {
    let previous = i128::from(delivered.saturating_sub(1).max(0));
    let envelope = JetStreamDelivery {
        subject: subject.to_owned(),
        headers,
        previous,
        stream_sequence,
    };
    Message::incoming(body, envelope, subject, previous > 0, stream_sequence)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_is_the_msg_id_header_and_attempts_the_delivery_count() {
        let mut headers = HeaderMap::new();
        headers.insert(MSG_ID_HEADER, "pay-1");
        headers.insert("x-tenant", "acme");
        let first = message("payments", b"{}".to_vec(), Some(headers.clone()), 1, 7);
        assert_eq!(first.transport_id(), Some("pay-1"));
        assert_eq!(first.header_text("x-tenant").as_deref(), Some("acme"));
        assert_eq!(first.failed_attempts(), 0);
        assert!(!first.redelivered());
        let third = message("payments", b"{}".to_vec(), Some(headers), 3, 7);
        assert_eq!(third.failed_attempts(), 2);
        assert_eq!(third.attempt(), 3);
        assert!(third.redelivered());
        let js = third.jetstream().expect("a JetStream delivery");
        assert_eq!(
            (js.subject(), js.stream_sequence(), js.delivered()),
            ("payments", 7, 3)
        );
        assert!(
            third.amqp().is_none(),
            "no AMQP side on a JetStream delivery"
        );
        let bare = message("payments", Vec::new(), None, 1, 8);
        assert_eq!(bare.transport_id(), None);
        assert_eq!(bare.jetstream().map(|js| js.subject()), Some("payments"));
    }
}
