//! Message ids: what a usable one is ([`validate_message_id`]) and why one
//! is refused ([`InvalidMessageId`]). Re-exported by [`inbox`](crate::inbox),
//! whose claims key on them.

/// The longest accepted message id, in bytes.
pub(crate) const MAX_MESSAGE_ID_LEN: usize = 255;

/// Why a message id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMessageId {
    /// The message carried no id where one was expected.
    #[error("missing message id")]
    Missing,
    /// The id is the empty string.
    #[error("empty message id")]
    Empty,
    /// The id is longer than 255 bytes.
    #[error("message id is {len} bytes long, the limit is {MAX_MESSAGE_ID_LEN}")]
    TooLong {
        /// The id's length in bytes.
        len: usize,
    },
    /// The id contains a NUL character, which PostgreSQL text cannot hold.
    #[error("message id contains a NUL character")]
    ContainsNul,
    /// A user function that derives the id panicked on this message.
    #[error("the message-id function panicked")]
    FunctionPanicked,
}

/// Checks that `id` is usable as a message id: 1 to 255
/// bytes, without NUL (which PostgreSQL text cannot hold).
///
/// # Errors
/// [`InvalidMessageId::Empty`], [`InvalidMessageId::TooLong`] or
/// [`InvalidMessageId::ContainsNul`].
pub(crate) fn validate_message_id(id: &str) -> Result<(), InvalidMessageId> {
    match id.len() {
        0 => Err(InvalidMessageId::Empty),
        len if len > MAX_MESSAGE_ID_LEN => Err(InvalidMessageId::TooLong { len }),
        _ if id.contains('\0') => Err(InvalidMessageId::ContainsNul),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_from_one_to_255_bytes_are_valid() {
        assert_eq!(validate_message_id("a"), Ok(()));
        assert_eq!(validate_message_id(&"x".repeat(255)), Ok(()));
    }

    #[test]
    fn empty_and_oversized_message_ids_are_refused() {
        assert_eq!(validate_message_id(""), Err(InvalidMessageId::Empty));
        assert_eq!(
            validate_message_id(&"x".repeat(256)),
            Err(InvalidMessageId::TooLong { len: 256 })
        );
        // The limit counts bytes, not characters: 128 two-byte characters are 256 bytes.
        assert_eq!(
            validate_message_id(&"é".repeat(128)),
            Err(InvalidMessageId::TooLong { len: 256 })
        );
        assert_eq!(
            validate_message_id("pay\0-1"),
            Err(InvalidMessageId::ContainsNul)
        );
    }
}
