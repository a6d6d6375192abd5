//! A JetStream delivery as the runtime's [`Message`]: its headers, its
//! `Nats-Msg-Id` (the transport's own id) and, from its metadata, how many
//! times it was delivered before.

use async_nats::HeaderMap;

use crate::runtime::headers::ATTEMPTS_HEADER;
use crate::runtime::message::{Envelope, HeaderRef, Message};

/// The header JetStream deduplicates publishes on, and the id a
/// [`MessageIdSource::Property`](crate::consumer::MessageIdSource::Property)
/// reads on NATS.
pub(crate) const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// What the runtime reads of a JetStream delivery besides its body.
pub(crate) struct JetStreamEnvelope {
    headers: Option<HeaderMap>,
    /// Deliveries before this one, as JetStream counts them.
    previous: i128,
}

impl Envelope for JetStreamEnvelope {
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
    let envelope = JetStreamEnvelope { headers, previous };
    Message::incoming(body, envelope, "", subject, previous > 0, stream_sequence)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::headers::Failures;

    #[test]
    fn the_id_is_the_msg_id_header_and_attempts_the_delivery_count() {
        let mut headers = HeaderMap::new();
        headers.insert(MSG_ID_HEADER, "pay-1");
        headers.insert("x-tenant", "acme");
        let first = message("payments", b"{}".to_vec(), Some(headers.clone()), 1, 7);
        assert_eq!(first.transport_id(), Some("pay-1"));
        assert_eq!(first.header_text("x-tenant").as_deref(), Some("acme"));
        assert_eq!(Failures::previous_attempts(&first), 0);
        assert!(!first.redelivered());
        let third = message("payments", b"{}".to_vec(), Some(headers), 3, 7);
        assert_eq!(Failures::previous_attempts(&third), 2);
        assert!(third.redelivered());
        let bare = message("payments", Vec::new(), None, 1, 8);
        assert_eq!(bare.transport_id(), None);
        assert_eq!(bare.routing_key(), "payments");
    }
}
