//! Time-ordered (version 7) UUIDs: the outbox's message ids.

use super::bytes;
use crate::error::RandomnessUnavailable;

/// A time-ordered (version 7) UUID: Unix milliseconds, then random bits.
pub(crate) fn uuid_v7() -> Result<String, RandomnessUnavailable> {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    Ok(uuid::Builder::from_unix_timestamp_millis(millis, &bytes()?)
        .into_uuid()
        .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::check::assert_hyphenated;

    #[test]
    fn v7_uuids_are_time_ordered() {
        let a = uuid_v7().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = uuid_v7().unwrap();
        assert!(a < b, "{a} then {b}");
        assert_eq!(&a[14..15], "7");
    }

    #[test]
    fn uuids_are_lowercase_and_hyphenated() {
        for _ in 0..100 {
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
}
