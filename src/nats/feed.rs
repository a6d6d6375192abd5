//! The pull's messages as the runtime's feed, taken from the client as
//! they arrive: a delivery waiting for a free slot (the handlers busy, or
//! held at the database gate in an outage) is told to JetStream as still
//! at work every third of the ack wait, like one a handler runs. Left in
//! the client, it was redelivered each ack wait and each wait counted as an
//! attempt (four payments waiting 1.5 s each behind one slot, with a 1 s
//! ack wait: eight redeliveries).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;

use super::envelope;
use super::pipeline::Receipt;
use crate::runtime::dispatch::Feed;
use crate::runtime::health::Health;
use crate::runtime::message::Message;

type Item = Result<(u64, Message, Receipt), String>;

/// Deliveries received and not yet taken by the runtime, by arrival.
type Waiting = Arc<Mutex<BTreeMap<u64, Receipt>>>;

pub(crate) struct NatsFeed {
    received: mpsc::UnboundedReceiver<Item>,
    waiting: Waiting,
    reader: tokio::task::JoinHandle<()>,
}

impl NatsFeed {
    /// Reads `messages` in a task of its own; `ack_wait` sets how often the
    /// waiting deliveries are kept.
    pub(crate) fn new(
        messages: async_nats::jetstream::consumer::pull::Stream,
        health: Health,
        ack_wait: Duration,
    ) -> Self {
        let (sender, received) = mpsc::unbounded_channel();
        let waiting = Waiting::default();
        let reader = tokio::spawn(read(
            messages,
            health,
            sender,
            waiting.clone(),
            ack_wait / 3,
        ));
        NatsFeed {
            received,
            waiting,
            reader,
        }
    }
}

impl Drop for NatsFeed {
    fn drop(&mut self) {
        // What still waits is redelivered after the ack wait, as before.
        self.reader.abort();
    }
}

impl Feed<Receipt> for NatsFeed {
    async fn next(&mut self) -> Result<(Message, Receipt), String> {
        match self.received.recv().await {
            Some(Ok((arrival, message, receipt))) => {
                lock(&self.waiting).remove(&arrival);
                Ok((message, receipt))
            }
            Some(Err(e)) => Err(e),
            None => Err("the JetStream pull stream ended".into()),
        }
    }
}

fn lock(waiting: &Waiting) -> std::sync::MutexGuard<'_, BTreeMap<u64, Receipt>> {
    waiting.lock().unwrap_or_else(|p| p.into_inner())
}

async fn read(
    mut messages: async_nats::jetstream::consumer::pull::Stream,
    health: Health,
    sender: mpsc::UnboundedSender<Item>,
    waiting: Waiting,
    period: Duration,
) {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    let mut arrivals = 0u64;
    loop {
        tokio::select! {
            next = messages.next() => match next {
                Some(Ok(delivery)) => {
                    let (delivered, sequence) = delivery
                        .info()
                        .map_or((1, 0), |info| (info.delivered, info.stream_sequence));
                    let (message, acker) = delivery.split();
                    let message = envelope::message(
                        message.subject.as_str(),
                        message.payload.to_vec(),
                        message.headers,
                        delivered,
                        sequence,
                    );
                    let receipt = Receipt::new(acker);
                    arrivals += 1;
                    lock(&waiting).insert(arrivals, receipt.handle());
                    if sender.send(Ok((arrivals, message, receipt))).is_err() {
                        return;
                    }
                }
                Some(Err(e)) => {
                    // Missed heartbeats and failed pulls are re-issued by the client.
                    tracing::debug!(error = %e, "JetStream pull");
                    health.record_error(format!("JetStream pull: {e}"));
                }
                None => {
                    let _ = sender.send(Err("the JetStream pull stream ended".into()));
                    return;
                }
            },
            _ = ticks.tick() => {
                let handles: Vec<Receipt> = lock(&waiting).values().map(Receipt::handle).collect();
                for receipt in &handles {
                    receipt.still_at_work().await;
                }
            }
        }
    }
}
