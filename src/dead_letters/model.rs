//! The one model of a dead letter, whichever store keeps it (the
//! `dead_letters` table or a RabbitMQ DLQ): what operators list, group,
//! show, replay and purge.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Serialize, Serializer};

/// A letter's state (only the table keeps letters after a replay or a
/// discard; a letter in a RabbitMQ DLQ is always live).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LetterState {
    /// Waiting for an operator.
    Live,
    /// Staged in the outbox by a replay.
    Replayed,
    /// Discarded: kept for audit until reaped.
    Discarded,
}

impl LetterState {
    /// As stored and printed: `live`, `replayed`, `discarded`.
    pub fn as_str(self) -> &'static str {
        match self {
            LetterState::Live => "live",
            LetterState::Replayed => "replayed",
            LetterState::Discarded => "discarded",
        }
    }

    /// The state named `text` (as [`as_str`](Self::as_str) writes it).
    pub fn parse(text: &str) -> Option<LetterState> {
        [
            LetterState::Live,
            LetterState::Replayed,
            LetterState::Discarded,
        ]
        .into_iter()
        .find(|s| s.as_str() == text)
    }
}

impl fmt::Display for LetterState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which dead letters an operation concerns. `Default` is every live letter.
///
/// A RabbitMQ DLQ can only be read front to back, so on it only the queue,
/// the message ids, the reason, `until` and `limit` select; the other
/// fields need the table store (the operation says so).
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// The consumer that dead-lettered them (table store).
    pub consumer: Option<String>,
    /// Their work queue.
    pub queue: Option<String>,
    /// Their reason, as in `x-idempo-reason` (e.g. `permanent error`).
    pub reason: Option<String>,
    /// Their cause's fingerprint (table store).
    pub fingerprint: Option<String>,
    /// Their message ids (any of them).
    pub message_ids: Vec<String>,
    /// Their row ids (table store).
    pub ids: Vec<i64>,
    /// Last failed at or after this time (table store).
    pub since: Option<SystemTime>,
    /// Last failed before this time (a letter without a failure time is
    /// never selected by it).
    pub until: Option<SystemTime>,
    /// A SQL/JSON path their body (when it is JSON) must match, e.g.
    /// `$.account ? (@ == "alice")` (table store).
    pub body_path: Option<String>,
    /// Their state; `None` is [`LetterState::Live`].
    pub state: Option<LetterState>,
    /// Every state (then `state` is ignored; table store).
    pub any_state: bool,
    /// At most this many (`None`: 100 for a list, all for the others).
    pub limit: Option<i64>,
    /// Only letters with a row id above this (paging a list; table store).
    pub after_id: Option<i64>,
}

impl Filter {
    /// The live letters of one work queue.
    pub fn queue(queue: impl Into<String>) -> Self {
        Filter {
            queue: Some(queue.into()),
            ..Filter::default()
        }
    }

    /// Whether something besides the queue, the state and the limit
    /// selects (a replay or a discard of everything must say
    /// [`ReplayOptions::all`]).
    pub fn selects(&self) -> bool {
        self.consumer.is_some()
            || self.reason.is_some()
            || self.fingerprint.is_some()
            || !self.message_ids.is_empty()
            || !self.ids.is_empty()
            || self.since.is_some()
            || self.until.is_some()
            || self.body_path.is_some()
    }

    /// The first field only the table store can select by, by its name.
    pub(crate) fn table_only(&self) -> Option<&'static str> {
        [
            (self.fingerprint.is_some(), "fingerprint"),
            (self.consumer.is_some(), "consumer"),
            (self.since.is_some(), "since"),
            (self.body_path.is_some(), "body path"),
            (
                self.any_state || self.state.is_some_and(|s| s != LetterState::Live),
                "state",
            ),
            (!self.ids.is_empty(), "row id"),
            (self.after_id.is_some(), "row id"),
        ]
        .into_iter()
        .find_map(|(set, name)| set.then_some(name))
    }

    /// Whether `letter` is selected by the fields a DLQ can check.
    pub(crate) fn matches(&self, letter: &Letter) -> bool {
        let id_ok = self.message_ids.is_empty()
            || letter
                .message_id
                .as_ref()
                .is_some_and(|id| self.message_ids.contains(id));
        let reason_ok = self.reason.as_ref().is_none_or(|r| *r == letter.reason);
        let until_ok = self
            .until
            .is_none_or(|until| letter.last_failed_at.is_some_and(|t| t < until));
        id_ok && reason_ok && until_ok
    }
}

