//! A unit of JetStream deliveries on its way: [`Pipeline::run`] has the
//! runtime's `Router` decide each delivery and `Settle` carry the routes out
//! through the [`Transport`] below, the only code that acknowledges, NAKs or
//! terminates a JetStream message.
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

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::message::Acker;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::envelope;
use super::telemetry;
use crate::runtime::health::Health;
use crate::runtime::message::Message;
use crate::runtime::outcome::{Abandon, Settled};
use crate::runtime::route::Router;
use crate::runtime::settle::{LogLimit, Settle};
use crate::runtime::stats::{Counter, Stats};
use crate::runtime::trace;
use crate::runtime::transport::{Finished, Later, Letter, Refused, Transport};

pub(crate) struct Pipeline {
    pub(crate) router: Arc<Router>,
    /// The consumed subject (a batch span's destination).
    pub(crate) subject: String,
    /// How often a running unit tells JetStream it is still at work.
    pub(crate) progress_every: Duration,
    pub(crate) shutdown: CancellationToken,
    pub(crate) health: Health,
    pub(crate) stats: Stats,
    pub(crate) log_limit: LogLimit,
}

/// One JetStream delivery's handle: its ack subject.
pub(crate) struct Receipt {
    acker: Arc<Acker>,
}

impl Pipeline {
    /// Decides and settles a unit of deliveries; tells JetStream they are in
    /// progress meanwhile, so that a long handler keeps its messages.
    pub(crate) async fn run(
        self: Arc<Self>,
        deliveries: Vec<async_nats::jetstream::Message>,
    ) -> Vec<Settled> {
        let mut receipts = Vec::with_capacity(deliveries.len());
        let mut messages = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            self.stats.incr(Counter::Deliveries);
            let (delivered, sequence) = delivery
                .info()
                .map_or((1, 0), |info| (info.delivered, info.stream_sequence));
            let (message, acker) = delivery.split();
            messages.push(envelope::message(
                message.subject.as_str(),
                message.payload.to_vec(),
                message.headers,
                delivered,
                sequence,
            ));
            receipts.push(Receipt {
                acker: Arc::new(acker),
            });
        }
        let span = telemetry::process_span(&self.router.consumer, &self.subject, &messages);
        trace::link_producers(&span, &messages);
        let progress: Vec<Arc<Acker>> = receipts.iter().map(|r| r.acker.clone()).collect();
        let work = self
            .clone()
            .decide_and_settle(messages, receipts)
            .instrument(span);
        tokio::pin!(work);
        // The first tick a period from now. (`interval`'s first tick is due
        // at once but still waits for the timer wheel's next millisecond:
        // about a millisecond more for every unit, measured.)
        let mut ticks = tokio::time::interval_at(
            tokio::time::Instant::now() + self.progress_every,
            self.progress_every,
        );
        loop {
            tokio::select! {
                settled = &mut work => return settled,
                _ = ticks.tick() => {
                    for acker in &progress {
                        // Best effort: a lost one only shortens the wait.
                        let _ = acker.ack_with(AckKind::Progress).await;
                    }
                }
            }
        }
    }

    async fn decide_and_settle(
        self: Arc<Self>,
        messages: Vec<Message>,
        receipts: Vec<Receipt>,
    ) -> Vec<Settled> {
        // A JetStream delivery stays valid across reconnects: only shutdown
        // abandons a wait.
        let abandon = Abandon {
            shutdown: self.shutdown.clone(),
            gone: None,
        };
        let settle = Settle {
            router: &self.router,
            health: &self.health,
            stats: &self.stats,
            log_limit: &self.log_limit,
        };
        settle.decide(&*self, messages, receipts, &abandon).await
    }
}

impl Transport for Pipeline {
    type Receipt = Receipt;

    async fn retry_later(
        &self,
        _message: &Message,
        receipt: &Receipt,
        later: Later<'_>,
    ) -> Result<(), Refused> {
        nak(&receipt.acker, later.delay).await;
        Ok(())
    }

    async fn dead_letter(
        &self,
        _message: &Message,
        _receipt: &Receipt,
        _letter: Letter<'_>,
    ) -> Result<Vec<(String, usize)>, Refused> {
        // Reached only when the dead-letter table refused the letter.
        Err(Refused::Failed(
            "JetStream has no dead-letter stream; the dead-letter table refused the letter".into(),
        ))
    }

    async fn letter_stored(&self, _message: &Message, receipt: &Receipt, _letter: Letter<'_>) {
        ack(&receipt.acker).await;
    }

    async fn requeue(&self, _message: &Message, receipt: &Receipt, pause: Duration, _error: &str) {
        nak(&receipt.acker, pause).await;
    }

    async fn reject(&self, receipt: &Receipt) {
        if let Err(e) = receipt.acker.ack_with(AckKind::Term).await {
            tracing::warn!(error = %e, "TERM not sent; JetStream will redeliver");
        }
    }

    async fn finish(&self, unit: Vec<Finished<Receipt>>) {
        let acks = unit.iter().filter_map(|finished| match finished {
            Finished::Ack { receipt, .. } => Some(ack(&receipt.acker)),
            Finished::Settled(_) | Finished::Abandoned(_) => None,
        });
        futures::future::join_all(acks).await;
    }
}

/// Acknowledges and waits for the server to confirm it.
async fn ack(acker: &Acker) {
    // Either way the work is durable; the redelivery will be claimed as a duplicate.
    if let Err(e) = acker.double_ack().await {
        tracing::warn!(error = %e, "ack not confirmed; the redelivery will be deduplicated");
    }
}

/// Hands the message back, to be delivered again after `delay`.
async fn nak(acker: &Acker, delay: Duration) {
    // A lost NAK only delays the redelivery until the ack wait runs out.
    if let Err(e) = acker.ack_with(AckKind::Nak(Some(delay))).await {
        tracing::warn!(error = %e, "NAK not sent; JetStream redelivers after the ack wait");
    }
}
