//! Saga ids and step names: checked before any statement is sent.
//!
//! PostgreSQL refuses some strings late and obscurely (a NUL byte is an
//! "invalid byte sequence", a 10 kB id overflows the primary key's btree
//! row), and the idempotency key `{saga_id}:{step}` is meant to travel as an
//! `Idempotency-Key` header. So both are held to the header's rules up front.

/// The longest saga id accepted, in bytes.
///
/// With 64 and the `:` between them, the idempotency key
/// `{saga_id}:{step}` stays within the 255 characters an `Idempotency-Key`
/// may have (idempo's HTTP layer and Stripe both stop there).
pub(crate) const MAX_SAGA_ID_LEN: usize = 190;

/// The longest step name accepted, in bytes (see 190).
pub(crate) const MAX_STEP_LEN: usize = 64;

/// Why a saga id or a step name was refused. Nothing was sent to the
/// database.
///
/// Both are 1 or more characters of visible ASCII (`!` to `~`) other than
/// `"`; a step name has no `:` either.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// The empty string.
    #[error("empty")]
    Empty,
    /// Longer than 190 or 64.
    #[error("{len} bytes long, at most {max} are allowed")]
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A byte that is not visible ASCII (a NUL, a control character, a
    /// space, anything non-ASCII) or a `"` (which would make the idempotency
    /// key read as a quoted string).
    #[error("a character outside visible ASCII (or a '\"') at byte {position}")]
    InvalidCharacter {
        /// Zero-based byte offset.
        position: usize,
    },
    /// A `:` in a step name: `{saga_id}:{step}` must name one pair only
    /// (saga `a:b`, step `c` and saga `a`, step `b:c` would share a key).
    #[error("a ':' at byte {position} (it separates saga id and step in the idempotency key)")]
    Colon {
        /// Zero-based byte offset.
        position: usize,
    },
}

/// Checks a saga id.
pub(crate) fn check_saga_id(saga_id: &str) -> Result<(), NameError> {
    check(saga_id, MAX_SAGA_ID_LEN)
}

/// Checks a step name: a saga id's rules, a shorter limit, and no `:`.
pub(crate) fn check_step(step: &str) -> Result<(), NameError> {
    check(step, MAX_STEP_LEN)?;
    match step.find(':') {
        Some(position) => Err(NameError::Colon { position }),
        None => Ok(()),
    }
}

fn check(name: &str, max: usize) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > max {
        return Err(NameError::TooLong {
            len: name.len(),
            max,
        });
    }
    match name
        .bytes()
        .position(|b| !b.is_ascii_graphic() || b == b'"')
    {
        Some(position) => Err(NameError::InvalidCharacter { position }),
        None => Ok(()),
    }
}

/// At most 40 characters of `name`, for error messages about names that
/// may be 10 kB long.
pub(crate) fn shorten(name: &str) -> String {
    match name.char_indices().nth(40) {
        Some((end, _)) => format!("{:?}…", &name[..end]),
        None => format!("{name:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saga_ids_are_visible_ascii_up_to_the_limit() {
        assert_eq!(check_saga_id("order-17:eu"), Ok(()));
        assert_eq!(check_saga_id(&"x".repeat(MAX_SAGA_ID_LEN)), Ok(()));
        assert_eq!(check_saga_id(""), Err(NameError::Empty));
        assert_eq!(
            check_saga_id(&"x".repeat(10_000)),
            Err(NameError::TooLong {
                len: 10_000,
                max: MAX_SAGA_ID_LEN
            })
        );
        for (id, position) in [
            ("a\0b", 1),
            ("order 17", 5),
            ("é", 0),
            ("\"q\"", 0),
            ("a\n", 1),
        ] {
            assert_eq!(
                check_saga_id(id),
                Err(NameError::InvalidCharacter { position }),
                "{id:?}"
            );
        }
    }

    #[test]
    fn step_names_also_have_no_colon() {
        assert_eq!(check_step("charge-card"), Ok(()));
        assert_eq!(check_step("b:c"), Err(NameError::Colon { position: 1 }));
        assert!(matches!(
            check_step(&"s".repeat(MAX_STEP_LEN + 1)),
            Err(NameError::TooLong { .. })
        ));
    }

    #[test]
    fn the_longest_names_make_a_key_of_255_characters() {
        let key = crate::saga::Saga::idempotency_key(
            &"x".repeat(MAX_SAGA_ID_LEN),
            &"s".repeat(MAX_STEP_LEN),
        );
        assert_eq!(key.len(), 255);
    }

    #[test]
    fn long_names_are_shortened_in_messages() {
        assert_eq!(shorten("short"), "\"short\"");
        assert_eq!(
            shorten(&"x".repeat(10_000)),
            format!("{:?}…", "x".repeat(40))
        );
        assert_eq!(shorten(&"é".repeat(41)), format!("{:?}…", "é".repeat(40)));
    }
}
