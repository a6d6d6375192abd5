//! An outbox message as an AMQP publish: its properties, and its JSON
//! headers as an AMQP table; and the broker's size limit read from its
//! refusal.

use lapin::BasicProperties;
use lapin::protocol::basic::parse_properties;
use lapin::types::{AMQPValue, FieldArray, FieldTable};

use crate::amqp::publish::OutgoingFrame;
use crate::outbox::packed::Staged;

/// The broker's `max_message_size`, when it closed the channel over a
/// message larger than that ("message size 2097152 is larger than
/// configured max size 1048576").
pub(crate) fn broker_size_limit(reason: &str) -> Option<usize> {
    let (_, after) = reason.split_once("larger than configured max size ")?;
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// A message as a publish: its exact properties when it was staged with
/// them, else built from its columns.
pub(crate) fn frame(row: &Staged) -> OutgoingFrame<'_> {
    if let Some(properties) = exact(row) {
        return OutgoingFrame {
            exchange: &row.exchange,
            routing_key: &row.routing_key,
            body: &row.body,
            properties,
        };
    }
    let mut properties = BasicProperties::default()
        .with_message_id(row.message_id.as_str().into())
        .with_delivery_mode(if row.persistent { 2 } else { 1 });
    if let Some(content_type) = &row.content_type {
        properties = properties.with_content_type(content_type.as_str().into());
    }
    if let Some(correlation_id) = &row.correlation_id {
        properties = properties.with_correlation_id(correlation_id.as_str().into());
    }
    if let Ok(serde_json::Value::Object(headers)) = serde_json::from_str(&row.headers)
        && !headers.is_empty()
    {
        properties = properties.with_headers(table(&headers));
    }
    OutgoingFrame {
        exchange: &row.exchange,
        routing_key: &row.routing_key,
        body: &row.body,
        properties,
    }
}

/// The exact properties a row was staged with, as AMQP's: from idempo's
/// encoding, or AMQP's own (rows staged before). `None` without them, or
/// for a damaged row (then published from its columns, with a warning).
fn exact(row: &Staged) -> Option<BasicProperties> {
    let decoded = match (&row.exact, &row.legacy) {
        (Some(exact), _) => crate::properties::Properties::decode(exact)
            .and_then(|p| crate::amqp::stored::from_stored(&p)),
        (None, Some(legacy)) => parse_properties(legacy.as_slice())
            .map(|(_, p)| p)
            .map_err(|e| e.to_string()),
        (None, None) => return None,
    };
    match decoded {
        Ok(properties) => Some(properties),
        Err(error) => {
            tracing::warn!(
                message_id = %row.message_id,
                %error,
                "outbox relay: the exact properties cannot be read; publishing from the columns"
            );
            None
        }
    }
}

/// JSON headers as an AMQP table.
fn table(object: &serde_json::Map<String, serde_json::Value>) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in object {
        table.insert(name.as_str().into(), amqp_value(value));
    }
    table
}

