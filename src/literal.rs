//! Values written into SQL text as literals, for the statements idempo sends
//! together in one simple-query message: a consumer unit's deferred outbox
//! rows, with its `COMMIT` (see ARCHITECTURE.md, "The wire shape of one
//! delivery"). The simple-query protocol takes no parameters, so the values
//! travel in the text.
//!
//! Only validated values come here (message ids and the outbox's fields are
//! refused earlier when they hold a NUL, which no PostgreSQL text can). Text
//! is quoted by `postgres-protocol`'s `escape_literal`, libpq's
//! `PQescapeLiteral`: correct whichever way `standard_conforming_strings` is
//! set. Bytes travel as hex digits, which need no quoting rules at all.

use crate::error::{Error, Result};

/// `value` as a SQL string literal.
///
/// # Errors
/// [`Error::Config`] when `value` holds a NUL (the caller's `what`): no
/// PostgreSQL text can, and the query text would end there.
pub(crate) fn text(what: &str, value: &str) -> Result<String> {
    if value.contains('\0') {
        return Err(Error::Config(format!("{what} {value:?} contains a NUL")));
    }
    Ok(postgres_protocol::escape::escape_literal(value))
}

/// An optional text: its literal, or `NULL`.
pub(crate) fn optional_text(what: &str, value: Option<&str>) -> Result<String> {
    value.map_or_else(|| Ok("NULL".to_owned()), |v| text(what, v))
}

/// `value` as a `bytea` expression: `decode('<hex>', 'hex')`.
pub(crate) fn bytes(value: &[u8]) -> String {
    format!("decode('{}', 'hex')", hex::encode(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_and_backslashes_cannot_end_a_literal() {
        assert_eq!(text("id", "pay-1").unwrap(), "'pay-1'");
        assert_eq!(text("id", "it's").unwrap(), "'it''s'");
        // With a backslash, the E'' form: the same value whatever
        // standard_conforming_strings says.
        assert_eq!(text("id", r"a\'b").unwrap(), r" E'a\\''b'");
        assert_eq!(text("id", "$$x$$").unwrap(), "'$$x$$'");
        assert!(text("id", "a\0b").is_err());
    }

    #[test]
    fn bytes_travel_as_hex_digits() {
        assert_eq!(bytes(&[0x00, 0xab, 0x27]), "decode('00ab27', 'hex')");
        assert_eq!(optional_text("x", None).unwrap(), "NULL");
    }
}
