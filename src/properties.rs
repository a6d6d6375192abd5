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
const VERSION: u8 = 1;

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
    /// The value as text: UTF-8 bytes, or an integer written out.
    pub(crate) fn text(&self) -> Option<String> {
        match self {
            Value::ShortText(s) => Some(s.clone()),
            Value::Text(b) => String::from_utf8(b.clone()).ok(),
            Value::I8(n) => Some(n.to_string()),
            Value::U8(n) => Some(n.to_string()),
            Value::I16(n) => Some(n.to_string()),
            Value::U16(n) => Some(n.to_string()),
            Value::I32(n) => Some(n.to_string()),
            Value::U32(n) => Some(n.to_string()),
            Value::I64(n) => Some(n.to_string()),
            _ => None,
        }
    }

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
    /// The field `name`.
    pub(crate) fn field(&self, name: &str) -> Option<&Value> {
        self.fields.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// The header `name` (the last, when a name repeats).
    pub(crate) fn header(&self, name: &str) -> Option<&Value> {
        self.headers
            .as_ref()?
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    }

    /// The header `name` as text ([`Value::text`]).
    pub(crate) fn header_text(&self, name: &str) -> Option<String> {
        self.header(name)?.text()
    }

    /// The `message_id` field as text.
    pub(crate) fn message_id(&self) -> Option<String> {
        self.field("message_id")?.text()
    }

    /// Sets header `name` (replacing every value it had).
    pub(crate) fn set_header(&mut self, name: &str, value: Value) {
        let headers = self.headers.get_or_insert_with(Vec::new);
        headers.retain(|(n, _)| n != name);
        headers.push((name.to_owned(), value));
    }

    /// Removes header `name`.
    pub(crate) fn remove_header(&mut self, name: &str) {
        if let Some(headers) = &mut self.headers {
            headers.retain(|(n, _)| n != name);
        }
    }

    /// The headers as a JSON object, for queries and operators.
    pub(crate) fn headers_json(&self) -> Map<String, Json> {
        self.headers.as_deref().map(table_json).unwrap_or_default()
    }

    /// The fields as a JSON object.
    pub(crate) fn fields_json(&self) -> Map<String, Json> {
        table_json(&self.fields)
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

    /// What [`encode`](Self::encode) wrote.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Properties, String> {
        let mut input = Reader { bytes, at: 0 };
        if input.u8()? != VERSION {
            return Err("unknown properties format".into());
        }
        let fields = input.entries(0)?;
        let headers = match input.u8()? {
            0 => None,
            _ => Some(input.entries(0)?),
        };
        if input.at != bytes.len() {
            return Err("trailing bytes after the properties".into());
        }
        Ok(Properties { fields, headers })
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

/// How deep arrays and tables may nest: a crafted row cannot exhaust the
/// stack.
const MAX_DEPTH: usize = 64;

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or("truncated properties")?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn len(&mut self) -> Result<usize, String> {
        Ok(u32::from_be_bytes(self.array()?) as usize)
    }

    fn bytes(&mut self) -> Result<Vec<u8>, String> {
        let n = self.len()?;
        Ok(self.take(n)?.to_vec())
    }

    fn text(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?).map_err(|e| e.to_string())
    }

    fn entries(&mut self, depth: usize) -> Result<Vec<(String, Value)>, String> {
        let n = self.len()?;
        let mut entries = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let name = self.text()?;
            entries.push((name, self.value(depth)?));
        }
        Ok(entries)
    }

    fn value(&mut self, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err("properties nested too deep".into());
        }
        Ok(match self.u8()? {
            0 => Value::Void,
            1 => Value::Bool(self.u8()? != 0),
            2 => Value::I8(i8::from_be_bytes(self.array()?)),
            3 => Value::U8(self.u8()?),
            4 => Value::I16(i16::from_be_bytes(self.array()?)),
            5 => Value::U16(u16::from_be_bytes(self.array()?)),
            6 => Value::I32(i32::from_be_bytes(self.array()?)),
            7 => Value::U32(u32::from_be_bytes(self.array()?)),
            8 => Value::I64(i64::from_be_bytes(self.array()?)),
            9 => Value::F32(f32::from_bits(u32::from_be_bytes(self.array()?))),
            10 => Value::F64(f64::from_bits(u64::from_be_bytes(self.array()?))),
            11 => {
                let scale = self.u8()?;
                Value::Decimal {
                    scale,
                    value: u32::from_be_bytes(self.array()?),
                }
            }
            12 => Value::ShortText(self.text()?),
            13 => Value::Text(self.bytes()?),
            14 => Value::Timestamp(u64::from_be_bytes(self.array()?)),
            15 => Value::Bytes(self.bytes()?),
            16 => {
                let n = self.len()?;
                let mut items = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    items.push(self.value(depth + 1)?);
                }
                Value::Array(items)
            }
            17 => Value::Table(self.entries(depth + 1)?),
            other => return Err(format!("unknown value type {other}")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_type() -> Properties {
        let nested = Value::Table(vec![("deep".into(), Value::I8(-1))]);
        Properties {
            fields: vec![
                ("message_id".into(), Value::ShortText("id-1".into())),
                ("priority".into(), Value::U8(7)),
                ("timestamp".into(), Value::Timestamp(1_700_000_000)),
            ],
            headers: Some(vec![
                ("void".into(), Value::Void),
                ("bool".into(), Value::Bool(true)),
                ("i8".into(), Value::I8(-8)),
                ("u8".into(), Value::U8(8)),
                ("i16".into(), Value::I16(-16)),
                ("u16".into(), Value::U16(16)),
                ("i32".into(), Value::I32(-32)),
                ("u32".into(), Value::U32(32)),
                ("i64".into(), Value::I64(-64)),
                ("f32".into(), Value::F32(1.5)),
                ("f64".into(), Value::F64(2.25)),
                (
                    "decimal".into(),
                    Value::Decimal {
                        scale: 2,
                        value: 1234,
                    },
                ),
                ("not utf-8".into(), Value::Text(vec![0, 159, 146, 150])),
                ("bytes".into(), Value::Bytes(vec![0, 1])),
                (
                    "array".into(),
                    Value::Array(vec![Value::I64(1), nested.clone()]),
                ),
                ("table".into(), nested),
                (
                    "x".repeat(300),
                    Value::Text(b"a name longer than AMQP's".to_vec()),
                ),
                ("repeated".into(), Value::Text(b"one".to_vec())),
                ("repeated".into(), Value::Text(b"two".to_vec())),
            ]),
        }
    }

    #[test]
    fn every_type_round_trips_exactly() {
        let p = every_type();
        assert_eq!(Properties::decode(&p.encode()).unwrap(), p);
        let bare = Properties::default();
        assert_eq!(Properties::decode(&bare.encode()).unwrap(), bare);
        let empty = Properties {
            fields: Vec::new(),
            headers: Some(Vec::new()),
        };
        assert_eq!(
            Properties::decode(&empty.encode()).unwrap(),
            empty,
            "an empty header table is not no table"
        );
    }

    #[test]
    fn damaged_input_is_an_error_not_a_panic() {
        let bytes = every_type().encode();
        for n in 0..bytes.len() {
            assert!(Properties::decode(&bytes[..n]).is_err(), "cut at {n}");
        }
        let mut deep = vec![VERSION, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, b'a'];
        deep.extend(std::iter::repeat_n([16u8, 0, 0, 0, 1], 100).flatten());
        assert!(Properties::decode(&deep).is_err(), "nesting is bounded");
    }

    #[test]
    fn headers_read_as_text_and_json() {
        let p = every_type();
        assert_eq!(p.header_text("repeated").as_deref(), Some("two"));
        assert_eq!(p.header_text("i64").as_deref(), Some("-64"));
        assert_eq!(p.header_text("bool"), None);
        assert_eq!(p.message_id().as_deref(), Some("id-1"));
        let json = p.headers_json();
        assert_eq!(json["u16"], serde_json::json!(16));
        assert_eq!(json["table"]["deep"], serde_json::json!(-1));
    }
}