fn amqp_value(value: &serde_json::Value) -> AMQPValue {
    use serde_json::Value;
    match value {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or_default()),
        },
        Value::String(s) => AMQPValue::LongString(s.as_str().into()),
        Value::Array(items) => AMQPValue::FieldArray(FieldArray::from(
            items.iter().map(amqp_value).collect::<Vec<_>>(),
        )),
        Value::Object(object) => AMQPValue::FieldTable(table(object)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_broker_size_limit_is_read_from_its_reason() {
        let why =
            "PRECONDITION_FAILED - message size 2097152 is larger than configured max size 1048576";
        assert_eq!(broker_size_limit(why), Some(1_048_576));
        assert_eq!(broker_size_limit("NOT_FOUND - no exchange"), None);
    }

    /// Staging refuses what would not fit in a frame by its own count of the
    /// bytes: it must be the client's.
    #[test]
    fn staging_counts_the_header_frame_as_the_client_encodes_it() {
        use crate::amqp::fit::header_frame_len as header_frame_size;
        use crate::outbox::OutboxMessage;
        let staged = |m: &OutboxMessage| Staged {
            exchange: m.exchange.clone(),
            routing_key: m.routing_key.clone(),
            message_id: m.message_id.clone().unwrap(),
            content_type: m.content_type.clone(),
            correlation_id: m.correlation_id.clone(),
            persistent: m.persistent,
            headers: m.headers_text(),
            body: m.body.clone(),
            exact: m.exact.as_ref().map(crate::properties::Properties::encode),
            legacy: None,
            transport: "amqp".into(),
        };
        let bare = OutboxMessage::new("", "q", b"x".to_vec())
            .message_id("id-1")
            .transient();
        let full = OutboxMessage::new("ex", "rk", b"body".to_vec())
            .message_id("id-2")
            .content_type("application/json")
            .correlation_id("corr")
            .header("s", "x".repeat(300))
            .header("i", 3)
            .header("f", 1.5)
            .header("b", true)
            .header("n", serde_json::Value::Null)
            .header("a", serde_json::json!([1, "two", [3.5, null]]))
            .header("o", serde_json::json!({"k": {"v": "w"}, "e": {}}));
        let exact = OutboxMessage::new("", "q", b"x".to_vec())
            .amqp_properties(&every_property())
            .unwrap();
        for m in [bare, full, exact] {
            let sent = header_frame_size(&frame(&staged(&m)).properties);
            assert_eq!(m.header_frame_size(), sent, "{m:?}");
        }
    }

    /// Every basic property, and a header of every AMQP field type.
    fn every_property() -> BasicProperties {
        use lapin::types::{ByteArray, DecimalValue, LongString};
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
            ("text", AMQPValue::LongString(LongString::from("text"))),
            (
                "bytes",
                AMQPValue::ByteArray(ByteArray::from(vec![0u8, 159, 146, 150])),
            ),
            ("time", AMQPValue::Timestamp(1_700_000_000)),
            ("void", AMQPValue::Void),
            ("table", AMQPValue::FieldTable(nested)),
            (
                "array",
                AMQPValue::FieldArray(FieldArray::from(vec![
                    AMQPValue::DecimalValue(DecimalValue {
                        scale: 1,
                        value: 25,
                    }),
                    AMQPValue::LongString(LongString::from("two")),
                ])),
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

    /// Staged with exact properties, a message is published with exactly
    /// those, whatever JSON cannot say.
    #[test]
    fn exact_properties_are_published_as_staged() {
        use crate::outbox::OutboxMessage;
        let properties = every_property();
        let m = OutboxMessage::new("", "q", b"x".to_vec())
            .amqp_properties(&properties)
            .unwrap();
        assert_eq!(m.id(), Some("id-3"));
        let staged = m.to_staged();
        assert_eq!(frame(&staged).properties, properties);
        // Through a packed row too.
        let packed =
            crate::outbox::packed::decode(&crate::outbox::packed::encode(&[m]), "amqp").unwrap();
        assert_eq!(frame(&packed[0]).properties, properties);
    }

    #[test]
    fn json_headers_become_amqp_values() {
        let headers =
            serde_json::json!({"s": "x", "i": 3, "b": true, "f": 1.5, "a": [1], "o": {"k": "v"}});
        let table = table(headers.as_object().unwrap());
        let inner = table.inner();
        assert_eq!(inner.get("i"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(inner.get("b"), Some(&AMQPValue::Boolean(true)));
        assert_eq!(inner.get("f"), Some(&AMQPValue::Double(1.5)));
        assert!(matches!(inner.get("s"), Some(AMQPValue::LongString(_))));
        assert!(matches!(inner.get("a"), Some(AMQPValue::FieldArray(_))));
        assert!(matches!(inner.get("o"), Some(AMQPValue::FieldTable(_))));
    }
}
