//! The transactional inbox: claim a message id inside the caller's transaction.
//!
//! This is the transport-agnostic core of idempo. A *claim* inserts
//! `(consumer, message_id)` into `processed_messages` in the same PostgreSQL
//! transaction as the business writes. If the transaction commits, the message
//! is recorded as processed together with its effects; if it rolls back, neither
//! survives. The table's primary key is the lock: two workers claiming one id
//! at once serialize on the unique index, so exactly one of them gets
//! [`Claim::Fresh`]. There is no separate "processing" mark and no
//! check-then-insert.
//!
//! The claim stores the SHA-256 of the body, so a *different* message reusing
//! an id is detected ([`Claim::Mismatch`]) instead of being silently dropped.
//!
//! # Example: any worker loop (Kafka, NATS, cron, ...)
//! ```no_run
//! use idempo::inbox::{self, Claim};
//!
//! # async fn doc(pool: sqlx::PgPool, id: &str, body: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! let mut tx = pool.begin().await?;
//! match inbox::claim(&mut tx, "billing", id, body).await? {
//!     Claim::Fresh => {
//!         sqlx::query("UPDATE accounts SET balance = balance + 10 WHERE id = 1")
//!             .execute(&mut *tx)
//!             .await?;
//!         tx.commit().await?; // effects and claim commit together
//!     }
//!     Claim::Duplicate => tx.rollback().await?, // already applied: just acknowledge
//!     Claim::Mismatch => {
//!         tx.rollback().await?;
//!         // the id was reused for a different body: park the message for a human
//!     }
//! }
//! # Ok(()) }
//! ```

use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{PgPool, Postgres, Transaction};

use crate::Result;

/// The longest accepted message id, in bytes.
pub const MAX_MESSAGE_ID_LEN: usize = 255;

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Claim {
    /// First time this consumer sees the id: do the work in this transaction,
    /// then commit.
    Fresh,
    /// Already processed (committed) by this consumer with the same body: roll
    /// back and acknowledge.
    Duplicate,
    /// Already processed, but with a *different* body: the id was reused.
    /// Nothing should run; report it.
    Mismatch,
}

/// Why a message id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMessageId {
    /// The message carried no id where one was expected.
    #[error("missing message id")]
    Missing,
    /// The id is the empty string.
    #[error("empty message id")]
    Empty,
    /// The id is longer than [`MAX_MESSAGE_ID_LEN`] bytes.
    #[error("message id is {len} bytes long, the limit is {MAX_MESSAGE_ID_LEN}")]
    TooLong {
        /// The id's length in bytes.
        len: usize,
    },
    /// A user function that derives the id panicked on this message.
    #[error("the message-id function panicked")]
    FunctionPanicked,
}

/// Checks that `id` is usable as a message id: 1 to [`MAX_MESSAGE_ID_LEN`] bytes.
///
/// # Errors
/// [`InvalidMessageId::Empty`] or [`InvalidMessageId::TooLong`].
pub fn validate_message_id(id: &str) -> Result<(), InvalidMessageId> {
    match id.len() {
        0 => Err(InvalidMessageId::Empty),
        len if len > MAX_MESSAGE_ID_LEN => Err(InvalidMessageId::TooLong { len }),
        _ => Ok(()),
    }
}

/// SHA-256 of a message body: what the inbox stores to detect a reused id.
pub fn payload_sha256(body: &[u8]) -> [u8; 32] {
    Sha256::digest(body).into()
}

