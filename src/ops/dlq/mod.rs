//! Dead letters: [`list`], [`show`], [`replay`] to the work queue, [`purge`].
//!
//! Dead letters are read with `basic.get` and held unacknowledged while an
//! operation runs, so none comes twice. Only [`replay`] (after the broker
//! confirmed the copy) and [`PurgePlan::delete`] delete dead letters.
//!
//! # Browsing spends no delivery attempts
//!
//! A dead letter handed back to a quorum queue (by `basic.nack`, or by
//! closing the channel) counts as a failed delivery on RabbitMQ 3.x and 4.0
//! to 4.2: its `x-delivery-count` grows, and once it reaches the queue's
//! `delivery-limit` (a policy; on 4.x every quorum queue has 20 unless told
//! otherwise) the broker drops it. So an operation does not hand a dead
//! letter back: when it ends, every dead letter it read and did not delete
//! is published again to the DLQ as a new message (same body and
//! properties, without the broker's `x-delivery-count`/`x-acquired-count`),
//! confirmed, and only then the one read is acknowledged. The dead letters
//! read move, in their order, to the back of the DLQ: a browse of the whole
//! DLQ keeps its order; one that stopped early (a limit, `show`) puts what
//! it read behind the rest. A dead letter whose copy is not confirmed is
//! handed back by closing the channel instead. A crash between the confirm
//! and the ack leaves a dead letter twice (replaying both is harmless: the
//! consumer drops the second as a duplicate).
//!
//! A queue is named by its work queue (`payments`, whose DLQ is
//! [`dead_letter_queue`]`("payments")`) or by the DLQ itself
//! (`payments.dlq`).

mod import;
mod purge;
mod replay;

use std::collections::BTreeMap;

use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;

use super::{OpsError, Result, Services, close, queue_depth};
use crate::amqp::publish::ConfirmChannel;
use crate::amqp::{DeadLetter, dead_letter_queue};

pub use import::{ImportSummary, import, table_holds};
pub use purge::{PurgeOptions, PurgePlan, purge, purge_now};
pub use replay::{Refusal, ReplayEvent, ReplayOptions, ReplaySummary, replay};

/// Which dead letters an operation picks: all of them when both are empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Only these message ids.
    pub ids: Vec<String>,
    /// Only this reason, as in [`DeadLetterSummary::reason`] (for example
    /// `max attempts exceeded`, or `foreign`).
    pub reason: Option<String>,
}

impl Selection {
    /// Whether `summary` is picked.
    pub fn matches(&self, summary: &DeadLetterSummary) -> bool {
        let id_ok = self.ids.is_empty()
            || summary
                .message_id
                .as_ref()
                .is_some_and(|id| self.ids.contains(id));
        let reason_ok = self.reason.as_ref().is_none_or(|r| *r == summary.reason);
        id_ok && reason_ok
    }
}

/// A dead letter at a glance. Serialises as a line of `idempo dlq list --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DeadLetterSummary {
    /// Its message id ([`DeadLetter::message_id`]).
    pub message_id: Option<String>,
    /// Why it was dead-lettered; `foreign` when idempo did not say.
    pub reason: String,
    /// How many attempts failed.
    pub attempts: Option<u32>,
    /// The last error.
    pub error: Option<String>,
    /// When its first attempt failed (RFC 3339, as written).
    pub first_failure: Option<String>,
    /// When its last attempt failed (RFC 3339, as written).
    pub last_failure: Option<String>,
    /// The consumer that dead-lettered it.
    pub consumer: Option<String>,
    /// The queue it came from.
    pub original_queue: Option<String>,
    /// The routing key it was first published with (or, for a foreign one,
    /// the one it reached the DLQ with).
    pub routing_key: String,
    /// The size of its body, in bytes.
    pub size: usize,
    /// Whether idempo did not dead-letter it ([`DeadLetter::is_foreign`]).
    pub foreign: bool,
}

/// What [`DeadLetterSummary::reason`] says of a dead letter without a reason.
pub(crate) const FOREIGN: &str = "foreign";

impl DeadLetterSummary {
    /// The summary of a dead letter fetched from a DLQ.
    pub fn of(delivery: &Delivery) -> Self {
        let dead = DeadLetter::from_delivery(delivery);
        DeadLetterSummary {
            message_id: dead.message_id(),
            reason: dead.reason().unwrap_or_else(|| FOREIGN.into()),
            attempts: dead.attempts(),
            error: dead.error(),
            first_failure: dead.header(crate::headers::FIRST_FAILURE_HEADER),
            last_failure: dead.header(crate::headers::LAST_FAILURE_HEADER),
            consumer: dead.consumer(),
            original_queue: dead.original_queue(),
            routing_key: dead
                .original_routing_key()
                .unwrap_or_else(|| delivery.routing_key.to_string()),
            size: delivery.data.len(),
            foreign: dead.is_foreign(),
        }
    }
}

/// The DLQ of `queue`: `queue` itself when it already is one.
fn dlq_name(queue: &str) -> String {
    dead_letter_queue(crate::amqp::work_queue(queue))
}

/// How long a copy (a replay, or a dead letter put back) may wait for its
/// confirm.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// Headers the broker adds to a delivery, which a dead letter put back must
/// not carry (the copy is a new message, delivered zero times).
const BROKER_DELIVERY_HEADERS: [&str; 2] = ["x-delivery-count", "x-acquired-count"];

/// A dead letter read and not deleted yet: what putting it back needs.
struct Held {
    tag: u64,
    properties: BasicProperties,
    body: Vec<u8>,
}

/// What a walk does with a picked dead letter.
enum Visit {
    /// Put it back at the end of the DLQ now.
    PutBack,
    /// Delete it (ack) now.
    Delete,
    /// Keep it unacked (its body held) until the operation decides.
    Hold,
}

