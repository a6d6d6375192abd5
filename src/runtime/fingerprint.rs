//! The fingerprint of a dead letter: what groups letters with the same cause.

use sha2::{Digest, Sha256};

/// The cause of a failure as text: `reason`, then `error` with what varies
/// between letters of one cause masked: quoted values (`'…'`, `"…"`) become
/// `?`, numbers (and ids made of hex digits and dashes, such as UUIDs)
/// become `#`.
pub(crate) fn pattern(reason: &str, error: &str) -> String {
    let mut out = String::with_capacity(reason.len() + error.len() + 2);
    out.push_str(reason);
    out.push_str(": ");
    let chars: Vec<char> = error.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' {
            // A quoted value: up to the matching quote (or the end).
            let end = chars[i + 1..]
                .iter()
                .position(|&d| d == c)
                .map_or(chars.len(), |p| i + 1 + p + 1);
            out.push('?');
            i = end;
        } else if c.is_ascii_digit() || (c.is_ascii_hexdigit() && word_is_id(&chars, i)) {
            // A number, or a word of hex digits and dashes holding a digit.
            while i < chars.len()
                && (chars[i].is_ascii_hexdigit() || chars[i] == '-' || chars[i] == '.')
            {
                i += 1;
            }
            out.push('#');
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether the word that starts at `i` is made of hex digits and dashes and
/// holds at least one digit (a UUID, a hash), and starts a word.
fn word_is_id(chars: &[char], i: usize) -> bool {
    if i > 0 && chars[i - 1].is_alphanumeric() {
        return false;
    }
    let word: Vec<char> = chars[i..]
        .iter()
        .copied()
        .take_while(|c| c.is_alphanumeric() || *c == '-')
        .collect();
    word.iter().all(|c| c.is_ascii_hexdigit() || *c == '-') && word.iter().any(char::is_ascii_digit)
}

/// The fingerprint: 16 hex digits of the SHA-256 of the cause's pattern
/// (the reason and the error with ids, numbers and quoted values masked).
pub(crate) fn fingerprint(reason: &str, error: &str) -> String {
    let digest = Sha256::digest(pattern(reason, error).as_bytes());
    hex::encode(&digest[..8])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letters_of_one_cause_share_a_fingerprint() {
        let a = fingerprint(
            "permanent error",
            "duplicate key value violates unique constraint \"payments_pkey\": Key (id)=(42) already exists",
        );
        let b = fingerprint(
            "permanent error",
            "duplicate key value violates unique constraint \"payments_pkey\": Key (id)=(977) already exists",
        );
        assert_eq!(a, b);
        assert_eq!(a.len(), 16);
    }

    #[test]
    fn ids_numbers_and_quoted_values_are_masked() {
        assert_eq!(
            pattern(
                "undecodable body",
                "id 3f2b8c1e-0d4a-4c7e-9b1a-2f6d8e0c5a71 at line 12 column 7: 'abc'"
            ),
            "undecodable body: id # at line # column #: ?"
        );
        // Words that merely use hex letters stay.
        assert_eq!(pattern("r", "bad face"), "r: bad face");
        assert_eq!(pattern("r", "account \"alice\""), "r: account ?");
    }

    #[test]
    fn other_causes_differ() {
        assert_ne!(
            fingerprint("permanent error", "amount is negative"),
            fingerprint("permanent error", "account is empty")
        );
        assert_ne!(
            fingerprint("permanent error", "x"),
            fingerprint("undecodable body", "x")
        );
    }
}
