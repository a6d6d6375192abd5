//! The JetStream side of the seam: how a delivery the runtime decided is
//! settled, the only code that acknowledges, NAKs or terminates a JetStream
//! message.
//!
//! ```text
//! ack            ─► +ACK, confirmed by the server (a lost ack is known: the redelivery is a duplicate)
//! retry_later    ─► -NAK with the policy's delay: the message returns unchanged, JetStream counts it
//! letter_stored  ─► +ACK, confirmed (the dead-letter table took the letter)
//! dead_letter    ─► refused: JetStream has no dead-letter stream; the message is NAKed after a pause
//! requeue        ─► -NAK with the pause
//! reject         ─► +TERM (never sent: a NATS copy is never too large, nothing is copied)
//! while the unit runs: +WPI (in progress) every third of the ack wait
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::message::Acker;

/// One JetStream delivery's handle: its ack subject.
pub struct Receipt {
    acker: Arc<Acker>,
}

impl std::fmt::Debug for Receipt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receipt").finish_non_exhaustive()
    }
}

impl Receipt {
    pub(crate) fn new(acker: Acker) -> Self {
        Receipt {
            acker: Arc::new(acker),
        }
    }
}

impl Receipt {
    /// Tells JetStream the message is still at work (best effort: a lost
    /// one only shortens the wait).
    pub(crate) async fn still_at_work(&self) {
        let _ = self.acker.ack_with(AckKind::Progress).await;
    }

    /// Another handle on the same delivery, for [`still_at_work`](Self::still_at_work)
    /// while the runtime holds the first.
    pub(crate) fn handle(&self) -> Receipt {
        Receipt {
            acker: self.acker.clone(),
        }
    }
}

/// Tells JetStream every `period` that the unit's messages are still at
/// work, so that a long handler keeps them.
pub(crate) fn in_progress(
    receipts: &[Receipt],
    period: Duration,
) -> impl Future<Output = ()> + Send + 'static {
    let ackers: Vec<Arc<Acker>> = receipts.iter().map(|r| r.acker.clone()).collect();
    async move {
        // The first tick a period from now. (`interval`'s first tick is due
        // at once but still waits for the timer wheel's next millisecond:
        // about a millisecond more for every unit, measured.)
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            ticks.tick().await;
            for acker in &ackers {
                // Best effort: a lost one only shortens the wait.
                let _ = acker.ack_with(AckKind::Progress).await;
            }
        }
    }
}

/// Acknowledges and waits for the server to confirm it.
pub(crate) async fn ack(receipt: &Receipt) {
    // Either way the work is durable; the redelivery will be claimed as a duplicate.
    if let Err(e) = receipt.acker.double_ack().await {
        tracing::warn!(error = %e, "ack not confirmed; the redelivery will be deduplicated");
    }
}

/// Hands the message back, to be delivered again after `delay`.
pub(crate) async fn nak(receipt: &Receipt, delay: Duration) {
    // A lost NAK only delays the redelivery until the ack wait runs out.
    if let Err(e) = receipt.acker.ack_with(AckKind::Nak(Some(delay))).await {
        tracing::warn!(error = %e, "NAK not sent; JetStream redelivers after the ack wait");
    }
}

/// Tells JetStream never to deliver the message again.
pub(crate) async fn term(receipt: &Receipt) {
    if let Err(e) = receipt.acker.ack_with(AckKind::Term).await {
        tracing::warn!(error = %e, "TERM not sent; JetStream will redeliver");
    }
}
