//! The transactional outbox (feature `outbox`, on by default): messages a
//! transaction emits exactly when it commits.
//!
//! A handler that publishes to the broker directly emits a phantom event when
//! its transaction later rolls back, and loses the event when the process dies
//! between commit and publish. [`stage`] instead writes the message as a row
//! of the `outbox` table **in the caller's transaction**: it commits or rolls
//! back with the caller's writes. A relay ([`relay::Relay`](crate::relay::Relay),
//! run by every [`Consumer`](crate::amqp::Consumer) by default) publishes
//! committed rows with publisher confirms and `mandatory`, and deletes each
//! row only after the broker confirmed it. A crash anywhere leads to a resend
//! of the same `message_id`, never to a loss, and an idempo consumer
//! downstream deduplicates the resend: consume → write → emit → the next
//! consumer has exactly-once effects end to end.
//!
//! Staging works on any transaction's connection ([`StageTarget`]): the
//! guard of a [`Tx`](crate::Tx) in an AMQP handler or in an HTTP handler
//! behind the idempotency layer, or your own `pool.begin()`. In a consumer's
//! handler, stage through the handler's guard (`outbox::stage(&mut guard,
//! m)` with `let mut guard = tx.try_lock()?`): the consumer then writes the
//! message just before its `COMMIT`, in the same round trip,
//! and wakes its relay right after the commit.
//!
//! ```no_run
//! use idempo::outbox::{self, OutboxMessage};
//!
//! #[derive(serde::Serialize)]
//! struct Receipt { account: String, amount_cents: i64 }
//!
//! # async fn doc(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let mut tx = pool.begin().await?;
//! sqlx::query("UPDATE balances SET cents = cents + 250 WHERE account = 'alice'")
//!     .execute(&mut *tx)
//!     .await?;
//! outbox::stage(
//!     &mut tx,
//!     OutboxMessage::json("", "receipts", &Receipt { account: "alice".into(), amount_cents: 250 })?,
//! )
//! .await?;
//! tx.commit().await?; // the receipt is published now, once, by a relay
//! # Ok(()) }
//! ```
//!
//! What is guaranteed, exactly: a staged message is published **at least
//! once** after its transaction commits and **never** if it rolls back; every
//! copy carries the id fixed at staging, so a deduplicating consumer applies
//! it exactly once. Messages with the same [ordering
//! key](OutboxMessage::ordering_key) are published in commit order.

mod admin;
// The relays' side of the table, and the consumer's link to the relay it
// runs: the consumer runtime's.
#[cfg(idempo_runtime)]
pub(crate) mod batch;
mod message;
pub(crate) mod packed;
#[cfg(idempo_runtime)]
mod relay_link;
mod stage;
mod unit;
mod wire_size;

use std::future::Future;

use sha2::{Digest, Sha256};

pub use admin::{FailedMessage, OutboxStatus, PendingGroup};
pub use message::OutboxMessage;
// The consumer runtime's side: the link to the relay it runs, and its
// units' commit of what their handlers deferred.
#[cfg(idempo_runtime)]
pub(crate) use relay_link::{Publishing, RelayLink};
#[cfg(idempo_runtime)]
pub(crate) use stage::deferred_statements;
pub use stage::{StageTarget, stage, stage_all};
#[cfg(idempo_runtime)]
pub(crate) use unit::UnitOutbox;

