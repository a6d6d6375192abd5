//! The AMQP side of the seam: how a delivery the runtime decided is settled
//! over lapin, through the session it came from ([`SessionLink`]: its
//! republishing channels, batch mode's coalesced acks). The only code that
//! acks, nacks, republishes or rejects.
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

use super::acks::{AckTracker, Misplaced};
use super::publish::PublishError;
use super::republish::Republisher;
use super::topology::delay_queue;
use crate::runtime::health::Health;
use crate::runtime::message::Message;
use crate::runtime::transport::{Finished, Later, Letter, Refused};

/// The pause before a retry that could not reach its delay queue goes
/// through the work queue instead.
const FALLBACK_PAUSE: Duration = Duration::from_secs(1);

/// What a session's deliveries are settled through: they keep it after the
/// session ended (their acks then fail, and the redelivery is a duplicate).
pub(crate) struct SessionLink {
    pub(crate) queue: String,
    pub(crate) dead_letter_queue: String,
    pub(crate) declare: bool,
    pub(crate) republisher: Republisher,
    /// Batch mode: processed deliveries are acked with multiple acks.
    pub(crate) coalesced: Option<AckTracker>,
    /// Fired when the session must end (republishing channels gone, a tag
    /// the ack bookkeeping cannot place, a queue to declare again).
    pub(crate) broken: CancellationToken,
    pub(crate) health: Health,
}

/// One lapin delivery's handle.
pub struct Receipt {
    acker: Acker,
    tag: u64,
    session: Arc<SessionLink>,
}

impl std::fmt::Debug for Receipt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receipt")
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

impl Receipt {
    pub(crate) fn new(acker: Acker, tag: u64, session: Arc<SessionLink>) -> Self {
        Receipt {
            acker,
            tag,
            session,
        }
    }

    /// Whether the delivery's channel closed: lapin poisons every acker of a
    /// closed channel.
    pub(crate) fn probe(&self) -> Box<dyn Fn() -> bool + Send + Sync> {
        let acker = self.acker.clone();
        Box::new(move || acker.poisoned())
    }
}

impl SessionLink {
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

pub(crate) async fn retry_later(
    message: &Message,
    receipt: &Receipt,
    later: Later<'_>,
) -> Result<(), Refused> {
    let session = &receipt.session;
    let queue = delay_queue(&session.queue, later.delay);
    let mut published = session
        .republisher
        .publish(&queue, message, later.headers.clone())
        .await;
    if let Err(PublishError::Returned(_)) = &published {
        // The delay queue is gone (deleted by hand). Retry through the
        // work queue itself, with the attempt counted, so that the
        // attempts still run out; a pause stands in for the delay.
        session.missing_queue(&queue);
        tokio::time::sleep(FALLBACK_PAUSE).await;
        published = session
            .republisher
            .publish(&session.queue, message, later.headers)
            .await;
    }
    published.map_err(|e| match session.refused(e) {
        Refused::Failed(why) => Refused::Failed(format!("to {queue:?}: {why}")),
        too_large => too_large,
    })?;
    ack(&receipt.acker, false).await;
    Ok(())
}

pub(crate) async fn dead_letter(
    message: &Message,
    receipt: &Receipt,
    letter: Letter<'_>,
) -> Result<Vec<(String, usize)>, Refused> {
    let session = &receipt.session;
    let published = session
        .republisher
        .publish_trimmed(&session.dead_letter_queue, message, letter.headers)
        .await;
    match published {
        Ok(trimmed) => {
            ack(&receipt.acker, false).await;
            Ok(trimmed)
        }
        Err(e) => {
            if let PublishError::Returned(_) = e {
                session.missing_queue(&session.dead_letter_queue);
            }
            Err(match session.refused(e) {
                Refused::Failed(why) => {
                    Refused::Failed(format!("to {:?}: {why}", session.dead_letter_queue))
                }
                too_large => too_large,
            })
        }
    }
}

pub(crate) async fn letter_stored(receipt: &Receipt) {
    ack(&receipt.acker, false).await;
}

pub(crate) async fn requeue(receipt: &Receipt, pause: Duration) {
    tokio::time::sleep(pause).await;
    let nack = BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    };
    match receipt.acker.nack(nack).await {
        Ok(true) => {}
        // The channel is gone: the broker requeues every unacked delivery.
        Ok(false) => tracing::warn!("nack not sent (channel closed); the broker will redeliver"),
        Err(e) => tracing::warn!(error = %e, "nack failed; the broker will redeliver"),
    }
}

/// Rejects without requeue: the queue's dead-letter exchange takes it.
pub(crate) async fn reject(receipt: &Receipt) {
    match receipt
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
    {
        Ok(true) => {}
        Ok(false) => tracing::warn!("reject not sent (channel closed); the broker will redeliver"),
        Err(e) => tracing::warn!(error = %e, "reject failed; the broker will redeliver"),
    }
}

pub(crate) async fn finish(unit: Vec<Finished<Receipt>>) {
    let session = match unit.first() {
        Some(Finished::Ack { receipt, .. } | Finished::Settled(receipt)) => receipt.session.clone(),
        Some(Finished::Abandoned(receipt)) => receipt.session.clone(),
        None => return,
    };
    let Some(tracker) = &session.coalesced else {
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
            session.broken.cancel();
        }
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
