//! A session's deliveries on their way, over lapin: [`Pipeline::run`] has
//! the `Router` (`route.rs`) give each delivery its id, its outcome and its
//! route, and `settle`s every delivery: the only code that acks, nacks,
//! retries or dead-letters.
//!
//! ```text
//! received ─► id ─┬─ missing/invalid ─► DeadLetter
//!                 └─ decide (steps.rs) ─► Outcome
//! settle = Processed, Duplicate ─► ack (batch mode: one multiple ack over settled tags)
//!          DeadLetter ─► publish to <queue>.dlq (confirmed; headers trimmed to fit the frame) ─► ack
//!                        even idempo's headers do not fit ─► reject: the broker dead-letters it
//!          Retry whose copy does not fit the frame ─► DeadLetter (headers too large to retry)
//!          Retry ─► publish to <queue>.retry.<delay> (confirmed) ─► ack; attempts used up: DeadLetter;
//!                   requeue policy: pause ─► nack(requeue)
//!          a copy that is not confirmed ─► pause ─► nack(requeue): never acked
//!          Abandoned ─► nothing: the delivery returns when its channel closes
//! ```

use std::sync::Arc;
use std::time::Duration;

use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::types::AMQPValue;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span, field};

use super::Message;
use crate::amqp::acks::{AckTracker, Misplaced};
use crate::amqp::publish::PublishError;
use crate::amqp::republish::Republisher;
use crate::runtime::dead_letter::DeadLetterReason;
use crate::runtime::headers::{Failures, REASON_HEADER};
use crate::runtime::health::Health;
use crate::runtime::outcome::{Abandon, Settled};
#[cfg(feature = "outbox")]
use crate::runtime::route::Stored;
use crate::runtime::route::{Route, Router};
use crate::runtime::stats::{Counter, Stats};

/// A pause before handing a delivery back with nack when no confirmed
/// republish was possible, so a failing broker path is not hammered.
const FALLBACK_PAUSE: Duration = Duration::from_secs(1);

/// Everything a session's delivery tasks share.
pub(crate) struct Pipeline {
    /// Ids, decisions and routes: the transport-free part.
    pub(crate) router: Arc<Router>,
    pub(crate) dead_letter_queue: String,
    /// Whether the runtime declares its queues (and so may declare a missing
    /// one again).
    pub(crate) declare: bool,
    /// Copies to delay queues and to the DLQ, confirmed before the ack.
    pub(crate) republisher: Republisher,
    /// Batch mode: coalesced acks for this session's channel.
    pub(crate) coalesced: Option<AckTracker>,
    /// Fired when the session must end (republishing channels gone, a tag
    /// the ack bookkeeping cannot place).
    pub(crate) broken: CancellationToken,
    /// Fired on shutdown: deliveries waiting for the database give up.
    pub(crate) shutdown: CancellationToken,
    pub(crate) health: Health,
    pub(crate) stats: Stats,
    pub(crate) log_limit: LogLimit,
}

/// Lets a repeated log line through once per interval.
#[derive(Debug, Default)]
pub(crate) struct LogLimit {
    last: std::sync::Mutex<Option<std::time::Instant>>,
}

impl LogLimit {
    const EVERY: Duration = Duration::from_secs(10);

