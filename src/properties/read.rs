//! Reading properties back (a relay publishing a row's exact properties, a
//! replay, the operators' views): their decoding, and a value as text.

use super::value::VERSION;
use super::{Properties, Value};

impl Properties {
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
}
