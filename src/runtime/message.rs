//! What a handler receives: the raw [`Message`] and typed extractors such as [`JsonBody`].

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;

use crate::properties::{Properties, Value};

/// A header value idempo writes on a copy (its failure history); each
/// transport writes it in its own type (AMQP: a long string, a long-long
/// integer; JetStream: text).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderValue {
    /// Text.
    Text(String),
    /// A whole number (the attempts).
    Integer(i64),
}

/// A header value as the runtime reads it, whatever the transport's own
/// type (AMQP field values, JetStream's text headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeaderRef<'a> {
    /// Text or raw bytes (an AMQP long string holds bytes).
    Bytes(&'a [u8]),
    /// Any integer type.
    Integer(i128),
}

impl HeaderRef<'_> {
    /// The value as text: UTF-8 bytes, or an integer written out.
    pub(crate) fn text(self) -> Option<String> {
        match self {
            HeaderRef::Bytes(b) => String::from_utf8(b.to_vec()).ok(),
            HeaderRef::Integer(n) => Some(n.to_string()),
        }
    }
}

/// The transport's own part of a delivery (AMQP: its properties): what the
/// runtime reads through it, the transport reads whole by downcasting.
pub(crate) trait Envelope: Any + Send + Sync {
    /// The id the producer gave the message in the transport's own field
    /// (AMQP: the `message_id` property).
    fn message_id(&self) -> Option<&str>;

    /// One application header.
    fn header(&self, name: &str) -> Option<HeaderRef<'_>>;

    /// Every application header, in order, for a copy kept in another
    /// transport's terms (the dead-letter table keeps AMQP's encoding).
    /// The AMQP envelope is copied whole instead, and need not list them.
    fn headers(&self) -> Vec<(&str, HeaderRef<'_>)> {
        Vec::new()
    }

    /// The body's content type, when the transport carries one.
    fn content_type(&self) -> Option<&str> {
        None
    }

    /// The exchange it was published to, where the transport has exchanges
    /// (AMQP; the dead-letter table keeps it): empty by default.
    fn exchange(&self) -> &str {
        ""
    }

    /// The properties and headers of a copy kept at rest (a dead letter in
    /// the table), in idempo's encoding: by default the id, the content
    /// type and [`headers`](Envelope::headers).
    fn stored(&self) -> Properties {
        let text = |s: &str| Value::ShortText(s.to_owned());
        let fields = [
            ("message_id", self.message_id().map(text)),
            ("content_type", self.content_type().map(text)),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name.to_owned(), value?)))
        .collect();
        let headers = self
            .headers()
            .into_iter()
            .map(|(name, value)| {
                let value = match value {
                    HeaderRef::Bytes(bytes) => Value::Text(bytes.to_vec()),
                    HeaderRef::Integer(n) => match i64::try_from(n) {
                        Ok(n) => Value::I64(n),
                        Err(_) => Value::Text(n.to_string().into_bytes()),
                    },
                };
                (name.to_owned(), value)
            })
            .collect();
        Properties {
            fields,
            headers: Some(headers),
        }
    }
}

/// One delivery as the handler sees it, whatever the transport: its id,
/// body, headers, content type, attempt and whether it was redelivered. What
/// only one broker says sits behind an accessor named after it
/// ([`amqp`](Message::amqp): the AMQP properties, exchange and routing key;
/// [`jetstream`](Message::jetstream): the subject and stream sequence), which
/// is `None` on another transport. Cheap to clone (the data is shared).
///
/// Its `Debug` output leaves the body out, so payloads never end up in logs.
#[derive(Clone)]
pub struct Message {
    inner: Arc<Inner<dyn Envelope>>,
}

// The envelope is the last field so that one allocation holds it whatever
// its type (an `Arc<Inner<E>>` coerces to `Arc<Inner<dyn Envelope>>`).
struct Inner<E: ?Sized> {
    id: String,
    body: Vec<u8>,
    routing_key: String,
    redelivered: bool,
    delivery_tag: u64,
    received_at: std::time::Instant,
    envelope: E,
}

impl Message {
    /// A delivery as its transport hands it over, its id not yet extracted.
    pub(crate) fn incoming<E: Envelope>(
        body: Vec<u8>,
        envelope: E,
        routing_key: &str,
        redelivered: bool,
        delivery_tag: u64,
    ) -> Self {
        let inner: Arc<Inner<dyn Envelope>> = Arc::new(Inner {
            id: String::new(),
            body,
            routing_key: routing_key.to_owned(),
            redelivered,
            delivery_tag,
            received_at: std::time::Instant::now(),
            envelope,
        });
        Message { inner }
    }

    /// The exchange it was published to ([`Envelope::exchange`]).
    pub(crate) fn exchange(&self) -> &str {
        self.inner.envelope.exchange()
    }

