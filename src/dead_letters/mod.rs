//! Dead letters kept in PostgreSQL (features `amqp` + `outbox`): the
//! `dead_letters` table, written by a consumer configured with
//! [`DeadLetters::Table`], and the library
//! functions that list, group, show, replay, discard, purge and reap them
//! (used by the `idempo dlq` commands).
//!
//! After reading this page you can find the dead letters of one cause, look
//! at one, and replay them exactly once.
//!
//! # Why a table
//! A RabbitMQ dead-letter queue can only be read by taking messages off it
//! (and on RabbitMQ 4.x every such read of a quorum queue spends one of its
//! delivery attempts). A table answers "which letters of this queue failed
//! with this cause since 03:00" with an index, groups them by
//! **fingerprint** (the reason and the error text with ids, numbers and
//! quoted values masked: [`fingerprint`]), and makes a replay exactly once
//! by construction.
//!
//! # Replay, exactly once
//! [`replay`] takes the live letters of a selection in bounded batches; each
//! batch is one transaction that locks its letters (`FOR UPDATE SKIP
//! LOCKED`: two replays at once take different letters), **stages** each in
//! the [outbox](crate::outbox) under its original message id, and marks it
//! replayed. The relay publishes it after the commit. A replay killed
//! anywhere leaves each letter either replayed *and* staged, or untouched;
//! a second replay finds nothing live to take.
//!
//! ```no_run
//! use idempo::dead_letters::{self, Filter, ReplayOptions};
//! # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
//! let filter = Filter::queue("payments");
//! for group in dead_letters::groups(&pool, &filter).await? {
//!     println!("{} × {}: {}", group.count, group.reason, group.sample_error);
//! }
//! let one_cause = Filter { fingerprint: Some("3f2b8c1e0d4a4c7e".into()), ..Filter::queue("payments") };
//! let report = dead_letters::replay(&pool, &one_cause, &ReplayOptions::by("alice"), |_| {}).await?;
//! println!("{} replayed, {} skipped", report.replayed, report.skipped.len());
//! # Ok(()) }
//! ```

mod fingerprint;
mod table;

use std::time::SystemTime;

pub use fingerprint::fingerprint;
pub use table::{LetterState, count, discard, groups, list, purge, reap, replay, show};
#[cfg(feature = "ops")]
pub(crate) use table::{counts, holds, table_exists};

/// Live letters of one consumer, queue and cause (in `ops::Status`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
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
pub(crate) use table::{TableStore, insert};

/// Where a consumer puts its dead letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeadLetters {
    /// The RabbitMQ queue `<queue>.dlq` (or the one configured): the default.
    #[default]
    Queue,
    /// The `dead_letters` table, in a transaction of its own; the delivery
    /// is acked only after that commit, and waits while PostgreSQL cannot
    /// take it.
    Table,
}

/// Which dead letters a function concerns. `Default` is every live letter.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// The consumer that dead-lettered them.
    pub consumer: Option<String>,
    /// Their work queue.
    pub queue: Option<String>,
    /// Their reason, as in `x-idempo-reason` (e.g. `permanent error`).
    pub reason: Option<String>,
    /// Their fingerprint.
    pub fingerprint: Option<String>,
    /// Their message ids (any of them).
    pub message_ids: Vec<String>,
    /// Their row ids (any of them).
    pub ids: Vec<i64>,
    /// Last failed at or after this time.
    pub since: Option<SystemTime>,
    /// Last failed before this time.
    pub until: Option<SystemTime>,
    /// A SQL/JSON path their body (when it is JSON) must match, e.g.
    /// `$.account ? (@ == "alice")`.
    pub body_path: Option<String>,
    /// Their state; `None` is [`LetterState::Live`].
    pub state: Option<LetterState>,
    /// Every state (then `state` is ignored).
    pub any_state: bool,
    /// At most this many (lists and groups; `None`: 100 for [`list`], all
    /// for the others).
    pub limit: Option<i64>,
    /// Only letters with a row id above this (paging a list).
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
}

/// One dead letter, without its body and properties ([`show`] has them).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Letter {
    /// The row id.
    pub id: i64,
    /// The consumer that dead-lettered it.
    pub consumer: String,
    /// Its work queue.
    pub queue: String,
    /// Its message id (`None`: it had no usable one).
    pub message_id: Option<String>,
    /// Why (the `x-idempo-reason` text).
    pub reason: String,
    /// What failed.
    pub error: String,
    /// Its cause's fingerprint.
    pub fingerprint: String,
    /// Failed attempts.
    pub attempts: i32,
    /// How many times it arrived (more than 1: a redelivered dead letter).
    pub deliveries: i32,
    /// First failure (RFC 3339, UTC).
    pub first_failed_at: String,
    /// Last failure (RFC 3339, UTC).
    pub last_failed_at: String,
    /// `live`, `replayed` or `discarded`.
    pub state: String,
    /// How many times it was replayed.
    pub replay_count: i32,
    /// When, by whom and to where it was last replayed.
    pub replayed_at: Option<String>,
    /// Who replayed it.
    pub replayed_by: Option<String>,
    /// The queue it was replayed to.
    pub replayed_to: Option<String>,
    /// When and by whom it was discarded.
    pub discarded_at: Option<String>,
    /// Who discarded it.
    pub discarded_by: Option<String>,
    /// The body's size in bytes.
    pub body_bytes: i64,
}

/// One dead letter whole: [`Letter`], its routing, headers and body.
#[derive(Debug, Clone)]
pub struct LetterDetail {
    /// What [`list`] shows.
    pub letter: Letter,
    /// The exchange it was published to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// Its headers, idempo's failure headers included, as JSON.
    pub headers: serde_json::Value,
    /// Its AMQP properties.
    pub properties: lapin::BasicProperties,
    /// The body.
    pub body: Vec<u8>,
}

/// The letters of one cause.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Group {
    /// The fingerprint.
    pub fingerprint: String,
    /// The work queue.
    pub queue: String,
    /// The reason.
    pub reason: String,
    /// How many letters.
    pub count: i64,
    /// The first failure of any of them (RFC 3339, UTC).
    pub first_seen: String,
    /// The last failure of any of them.
    pub last_seen: String,
    /// The error of the latest of them.
    pub sample_error: String,
}

/// How [`replay`] replays.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Who replays (recorded on each letter).
    pub by: String,
    /// The queue to publish to instead of each letter's work queue.
    pub to: Option<String>,
    /// Replay letters whose id the consumer already processed too (with
    /// another body: the replay is dead-lettered again as a mismatch; with
    /// the same body: it is a duplicate).
    pub force: bool,
    /// Letters per transaction (default 100).
    pub batch_size: i64,
    /// Count what would be replayed; change nothing.
    pub dry_run: bool,
    /// A pause after each batch (spreads a large replay out).
    pub throttle: Option<std::time::Duration>,
}

impl ReplayOptions {
    /// Replays by `who`, to each letter's work queue, 100 per transaction.
    pub fn by(who: impl Into<String>) -> Self {
        ReplayOptions {
            by: who.into(),
            to: None,
            force: false,
            batch_size: 100,
            dry_run: false,
            throttle: None,
        }
    }
}

/// What [`replay`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReplayReport {
    /// Letters staged in the outbox and marked replayed (with `dry_run`:
    /// that would be).
    pub replayed: u64,
    /// Letters left alone, with why.
    pub skipped: Vec<(i64, String)>,
}
