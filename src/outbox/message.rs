//! [`OutboxMessage`]: what a handler stages, with its properties.

use crate::headers::TRACEPARENT_HEADER;
use serde::Serialize;
use serde_json::{Map, Value};

use super::OutboxError;
#[cfg(feature = "testing")]
use super::packed::Staged;
use super::wire_size::{self, MAX_SHORT_STRING, PROPERTY_FLAGS};
use crate::message_id::validate_message_id;
#[cfg(feature = "amqp")]
use crate::properties::{Properties, Value as Typed};
use crate::wire_size::{DEFAULT_FRAME_MAX, HEADER_FRAME_OVERHEAD};

/// The largest body staged unless [`OutboxMessage::max_body_size`] says
/// otherwise: RabbitMQ 4's default `max_message_size` (16 MiB), the strictest
/// of its versions, so that an oversized body fails at staging, in the
/// handler, instead of at the relay.
pub(crate) const DEFAULT_MAX_BODY_SIZE: usize = 16 * 1024 * 1024;

/// Staging refuses properties that would not fit a frame of RabbitMQ's
/// default size.
pub(crate) const MAX_HEADER_FRAME: usize = DEFAULT_FRAME_MAX;

/// A message to publish once the staging transaction commits: exchange,
/// routing key, body and AMQP properties. Persistent by default; its
/// `message_id` is fixed at staging (yours, or a generated UUID v7), so every
/// resend of it carries the same id and an idempo consumer downstream
/// deduplicates it.
///
/// # Example
/// ```
/// use idempo::outbox::OutboxMessage;
///
/// #[derive(serde::Serialize)]
/// struct Receipt { account: String, amount_cents: i64 }
///
/// let incoming_id = "payment-42";
/// let message = OutboxMessage::json("", "receipts", &Receipt { account: "alice".into(), amount_cents: 250 })?
///     // Stable across redeliveries of the incoming message: derived from its id.
///     .derived_id(incoming_id, "receipt")
///     .header("x-tenant", "acme")
///     .ordering_key("alice");
/// let again = OutboxMessage::new("", "receipts", b"{}".to_vec()).derived_id("payment-42", "receipt");
/// assert_eq!(message.id(), again.id());
/// # Ok::<(), idempo::outbox::OutboxError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxMessage {
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) body: Vec<u8>,
    pub(crate) message_id: Option<String>,
    pub(crate) content_type: Option<String>,
    pub(crate) correlation_id: Option<String>,
    pub(crate) persistent: bool,
    pub(crate) headers: Map<String, Value>,
    pub(crate) ordering_key: Option<String>,
    pub(crate) max_body_size: usize,
    /// Exact properties and typed headers, published as they are (see
    /// `amqp_properties`; a replayed dead letter's): only the AMQP adapter
    /// and the operations' replay set them.
    #[cfg(feature = "amqp")]
    pub(crate) exact: Option<Properties>,
    /// The transport whose relay publishes it; `None`: the staging
    /// consumer's, or [`DEFAULT_TRANSPORT`] outside a consumer.
    pub(crate) transport: Option<String>,
}

/// The transport of a message staged outside a consumer without naming one,
/// and of every row staged before rows named theirs: RabbitMQ's, the first
/// transport (the migration's default too).
pub(crate) const DEFAULT_TRANSPORT: &str = "amqp";

impl OutboxMessage {
    /// A message with this body for `exchange` (`""`: the default exchange,
    /// where the routing key is a queue name) and `routing_key`.
    pub fn new(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        body: impl Into<Vec<u8>>,
    ) -> Self {
        OutboxMessage {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            body: body.into(),
            message_id: None,
            content_type: None,
            correlation_id: None,
            persistent: true,
            headers: Map::new(),
            ordering_key: None,
            max_body_size: DEFAULT_MAX_BODY_SIZE,
            #[cfg(feature = "amqp")]
            exact: None,
            transport: None,
        }
    }

    /// A message whose body is `value` as JSON, with content type
    /// `application/json`.
    ///
    /// # Errors
    /// [`OutboxError::Serialize`] when `value` cannot be serialised.
    pub fn json<T: Serialize + ?Sized>(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        value: &T,
    ) -> Result<Self, OutboxError> {
        let body = serde_json::to_vec(value).map_err(OutboxError::Serialize)?;
        Ok(Self::new(exchange, routing_key, body).content_type("application/json"))
    }

