//! The per-delivery state machine; the only code that acks, nacks or dead-letters.
//!
//! ```text
//! received ─► id extracted ─► BEGIN ─► claim ─┬─ Fresh ─► handler ─┬─ Ok ─► COMMIT ─┬─ ok ─► ack
//!    │                                        │                    │                └─ failed/unknown ─► requeue
//!    │                                        ├─ Duplicate ─► ROLLBACK ─► ack       ├─ transient error / panic ─► ROLLBACK ─► requeue
//!    │                                        └─ Mismatch ──► ROLLBACK ─► dead-letter ─► ack
//!    └─ no/invalid id ─► dead-letter ─► ack          └─ permanent error / undecodable ─► ROLLBACK ─► dead-letter ─► ack
//! ```
//!
//! Dropping the future (shutdown timeout) at any `.await` is safe: before the
//! commit, the transaction rolls back when dropped and the unacked delivery
//! returns to the queue when the channel closes; during or after the commit,
//! the redelivery is claimed as a duplicate and acknowledged.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use sqlx::{PgPool, Postgres, Transaction};
use tracing::{Instrument, Span, field};

use super::dead_letter::{self, DeadLetterReason};
use super::handler::{BoxedHandler, Failure, Tx};
use super::stats::{Counter, Stats};
use super::{DecodeError, Message, MessageIdSource};
use crate::inbox::{self, Claim, InvalidMessageId};

/// Everything a delivery task needs, shared by all tasks of one consumer.
pub(crate) struct Pipeline {
    pub(crate) consumer: String,
    pub(crate) queue: String,
    pub(crate) dead_letter_queue: String,
    pub(crate) pool: PgPool,
    pub(crate) handler: BoxedHandler,
    pub(crate) message_id: MessageIdSource,
    pub(crate) requeue_delay: Duration,
    /// A channel in confirm mode, for dead letters.
    pub(crate) dead_letters: lapin::Channel,
    pub(crate) stats: Stats,
}

/// Where a delivery ends.
#[derive(Debug)]
enum Outcome {
    /// The handler ran and its transaction committed: ack.
    Processed,
    /// Already processed with the same body: ack without running the handler.
    Duplicate,
    /// Final failure: publish to the DLQ (confirmed), then ack.
    DeadLetter {
        reason: DeadLetterReason,
        error: String,
    },
    /// Might succeed later: hand back to the broker after a delay.
    Retry { error: String },
}

impl Outcome {
    fn name(&self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::DeadLetter { .. } => "dead_lettered",
            Outcome::Retry { .. } => "retried",
        }
    }
}

impl Pipeline {
    /// Processes one delivery to its end, inside a span that records its outcome.
    pub(crate) async fn run(self: Arc<Self>, delivery: lapin::message::Delivery) {
        self.stats.incr(Counter::Deliveries);
        let acker = delivery.acker.clone();
        let mut message = Message::from_delivery(delivery);
        let span = tracing::info_span!(
            "delivery",
            consumer = %self.consumer,
            message_id = field::Empty,
            delivery_tag = message.delivery_tag(),
            redelivered = message.redelivered(),
            outcome = field::Empty,
        );
        async {
            let outcome = match self.message_id.extract(&message) {
                Ok(id) => {
                    Span::current().record("message_id", id.as_str());
                    message.set_id(id);
                    self.decide(&message).await
                }
                Err(e) => invalid_id(e),
            };
            Span::current().record("outcome", outcome.name());
            self.settle(&acker, &message, outcome).await;
        }
        .instrument(span)
        .await
    }