    /// This message's properties and headers as a dead letter keeps them,
    /// `extra` (idempo's failure headers) set over its own.
    pub(crate) fn stored_properties(&self, extra: &[(&'static str, HeaderValue)]) -> Properties {
        let mut stored = self.inner.envelope.stored();
        for (name, value) in extra {
            let value = match value {
                HeaderValue::Text(text) => Value::Text(text.clone().into_bytes()),
                HeaderValue::Integer(n) => Value::I64(*n),
            };
            stored.set_header(name, value);
        }
        stored
    }

    /// The transport's envelope, when it is an `E`.
    pub(crate) fn envelope<E: Envelope>(&self) -> Option<&E> {
        let envelope: &dyn Any = &self.inner.envelope;
        envelope.downcast_ref()
    }

    /// A message that no broker delivered, for the runtime's unit tests.
    #[cfg(test)]
    pub(crate) fn for_test(id: &str, body: &[u8]) -> Self {
        let mut message = Message::for_test_with_headers(body, &[]);
        message.set_id(id.to_owned());
        message
    }

    /// [`for_test`](Self::for_test), delivered again by its broker.
    #[cfg(test)]
    pub(crate) fn for_test_redelivered(id: &str, body: &[u8]) -> Self {
        struct Bare;
        impl Envelope for Bare {
            fn message_id(&self) -> Option<&str> {
                None
            }
            fn header(&self, _: &str) -> Option<HeaderRef<'_>> {
                None
            }
        }
        let mut message = Message::incoming(body.to_vec(), Bare, "test", true, 2);
        message.set_id(id.to_owned());
        message
    }

    /// A message with text headers, its id not yet extracted, for the
    /// runtime's unit tests.
    #[cfg(test)]
    pub(crate) fn for_test_with_headers(body: &[u8], headers: &[(&str, &str)]) -> Self {
        struct Headers(Vec<(String, String)>);
        impl Envelope for Headers {
            fn message_id(&self) -> Option<&str> {
                None
            }
            fn header(&self, name: &str) -> Option<HeaderRef<'_>> {
                let (_, value) = self.0.iter().find(|(n, _)| n == name)?;
                Some(HeaderRef::Bytes(value.as_bytes()))
            }
        }
        let headers = headers
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect();
        Message::incoming(body.to_vec(), Headers(headers), "test", false, 1)
    }

    /// Records the id the runtime deduplicates on; called before the message
    /// is shared with a handler.
    pub(crate) fn set_id(&mut self, id: String) {
        Arc::get_mut(&mut self.inner)
            .expect("the id is set before the message is shared")
            .id = id;
    }

    /// The id idempo deduplicated this message on (from the configured
    /// [`MessageIdSource`](crate::consumer::MessageIdSource), or the sealed
    /// id an idempo copy carries): use it as the identity of the business
    /// operation. The same on every transport, and on the copies the test
    /// harness reports; empty only when the delivery had no usable id.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The raw body.
    pub fn body(&self) -> &[u8] {
        &self.inner.body
    }

    /// The id the producer set in the transport's own field (AMQP: the
    /// `message_id` property).
    pub(crate) fn transport_id(&self) -> Option<&str> {
        self.inner.envelope.message_id()
    }

    /// One header as the runtime reads it.
    pub(crate) fn header_ref(&self, name: &str) -> Option<HeaderRef<'_>> {
        self.inner.envelope.header(name)
    }

    /// One application header as text, whatever the transport: an AMQP
    /// string or integer header, a JetStream header. `None` when it is
    /// missing or not text (an AMQP table, bytes that are not UTF-8).
    pub fn header_text(&self, name: &str) -> Option<String> {
        self.header_ref(name)?.text()
    }

    /// The routing key (JetStream: the subject) it was delivered with.
    pub(crate) fn routing_key(&self) -> &str {
        &self.inner.routing_key
    }

    /// Whether the broker flagged this as a redelivery. Informational only:
    /// idempo deduplicates on the message id, not on this flag.
    pub fn redelivered(&self) -> bool {
        self.inner.redelivered
    }

    /// The transport's number for this delivery (AMQP: the delivery tag;
    /// JetStream: the stream sequence).
    pub(crate) fn delivery_tag(&self) -> u64 {
        self.inner.delivery_tag
    }

    /// The body's content type (AMQP: the `content_type` property;
    /// JetStream: the `Content-Type` header), if the producer set one.
    pub fn content_type(&self) -> Option<&str> {
        self.inner.envelope.content_type()
    }

    /// Which attempt this delivery is: 1 for a first delivery, `n + 1` after
    /// `n` failed attempts (idempo's `x-idempo-attempts` on a copy, or
    /// JetStream's delivery count).
    pub fn attempt(&self) -> u32 {
        self.failed_attempts().saturating_add(1)
    }

    /// The failed attempts before this delivery, as its copy's header says
    /// (JetStream: its delivery count): 0 for a first delivery.
    pub(crate) fn failed_attempts(&self) -> u32 {
        // Any integer type counts; text does not.
        match self.header_ref(crate::runtime::header_names::ATTEMPTS_HEADER) {
            Some(HeaderRef::Integer(n)) => u32::try_from(n).unwrap_or(0),
            _ => 0,
        }
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
    /// its [`ErrorKind`](crate::consumer::ErrorKind).
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
/// use idempo::consumer::{HandlerError, JsonBody};
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
