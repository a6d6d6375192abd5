//! [`Memory`]: the in-memory transport, on the same seam as RabbitMQ's and
//! JetStream's. The harness hands it units of deliveries itself, and each
//! settlement the runtime asks for is written down as a [`Delivered`] value;
//! a consumer built with [`MemoryBroker::consumer`] receives from the
//! broker's queue and settles there (acks, delayed copies, dead letters),
//! as on a real broker.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::delivered::Delivered;
use super::memory::{MemoryBroker, Stored};
use crate::Result;
use crate::amqp::copy::copy_properties;
use crate::runtime::dead_letter::DeadLetterReason;
use crate::runtime::dispatch::{Deliveries, Feed, FeedEnd};
use crate::runtime::health::RuntimeState;
use crate::runtime::message::HeaderValue;
use crate::runtime::message::Message;
use crate::runtime::transport::{Finished, Later, Letter, Refused, Setup, Transport};

/// The in-memory transport: a [`MemoryBroker`]'s queue, or the harness's
/// units (see [`Harness`](super::Harness)), every settlement recorded.
#[derive(Debug)]
pub struct Memory {
    queue: String,
    dead_letter_queue: String,
    broker: Option<MemoryBroker>,
}

/// The queue a [`Memory`] consumer reads, and the broker that holds it
/// (none for the harness, which feeds units itself).
#[derive(Debug)]
pub struct MemoryOptions {
    pub(crate) queue: String,
    pub(crate) broker: Option<MemoryBroker>,
}

/// One delivery on the [`Memory`] transport: its place in a unit the
/// harness fed, or its delivery tag on a [`MemoryBroker`]'s queue.
#[derive(Debug)]
pub struct Slot(SlotKind);

#[derive(Debug)]
enum SlotKind {
    Recorded {
        position: usize,
        recording: Arc<Recording>,
    },
    Broker {
        tag: u64,
        stored: Box<Stored>,
    },
}

impl MemoryBroker {
    /// A consumer of `queue` on this broker, running in transactions on
    /// `pool`: `.handler(..)`, then `run` it as in production.
    pub fn consumer(
        &self,
        queue: impl Into<String>,
        pool: sqlx::PgPool,
    ) -> crate::runtime::builder::ConsumerBuilder<Memory> {
        crate::runtime::builder::ConsumerBuilder::with_options(
            pool,
            MemoryOptions {
                queue: queue.into(),
                broker: Some(self.clone()),
            },
        )
    }
}

/// A session of a [`MemoryBroker`] queue as the runtime's feed.
struct MemoryFeed {
    broker: MemoryBroker,
    queue: String,
    session: u64,
}