    /// The AMQP `message_id` (default: a UUID v7 generated at staging).
    pub fn message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// A message id derived from the id of the message being handled and a
    /// `purpose` that tells apart the messages one handler emits (`"receipt"`,
    /// `"audit"`): every redelivery of the incoming message, in any process,
    /// stages the same id, so a downstream consumer also deduplicates what
    /// two runs of a non-idempotent producer emitted. The id is UUID-shaped:
    /// 128 bits of SHA-256 of both inputs (version 8), the same in every
    /// process, different for different purposes.
    pub fn derived_id(self, incoming_id: &str, purpose: &str) -> Self {
        self.message_id(super::derived_message_id(incoming_id, purpose))
    }

    /// The AMQP `content_type` property.
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// The AMQP `correlation_id` property.
    pub fn correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }

    /// An AMQP header: a string, an integer, a float, a bool, or JSON arrays
    /// and objects of those (sent as AMQP arrays and tables).
    /// The properties and headers together must fit in one AMQP frame
    /// (128 KiB): staging refuses more with
    /// [`OutboxError::HeadersTooLarge`].
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The transport whose relay publishes the message: `"amqp"` (RabbitMQ;
    /// the routing key is a queue or binding key) or `"nats"` (JetStream;
    /// the routing key is the subject, the exchange must be empty), or the
    /// name of another transport. Each relay publishes only its own
    /// transport's messages, so services on different brokers can share one
    /// database.
    ///
    /// # Default
    /// Staged through a consumer handler's guard, the consumer's transport
    /// (a forward goes out on the broker the message came from); anywhere
    /// else, `"amqp"`.
    pub fn transport(mut self, transport: impl Into<String>) -> Self {
        self.transport = Some(transport.into());
        self
    }

    /// The transport named with [`transport`](Self::transport), if any.
    pub fn transport_value(&self) -> Option<&str> {
        self.transport.as_deref()
    }

    /// The id the outbox keeps for the row when exact properties publish
    /// none (a dead letter whose consumer read its id from a header).
    #[cfg(feature = "ops")]
    pub(crate) fn row_id(mut self, id: String) -> Self {
        self.message_id = Some(id);
        self
    }

    /// Exact properties and typed headers (a replayed dead letter's, or
    /// [`amqp_properties`](Self::amqp_properties)): the relay publishes
    /// them as they are. They replace what [`message_id`](Self::message_id),
    /// [`content_type`](Self::content_type), [`correlation_id`](Self::correlation_id),
    /// [`transient`](Self::transient) and [`header`](Self::header) set:
    /// the message's id is their `message_id`; without one, the outbox keeps
    /// a generated id for its row and publishes none.
    #[cfg(feature = "amqp")]
    pub(crate) fn with_exact(mut self, exact: Properties) -> Self {
        let field = |name: &str| exact.fields.iter().find(|(n, _)| n == name).map(|(_, v)| v);
        let text = |name: &str| field(name).and_then(Typed::text);
        self.message_id = text("message_id");
        self.content_type = text("content_type");
        self.correlation_id = text("correlation_id");
        self.persistent = field("delivery_mode") != Some(&Typed::U8(1));
        self.headers = exact.headers_json();
        self.exact = Some(exact);
        self
    }

    /// Messages with the same ordering key are published in the order their
    /// transactions committed, also across relay crashes and with several
    /// relays; messages without one carry no order promise. Staging a keyed
    /// message takes a transaction-long lock on the key, so transactions that
    /// stage the same key commit one after the other.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Not persistent (`delivery_mode` 1): the broker may lose it on restart.
    pub fn transient(mut self) -> Self {
        self.persistent = false;
        self
    }

    /// A W3C `traceparent` for the outgoing headers. Without it, staging
    /// takes the one of the message being handled (see
    /// [`with_traceparent`](super::with_traceparent)).
    pub fn traceparent(self, traceparent: impl Into<String>) -> Self {
        self.header(TRACEPARENT_HEADER, traceparent.into())
    }

    /// The largest body accepted at staging (default 16 MiB, RabbitMQ 4's
    /// default `max_message_size`); raise it to what your broker's
    /// `max_message_size` allows.
    pub fn max_body_size(mut self, bytes: usize) -> Self {
        self.max_body_size = bytes;
        self
    }

    /// The exchange.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The routing key.
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The message id, if one was set (otherwise it is generated at staging).
    pub fn id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    /// Whether the message is persistent.
    pub fn is_persistent(&self) -> bool {
        self.persistent
    }

    /// The content type, if set.
    pub fn content_type_value(&self) -> Option<&str> {
        self.content_type.as_deref()
    }

    /// The correlation id, if set.
    pub fn correlation_id_value(&self) -> Option<&str> {
        self.correlation_id.as_deref()
    }

    /// The application headers, as JSON values.
    pub fn headers(&self) -> &Map<String, Value> {
        &self.headers
    }

    /// The ordering key, if set: messages of one key are published in
    /// staging order.
    pub fn ordering_key_value(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// The body deserialized from JSON.
    ///
    /// # Errors
    /// [`OutboxError::Serialize`] when the body is not valid JSON for `T`.
    pub fn body_json<T: serde::de::DeserializeOwned>(&self) -> Result<T, OutboxError> {
        serde_json::from_slice(&self.body).map_err(OutboxError::Serialize)
    }

    /// A staged message as read back from the outbox table, with the
    /// ordering key of its row.
    #[cfg(feature = "testing")]
    pub(crate) fn from_staged(staged: Staged, ordering_key: Option<String>) -> Self {
        let headers = match serde_json::from_str(&staged.headers) {
            Ok(Value::Object(headers)) => headers,
            _ => Map::new(),
        };
        OutboxMessage {
            exchange: staged.exchange,
            routing_key: staged.routing_key,
            body: staged.body,
            message_id: Some(staged.message_id),
            content_type: staged.content_type,
            correlation_id: staged.correlation_id,
            persistent: staged.persistent,
            headers,
            ordering_key,
            max_body_size: DEFAULT_MAX_BODY_SIZE,
            exact: staged.exact.and_then(|e| Properties::decode(&e).ok()),
            transport: Some(staged.transport),
        }
    }

    /// The message as the relay publishes it (its id must be set).
    #[cfg(feature = "testing")]
    pub(crate) fn to_staged(&self) -> Staged {
        Staged {
            exchange: self.exchange.clone(),
            routing_key: self.routing_key.clone(),
            message_id: self.message_id.clone().unwrap_or_default(),
            content_type: self.content_type.clone(),
            correlation_id: self.correlation_id.clone(),
            persistent: self.persistent,
            headers: self.headers_text(),
            body: self.body.clone(),
            exact: self.exact_encoded(),
            legacy: None,
            transport: self.transport_or_default().to_owned(),
        }
    }

    /// Whether it carries exact properties.
    fn has_exact(&self) -> bool {
        #[cfg(feature = "amqp")]
        let exact = self.exact.is_some();
        #[cfg(not(feature = "amqp"))]
        let exact = false;
        exact
    }

    /// The exact properties in idempo's encoding, as the row keeps them.
    pub(crate) fn exact_encoded(&self) -> Option<Vec<u8>> {
        #[cfg(feature = "amqp")]
        let encoded = self.exact.as_ref().map(Properties::encode);
        #[cfg(not(feature = "amqp"))]
        let encoded = None;
        encoded
    }

    /// The transport the row is written for.
    pub(crate) fn transport_or_default(&self) -> &str {
        self.transport.as_deref().unwrap_or(DEFAULT_TRANSPORT)
    }

    /// The headers as JSON text (an object), as the outbox stores them
    /// (`jsonb` refuses `\u0000`: a NUL in the readable copy of exact
    /// properties becomes U+FFFD there; the properties keep it).
    pub(crate) fn headers_text(&self) -> String {
        let text = serde_json::to_string(&self.headers).expect("a JSON map serialises");
        if self.has_exact() {
            text.replace("\\u0000", "\\ufffd")
        } else {
            text
        }
    }

    /// The bytes of the AMQP content header frame the relay sends for this
    /// message: its properties and its headers as an AMQP table (the relay
    /// maps JSON as `amqp::relay`'s `frame` does; a test there checks that
    /// both agree).
    pub(crate) fn header_frame_size(&self) -> usize {
        #[cfg(feature = "amqp")]
        if let Some(exact) = &self.exact {
            return HEADER_FRAME_OVERHEAD + wire_size::properties(exact);
        }
        let short = wire_size::short_string;
        let headers = if self.headers.is_empty() {
            0
        } else {
            wire_size::json_table(&self.headers)
        };
        HEADER_FRAME_OVERHEAD
            + PROPERTY_FLAGS
            + short(self.content_type.as_deref())
            + headers
            + 1 // delivery mode
            + short(self.correlation_id.as_deref())
            + short(self.message_id.as_deref())
    }

    /// Everything a broker or PostgreSQL would refuse, as a clear error now.
    pub(crate) fn validate(&self) -> Result<(), OutboxError> {
        if self.body.len() > self.max_body_size {
            return Err(OutboxError::TooLarge {
                size: self.body.len(),
                limit: self.max_body_size,
            });
        }
        let header_frame = self.header_frame_size();
        if header_frame > MAX_HEADER_FRAME {
            return Err(OutboxError::HeadersTooLarge {
                size: header_frame,
                limit: MAX_HEADER_FRAME,
            });
        }
        if let Some(id) = &self.message_id {
            validate_message_id(id)?;
        }
        if let Some(transport) = &self.transport
            && (transport.is_empty()
                || !transport.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_'
                }))
        {
            return Err(OutboxError::InvalidField {
                field: "transport",
                reason: format!(
                    "{transport:?}: a transport's name is lowercase letters, digits, - and _ (\"amqp\", \"nats\")"
                ),
            });
        }
        short_string("exchange", &self.exchange)?;
        short_string("routing key", &self.routing_key)?;
        for (name, value) in &self.headers {
            short_string("header name", name)?;
            // Exact properties carry a NUL; only their readable copy loses it.
            if !self.has_exact() && holds_nul(value) {
                // The outbox stores headers as jsonb, which refuses \u0000.
                return Err(OutboxError::InvalidField {
                    field: "header value",
                    reason: format!("header {name:?} contains NUL"),
                });
            }
        }
        for (field, value) in [
            ("message id", self.message_id.as_deref()),
            ("content type", self.content_type.as_deref()),
            ("correlation id", self.correlation_id.as_deref()),
            ("ordering key", self.ordering_key.as_deref()),
            ("transport", self.transport.as_deref()),
        ] {
            if let Some(value) = value {
                short_string(field, value)?;
            }
        }
        Ok(())
    }
}

