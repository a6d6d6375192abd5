//! [`DedupPublisher`]: publish once per dedup id within the window.

use std::fmt;
use std::time::Duration;

use lapin::types::{AMQPValue, ShortString};
use lapin::{BasicProperties, Connection};

use crate::amqp::publish::{ConfirmChannel, PublishError};
use crate::window::{DedupId, DedupWindow, Reservation, Scope, WindowStore};
use crate::{Error, Result};

/// The header that carries a message's dedup id.
pub const DEDUP_ID_HEADER: &str = "x-idempo-dedup-id";

/// The header that carries a message's group id (SQS's `MessageGroupId`).
pub const GROUP_ID_HEADER: &str = "x-group-id";

/// A message to publish with [`DedupPublisher::publish`].
#[derive(Debug, Clone)]
pub struct Outgoing {
    body: Vec<u8>,
    properties: BasicProperties,
    dedup_id: Option<DedupId>,
    group: Option<String>,
}

impl Outgoing {
    /// A persistent message with `body`, deduplicated on its content unless
    /// [`dedup_id`](Self::dedup_id) is set.
    pub fn new(body: impl Into<Vec<u8>>) -> Self {
        Outgoing {
            body: body.into(),
            properties: BasicProperties::default().with_delivery_mode(2),
            dedup_id: None,
            group: None,
        }
    }

    /// Deduplicate on this id instead of the body's hash.
    #[must_use]
    pub fn dedup_id(mut self, id: DedupId) -> Self {
        self.dedup_id = Some(id);
        self
    }

    /// Puts the message in a group: header [`GROUP_ID_HEADER`], and ids count
    /// per group.
    #[must_use]
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }

    /// The AMQP properties (a `message_id` set here is kept; otherwise a
    /// random UUID is assigned).
    #[must_use]
    pub fn properties(mut self, properties: BasicProperties) -> Self {
        self.properties = properties;
        self
    }
}

/// What [`DedupPublisher::publish`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The `message_id` of the message on the queue: for a duplicate, the
    /// first publish's (as SQS returns it).
    pub message_id: String,
    /// `true` when nothing was sent because the id was seen in the window.
    pub duplicate: bool,
}

/// Publishes through a confirm-mode channel, at most once per dedup id
/// within the window.
///
/// The id is *reserved* before publishing and *recorded* only after the
/// broker confirmed the publish: a publish that fails releases it, so it
/// does not poison the id, and a concurrent publish of the same id waits for
/// the first to settle (then returns its message id, or publishes itself if
/// the first failed). A process that dies between the confirm and the record
/// leaves a reservation that expires after its lease (70 s); a retry after
/// that publishes again: the window is at-least-once at that point. So does a
/// publish whose confirm never came (the broker may hold it): it returns an
/// error but keeps the id reserved for the lease.
pub struct DedupPublisher<S> {
    channel: ConfirmChannel,
    window: DedupWindow<S>,
    lease: Duration,
    confirm_timeout: Duration,
}

