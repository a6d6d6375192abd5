//! Where a delivery's message id comes from.

use std::fmt;
use std::sync::Arc;

use crate::inbox::{InvalidMessageId, payload_sha256};
use crate::message_id::validate_message_id;
use crate::runtime::message::Message;

/// A user function that finds a delivery's id; `None` means "no id". (An
/// alias for the crate's code only: rustdoc shows the type it names.)
pub(crate) type IdFn = Arc<dyn Fn(&Message) -> Option<String> + Send + Sync>;

/// How the runtime finds the id it deduplicates on.
///
/// # Default
/// [`MessageIdSource::Property`]: the transport's own id field (RabbitMQ:
/// the AMQP `message_id` property; JetStream: the `Nats-Msg-Id` header),
/// which publishers should set to the id of the *business* operation (a
/// payment id), not a fresh id per publish attempt.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum MessageIdSource {
    /// The transport's own id field: RabbitMQ's `message_id` property,
    /// JetStream's `Nats-Msg-Id` header.
    #[default]
    Property,
    /// An application header with this name (string or integer value).
    Header(String),
    /// A function of the delivery; `None` means "no id" (dead-lettered).
    /// Made by [`MessageIdSource::custom`].
    Custom(IdFn),
    /// The lowercase hex SHA-256 of the body: equal bodies are one message.
    ///
    /// Opt-in, because two *intended* identical messages (two equal payments)
    /// become one.
    ContentHash,
}

impl MessageIdSource {
    /// A [`MessageIdSource::Custom`] from a closure.
    pub fn custom(f: impl Fn(&Message) -> Option<String> + Send + Sync + 'static) -> Self {
        MessageIdSource::Custom(Arc::new(f))
    }

    /// Extracts and validates the id of `message` from this source.
    ///
    /// (The runtime first looks for the id an idempo copy carries forward in
    /// `x-idempo-message-id`, sealed under the
    /// consumer's key; a header without a valid seal is ignored, and then
    /// this source decides.)
    ///
    /// # Errors
    /// [`InvalidMessageId`] when it is missing, empty, over 255 bytes or
    /// holds a NUL.
    pub fn extract(&self, message: &Message) -> Result<String, InvalidMessageId> {
        let id = match self {
            MessageIdSource::Property => message.transport_id().map(str::to_owned),
            MessageIdSource::Header(name) => message.header_text(name),
            // A panic here would repeat on every redelivery: treat it as
            // an invalid id, which is dead-lettered.
            MessageIdSource::Custom(f) => {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(message)))
                    .map_err(|_| InvalidMessageId::FunctionPanicked)?
            }
            MessageIdSource::ContentHash => Some(hex::encode(payload_sha256(message.body()))),
        };
        let id = id.ok_or(InvalidMessageId::Missing)?;
        validate_message_id(&id)?;
        Ok(id)
    }
}

impl fmt::Debug for MessageIdSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MessageIdSource::Property => f.write_str("Property"),
            MessageIdSource::Header(h) => f.debug_tuple("Header").field(h).finish(),
            MessageIdSource::Custom(_) => f.write_str("Custom(..)"),
            MessageIdSource::ContentHash => f.write_str("ContentHash"),
        }
    }
}
