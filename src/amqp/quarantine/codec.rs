//! The AMQP 0-9-1 wire format as the quarantine reads and writes it: field
//! tables, the basic properties (raw bytes, so that invalid UTF-8 survives
//! the read and is mended on the way out).

use super::error::{QuarantineError, Result};

/// A message read with `basic.get`.
pub(super) struct Got {
    pub(super) delivery_tag: u64,
    pub(super) routing_key: Vec<u8>,
    pub(super) properties: Properties,
    pub(super) body: Vec<u8>,
}

/// The basic properties, as raw as the wire has them.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Properties {
    pub(super) content_type: Option<Vec<u8>>,
    pub(super) content_encoding: Option<Vec<u8>>,
    pub(super) headers: Option<Vec<(Vec<u8>, Value)>>,
    pub(super) delivery_mode: Option<u8>,
    pub(super) priority: Option<u8>,
    pub(super) correlation_id: Option<Vec<u8>>,
    pub(super) reply_to: Option<Vec<u8>>,
    pub(super) expiration: Option<Vec<u8>>,
    pub(super) message_id: Option<Vec<u8>>,
    pub(super) timestamp: Option<u64>,
    pub(super) kind: Option<Vec<u8>>,
    pub(super) user_id: Option<Vec<u8>>,
    pub(super) app_id: Option<Vec<u8>>,
    pub(super) cluster_id: Option<Vec<u8>>,
}

/// A field value: tables and arrays parsed (their names may need mending),
/// every other type kept as its type tag and raw bytes.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Value {
    Table(Vec<(Vec<u8>, Value)>),
    Array(Vec<Value>),
    Other(u8, Vec<u8>),
}

impl Value {
    pub(super) fn long_string(bytes: &[u8]) -> Value {
        let mut raw = (bytes.len() as u32).to_be_bytes().to_vec();
        raw.extend_from_slice(bytes);
        Value::Other(b'S', raw)
    }
}

impl Properties {
    /// What lapin would refuse: short strings (and names) that are not UTF-8.
    pub(super) fn problems(&self, routing_key: &[u8]) -> Vec<String> {
        let mut problems = Vec::new();
        let mut check = |what: &str, bytes: &Option<Vec<u8>>| {
            if let Some(bytes) = bytes
                && std::str::from_utf8(bytes).is_err()
            {
                problems.push(format!(
                    "{what} is not valid UTF-8 (hex {})",
                    hex::encode(bytes)
                ));
            }
        };
        check("the routing key", &Some(routing_key.to_vec()));
        check("content_type", &self.content_type);
        check("content_encoding", &self.content_encoding);
        check("correlation_id", &self.correlation_id);
        check("reply_to", &self.reply_to);
        check("expiration", &self.expiration);
        check("message_id", &self.message_id);
        check("type", &self.kind);
        check("user_id", &self.user_id);
        check("app_id", &self.app_id);
        check("cluster_id", &self.cluster_id);
        if let Some(headers) = &self.headers {
            table_problems(headers, &mut problems);
        }
        problems
    }
}

pub(super) fn table_problems(table: &[(Vec<u8>, Value)], problems: &mut Vec<String>) {
    for (name, value) in table {
        if std::str::from_utf8(name).is_err() {
            problems.push(format!(
                "a header name is not valid UTF-8 (hex {})",
                hex::encode(name)
            ));
        }
        value_problems(value, problems);
    }
}

pub(super) fn value_problems(value: &Value, problems: &mut Vec<String>) {
    match value {
        Value::Table(table) => table_problems(table, problems),
        Value::Array(values) => values.iter().for_each(|v| value_problems(v, problems)),
        Value::Other(..) => {}
    }
}

