//! The per-delivery state machine; the only code that acks, nacks or dead-letters.
//!
//! ```text
//! received ─► id ─► decode ─► BEGIN ─► claim ─┬─ Fresh ─► handler ─┬─ Ok ─► claim still ours? ─► COMMIT ─┬─ ok ─► ack
//!              │       │                      │                    │                                     └─ failed/unknown ─► requeue
//!              │       │                      ├─ Duplicate ─► ROLLBACK ─► ack
//!              │       │                      └─ Mismatch ──► ROLLBACK ─► dead-letter ─► ack
//!              │       └─ undecodable ─► dead-letter ─► ack  ├─ transient error / panic / timeout ─► ROLLBACK ─► requeue
//!              └─ missing/invalid ─► dead-letter ─► ack      └─ permanent error ─► ROLLBACK ─► dead-letter ─► ack
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
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span, field};

use super::dead_letter::{DeadLetterPublisher, DeadLetterReason};
use super::handler::{BoxedHandler, HandlerError, PreparedCall, Tx};
use super::stats::{Counter, Stats};
use super::{DecodeError, Message, MessageIdSource};
use crate::inbox::{self, Claim, InvalidMessageId};

/// The claim relies on READ COMMITTED (a duplicate's follow-up read must see
/// the row another transaction just committed), whatever the database default.
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Everything a delivery task needs, shared by all tasks of one consumer.
pub(crate) struct Pipeline {
    pub(crate) consumer: String,
    pub(crate) pool: PgPool,
    pub(crate) handler: BoxedHandler,
    pub(crate) message_id: MessageIdSource,
    pub(crate) requeue_delay: Duration,
    pub(crate) handler_timeout: Duration,
    pub(crate) dead_letters: DeadLetterPublisher,
    /// Fired when the dead-letter channel is gone: the consumer must stop.
    pub(crate) broken: CancellationToken,
    pub(crate) stats: Stats,
}

