//! What a dead letter says about itself, read from its headers
//! ([`DeadLetter`]): the one reader of idempo's failure headers, and the
//! properties of a replay's copy (feature `ops`).

use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use crate::properties::{Properties, Value};
use crate::runtime::header_names::REPLAY_HISTORY_HEADER;
use crate::runtime::header_names::{
    ATTEMPTS_HEADER, CONSUMER_HEADER, ERROR_HEADER, FIRST_FAILURE_HEADER, LAST_FAILURE_HEADER,
    MESSAGE_ID_HEADER, QUEUE_HEADER, REASON_HEADER, ROUTING_KEY_HEADER,
};
use crate::runtime::headers::{rfc3339, truncate};

/// How many times the message was replayed in all (an integer), including
/// the replays whose records left the [`REPLAY_HISTORY_HEADER`]. Written
/// and read by the replay only.
pub(crate) const REPLAY_COUNT_HEADER: &str = "x-idempo-replay-count";

/// How many replay records the [`REPLAY_HISTORY_HEADER`] keeps (the guide
/// and `Letter::history` say 5).
pub(crate) const MAX_REPLAY_HISTORY: usize = 5;

/// A record's error text is cut to this many bytes (the full text of the
/// last failure stays in the dead letter's own error header).
const MAX_RECORDED_ERROR: usize = 512;

/// Headers a replay drops: the attempt counters start again (their values
/// move into the [`REPLAY_HISTORY_HEADER`]).
const RESET_ON_REPLAY: [&str; 5] = [
    REASON_HEADER,
    ERROR_HEADER,
    ATTEMPTS_HEADER,
    FIRST_FAILURE_HEADER,
    LAST_FAILURE_HEADER,
];

/// A dead letter's `x-idempo-*` headers, read the way the runtime wrote them.
///
/// The runtime publishes each dead letter with its reason, the last error,
/// the failed attempts, the consumer, the queue and routing key it came
/// from, and when its first and last attempts failed (see the
/// [`REASON_HEADER`](crate::runtime::header_names::REASON_HEADER) family of constants). This view
/// reads them from the letter's properties in idempo's encoding (a DLQ
/// delivery's are converted first): text headers must be UTF-8 (a value
/// that is not reads as absent, as it does for the runtime).
///
/// A message without [`QUEUE_HEADER`](crate::runtime::header_names::QUEUE_HEADER) was not
/// dead-lettered by idempo ([`is_foreign`](Self::is_foreign)): put into the
/// DLQ by hand, or by the broker's own dead-lettering.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeadLetter<'a> {
    properties: &'a Properties,
}

/// What the operators read of a letter's properties, and how a replay
/// changes them.
impl Properties {
    /// The header `name` (the last, when a name repeats).
    pub(crate) fn header(&self, name: &str) -> Option<&Value> {
        self.headers
            .as_ref()?
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    }

    /// The header `name` as text ([`Value::text`]).
    pub(crate) fn header_text(&self, name: &str) -> Option<String> {
        self.header(name)?.text()
    }

    /// The `message_id` field as text.
    pub(crate) fn message_id(&self) -> Option<String> {
        let (_, id) = self.fields.iter().find(|(n, _)| n == "message_id")?;
        id.text()
    }

    /// Removes header `name`.
    pub(crate) fn remove_header(&mut self, name: &str) {
        if let Some(headers) = &mut self.headers {
            headers.retain(|(n, _)| n != name);
        }
    }

    /// The fields as a JSON object.
    pub(crate) fn fields_json(&self) -> Map<String, Json> {
        self.fields
            .iter()
            .map(|(name, value)| (name.clone(), value.to_json()))
            .collect()
    }
}

/// What a dead letter looked like before one replay: an element of the
/// [`REPLAY_HISTORY_HEADER`] array. The times are RFC 3339 text as the
/// runtime wrote them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub(crate) struct ReplayRecord {
    /// Why it had been dead-lettered.
    pub reason: Option<String>,
    /// The text of its last error.
    pub error: Option<String>,
    /// How many attempts had failed.
    pub attempts: Option<u32>,
    /// When its first attempt failed.
    pub first_failure: Option<String>,
    /// When its last attempt failed.
    pub last_failure: Option<String>,
    /// When it was replayed (absent in records written before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed_at: Option<String>,
}

impl<'a> DeadLetter<'a> {
    /// The view of a message with these properties.
    pub(crate) fn new(properties: &'a Properties) -> Self {
        DeadLetter { properties }
    }

