//! Random ids and tokens from the operating system's generator: the one
//! source for everything that must not collide across processes or be
//! guessed (seal keys, fencing and reservation tokens, UUIDs for
//! `Idempotency-Key`s and message ids).
//!
//! There is no fallback: a secret drawn from a weak generator is worse than
//! an error, so when the operating system gives no randomness the caller
//! fails with [`RandomnessUnavailable`].

/// The operating system gave no random bytes (`getrandom` failed): idempo
/// refuses to make keys, tokens or ids from a weaker source.
#[derive(Debug, thiserror::Error)]
#[error("the operating system gave no random bytes: {0}")]
pub struct RandomnessUnavailable(getrandom::Error);

/// `N` bytes from the OS generator.
pub(crate) fn bytes<const N: usize>() -> Result<[u8; N], RandomnessUnavailable> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(RandomnessUnavailable)?;
    Ok(bytes)
}

/// A random (version 4) UUID, lowercase and hyphenated.
#[cfg_attr(
    not(any(feature = "retry", all(feature = "amqp", feature = "window"))),
    allow(dead_code)
)]
pub(crate) fn uuid_v4() -> Result<String, RandomnessUnavailable> {
    Ok(uuid::Builder::from_random_bytes(bytes()?)
        .into_uuid()
        .to_string())
}

/// A time-ordered (version 7) UUID: Unix milliseconds, then random bits.
#[cfg_attr(not(feature = "outbox"), allow(dead_code))]
pub(crate) fn uuid_v7() -> Result<String, RandomnessUnavailable> {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    Ok(uuid::Builder::from_unix_timestamp_millis(millis, &bytes()?)
        .into_uuid()
        .to_string())
}

/// A positive random `i64`: fencing and reservation tokens.
#[cfg_attr(
    not(any(feature = "window", feature = "redis", feature = "testing", test)),
    allow(dead_code)
)]
pub(crate) fn token() -> Result<i64, RandomnessUnavailable> {
    Ok((u64::from_be_bytes(bytes::<8>()?) >> 1).max(1) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_version_4_and_distinct() {
        let (a, b) = (uuid_v4().unwrap(), uuid_v4().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
        assert!(matches!(&a[19..20], "8" | "9" | "a" | "b"));
    }

    #[test]
    fn v7_uuids_are_time_ordered() {
        let a = uuid_v7().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = uuid_v7().unwrap();
        assert!(a < b, "{a} then {b}");
        assert_eq!(&a[14..15], "7");
    }

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
    fn uuids_are_lowercase_and_hyphenated() {
        for _ in 0..100 {
            assert_hyphenated(&uuid_v4().unwrap());
            assert_hyphenated(&uuid_v7().unwrap());
        }
    }

    #[test]
    fn v7_uuids_start_with_the_unix_milliseconds() {
        let millis = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64
        };
        let before = millis();
        let id = uuid_v7().unwrap();
        let after = millis();
        let stamp = u64::from_str_radix(&id[..13].replace('-', ""), 16).unwrap();
        assert!(
            (before..=after).contains(&stamp),
            "{id}: {before}..={after}"
        );
    }

    #[test]
    fn tokens_are_positive() {
        assert!((0..1000).all(|_| token().unwrap() > 0));
    }
}
