//! The schedule: a ceiling that doubles from a base up to a max, and a wait
//! drawn uniformly below it.

use std::time::Duration;

/// The most the `n`-th wait (1-based) can be: `base · 2^(n-1)`, capped at `max`.
pub(crate) fn ceiling(base: Duration, max: Duration, n: u32) -> Duration {
    let factor = 2u32.saturating_pow(n.saturating_sub(1));
    base.saturating_mul(factor).min(max)
}

/// A wait drawn uniformly from `[0, ceiling]` ("full jitter"), so that many
/// clients that failed together do not come back in lockstep.
pub(crate) fn full_jitter(ceiling: Duration) -> Duration {
    let nanos = ceiling.as_nanos().min(u128::from(u64::MAX)) as u64;
    Duration::from_nanos(fastrand::u64(0..=nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_doubles_up_to_the_max() {
        let (base, max) = (Duration::from_millis(200), Duration::from_secs(30));
        assert_eq!(ceiling(base, max, 1), base);
        assert_eq!(ceiling(base, max, 3), Duration::from_millis(800));
        assert_eq!(ceiling(base, max, 40), max);
        assert_eq!(ceiling(base, max, u32::MAX), max);
    }

    #[test]
    fn full_jitter_never_exceeds_its_ceiling() {
        for _ in 0..1000 {
            assert!(full_jitter(Duration::from_millis(5)) <= Duration::from_millis(5));
        }
        assert_eq!(full_jitter(Duration::ZERO), Duration::ZERO);
    }
}