/// One dead letter, without its body and properties
/// ([`LetterDetail`] has them). Serialises as a line of
/// `idempo dlq list --json`, times in RFC 3339 (UTC).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Letter {
    /// Its row id in the table store (`None` in a RabbitMQ DLQ).
    pub id: Option<i64>,
    /// Its message id (`None`: it had no usable one).
    pub message_id: Option<String>,
    /// The consumer that dead-lettered it (`None`: idempo did not).
    pub consumer: Option<String>,
    /// The work queue it failed on.
    pub queue: Option<String>,
    /// The routing key it was first published with (or, for a foreign one,
    /// the one it reached the DLQ with).
    pub routing_key: String,
    /// Why (the `x-idempo-reason` text; `foreign` when idempo did not say).
    pub reason: String,
    /// What failed.
    pub error: Option<String>,
    /// Its cause's fingerprint: the reason and the error with ids, numbers
    /// and quoted values masked.
    pub fingerprint: String,
    /// Failed attempts.
    pub attempts: Option<u32>,
    /// How many times it reached the store (more than 1: a redelivered
    /// dead letter, counted by the table store).
    pub deliveries: u32,
    /// First failure.
    #[serde(serialize_with = "rfc3339")]
    pub first_failed_at: Option<SystemTime>,
    /// Last failure.
    #[serde(serialize_with = "rfc3339")]
    pub last_failed_at: Option<SystemTime>,
    /// Live, replayed or discarded.
    pub state: LetterState,
    /// How many times it was replayed.
    pub replay_count: u32,
    /// When it was last replayed (table store).
    #[serde(serialize_with = "rfc3339")]
    pub replayed_at: Option<SystemTime>,
    /// Who replayed it.
    pub replayed_by: Option<String>,
    /// The queue it was replayed to.
    pub replayed_to: Option<String>,
    /// When it was discarded.
    #[serde(serialize_with = "rfc3339")]
    pub discarded_at: Option<SystemTime>,
    /// Who discarded it.
    pub discarded_by: Option<String>,
    /// The body's size in bytes.
    pub body_bytes: u64,
    /// Whether idempo did not dead-letter it (no `x-idempo-reason`).
    pub foreign: bool,
    /// The transport it came from, where a replay sends it: `amqp` (always,
    /// in a RabbitMQ DLQ) or `nats`.
    pub transport: String,
}

/// One dead letter whole: [`Letter`], its routing, headers and body.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LetterDetail {
    /// What a list shows.
    pub letter: Letter,
    /// The exchange it was published to.
    pub exchange: String,
    /// Its headers, idempo's failure headers included, as JSON.
    pub headers: serde_json::Value,
    /// Its properties (`message_id`, `content_type`, and the transport's
    /// others), as JSON.
    pub properties: serde_json::Value,
    /// The body.
    pub body: Vec<u8>,
}

impl LetterDetail {
    /// The trace id of the message's creation context (its `traceparent`
    /// header), kept through every retry and replay: where to look for the
    /// failed attempts in a trace backend.
    pub fn trace_id(&self) -> Option<&str> {
        let traceparent = self.headers.get(crate::headers::TRACEPARENT_HEADER)?;
        crate::trace_id::trace_id(traceparent.as_str()?)
    }
}

/// Which letter [`DeadLetterStore::show`](crate::ops::dead_letters::DeadLetterStore::show)
/// shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LetterRef {
    /// The latest letter with this message id.
    MessageId(String),
    /// The letter of this row (table store).
    Row(i64),
}

/// The letters of one cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Group {
    /// The fingerprint.
    pub fingerprint: String,
    /// The work queue.
    pub queue: String,
    /// The reason.
    pub reason: String,
    /// How many letters.
    pub count: u64,
    /// The first failure of any of them.
    #[serde(serialize_with = "rfc3339")]
    pub first_seen: Option<SystemTime>,
    /// The last failure of any of them.
    #[serde(serialize_with = "rfc3339")]
    pub last_seen: Option<SystemTime>,
    /// The error of the latest of them.
    pub sample_error: String,
}

/// How a replay runs.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Who replays (recorded on each letter of the table store).
    pub by: String,
    /// Replay every letter the filter's queue holds (required when the
    /// filter selects nothing else: see [`Filter::selects`]).
    pub all: bool,
    /// The queue to publish to instead of each letter's work queue (the
    /// only target a foreign letter has).
    pub to: Option<String>,
    /// Replay letters whose id the consumer already processed too (with
    /// another body: the replay is dead-lettered again as a mismatch; with
    /// the same body: it is a duplicate).
    pub force: bool,
    /// Count what would be replayed; change nothing.
    pub dry_run: bool,
    /// A pause after each letter (spreads a large replay out; the table
    /// store then stages one letter per transaction).
    pub throttle: Option<Duration>,
}

