//! The `Idempotency-Key` syntax, one rule for both sides: the `http` layer
//! parses what arrives with it and the `retry` client checks what it sends,
//! so the client never sends a key that idempo's server would refuse (or read
//! differently, as it would a padded one whose blanks HTTP strips).
//!
//! A ground-floor module: it knows neither feature module; the crate
//! exports [`KeyError`], and the `http` layer the limit.

/// The longest key accepted, in characters.
pub(crate) const MAX_KEY_LEN: usize = 255;

/// Why an `Idempotency-Key` was refused: the `http` layer answers 400, the
/// `retry` client does not send the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The header is empty (or `""`).
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// Longer than 255 characters.
    #[error("the Idempotency-Key is {len} characters long; at most {MAX_KEY_LEN} are allowed")]
    TooLong {
        /// The key's length.
        len: usize,
    },
    /// A character outside visible ASCII (`!` to `~`), or, in a quoted key,
    /// outside printable ASCII (space to `~`).
    #[error("the Idempotency-Key has a character outside visible ASCII at position {position}")]
    InvalidCharacter {
        /// Zero-based position in the (unquoted) key.
        position: usize,
    },
    /// Opens a quoted string that does not close, or has a bad escape.
    #[error("the Idempotency-Key is not a well-formed quoted string")]
    Unterminated,
    /// The header was sent more than once.
    #[error("the Idempotency-Key header was sent more than once")]
    Repeated,
}

/// The key one header value names: 1 to [`MAX_KEY_LEN`] characters, as a
/// plain token of visible ASCII (`8e03978e-40d5`) or the structured-field
/// string of the IETF draft (`"8e03978e-40d5"`, `"order 42"`: printable ASCII,
/// spaces included, as RFC 8941 allows, with `\"` and `\\` escapes; the
/// quotes are not part of the key). Control characters are refused in both.
pub(crate) fn parse(value: &[u8]) -> Result<String, KeyError> {
    let (key, allowed): (Vec<u8>, fn(&u8) -> bool) = match value {
        [b'"', inner @ .., b'"'] => (unquote(inner)?, |b| (b' '..=b'~').contains(b)),
        [b'"', ..] => return Err(KeyError::Unterminated),
        // A plain token has no blanks: HTTP strips them at its ends.
        plain => (plain.to_vec(), u8::is_ascii_graphic),
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: key.len() });
    }
    if let Some(position) = key.iter().position(|b| !allowed(b)) {
        return Err(KeyError::InvalidCharacter { position });
    }
    // Printable ASCII is valid UTF-8.
    Ok(String::from_utf8(key).expect("checked ASCII"))
}

/// The content of a structured-field string (RFC 8941 §3.3.3): only `\"`
/// and `\\` are escapes; a bare `"` inside is malformed.
fn unquote(inner: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err(KeyError::Unterminated),
            },
            b'"' => return Err(KeyError::Unterminated),
            other => out.push(other),
        }
    }
    Ok(out)
}