/// Reads the wire format.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.buf.len());
        let end = end.ok_or_else(|| QuarantineError::Protocol("a truncated frame".into()))?;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    pub(super) fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    pub(super) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    pub(super) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    pub(super) fn short_string(&mut self) -> Result<Vec<u8>> {
        let len = self.u8()?;
        Ok(self.take(len.into())?.to_vec())
    }

    pub(super) fn table(&mut self) -> Result<Vec<(Vec<u8>, Value)>> {
        let len = self.u32()? as usize;
        let mut inner = Reader::new(self.take(len)?);
        let mut table = Vec::new();
        while inner.pos < inner.buf.len() {
            let name = inner.short_string()?;
            table.push((name, inner.value()?));
        }
        Ok(table)
    }

    pub(super) fn value(&mut self) -> Result<Value> {
        let kind = self.u8()?;
        let fixed = |n: usize, r: &mut Self| Ok(Value::Other(kind, r.take(n)?.to_vec()));
        match kind {
            b't' | b'b' | b'B' => fixed(1, self),
            b's' | b'u' => fixed(2, self),
            b'I' | b'i' | b'f' => fixed(4, self),
            b'l' | b'L' | b'd' | b'T' => fixed(8, self),
            b'D' => fixed(5, self),
            b'V' => fixed(0, self),
            b'S' | b'x' => {
                let start = self.pos;
                let len = self.u32()? as usize;
                self.take(len)?;
                Ok(Value::Other(kind, self.buf[start..self.pos].to_vec()))
            }
            b'F' => Ok(Value::Table(self.table()?)),
            b'A' => {
                let len = self.u32()? as usize;
                let mut inner = Reader::new(self.take(len)?);
                let mut values = Vec::new();
                while inner.pos < inner.buf.len() {
                    values.push(inner.value()?);
                }
                Ok(Value::Array(values))
            }
            other => Err(QuarantineError::Protocol(format!(
                "unknown field type {:?}",
                other as char
            ))),
        }
    }

    pub(super) fn properties(&mut self) -> Result<Properties> {
        let flags = self.u16()?;
        let has = |bit: u16| flags & (1 << bit) != 0;
        let mut p = Properties::default();
        if has(15) {
            p.content_type = Some(self.short_string()?);
        }
        if has(14) {
            p.content_encoding = Some(self.short_string()?);
        }
        if has(13) {
            p.headers = Some(self.table()?);
        }
        if has(12) {
            p.delivery_mode = Some(self.u8()?);
        }
        if has(11) {
            p.priority = Some(self.u8()?);
        }
        if has(10) {
            p.correlation_id = Some(self.short_string()?);
        }
        if has(9) {
            p.reply_to = Some(self.short_string()?);
        }
        if has(8) {
            p.expiration = Some(self.short_string()?);
        }
        if has(7) {
            p.message_id = Some(self.short_string()?);
        }
        if has(6) {
            p.timestamp = Some(self.u64()?);
        }
        if has(5) {
            p.kind = Some(self.short_string()?);
        }
        if has(4) {
            p.user_id = Some(self.short_string()?);
        }
        if has(3) {
            p.app_id = Some(self.short_string()?);
        }
        if has(2) {
            p.cluster_id = Some(self.short_string()?);
        }
        Ok(p)
    }
}

/// Writes the wire format. Strings are made valid UTF-8 on the way out (the
/// point of the copy: whoever reads the DLQ can parse it).
#[derive(Default)]
pub(super) struct Writer {
    pub(super) buf: Vec<u8>,
}

impl Writer {
    pub(super) fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub(super) fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// A short string, mended to UTF-8 and cut to 255 bytes at a character boundary.
    pub(super) fn short_string(&mut self, bytes: &[u8]) -> &mut Self {
        let text = String::from_utf8_lossy(bytes);
        let mut end = text.len().min(255);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        self.u8(end as u8);
        self.buf.extend_from_slice(&text.as_bytes()[..end]);
        self
    }

    pub(super) fn long_string(&mut self, bytes: &[u8]) -> &mut Self {
        self.u32(bytes.len() as u32);
        self.buf.extend_from_slice(bytes);
        self
    }

    pub(super) fn table(&mut self, table: &[(Vec<u8>, Value)]) -> &mut Self {
        let mut inner = Writer::default();
        for (name, value) in table {
            inner.short_string(name);
            inner.value(value);
        }
        self.long_string(&inner.buf)
    }

