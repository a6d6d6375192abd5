//! AMQP properties as idempo keeps them at rest ([`Properties`]) and back,
//! without loss: every basic property, every header with its field type.
//! A name or short text AMQP cannot carry (over 255 bytes: a JetStream
//! header) makes the way back an error, never a panic.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
#[cfg(feature = "outbox")]
use lapin::types::{ByteArray, DecimalValue, FieldArray, LongString};

use crate::properties::{Properties, Value};

/// `properties` as idempo keeps them.
pub(crate) fn to_stored(properties: &BasicProperties) -> Properties {
    let text =
        |v: &Option<ShortString>| v.as_ref().map(|s| Value::ShortText(s.as_str().to_owned()));
    let fields = [
        ("content_type", text(properties.content_type())),
        ("content_encoding", text(properties.content_encoding())),
        ("delivery_mode", properties.delivery_mode().map(Value::U8)),
        ("priority", properties.priority().map(Value::U8)),
        ("correlation_id", text(properties.correlation_id())),
        ("reply_to", text(properties.reply_to())),
        ("expiration", text(properties.expiration())),
        ("message_id", text(properties.message_id())),
        ("timestamp", properties.timestamp().map(Value::Timestamp)),
        ("type", text(properties.kind())),
        ("user_id", text(properties.user_id())),
        ("app_id", text(properties.app_id())),
        ("cluster_id", text(properties.cluster_id())),
    ]
    .into_iter()
    .filter_map(|(name, value)| Some((name.to_owned(), value?)))
    .collect();
    Properties {
        fields,
        headers: properties.headers().as_ref().map(table_entries),
    }
}

fn table_entries(table: &FieldTable) -> Vec<(String, Value)> {
    table
        .inner()
        .iter()
        .map(|(name, value)| (name.as_str().to_owned(), to_value(value)))
        .collect()
}

/// One AMQP field value as idempo keeps it.
pub(crate) fn to_value(value: &AMQPValue) -> Value {
    match value {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => Value::I8(*n),
        AMQPValue::ShortShortUInt(n) => Value::U8(*n),
        AMQPValue::ShortInt(n) => Value::I16(*n),
        AMQPValue::ShortUInt(n) => Value::U16(*n),
        AMQPValue::LongInt(n) => Value::I32(*n),
        AMQPValue::LongUInt(n) => Value::U32(*n),
        AMQPValue::LongLongInt(n) => Value::I64(*n),
        AMQPValue::Float(f) => Value::F32(*f),
        AMQPValue::Double(f) => Value::F64(*f),
        AMQPValue::DecimalValue(d) => Value::Decimal {
            scale: d.scale,
            value: d.value,
        },
        AMQPValue::ShortString(s) => Value::ShortText(s.as_str().to_owned()),
        AMQPValue::LongString(s) => Value::Text(s.as_bytes().to_vec()),
        AMQPValue::FieldArray(items) => {
            Value::Array(items.as_slice().iter().map(to_value).collect())
        }
        AMQPValue::Timestamp(t) => Value::Timestamp(*t),
        AMQPValue::FieldTable(table) => Value::Table(table_entries(table)),
        AMQPValue::ByteArray(bytes) => Value::Bytes(bytes.as_slice().to_vec()),
        AMQPValue::Void => Value::Void,
    }
}

#[cfg(feature = "outbox")]
fn short(what: &str, text: &str) -> Result<ShortString, String> {
    ShortString::try_new(text).map_err(|e| format!("{what} {text:.40?}…: {e}"))
}

