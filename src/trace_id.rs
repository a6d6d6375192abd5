//! A W3C trace context's trace id, read from its `traceparent` header
//! ([`TRACEPARENT_HEADER`](crate::headers::TRACEPARENT_HEADER)): what links a
//! dead letter to its trace, and what OpenTelemetry continues.

/// The trace id of a W3C `traceparent` (`vv-<32 hex>-<16 hex>-ff`, lower
/// case, a version other than `ff`), when it has that shape.
pub(crate) fn trace_id(traceparent: &str) -> Option<&str> {
    let parts: Vec<&str> = traceparent.trim().split('-').collect();
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let formed = parts.len() >= 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
        && (parts[0] != "00" || parts.len() == 4);
    // Lazily: a short text has no second part.
    formed.then(|| parts[1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_whole_traceparent_has_a_trace_id() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(trace_id(tp), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        for bad in [
            "",
            "-",
            "00",
            "garbage",
            "00-abc-def-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert_eq!(trace_id(bad), None, "{bad:?}");
        }
        // A later version may carry more parts.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more";
        assert!(trace_id(later).is_some());
    }
}
