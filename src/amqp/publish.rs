//! The one confirmed publish: a channel in confirm mode that carries one
//! publish at a time, shared by the republisher (retries, dead letters), the
//! deduplicating publisher, the outbox relay and the operations' replay
//! ([`ConfirmChannel`], public for tools that publish outside the runtime).

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::{BasicProperties, Channel, Connection, ErrorKind};
use tokio::sync::Mutex;
use tokio::time::{Instant, timeout_at};

/// Why a publish on a confirm-mode channel was not confirmed.
///
/// [`certainly_not_sent`](Self::certainly_not_sent) tells the failures after
/// which the broker certainly does not hold the message from those after
/// which it may.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The channel or connection failed: the broker may or may not hold the
    /// message, unless the broker closed the channel because of this publish
    /// (see [`certainly_not_sent`](Self::certainly_not_sent)).
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    /// The channel (or its connection) was already closed when the publish
    /// was attempted: lapin refused it before sending a frame.
    #[error("the channel was closed; nothing was sent: {0}")]
    Closed(lapin::Error),
    /// The broker refused the message (`basic.nack`): it does not hold it.
    #[error("the broker refused the message (nack)")]
    Nacked,
    /// The message was `mandatory` and nothing is bound for its routing key:
    /// the broker returned it (the destination is named).
    #[error("the message was unroutable: nothing is bound for {0:?}")]
    Returned(String),
    /// The channel or connection failed while the message was in flight
    /// (the broker's reason): the broker may or may not hold it.
    #[error("the channel failed: {0}")]
    Lost(String),
    /// No confirm in time: the broker may hold the message.
    #[error("no publisher confirm within {0:?}")]
    Timeout(Duration),
    /// The channel stayed busy with other publishes: nothing was sent.
    #[error("the publishing channel stayed busy for {0:?}; nothing was sent")]
    Busy(Duration),
    /// The message's properties (its headers) do not fit one frame of the
    /// connection: RabbitMQ would close the whole connection, so nothing was
    /// sent.
    #[error(
        "the message's properties need a {size}-byte frame, more than the connection's \
         frame size of {frame_max} bytes; nothing was sent"
    )]
    TooLarge {
        /// The header frame the properties need, in bytes.
        size: usize,
        /// The connection's negotiated frame size.
        frame_max: usize,
    },
}

impl PublishError {
    /// Whether the broker certainly does not hold the message (so that a
    /// dedup id reserved for it can be released): nacked, returned, never
    /// sent (busy, closed), or refused by the broker with a channel error
    /// that RabbitMQ raises before routing: `NOT_FOUND` (no such exchange) or
    /// `ACCESS_REFUSED` (no write permission on it). The channel carries one
    /// publish at a time, so such an error is this publish's.
    pub fn certainly_not_sent(&self) -> bool {
        match self {
            PublishError::Nacked
            | PublishError::Returned(_)
            | PublishError::Busy(_)
            | PublishError::TooLarge { .. }
            | PublishError::Closed(_) => true,
            PublishError::Amqp(e) => refused_before_routing(e),
            PublishError::Lost(_) | PublishError::Timeout(_) => false,
        }
    }
}

/// A channel-level `NOT_FOUND` or `ACCESS_REFUSED` from the broker.
fn refused_before_routing(error: &lapin::Error) -> bool {
    match error.kind() {
        ErrorKind::ProtocolError(e) => matches!(
            e.kind(),
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND | AMQPSoftError::ACCESSREFUSED)
        ),
        _ => false,
    }
}

/// A channel in [publisher-confirm](https://www.rabbitmq.com/docs/confirms)
/// mode; every publish is `mandatory`, so an unroutable message comes back as
/// [`PublishError::Returned`] instead of vanishing. [`publish`](Self::publish)
/// returns `Ok` only once the broker has taken responsibility for the message:
/// the moment to acknowledge (or delete) the original.
///
/// One publish at a time: lapin hands a returned (unroutable) message to
/// whichever pending confirm resolves next, so with several publishes in
/// flight on one channel an unroutable message could be credited with
/// another's clean confirm. Concurrent callers wait for the channel.
pub(crate) struct ConfirmChannel {
    channel: Mutex<Channel>,
    /// A handle on the same channel for reading its status without waiting
    /// for the publish in progress.
    status: Channel,
    confirm_timeout: Duration,
    /// The connection's frame size: larger properties are refused unsent.
    frame_max: usize,
}

