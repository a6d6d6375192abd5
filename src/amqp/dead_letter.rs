//! Dead-lettering: publish to the DLQ with the reason, confirmed, before the ack.

use std::fmt;

use lapin::Channel;
use lapin::options::BasicPublishOptions;
use lapin::types::AMQPValue;

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

/// Why a dead letter could not be published; the original is then requeued.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishError {
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    #[error("the broker refused the dead letter (nack)")]
    Nacked,
    #[error("the dead letter was unroutable (is queue {0:?} declared?)")]
    Returned(String),
}

/// Publishes `message` to `dead_letter_queue` through the default exchange
/// with the reason headers and waits for the broker's confirm. Only after this
/// returns `Ok` may the original delivery be acknowledged.
///
/// `channel` must be in confirm mode.
pub(crate) async fn publish(
    channel: &Channel,
    dead_letter_queue: &str,
    consumer: &str,
    queue: &str,
    message: &Message,
    reason: DeadLetterReason,
    error: &str,
) -> Result<(), PublishError> {
    let mut headers = message.headers().cloned().unwrap_or_default();
    let mut put = |k: &str, v: &str| {
        headers.insert(k.into(), AMQPValue::LongString(v.into()));
    };
    put(REASON_HEADER, reason.as_str());
    put(ERROR_HEADER, error);
    put(CONSUMER_HEADER, consumer);
    put(QUEUE_HEADER, queue);
    put(ROUTING_KEY_HEADER, message.routing_key());
    let properties = message
        .properties()
        .clone()
        .with_headers(headers)
        .with_delivery_mode(2);

    let confirm = channel
        .basic_publish(
            "".into(),
            dead_letter_queue.into(),
            // mandatory: an unroutable dead letter comes back instead of vanishing.
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            message.body(),
            properties,
        )
        .await?
        .await?;
    match confirm {
        lapin::Confirmation::Ack(None) => Ok(()),
        lapin::Confirmation::Ack(Some(_)) => {
            Err(PublishError::Returned(dead_letter_queue.to_owned()))
        }
        _ => Err(PublishError::Nacked),
    }
}
