//! The `Idempotency-Key` request header: parsing and validation.

use std::fmt;

use http::{HeaderMap, HeaderName};

/// [`crate::headers::IDEMPOTENCY_KEY`], as a header name (lowercase, as `http` wants it).
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// `Idempotent-Replayed: true` marks a response that was replayed from the
/// store rather than produced by the handler.
pub(crate) const IDEMPOTENT_REPLAYED: HeaderName =
    HeaderName::from_static(IdempotencyKey::REPLAYED_HEADER);

// The syntax is shared with the retry client, which checks what it sends.
use crate::key::KeyError;

/// A validated `Idempotency-Key`: 1 to 255 characters of visible ASCII.
///
/// Two forms are accepted: a plain token (`Idempotency-Key: 8e03978e-40d5`)
/// and the structured-field string of the IETF draft
/// (`Idempotency-Key: "8e03978e-40d5"`, with `\"` and `\\` escapes). Both
/// name the same key: the quotes are not part of it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The response header that marks an answer replayed from the
    /// idempotency store (`Idempotent-Replayed: true`) rather than produced
    /// by the handler.
    pub const REPLAYED_HEADER: &'static str = "idempotent-replayed";

    /// Parses one header value.
    ///
    /// # Errors
    /// [`KeyError`] when the value is empty, too long, badly quoted or holds
    /// a character outside visible ASCII.
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        crate::key::parse(value).map(IdempotencyKey)
    }

    /// The key of a request: `Ok(None)` when the header is absent.
    ///
    /// # Errors
    /// [`KeyError::Repeated`] when the header appears more than once, or the
    /// value's own error.
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(value.as_bytes()).map(Some)
    }

    /// The key, without quotes.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_quoted_forms_name_the_same_key() {
        let plain = IdempotencyKey::parse(b"abc-123").unwrap();
        assert_eq!(plain.as_str(), "abc-123");
        assert_eq!(IdempotencyKey::parse(b"\"abc-123\"").unwrap(), plain);
        assert_eq!(
            IdempotencyKey::parse(br#""a\"b\\c""#).unwrap().as_str(),
            r#"a"b\c"#
        );
    }

    #[test]
    fn rejects_bad_keys() {
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"\"\""), Err(KeyError::Empty));
        assert!(IdempotencyKey::parse(&[b'k'; 255]).is_ok());
        assert_eq!(
            IdempotencyKey::parse(&[b'k'; 256]),
            Err(KeyError::TooLong { len: 256 })
        );
        assert_eq!(
            IdempotencyKey::parse(b"a b"),
            Err(KeyError::InvalidCharacter { position: 1 })
        );
        assert_eq!(
            IdempotencyKey::parse("caf\u{e9}".as_bytes()),
            Err(KeyError::InvalidCharacter { position: 3 })
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"open"),
            Err(KeyError::Unterminated)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a\"b\""),
            Err(KeyError::Unterminated)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a\\nb\""),
            Err(KeyError::Unterminated)
        );
        // Control characters stay refused in a quoted key.
        assert_eq!(
            IdempotencyKey::parse(b"\"a\tb\""),
            Err(KeyError::InvalidCharacter { position: 1 })
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a\x7fb\""),
            Err(KeyError::InvalidCharacter { position: 1 })
        );
    }

    #[test]
    fn a_quoted_key_may_hold_spaces_as_rfc_8941_allows() {
        let key = IdempotencyKey::parse(b"\"order 42 \\\"x\\\"\"").unwrap();
        assert_eq!(key.as_str(), "order 42 \"x\"");
        assert_eq!(IdempotencyKey::parse(b"\" \"").unwrap().as_str(), " ");
    }

    #[test]
    fn one_header_only() {
        let mut headers = HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&headers), Ok(None));
        headers.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
        assert!(IdempotencyKey::from_headers(&headers).unwrap().is_some());
        headers.append(IDEMPOTENCY_KEY, "b".parse().unwrap());
        assert_eq!(
            IdempotencyKey::from_headers(&headers),
            Err(KeyError::Repeated)
        );
    }
}
