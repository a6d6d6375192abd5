//! Deliveries the AMQP client cannot parse, moved to the dead-letter queue.
//!
//! RabbitMQ accepts a message whose `message_id`, `content_type` (any short
//! string property) or a header *name* is not valid UTF-8; lapin refuses to
//! parse its frames and drops the connection. The broker then redelivers that
//! message first, and every new session dies the same way: one message would
//! stop the queue. So when a session ends with a frame lapin could not
//! parse, the runtime reads the head of the queue itself, on a connection of
//! its own with a parser that takes any bytes: `basic.get` until it finds
//! the messages whose properties are not UTF-8 (at most a prefetch's worth),
//! publishes each to the DLQ (confirmed, `mandatory`) with the properties made
//! valid (invalid bytes replaced by U+FFFD), the original bytes in
//! `x-idempo-error` and reason `undecodable properties`, and acks it. The
//! well-formed messages it read are handed back by closing the connection.
//!
//! This is a deliberately small AMQP 0-9-1 client: one connection (on
//! lapin's transport, so `amqps://` and the broker's TLS settings work as for
//! the consumer), PLAIN authentication, one channel, `basic.get`,
//! `basic.publish` with confirms, `basic.ack`. Every step is bounded in time.

mod codec;
mod error;
mod wire;

use std::time::{Duration, SystemTime};

use lapin::tcp::AMQPUriTcpExt;

use super::broker::Broker;
use crate::runtime::dead_letter::DeadLetterReason;
use crate::runtime::header_names::{
    ATTEMPTS_HEADER, CONSUMER_HEADER, ERROR_HEADER, FIRST_FAILURE_HEADER, LAST_FAILURE_HEADER,
    QUEUE_HEADER, REASON_HEADER, ROUTING_KEY_HEADER,
};
use crate::runtime::headers::rfc3339;
use codec::Value;
pub(crate) use error::QuarantineError;
use error::Result;
use wire::Wire;

/// How long the whole pass may take.
pub(crate) const TIME_LIMIT: Duration = Duration::from_secs(30);

/// Where to look and what to write on the dead letters.
pub(crate) struct Target<'a> {
    pub(crate) broker: &'a Broker,
    /// The node whose session died.
    pub(crate) node: usize,
    pub(crate) queue: &'a str,
    pub(crate) dead_letter_queue: &'a str,
    pub(crate) consumer: &'a str,
    /// How many messages to read at most (the ones before a bad one stay
    /// unacked meanwhile).
    pub(crate) limit: usize,
    /// The table store's pool, when the consumer keeps its dead letters in
    /// PostgreSQL: the poison goes there instead of to the DLQ.
    pub(crate) table: Option<&'a sqlx::PgPool>,
}

/// Moves the unparseable messages among the first `limit` of the queue to
/// the DLQ; returns how many it moved.
pub(crate) async fn run(target: &Target<'_>) -> Result<usize> {
    tokio::time::timeout(TIME_LIMIT, pass(target))
        .await
        .map_err(|_| QuarantineError::Timeout(TIME_LIMIT))?
}

async fn pass(target: &Target<'_>) -> Result<usize> {
    let uri = target
        .broker
        .uri(target.node)
        .map_err(|e| QuarantineError::Address(e.to_string()))?;
    let runtime =
        lapin::runtime::default_runtime().map_err(|e| QuarantineError::Address(e.to_string()))?;
    let tls = target.broker.tls_config();
    let stream = uri
        .connect_with_config_async(tls.as_ref(), &runtime)
        .await?;
    let mut wire = Wire::new(stream);
    wire.open(
        &uri.authority.userinfo.username,
        &uri.authority.userinfo.password,
        &uri.vhost,
    )
    .await?;
    let mut moved = 0;
    let mut publishes = 0u64;
    for _ in 0..target.limit {
        let Some(got) = wire.get(target.queue).await? else {
            break;
        };
        let problems = got.properties.problems(&got.routing_key);
        if problems.is_empty() {
            continue; // well-formed: handed back when the connection closes
        }
        let error = format!("undecodable properties: {}", problems.join("; "));
        tracing::warn!(queue = target.queue, %error, "moving a message the client cannot parse to the dead-letter queue");
        let now = rfc3339(SystemTime::now());
        let text = |s: &str| Value::long_string(s.as_bytes());
        let mut headers = got.properties.headers.clone().unwrap_or_default();
        headers.extend([
            (
                REASON_HEADER.into(),
                text(DeadLetterReason::UndecodableProperties.as_str()),
            ),
            (ERROR_HEADER.into(), text(&error)),
            (CONSUMER_HEADER.into(), text(target.consumer)),
            (QUEUE_HEADER.into(), text(target.queue)),
            (
                ROUTING_KEY_HEADER.into(),
                Value::long_string(&got.routing_key),
            ),
            (
                ATTEMPTS_HEADER.into(),
                Value::Other(b'l', 1i64.to_be_bytes().to_vec()),
            ),
            (FIRST_FAILURE_HEADER.into(), text(&now)),
            (LAST_FAILURE_HEADER.into(), text(&now)),
        ]);
        let mut properties = got.properties.clone();
        properties.headers = Some(headers);
        // As the republisher does: a dead letter must not expire out of the
        // DLQ, and another user's id would be refused.
        properties.expiration = None;
        properties.user_id = None;
        properties.delivery_mode = Some(2);
        if let Some(pool) = target.table {
            // Stored (committed) before the ack; while PostgreSQL cannot take
            // it, the pass fails and the message is handed back.
            store(pool, target, &properties, &got, &error, &now).await?;
            wire.ack(got.delivery_tag).await?;
            moved += 1;
            continue;
        }
        publishes += 1;
        wire.publish(target.dead_letter_queue, &properties, &got.body, publishes)
            .await?;
        wire.ack(got.delivery_tag).await?;
        moved += 1;
    }
    wire.close().await;
    Ok(moved)
}

/// The poison as a letter of the table store, its properties mended to
/// UTF-8 (the codec's writer does that), read back as lapin's.
async fn store(
    pool: &sqlx::PgPool,
    target: &Target<'_>,
    properties: &codec::Properties,
    got: &codec::Got,
    error: &str,
    now: &str,
) -> Result<()> {
    let mut encoded = codec::Writer::default();
    encoded.properties(properties);
    let (_, mended) = lapin::protocol::basic::parse_properties(encoded.buf.as_slice())
        .map_err(|e| QuarantineError::Protocol(format!("mended properties: {e}")))?;
    let message_id = mended
        .message_id()
        .as_ref()
        .map(|id| id.to_string())
        .unwrap_or_default();
    let routing_key = String::from_utf8_lossy(&got.routing_key);
    let letter = crate::runtime::letter_table::Row {
        transport: crate::amqp::TRANSPORT,
        consumer: target.consumer,
        queue: target.queue,
        message_id: &message_id,
        exchange: "",
        routing_key: &routing_key,
        properties: &crate::amqp::stored::to_stored(&mended),
        body: &got.body,
        reason: DeadLetterReason::UndecodableProperties.as_str(),
        error,
        attempts: 1,
        first_failed_at: now,
        last_failed_at: now,
    };
    // A message processed already is only acknowledged (no letter).
    crate::runtime::letter_table::insert(pool, &letter)
        .await
        .map(|_filing| ())
        .map_err(|e| QuarantineError::Store(e.to_string()))
}
