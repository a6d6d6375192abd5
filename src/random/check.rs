//! What every UUID idempo draws looks like, for the random module's tests.

/// Lowercase 8-4-4-4-12 hex, the RFC 4122 variant: the form ids have always
/// been stored and compared in.
pub(super) fn assert_hyphenated(id: &str) {
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
