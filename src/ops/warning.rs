//! What `idempo status` warns an operator about: each [`Warning`] and its
//! text (the JSON output carries the text).

use std::fmt;
use std::time::Duration;

use serde::{Serialize, Serializer};

use super::short_duration;

/// Something an operator must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Warning {
    /// The inbox table does not exist: the migrations did not run.
    NotMigrated,
    /// The claims are deleted before every copy of their messages can have
    /// come back: a late redelivery would be processed again.
    RetentionTooShort {
        /// The retention.
        retention: Duration,
        /// The redelivery horizon: `retries + consumer_timeout`.
        horizon: Duration,
        /// The longest the retries can take: every retry at the longest
        /// delay (a handler may ask for it).
        retries: Duration,
        /// The broker's `consumer_timeout`.
        consumer_timeout: Duration,
    },
    /// A DLQ holds messages (only with [`StatusOptions::fail_on_dlq`](super::StatusOptions::fail_on_dlq)).
    DeadLetters {
        /// The DLQ.
        dlq: String,
        /// How many.
        ready: u32,
    },
    /// The outbox relay gave up on messages.
    OutboxFailed {
        /// How many.
        failed: i64,
    },
    /// The dead-letter table holds live letters of a queue (only with
    /// [`StatusOptions::fail_on_dlq`](super::StatusOptions::fail_on_dlq)).
    TableDeadLetters {
        /// The work queue.
        queue: String,
        /// How many.
        count: i64,
    },
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Warning::NotMigrated => {
                f.write_str("idempo's tables do not exist: run `idempo migrate`")
            }
            Warning::RetentionTooShort {
                retention,
                horizon,
                retries,
                consumer_timeout,
            } => write!(
                f,
                "retention {} is shorter than the redelivery horizon {} (retries {} + consumer_timeout {}): \
                 a late redelivery would be processed again",
                short_duration(*retention),
                short_duration(*horizon),
                short_duration(*retries),
                short_duration(*consumer_timeout)
            ),
            Warning::DeadLetters { dlq, ready } => write!(f, "{dlq} holds {ready} dead letter(s)"),
            Warning::OutboxFailed { failed } => write!(
                f,
                "the outbox holds {failed} failed message(s) the relay gave up on"
            ),
            Warning::TableDeadLetters { queue, count } => write!(
                f,
                "the dead_letters table holds {count} live dead letter(s) of {queue}"
            ),
        }
    }
}

/// A warning serialises as its text.
impl Serialize for Warning {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}
