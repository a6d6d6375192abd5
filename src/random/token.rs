//! Positive random `i64`s: fencing and reservation tokens, unique names.

use super::bytes;
use crate::error::RandomnessUnavailable;

/// A positive random `i64`: fencing and reservation tokens.
pub(crate) fn token() -> Result<i64, RandomnessUnavailable> {
    Ok((u64::from_be_bytes(bytes::<8>()?) >> 1).max(1) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_positive() {
        assert!((0..1000).all(|_| token().unwrap() > 0));
    }
}
