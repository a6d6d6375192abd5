//! How idempo writes a duration where the text is a name others rely on (a
//! delay queue's `<queue>.retry.2m`): exactly. Where a person reads it (the
//! operations' tables), `ops::short_duration` rounds it down to one unit.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_labels_use_the_largest_unit_that_divides() {
        assert_eq!(exact_label(Duration::from_secs(120)), "2m");
        assert_eq!(exact_label(Duration::from_millis(1500)), "1500ms");
        assert_eq!(exact_label(Duration::from_secs(7200)), "2h");
        assert_eq!(exact_label(Duration::from_secs(90)), "90s");
    }
}
