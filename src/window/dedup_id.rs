//! [`DedupId`]: an SQS-style deduplication id, explicit or content-based.

use std::fmt;

use sha2::{Digest, Sha256};

/// The longest explicit id, as in SQS.
pub(crate) const MAX_DEDUP_ID_LEN: usize = 128;

/// A deduplication id: two messages with the same id within the window are
/// one message.
///
/// Either explicit ([`DedupId::new`]: 1 to 128 characters from SQS's set,
/// alphanumerics and ``!"#$%&'()*+,-./:;<=>?@[\]^_`{|}~``) or content-based
/// ([`DedupId::content`]: the SHA-256 of the body in hex; properties and
/// headers do not count, as in SQS).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct DedupId(String);

impl DedupId {
    /// An explicit id.
    ///
    /// # Errors
    /// [`InvalidDedupId`] when it is empty, longer than 128 characters or
    /// holds a character outside the allowed set (spaces included).
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidDedupId> {
        let id = id.into();
        if id.is_empty() {
            return Err(InvalidDedupId::Empty);
        }
        if let Some((position, character)) = id.char_indices().find(|(_, c)| !c.is_ascii_graphic())
        {
            return Err(InvalidDedupId::InvalidCharacter {
                position,
                character,
            });
        }
        // ASCII only from here on: bytes are characters.
        if id.len() > MAX_DEDUP_ID_LEN {
            return Err(InvalidDedupId::TooLong { len: id.len() });
        }
        Ok(DedupId(id))
    }

    /// The content-based id of `body`: its SHA-256 in lowercase hex.
    pub fn content(body: &[u8]) -> Self {
        DedupId(hex::encode(Sha256::digest(body)))
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for DedupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DedupId").field(&self.0).finish()
    }
}

impl fmt::Display for DedupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a deduplication id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidDedupId {
    /// The id is empty.
    #[error("the deduplication id is empty")]
    Empty,
    /// Longer than 128.
    #[error(
        "the deduplication id is {len} characters long; at most {MAX_DEDUP_ID_LEN} are allowed"
    )]
    TooLong {
        /// Its length.
        len: usize,
    },
    /// A character outside alphanumerics and ASCII punctuation.
    #[error(
        "the deduplication id has {character:?} at byte {position}; only alphanumerics and ASCII punctuation are allowed"
    )]
    InvalidCharacter {
        /// Byte position.
        position: usize,
        /// The character.
        character: char,
    },
}

/// Where an id counts: per queue (the default) or per message group in a
/// queue. The same id in two scopes names two messages.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope(String);

impl Scope {
    /// Ids count per queue (or, for a publisher, per exchange and routing key).
    pub fn queue(queue: &str) -> Self {
        Scope(format!("q{}:{queue}", queue.len()))
    }

    /// Ids count per message group within a queue.
    pub fn group(queue: &str, group: &str) -> Self {
        Scope(format!("g{}:{queue}{}:{group}", queue.len(), group.len()))
    }

    /// The store key of `id` in this scope. Lengths prefix the variable
    /// parts, so no queue or group name can forge another scope's key.
    pub fn key(&self, id: &DedupId) -> String {
        self.key_of(id.as_str())
    }

    /// The store key of any id (the consumer's message ids follow the inbox's
    /// rules, not SQS's).
    pub(crate) fn key_of(&self, id: &str) -> String {
        format!("{}:{id}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_ids_follow_sqs_rules() {
        assert!(DedupId::new("order-1:retry_2").is_ok());
        assert!(DedupId::new(r##"!"#$%&'()*+,-./:;<=>?@[\]^_`{|}~"##).is_ok());
        assert!(DedupId::new("a".repeat(128)).is_ok());
        assert_eq!(DedupId::new(""), Err(InvalidDedupId::Empty));
        assert_eq!(
            DedupId::new("a".repeat(129)),
            Err(InvalidDedupId::TooLong { len: 129 })
        );
        assert!(matches!(
            DedupId::new("has space"),
            Err(InvalidDedupId::InvalidCharacter {
                position: 3,
                character: ' '
            })
        ));
        assert!(matches!(
            DedupId::new("café"),
            Err(InvalidDedupId::InvalidCharacter {
                character: 'é', ..
            })
        ));
    }

    #[test]
    fn content_ids_match_equal_bodies_only() {
        assert_eq!(DedupId::content(b"{}"), DedupId::content(b"{}"));
        assert_ne!(DedupId::content(b"{}"), DedupId::content(b"{ }"));
        assert_eq!(DedupId::content(b"").as_str().len(), 64);
        assert!(DedupId::new(DedupId::content(b"x").as_str()).is_ok());
    }

    #[test]
    fn scopes_cannot_be_forged() {
        let id = DedupId::new("1").unwrap();
        assert_ne!(
            Scope::queue("a:b").key(&id),
            Scope::group("a", "b").key(&id)
        );
        assert_ne!(
            Scope::group("a:", "b").key(&id),
            Scope::group("a", ":b").key(&id)
        );
        assert_ne!(Scope::queue("q").key(&id), Scope::queue("r").key(&id));
    }
}
