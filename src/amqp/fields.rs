//! AMQP field values as idempo reads and writes them: header values as
//! the runtime's [`HeaderRef`] and as text, idempo's own header values as
//! AMQP types, and AMQP tables as JSON.

use lapin::types::{AMQPValue, FieldTable};

use crate::runtime::headers::HeaderValue;
use crate::runtime::message::HeaderRef;

/// An AMQP value as the runtime reads a header: text or bytes, any integer
/// type, or something else.
pub(crate) fn header_ref(value: &AMQPValue) -> HeaderRef<'_> {
    match value {
        AMQPValue::LongString(s) => HeaderRef::Bytes(s.as_bytes()),
        AMQPValue::ShortString(s) => HeaderRef::Bytes(s.as_str().as_bytes()),
        AMQPValue::ByteArray(b) => HeaderRef::Bytes(b.as_slice()),
        AMQPValue::ShortShortInt(n) => HeaderRef::Integer((*n).into()),
        AMQPValue::ShortShortUInt(n) => HeaderRef::Integer((*n).into()),
        AMQPValue::ShortInt(n) => HeaderRef::Integer((*n).into()),
        AMQPValue::ShortUInt(n) => HeaderRef::Integer((*n).into()),
        AMQPValue::LongInt(n) => HeaderRef::Integer((*n).into()),
        AMQPValue::LongUInt(n) => HeaderRef::Integer((*n).into()),
        AMQPValue::LongLongInt(n) => HeaderRef::Integer((*n).into()),
        _ => HeaderRef::Other,
    }
}

/// One of idempo's header values as the AMQP type it has always had on the
/// wire (a copy's headers are read back by older builds too).
pub(crate) fn amqp_value(value: HeaderValue) -> AMQPValue {
    match value {
        HeaderValue::Text(text) => AMQPValue::LongString(text.into()),
        HeaderValue::Integer(n) => AMQPValue::LongLongInt(n),
    }
}

/// An AMQP table as JSON, the inverse of the relay's mapping of staged JSON
/// headers (`relay/frame.rs`): the readable copy the outbox and the
/// dead-letter table keep beside exact properties, and how headers are
/// shown. Byte arrays and text that is not UTF-8 become lossy text;
/// timestamps and decimals numbers.
#[cfg(feature = "outbox")]
pub(crate) fn json_headers(table: &FieldTable) -> serde_json::Map<String, serde_json::Value> {
    table
        .inner()
        .iter()
        .map(|(name, value)| (name.to_string(), json_value(value)))
        .collect()
}

#[cfg(feature = "outbox")]
fn json_value(value: &AMQPValue) -> serde_json::Value {
    use serde_json::Value;
    match value {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(i) => Value::from(*i),
        AMQPValue::ShortShortUInt(i) => Value::from(*i),
        AMQPValue::ShortInt(i) => Value::from(*i),
        AMQPValue::ShortUInt(i) => Value::from(*i),
        AMQPValue::LongInt(i) => Value::from(*i),
        AMQPValue::LongUInt(i) => Value::from(*i),
        AMQPValue::LongLongInt(i) => Value::from(*i),
        AMQPValue::Timestamp(t) => Value::from(*t),
        AMQPValue::Float(f) => Value::from(f64::from(*f)),
        AMQPValue::Double(f) => Value::from(*f),
        AMQPValue::ShortString(s) => Value::String(s.to_string()),
        AMQPValue::LongString(s) => Value::String(String::from_utf8_lossy(s.as_bytes()).into()),
        AMQPValue::ByteArray(b) => Value::String(String::from_utf8_lossy(b.as_slice()).into()),
        AMQPValue::FieldArray(items) => {
            Value::Array(items.as_slice().iter().map(json_value).collect())
        }
        AMQPValue::FieldTable(table) => Value::Object(json_headers(table)),
        AMQPValue::DecimalValue(d) => {
            Value::from(f64::from(d.value) / 10f64.powi(i32::from(d.scale)))
        }
        AMQPValue::Void => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_and_string_headers_become_ids() {
        assert_eq!(
            header_ref(&AMQPValue::LongLongInt(42)).text().as_deref(),
            Some("42")
        );
        assert_eq!(
            header_ref(&AMQPValue::LongString("pay-1".into()))
                .text()
                .as_deref(),
            Some("pay-1")
        );
        assert_eq!(header_ref(&AMQPValue::Boolean(true)).text(), None);
    }

    #[test]
    fn idempos_values_keep_their_wire_types() {
        assert_eq!(
            amqp_value(HeaderValue::Integer(3)),
            AMQPValue::LongLongInt(3)
        );
        assert_eq!(
            amqp_value(HeaderValue::Text("x".into())),
            AMQPValue::LongString("x".into())
        );
    }

    #[test]
    fn attempt_counts_accept_any_integer_type() {
        assert_eq!(header_ref(&AMQPValue::ShortUInt(7)), HeaderRef::Integer(7));
        assert_eq!(
            header_ref(&AMQPValue::LongLongInt(-1)),
            HeaderRef::Integer(-1)
        );
        assert_eq!(
            header_ref(&AMQPValue::LongString("3".into())),
            HeaderRef::Bytes(b"3")
        );
    }
}
