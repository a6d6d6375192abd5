//! The names NATS accepts for streams, durable consumers and subjects,
//! checked before anything is sent (the server's own refusals are less
//! clear, and some, like a space in a subject, are silently misread).

use super::error::NatsError;

/// The longest stream or consumer name idempo sends: the server stores them
/// as directory names.
const MAX_NAME: usize = 255;

/// A stream or durable consumer name: printable, no spaces, dots,
/// wildcards or path separators.
pub(crate) fn check_name(what: &'static str, name: &str) -> Result<(), NatsError> {
    let invalid = |reason| NatsError::InvalidName {
        what,
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("it is empty"));
    }
    if name.len() > MAX_NAME {
        return Err(invalid("it is longer than 255 bytes"));
    }
    if name
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
    {
        return Err(invalid(
            "it holds a space, a control character, '.', '*', '>', '/' or '\\'",
        ));
    }
    Ok(())
}

/// A subject to consume: dot-separated tokens, none empty, no spaces;
/// `*` only as a whole token, `>` only as the last one.
pub(crate) fn check_subject(subject: &str) -> Result<(), NatsError> {
    let invalid = |reason| NatsError::InvalidName {
        what: "subject",
        name: subject.to_owned(),
        reason,
    };
    if subject.is_empty() {
        return Err(invalid("it is empty"));
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid("it holds a space or a control character"));
    }
    let tokens: Vec<&str> = subject.split('.').collect();
    for (i, token) in tokens.iter().enumerate() {
        if token.is_empty() {
            return Err(invalid(
                "it has an empty token (a leading, trailing or double '.')",
            ));
        }
        if token.len() > 1 && (token.contains('*') || token.contains('>')) {
            return Err(invalid("a wildcard ('*', '>') must be a whole token"));
        }
        if *token == ">" && i + 1 != tokens.len() {
            return Err(invalid("'>' may only be the last token"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_nats_refuses_are_refused_here() {
        assert!(check_name("stream", "payments").is_ok());
        assert!(check_name("stream", "payments-v2_eu").is_ok());
        for bad in [
            "",
            "pay ments",
            "pay.ments",
            "pay*",
            "pay>",
            "a/b",
            "a\\b",
            "tab\t",
        ] {
            let e = check_name("stream", bad).unwrap_err();
            assert!(e.to_string().contains("stream name"), "{e}");
        }
        assert!(check_name("consumer", &"x".repeat(256)).is_err());
    }

    #[test]
    fn subjects_are_tokens_with_whole_wildcards() {
        for good in ["payments", "orders.eu.paid", "orders.*.paid", "orders.>"] {
            assert!(check_subject(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "a..b",
            ".a",
            "a.",
            "a b",
            "orders.eu*",
            "orders.>.paid",
            "a.b>",
        ] {
            assert!(check_subject(bad).is_err(), "{bad}");
        }
    }
}
