//! Whether a message's properties fit the connection's frame size, and a
//! copy's headers trimmed until they do.
//!
//! AMQP carries a message's properties (headers included) in one content
//! header frame, which must not exceed the `frame_max` negotiated with the
//! broker. RabbitMQ answers a larger one by closing the whole connection
//! (`FRAME_ERROR`), so every publish is measured before it is sent.

use std::collections::BTreeMap;

use lapin::BasicProperties;
use lapin::protocol::basic::gen_properties;
use lapin::types::generation::gen_field_table;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::wire_size::{DEFAULT_FRAME_MAX, HEADER_FRAME_OVERHEAD};

/// The headers removed from a dead letter so that it fits the broker's frame
/// size, as `name=bytes` pairs, largest first (for example
/// `x-pad=130811`). RabbitMQ closes the connection on a larger header frame,
/// so a copy that would not fit is trimmed: first the largest headers that
/// are not idempo's, then the error text and the replay history.
const TRIMMED_HEADERS_HEADER: &str = "x-idempo-trimmed-headers";

/// The frame size a connection negotiated, where `0` (no limit, which
/// RabbitMQ never negotiates) reads as RabbitMQ's default of 128 KiB.
pub(crate) fn frame_max(connection: &lapin::Connection) -> usize {
    match connection.configuration().frame_max() {
        0 => DEFAULT_FRAME_MAX,
        n => n as usize,
    }
}

/// The size of the content header frame that carries `properties`, encoded
/// exactly as lapin will send it.
pub(crate) fn header_frame_len(properties: &BasicProperties) -> usize {
    match gen_properties(properties)(Vec::new().into()) {
        Ok(written) => written.position as usize + HEADER_FRAME_OVERHEAD,
        // Only a value too long for its length prefix fails: it cannot fit.
        Err(_) => usize::MAX,
    }
}

/// Why a message cannot be published on this connection: its properties
/// take `size` bytes of a frame of `frame_max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooLarge {
    pub(crate) size: usize,
    pub(crate) frame_max: usize,
}

/// Checks that `properties` fit a frame of `frame_max` bytes.
pub(crate) fn check(properties: &BasicProperties, frame_max: usize) -> Result<(), TooLarge> {
    let size = header_frame_len(properties);
    if size <= frame_max {
        Ok(())
    } else {
        Err(TooLarge { size, frame_max })
    }
}

/// Headers of idempo's that a dead letter can lose when nothing else is left
/// to trim (their content is informational, bounded and rebuilt elsewhere).
const INFORMATIONAL: [&str; 2] = [
    crate::runtime::header_names::ERROR_HEADER,
    crate::runtime::header_names::REPLAY_HISTORY_HEADER,
];

/// The record of trimmed headers is cut to this many bytes.
const MAX_RECORD: usize = 1024;

/// `properties` with headers removed until they fit a frame of `frame_max`:
/// first the largest headers that are not idempo's own (`x-idempo-*`), then
/// idempo's informational ones (the error text, the replay history). What
/// was removed is recorded in [`TRIMMED_HEADERS_HEADER`] as `name=bytes`
/// pairs, largest first. Returns the properties unchanged, with an empty
/// list, when they already fit.
///
/// # Errors
/// [`TooLarge`] when even the trimmed properties do not fit (the remaining
/// properties and idempo's identifying headers alone exceed the frame).
pub(crate) fn trim(
    properties: BasicProperties,
    frame_max: usize,
) -> Result<(BasicProperties, Vec<(String, usize)>), TooLarge> {
    if check(&properties, frame_max).is_ok() {
        return Ok((properties, Vec::new()));
    }
    let mut headers: BTreeMap<ShortString, AMQPValue> = properties
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    // Largest foreign headers first, then idempo's informational ones.
    let mut candidates: Vec<(bool, usize, ShortString)> = headers
        .iter()
        .filter_map(|(name, value)| {
            let own = name.as_str().starts_with("x-idempo-");
            let informational = INFORMATIONAL.contains(&name.as_str());
            (!own || informational).then(|| (own, entry_len(name, value), name.clone()))
        })
        .collect();
    candidates.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));

    let mut trimmed = Vec::new();
    for (_, len, name) in candidates {
        headers.remove(&name);
        trimmed.push((name.to_string(), len));
        let mut with_record = FieldTable::from(headers.clone());
        with_record.insert(
            TRIMMED_HEADERS_HEADER.into(),
            AMQPValue::LongString(record(&trimmed).into()),
        );
        let candidate = properties.clone().with_headers(with_record);
        if check(&candidate, frame_max).is_ok() {
            return Ok((candidate, trimmed));
        }
    }
    // Every candidate went, and the rest still does not fit.
    Err(TooLarge {
        size: header_frame_len(&properties.with_headers(FieldTable::from(headers))),
        frame_max,
    })
}

