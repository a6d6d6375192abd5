//! A delivery's AMQP side: the envelope the adapter puts in each
//! [`Message`] ([`AmqpDelivery`]: its properties, exchange, routing key and
//! delivery tag), and [`Message::amqp`], the accessor that says it is
//! RabbitMQ's.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use super::fields::header_ref;
use crate::runtime::message::{Envelope, HeaderRef, Message};

/// What RabbitMQ said of a delivery beyond what every transport has: its
/// AMQP properties, the exchange and routing key it was published with, its
/// delivery tag. Read it with [`Message::amqp`].
#[derive(Debug)]
pub struct AmqpDelivery {
    properties: BasicProperties,
    exchange: String,
    routing_key: String,
    delivery_tag: u64,
}

impl AmqpDelivery {
    /// The AMQP properties (message id, content type, timestamp, headers, ...).
    pub fn properties(&self) -> &BasicProperties {
        &self.properties
    }

    /// The AMQP `message_id` property, if set.
    pub fn message_id(&self) -> Option<&str> {
        self.properties.message_id().as_ref().map(|s| s.as_str())
    }

    /// The application headers, if any, with their AMQP types.
    pub fn headers(&self) -> Option<&FieldTable> {
        self.properties.headers().as_ref()
    }

    /// One application header, with its AMQP type.
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.headers()?.inner().get(name)
    }

    /// The exchange the message was published to (empty for the default exchange).
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The routing key it was published with (a copy idempo republished
    /// carries the queue it went through; the original's is in
    /// `x-idempo-original-routing-key`).
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }

    /// The delivery tag on the consuming channel.
    pub fn delivery_tag(&self) -> u64 {
        self.delivery_tag
    }
}

impl Envelope for AmqpDelivery {
    fn message_id(&self) -> Option<&str> {
        AmqpDelivery::message_id(self)
    }

    fn header(&self, name: &str) -> Option<HeaderRef<'_>> {
        self.headers()?.inner().get(name).and_then(header_ref)
    }

    fn content_type(&self) -> Option<&str> {
        self.properties.content_type().as_ref().map(|s| s.as_str())
    }

    fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The AMQP copy of the delivery (see `copy.rs`), every property and
    /// header type kept.
    fn stored(&self) -> crate::properties::Properties {
        super::stored::to_stored(&super::copy::copied(&self.properties, []))
    }
}

impl Message {
    /// RabbitMQ's side of this delivery (its properties, exchange, routing
    /// key, delivery tag); `None` when another transport delivered it.
    pub fn amqp(&self) -> Option<&AmqpDelivery> {
        self.envelope::<AmqpDelivery>()
    }

    /// A delivery as lapin hands it over, its id not yet extracted.
    pub(crate) fn from_delivery(delivery: lapin::message::Delivery) -> Self {
        Message::with_properties(
            delivery.data,
            delivery.properties,
            delivery.exchange.as_str(),
            delivery.routing_key.as_str(),
            delivery.redelivered,
            delivery.delivery_tag,
        )
    }

    /// A delivery with these AMQP properties that did not come through
    /// lapin (the test harness's feed), its id not yet extracted.
    pub(crate) fn with_properties(
        body: Vec<u8>,
        properties: BasicProperties,
        exchange: &str,
        routing_key: &str,
        redelivered: bool,
        delivery_tag: u64,
    ) -> Self {
        let envelope = AmqpDelivery {
            properties,
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            delivery_tag,
        };
        Message::incoming(body, envelope, routing_key, redelivered, delivery_tag)
    }

    /// This message as the broker would deliver it again: same body,
    /// properties and routing, a new delivery tag, the id not yet extracted.
    #[cfg(feature = "testing")]
    pub(crate) fn delivered_again(&self, redelivered: bool, delivery_tag: u64) -> Self {
        let (properties, exchange) = match self.amqp() {
            Some(amqp) => (amqp.properties.clone(), amqp.exchange.as_str()),
            None => (BasicProperties::default(), ""),
        };
        Message::with_properties(
            self.body().to_vec(),
            properties,
            exchange,
            self.routing_key(),
            redelivered,
            delivery_tag,
        )
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
            .with_content_type("application/json".into())
            .with_headers(headers);
        let message = Message::with_properties(b"{}".to_vec(), properties, "x", "q", false, 1);
        assert_eq!(message.transport_id(), Some("m-1"));
        assert_eq!(message.header_text("n").as_deref(), Some("7"));
        assert_eq!(message.header_text("t").as_deref(), Some("pay-1"));
        // A boolean holds no id, count or time: it reads as absent.
        assert_eq!(message.header_ref("b"), None);
        assert_eq!(message.header_text("missing"), None);
        assert_eq!(message.content_type(), Some("application/json"));
        // RabbitMQ's side says so.
        let amqp = message.amqp().expect("an AMQP delivery");
        assert_eq!(amqp.message_id(), Some("m-1"));
        assert_eq!(amqp.header("n"), Some(&AMQPValue::ShortUInt(7)));
        assert_eq!((amqp.exchange(), amqp.routing_key()), ("x", "q"));
        assert_eq!(amqp.delivery_tag(), 1);
    }
}