    pub(super) fn value(&mut self, value: &Value) -> &mut Self {
        match value {
            Value::Table(table) => self.u8(b'F').table(table),
            Value::Array(values) => {
                let mut inner = Writer::default();
                values.iter().for_each(|v| {
                    inner.value(v);
                });
                self.u8(b'A').long_string(&inner.buf)
            }
            Value::Other(kind, raw) => {
                self.u8(*kind);
                self.buf.extend_from_slice(raw);
                self
            }
        }
    }

    pub(super) fn properties(&mut self, p: &Properties) -> &mut Self {
        let strings = [
            (15, &p.content_type),
            (14, &p.content_encoding),
            (10, &p.correlation_id),
            (9, &p.reply_to),
            (8, &p.expiration),
            (7, &p.message_id),
            (5, &p.kind),
            (4, &p.user_id),
            (3, &p.app_id),
            (2, &p.cluster_id),
        ];
        let mut flags = 0u16;
        for (bit, value) in strings {
            if value.is_some() {
                flags |= 1 << bit;
            }
        }
        for (bit, set) in [
            (13, p.headers.is_some()),
            (12, p.delivery_mode.is_some()),
            (11, p.priority.is_some()),
            (6, p.timestamp.is_some()),
        ] {
            if set {
                flags |= 1 << bit;
            }
        }
        self.u16(flags);
        let short = |w: &mut Self, v: &Option<Vec<u8>>| {
            if let Some(v) = v {
                w.short_string(v);
            }
        };
        short(self, &p.content_type);
        short(self, &p.content_encoding);
        if let Some(headers) = &p.headers {
            self.table(headers);
        }
        if let Some(v) = p.delivery_mode {
            self.u8(v);
        }
        if let Some(v) = p.priority {
            self.u8(v);
        }
        short(self, &p.correlation_id);
        short(self, &p.reply_to);
        short(self, &p.expiration);
        short(self, &p.message_id);
        if let Some(v) = p.timestamp {
            self.u64(v);
        }
        short(self, &p.kind);
        short(self, &p.user_id);
        short(self, &p.app_id);
        short(self, &p.cluster_id);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_round_trip_and_invalid_strings_are_mended() {
        let p = Properties {
            content_type: Some(b"application/json".to_vec()),
            headers: Some(vec![
                (b"ok".to_vec(), Value::long_string(b"v")),
                (
                    b"nested".to_vec(),
                    Value::Table(vec![(b"bad-\xff".to_vec(), Value::Other(b't', vec![1]))]),
                ),
                (
                    b"list".to_vec(),
                    Value::Array(vec![Value::Other(b'I', vec![0, 0, 0, 7])]),
                ),
            ]),
            delivery_mode: Some(2),
            message_id: Some(b"id-\xfe".to_vec()),
            timestamp: Some(42),
            ..Properties::default()
        };
        assert_eq!(
            p.problems(b"rk"),
            [
                "message_id is not valid UTF-8 (hex 69642dfe)",
                "a header name is not valid UTF-8 (hex 6261642dff)"
            ]
        );
        let mut w = Writer::default();
        w.properties(&p);
        let back = Reader::new(&w.buf).properties().unwrap();
        // Everything survives, with the invalid bytes replaced.
        assert_eq!(back.message_id.as_deref(), Some("id-\u{fffd}".as_bytes()));
        assert_eq!(back.timestamp, Some(42));
        assert_eq!(back.content_type, p.content_type);
        assert!(back.problems(b"rk").is_empty(), "the copy parses");
        let headers = back.headers.unwrap();
        assert_eq!(headers[0], p.headers.as_ref().unwrap()[0]);
        assert_eq!(headers[2], p.headers.as_ref().unwrap()[2]);
    }

    #[test]
    fn a_truncated_table_is_an_error_not_a_panic() {
        let mut r = Reader::new(&[0, 0, 0, 9, 3, b'a']);
        assert!(r.table().is_err());
    }
}
