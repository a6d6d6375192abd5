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
    use crate::random::check::assert_hyphenated;

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