/// Whether a JSON value holds a NUL in any string or object key.
fn holds_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(holds_nul),
        Value::Object(object) => object
            .iter()
            .any(|(key, value)| key.contains('\0') || holds_nul(value)),
        _ => false,
    }
}

/// An AMQP short string, storable in a PostgreSQL `text` (no NUL).
fn short_string(field: &'static str, value: &str) -> Result<(), OutboxError> {
    if value.len() > MAX_SHORT_STRING {
        return Err(OutboxError::InvalidField {
            field,
            reason: format!("{} bytes, AMQP allows {MAX_SHORT_STRING}", value.len()),
        });
    }
    if value.contains('\0') {
        return Err(OutboxError::InvalidField {
            field,
            reason: "contains NUL".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_persistent_without_an_id() {
        let m = OutboxMessage::new("", "q", b"x".to_vec());
        assert!(m.is_persistent());
        assert_eq!(m.id(), None);
        assert!(m.validate().is_ok());
        assert!(!m.transient().is_persistent());
    }

    #[test]
    fn bad_fields_are_refused_with_their_name() {
        let big = OutboxMessage::new("", "q", vec![0; 11]).max_body_size(10);
        assert!(matches!(
            big.validate(),
            Err(OutboxError::TooLarge {
                size: 11,
                limit: 10
            })
        ));
        let long_key = OutboxMessage::new("", "q".repeat(256), b"x".to_vec());
        assert!(
            long_key
                .validate()
                .unwrap_err()
                .to_string()
                .contains("routing key")
        );
        let nul = OutboxMessage::new("", "q", b"x".to_vec()).ordering_key("a\0b");
        assert!(nul.validate().unwrap_err().to_string().contains("NUL"));
        // jsonb refuses \u0000 anywhere: a value, nested, or a nested key.
        for value in [
            serde_json::json!("a\0b"),
            serde_json::json!(["ok", {"k": "a\0"}]),
            serde_json::json!({"a\0": 1}),
        ] {
            let nul = OutboxMessage::new("", "q", b"x".to_vec()).header("x-nul", value);
            let refused = nul.validate().unwrap_err().to_string();
            assert!(refused.contains("header value"), "{refused}");
        }
        let fat = OutboxMessage::new("", "q", b"x".to_vec()).header("x-big", "h".repeat(200_000));
        assert!(matches!(
            fat.validate(),
            Err(OutboxError::HeadersTooLarge { limit: MAX_HEADER_FRAME, size }) if size > 200_000
        ));
        let empty_id = OutboxMessage::new("", "q", b"x".to_vec()).message_id("");
        assert!(matches!(
            empty_id.validate(),
            Err(OutboxError::InvalidMessageId(_))
        ));
    }
}