impl ReplayOptions {
    /// Replays by `<tool>:<user>@<this host>` (for example
    /// `idempo-cli:alice@ops-1`), to each letter's work queue: who acts, as
    /// recorded on the letters (pass its `by` to a discard too).
    pub fn by_operator(tool: &str, user: &str) -> Self {
        Self::by(format!("{tool}:{user}@{}", crate::host::name()))
    }

    /// Replays by `who`, to each letter's work queue.
    pub fn by(who: impl Into<String>) -> Self {
        ReplayOptions {
            by: who.into(),
            all: false,
            to: None,
            force: false,
            dry_run: false,
            throttle: None,
        }
    }
}

/// Why a selected letter was not replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Refusal {
    /// Idempo did not dead-letter it, so it names no work queue, and
    /// [`ReplayOptions::to`] names none either.
    Foreign,
    /// Its consumer already processed its id with a different body: the
    /// copy would be dead-lettered again (unless [`ReplayOptions::force`]).
    PayloadMismatch,
    /// Its consumer processed its id (same body) since it was
    /// dead-lettered: the copy would be a duplicate (unless
    /// [`ReplayOptions::force`]).
    AlreadyProcessed,
    /// It was replayed after this replay started and failed again: a replay
    /// sends each letter once.
    ReplayedDuringRun,
    /// Its replay copy would not fit one frame of the connection.
    TooLarge,
    /// Its stored properties cannot be decoded.
    Undecodable,
    /// The queue it would be replayed to does not exist (start its
    /// consumer, which declares it, or replay to another).
    NoSuchQueue,
    /// The outbox refuses its copy (a routing key, id or property AMQP
    /// cannot carry).
    Unstageable,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refusal::Foreign => "foreign (no x-idempo-original-queue): it needs a target queue",
            Refusal::PayloadMismatch => "its id was already processed with a different payload",
            Refusal::AlreadyProcessed => "its id was processed since it was dead-lettered",
            Refusal::ReplayedDuringRun => {
                "it was replayed after this replay started and failed again"
            }
            Refusal::TooLarge => "its replay copy would not fit the connection's frame size",
            Refusal::Undecodable => "its stored properties cannot be decoded",
            Refusal::NoSuchQueue => "the queue to replay it to does not exist",
            Refusal::Unstageable => "the outbox refuses its copy (a name or id AMQP cannot carry)",
        })
    }
}

/// What a replay reports as it goes, in order.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum ReplayEvent<'a> {
    /// At most `total` letters will be looked at.
    Started {
        /// The letters selected (the table), or the DLQ's ready messages
        /// (at most the limit).
        total: u64,
    },
    /// A selected letter stays where it is.
    Skipped {
        /// Its id.
        message_id: Option<&'a str>,
        /// Its row (table store).
        row: Option<i64>,
        /// Why.
        refusal: Refusal,
    },
    /// A dry run would replay it to `queue`.
    WouldReplay {
        /// Its id.
        message_id: Option<&'a str>,
        /// Its work queue.
        queue: &'a str,
    },
    /// It was replayed to `queue`: published and confirmed (a DLQ), or
    /// staged in the outbox and committed (the table).
    Replayed {
        /// Its id.
        message_id: Option<&'a str>,
        /// Its work queue.
        queue: &'a str,
    },
}

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ReplayReport {
    /// Replayed (or, in a dry run, would have been).
    pub replayed: u64,
    /// Whether it was a dry run.
    pub dry_run: bool,
    /// Selected letters left where they are, per refusal.
    pub skipped: BTreeMap<Refusal, u64>,
}

impl ReplayReport {
    /// How many were skipped.
    pub fn skipped_total(&self) -> u64 {
        self.skipped.values().sum()
    }

    pub(crate) fn skip(&mut self, refusal: Refusal) {
        *self.skipped.entry(refusal).or_default() += 1;
    }
}

impl Serialize for Refusal {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Live letters of one consumer, queue and cause (in `ops::Status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LetterCount {
    /// The consumer.
    pub consumer: String,
    /// The work queue.
    pub queue: String,
    /// The cause.
    pub fingerprint: String,
    /// Its reason.
    pub reason: String,
    /// How many live letters.
    pub count: i64,
}

/// A time as RFC 3339 text (UTC, milliseconds), or null.
fn rfc3339<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.serialize_str(&crate::runtime::headers::rfc3339(*t)),
        None => s.serialize_none(),
    }
}

/// The time `micros` microseconds after the Unix epoch (before it: negative).
pub(crate) fn from_micros(micros: i64) -> SystemTime {
    let magnitude = Duration::from_micros(micros.unsigned_abs());
    if micros >= 0 {
        UNIX_EPOCH + magnitude
    } else {
        UNIX_EPOCH - magnitude
    }
}
