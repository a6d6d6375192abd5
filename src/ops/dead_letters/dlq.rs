//! Reading a RabbitMQ DLQ: letters taken with `basic.get` and held
//! unacknowledged while an operation runs, so none comes twice; those read
//! and not deleted are put back at the end of the DLQ as new messages,
//! confirmed, then acked (handed back, a quorum queue's letter would spend
//! a delivery attempt).

use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};

use crate::amqp::publish::ConfirmChannel;
use crate::dead_letters::model::{Filter, Letter, LetterDetail, LetterState};
use crate::dead_letters::view::DeadLetter;
use crate::ops::{OpsError, Result, Services, close, queue_depth};

/// What a letter's reason is when idempo did not say.
const FOREIGN: &str = "foreign";

/// How long a copy (a replay, or a dead letter put back) may wait for its
/// confirm.
pub(super) const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// Headers the broker adds to a delivery, which a dead letter put back must
/// not carry (the copy is a new message, delivered zero times).
const BROKER_DELIVERY_HEADERS: [&str; 2] = ["x-delivery-count", "x-acquired-count"];

/// A DLQ delivery's properties, as idempo reads a dead letter's.
pub(super) fn stored_of(delivery: &Delivery) -> crate::properties::Properties {
    crate::amqp::stored::to_stored(&delivery.properties)
}

/// The [`Letter`] of a dead letter read from a DLQ.
pub(super) fn letter_of(delivery: &Delivery) -> Letter {
    let stored = stored_of(delivery);
    let dead = DeadLetter::new(&stored);
    let reason = dead.reason().unwrap_or_else(|| FOREIGN.into());
    let error = dead.error();
    Letter {
        id: None,
        message_id: dead.message_id(),
        consumer: dead.consumer(),
        queue: dead.original_queue(),
        routing_key: dead
            .original_routing_key()
            .unwrap_or_else(|| delivery.routing_key.to_string()),
        fingerprint: crate::runtime::fingerprint::fingerprint(
            &reason,
            error.as_deref().unwrap_or(""),
        ),
        reason,
        error,
        attempts: dead.attempts(),
        deliveries: 1,
        first_failed_at: dead.first_failure(),
        last_failed_at: dead.last_failure(),
        state: LetterState::Live,
        replay_count: u32::try_from(dead.replay_count()).unwrap_or(u32::MAX),
        replayed_at: dead.last_replayed(),
        replayed_by: None,
        replayed_to: None,
        discarded_at: None,
        discarded_by: None,
        body_bytes: delivery.data.len() as u64,
        foreign: dead.is_foreign(),
        transport: crate::amqp::TRANSPORT.to_owned(),
    }
}

/// The [`LetterDetail`] of a dead letter read from a DLQ.
pub(super) fn detail_of(delivery: &Delivery) -> LetterDetail {
    let stored = stored_of(delivery);
    LetterDetail {
        letter: letter_of(delivery),
        exchange: delivery.exchange.to_string(),
        headers: serde_json::Value::Object(stored.headers_json()),
        properties: serde_json::Value::Object(stored.fields_json()),
        body: delivery.data.clone(),
    }
}

/// A dead letter read and not deleted yet: what putting it back needs.
pub(super) struct Held {
    tag: u64,
    properties: BasicProperties,
    body: Vec<u8>,
}

/// What a walk does with a picked dead letter.
pub(super) enum Visit {
    /// Put it back at the end of the DLQ now.
    PutBack,
    /// Delete it (ack) now.
    Delete,
    /// Keep it unacked (its body held) until the operation decides.
    Hold,
}

/// A DLQ opened for reading.
pub(super) struct Opened {
    pub(super) connection: Connection,
    channel: Channel,
    /// Copies (replays, dead letters put back), confirmed one at a time.
    pub(super) confirms: ConfirmChannel,
    pub(super) dlq: String,
    /// Its ready messages when opened.
    pub(super) ready: u32,
    /// Every dead letter read and not acked, in the order read.
    held: std::sync::Mutex<Vec<Held>>,
}

impl Opened {
    /// Connects and checks that the DLQ of `queue` exists.
    pub(super) async fn new(services: &Services, dlq: &str) -> Result<Opened> {
        let connection = services.broker().await?;
        let dlq = dlq.to_owned();
        let opened = async {
            let Some(depth) = queue_depth(&connection, &dlq).await? else {
                return Err(OpsError::DeadLetterQueueNotFound {
                    queue: crate::amqp::Amqp::work_queue(&dlq).to_owned(),
                    dlq: dlq.clone(),
                });
            };
            let channel = connection.create_channel().await?;
            let confirms = ConfirmChannel::open(&connection, CONFIRM_TIMEOUT).await?;
            Ok((channel, confirms, depth.ready))
        }
        .await;
        match opened {
            Ok((channel, confirms, ready)) => Ok(Opened {
                connection,
                channel,
                confirms,
                dlq,
                ready,
                held: std::sync::Mutex::default(),
            }),
            Err(e) => {
                close(&connection).await;
                Err(e)
            }
        }
    }