/// One value as an AMQP field value.
#[cfg(feature = "outbox")]
pub(crate) fn from_value(value: &Value) -> Result<AMQPValue, String> {
    Ok(match value {
        Value::Void => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::I8(n) => AMQPValue::ShortShortInt(*n),
        Value::U8(n) => AMQPValue::ShortShortUInt(*n),
        Value::I16(n) => AMQPValue::ShortInt(*n),
        Value::U16(n) => AMQPValue::ShortUInt(*n),
        Value::I32(n) => AMQPValue::LongInt(*n),
        Value::U32(n) => AMQPValue::LongUInt(*n),
        Value::I64(n) => AMQPValue::LongLongInt(*n),
        Value::F32(f) => AMQPValue::Float(*f),
        Value::F64(f) => AMQPValue::Double(*f),
        Value::Decimal { scale, value } => AMQPValue::DecimalValue(DecimalValue {
            scale: *scale,
            value: *value,
        }),
        Value::ShortText(s) => AMQPValue::ShortString(short("short string", s)?),
        Value::Text(b) => AMQPValue::LongString(LongString::from(b.clone())),
        Value::Timestamp(t) => AMQPValue::Timestamp(*t),
        Value::Bytes(b) => AMQPValue::ByteArray(ByteArray::from(b.clone())),
        Value::Array(items) => AMQPValue::FieldArray(FieldArray::from(
            items
                .iter()
                .map(from_value)
                .collect::<Result<Vec<_>, _>>()?,
        )),
        Value::Table(entries) => AMQPValue::FieldTable(from_entries(entries)?),
    })
}

#[cfg(feature = "outbox")]
fn from_entries(entries: &[(String, Value)]) -> Result<FieldTable, String> {
    let mut table = FieldTable::default();
    for (name, value) in entries {
        table.insert(short("header name", name)?, from_value(value)?);
    }
    Ok(table)
}

#[cfg(feature = "outbox")]
impl crate::outbox::OutboxMessage {
    /// Exact AMQP properties (feature `amqp`): the relay publishes these as
    /// they are, every basic property (`priority`, `reply_to`, `timestamp`,
    /// `type`, `app_id`, `content_encoding`, …) and every header with its
    /// AMQP field type (decimals, timestamps, byte arrays with NUL, nested
    /// tables, integers of each width), which [`header`](Self::header)'s
    /// JSON cannot express. They replace what [`message_id`](Self::message_id),
    /// [`content_type`](Self::content_type), [`correlation_id`](Self::correlation_id),
    /// [`transient`](Self::transient) and [`header`](Self::header) set (call
    /// it last): the message's id is their `message_id`; without one, the
    /// outbox keeps a generated id for its row and publishes none.
    ///
    /// ```
    /// use idempo::amqp::lapin::BasicProperties;
    /// use idempo::amqp::lapin::types::{AMQPValue, DecimalValue, FieldTable};
    /// use idempo::outbox::OutboxMessage;
    ///
    /// let mut headers = FieldTable::default();
    /// headers.insert("amount".into(), AMQPValue::DecimalValue(DecimalValue { scale: 2, value: 1234 }));
    /// let properties = BasicProperties::default()
    ///     .with_message_id("payment-42".into())
    ///     .with_priority(5)
    ///     .with_headers(headers);
    /// let message = OutboxMessage::new("", "payments", b"{}".to_vec()).amqp_properties(&properties)?;
    /// assert_eq!(message.id(), Some("payment-42"));
    /// # Ok::<(), idempo::outbox::OutboxError>(())
    /// ```
    ///
    /// # Errors
    /// None today: every AMQP property is kept; the `Result` stays for the
    /// checks of a later version.
    #[cfg_attr(docsrs, doc(cfg(feature = "outbox")))]
    pub fn amqp_properties(
        self,
        properties: &BasicProperties,
    ) -> Result<Self, crate::outbox::OutboxError> {
        Ok(self.with_exact(to_stored(properties)))
    }
}

