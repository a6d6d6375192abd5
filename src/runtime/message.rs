//! What a handler receives: the raw [`Message`] and typed extractors such as [`JsonBody`].

use std::fmt;
use std::sync::Arc;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use serde::de::DeserializeOwned;

/// One delivery as the handler sees it: body, properties, headers and routing
/// data. Cheap to clone (the data is shared).
///
/// Its `Debug` output leaves the body out, so payloads never end up in logs.
#[derive(Clone)]
pub struct Message {
    inner: Arc<Inner>,
}

struct Inner {
    id: String,
    body: Vec<u8>,
    properties: BasicProperties,
    exchange: String,
    routing_key: String,
    redelivered: bool,
    delivery_tag: u64,
    received_at: std::time::Instant,
}

impl Message {
    pub(crate) fn from_delivery(delivery: lapin::message::Delivery) -> Self {
        Message {
            inner: Arc::new(Inner {
                id: String::new(),
                body: delivery.data,
                properties: delivery.properties,
                exchange: delivery.exchange.to_string(),
                routing_key: delivery.routing_key.to_string(),
                redelivered: delivery.redelivered,
                delivery_tag: delivery.delivery_tag,
                received_at: std::time::Instant::now(),
            }),
        }
    }

    /// A delivery that did not come through lapin (the test harness's
    /// feed), its id not yet extracted.
    #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
    pub(crate) fn incoming(
        body: Vec<u8>,
        properties: BasicProperties,
        exchange: &str,
        routing_key: &str,
        redelivered: bool,
        delivery_tag: u64,
    ) -> Self {
        Message {
            inner: Arc::new(Inner {
                id: String::new(),
                body,
                properties,
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
                redelivered,
                delivery_tag,
                received_at: std::time::Instant::now(),
            }),
        }
    }

    /// This message as the broker would deliver it again: same body,
    /// properties and routing, a new delivery tag, the id not yet extracted.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) fn delivered_again(&self, redelivered: bool, delivery_tag: u64) -> Self {
        Message::incoming(
            self.inner.body.clone(),
            self.inner.properties.clone(),
            &self.inner.exchange,
            &self.inner.routing_key,
            redelivered,
            delivery_tag,
        )
    }

    /// A message that no broker delivered, for the runtime's unit tests.
    #[cfg(test)]
    pub(crate) fn for_test(id: &str, body: &[u8]) -> Self {
        let mut message = Message::incoming(
            body.to_vec(),
            BasicProperties::default(),
            "",
            "test",
            false,
            1,
        );
        message.set_id(id.to_owned());
        message
    }

    /// A message with application headers, for the runtime's unit tests.
    #[cfg(test)]
    pub(crate) fn for_test_with_headers(body: &[u8], headers: FieldTable) -> Self {
        let mut message = Message::for_test("", body);
        Arc::get_mut(&mut message.inner)
            .expect("not shared yet")
            .properties = BasicProperties::default().with_headers(headers);
        message
    }

    /// Records the id the runtime deduplicates on; called before the message
    /// is shared with a handler.
    pub(crate) fn set_id(&mut self, id: String) {
        Arc::get_mut(&mut self.inner)
            .expect("the id is set before the message is shared")
            .id = id;
    }

    /// The id idempo deduplicated this message on (from the configured
    /// [`MessageIdSource`](crate::amqp::MessageIdSource)): use it as the
    /// identity of the business operation. Empty only before the runtime
    /// extracted it, so never inside a handler.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The raw body.
    pub fn body(&self) -> &[u8] {
        &self.inner.body
    }

    /// The AMQP properties (message id, content type, timestamp, ...).
    pub fn properties(&self) -> &BasicProperties {
        &self.inner.properties
    }

    /// The AMQP `message_id` property, if set.
    pub fn message_id_property(&self) -> Option<&str> {
        self.inner
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
    }

    /// The application headers, if any.
    pub fn headers(&self) -> Option<&FieldTable> {
        self.inner.properties.headers().as_ref()
    }

    /// One application header.
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.headers()?.inner().get(name)
    }

    /// The exchange the message was published to (empty for the default exchange).
    pub fn exchange(&self) -> &str {
        &self.inner.exchange
    }

    /// The routing key it was published with.
    pub fn routing_key(&self) -> &str {
        &self.inner.routing_key
    }

    /// Whether the broker flagged this as a redelivery. Informational only:
    /// idempo deduplicates on the message id, not on this flag.
    pub fn redelivered(&self) -> bool {
        self.inner.redelivered
    }

    /// The delivery tag on the consuming channel.
    pub fn delivery_tag(&self) -> u64 {
        self.inner.delivery_tag
    }

    /// When the runtime received the delivery from the broker: for latency
    /// metrics of the host's own (received → handled).
    pub fn received_at(&self) -> std::time::Instant {
        self.inner.received_at
    }

    /// Deserializes the body as JSON.
    ///
    /// # Errors
    /// [`DecodeError`] when the body is not valid JSON for `T`. Inside a
    /// handler, `msg.json::<T>()?` dead-letters such a message with reason
    /// `undecodable body`: the runtime recognizes a [`DecodeError`] whatever
    /// its [`ErrorKind`](crate::amqp::ErrorKind).
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, DecodeError> {
        serde_json::from_slice(self.body()).map_err(|e| DecodeError(e.to_string()))
    }
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("id", &self.id())
            .field("routing_key", &self.routing_key())
            .field("redelivered", &self.redelivered())
            .field("body_len", &self.body().len())
            .finish_non_exhaustive()
    }
}

