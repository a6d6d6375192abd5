//! [`Delivered`]: how the harness's consumer ended one delivery.

use std::fmt;
use std::time::Duration;

use crate::consumer::{DeadLetterReason, Message};
use crate::outbox::OutboxMessage;

/// How one delivery ended, as the runtime would have settled it: readable in
/// an assertion (`assert!(d.is_acked(), "{d}")`) and printed whole on failure.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Delivered {
    /// The handler ran and its transaction committed: acked.
    Acked {
        /// What this delivery's transaction staged in the outbox (in batch
        /// mode: its batch's), not yet published.
        staged: Vec<OutboxMessage>,
    },
    /// Already processed with the same body: acked without running the handler.
    Duplicate,
    /// The id was processed before with *another* body: the handler did not
    /// run, and the runtime dead-letters the delivery with reason
    /// [`DeadLetterReason::PayloadMismatch`].
    Mismatch {
        /// The error text of the dead letter.
        error: String,
        /// The dead letter, with idempo's headers.
        copy: Message,
    },
    /// A transient failure: the runtime republishes `copy` to a delay queue
    /// (or hands the delivery back, with a requeue policy) and acks.
    Retried {
        /// The delay the [`RedeliveryPolicy`](crate::consumer::RedeliveryPolicy)
        /// chose (the requeue pause with a requeue policy).
        delay: Duration,
        /// Failed attempts so far, this one included (0 with a requeue
        /// policy, which does not count them).
        attempt: u32,
        /// What failed.
        error: String,
        /// The copy the broker would deliver after the delay, with idempo's
        /// failure headers: deliver it to go on.
        copy: Message,
    },
    /// A final failure: the runtime publishes `copy` to the dead-letter
    /// queue with `reason` and acks.
    DeadLettered {
        /// Why.
        reason: DeadLetterReason,
        /// What failed.
        error: String,
        /// The dead letter, with idempo's headers (`x-idempo-reason`, ...).
        copy: Message,
    },
    /// The delivery waited at the database gate (PostgreSQL unreachable or
    /// read-only) longer than the harness's
    /// [`hold_timeout`](super::HarnessBuilder::hold_timeout): the runtime
    /// keeps it unacked until the database answers.
    Held,
}

impl Delivered {
    /// Acked after the handler's transaction committed.
    pub fn is_acked(&self) -> bool {
        matches!(self, Delivered::Acked { .. })
    }

    /// What this delivery's transaction staged in the outbox (empty unless
    /// [`Acked`](Delivered::Acked)).
    pub fn staged(&self) -> &[OutboxMessage] {
        match self {
            Delivered::Acked { staged } => staged,
            _ => &[],
        }
    }

    /// Acked as a duplicate, the handler not run.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Delivered::Duplicate)
    }

    /// The id was reused with another body.
    pub fn is_mismatch(&self) -> bool {
        matches!(self, Delivered::Mismatch { .. })
    }

    /// Retried later.
    pub fn is_retried(&self) -> bool {
        matches!(self, Delivered::Retried { .. })
    }

    /// Dead-lettered, a [`Mismatch`](Delivered::Mismatch) included.
    pub fn is_dead_lettered(&self) -> bool {
        matches!(
            self,
            Delivered::DeadLettered { .. } | Delivered::Mismatch { .. }
        )
    }

    /// The dead letter, if dead-lettered (a mismatch's too).
    pub fn dead_letter(&self) -> Option<&Message> {
        match self {
            Delivered::DeadLettered { copy, .. } | Delivered::Mismatch { copy, .. } => Some(copy),
            _ => None,
        }
    }

    /// Waiting at the database gate.
    pub fn is_held(&self) -> bool {
        matches!(self, Delivered::Held)
    }

    /// The dead letter's reason, if dead-lettered.
    pub fn dead_letter_reason(&self) -> Option<DeadLetterReason> {
        match self {
            Delivered::DeadLettered { reason, .. } => Some(*reason),
            Delivered::Mismatch { .. } => Some(DeadLetterReason::PayloadMismatch),
            _ => None,
        }
    }

    /// The retry's delay, if retried.
    pub fn retry_delay(&self) -> Option<Duration> {
        match self {
            Delivered::Retried { delay, .. } => Some(*delay),
            _ => None,
        }
    }

    /// The failed attempts counted so far, if retried.
    pub fn attempt(&self) -> Option<u32> {
        match self {
            Delivered::Retried { attempt, .. } => Some(*attempt),
            _ => None,
        }
    }

    /// What the broker would deliver next in place of this delivery: the
    /// retry copy. `None` for every other outcome.
    pub fn redelivery(&self) -> Option<Message> {
        match self {
            Delivered::Retried { copy, .. } => Some(copy.clone()),
            _ => None,
        }
    }

    /// The error text, for the failures.
    pub fn error(&self) -> Option<&str> {
        match self {
            Delivered::Mismatch { error, .. }
            | Delivered::Retried { error, .. }
            | Delivered::DeadLettered { error, .. } => Some(error),
            _ => None,
        }
    }
}

impl fmt::Display for Delivered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Delivered::Acked { staged } if staged.is_empty() => write!(f, "acked (processed)"),
            Delivered::Acked { staged } => {
                write!(f, "acked (processed), {} message(s) staged", staged.len())
            }
            Delivered::Duplicate => write!(f, "acked as a duplicate (handler not run)"),
            Delivered::Mismatch { error, .. } => {
                write!(f, "dead-lettered as a mismatch: {error}")
            }
            Delivered::Retried {
                delay,
                attempt,
                error,
                ..
            } => write!(f, "retried in {delay:?} (attempt {attempt}): {error}"),
            Delivered::DeadLettered { reason, error, .. } => {
                write!(f, "dead-lettered ({reason}): {error}")
            }
            Delivered::Held => write!(f, "held at the database gate (not acked)"),
        }
    }
}
