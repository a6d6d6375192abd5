//! The sizes of AMQP 0-9-1's wire format that idempo checks before it
//! sends: the frame a message's properties travel in, short strings, and
//! JSON headers as a field table. The AMQP adapter measures lapin's own
//! encoding with these constants (`amqp/fit.rs`); the outbox, which knows
//! no lapin, measures JSON headers here.

#[cfg(feature = "outbox")]
use serde_json::{Map, Value};

/// RabbitMQ's default `frame_max` (128 KiB), also what a negotiated `0` (no
/// limit, which RabbitMQ never negotiates) reads as: a message's properties
/// and headers travel in one frame no larger than the connection's, and a
/// broker that receives a larger one closes the whole connection
/// (`FRAME_ERROR`).
pub(crate) const DEFAULT_FRAME_MAX: usize = 131_072;

/// A content header frame's bytes besides the properties: type, channel and
/// size (7), class and weight (4), body size (8), frame end (1).
pub(crate) const HEADER_FRAME_OVERHEAD: usize = 20;

/// The property flags that lead the encoded properties.
#[cfg(feature = "outbox")]
pub(crate) const PROPERTY_FLAGS: usize = 2;

/// AMQP short strings (exchange, routing key, header names, message id)
/// hold at most 255 bytes.
#[cfg(feature = "outbox")]
pub(crate) const MAX_SHORT_STRING: usize = 255;

/// The encoded size of an optional short string property.
#[cfg(feature = "outbox")]
pub(crate) fn short_string(value: Option<&str>) -> usize {
    value.map_or(0, |s| 1 + s.len())
}

/// The encoded size of JSON headers as an AMQP field table, mapped as the
/// relay maps them: null is void, numbers are 64-bit, strings are long
/// strings.
#[cfg(feature = "outbox")]
pub(crate) fn json_table(object: &Map<String, Value>) -> usize {
    4 + object
        .iter()
        .map(|(name, value)| 1 + name.len() + json_value(value))
        .sum::<usize>()
}

/// The encoded size of a JSON value as an AMQP field value, type byte
/// included.
#[cfg(feature = "outbox")]
fn json_value(value: &Value) -> usize {
    1 + match value {
        Value::Null => 0,
        Value::Bool(_) => 1,
        Value::Number(_) => 8,
        Value::String(s) => 4 + s.len(),
        Value::Array(items) => 4 + items.iter().map(json_value).sum::<usize>(),
        Value::Object(object) => json_table(object),
    }
}

/// The encoded size of properties kept in idempo's encoding as AMQP's
/// property list (flags included), the way the AMQP client writes them.
#[cfg(feature = "outbox")]
pub(crate) fn properties(p: &crate::properties::Properties) -> usize {
    use crate::properties::Value;
    let fields: usize = p
        .fields
        .iter()
        .map(|(_, value)| match value {
            Value::U8(_) => 1,
            Value::Timestamp(_) => 8,
            other => 1 + other.text().map_or(0, |t| t.len()),
        })
        .sum();
    PROPERTY_FLAGS + fields + p.headers.as_deref().map_or(0, table)
}

/// The encoded size of a field table of idempo's values.
#[cfg(feature = "outbox")]
fn table(entries: &[(String, crate::properties::Value)]) -> usize {
    4 + entries
        .iter()
        .map(|(name, value)| 1 + name.len() + field_value(value))
        .sum::<usize>()
}

/// The encoded size of one field value, type byte included.
#[cfg(feature = "outbox")]
fn field_value(value: &crate::properties::Value) -> usize {
    use crate::properties::Value;
    1 + match value {
        Value::Void => 0,
        Value::Bool(_) | Value::I8(_) | Value::U8(_) => 1,
        Value::I16(_) | Value::U16(_) => 2,
        Value::I32(_) | Value::U32(_) | Value::F32(_) => 4,
        Value::I64(_) | Value::F64(_) | Value::Timestamp(_) => 8,
        Value::Decimal { .. } => 5,
        Value::ShortText(s) => 1 + s.len(),
        Value::Text(b) | Value::Bytes(b) => 4 + b.len(),
        Value::Array(items) => 4 + items.iter().map(field_value).sum::<usize>(),
        Value::Table(entries) => table(entries),
    }
}
