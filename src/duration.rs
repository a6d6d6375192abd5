//! How idempo writes a duration, in one place: exactly, where the text is a
//! name others rely on (a delay queue's `<queue>.retry.2m`), or rounded down
//! to one unit, where a person reads it (the operations' tables).

use std::time::Duration;

/// `1s`, `2m`, `250ms`, `1h`: exact, short, and stable across restarts
/// (the unit is the largest that divides the duration).
pub(crate) fn exact_label(delay: Duration) -> String {
    let ms = delay.as_millis();
    match ms {
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1_000 == 0 => format!("{}s", ms / 1_000),
        ms => format!("{ms}ms"),
    }
}

/// A duration as the operations print it: one unit, rounded down (`250ms`,
/// `90s`, `45m`, `36h`, `7d`).
///
/// ```
/// use std::time::Duration;
/// use idempo::ops::short_duration;
///
/// assert_eq!(short_duration(Duration::from_millis(250)), "250ms");
/// assert_eq!(short_duration(Duration::from_secs(90)), "90s");
/// assert_eq!(short_duration(Duration::from_secs(7 * 86_400)), "7d");
/// ```
#[cfg(feature = "ops")]
pub fn short_duration(d: Duration) -> String {
    match d.as_secs() {
        0 => format!("{}ms", d.as_millis()),
        s if s < 120 => format!("{s}s"),
        s if s < 7_200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "ops")]
    #[test]
    fn durations_print_in_one_unit() {
        let s = Duration::from_secs;
        assert_eq!(short_duration(Duration::ZERO), "0ms");
        assert_eq!(short_duration(s(119)), "119s");
        assert_eq!(short_duration(s(120)), "2m");
        assert_eq!(short_duration(s(7_199)), "119m");
        assert_eq!(short_duration(s(7_200)), "2h");
        assert_eq!(short_duration(s(172_800)), "2d");
    }

    #[test]
    fn exact_labels_use_the_largest_unit_that_divides() {
        assert_eq!(exact_label(Duration::from_secs(120)), "2m");
        assert_eq!(exact_label(Duration::from_millis(1500)), "1500ms");
        assert_eq!(exact_label(Duration::from_secs(7200)), "2h");
        assert_eq!(exact_label(Duration::from_secs(90)), "90s");
    }
}
