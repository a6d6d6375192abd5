//! A message's properties and headers at rest (a dead letter, an outbox
//! row), in idempo's own encoding, whichever transport carried them: typed
//! values that hold every AMQP field type without loss (so a replay to
//! RabbitMQ keeps every byte) and JetStream's text headers alike (any name,
//! any length, repeated names in order). Each transport converts its own
//! types to and from [`Properties`]; nothing here knows a broker's client.
//!
//! The encoding: a version byte, then the fields and the headers as
//! length-prefixed lists of (name, value), each value a type byte and its
//! bytes. [`Properties::to_json`] is the readable copy kept beside it for
//! queries and operators.

use serde_json::{Map, Value as Json};

/// The format's first byte.
pub(crate) const VERSION: u8 = 1;

/// A typed value: AMQP's field types, which also hold JetStream's text.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Void,
    Bool(bool),
    I8(i8),
    U8(u8),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
    F64(f64),
    Decimal {
        scale: u8,
        value: u32,
    },
    /// AMQP's short string.
    ShortText(String),
    /// Text or bytes that need not be UTF-8 (AMQP's long string, a
    /// JetStream header value).
    Text(Vec<u8>),
    Timestamp(u64),
    Bytes(Vec<u8>),
    Array(Vec<Value>),
    Table(Vec<(String, Value)>),
}

/// A message's properties (named fields: `message_id`, `content_type`, and
/// AMQP's other basic properties) and application headers, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Properties {
    pub(crate) fields: Vec<(String, Value)>,
    /// `None`: the message had no header table (AMQP tells it from an
    /// empty one).
    pub(crate) headers: Option<Vec<(String, Value)>>,
}

impl Value {
    /// The value as JSON for people and queries: numbers (decimals and
    /// timestamps too), text (lossy when not UTF-8, bytes too), arrays and
    /// objects.
    pub(crate) fn to_json(&self) -> Json {
        match self {
            Value::Void => Json::Null,
            Value::Bool(b) => Json::Bool(*b),
            Value::I8(n) => (*n).into(),
            Value::U8(n) => (*n).into(),
            Value::I16(n) => (*n).into(),
            Value::U16(n) => (*n).into(),
            Value::I32(n) => (*n).into(),
            Value::U32(n) => (*n).into(),
            Value::I64(n) => (*n).into(),
            Value::Timestamp(n) => (*n).into(),
            Value::F32(f) => Json::from(f64::from(*f)),
            Value::F64(f) => Json::from(*f),
            Value::Decimal { scale, value } => {
                Json::from(f64::from(*value) / 10f64.powi(i32::from(*scale)))
            }
            Value::ShortText(s) => Json::String(s.clone()),
            Value::Text(b) | Value::Bytes(b) => {
                Json::String(String::from_utf8_lossy(b).into_owned())
            }
            Value::Array(items) => Json::Array(items.iter().map(Value::to_json).collect()),
            Value::Table(entries) => Json::Object(table_json(entries)),
        }
    }
}

fn table_json(entries: &[(String, Value)]) -> Map<String, Json> {
    entries
        .iter()
        .map(|(name, value)| (name.clone(), value.to_json()))
        .collect()
}

impl Properties {
    /// Sets header `name` (replacing every value it had).
    pub(crate) fn set_header(&mut self, name: &str, value: Value) {
        let headers = self.headers.get_or_insert_with(Vec::new);
        headers.retain(|(n, _)| n != name);
        headers.push((name.to_owned(), value));
    }

    /// The headers as a JSON object, for queries and operators.
    pub(crate) fn headers_json(&self) -> Map<String, Json> {
        self.headers.as_deref().map(table_json).unwrap_or_default()
    }

    /// idempo's encoding of the properties.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        put_entries(&mut out, &self.fields);
        match &self.headers {
            Some(headers) => {
                out.push(1);
                put_entries(&mut out, headers);
            }
            None => out.push(0),
        }
        out
    }
}

fn put_len(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_len(out, bytes.len());
    out.extend_from_slice(bytes);
}

fn put_entries(out: &mut Vec<u8>, entries: &[(String, Value)]) {
    put_len(out, entries.len());
    for (name, value) in entries {
        put_bytes(out, name.as_bytes());
        put_value(out, value);
    }
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Void => out.push(0),
        Value::Bool(b) => out.extend_from_slice(&[1, u8::from(*b)]),
        Value::I8(n) => {
            out.push(2);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Value::U8(n) => out.extend_from_slice(&[3, *n]),
        Value::I16(n) => {
            out.push(4);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Value::U16(n) => {
            out.push(5);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Value::I32(n) => {
            out.push(6);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Value::U32(n) => {
            out.push(7);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Value::I64(n) => {
            out.push(8);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Value::F32(f) => {
            out.push(9);
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        Value::F64(f) => {
            out.push(10);
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        Value::Decimal { scale, value } => {
            out.extend_from_slice(&[11, *scale]);
            out.extend_from_slice(&value.to_be_bytes());
        }
        Value::ShortText(s) => {
            out.push(12);
            put_bytes(out, s.as_bytes());
        }
        Value::Text(b) => {
            out.push(13);
            put_bytes(out, b);
        }
        Value::Timestamp(n) => {
            out.push(14);
            out.extend_from_slice(&n.to_be_bytes());
        }
        Value::Bytes(b) => {
            out.push(15);
            put_bytes(out, b);
        }
        Value::Array(items) => {
            out.push(16);
            put_len(out, items.len());
            for item in items {
                put_value(out, item);
            }
        }
        Value::Table(entries) => {
            out.push(17);
            put_entries(out, entries);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_read_as_json() {
        let nested = Value::Table(vec![("deep".into(), Value::I8(-1))]);
        let p = Properties {
            fields: Vec::new(),
            headers: Some(vec![
                ("u16".into(), Value::U16(16)),
                ("table".into(), nested),
            ]),
        };
        let json = p.headers_json();
        assert_eq!(json["u16"], serde_json::json!(16));
        assert_eq!(json["table"]["deep"], serde_json::json!(-1));
    }
}