impl Feed<Slot> for MemoryFeed {
    async fn next(&mut self) -> std::result::Result<(Message, Slot), String> {
        match self.broker.next(&self.queue, self.session).await {
            Some((tag, stored)) => Ok((
                stored.message(&self.queue, tag),
                Slot(SlotKind::Broker {
                    tag,
                    stored: Box::new(stored),
                }),
            )),
            None => Err("the session was cut".into()),
        }
    }
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
            .map(|position| {
                Slot(SlotKind::Recorded {
                    position,
                    recording: recording.clone(),
                })
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
    /// Records `delivered` for a harness's delivery; on a broker, `on_broker`
    /// settles it there (its tag acknowledged first).
    fn settle(
        &self,
        slot: &Slot,
        delivered: impl FnOnce() -> Delivered,
        on_broker: impl FnOnce(&MemoryBroker, &Stored),
    ) {
        match &slot.0 {
            SlotKind::Recorded {
                position,
                recording,
            } => recording.record(*position, delivered()),
            SlotKind::Broker { tag, stored } => {
                let broker = self.broker.as_ref().expect("a broker's delivery");
                if broker.settle(&self.queue, *tag) {
                    on_broker(broker, stored);
                }
            }
        }
    }

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
            dead_letter_queue: crate::amqp::Amqp::dead_letter_queue(&queue),
            queue,
            broker: options.broker,
        })
    }

    fn source(&self) -> &str {
        &self.queue
    }

    /// The broker's queue, session after session (a [`MemoryBroker::cut`]
    /// ends one); without a broker (the harness), nothing to receive.
    async fn consume(self: Arc<Self>, deliveries: &mut Deliveries<Self>) -> Result<()> {
        let Some(broker) = self.broker.clone() else {
            deliveries.stopping().await;
            return Ok(());
        };
        loop {
            let session = broker.session(&self.queue);
            deliveries.health().set_state(RuntimeState::Consuming);
            let mut feed = MemoryFeed {
                broker: broker.clone(),
                queue: self.queue.clone(),
                session,
            };
            match deliveries.dispatch(&mut feed).await {
                FeedEnd::Lost { error, .. } => {
                    deliveries.health().record_error(error);
                    deliveries.health().record_reconnect();
                }
                _ => {
                    deliveries.drain().await;
                    // What was left unsettled goes back, as when a
                    // consumer's channel closes.
                    broker.cut(&self.queue);
                    return Ok(());
                }
            }
        }
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
        let copy = copy(message, later.headers, &queue);
        let (delay, attempt, error) = (later.delay, later.attempts, later.error.to_owned());
        self.settle(
            slot,
            || Delivered::Retried {
                delay,
                attempt,
                error,
                copy: copy.clone(),
            },
            |broker, stored| {
                let again = Stored {
                    properties: copy_properties(&copy, []),
                    ..stored.clone()
                };
                broker.put_later(&self.queue, again, delay);
            },
        );
        Ok(())
    }

    async fn dead_letter(
        &self,
        message: &Message,
        slot: &Slot,
        letter: Letter<'_>,
    ) -> std::result::Result<Vec<(String, usize)>, Refused> {
        let delivered = self.letter(message, letter);
        let copy = match &delivered {
            Delivered::Mismatch { copy, .. } | Delivered::DeadLettered { copy, .. } => copy.clone(),
            _ => message.clone(),
        };
        self.settle(
            slot,
            || delivered,
            |broker, stored| {
                let letter = Stored {
                    properties: copy_properties(&copy, []),
                    ..stored.clone()
                };
                broker.dead_letter(&self.queue, letter);
            },
        );
        Ok(Vec::new())
    }

    async fn letter_stored(&self, message: &Message, slot: &Slot, letter: Letter<'_>) {
        let delivered = self.letter(message, letter);
        self.settle(slot, || delivered, |_, _| {});
    }

    async fn requeue(&self, message: &Message, slot: &Slot, pause: Duration, error: &str) {
        self.settle(
            slot,
            || Delivered::Retried {
                delay: pause,
                attempt: 0,
                error: error.to_owned(),
                copy: {
                    let mut again = message.delivered_again(true, 0);
                    again.set_id(message.id().to_owned());
                    again
                },
            },
            |broker, stored| {
                let again = Stored {
                    redelivered: true,
                    ..stored.clone()
                };
                broker.put_later(&self.queue, again, pause);
            },
        );
    }

    async fn reject(&self, slot: &Slot) {
        if let SlotKind::Broker { .. } = &slot.0 {
            self.settle(
                slot,
                || Delivered::Held,
                |broker, stored| {
                    broker.dead_letter(&self.queue, stored.clone());
                },
            );
        }
    }

    async fn finish(&self, unit: Vec<Finished<Slot>>) {
        for finished in unit {
            match finished {
                Finished::Ack { receipt, duplicate } => self.settle(
                    &receipt,
                    || {
                        if duplicate {
                            Delivered::Duplicate
                        } else {
                            Delivered::Acked { staged: Vec::new() }
                        }
                    },
                    |_, _| {},
                ),
                Finished::Abandoned(receipt) => {
                    if let SlotKind::Recorded {
                        position,
                        recording,
                    } = &receipt.0
                    {
                        recording.record(*position, Delivered::Held);
                    }
                }
                _ => {}
            }
        }
    }
}
