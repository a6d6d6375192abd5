//! [`Memory`]: the harness's transport, on the same seam as RabbitMQ's and
//! JetStream's. The harness hands it each unit of deliveries itself; each
//! settlement the runtime asks for is written down as a [`Delivered`] value
//! instead of being sent to a broker.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::delivered::Delivered;
use crate::Result;
use crate::amqp::copy::copy_properties;
use crate::runtime::dead_letter::DeadLetterReason;
use crate::runtime::dispatch::Deliveries;
use crate::runtime::headers::HeaderValue;
use crate::runtime::message::Message;
use crate::runtime::transport::{Finished, Later, Letter, Refused, Setup, Transport};

/// The harness's transport: no broker, every settlement recorded (see
/// [`Harness`](super::Harness)). Its messages are delivered by the harness,
/// not received.
#[derive(Debug)]
pub struct Memory {
    queue: String,
    dead_letter_queue: String,
}

/// The queue a [`Memory`] consumer reads, named by the harness.
#[derive(Debug)]
pub struct MemoryOptions {
    pub(crate) queue: String,
}

/// One delivery of a unit the harness fed: its place in the unit, and
/// where the unit's settlements are written down.
#[derive(Debug)]
pub struct Slot {
    position: usize,
    recording: Arc<Recording>,
}

/// One unit's settlements, by the position of each delivery in the unit.
#[derive(Debug)]
pub(crate) struct Recording {
    delivered: Mutex<Vec<Option<Delivered>>>,
}

impl Recording {
    /// A recording of `deliveries` settlements, and a slot for each.
    pub(crate) fn new(deliveries: usize) -> (Arc<Recording>, Vec<Slot>) {
        let recording = Arc::new(Recording {
            delivered: Mutex::new(vec![None; deliveries]),
        });
        let slots = (0..deliveries)
            .map(|position| Slot {
                position,
                recording: recording.clone(),
            })
            .collect();
        (recording, slots)
    }

    /// How each delivery ended, in order; one the runtime left unsettled
    /// (it waited at the gate past the hold timeout) is [`Delivered::Held`].
    pub(crate) fn delivered(&self) -> Vec<Delivered> {
        self.delivered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|d| d.clone().unwrap_or(Delivered::Held))
            .collect()
    }

    fn record(&self, position: usize, delivered: Delivered) {
        let mut all = self.delivered.lock().unwrap_or_else(|p| p.into_inner());
        all[position] = Some(delivered);
    }
}

impl Memory {
    fn letter(&self, message: &Message, letter: Letter<'_>) -> Delivered {
        let error = letter.error.to_owned();
        let copy = copy(message, letter.headers, &self.dead_letter_queue);
        if letter.reason == DeadLetterReason::PayloadMismatch {
            return Delivered::Mismatch { error, copy };
        }
        Delivered::DeadLettered {
            reason: letter.reason,
            error,
            copy,
        }
    }
}

/// The copy a broker would deliver from `queue`, its id the one the
/// original was deduplicated on (which the copy carries, sealed).
fn copy(message: &Message, headers: Vec<(&'static str, HeaderValue)>, queue: &str) -> Message {
    let mut copy = Message::with_properties(
        message.body().to_vec(),
        copy_properties(message, headers),
        "",
        queue,
        false,
        0,
    );
    copy.set_id(message.id().to_owned());
    copy
}

impl Transport for Memory {
    type Options = MemoryOptions;
    type Receipt = Slot;
    const NAME: &'static str = "memory";
    const OWN_DEAD_LETTERS: bool = true;

    fn build(options: MemoryOptions, _setup: &Setup<'_>) -> Result<Self> {
        let queue = options.queue;
        Ok(Memory {
            dead_letter_queue: crate::amqp::dead_letter_queue(&queue),
            queue,
        })
    }

    fn source(&self) -> &str {
        &self.queue
    }

    /// The harness feeds the units itself: nothing to receive.
    async fn consume(self: Arc<Self>, deliveries: &mut Deliveries<Self>) -> Result<()> {
        deliveries.stopping().await;
        Ok(())
    }

    fn span(&self, _consumer: &str, _messages: &[Message]) -> tracing::Span {
        tracing::Span::none()
    }

    async fn retry_later(
        &self,
        message: &Message,
        slot: &Slot,
        later: Later<'_>,
    ) -> std::result::Result<(), Refused> {
        let queue = format!("{}.retry", self.queue);
        let delivered = Delivered::Retried {
            delay: later.delay,
            attempt: later.attempts,
            error: later.error.to_owned(),
            copy: copy(message, later.headers, &queue),
        };
        slot.recording.record(slot.position, delivered);
        Ok(())
    }

    async fn dead_letter(
        &self,
        message: &Message,
        slot: &Slot,
        letter: Letter<'_>,
    ) -> std::result::Result<Vec<(String, usize)>, Refused> {
        slot.recording
            .record(slot.position, self.letter(message, letter));
        Ok(Vec::new())
    }

    async fn letter_stored(&self, message: &Message, slot: &Slot, letter: Letter<'_>) {
        slot.recording
            .record(slot.position, self.letter(message, letter));
    }

    async fn requeue(&self, message: &Message, slot: &Slot, pause: Duration, error: &str) {
        let delivered = Delivered::Retried {
            delay: pause,
            attempt: 0,
            error: error.to_owned(),
            copy: {
                let mut again = message.delivered_again(true, 0);
                again.set_id(message.id().to_owned());
                again
            },
        };
        slot.recording.record(slot.position, delivered);
    }

    async fn reject(&self, _slot: &Slot) {}

    async fn finish(&self, unit: Vec<Finished<Slot>>) {
        for finished in unit {
            match finished {
                Finished::Ack {
                    receipt,
                    duplicate: false,
                } => receipt
                    .recording
                    .record(receipt.position, Delivered::Acked { staged: Vec::new() }),
                Finished::Ack {
                    receipt,
                    duplicate: true,
                } => receipt
                    .recording
                    .record(receipt.position, Delivered::Duplicate),
                Finished::Abandoned(receipt) => {
                    receipt.recording.record(receipt.position, Delivered::Held)
                }
                _ => {}
            }
        }
    }
}
