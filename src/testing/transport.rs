//! The harness as a transport: the runtime settles each delivery through the
//! same seam the AMQP adapter implements, and this transport writes down
//! what it was asked to do as a [`Delivered`] value instead of acking.

use std::sync::Mutex;
use std::time::Duration;

use super::delivered::Delivered;
use crate::amqp::copy::copy_properties;
use crate::consumer::DeadLetterReason;
use crate::runtime::headers::HeaderValue;
use crate::runtime::message::Message;
use crate::runtime::transport::{Finished, Later, Letter, Refused, Transport};

/// One unit's settlements, by the position of each delivery in the unit.
pub(crate) struct Recorder<'a> {
    dead_letter_queue: &'a str,
    delivered: Mutex<Vec<Option<Delivered>>>,
}

impl<'a> Recorder<'a> {
    pub(crate) fn new(dead_letter_queue: &'a str, deliveries: usize) -> Self {
        Recorder {
            dead_letter_queue,
            delivered: Mutex::new(vec![None; deliveries]),
        }
    }

    /// How each delivery ended, in order.
    pub(crate) fn into_delivered(self) -> Vec<Delivered> {
        self.delivered
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .into_iter()
            .map(|d| d.unwrap_or(Delivered::Held))
            .collect()
    }

    fn record(&self, position: usize, delivered: Delivered) {
        let mut all = self.delivered.lock().unwrap_or_else(|p| p.into_inner());
        all[position] = Some(delivered);
    }

    fn letter(&self, message: &Message, letter: Letter<'_>) -> Delivered {
        let error = letter.error.to_owned();
        let copy = copy(message, letter.headers, self.dead_letter_queue);
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

/// The copy the broker would deliver from `queue`.
fn copy(message: &Message, headers: Vec<(&'static str, HeaderValue)>, queue: &str) -> Message {
    Message::with_properties(
        message.body().to_vec(),
        copy_properties(message, headers),
        "",
        queue,
        false,
        0,
    )
}

impl Transport for Recorder<'_> {
    type Receipt = usize;

    async fn retry_later(
        &self,
        message: &Message,
        position: &usize,
        later: Later<'_>,
    ) -> Result<(), Refused> {
        let delivered = Delivered::Retried {
            delay: later.delay,
            attempt: later.attempts,
            error: later.error.to_owned(),
            copy: copy(message, later.headers, later.queue),
        };
        self.record(*position, delivered);
        Ok(())
    }

    async fn dead_letter(
        &self,
        message: &Message,
        position: &usize,
        letter: Letter<'_>,
    ) -> Result<Vec<(String, usize)>, Refused> {
        self.record(*position, self.letter(message, letter));
        Ok(Vec::new())
    }

    async fn letter_stored(&self, message: &Message, position: &usize, letter: Letter<'_>) {
        self.record(*position, self.letter(message, letter));
    }

    async fn requeue(&self, message: &Message, position: &usize, pause: Duration, error: &str) {
        let delivered = Delivered::Retried {
            delay: pause,
            attempt: 0,
            error: error.to_owned(),
            copy: message.delivered_again(true, 0),
        };
        self.record(*position, delivered);
    }

    async fn reject(&self, _position: &usize) {}

    async fn finish(&self, unit: Vec<Finished<usize>>) {
        for finished in unit {
            match finished {
                Finished::Ack {
                    receipt,
                    duplicate: false,
                } => self.record(receipt, Delivered::Acked { staged: Vec::new() }),
                Finished::Ack {
                    receipt,
                    duplicate: true,
                } => self.record(receipt, Delivered::Duplicate),
                Finished::Abandoned(receipt) => self.record(receipt, Delivered::Held),
                Finished::Settled(_) => {}
            }
        }
    }
}
