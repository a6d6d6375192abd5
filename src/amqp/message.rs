//! A delivery's AMQP side: the envelope the adapter puts in each
//! [`Message`] (its properties), and the AMQP accessors handlers use.

use std::sync::LazyLock;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use super::fields::header_ref;
use crate::runtime::message::{Envelope, HeaderRef, Message};

/// The AMQP properties of a delivery, as the runtime carries them.
pub(crate) struct Properties(pub(crate) BasicProperties);

impl Envelope for Properties {
    fn message_id(&self) -> Option<&str> {
        self.0.message_id().as_ref().map(|s| s.as_str())
    }

    fn header(&self, name: &str) -> Option<HeaderRef<'_>> {
        self.0.headers().as_ref()?.inner().get(name).map(header_ref)
    }
}

/// What a message that no AMQP broker delivered reports as its properties.
static NO_PROPERTIES: LazyLock<BasicProperties> = LazyLock::new(BasicProperties::default);

impl Message {
    /// A delivery as lapin hands it over, its id not yet extracted.
    pub(crate) fn from_delivery(delivery: lapin::message::Delivery) -> Self {
        Message::incoming(
            delivery.data,
            Properties(delivery.properties),
            delivery.exchange.as_str(),
            delivery.routing_key.as_str(),
            delivery.redelivered,
            delivery.delivery_tag,
        )
    }

    /// A delivery with these AMQP properties that did not come through
    /// lapin (the test harness's feed), its id not yet extracted.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) fn with_properties(
        body: Vec<u8>,
        properties: BasicProperties,
        exchange: &str,
        routing_key: &str,
        redelivered: bool,
        delivery_tag: u64,
    ) -> Self {
        let envelope = Properties(properties);
        Message::incoming(
            body,
            envelope,
            exchange,
            routing_key,
            redelivered,
            delivery_tag,
        )
    }

    /// This message as the broker would deliver it again: same body,
    /// properties and routing, a new delivery tag, the id not yet extracted.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) fn delivered_again(&self, redelivered: bool, delivery_tag: u64) -> Self {
        Message::with_properties(
            self.body().to_vec(),
            self.properties().clone(),
            self.exchange(),
            self.routing_key(),
            redelivered,
            delivery_tag,
        )
    }

    /// The AMQP properties (message id, content type, timestamp, ...).
    pub fn properties(&self) -> &BasicProperties {
        self.envelope::<Properties>()
            .map_or(&*NO_PROPERTIES, |p| &p.0)
    }

    /// The AMQP `message_id` property, if set.
    pub fn message_id_property(&self) -> Option<&str> {
        self.properties().message_id().as_ref().map(|s| s.as_str())
    }

    /// The application headers, if any.
    pub fn headers(&self) -> Option<&FieldTable> {
        self.properties().headers().as_ref()
    }

    /// One application header.
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.headers()?.inner().get(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_reads_amqp_headers_and_the_message_id_property() {
        let mut headers = FieldTable::default();
        headers.insert("n".into(), AMQPValue::ShortUInt(7));
        headers.insert("t".into(), AMQPValue::LongString("pay-1".into()));
        headers.insert("b".into(), AMQPValue::Boolean(true));
        let properties = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_headers(headers);
        let message = Message::with_properties(b"{}".to_vec(), properties, "", "q", false, 1);
        assert_eq!(message.transport_id(), Some("m-1"));
        assert_eq!(message.header_text("n").as_deref(), Some("7"));
        assert_eq!(message.header_text("t").as_deref(), Some("pay-1"));
        assert_eq!(message.header_ref("b"), Some(HeaderRef::Other));
        assert_eq!(message.header_text("missing"), None);
        // The AMQP accessors see the same properties.
        assert_eq!(message.message_id_property(), Some("m-1"));
        assert_eq!(message.header("n"), Some(&AMQPValue::ShortUInt(7)));
    }
}
