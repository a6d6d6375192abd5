//! The AMQP copy idempo sends of a delivery (to a delay queue, to the
//! DLQ, into the dead-letter table): one rule for what follows the
//! original and what does not.

use std::collections::BTreeMap;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use super::fields::amqp_value;
use crate::runtime::message::HeaderValue;
use crate::runtime::message::Message;

/// The original per-message TTL, which republished copies drop (a dead letter
/// must not expire out of the DLQ, a retry must not expire in its delay queue).
const ORIGINAL_EXPIRATION_HEADER: &str = "x-idempo-original-expiration";

/// The original properties with `headers` added, minus what must not follow a
/// copy: `expiration` (it would expire in the delay queue or the DLQ),
/// `user-id` (the broker rejects another user's id) and the `CC`/`BCC`
/// headers (they would route the copy to extra queues).
pub(crate) fn copy_properties(
    message: &Message,
    extra: impl IntoIterator<Item = (&'static str, HeaderValue)>,
) -> BasicProperties {
    let none = BasicProperties::default();
    let original = message.amqp().map_or(&none, |amqp| amqp.properties());
    let mut copy = copied(original, extra);
    if original.message_id().is_none()
        && let Some(id) = message.transport_id()
    {
        copy = copy.with_message_id(id.into());
    }
    copy
}

/// [`copy_properties`] of AMQP properties.
pub(crate) fn copied(
    original: &BasicProperties,
    extra: impl IntoIterator<Item = (&'static str, HeaderValue)>,
) -> BasicProperties {
    let mut headers: BTreeMap<ShortString, AMQPValue> = original
        .headers()
        .as_ref()
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
        headers.insert(name.into(), amqp_value(value));
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
    if let Some(v) = original.cluster_id() {
        properties = properties.with_cluster_id(v.clone());
    }
    properties
}
