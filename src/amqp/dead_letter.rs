//! Dead-lettering: publish to the DLQ with the reason, confirmed, before the ack.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel};
use tokio::sync::Mutex;

use super::Message;

/// Header carrying the reason category (one of [`DeadLetterReason::as_str`]).
pub const REASON_HEADER: &str = "x-idempo-reason";
/// Header carrying the error text.
pub const ERROR_HEADER: &str = "x-idempo-error";
/// Header naming the consumer that dead-lettered the message.
pub const CONSUMER_HEADER: &str = "x-idempo-consumer";
/// Header naming the queue the message was consumed from.
pub const QUEUE_HEADER: &str = "x-idempo-original-queue";
/// Header carrying the routing key the message was published with.
pub const ROUTING_KEY_HEADER: &str = "x-idempo-original-routing-key";

/// Why a delivery went to the dead-letter queue. Each one is final:
/// redelivering the same message cannot change the outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// No message id could be found.
    MissingMessageId,
    /// The message id is empty or longer than 255 bytes.
    InvalidMessageId,
    /// The body could not be decoded into the handler's type.
    UndecodableBody,
    /// The id was already processed with a different body.
    PayloadMismatch,
    /// The handler returned a permanent error.
    PermanentError,
}

impl DeadLetterReason {
    /// The value of the [`REASON_HEADER`] header.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::MissingMessageId => "missing message id",
            DeadLetterReason::InvalidMessageId => "invalid message id",
            DeadLetterReason::UndecodableBody => "undecodable body",
            DeadLetterReason::PayloadMismatch => "message id reused with a different payload",
            DeadLetterReason::PermanentError => "permanent handler error",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Header keeping the original per-message TTL, which the dead letter drops
/// (a dead letter must not expire out of the DLQ).
pub const ORIGINAL_EXPIRATION_HEADER: &str = "x-idempo-original-expiration";

/// Why a dead letter could not be published; the original is then requeued.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishError {
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    #[error("the broker refused the dead letter (nack)")]
    Nacked,
    #[error("the dead letter was unroutable (is queue {0:?} declared?)")]
    Returned(String),
    #[error("no publisher confirm within {0:?}")]
    Timeout(Duration),
}

/// Publishes dead letters on a channel in confirm mode, one at a time.
///
/// One at a time, because lapin hands a returned (unroutable) message to
/// whichever pending confirm resolves next: with several dead letters in
/// flight, an unroutable one could be credited with another's clean confirm,
/// and its original acked. Dead letters are rare; the serialization is cheap.
pub(crate) struct DeadLetterPublisher {
    channel: Mutex<Channel>,
    dead_letter_queue: String,
    consumer: String,
    queue: String,
    confirm_timeout: Duration,
}

impl DeadLetterPublisher {
    /// `channel` must already be in confirm mode.
    pub(crate) fn new(
        channel: Channel,
        dead_letter_queue: String,
        consumer: String,
        queue: String,
    ) -> Self {
        DeadLetterPublisher {
            channel: Mutex::new(channel),
            dead_letter_queue,
            consumer,
            queue,
            confirm_timeout: Duration::from_secs(30),
        }
    }

    /// Publishes `message` to the dead-letter queue through the default
    /// exchange, `mandatory` and persistent, with the reason headers, and waits
    /// for the broker's confirm. Only after `Ok` may the original be acked.
    pub(crate) async fn publish(
        &self,
        message: &Message,
        reason: DeadLetterReason,
        error: &str,
    ) -> Result<(), PublishError> {
        let properties = self.properties(message, reason, error);
        let channel = self.channel.lock().await;
        let confirm = async {
            channel
                .basic_publish(
                    "".into(),
                    self.dead_letter_queue.as_str().into(),
                    // mandatory: an unroutable dead letter comes back instead of vanishing.
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
                // A late confirm (or return) could be credited to the next dead
                // letter: retire the channel instead of reusing it.
                let _ = channel
                    .close(200, "dead-letter confirm timed out".into())
                    .await;
                return Err(PublishError::Timeout(self.confirm_timeout));
            }
        };
        match confirm {
            lapin::Confirmation::Ack(None) => Ok(()),
            lapin::Confirmation::Ack(Some(_)) => {
                Err(PublishError::Returned(self.dead_letter_queue.clone()))
            }
            _ => Err(PublishError::Nacked),
        }
    }

    /// Whether the channel can still publish; when it cannot, the consumer stops.
    pub(crate) async fn is_open(&self) -> bool {
        self.channel.lock().await.status().connected()
    }

    /// The original properties, minus what must not follow a dead letter:
    /// `expiration` (it would expire out of the DLQ), `user-id` (the broker
    /// rejects another user's id) and the `CC`/`BCC` headers (extra routing).
    fn properties(
        &self,
        message: &Message,
        reason: DeadLetterReason,
        error: &str,
    ) -> BasicProperties {
        let original = message.properties();
        let mut headers: BTreeMap<ShortString, AMQPValue> = message
            .headers()
            .map(|h| h.inner().clone())
            .unwrap_or_default();
        headers.remove("CC");
        headers.remove("BCC");
        let mut put = |k: &str, v: &str| {
            headers.insert(k.into(), AMQPValue::LongString(v.into()));
        };
        put(REASON_HEADER, reason.as_str());
        put(ERROR_HEADER, error);
        put(CONSUMER_HEADER, &self.consumer);
        put(QUEUE_HEADER, &self.queue);
        put(ROUTING_KEY_HEADER, message.routing_key());
        if let Some(expiration) = original.expiration() {
            put(ORIGINAL_EXPIRATION_HEADER, expiration.as_str());
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
}