/// A DLQ opened for reading.
struct Opened {
    connection: Connection,
    channel: Channel,
    /// Copies (replays, dead letters put back), confirmed one at a time.
    confirms: ConfirmChannel,
    dlq: String,
    /// Its ready messages when opened.
    ready: u32,
    /// Every dead letter read and not acked, in the order read.
    held: std::sync::Mutex<Vec<Held>>,
}

impl Opened {
    /// Connects and checks that the DLQ of `queue` exists.
    async fn new(services: &Services, queue: &str) -> Result<Opened> {
        let connection = services.broker().await?;
        let dlq = dlq_name(queue);
        let opened = async {
            let Some(depth) = queue_depth(&connection, &dlq).await? else {
                return Err(OpsError::DeadLetterQueueNotFound {
                    queue: queue.to_owned(),
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
    async fn next(&self) -> Result<Option<Delivery>> {
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

    fn held(&self) -> std::sync::MutexGuard<'_, Vec<Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Acknowledges (deletes) a dead letter read.
    async fn ack(&self, tag: u64) -> lapin::Result<()> {
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
    async fn walk(
        &self,
        selection: &Selection,
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
            let fate = if selection.matches(&DeadLetterSummary::of(&delivery)) && keep(&delivery) {
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
    async fn put_back(&self, tag: u64) -> Result<()> {
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
    async fn close(self, why: &str) {
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
fn without_broker_headers(properties: BasicProperties) -> BasicProperties {
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

/// The dead letters [`list`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Listing {
    /// The DLQ.
    pub dlq: String,
    /// How many messages it held when opened.
    pub ready: u32,
    /// The dead letters picked, in the DLQ's order.
    pub dead_letters: Vec<DeadLetterSummary>,
}

/// Lists at most `limit` dead letters of `queue` that `selection` picks.
/// They all stay in the DLQ: put back, without spending a delivery attempt
/// (see the module docs), in their order.
///
/// ```no_run
/// use idempo::ops::{Services, dlq};
///
/// # async fn doc(services: Services) -> idempo::ops::Result<()> {
/// let listing = dlq::list(&services, "payments", &dlq::Selection::default(), 100).await?;
/// for dead in &listing.dead_letters {
///     println!("{:?}: {} ({:?})", dead.message_id, dead.reason, dead.error);
/// }
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`OpsError::DeadLetterQueueNotFound`]; connection and channel errors.
pub async fn list(
    services: &Services,
    queue: &str,
    selection: &Selection,
    limit: usize,
) -> Result<Listing> {
    let opened = Opened::new(services, queue).await?;
    let mut dead_letters = Vec::new();
    let walked = opened
        .walk(
            selection,
            limit,
            |_| true,
            |delivery| {
                dead_letters.push(DeadLetterSummary::of(delivery));
                Visit::PutBack
            },
        )
        .await;
    let (dlq, ready) = (opened.dlq.clone(), opened.ready);
    opened.close("browsed").await;
    walked?;
    Ok(Listing {
        dlq,
        ready,
        dead_letters,
    })
}

/// One dead letter in full.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterDetail {
    /// Its summary.
    pub summary: DeadLetterSummary,
    /// Every header, as text ([`DeadLetter::headers_for_display`]).
    pub headers: BTreeMap<String, String>,
    /// Its body.
    pub body: Vec<u8>,
}

/// The first dead letter of `queue` with `message_id`. It stays in the DLQ.
///
/// # Errors
/// [`OpsError::DeadLetterNotFound`], [`OpsError::DeadLetterQueueNotFound`];
/// connection and channel errors.
pub async fn show(services: &Services, queue: &str, message_id: &str) -> Result<DeadLetterDetail> {
    let opened = Opened::new(services, queue).await?;
    let selection = Selection {
        ids: vec![message_id.to_owned()],
        ..Selection::default()
    };
    let mut found = None;
    let walked = opened
        .walk(
            &selection,
            1,
            |_| true,
            |delivery| {
                found = Some(DeadLetterDetail {
                    summary: DeadLetterSummary::of(delivery),
                    headers: DeadLetter::from_delivery(delivery).headers_for_display(),
                    body: delivery.data.clone(),
                });
                Visit::PutBack
            },
        )
        .await;
    let dlq = opened.dlq.clone();
    opened.close("browsed").await;
    walked?;
    found.ok_or_else(|| OpsError::DeadLetterNotFound {
        message_id: message_id.to_owned(),
        dlq,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(id: &str, reason: &str) -> DeadLetterSummary {
        DeadLetterSummary {
            message_id: Some(id.into()),
            reason: reason.into(),
            attempts: None,
            error: None,
            first_failure: None,
            last_failure: None,
            consumer: None,
            original_queue: None,
            routing_key: String::new(),
            size: 0,
            foreign: false,
        }
    }

    #[test]
    fn a_queue_or_its_dlq_names_the_dlq() {
        assert_eq!(dlq_name("payments"), "payments.dlq");
        assert_eq!(dlq_name("payments.dlq"), "payments.dlq");
    }

    #[test]
    fn selections_pick_by_id_and_reason_together() {
        let all = Selection::default();
        let by_id = Selection {
            ids: vec!["a".into()],
            reason: None,
        };
        let both = Selection {
            ids: vec!["a".into()],
            reason: Some("foreign".into()),
        };
        let a = summary("a", "max attempts exceeded");
        assert!(all.matches(&a));
        assert!(by_id.matches(&a));
        assert!(!by_id.matches(&summary("b", "foreign")));
        assert!(!both.matches(&a));
        assert!(both.matches(&summary("a", "foreign")));
    }
}
