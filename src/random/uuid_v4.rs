//! Random (version 4) UUIDs: `Idempotency-Key`s of the retrying client,
//! dedup ids of the dedup publisher.

use super::bytes;
use crate::error::RandomnessUnavailable;

/// A random (version 4) UUID, lowercase and hyphenated.
pub(crate) fn uuid_v4() -> Result<String, RandomnessUnavailable> {
    Ok(uuid::Builder::from_random_bytes(bytes()?)
        .into_uuid()
        .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lowercase 8-4-4-4-12 hex, the RFC 4122 variant: the form ids have
    /// always been stored and compared in.
    fn assert_hyphenated(id: &str) {
        assert_eq!(id.len(), 36, "{id}");
        for (i, c) in id.char_indices() {
            if [8, 13, 18, 23].contains(&i) {
                assert_eq!(c, '-', "{id}");
            } else {
                assert!(matches!(c, '0'..='9' | 'a'..='f'), "{id}");
            }
        }
        assert!(matches!(&id[19..20], "8" | "9" | "a" | "b"), "{id}");
    }

    #[test]
    fn uuids_are_version_4_and_distinct() {
        let (a, b) = (uuid_v4().unwrap(), uuid_v4().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
        assert!(matches!(&a[19..20], "8" | "9" | "a" | "b"));
    }

    #[test]
    fn uuids_are_lowercase_and_hyphenated() {
        for _ in 0..100 {
            assert_hyphenated(&uuid_v4().unwrap());
        }
    }
}