    /// The next dead letter, unacknowledged: it stays on this channel until
    /// acked (deleted) or put back by [`close`](Self::close).
    pub(super) async fn next(&self) -> Result<Option<Delivery>> {
        let got = self
            .channel
            .basic_get(self.dlq.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .map_err(|source| OpsError::ReadQueue {
                queue: self.dlq.clone(),
                source,
            })?;
        let delivery = got.map(|m| m.delivery);
        if let Some(d) = &delivery {
            self.held().push(Held {
                tag: d.delivery_tag,
                properties: d.properties.clone(),
                body: d.data.clone(),
            });
        }
        Ok(delivery)
    }

    pub(super) fn held(&self) -> std::sync::MutexGuard<'_, Vec<Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Acknowledges (deletes) a dead letter read.
    pub(super) async fn ack(&self, tag: u64) -> lapin::Result<()> {
        self.channel
            .basic_ack(tag, BasicAckOptions::default())
            .await?;
        self.held().retain(|h| h.tag != tag);
        Ok(())
    }

    /// Walks the dead letters the DLQ held when opened (no more: those put
    /// back queue up behind them), at most `limit` of those `selection` and
    /// `keep` pick; `visit` says what becomes of each picked one. Every
    /// other one is put back at once, so that a walk holds one letter at a
    /// time (plus those `visit` holds).
    pub(super) async fn walk(
        &self,
        filter: &Filter,
        limit: usize,
        mut keep: impl FnMut(&Delivery) -> bool,
        mut visit: impl FnMut(&Delivery) -> Visit,
    ) -> Result<()> {
        let (mut picked, mut read) = (0usize, 0usize);
        while picked < limit && read < self.ready as usize {
            let Some(delivery) = self.next().await? else {
                break;
            };
            read += 1;
            let fate = if filter.matches(&letter_of(&delivery)) && keep(&delivery) {
                picked += 1;
                visit(&delivery)
            } else {
                Visit::PutBack
            };
            match fate {
                Visit::PutBack => self.put_back(delivery.delivery_tag).await?,
                Visit::Delete => self
                    .ack(delivery.delivery_tag)
                    .await
                    .map_err(OpsError::Ack)?,
                Visit::Hold => {}
            }
        }
        Ok(())
    }

    /// Puts a dead letter read back at the end of the DLQ now, as
    /// [`close`](Self::close) does: a new message, confirmed, then the
    /// original acked. If the copy is not confirmed the letter stays held
    /// (the close hands it back).
    pub(super) async fn put_back(&self, tag: u64) -> Result<()> {
        let letter = {
            let mut held = self.held();
            let Some(i) = held.iter().position(|h| h.tag == tag) else {
                return Ok(());
            };
            held.remove(i)
        };
        let properties = without_broker_headers(letter.properties.clone());
        match self
            .confirms
            .publish("", &self.dlq, &letter.body, properties)
            .await
        {
            Ok(()) => self
                .channel
                .basic_ack(letter.tag, BasicAckOptions::default())
                .await
                .map_err(OpsError::Ack),
            Err(e) => {
                tracing::warn!(dlq = %self.dlq, error = %e, "a dead letter stays held: its copy was not confirmed");
                self.held().push(letter);
                Ok(())
            }
        }
    }

    /// Puts every dead letter read and not acked back at the end of the DLQ
    /// as a new message (see the module docs: a dead letter handed back
    /// would spend a delivery attempt), then closes the channels (any left
    /// unacked go back into the DLQ, after the acks sent) and the connection.
    pub(super) async fn close(self, why: &str) {
        let held = std::mem::take(&mut *self.held());
        for letter in held {
            let properties = without_broker_headers(letter.properties);
            let put_back = self
                .confirms
                .publish("", &self.dlq, &letter.body, properties)
                .await;
            match put_back {
                Ok(()) => {
                    let acked = self
                        .channel
                        .basic_ack(letter.tag, BasicAckOptions::default())
                        .await;
                    if acked.is_err() {
                        // The channel is gone: the original is back in the
                        // DLQ beside its copy, and nothing more can be acked.
                        tracing::warn!(dlq = %self.dlq, "a dead letter put back is now in the DLQ twice");
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(dlq = %self.dlq, error = %e, "a dead letter is handed back instead of put back");
                }
            }
        }
        self.confirms.close().await;
        let _ = self.channel.close(200, why.into()).await;
        close(&self.connection).await;
    }
}

/// `properties` without the headers the broker added on delivery.
pub(super) fn without_broker_headers(properties: BasicProperties) -> BasicProperties {
    let Some(headers) = properties.headers().clone() else {
        return properties;
    };
    let kept: std::collections::BTreeMap<_, _> = headers
        .inner()
        .iter()
        .filter(|(name, _)| !BROKER_DELIVERY_HEADERS.contains(&name.as_str()))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    properties.with_headers(FieldTable::from(kept))
}