/// Claims `message_id` for `consumer` inside the caller's transaction.
///
/// On [`Claim::Fresh`] the claim row is written in `tx`: commit `tx` after the
/// work, or roll it back to release the id. On [`Claim::Duplicate`] and
/// [`Claim::Mismatch`] nothing was written; roll back.
///
/// Costs one round trip for a fresh id; a duplicate costs a second one to read
/// the stored hash.
///
/// # Concurrency
/// A concurrent claim of the same `(consumer, message_id)` blocks on this
/// transaction's uncommitted row until it commits (the other side then sees
/// `Duplicate`) or rolls back (the other side then gets `Fresh`). Run the
/// transaction at the default READ COMMITTED level; under REPEATABLE READ a
/// concurrent claim fails with a serialization error, which is safe to retry.
///
/// # Errors
/// [`Error::InvalidMessageId`](crate::Error::InvalidMessageId) for an empty or
/// oversized id, [`Error::Database`](crate::Error::Database) when a statement
/// fails.
pub async fn claim(
    tx: &mut Transaction<'_, Postgres>,
    consumer: &str,
    message_id: &str,
    body: &[u8],
) -> Result<Claim> {
    validate_message_id(message_id)?;
    let hash = payload_sha256(body);
    // Bounded: the row we conflicted with can only vanish if retention deleted
    // it in between, and then the next insert succeeds.
    for _ in 0..3 {
        let inserted = sqlx::query(
            "INSERT INTO processed_messages (consumer, message_id, payload_sha256) \
             VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
        )
        .bind(consumer)
        .bind(message_id)
        .bind(&hash[..])
        .execute(&mut **tx)
        .await?
        .rows_affected();
        if inserted == 1 {
            return Ok(Claim::Fresh);
        }
        // A new statement takes a new snapshot (READ COMMITTED), so it sees the
        // row that the conflicting transaction committed.
        let stored: Option<Option<Vec<u8>>> = sqlx::query_scalar(
            "SELECT payload_sha256 FROM processed_messages WHERE consumer = $1 AND message_id = $2",
        )
        .bind(consumer)
        .bind(message_id)
        .fetch_optional(&mut **tx)
        .await?;
        match stored {
            None => continue,
            // A row without a hash (written by hand) cannot be compared.
            Some(None) => return Ok(Claim::Duplicate),
            Some(Some(stored)) if stored == hash => return Ok(Claim::Duplicate),
            Some(Some(_)) => return Ok(Claim::Mismatch),
        }
    }
    // Never guess "duplicate" here: that would acknowledge unprocessed work.
    Err(
        sqlx::Error::Protocol("the conflicting processed_messages row vanished three times".into())
            .into(),
    )
}

/// Deletes `consumer`'s claims older than `age`, `batch` rows per statement,
/// and returns how many rows went.
///
/// Each statement is its own short transaction and skips rows that another
/// reaper has locked, so replicas reaping at once neither wait for nor
/// deadlock with each other. Delete only what can no longer be redelivered: a
/// redelivery that arrives after its claim is gone is processed again.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when a statement fails.
pub async fn delete_processed_before(
    pool: &PgPool,
    consumer: &str,
    age: Duration,
    batch: i64,
) -> Result<u64> {
    let mut total = 0;
    loop {
        let deleted = sqlx::query(
            "DELETE FROM processed_messages WHERE ctid = ANY(ARRAY(\
                 SELECT ctid FROM processed_messages \
                 WHERE consumer = $1 AND processed_at < now() - make_interval(secs => $2) \
                 LIMIT $3 FOR UPDATE SKIP LOCKED))",
        )
        .bind(consumer)
        .bind(age.as_secs_f64())
        .bind(batch)
        .execute(pool)
        .await?
        .rows_affected();
        total += deleted;
        if deleted < batch.max(1) as u64 {
            return Ok(total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_from_one_to_255_bytes_are_valid() {
        assert_eq!(validate_message_id("a"), Ok(()));
        assert_eq!(validate_message_id(&"x".repeat(255)), Ok(()));
    }

    #[test]
    fn empty_and_oversized_message_ids_are_refused() {
        assert_eq!(validate_message_id(""), Err(InvalidMessageId::Empty));
        assert_eq!(
            validate_message_id(&"x".repeat(256)),
            Err(InvalidMessageId::TooLong { len: 256 })
        );
        // The limit counts bytes, not characters: 128 two-byte characters are 256 bytes.
        assert_eq!(
            validate_message_id(&"é".repeat(128)),
            Err(InvalidMessageId::TooLong { len: 256 })
        );
    }

    #[test]
    fn payload_hash_is_sha256() {
        let h = payload_sha256(b"abc");
        assert_eq!(h[..4], [0xba, 0x78, 0x16, 0xbf]);
    }
}
