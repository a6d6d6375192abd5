//! Confirmed republishing of a delivery (to a delay queue or the DLQ) before it is acked.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use super::Message;
use super::headers::ORIGINAL_EXPIRATION_HEADER;

/// Why a republish failed; the original is then handed back, not acked.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishError {
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    #[error("the broker refused the message (nack)")]
    Nacked,
    #[error("the message was unroutable (is queue {0:?} declared?)")]
    Returned(String),
    #[error("no publisher confirm within {0:?}")]
    Timeout(Duration),
}

/// Publishes copies of deliveries through the default exchange, `mandatory`
/// and persistent, on channels in confirm mode, and waits for each confirm.
///
/// Each channel carries one publish at a time, because lapin hands a returned
/// (unroutable) message to whichever pending confirm resolves next: with
/// several publishes in flight on one channel, an unroutable copy could be
/// credited with another's clean confirm, and its original acked. A few
/// channels side by side keep retries from queueing behind each other.
pub(crate) struct Republisher {
    channels: Vec<Mutex<Channel>>,
    next: AtomicUsize,
    confirm_timeout: Duration,
}

impl Republisher {
    /// Opens `channels` channels on `connection`, in confirm mode.
    pub(crate) async fn open(connection: &Connection, channels: usize) -> lapin::Result<Self> {
        let mut opened = Vec::with_capacity(channels);
        for _ in 0..channels.max(1) {
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            opened.push(Mutex::new(channel));
        }
        Ok(Republisher {
            channels: opened,
            next: AtomicUsize::new(0),
            confirm_timeout: Duration::from_secs(30),
        })
    }

    /// Publishes a copy of `message` to `queue` with `headers` added, and
    /// returns once the broker confirmed it. Only then may the original be acked.
    pub(crate) async fn publish(
        &self,
        queue: &str,
        message: &Message,
        headers: impl IntoIterator<Item = (&'static str, AMQPValue)>,
    ) -> Result<(), PublishError> {
        let properties = copy_properties(message, headers);
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.channels.len();
        let channel = self.channels[slot].lock().await;
        let confirm = async {
            channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    // mandatory: an unroutable copy comes back instead of vanishing.
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    message.body(),
                    properties,
                )
                .await?
                .await
        };
        let confirm = match tokio::time::timeout(self.confirm_timeout, confirm).await {
            Ok(confirm) => confirm?,
            Err(_) => {
                // A late confirm (or return) could be credited to the next
                // publish: retire the channel instead of reusing it.
                let _ = channel
                    .close(200, "publisher confirm timed out".into())
                    .await;
                return Err(PublishError::Timeout(self.confirm_timeout));
            }
        };
        match confirm {
            lapin::Confirmation::Ack(None) => Ok(()),
            lapin::Confirmation::Ack(Some(_)) => Err(PublishError::Returned(queue.to_owned())),
            _ => Err(PublishError::Nacked),
        }
    }

    /// Whether every channel can still publish.
    pub(crate) async fn is_open(&self) -> bool {
        for channel in &self.channels {
            if !channel.lock().await.status().connected() {
                return false;
            }
        }
        true
    }
}

/// The original properties with `headers` added, minus what must not follow a
/// copy: `expiration` (it would expire in the delay queue or the DLQ),
/// `user-id` (the broker rejects another user's id) and the `CC`/`BCC`
/// headers (they would route the copy to extra queues).
fn copy_properties(
    message: &Message,
    extra: impl IntoIterator<Item = (&'static str, AMQPValue)>,
) -> BasicProperties {
    let original = message.properties();
    let mut headers: BTreeMap<ShortString, AMQPValue> = message
        .headers()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    headers.remove("CC");
    headers.remove("BCC");
    if let Some(expiration) = original.expiration() {
        headers
            .entry(ORIGINAL_EXPIRATION_HEADER.into())
            .or_insert_with(|| AMQPValue::LongString(expiration.as_str().into()));
    }
    for (name, value) in extra {
        headers.insert(name.into(), value);
    }

    let mut properties = BasicProperties::default()
        .with_headers(FieldTable::from(headers))
        .with_delivery_mode(2);
    if let Some(v) = original.content_type() {
        properties = properties.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        properties = properties.with_content_encoding(v.clone());
    }
    if let Some(v) = original.priority() {
        properties = properties.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        properties = properties.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        properties = properties.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        properties = properties.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        properties = properties.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        properties = properties.with_type(v.clone());
    }
    if let Some(v) = original.app_id() {
        properties = properties.with_app_id(v.clone());
    }
    properties
}