    /// The header `name` as text: a UTF-8 string or an integer, `None` when
    /// absent or anything else.
    pub(crate) fn header(&self, name: &str) -> Option<String> {
        self.properties.header_text(name)
    }

    /// The id idempo deduplicated the original on ([`MESSAGE_ID_HEADER`]),
    /// or else the `message_id` property.
    pub(crate) fn message_id(&self) -> Option<String> {
        self.header(MESSAGE_ID_HEADER)
            .or_else(|| self.properties.message_id())
    }

    /// Why it was dead-lettered: the text of a
    /// [`DeadLetterReason`](DeadLetterReason::as_str).
    pub(crate) fn reason(&self) -> Option<String> {
        self.header(REASON_HEADER)
    }

    /// The text of the last error.
    pub(crate) fn error(&self) -> Option<String> {
        self.header(ERROR_HEADER)
    }

    /// How many attempts failed: an integer header (as the runtime writes
    /// it) or its decimal text.
    pub(crate) fn attempts(&self) -> Option<u32> {
        self.header(ATTEMPTS_HEADER)?.parse().ok()
    }

    /// The consumer that dead-lettered it.
    pub(crate) fn consumer(&self) -> Option<String> {
        self.header(CONSUMER_HEADER)
    }

    /// The queue it was consumed from: where a replay sends it.
    pub(crate) fn original_queue(&self) -> Option<String> {
        self.header(QUEUE_HEADER)
    }

    /// The routing key it was first published with.
    pub(crate) fn original_routing_key(&self) -> Option<String> {
        self.header(ROUTING_KEY_HEADER)
    }

    /// When its first attempt failed.
    pub(crate) fn first_failure(&self) -> Option<SystemTime> {
        self.time(FIRST_FAILURE_HEADER)
    }

    /// When its last attempt failed.
    pub(crate) fn last_failure(&self) -> Option<SystemTime> {
        self.time(LAST_FAILURE_HEADER)
    }

    fn time(&self, name: &str) -> Option<SystemTime> {
        humantime::parse_rfc3339(&self.header(name)?).ok()
    }

    /// What it looked like before each of its last replays (at most
    /// [`MAX_REPLAY_HISTORY`]), oldest first (empty when it was never
    /// replayed, or the header does not parse).
    pub(crate) fn replay_history(&self) -> Vec<ReplayRecord> {
        self.header(REPLAY_HISTORY_HEADER)
            .and_then(|h| serde_json::from_str(&h).ok())
            .unwrap_or_default()
    }

