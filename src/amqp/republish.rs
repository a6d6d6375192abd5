//! Confirmed republishing of a delivery (to a delay queue or the DLQ) before it is acked.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::{BasicProperties, Connection};

use super::copy::copy_properties;
use crate::amqp::fit;
use crate::amqp::publish::{ConfirmChannel, PublishError};
use crate::consumer::Message;
use crate::runtime::message::HeaderValue;

/// How long a copy may wait for its confirm before the original is handed back.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// Publishes copies of deliveries through the default exchange, `mandatory`
/// and persistent, on a few [`ConfirmChannel`]s side by side (each carries
/// one publish at a time), so that retries do not queue behind each other.
///
/// A channel the broker closed over one publish (`ACCESS_REFUSED` for a user
/// without write permission, `NOT_FOUND`) is opened again on the same
/// connection for the next copy: a refusal is that copy's failure, not the
/// session's.
pub(crate) struct Republisher {
    connection: Arc<Connection>,
    channels: Vec<tokio::sync::Mutex<Arc<ConfirmChannel>>>,
    next: AtomicUsize,
    /// The connection's frame size, which a copy's properties must fit.
    frame_max: usize,
}

impl Republisher {
    /// Opens `channels` confirm-mode channels on `connection`.
    pub(crate) async fn open(connection: &Arc<Connection>, channels: usize) -> lapin::Result<Self> {
        let mut opened = Vec::with_capacity(channels);
        for _ in 0..channels.max(1) {
            let channel = ConfirmChannel::open(connection, CONFIRM_TIMEOUT).await?;
            opened.push(tokio::sync::Mutex::new(Arc::new(channel)));
        }
        Ok(Republisher {
            connection: connection.clone(),
            channels: opened,
            next: AtomicUsize::new(0),
            frame_max: fit::frame_max(connection),
        })
    }

    /// Publishes a copy of `message` to `queue` with `headers` added, and
    /// returns once the broker confirmed it. Only then may the original be acked.
    ///
    /// # Errors
    /// [`PublishError::TooLarge`] (nothing sent) when the copy's properties
    /// do not fit the connection's frame; any other publish error.
    pub(crate) async fn publish(
        &self,
        queue: &str,
        message: &Message,
        headers: impl IntoIterator<Item = (&'static str, HeaderValue)>,
    ) -> Result<(), PublishError> {
        let properties = copy_properties(message, headers);
        self.send(queue, message, properties).await
    }

    /// [`publish`](Self::publish) for a dead letter, which must reach the DLQ
    /// even when its headers do not fit the frame: they are trimmed until they
    /// do ([`fit::trim`]). Returns the headers removed (name, bytes).
    ///
    /// # Errors
    /// [`PublishError::TooLarge`] when even idempo's own headers do not fit;
    /// any other publish error.
    pub(crate) async fn publish_trimmed(
        &self,
        queue: &str,
        message: &Message,
        headers: impl IntoIterator<Item = (&'static str, HeaderValue)>,
    ) -> Result<Vec<(String, usize)>, PublishError> {
        let properties = copy_properties(message, headers);
        let (properties, trimmed) =
            fit::trim(properties, self.frame_max).map_err(|e| PublishError::TooLarge {
                size: e.size,
                frame_max: e.frame_max,
            })?;
        self.send(queue, message, properties).await?;
        Ok(trimmed)
    }

    async fn send(
        &self,
        queue: &str,
        message: &Message,
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.channels.len();
        let channel = {
            let mut current = self.channels[slot].lock().await;
            if !current.is_usable() && self.is_open() {
                // Closed by the broker over an earlier copy: a new one.
                match ConfirmChannel::open(&self.connection, CONFIRM_TIMEOUT).await {
                    Ok(reopened) => *current = Arc::new(reopened),
                    Err(e) => tracing::debug!(error = %e, "cannot reopen a republishing channel"),
                }
            }
            current.clone()
        };
        channel.publish("", queue, message.body(), properties).await
    }

    /// Closes every channel.
    pub(crate) async fn close(&self) {
        let mut channels = Vec::with_capacity(self.channels.len());
        for slot in &self.channels {
            channels.push(slot.lock().await.clone());
        }
        futures::future::join_all(channels.iter().map(|c| c.close())).await;
    }

    /// Whether copies can still be published: the connection is up (a
    /// channel the broker closed is opened again for the next copy).
    pub(crate) fn is_open(&self) -> bool {
        self.connection.status().connected()
    }
}