    fn allow(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        match *last {
            Some(at) if now.duration_since(at) < Self::EVERY => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

/// One delivery on its way: the message and what settles it.
struct Item {
    message: Message,
    acker: Acker,
}

impl Pipeline {
    /// Takes a unit of deliveries (one, or a batch) through the steps and
    /// settles each, inside a span that records the outcome.
    pub(crate) async fn run(
        self: Arc<Self>,
        deliveries: Vec<lapin::message::Delivery>,
    ) -> Vec<Settled> {
        let span = match deliveries.as_slice() {
            [one] => tracing::info_span!(
                "delivery",
                consumer = %self.router.consumer,
                message_id = field::Empty,
                delivery_tag = one.delivery_tag,
                redelivered = one.redelivered,
                outcome = field::Empty,
            ),
            many => {
                tracing::info_span!("batch", consumer = %self.router.consumer, size = many.len())
            }
        };
        async {
            let mut ackers = Vec::with_capacity(deliveries.len());
            let mut messages: Vec<Message> = deliveries
                .into_iter()
                .map(|delivery| {
                    self.stats.incr(Counter::Deliveries);
                    ackers.push(delivery.acker.clone());
                    Message::from_delivery(delivery)
                })
                .collect();
            // The unit's deliveries share a channel: the first one's tells
            // when it closed.
            let abandon = Abandon {
                shutdown: self.shutdown.clone(),
                channel: ackers.first().cloned(),
            };
            let outcomes = self.router.outcomes(&mut messages, &abandon).await;
            if let [message] = messages.as_slice() {
                Span::current().record("message_id", message.id());
            }
            let items = messages
                .into_iter()
                .zip(ackers)
                .map(|(message, acker)| Item { message, acker })
                .collect();
            let routes = outcomes
                .into_iter()
                .zip(&items)
                .map(|(outcome, item): (_, &Item)| self.router.route(&item.message, outcome))
                .collect();
            let settled = self.settle(items, routes).await;
            if let [one] = settled.as_slice() {
                Span::current().record("outcome", one.as_str());
            }
            settled
        }
        .instrument(span)
        .await
    }

    /// Carries out each delivery's route, and says what it did. Nothing is
    /// acked before its effects, its retry copy or its dead letter are
    /// durable. In batch mode, processed and duplicate deliveries are acked
    /// together with one multiple ack, once every lower tag is settled.
    async fn settle(&self, items: Vec<Item>, routes: Vec<Route>) -> Vec<Settled> {
        let mut settled = Vec::with_capacity(items.len());
        let mut tags: Vec<(u64, Option<Acker>)> = Vec::with_capacity(items.len());
        for (item, route) in items.into_iter().zip(routes) {
            let tag = item.message.delivery_tag();
            let done = match route {
                Route::Ack { duplicate } => {
                    let (counter, done) = if duplicate {
                        tracing::debug!("duplicate acknowledged without running the handler");
                        (Counter::Duplicates, Settled::Duplicate)
                    } else {
                        (Counter::Processed, Settled::Processed)
                    };
                    self.stats.incr(counter);
                    if self.coalesced.is_some() {
                        tags.push((tag, Some(item.acker)));
                    } else {
                        ack(&item.acker, false).await;
                    }
                    settled.push(done);
                    continue;
                }
                Route::DeadLetter {
                    reason,
                    error,
                    failures,
                } => self.dead_letter(&item, reason, &error, failures).await,
                Route::Delay {
                    queue,
                    delay,
                    error,
                    failures,
                } => self.delay(&item, &queue, delay, &error, failures).await,
                Route::Requeue { pause, error } => {
                    tracing::warn!(%error, "transient failure; requeueing");
                    self.stats.incr(Counter::Retried);
                    nack_after(&item.acker, pause).await;
                    Settled::Retried
                }
                // Never recorded: no multiple ack may cover it.
                Route::Abandon => {
                    settled.push(Settled::Abandoned);
                    continue;
                }
            };
            if done == Settled::Abandoned {
                settled.push(done);
                continue;
            }
            tags.push((tag, None));
            settled.push(done);
        }
        if let Some(tracker) = &self.coalesced {
            let mut acks = tracker.lock().await;
            match acks.record(tags) {
                // Sent under the lock: multiple acks leave in increasing order.
                Ok(Some(acker)) => ack(&acker, true).await,
                Ok(None) => {}
                Err(Misplaced(tag)) => {
                    tracing::error!(
                        tag,
                        watermark = acks.watermark(),
                        "delivery tag reported twice or out of range; reconnecting"
                    );
                    self.broken.cancel();
                }
            }
        }
        settled
    }

    /// Republishes a copy to the delay queue, then acks the original.
    async fn delay(
        &self,
        item: &Item,
        queue: &str,
        delay: Duration,
        error: &str,
        failures: Failures,
    ) -> Settled {
        let headers = self
            .router
            .failure_headers(&item.message, error, &failures)
            .await;
        let mut published = self
            .republisher
            .publish(queue, &item.message, headers.clone())
            .await;
        if let Err(PublishError::Returned(_)) = &published {
            // The delay queue is gone (deleted by hand). Retry through
            // the work queue itself, with the attempt counted, so
            // that the attempts still run out; a pause stands in for
            // the delay.
            self.missing_queue(queue);
            tokio::time::sleep(FALLBACK_PAUSE).await;
            published = self
                .republisher
                .publish(&self.router.queue, &item.message, headers)
                .await;
        }
        match published {
            Ok(()) => {
                tracing::warn!(%error, attempts = failures.attempts, ?delay, "transient failure; retrying later");
                self.stats.incr(Counter::Retried);
                ack(&item.acker, false).await;
            }
            // Sent, it would close the connection, and the original
            // would come back to fail the same way: it never can be
            // retried.
            Err(e @ PublishError::TooLarge { .. }) => {
                let error = format!("{e}; the last failure: {error}");
                return self
                    .dead_letter(item, DeadLetterReason::HeadersTooLarge, &error, failures)
                    .await;
            }
            Err(e) => {
                let error = format!("cannot publish the retry to {queue:?}: {e}");
                self.publish_failed(&item.acker, error).await;
            }
        }
        Settled::Retried
    }

    async fn dead_letter(
        &self,
        item: &Item,
        reason: DeadLetterReason,
        error: &str,
        failures: Failures,
    ) -> Settled {
        #[cfg(feature = "outbox")]
        if self.router.dead_letters_to_table() {
            let abandon = Abandon {
                shutdown: self.shutdown.clone(),
                channel: Some(item.acker.clone()),
            };
            match self
                .router
                .store_dead_letter(&item.message, reason, error, &failures, &abandon)
                .await
            {
                Stored::Yes => {
                    self.stats.incr(Counter::DeadLettered);
                    tracing::warn!(%reason, %error, "dead-lettered to the table");
                    ack(&item.acker, false).await;
                    return Settled::DeadLettered;
                }
                Stored::Abandoned => return Settled::Abandoned,
                Stored::Refused(e) => {
                    let refused = format!(
                        "the dead-letter table refused the letter ({e}); sending it to the queue"
                    );
                    tracing::error!(error = %refused);
                    self.health.record_error(refused);
                }
            }
        }
        let mut headers = self
            .router
            .failure_headers(&item.message, error, &failures)
            .await;
        headers.push((REASON_HEADER, AMQPValue::LongString(reason.as_str().into())));
        match self
            .republisher
            .publish_trimmed(&self.dead_letter_queue, &item.message, headers)
            .await
        {
            Ok(trimmed) => {
                self.stats.incr(Counter::DeadLettered);
                if trimmed.is_empty() {
                    tracing::warn!(%reason, %error, "dead-lettered");
                } else {
                    tracing::warn!(%reason, %error, ?trimmed, "dead-lettered with headers trimmed to fit the frame size");
                }
                ack(&item.acker, false).await;
                Settled::DeadLettered
            }
            Err(e @ PublishError::TooLarge { .. }) => {
                // Even idempo's own headers do not fit (a tiny frame size):
                // the broker's own dead-lettering (the work queue's
                // dead-letter exchange) moves the original as it is.
                let error = format!("cannot dead-letter ({reason}): {e}; rejecting the original");
                tracing::error!(%error);
                self.health.record_error(error);
                self.stats.incr(Counter::DeadLettered);
                reject(&item.acker).await;
                Settled::DeadLettered
            }
            Err(e) => {
                if let PublishError::Returned(_) = e {
                    self.missing_queue(&self.dead_letter_queue);
                }
                let error = format!(
                    "cannot dead-letter ({reason}) to {:?}: {e}",
                    self.dead_letter_queue
                );
                self.publish_failed(&item.acker, error).await;
                Settled::Retried
            }
        }
    }

    /// A copy was returned as unroutable: `queue` is gone (an operator
    /// deleted it). When the runtime declares its queues, a new session
    /// declares them again; otherwise only a human can create it.
    fn missing_queue(&self, queue: &str) {
        let error = if self.declare {
            self.broken.cancel();
            format!("queue {queue:?} is missing; reconnecting to declare the topology again")
        } else {
            format!(
                "queue {queue:?} does not exist, and this consumer does not declare queues \
                 (declare(false)): create it"
            )
        };
        tracing::warn!(%error);
        self.health.record_error(error);
    }

    /// No confirmed copy: hand the original back instead. If the publishing
    /// channels are gone, the session must reconnect.
    async fn publish_failed(&self, acker: &Acker, error: String) {
        // At ERROR once every 10 s: a missing queue fails every copy.
        if self.log_limit.allow() {
            tracing::error!(%error, "requeueing the original instead");
        } else {
            tracing::debug!(%error, "requeueing the original instead");
        }
        self.health.record_error(error);
        if !self.republisher.is_open() {
            self.broken.cancel();
        }
        self.stats.incr(Counter::Retried);
        self.stats.incr(Counter::PublishFailures);
        nack_after(acker, FALLBACK_PAUSE).await;
    }
}

/// Hands the delivery back after a pause, so a failing dependency is not
/// hammered in a tight redelivery loop.
async fn nack_after(acker: &Acker, pause: Duration) {
    tokio::time::sleep(pause).await;
    let nack = BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    };
    match acker.nack(nack).await {
        Ok(true) => {}
        // The channel is gone: the broker requeues every unacked delivery.
        Ok(false) => tracing::warn!("nack not sent (channel closed); the broker will redeliver"),
        Err(e) => tracing::warn!(error = %e, "nack failed; the broker will redeliver"),
    }
}

/// Rejects without requeue: the queue's dead-letter exchange takes it.
async fn reject(acker: &Acker) {
    match acker.reject(BasicRejectOptions { requeue: false }).await {
        Ok(true) => {}
        Ok(false) => tracing::warn!("reject not sent (channel closed); the broker will redeliver"),
        Err(e) => tracing::warn!(error = %e, "reject failed; the broker will redeliver"),
    }
}

async fn ack(acker: &Acker, multiple: bool) {
    // Either way the work is durable; the redelivery will be claimed as a duplicate.
    match acker.ack(BasicAckOptions { multiple }).await {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!("ack not sent (channel closed); the redelivery will be deduplicated")
        }
        Err(e) => {
            tracing::warn!(error = %e, "ack failed; the redelivery will be deduplicated")
        }
    }
}