impl std::fmt::Debug for ConfirmChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfirmChannel")
            .field("channel", &self.status.id())
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

impl ConfirmChannel {
    /// Opens a channel on `connection` and puts it in confirm mode; each
    /// publish waits at most `confirm_timeout` for its confirm.
    ///
    /// # Errors
    /// The channel could not be opened or put in confirm mode.
    pub(crate) async fn open(
        connection: &Connection,
        confirm_timeout: Duration,
    ) -> lapin::Result<Self> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(ConfirmChannel {
            status: channel.clone(),
            channel: Mutex::new(channel),
            confirm_timeout,
            frame_max: crate::amqp::fit::frame_max(connection),
        })
    }

    /// Publishes (`mandatory`) and waits for the broker's confirm. The wait
    /// for the channel, the publish and the confirm together take at most the
    /// confirm timeout.
    ///
    /// # Errors
    /// [`PublishError`]: nacked, returned (unroutable), timed out, the
    /// channel failed, or the properties do not fit a frame (refused before
    /// sending). After a timeout the channel is closed (a late confirm
    /// must not be credited to the next publish): open a new one.
    ///
    /// # Cancel safety
    /// Dropping the future after the message was sent leaves its fate
    /// unknown, as after [`PublishError::Timeout`].
    pub(crate) async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        let deadline = Instant::now() + self.confirm_timeout;
        self.publish_by(deadline, exchange, routing_key, body, properties)
            .await
    }

    /// [`publish`](Self::publish), done by `deadline` instead of within the
    /// confirm timeout (for a caller whose own steps share that time).
    pub(crate) async fn publish_by(
        &self,
        deadline: Instant,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        crate::amqp::fit::check(&properties, self.frame_max).map_err(|e| {
            PublishError::TooLarge {
                size: e.size,
                frame_max: e.frame_max,
            }
        })?;
        let Ok(channel) = timeout_at(deadline, self.channel.lock()).await else {
            return Err(PublishError::Busy(self.confirm_timeout));
        };
        let confirm = async {
            let sent = channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    body,
                    properties,
                )
                .await;
            let confirm = match sent {
                Ok(confirm) => confirm,
                // lapin checks the state before queueing a frame.
                Err(e) if closed_before_sending(&e) => return Err(PublishError::Closed(e)),
                Err(e) => return Err(PublishError::Amqp(e)),
            };
            Ok(confirm.await?)
        };
        match timeout_at(deadline, confirm).await {
            Ok(confirm) => match confirm? {
                lapin::Confirmation::Ack(None) => Ok(()),
                lapin::Confirmation::Ack(Some(_)) => {
                    Err(PublishError::Returned(destination(exchange, routing_key)))
                }
                _ => Err(PublishError::Nacked),
            },
            Err(_) => {
                // A late confirm (or return) would be credited to the next
                // publish: retire the channel instead of reusing it.
                let _ = channel
                    .close(200, "publisher confirm timed out".into())
                    .await;
                Err(PublishError::Timeout(self.confirm_timeout))
            }
        }
    }

    /// Publishes several messages with their confirms in flight together
    /// (one round trip for the lot instead of one each), holding the channel
    /// for the whole batch; returns each message's outcome, in order.
    ///
    /// A returned (unroutable) message reaches lapin before its confirm but
    /// is attached to whichever confirm resolves next, so returns are matched
    /// to messages by their `message_id`: give every message a distinct one.
    /// The outbox relay's.
    #[cfg(feature = "outbox")]
    pub(crate) async fn publish_all(
        &self,
        messages: Vec<OutgoingFrame<'_>>,
    ) -> Vec<Result<(), PublishError>> {
        let deadline = Instant::now() + self.confirm_timeout;
        let Ok(channel) = timeout_at(deadline, self.channel.lock()).await else {
            return messages
                .iter()
                .map(|_| Err(PublishError::Busy(self.confirm_timeout)))
                .collect();
        };
        let mut ids = Vec::with_capacity(messages.len());
        let mut destinations = Vec::with_capacity(messages.len());
        let mut confirms = Vec::with_capacity(messages.len());
        let mut broken = None;
        for m in messages {
            ids.push(m.properties.message_id().as_ref().map(|id| id.to_string()));
            destinations.push(destination(m.exchange, m.routing_key));
            if broken.is_some() {
                confirms.push(None);
                continue;
            }
            let options = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            let published = timeout_at(
                deadline,
                channel.basic_publish(
                    m.exchange.into(),
                    m.routing_key.into(),
                    options,
                    m.body,
                    m.properties,
                ),
            )
            .await;
            match published {
                Ok(Ok(confirm)) => confirms.push(Some(confirm)),
                Ok(Err(e)) => {
                    broken = Some(e.to_string());
                    confirms.push(None);
                }
                Err(_) => {
                    broken = Some(format!(
                        "no publisher confirm within {:?}",
                        self.confirm_timeout
                    ));
                    confirms.push(None);
                }
            }
        }
        let mut outcomes = Vec::with_capacity(confirms.len());
        let mut returned = std::collections::HashSet::new();
        let mut timed_out = false;
        for confirm in confirms {
            let outcome = match confirm {
                None => Err(broken.clone().unwrap_or_default()),
                Some(confirm) => match timeout_at(deadline, confirm).await {
                    Ok(Ok(lapin::Confirmation::Ack(ret))) => Ok((true, ret)),
                    Ok(Ok(lapin::Confirmation::Nack(ret))) => Ok((false, ret)),
                    Ok(Ok(lapin::Confirmation::NotRequested)) => Ok((true, None)),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => {
                        timed_out = true;
                        Err(format!(
                            "no publisher confirm within {:?}",
                            self.confirm_timeout
                        ))
                    }
                },
            };
            if let Ok((_, Some(ret))) = &outcome
                && let Some(id) = ret.properties.message_id()
            {
                returned.insert(id.to_string());
            }
            outcomes.push(outcome.map(|(acked, _)| acked));
        }
        if timed_out {
            // As in `publish`: a late confirm must not be credited to the next batch.
            let _ = channel
                .close(200, "publisher confirm timed out".into())
                .await;
        }
        outcomes
            .into_iter()
            .zip(ids)
            .zip(destinations)
            .map(|((outcome, id), destination)| match outcome {
                Ok(true) if id.as_ref().is_some_and(|id| returned.contains(id)) => {
                    Err(PublishError::Returned(destination))
                }
                Ok(true) => Ok(()),
                Ok(false) => Err(PublishError::Nacked),
                Err(why) => Err(PublishError::Lost(why)),
            })
            .collect()
    }

    /// Closes the channel (if it is open), so that dropping it later does
    /// not race the connection's close.
    pub(crate) async fn close(&self) {
        let channel = self.channel.lock().await;
        if channel.status().connected() {
            let _ = channel.close(200, "idempo consumer stopped".into()).await;
        }
    }

    /// Whether the channel can still publish (without waiting for a publish
    /// in progress).
    pub(crate) fn is_usable(&self) -> bool {
        self.status.status().connected()
    }
}

/// Whether lapin refused a publish because the channel or its connection was
/// no longer open (it checks that before it queues a frame).
fn closed_before_sending(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        ErrorKind::InvalidChannelState(..) | ErrorKind::InvalidConnectionState(_)
    )
}

/// One message of [`ConfirmChannel::publish_all`].
#[cfg(feature = "outbox")]
pub(crate) struct OutgoingFrame<'a> {
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    pub(crate) body: &'a [u8],
    pub(crate) properties: BasicProperties,
}

/// `queue q` for the default exchange, `x / rk` otherwise.
fn destination(exchange: &str, routing_key: &str) -> String {
    if exchange.is_empty() {
        format!("queue {routing_key}")
    } else {
        format!("{exchange} / {routing_key}")
    }
}
