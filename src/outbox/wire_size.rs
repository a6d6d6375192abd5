//! The sizes of AMQP 0-9-1's wire format that the outbox checks at staging,
//! knowing no lapin: short strings, JSON headers as a field table, and
//! properties kept in idempo's encoding as AMQP's property list, all of
//! which travel in one frame ([`crate::wire_size`]).

use serde_json::{Map, Value};

/// The property flags that lead the encoded properties.
pub(crate) const PROPERTY_FLAGS: usize = 2;

/// AMQP short strings (exchange, routing key, header names, message id)
/// hold at most 255 bytes.
pub(crate) const MAX_SHORT_STRING: usize = 255;

/// The encoded size of an optional short string property.
pub(crate) fn short_string(value: Option<&str>) -> usize {
    value.map_or(0, |s| 1 + s.len())
}

/// The encoded size of JSON headers as an AMQP field table, mapped as the
/// relay maps them: null is void, numbers are 64-bit, strings are long
/// strings.
pub(crate) fn json_table(object: &Map<String, Value>) -> usize {
    4 + object
        .iter()
        .map(|(name, value)| 1 + name.len() + json_value(value))
        .sum::<usize>()
}

/// The encoded size of a JSON value as an AMQP field value, type byte
/// included.
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
#[cfg(feature = "amqp")]
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
#[cfg(feature = "amqp")]
fn table(entries: &[(String, crate::properties::Value)]) -> usize {
    4 + entries
        .iter()
        .map(|(name, value)| 1 + name.len() + field_value(value))
        .sum::<usize>()
}

/// The encoded size of one field value, type byte included.
#[cfg(feature = "amqp")]
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
