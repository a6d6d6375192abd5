//! Random ids and tokens from the operating system's generator: the one
//! source for everything that must not collide across processes (UUIDs for
//! `Idempotency-Key`s and message ids, fencing and reservation tokens).

/// `N` bytes from the OS generator. Should that ever fail (never seen on
/// supported targets), independent `fastrand` draws stand in rather than
/// failing the caller.
pub(crate) fn bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    if getrandom::fill(&mut bytes).is_err() {
        bytes.iter_mut().for_each(|b| *b = fastrand::u8(..));
    }
    bytes
}

/// A random (version 4) UUID in its hyphenated lowercase form: 122 random bits.
#[cfg_attr(
    not(any(feature = "retry", all(feature = "amqp", feature = "window"))),
    allow(dead_code)
)]
pub(crate) fn uuid_v4() -> String {
    uuid::Builder::from_random_bytes(bytes())
        .into_uuid()
        .to_string()
}

/// A time-ordered (version 7) UUID: 48 bits of Unix milliseconds, then 74
/// random bits. Ids staged later sort later, which keeps index inserts local.
#[cfg_attr(not(feature = "outbox"), allow(dead_code))]
pub(crate) fn uuid_v7() -> String {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    uuid::Builder::from_unix_timestamp_millis(millis, &bytes())
        .into_uuid()
        .to_string()
}

/// A random positive token (63 bits), for proving ownership of a lease.
// Used by the window stores, the Redis HTTP store and the test harness.
#[cfg_attr(
    not(any(feature = "window", feature = "redis", feature = "testing", test)),
    allow(dead_code)
)]
pub(crate) fn token() -> i64 {
    (u64::from_be_bytes(bytes::<8>()) >> 1).max(1) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_version_4_and_distinct() {
        let (a, b) = (uuid_v4(), uuid_v4());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
        assert!(matches!(&a[19..20], "8" | "9" | "a" | "b"));
    }

    #[test]
    fn v7_uuids_are_time_ordered() {
        let a = uuid_v7();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = uuid_v7();
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
            assert_hyphenated(&uuid_v4());
            assert_hyphenated(&uuid_v7());
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
        let id = uuid_v7();
        let after = millis();
        let stamp = u64::from_str_radix(&id[..13].replace('-', ""), 16).unwrap();
        assert!(
            (before..=after).contains(&stamp),
            "{id}: {before}..={after}"
        );
    }

    #[test]
    fn tokens_are_positive() {
        assert!((0..1000).all(|_| token() > 0));
    }
}