/// Why a message could not be staged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The body could not be serialised.
    #[error("cannot serialise the message body: {0}")]
    Serialize(#[source] serde_json::Error),
    /// The body is larger than the limit (see [`OutboxMessage::max_body_size`]).
    #[error("the message body is {size} bytes, above the limit of {limit} bytes")]
    TooLarge {
        /// The body's size.
        size: usize,
        /// The limit it broke.
        limit: usize,
    },
    /// The message's properties and headers are larger than one AMQP frame
    /// of RabbitMQ's default size (`message::MAX_HEADER_FRAME`, 128 KiB): the broker would
    /// close the relay's connection over it.
    #[error(
        "the message's properties and headers take {size} bytes, above the {limit} bytes of an AMQP frame"
    )]
    HeadersTooLarge {
        /// The content header frame's size.
        size: usize,
        /// The limit it broke.
        limit: usize,
    },
    /// The message id is empty or longer than 255 bytes.
    #[error(transparent)]
    InvalidMessageId(#[from] crate::inbox::InvalidMessageId),
    /// A field the broker or PostgreSQL would refuse.
    #[error("invalid {field}: {reason}")]
    InvalidField {
        /// Which field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The insert failed (connection lost, no `outbox` table: run
    /// [`idempo::migrate`](crate::migrate)).
    #[error("cannot stage the message: {0}")]
    Database(#[from] sqlx::Error),
    /// No message id could be drawn: the operating system gave no random
    /// bytes.
    #[error("the operating system gave no random bytes: {0}")]
    Randomness(#[source] std::io::Error),
}

impl From<crate::error::RandomnessUnavailable> for OutboxError {
    fn from(e: crate::error::RandomnessUnavailable) -> Self {
        OutboxError::Randomness(e.into())
    }
}

impl From<OutboxError> for crate::Error {
    fn from(e: OutboxError) -> Self {
        crate::Error::Other(Box::new(e))
    }
}

impl OutboxError {
    /// Whether staging the same message again can never succeed (a bad
    /// message, not a lost connection): a handler returning it is
    /// dead-lettered rather than retried.
    pub fn is_permanent(&self) -> bool {
        !matches!(self, OutboxError::Database(_) | OutboxError::Randomness(_))
    }
}

/// A message id derived from the id of the message being handled and a
/// purpose (`"receipt"`): the same inputs give the same id in every process,
/// different purposes give different ids. A UUID-shaped string of 128 bits of
/// SHA-256 (version 8), well within the 255 bytes an idempo consumer accepts.
pub(crate) fn derived_message_id(incoming_id: &str, purpose: &str) -> String {
    let digest = Sha256::new()
        .chain_update(incoming_id.as_bytes())
        .chain_update([0])
        .chain_update(purpose.as_bytes())
        .finalize();
    let b: [u8; 16] = digest[..16].try_into().expect("16 of 32 bytes");
    uuid::Builder::from_custom_bytes(b).into_uuid().to_string()
}

tokio::task_local! {
    static TRACEPARENT: Option<String>;
}

/// Runs `future` with a W3C `traceparent` that [`stage`] copies into the
/// headers of every message staged inside it (unless the message has its
/// own). The AMQP consumer runs each per-message handler this way with the
/// incoming message's `traceparent` header; call it yourself around an HTTP
/// handler, with the one from the request or from your OpenTelemetry context.
pub async fn with_traceparent<F: Future>(traceparent: Option<String>, future: F) -> F::Output {
    TRACEPARENT.scope(traceparent, future).await
}

/// The creation context of what is staged now: with feature `otel` and an
/// OpenTelemetry layer, the current span's; else the `traceparent` set by
/// the innermost [`with_traceparent`], if any.
pub(crate) fn current_traceparent() -> Option<String> {
    #[cfg(feature = "otel")]
    if let Some(traced) = crate::otel::context::current_traceparent() {
        return Some(traced);
    }
    TRACEPARENT.try_with(Clone::clone).ok().flatten()
}

/// Deletes up to `batch` published rows kept longer than `keep` (rows are
/// kept only with [`Relay::keep_published`](crate::relay::Relay::keep_published));
/// returns how many. The relay calls it in bounded batches.
///
/// # Errors
/// The delete failed.
#[cfg(idempo_runtime)]
pub(crate) async fn delete_published_before(
    pool: &sqlx::PgPool,
    keep: std::time::Duration,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM outbox WHERE id IN ( \
             SELECT id FROM outbox \
             WHERE state = 'done' AND published_at < now() - make_interval(secs => $1) \
             ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
    )
    .bind(keep.as_secs_f64())
    .bind(batch)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_ids_are_stable_and_distinct_per_purpose() {
        let a = derived_message_id("payment-1", "receipt");
        assert_eq!(a, derived_message_id("payment-1", "receipt"));
        assert_ne!(a, derived_message_id("payment-1", "audit"));
        assert_ne!(a, derived_message_id("payment-2", "receipt"));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(derived_message_id("ab", "c"), derived_message_id("a", "bc"));
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "8");
        // Derived ids are stored (in inboxes, in other systems): the same
        // inputs give this very string in every build.
        assert_eq!(a, "d835c9a6-9b8d-85af-aef1-80933421cea5");
    }

    #[tokio::test]
    async fn the_traceparent_is_scoped_to_the_future() {
        assert_eq!(current_traceparent(), None);
        let inside = with_traceparent(Some("00-abc-def-01".into()), async {
            current_traceparent()
        })
        .await;
        assert_eq!(inside.as_deref(), Some("00-abc-def-01"));
        assert_eq!(current_traceparent(), None);
    }
}