    /// Claims, runs the handler and commits; says how to settle the delivery.
    async fn decide(&self, message: &Message) -> Outcome {
        let id = message.id();
        let mut tx = match self.pool.begin().await {
            Ok(tx) => tx,
            Err(e) => return retry("cannot begin a transaction", e),
        };
        match inbox::claim(&mut tx, &self.consumer, id, message.body()).await {
            Err(e) => return retry("claim failed", e),
            Ok(Claim::Duplicate) => {
                rollback(tx).await;
                return Outcome::Duplicate;
            }
            Ok(Claim::Mismatch) => {
                rollback(tx).await;
                self.stats.incr(Counter::PayloadMismatches);
                tracing::warn!(message_id = %id, "message id reused with a different payload");
                return Outcome::DeadLetter {
                    reason: DeadLetterReason::PayloadMismatch,
                    error: format!(
                        "message id {id:?} was already processed by {:?} with a different body",
                        self.consumer
                    ),
                };
            }
            Ok(Claim::Fresh) => {}
        }

        let tx = Tx::new(tx);
        let result = AssertUnwindSafe((self.handler)(tx.clone(), message.clone()))
            .catch_unwind()
            .await;
        let Some(tx) = tx.take().await else {
            unreachable!("only the runtime takes the transaction");
        };
        match result {
            Ok(Ok(())) => match tx.commit().await {
                Ok(()) => Outcome::Processed,
                Err(e) => {
                    // Maybe committed, maybe not: never ack. The redelivery is
                    // either claimed as a duplicate or processed afresh.
                    self.stats.incr(Counter::CommitFailures);
                    retry("commit failed or its outcome is unknown", e)
                }
            },
            Ok(Err(Failure::Decode(e))) => {
                rollback(tx).await;
                Outcome::DeadLetter {
                    reason: DeadLetterReason::UndecodableBody,
                    error: e.to_string(),
                }
            }
            Ok(Err(Failure::Handler(e))) => {
                rollback(tx).await;
                // `msg.json()?` inside a handler: a body that cannot decode
                // never will, whatever kind the `?` conversion gave it.
                if let Some(decode) = e.source().downcast_ref::<DecodeError>() {
                    Outcome::DeadLetter {
                        reason: DeadLetterReason::UndecodableBody,
                        error: decode.to_string(),
                    }
                } else if e.is_permanent() {
                    Outcome::DeadLetter {
                        reason: DeadLetterReason::PermanentError,
                        error: e.to_string(),
                    }
                } else {
                    retry("handler failed", e)
                }
            }
            Err(panic) => {
                rollback(tx).await;
                Outcome::Retry {
                    error: format!("handler panicked: {}", panic_message(&*panic)),
                }
            }
        }
    }

    /// Acks, dead-letters or requeues. Nothing is acked before its effects
    /// (or its dead letter) are durable.
    async fn settle(&self, acker: &Acker, message: &Message, outcome: Outcome) {
        match outcome {
            Outcome::Processed => {
                self.stats.incr(Counter::Processed);
                ack(acker).await;
            }
            Outcome::Duplicate => {
                self.stats.incr(Counter::Duplicates);
                tracing::debug!("duplicate acknowledged without running the handler");
                ack(acker).await;
            }
            Outcome::DeadLetter { reason, error } => {
                let published = dead_letter::publish(
                    &self.dead_letters,
                    &self.dead_letter_queue,
                    &self.consumer,
                    &self.queue,
                    message,
                    reason,
                    &error,
                )
                .await;
                match published {
                    Ok(()) => {
                        self.stats.incr(Counter::DeadLettered);
                        tracing::warn!(%reason, %error, "dead-lettered");
                        ack(acker).await;
                    }
                    Err(e) => {
                        tracing::error!(%reason, error = %e, "cannot dead-letter; requeueing");
                        self.requeue(acker).await;
                    }
                }
            }
            Outcome::Retry { error } => {
                tracing::warn!(%error, "transient failure; the delivery will be retried");
                self.requeue(acker).await;
            }
        }
    }

    /// Hands the delivery back after a pause, so a failing dependency is not
    /// hammered in a tight redelivery loop.
    async fn requeue(&self, acker: &Acker) {
        self.stats.incr(Counter::Retried);
        tokio::time::sleep(self.requeue_delay).await;
        let nack = BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        };
        if let Err(e) = acker.nack(nack).await {
            // The channel is gone: the broker requeues every unacked delivery.
            tracing::warn!(error = %e, "nack failed; the broker will redeliver");
        }
    }
}

async fn ack(acker: &Acker) {
    if let Err(e) = acker.ack(BasicAckOptions::default()).await {
        // The work is committed; the redelivery will be claimed as a duplicate.
        tracing::warn!(error = %e, "ack failed after commit; the redelivery will be deduplicated");
    }
}

async fn rollback(tx: Transaction<'static, Postgres>) {
    if let Err(e) = tx.rollback().await {
        // A broken connection rolls back by itself on the server.
        tracing::debug!(error = %e, "rollback failed");
    }
}

fn invalid_id(e: InvalidMessageId) -> Outcome {
    let reason = match e {
        InvalidMessageId::Missing => DeadLetterReason::MissingMessageId,
        _ => DeadLetterReason::InvalidMessageId,
    };
    Outcome::DeadLetter {
        reason,
        error: e.to_string(),
    }
}

fn retry(context: &str, e: impl std::fmt::Display) -> Outcome {
    Outcome::Retry {
        error: format!("{context}: {e}"),
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s
    } else {
        "non-string panic payload"
    }
}
