//! A list of broker URLs, one per node of a cluster, comma-separated as
//! `AMQP_URL` gives them: split in one place, so that every reader (the
//! consumer, the operations, the management API's address) agrees on it.

/// The URLs of `list`, trimmed, empty entries skipped.
pub(crate) fn split(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(str::trim).filter(|u| !u.is_empty())
}

/// The first URL of `list` (`""` when it names none).
#[cfg(feature = "ops")]
pub(crate) fn first(list: &str) -> &str {
    split(list).next().unwrap_or_default()
}

/// `list` with every password replaced, for messages and logs.
#[cfg(feature = "ops")]
pub(crate) fn redacted(list: &str) -> String {
    split(list)
        .map(crate::redact_url)
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(all(test, feature = "ops"))]
mod tests {
    use super::*;

    #[test]
    fn urls_are_split_trimmed_and_redacted() {
        let list = " amqp://u:secret@a:5672/%2f , ,amqp://b ";
        assert_eq!(
            split(list).collect::<Vec<_>>(),
            ["amqp://u:secret@a:5672/%2f", "amqp://b"]
        );
        assert_eq!(first(list), "amqp://u:secret@a:5672/%2f");
        assert!(!redacted(list).contains("secret"), "{}", redacted(list));
        assert_eq!(first(" , "), "");
    }
}
