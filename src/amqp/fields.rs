//! AMQP field values as idempo reads and writes them: header values as
//! the runtime's [`HeaderRef`] and as text, idempo's own header values as
//! AMQP types, and AMQP tables as JSON.

use lapin::types::AMQPValue;

use crate::runtime::message::HeaderRef;
use crate::runtime::message::HeaderValue;

/// An AMQP value as the runtime reads a header: text or bytes, or any
/// integer type; anything else (booleans, tables, ...) holds no id, count or
/// time, and reads as absent.
pub(crate) fn header_ref(value: &AMQPValue) -> Option<HeaderRef<'_>> {
    Some(match value {
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
        _ => return None,
    })
}

/// One of idempo's header values as the AMQP type it has always had on the
/// wire (a copy's headers are read back by older builds too).
pub(crate) fn amqp_value(value: HeaderValue) -> AMQPValue {
    match value {
        HeaderValue::Text(text) => AMQPValue::LongString(text.into()),
        HeaderValue::Integer(n) => AMQPValue::LongLongInt(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_and_string_headers_become_ids() {
        assert_eq!(
            header_ref(&AMQPValue::LongLongInt(42))
                .and_then(HeaderRef::text)
                .as_deref(),
            Some("42")
        );
        assert_eq!(
            header_ref(&AMQPValue::LongString("pay-1".into()))
                .and_then(HeaderRef::text)
                .as_deref(),
            Some("pay-1")
        );
        assert_eq!(header_ref(&AMQPValue::Boolean(true)), None);
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
        assert_eq!(
            header_ref(&AMQPValue::ShortUInt(7)),
            Some(HeaderRef::Integer(7))
        );
        assert_eq!(
            header_ref(&AMQPValue::LongLongInt(-1)),
            Some(HeaderRef::Integer(-1))
        );
        assert_eq!(
            header_ref(&AMQPValue::LongString("3".into())),
            Some(HeaderRef::Bytes(b"3"))
        );
    }
}
