//! A session's deliveries on their way, over lapin: [`Pipeline::run`] has
//! the `Router` give each delivery its id, its outcome and its route, and
//! the runtime's `Settle` carries the routes out through [`Pipeline`]'s
//! [`Transport`]: the only code that acks, nacks, republishes or rejects.
//!
//! ```text
//! ack            ─► basic.ack (batch mode: one multiple ack over the unit's settled tags)
//! retry_later    ─► confirmed copy to <queue>.retry.<delay> ─► ack
//!                   the delay queue is gone ─► copy to the work queue after a pause ─► ack
//! dead_letter    ─► confirmed copy to <queue>.dlq, headers trimmed to fit the frame ─► ack
//! requeue        ─► pause ─► nack(requeue)
//! reject         ─► basic.reject: the work queue's dead-letter exchange takes it
//! a copy that is not confirmed: the session reconnects when its connection is gone
//! ```

use std::sync::Arc;
use std::time::Duration;

use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::amqp::acks::{AckTracker, Misplaced};
use crate::amqp::publish::PublishError;
use crate::amqp::republish::Republisher;
use crate::amqp::telemetry;
use crate::runtime::health::Health;
use crate::runtime::message::Message;
use crate::runtime::outcome::{Abandon, Settled};
use crate::runtime::route::Router;
use crate::runtime::settle::{LogLimit, Settle};
use crate::runtime::stats::{Counter, Stats};
use crate::runtime::trace;
use crate::runtime::transport::{Finished, Later, Letter, Refused, Transport};

/// The pause before a retry that could not reach its delay queue goes
/// through the work queue instead.
const FALLBACK_PAUSE: Duration = Duration::from_secs(1);

pub(crate) struct Pipeline {
    pub(crate) router: Arc<Router>,
    pub(crate) dead_letter_queue: String,
    pub(crate) declare: bool,
    pub(crate) republisher: Republisher,
    pub(crate) coalesced: Option<AckTracker>,
    pub(crate) broken: CancellationToken,
    pub(crate) shutdown: CancellationToken,
    pub(crate) health: Health,
    pub(crate) stats: Stats,
    pub(crate) log_limit: LogLimit,
}

/// One lapin delivery's handle.
pub(crate) struct Receipt {
    acker: Acker,
    tag: u64,
}

impl Pipeline {
    pub(crate) async fn run(
        self: Arc<Self>,
        deliveries: Vec<lapin::message::Delivery>,
    ) -> Vec<Settled> {
        let span = telemetry::process_span(&self.router.consumer, &self.router.queue, &deliveries);
        let mut receipts = Vec::with_capacity(deliveries.len());
        let messages: Vec<Message> = deliveries
            .into_iter()
            .map(|delivery| {
                self.stats.incr(Counter::Deliveries);
                receipts.push(Receipt {
                    acker: delivery.acker.clone(),
                    tag: delivery.delivery_tag,
                });
                Message::from_delivery(delivery)
            })
            .collect();
        trace::link_producers(&span, &messages);
        async {
            // The unit's deliveries share a channel: the first one's tells
            // when it closed (lapin poisons every acker of a closed channel).
            let abandon = Abandon {
                shutdown: self.shutdown.clone(),
                gone: receipts.first().map(|r| {
                    let acker = r.acker.clone();
                    Box::new(move || acker.poisoned()) as crate::runtime::outcome::Gone
                }),
            };
            let settle = Settle {
                router: &self.router,
                health: &self.health,
                stats: &self.stats,
                log_limit: &self.log_limit,
            };
            settle.decide(&*self, messages, receipts, &abandon).await
        }
        .instrument(span)
        .await
    }

    /// A copy the broker returned (no such queue): redeclare when this
    /// consumer declares its topology, say so either way.
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

    /// A copy that was not sent: as [`Refused`], reconnecting when the
    /// connection is gone.
    fn refused(&self, error: PublishError) -> Refused {
        match error {
            e @ PublishError::TooLarge { .. } => Refused::TooLarge(e.to_string()),
            e => {
                if !self.republisher.is_open() {
                    self.broken.cancel();
                }
                Refused::Failed(e.to_string())
            }
        }
    }
}

impl Transport for Pipeline {
    type Receipt = Receipt;

    async fn retry_later(
        &self,
        message: &Message,
        receipt: &Receipt,
        later: Later<'_>,
    ) -> Result<(), Refused> {
        let mut published = self
            .republisher
            .publish(later.queue, message, later.headers.clone())
            .await;
        if let Err(PublishError::Returned(_)) = &published {
            // The delay queue is gone (deleted by hand). Retry through the
            // work queue itself, with the attempt counted, so that the
            // attempts still run out; a pause stands in for the delay.
            self.missing_queue(later.queue);
            tokio::time::sleep(FALLBACK_PAUSE).await;
            published = self
                .republisher
                .publish(&self.router.queue, message, later.headers)
                .await;
        }
        published.map_err(|e| self.refused(e))?;
        ack(&receipt.acker, false).await;
        Ok(())
    }

    async fn dead_letter(
        &self,
        message: &Message,
        receipt: &Receipt,
        letter: Letter<'_>,
    ) -> Result<Vec<(String, usize)>, Refused> {
        let published = self
            .republisher
            .publish_trimmed(&self.dead_letter_queue, message, letter.headers)
            .await;
        match published {
            Ok(trimmed) => {
                ack(&receipt.acker, false).await;
                Ok(trimmed)
            }
            Err(e) => {
                if let PublishError::Returned(_) = e {
                    self.missing_queue(&self.dead_letter_queue);
                }
                Err(match self.refused(e) {
                    Refused::Failed(why) => {
                        Refused::Failed(format!("to {:?}: {why}", self.dead_letter_queue))
                    }
                    too_large => too_large,
                })
            }
        }
    }

    async fn letter_stored(&self, _message: &Message, receipt: &Receipt, _letter: Letter<'_>) {
        ack(&receipt.acker, false).await;
    }

    async fn requeue(&self, _message: &Message, receipt: &Receipt, pause: Duration, _error: &str) {
        nack_after(&receipt.acker, pause).await;
    }

    async fn reject(&self, receipt: &Receipt) {
        reject(&receipt.acker).await;
    }

    async fn finish(&self, unit: Vec<Finished<Receipt>>) {
        let Some(tracker) = &self.coalesced else {
            for finished in unit {
                if let Finished::Ack { receipt, .. } = finished {
                    ack(&receipt.acker, false).await;
                }
            }
            return;
        };
        // Abandoned deliveries are never recorded: no multiple ack may cover
        // them.
        let tags: Vec<(u64, Option<Acker>)> = unit
            .into_iter()
            .filter_map(|finished| match finished {
                Finished::Ack { receipt, .. } => Some((receipt.tag, Some(receipt.acker))),
                Finished::Settled(receipt) => Some((receipt.tag, None)),
                Finished::Abandoned(_) => None,
            })
            .collect();
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
}

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
