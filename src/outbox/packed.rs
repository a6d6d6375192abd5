//! Several messages in one `outbox` row: what `stage_all` writes for a batch
//! without ordering keys (one heap tuple, one index entry and compressed
//! storage instead of one row each), and what the relay reads back.

use super::OutboxMessage;

/// The format's first byte, so that a later layout can tell itself apart:
/// 3 carries each message's exact properties in idempo's encoding; 2 (their
/// AMQP encoding) and 1 (none), rows staged before, are still read.
const VERSION: u8 = 3;

/// A message as the relay publishes it: from a row of its own or from a
/// packed row.
// The reading side is the relays' (and the test kit's).
#[cfg(idempo_runtime)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Staged {
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) message_id: String,
    pub(crate) content_type: Option<String>,
    pub(crate) correlation_id: Option<String>,
    pub(crate) persistent: bool,
    /// The headers as JSON text (an object).
    pub(crate) headers: String,
    pub(crate) body: Vec<u8>,
    /// The exact properties, in idempo's encoding, when staged with them.
    pub(crate) exact: Option<Vec<u8>>,
    /// Exact properties in AMQP's encoding, staged before idempo's
    /// encoding was (rows of migration 0010's `properties` column).
    pub(crate) legacy: Option<Vec<u8>>,
    /// The transport whose relay publishes it (a packed row's messages
    /// share the row's).
    pub(crate) transport: String,
}

/// Encodes validated messages (ids assigned): per message, length-prefixed
/// fields; `u32::MAX` marks an absent optional one.
pub(crate) fn encode(messages: &[OutboxMessage]) -> Vec<u8> {
    let size: usize = messages.iter().map(|m| m.body.len() + 128).sum();
    let mut out = Vec::with_capacity(size + 5);
    out.push(VERSION);
    out.extend_from_slice(&(messages.len() as u32).to_be_bytes());
    for m in messages {
        let headers = m.headers_text();
        let exact = m.exact_encoded();
        for field in [
            Some(m.exchange.as_bytes()),
            Some(m.routing_key.as_bytes()),
            m.message_id.as_deref().map(str::as_bytes),
            m.content_type.as_deref().map(str::as_bytes),
            m.correlation_id.as_deref().map(str::as_bytes),
            Some(headers.as_bytes()),
            Some(m.body.as_slice()),
            exact.as_deref(),
        ] {
            match field {
                Some(bytes) => {
                    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
                    out.extend_from_slice(bytes);
                }
                None => out.extend_from_slice(&u32::MAX.to_be_bytes()),
            }
        }
        out.push(u8::from(m.persistent));
    }
    out
}

/// Decodes what [`encode`] wrote.
#[cfg(idempo_runtime)]
pub(crate) fn decode(bytes: &[u8], transport: &str) -> Result<Vec<Staged>, String> {
    let mut input = Reader { bytes, at: 0 };
    let version = input.take(1)?[0];
    if !(1..=VERSION).contains(&version) {
        return Err("unknown packed-row format".into());
    }
    let count = input.u32()? as usize;
    let mut messages = Vec::with_capacity(count.min(100_000));
    for _ in 0..count {
        let text = |bytes: Vec<u8>| String::from_utf8(bytes).map_err(|e| e.to_string());
        let exchange = text(input.field()?.ok_or("missing exchange")?)?;
        let routing_key = text(input.field()?.ok_or("missing routing key")?)?;
        let message_id = text(input.field()?.ok_or("missing message id")?)?;
        let content_type = input.field()?.map(text).transpose()?;
        let correlation_id = input.field()?.map(text).transpose()?;
        let headers = text(input.field()?.ok_or("missing headers")?)?;
        let body = input.field()?.ok_or("missing body")?;
        let properties = if version >= 2 { input.field()? } else { None };
        let (exact, legacy) = if version >= 3 {
            (properties, None)
        } else {
            (None, properties)
        };
        let persistent = input.take(1)?[0] != 0;
        messages.push(Staged {
            exchange,
            routing_key,
            message_id,
            content_type,
            correlation_id,
            persistent,
            headers,
            body,
            exact,
            legacy,
            transport: transport.to_owned(),
        });
    }
    Ok(messages)
}

#[cfg(idempo_runtime)]
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

#[cfg(idempo_runtime)]
impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or("truncated packed row")?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn field(&mut self) -> Result<Option<Vec<u8>>, String> {
        match self.u32()? {
            u32::MAX => Ok(None),
            n => Ok(Some(self.take(n as usize)?.to_vec())),
        }
    }
}

#[cfg(all(test, idempo_runtime))]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let messages = vec![
            OutboxMessage::new("x", "rk", b"one".to_vec())
                .message_id("1")
                .header("h", 5),
            OutboxMessage::new("", "q", Vec::new())
                .message_id("2")
                .content_type("application/json")
                .correlation_id("c")
                .transient(),
        ];
        let decoded = decode(&encode(&messages), "amqp").unwrap();
        assert_eq!(decoded.len(), 2);
        assert_eq!(decoded[0].exchange, "x");
        assert_eq!(decoded[0].headers, r#"{"h":5}"#);
        assert_eq!(decoded[0].content_type, None);
        assert!(decoded[0].persistent);
        assert_eq!(decoded[1].body, b"");
        assert_eq!(decoded[1].correlation_id.as_deref(), Some("c"));
        assert!(!decoded[1].persistent);
    }

    #[test]
    fn truncated_input_is_an_error_not_a_panic() {
        let bytes = encode(&[OutboxMessage::new("", "q", b"x".to_vec()).message_id("1")]);
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n], "amqp").is_err());
        }
    }
}
