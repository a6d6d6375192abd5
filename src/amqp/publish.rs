//! The one confirmed publish: a channel in confirm mode that carries one
//! publish at a time, shared by the republisher (retries, dead letters) and
//! the deduplicating publisher.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;
use tokio::time::{Instant, timeout_at};

/// Why a publish was not confirmed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishError {
    /// The channel or connection failed: the broker may or may not hold the message.
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    #[error("the broker refused the message (nack)")]
    Nacked,
    #[error("the message was unroutable: nothing is bound for {0:?}")]
    Returned(String),
    /// No confirm in time: the broker may hold the message.
    #[error("no publisher confirm within {0:?}")]
    Timeout(Duration),
    /// The channel stayed busy with other publishes: nothing was sent.
    #[error("the publishing channel stayed busy for {0:?}; nothing was sent")]
    Busy(Duration),
}

impl PublishError {
    /// Whether the broker certainly does not hold the message (so that a
    /// dedup id reserved for it can be released).
    #[cfg_attr(not(feature = "window"), allow(dead_code))]
    pub(crate) fn certainly_not_sent(&self) -> bool {
        matches!(
            self,
            PublishError::Nacked | PublishError::Returned(_) | PublishError::Busy(_)
        )
    }
}

/// A channel in confirm mode; every publish is `mandatory`, so an unroutable
/// message comes back instead of vanishing.
///
/// One publish at a time: lapin hands a returned (unroutable) message to
/// whichever pending confirm resolves next, so with several publishes in
/// flight on one channel an unroutable message could be credited with
/// another's clean confirm.
pub(crate) struct ConfirmChannel {
    channel: Mutex<Channel>,
    confirm_timeout: Duration,
}

impl ConfirmChannel {
    pub(crate) async fn open(
        connection: &Connection,
        confirm_timeout: Duration,
    ) -> lapin::Result<Self> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(ConfirmChannel {
            channel: Mutex::new(channel),
            confirm_timeout,
        })
    }

    /// Publishes and waits for the broker's confirm. The wait for the
    /// channel, the publish and the confirm together take at most the
    /// confirm timeout.
    pub(crate) async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        let deadline = Instant::now() + self.confirm_timeout;
        let Ok(channel) = timeout_at(deadline, self.channel.lock()).await else {
            return Err(PublishError::Busy(self.confirm_timeout));
        };
        let confirm = async {
            channel
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
                .await?
                .await
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

    /// Closes the channel (if it is open), so that dropping it later does
    /// not race the connection's close.
    pub(crate) async fn close(&self) {
        let channel = self.channel.lock().await;
        if channel.status().connected() {
            let _ = channel.close(200, "idempo consumer stopped".into()).await;
        }
    }

    /// Whether the channel can still publish.
    pub(crate) async fn is_open(&self) -> bool {
        self.channel.lock().await.status().connected()
    }
}

/// `queue q` for the default exchange, `x / rk` otherwise.
fn destination(exchange: &str, routing_key: &str) -> String {
    if exchange.is_empty() {
        format!("queue {routing_key}")
    } else {
        format!("{exchange} / {routing_key}")
    }
}