    /// How many times it was replayed in all: the [`REPLAY_COUNT_HEADER`],
    /// or (written before that header) the length of its history.
    pub(crate) fn replay_count(&self) -> u64 {
        self.header(REPLAY_COUNT_HEADER)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| self.replay_history().len() as u64)
    }

    /// When it was last replayed, if its history says.
    pub(crate) fn last_replayed(&self) -> Option<SystemTime> {
        let last = self.replay_history().pop()?.replayed_at?;
        humantime::parse_rfc3339(&last).ok()
    }

    /// Whether idempo did not dead-letter it: it has no
    /// [`QUEUE_HEADER`](crate::runtime::header_names::QUEUE_HEADER), so a replay needs a target.
    pub(crate) fn is_foreign(&self) -> bool {
        self.original_queue().is_none()
    }

    /// The properties of the copy a replay publishes to the work queue: the
    /// same id, properties and other headers, without the attempt counters
    /// (reason, error, attempts, first and last failure), which are appended
    /// to the [`REPLAY_HISTORY_HEADER`] instead (with the time of this
    /// replay; the last [`MAX_REPLAY_HISTORY`] records are kept, and the
    /// [`REPLAY_COUNT_HEADER`] counts them all). The consumer then gets its
    /// full number of attempts again.
    pub(crate) fn replay_properties(&self) -> Properties {
        self.replay_properties_at(SystemTime::now())
    }

    fn replay_properties_at(&self, now: SystemTime) -> Properties {
        // Earlier entries are kept as they are, whatever their shape.
        let mut history: Vec<serde_json::Value> = self
            .header(REPLAY_HISTORY_HEADER)
            .and_then(|h| serde_json::from_str(&h).ok())
            .unwrap_or_default();
        let record = ReplayRecord {
            reason: self.reason(),
            error: self
                .error()
                .map(|e| truncate(&e, MAX_RECORDED_ERROR).to_owned()),
            attempts: self.attempts(),
            first_failure: self.header(FIRST_FAILURE_HEADER),
            last_failure: self.header(LAST_FAILURE_HEADER),
            replayed_at: Some(rfc3339(now)),
        };
        let count = self.replay_count() + 1;
        history.push(serde_json::to_value(record).expect("a record serialises"));
        let excess = history.len().saturating_sub(MAX_REPLAY_HISTORY);
        history.drain(..excess);
        let mut replayed = self.properties.clone();
        for name in RESET_ON_REPLAY {
            replayed.remove_header(name);
        }
        replayed.set_header(
            REPLAY_HISTORY_HEADER,
            Value::Text(serde_json::Value::Array(history).to_string().into_bytes()),
        );
        replayed.set_header(
            REPLAY_COUNT_HEADER,
            Value::I64(i64::try_from(count).unwrap_or(i64::MAX)),
        );
        replayed
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    #[test]
    fn headers_read_as_text() {
        let p = Properties {
            fields: vec![("message_id".into(), Value::ShortText("id-1".into()))],
            headers: Some(vec![
                ("i64".into(), Value::I64(-64)),
                ("bool".into(), Value::Bool(true)),
                ("repeated".into(), Value::Text(b"one".to_vec())),
                ("repeated".into(), Value::Text(b"two".to_vec())),
            ]),
        };
        assert_eq!(p.header_text("repeated").as_deref(), Some("two"));
        assert_eq!(p.header_text("i64").as_deref(), Some("-64"));
        assert_eq!(p.header_text("bool"), None);
        assert_eq!(p.message_id().as_deref(), Some("id-1"));
    }

    fn properties(headers: &[(&str, Value)]) -> Properties {
        Properties {
            fields: vec![("message_id".into(), Value::ShortText("property-id".into()))],
            headers: Some(
                headers
                    .iter()
                    .map(|(name, value)| ((*name).to_owned(), value.clone()))
                    .collect(),
            ),
        }
    }

    fn text(s: &str) -> Value {
        Value::Text(s.as_bytes().to_vec())
    }

    fn dead_letter_as_the_runtime_writes_it() -> Properties {
        properties(&[
            (MESSAGE_ID_HEADER, text("pay-1")),
            (REASON_HEADER, text("max attempts exceeded")),
            (ERROR_HEADER, text("timeout")),
            (ATTEMPTS_HEADER, Value::I64(3)),
            (CONSUMER_HEADER, text("billing")),
            (QUEUE_HEADER, text("payments")),
            (ROUTING_KEY_HEADER, text("pay.eu")),
            (FIRST_FAILURE_HEADER, text("2026-12-01T02:19:47.123Z")),
            (LAST_FAILURE_HEADER, text("2026-12-01T02:20:47.000Z")),
            ("x-custom", text("kept")),
        ])
    }

    #[test]
    fn every_header_the_runtime_writes_is_read() {
        let p = dead_letter_as_the_runtime_writes_it();
        let dead = DeadLetter::new(&p);
        assert_eq!(dead.message_id().as_deref(), Some("pay-1"));
        assert_eq!(dead.reason().as_deref(), Some("max attempts exceeded"));
        assert_eq!(dead.error().as_deref(), Some("timeout"));
        assert_eq!(dead.attempts(), Some(3));
        assert_eq!(dead.consumer().as_deref(), Some("billing"));
        assert_eq!(dead.original_queue().as_deref(), Some("payments"));
        assert_eq!(dead.original_routing_key().as_deref(), Some("pay.eu"));
        let first = UNIX_EPOCH + Duration::from_millis(1_796_091_587_123);
        assert_eq!(dead.first_failure(), Some(first));
        assert_eq!(
            dead.last_failure(),
            Some(UNIX_EPOCH + Duration::from_secs(1_796_091_647))
        );
        assert!(!dead.is_foreign());
        assert!(dead.replay_history().is_empty());
    }

    #[test]
    fn a_message_without_idempo_headers_is_foreign_and_keeps_its_property_id() {
        let p = properties(&[]);
        let dead = DeadLetter::new(&p);
        assert!(dead.is_foreign());
        assert_eq!(dead.message_id().as_deref(), Some("property-id"));
        assert_eq!(dead.reason(), None);
        assert_eq!(dead.attempts(), None);
        assert_eq!(dead.last_failure(), None);
    }

    #[test]
    fn text_must_be_utf8_and_only_the_display_is_lossy() {
        let p = properties(&[
            (ERROR_HEADER, Value::Text(b"bad \xff byte".to_vec())),
            (ATTEMPTS_HEADER, text("2")),
            (LAST_FAILURE_HEADER, text("yesterday")),
            ("x-flag", Value::Bool(true)),
        ]);
        let dead = DeadLetter::new(&p);
        assert_eq!(dead.error(), None, "the one reader is strict");
        assert_eq!(dead.attempts(), Some(2), "decimal text is read too");
        assert_eq!(dead.last_failure(), None, "not RFC 3339");
    }

    #[test]
    fn a_replayed_copy_drops_the_counters_and_appends_them_to_its_history() {
        let p = dead_letter_as_the_runtime_writes_it();
        let once = DeadLetter::new(&p).replay_properties();
        let copy = DeadLetter::new(&once);
        assert_eq!(copy.reason(), None);
        assert_eq!(copy.attempts(), None);
        assert_eq!(copy.first_failure(), None);
        assert_eq!(copy.message_id().as_deref(), Some("pay-1"));
        assert_eq!(copy.original_queue().as_deref(), Some("payments"));
        assert_eq!(copy.header("x-custom").as_deref(), Some("kept"));
        assert_eq!(once.message_id(), p.message_id());
        let history = copy.replay_history();
        assert_eq!(history.len(), 1);
        assert_eq!(history[0].reason.as_deref(), Some("max attempts exceeded"));
        assert_eq!(history[0].attempts, Some(3));
        assert_eq!(
            history[0].first_failure.as_deref(),
            Some("2026-12-01T02:19:47.123Z")
        );

        // Dead-lettered again, then replayed again: two entries, oldest first.
        let mut again = once.clone();
        again.set_header(REASON_HEADER, text("permanent handler error"));
        let twice = DeadLetter::new(&again).replay_properties();
        let history = DeadLetter::new(&twice).replay_history();
        assert_eq!(history.len(), 2);
        assert_eq!(
            history[1].reason.as_deref(),
            Some("permanent handler error")
        );
    }

    #[test]
    fn the_replay_history_keeps_the_last_records_and_counts_every_replay() {
        let mut p = dead_letter_as_the_runtime_writes_it();
        let long_error = "e".repeat(4000);
        let start = UNIX_EPOCH + Duration::from_secs(1_796_091_587);
        let mut sizes = Vec::new();
        for pass in 0..12u64 {
            // Dead-lettered again with a long error, then replayed again.
            let mut dead = p.clone();
            dead.set_header(REASON_HEADER, text("permanent handler error"));
            dead.set_header(ERROR_HEADER, text(&long_error));
            p = DeadLetter::new(&dead).replay_properties_at(start + Duration::from_secs(pass));
            let history = DeadLetter::new(&p).header(REPLAY_HISTORY_HEADER).unwrap();
            sizes.push(history.len());
        }
        let copy = DeadLetter::new(&p);
        assert_eq!(copy.replay_count(), 12);
        let history = copy.replay_history();
        assert_eq!(history.len(), MAX_REPLAY_HISTORY);
        assert_eq!(
            history[0].replayed_at.as_deref(),
            Some("2026-12-01T02:19:54.000Z"),
            "the oldest kept is the 8th replay"
        );
        assert_eq!(copy.last_replayed(), Some(start + Duration::from_secs(11)));
        assert!(
            history
                .iter()
                .all(|r| r.error.as_ref().unwrap().len() == MAX_RECORDED_ERROR),
            "error texts are cut"
        );
        // Bounded: the header stops growing once the history is full.
        assert!(
            sizes[MAX_REPLAY_HISTORY..].windows(2).all(|w| w[0] == w[1]),
            "{sizes:?}"
        );
        assert!(*sizes.last().unwrap() < 4_000, "{sizes:?}");
    }

    #[test]
    fn a_history_written_before_the_count_counts_its_records() {
        let old = r#"[{"reason":"a"},{"reason":"b"}]"#;
        let p = properties(&[(REPLAY_HISTORY_HEADER, text(old))]);
        let dead = DeadLetter::new(&p);
        assert_eq!(dead.replay_count(), 2);
        assert_eq!(dead.last_replayed(), None);
        let once = dead.replay_properties();
        assert_eq!(DeadLetter::new(&once).replay_count(), 3);
        assert_eq!(DeadLetter::new(&once).replay_history().len(), 3);
    }
}