/// The AMQP properties idempo kept; an error names what AMQP cannot carry.
#[cfg(feature = "outbox")]
pub(crate) fn from_stored(stored: &Properties) -> Result<BasicProperties, String> {
    let mut p = BasicProperties::default();
    for (name, value) in &stored.fields {
        let text = || match value {
            Value::ShortText(s) => short(name, s),
            other => other
                .text()
                .ok_or_else(|| format!("property {name} is not text"))
                .and_then(|s| short(name, &s)),
        };
        let octet = || match value {
            Value::U8(n) => Ok(*n),
            _ => Err(format!("property {name} is not an octet")),
        };
        p = match name.as_str() {
            "content_type" => p.with_content_type(text()?),
            "content_encoding" => p.with_content_encoding(text()?),
            "delivery_mode" => p.with_delivery_mode(octet()?),
            "priority" => p.with_priority(octet()?),
            "correlation_id" => p.with_correlation_id(text()?),
            "reply_to" => p.with_reply_to(text()?),
            "expiration" => p.with_expiration(text()?),
            "message_id" => p.with_message_id(text()?),
            "timestamp" => match value {
                Value::Timestamp(t) => p.with_timestamp(*t),
                _ => return Err("property timestamp is not a timestamp".into()),
            },
            "type" => p.with_type(text()?),
            "user_id" => p.with_user_id(text()?),
            "app_id" => p.with_app_id(text()?),
            "cluster_id" => p.with_cluster_id(text()?),
            // Another transport's field: AMQP has no place for it.
            _ => p,
        };
    }
    if let Some(headers) = &stored.headers {
        p = p.with_headers(from_entries(headers)?);
    }
    Ok(p)
}

#[cfg(all(test, feature = "outbox"))]
mod tests {
    use super::*;

    /// Every basic property, and a header of every AMQP field type.
    fn every_property() -> BasicProperties {
        let mut nested = FieldTable::default();
        nested.insert("deep".into(), AMQPValue::ShortShortInt(-1));
        let mut headers = FieldTable::default();
        for (name, value) in [
            ("bool", AMQPValue::Boolean(true)),
            ("i8", AMQPValue::ShortShortInt(-8)),
            ("u8", AMQPValue::ShortShortUInt(8)),
            ("i16", AMQPValue::ShortInt(-16)),
            ("u16", AMQPValue::ShortUInt(16)),
            ("i32", AMQPValue::LongInt(-32)),
            ("u32", AMQPValue::LongUInt(32)),
            ("i64", AMQPValue::LongLongInt(-64)),
            ("f32", AMQPValue::Float(1.5)),
            ("f64", AMQPValue::Double(2.25)),
            (
                "decimal",
                AMQPValue::DecimalValue(DecimalValue {
                    scale: 2,
                    value: 1234,
                }),
            ),
            ("short", AMQPValue::ShortString("short".into())),
            (
                "text",
                AMQPValue::LongString(vec![0u8, 159, 146, 150].into()),
            ),
            ("bytes", AMQPValue::ByteArray(vec![0u8, 1].into())),
            ("time", AMQPValue::Timestamp(1_700_000_000)),
            ("void", AMQPValue::Void),
            ("table", AMQPValue::FieldTable(nested)),
            (
                "array",
                AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString("two".into())])),
            ),
        ] {
            headers.insert(name.into(), value);
        }
        BasicProperties::default()
            .with_content_type("application/octet-stream".into())
            .with_content_encoding("gzip".into())
            .with_headers(headers)
            .with_delivery_mode(2)
            .with_priority(7)
            .with_correlation_id("corr".into())
            .with_reply_to("replies".into())
            .with_expiration("60000".into())
            .with_message_id("id-3".into())
            .with_timestamp(1_700_000_001)
            .with_type("payment".into())
            .with_user_id("guest".into())
            .with_app_id("shop".into())
            .with_cluster_id("c1".into())
    }

    #[test]
    fn every_property_and_header_type_comes_back_exactly() {
        for p in [
            every_property(),
            BasicProperties::default(),
            BasicProperties::default().with_headers(FieldTable::default()),
        ] {
            let stored = to_stored(&p);
            let back = Properties::decode(&stored.encode()).unwrap();
            assert_eq!(from_stored(&back).unwrap(), p);
        }
    }

    #[test]
    fn what_amqp_cannot_carry_is_an_error_not_a_panic() {
        let long = Properties {
            fields: Vec::new(),
            headers: Some(vec![("n".repeat(300), Value::Text(b"v".to_vec()))]),
        };
        assert!(from_stored(&long).unwrap_err().contains("header name"));
        let long_id = Properties {
            fields: vec![("message_id".into(), Value::Text(vec![b'i'; 300]))],
            headers: None,
        };
        assert!(from_stored(&long_id).is_err());
    }
}