/// What the claim, the handler and the commit decided.
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
                    // Decode before touching the database: a bad body is final.
                    match (self.handler)(message.clone()) {
                        Ok(call) => self.decide(&message, call).await,
                        Err(e) => undecodable(&e),
                    }
                }
                Err(e) => invalid_id(e),
            };
            let settled = self.settle(&acker, &message, outcome).await;
            Span::current().record("outcome", settled);
        }
        .instrument(span)
        .await
    }

    /// Claims, runs the handler and commits; says how to settle the delivery.
    async fn decide(&self, message: &Message, call: PreparedCall) -> Outcome {
        let id = message.id();
        let mut tx = match self.pool.begin_with(BEGIN).await {
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
        let result = tokio::time::timeout(
            self.handler_timeout,
            AssertUnwindSafe(call(tx.clone())).catch_unwind(),
        )
        .await;
        let Some(tx) = tx.take() else {
            // The guard lives on in a task the handler spawned; the
            // transaction rolls back when that guard is dropped.
            return retry(
                "handler finished while a task it spawned still holds the transaction",
                "rolled back",
            );
        };
        match result {
            Ok(Ok(Ok(()))) => self.commit(tx, id).await,
            Ok(Ok(Err(e))) => {
                rollback(tx).await;
                handler_failed(e)
            }
            Ok(Err(panic)) => {
                rollback(tx).await;
                retry("handler panicked", panic_message(&*panic))
            }
            Err(_) => {
                rollback(tx).await;
                retry(
                    "handler timed out after",
                    format!("{:?}", self.handler_timeout),
                )
            }
        }
    }

    async fn commit(&self, mut tx: Transaction<'static, Postgres>, id: &str) -> Outcome {
        // COMMIT of an aborted transaction (a handler that ignored a failed
        // statement) reports success while it rolls back; a handler that ran
        // ROLLBACK itself leaves nothing to commit. Check the claim is still ours.
        let ours =
            sqlx::query("SELECT 1 FROM processed_messages WHERE consumer = $1 AND message_id = $2")
                .bind(&self.consumer)
                .bind(id)
                .fetch_optional(&mut *tx)
                .await;
        match ours {
            Ok(Some(_)) => {}
            Ok(None) => {
                rollback(tx).await;
                return retry(
                    "the handler ended the transaction itself",
                    "its writes and the claim are gone",
                );
            }
            Err(e) => {
                rollback(tx).await;
                return retry(
                    "the handler left the transaction aborted (did it ignore a failed statement?)",
                    e,
                );
            }
        }
        match tx.commit().await {
            Ok(()) => Outcome::Processed,
            Err(e) => {
                // Maybe committed, maybe not: never ack. The redelivery is
                // either claimed as a duplicate or processed afresh.
                self.stats.incr(Counter::CommitFailures);
                retry("commit failed or its outcome is unknown", e)
            }
        }
    }

    /// Acks, dead-letters or requeues, and says which it did. Nothing is acked
    /// before its effects (or its dead letter) are durable.
    async fn settle(&self, acker: &Acker, message: &Message, outcome: Outcome) -> &'static str {
        match outcome {
            Outcome::Processed => {
                self.stats.incr(Counter::Processed);
                ack(acker).await;
                "processed"
            }
            Outcome::Duplicate => {
                self.stats.incr(Counter::Duplicates);
                tracing::debug!("duplicate acknowledged without running the handler");
                ack(acker).await;
                "duplicate"
            }
            Outcome::DeadLetter { reason, error } => {
                match self.dead_letters.publish(message, reason, &error).await {
                    Ok(()) => {
                        self.stats.incr(Counter::DeadLettered);
                        tracing::warn!(%reason, %error, "dead-lettered");
                        ack(acker).await;
                        "dead_lettered"
                    }
                    Err(e) => {
                        tracing::error!(%reason, error = %e, "cannot dead-letter; requeueing");
                        if !self.dead_letters.is_open().await {
                            self.broken.cancel();
                        }
                        self.requeue(acker).await;
                        "retried"
                    }
                }
            }
            Outcome::Retry { error } => {
                tracing::warn!(%error, "transient failure; the delivery will be retried");
                self.requeue(acker).await;
                "retried"
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
        match acker.nack(nack).await {
            Ok(true) => {}
            // The channel is gone: the broker requeues every unacked delivery.
            Ok(false) => {
                tracing::warn!("nack not sent (channel closed); the broker will redeliver")
            }
            Err(e) => tracing::warn!(error = %e, "nack failed; the broker will redeliver"),
        }
    }
}

async fn ack(acker: &Acker) {
    // Either way the work is durable; the redelivery will be claimed as a duplicate.
    match acker.ack(BasicAckOptions::default()).await {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!("ack not sent (channel closed); the redelivery will be deduplicated")
        }
        Err(e) => {
            tracing::warn!(error = %e, "ack failed; the redelivery will be deduplicated")
        }
    }
}

async fn rollback(tx: Transaction<'static, Postgres>) {
    if let Err(e) = tx.rollback().await {
        // A broken connection rolls back by itself on the server.
        tracing::debug!(error = %e, "rollback failed");
    }
}

fn handler_failed(e: HandlerError) -> Outcome {
    // `msg.json()?` inside a handler: a body that cannot decode never will,
    // whatever kind the `?` conversion gave the error.
    if let Some(decode) = e.source().downcast_ref::<DecodeError>() {
        undecodable(decode)
    } else if e.is_permanent() {
        Outcome::DeadLetter {
            reason: DeadLetterReason::PermanentError,
            error: e.to_string(),
        }
    } else {
        retry("handler failed", e)
    }
}

fn undecodable(e: &DecodeError) -> Outcome {
    Outcome::DeadLetter {
        reason: DeadLetterReason::UndecodableBody,
        error: e.to_string(),
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