/// One header's bytes in an encoded field table.
fn entry_len(name: &ShortString, value: &AMQPValue) -> usize {
    let mut one = FieldTable::default();
    one.insert(name.clone(), value.clone());
    match gen_field_table(&one)(Vec::new().into()) {
        // Less the table's own length prefix.
        Ok(written) => (written.position as usize).saturating_sub(4),
        Err(_) => usize::MAX,
    }
}

/// `name=bytes, …`, cut at [`MAX_RECORD`] bytes with the count of the rest.
fn record(trimmed: &[(String, usize)]) -> String {
    let mut text = String::new();
    for (i, (name, len)) in trimmed.iter().enumerate() {
        let entry = format!("{}{name}={len}", if i == 0 { "" } else { ", " });
        if text.len() + entry.len() > MAX_RECORD {
            text.push_str(&format!(" and {} more", trimmed.len() - i));
            break;
        }
        text.push_str(&entry);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::header_names::{ERROR_HEADER, MESSAGE_ID_HEADER, REASON_HEADER};

    fn with_headers(headers: &[(&str, usize)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (name, len) in headers {
            table.insert(
                (*name).into(),
                AMQPValue::LongString("x".repeat(*len).into()),
            );
        }
        BasicProperties::default()
            .with_message_id("pay-1".into())
            .with_headers(table)
    }

    #[test]
    fn the_header_frame_length_is_the_encoded_properties_plus_the_frame_overhead() {
        // flags (2) + message id (1 + 5).
        let plain = BasicProperties::default().with_message_id("pay-1".into());
        assert_eq!(header_frame_len(&plain), 2 + 6 + HEADER_FRAME_OVERHEAD);
        // + headers: length (4) + name (1 + 5) + type (1) + long string (4 + 10).
        let one = with_headers(&[("x-pad", 10)]);
        assert_eq!(header_frame_len(&one), 2 + 6 + 4 + 6 + 1 + 14 + 20);
        assert_eq!(
            entry_len(
                &"x-pad".into(),
                &AMQPValue::LongString("x".repeat(10).into())
            ),
            6 + 1 + 14
        );
    }

    #[test]
    fn a_copy_that_fits_is_left_alone() {
        let p = with_headers(&[("x-pad", 1000)]);
        let (kept, trimmed) = trim(p.clone(), 131_072).unwrap();
        assert!(trimmed.is_empty());
        assert_eq!(kept, p);
    }

    #[test]
    fn the_largest_foreign_headers_go_first_and_idempo_headers_stay() {
        let p = with_headers(&[
            ("x-pad", 130_800),
            ("x-small", 100),
            ("x-medium", 2_000),
            (MESSAGE_ID_HEADER, 200),
            (REASON_HEADER, 20),
            (ERROR_HEADER, 4000),
        ]);
        assert!(check(&p, 131_072).is_err());
        let (fitted, trimmed) = trim(p, 131_072).unwrap();
        assert!(header_frame_len(&fitted) <= 131_072);
        assert_eq!(trimmed.len(), 1);
        assert_eq!(trimmed[0].0, "x-pad");
        let headers = fitted.headers().clone().unwrap();
        assert!(headers.inner().contains_key("x-medium"));
        assert!(headers.inner().contains_key(ERROR_HEADER));
        assert_eq!(
            headers.inner().get(TRIMMED_HEADERS_HEADER),
            Some(&AMQPValue::LongString(
                format!("x-pad={}", 6 + 1 + 4 + 130_800).into()
            ))
        );

        // A small frame: every foreign header, then the error text, go.
        let p = with_headers(&[
            ("x-a", 3000),
            ("x-b", 500),
            (MESSAGE_ID_HEADER, 200),
            (ERROR_HEADER, 1500),
        ]);
        let (fitted, trimmed) = trim(p, 1600).unwrap();
        let names: Vec<&str> = trimmed.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["x-a", "x-b", ERROR_HEADER]);
        assert!(
            fitted
                .headers()
                .as_ref()
                .unwrap()
                .inner()
                .contains_key(MESSAGE_ID_HEADER)
        );
    }

    #[test]
    fn what_cannot_fit_even_trimmed_is_refused() {
        let p = with_headers(&[(MESSAGE_ID_HEADER, 5000), ("x-a", 10)]);
        let err = trim(p, 4096).unwrap_err();
        assert_eq!(err.frame_max, 4096);
        assert!(err.size > 4096);
    }

    #[test]
    fn the_record_of_trimmed_headers_is_bounded() {
        let many: Vec<(String, usize)> = (0..500).map(|i| (format!("x-h{i:03}"), 10)).collect();
        let text = record(&many);
        assert!(text.len() <= MAX_RECORD + 20, "{}", text.len());
        assert!(text.ends_with("more"), "{text}");
    }
}