impl<S> fmt::Debug for DedupPublisher<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DedupPublisher")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl<S: WindowStore> DedupPublisher<S> {
    /// Opens a confirm-mode channel on `connection`.
    ///
    /// # Errors
    /// [`Error::Amqp`] when the channel cannot be opened.
    pub async fn new(connection: &Connection, window: DedupWindow<S>) -> Result<Self> {
        let confirm_timeout = Duration::from_secs(30);
        Ok(DedupPublisher {
            channel: ConfirmChannel::open(connection, confirm_timeout).await?,
            window,
            // Outlasts the slowest path from reserving to recording: the wait
            // for the channel and the confirm are both inside confirm_timeout.
            lease: Duration::from_secs(70),
            confirm_timeout,
        })
    }

    /// Publishes `message` to `exchange` with `routing_key` (the default
    /// exchange `""` and a queue name publish to that queue), unless its
    /// dedup id was seen within the window in the same scope (the exchange
    /// and routing key, and the group if any).
    ///
    /// # Errors
    /// [`Error::PublishNotConfirmed`] when the broker nacked the message or
    /// returned it as unroutable (the id is released: publishing again is
    /// safe), or did not confirm within 30 s (the outcome is unknown: the id
    /// stays reserved for its lease); [`Error::Amqp`] when the channel
    /// failed (outcome unknown too); the store's error.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: Outgoing,
    ) -> Result<Published> {
        let id = message
            .dedup_id
            .clone()
            .unwrap_or_else(|| DedupId::content(&message.body));
        // The exchange's length keeps ("", "a/b") and ("a", "b") apart.
        let destination = if exchange.is_empty() {
            routing_key.to_owned()
        } else {
            format!("{}:{exchange}/{routing_key}", exchange.len())
        };
        let scope = match &message.group {
            Some(group) => Scope::group(&destination, group),
            None => Scope::queue(&destination),
        };
        let deadline = tokio::time::Instant::now() + self.lease + self.confirm_timeout;
        loop {
            match self.window.reserve(&scope, &id, self.lease).await? {
                Reservation::Seen(message_id) => {
                    return Ok(Published {
                        message_id,
                        duplicate: true,
                    });
                }
                Reservation::Pending if tokio::time::Instant::now() < deadline => {
                    // Another publisher holds the id: wait for it to settle.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Reservation::Pending => {
                    return Err(Error::PublishNotConfirmed(format!(
                        "dedup id {id} stayed reserved by another publisher"
                    )));
                }
                Reservation::Reserved { token } => {
                    let sent = self.send(exchange, routing_key, &message, &id).await;
                    return match sent {
                        Ok(message_id) => {
                            // The message is out: a failure to record is logged,
                            // not returned (the caller would publish it again).
                            match self.window.record(&scope, &id, token, &message_id).await {
                                Ok(true) => {}
                                Ok(false) => {
                                    tracing::warn!(%id, "the reservation expired before the publish was recorded")
                                }
                                Err(e) => {
                                    tracing::warn!(%id, error = %e, "the publish could not be recorded in the window")
                                }
                            }
                            Ok(Published {
                                message_id,
                                duplicate: false,
                            })
                        }
                        // No confirm: the broker may hold the message. Keep the
                        // reservation (it expires with its lease) rather than let
                        // a retry publish a second copy at once.
                        Err(Sent::Unknown(error)) => Err(error),
                        Err(Sent::No(error)) => {
                            if let Err(e) = self.window.release(&scope, &id, token).await {
                                tracing::warn!(%id, error = %e, "could not release the dedup id");
                            }
                            Err(error)
                        }
                    };
                }
            }
        }
    }

    /// Publishes and waits for the confirm; returns the message id.
    async fn send(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Outgoing,
        id: &DedupId,
    ) -> std::result::Result<String, Sent> {
        let message_id = match &message.properties.message_id() {
            Some(known) => known.to_string(),
            None => crate::random::uuid_v4(),
        };
        let mut headers = message.properties.headers().clone().unwrap_or_default();
        headers.insert(
            DEDUP_ID_HEADER.into(),
            AMQPValue::LongString(id.as_str().into()),
        );
        if let Some(group) = &message.group {
            headers.insert(
                GROUP_ID_HEADER.into(),
                AMQPValue::LongString(group.as_str().into()),
            );
        }
        let properties = message
            .properties
            .clone()
            .with_message_id(ShortString::from(message_id.clone()))
            .with_headers(headers);
        match self
            .channel
            .publish(exchange, routing_key, &message.body, properties)
            .await
        {
            Ok(()) => Ok(message_id),
            Err(e) => {
                let certain = e.certainly_not_sent();
                let error = match e {
                    PublishError::Amqp(e) => Error::Amqp(e),
                    PublishError::Timeout(_) => Error::PublishNotConfirmed(format!(
                        "no confirm within {:?}; the outcome is unknown and the id stays reserved for its lease",
                        self.confirm_timeout
                    )),
                    other => Error::PublishNotConfirmed(other.to_string()),
                };
                Err(if certain {
                    Sent::No(error)
                } else {
                    Sent::Unknown(error)
                })
            }
        }
    }
}

/// Why a publish did not go out, and whether that is certain.
enum Sent {
    /// Certainly not delivered (nacked, returned): the id can be released.
    No(Error),
    /// Perhaps delivered (no confirm, a channel error): keep the id reserved.
    Unknown(Error),
}