/// A body that could not be turned into the handler's message type.
///
/// The runtime dead-letters such a delivery with reason `undecodable body`:
/// redelivering it cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("undecodable body: {0}")]
pub struct DecodeError(pub String);

/// Types a handler can take as its message argument.
///
/// Implemented for [`Message`] (everything, raw), [`JsonBody<T>`], and pairs of
/// them: `(JsonBody<Payment>, Message)` gives the typed body and the raw delivery
/// (its [`id`](Message::id), headers). Implement it for your own formats
/// (protobuf, ...). Decoding runs before any database work, so an undecodable
/// body is dead-lettered even while the database is down.
pub trait FromMessage: Sized + Send + 'static {
    /// Builds `Self` from the delivery.
    ///
    /// # Errors
    /// A [`DecodeError`] dead-letters the delivery without running the handler.
    fn from_message(message: Message) -> Result<Self, DecodeError>;
}

/// [`FromMessage::from_message`], with a panic turned into a [`DecodeError`]:
/// it would repeat on every redelivery, so the message is dead-lettered.
pub(crate) fn decode<M: FromMessage>(message: Message) -> Result<M, DecodeError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| M::from_message(message)))
        .unwrap_or_else(|_| Err(DecodeError("decoding panicked".into())))
}

impl FromMessage for Message {
    fn from_message(message: Message) -> Result<Self, DecodeError> {
        Ok(message)
    }
}

/// A JSON body, deserialized with serde. An undecodable body is dead-lettered.
/// (Named apart from `axum::Json`, so that a service using both imports both.)
///
/// A handler that needs the typed value *and* the headers takes [`Message`]
/// and calls [`Message::json`].
///
/// # Example
/// ```
/// use idempo::Tx;
/// use idempo::amqp::{HandlerError, JsonBody};
///
/// #[derive(serde::Deserialize)]
/// struct Payment { account: String, amount_cents: i64 }
///
/// async fn handle(tx: Tx, JsonBody(p): JsonBody<Payment>) -> Result<(), HandlerError> {
///     let mut tx = tx.try_lock()?;
///     sqlx::query("INSERT INTO payments (account, amount_cents) VALUES ($1, $2)")
///         .bind(&p.account)
///         .bind(p.amount_cents)
///         .execute(&mut *tx)
///         .await?;
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonBody<T>(pub T);

impl<T> JsonBody<T> {
    /// The decoded value.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T: DeserializeOwned + Send + 'static> FromMessage for JsonBody<T> {
    fn from_message(message: Message) -> Result<Self, DecodeError> {
        message.json().map(JsonBody)
    }
}

impl<A: FromMessage, B: FromMessage> FromMessage for (A, B) {
    fn from_message(message: Message) -> Result<Self, DecodeError> {
        Ok((A::from_message(message.clone())?, B::from_message(message)?))
    }
}
