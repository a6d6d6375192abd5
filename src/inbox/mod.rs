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
//! use idempo::inbox::{Begun, Inbox};
//!
//! # async fn doc(pool: sqlx::PgPool, id: &str, body: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = Inbox::new("billing");
//! match inbox.begin(&pool, id, body).await? {
//!     Begun::Fresh(mut tx) => {
//!         sqlx::query("UPDATE accounts SET balance = balance + 10 WHERE id = 1")
//!             .execute(&mut *tx)
//!             .await?;
//!         // The claim check, then COMMIT: effects and claim commit together;
//!         // an aborted transaction (a failed statement that was ignored) is
//!         // an error, not a silent rollback.
//!         inbox.commit(tx, id).await?;
//!     }
//!     Begun::Duplicate => {} // already applied: just acknowledge
//!     Begun::Mismatch => {
//!         // the id was reused for a different body: park the message for a human
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! [`Inbox::claim`] does the same inside a transaction the caller opened.
//!
//! # The wire shape
//! [`Inbox::begin`] and [`Inbox::commit`], for a fresh message, cost four
//! round trips of idempo's own around the caller's statements, one more
//! than a careful hand-written loop (`BEGIN`, claim, ..., `COMMIT`), for the
//! claim check:
//!
//! 1. `BEGIN ISOLATION LEVEL READ COMMITTED` (plain `BEGIN` when the
//!    consumer knows its sessions default to it).
//! 2. `INSERT INTO processed_messages ... ON CONFLICT DO NOTHING`, a
//!    statement prepared once per connection: PostgreSQL does not parse or
//!    plan it again. A duplicate raises nothing, so it writes no `ERROR`
//!    line to PostgreSQL's log and aborts no transaction: its stored body
//!    hash is read (one more round trip) and the empty transaction is
//!    dropped. (Sending `BEGIN` with a literal claim in one simple query
//!    saves a round trip but makes PostgreSQL parse and plan the claim for
//!    every message, and sqlx cannot read that query's answer, so a
//!    duplicate could only show as an error; measured slower on a shared
//!    host, see BENCHMARKS.md.)
//! 3. `SELECT 1 / count(*) FROM processed_messages WHERE <the claim>`,
//!    prepared too: in an aborted transaction it fails (`25P02`), and when
//!    the claim is gone (the caller rolled back, deleted it, or ignored a
//!    [`Claim::Duplicate`]) it divides by zero, so in neither case is
//!    `COMMIT` sent.
//! 4. `COMMIT`.
//!
//! The consumer runtime sends one round trip fewer, the hand loop's count:
//! it claimed the unit itself, so the only ways to lose its claims are an
//! aborted transaction and one the handler ended, and neither needs the
//! table to be seen. Its commit is `SELECT; COMMIT AND CHAIN` in one simple
//! query (nothing to plan): `SELECT` fails in an aborted transaction and the
//! query stops there; after the handler's own `ROLLBACK` or `COMMIT` the
//! query runs in an implicit transaction, where `COMMIT AND CHAIN` is an
//! error. The messages the handler deferred to the outbox travel in the
//! same query, before `COMMIT AND CHAIN`. The chained empty transaction is
//! rolled back with the pool's check of the released connection.

use std::future::Future;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{PgPool, Postgres, Transaction};

#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
pub use crate::message_id::InvalidMessageId;
use crate::message_id::validate_message_id;

pub(crate) mod claim;
pub mod partitioned;
mod reports;
mod retention;

pub use reports::ConsumerClaims;

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

/// SHA-256 of a message body ([`Inbox::payload_sha256`]).
pub(crate) fn payload_sha256(body: &[u8]) -> [u8; 32] {
    Sha256::digest(body).into()
}

/// What [`Inbox::begin`] found, with the transaction it opened for a fresh
/// claim.
#[derive(Debug)]
#[must_use]
pub enum Begun {
    /// First time this consumer sees the id: the claim is in this open
    /// transaction (READ COMMITTED). Do the work in it, then [`Inbox::commit`].
    Fresh(Transaction<'static, Postgres>),
    /// Already processed with the same body: acknowledge. No transaction is
    /// open.
    Duplicate,
    /// Already processed with a *different* body: the id was reused. No
    /// transaction is open.
    Mismatch,
}

/// What [`Inbox::begin_batch`] found.
#[derive(Debug)]
#[non_exhaustive]
pub struct ClaimedBatch {
    /// One claim per message, in order.
    pub claims: Vec<Claim>,
    /// The open transaction that holds the fresh claims; `None` when no
    /// claim is fresh.
    pub tx: Option<Transaction<'static, Postgres>>,
}

/// A consumer's inbox: the claims of its message ids in
/// `processed_messages`, plain or [partitioned](mod@partitioned). Each method
/// works inside, or opens, the caller's PostgreSQL transaction; the inbox
/// itself holds no connection and is cheap to clone.
///
/// ```no_run
/// use idempo::inbox::{Claim, Inbox};
/// # async fn doc(pool: sqlx::PgPool, body: &[u8]) -> idempo::Result<()> {
/// let inbox = Inbox::new("billing");
/// let mut tx = pool.begin().await?;
/// if inbox.claim(&mut tx, "pay-1", body).await? == Claim::Fresh {
///     // ... the work, in `tx` ...
///     inbox.commit(tx, "pay-1").await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbox {
    consumer: String,
    partitioned: bool,
}

impl Inbox {
    /// SHA-256 of a message body: what the inbox stores (the
    /// `payload_sha256` column) to detect a reused id.
    pub fn payload_sha256(body: &[u8]) -> [u8; 32] {
        payload_sha256(body)
    }

    /// The inbox of `consumer` (its claims are apart from every other
    /// consumer's), on the plain `processed_messages`.
    pub fn new(consumer: impl Into<String>) -> Self {
        Inbox {
            consumer: consumer.into(),
            partitioned: false,
        }
    }

    /// Claims in the partitioned `processed_messages` (see [`partitioned`]:
    /// the table must have been switched, and claims need READ COMMITTED)
    /// instead of the plain table.
    #[must_use]
    pub fn partitioned(mut self, partitioned: bool) -> Self {
        self.partitioned = partitioned;
        self
    }

    /// The consumer whose claims these are.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Whether claims go to the partitioned table.
    pub fn is_partitioned(&self) -> bool {
        self.partitioned
    }

    /// Claims `message_id` for `consumer` inside the caller's transaction.
    ///
    /// `body` is the message's raw bytes: its SHA-256 is stored with the claim,
    /// so that a later message reusing the id with another body is reported as
    /// [`Claim::Mismatch`].
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
    /// [`Error::InvalidMessageId`] for an empty or
    /// oversized id, [`Error::Database`] when a statement
    /// fails.
    pub async fn claim(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        message_id: &str,
        body: &[u8],
    ) -> Result<Claim> {
        if self.partitioned {
            Ok(claim::partitioned_claim_batch(tx, &self.consumer, &[(message_id, body)]).await?[0])
        } else {
            claim::claim(tx, &self.consumer, message_id, body).await
        }
    }

    /// Claims many message ids for `consumer` in one statement (plus one to read
    /// the stored hashes of those already there), inside the caller's
    /// transaction: [`claim`](Inbox::claim) for a batch. Returns one [`Claim`] per entry of
    /// `messages` (`(message id, body)` pairs), in order.
    ///
    /// The ids are inserted in sorted order, so that two batches (or a batch and
    /// a single claim) that share ids take their row locks in the same order and
    /// cannot deadlock. An id that occurs twice in `messages` is `Fresh` for its
    /// first occurrence with the inserted body and `Duplicate` (same body) or
    /// `Mismatch` (other body) for the others, as if they had come one by one.
    ///
    /// # Errors
    /// As [`claim`](Inbox::claim).
    pub async fn claim_batch(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        messages: &[(&str, &[u8])],
    ) -> Result<Vec<Claim>> {
        if self.partitioned {
            claim::partitioned_claim_batch(tx, &self.consumer, messages).await
        } else {
            claim::claim_batch(tx, &self.consumer, messages).await
        }
    }

    /// Opens a transaction on `pool` with `message_id` claimed in it: `BEGIN`,
    /// then [`claim`](Inbox::claim), two round trips. A duplicate costs a third
    /// (the read of the stored body hash), raises no error and leaves no
    /// transaction open.
    ///
    /// Commit a [`Begun::Fresh`] transaction with [`commit`](Inbox::commit) (one more round
    /// trip), or drop it to roll back. How the statements travel, and why every
    /// guarantee of [`claim`](Inbox::claim) and [`commit`](Inbox::commit) holds, is in the [module
    /// docs](self#the-wire-shape).
    ///
    /// # Errors
    /// As [`claim`](Inbox::claim).
    pub async fn begin(&self, pool: &PgPool, message_id: &str, body: &[u8]) -> Result<Begun> {
        let mut claimed = self.begin_batch(pool, &[(message_id, body)]).await?;
        Ok(match (claimed.claims[0], claimed.tx.take()) {
            (Claim::Fresh, Some(tx)) => Begun::Fresh(tx),
            (Claim::Mismatch, _) => Begun::Mismatch,
            _ => Begun::Duplicate,
        })
    }

    /// [`begin`](Inbox::begin) for many messages (`(message id, body)` pairs): `BEGIN`,
    /// then [`claim_batch`](Inbox::claim_batch), every claim in one statement, in
    /// sorted id order (two batches sharing ids cannot deadlock). When some
    /// ids were processed already, their stored hashes are read: a batch with
    /// duplicates costs one round trip more.
    ///
    /// An id that occurs twice in `messages` is claimed by its first occurrence
    /// and the others are `Duplicate` (same body) or `Mismatch` (other body), as
    /// with [`claim_batch`](Inbox::claim_batch).
    ///
    /// # Errors
    /// As [`claim`](Inbox::claim).
    pub async fn begin_batch(
        &self,
        pool: &PgPool,
        messages: &[(&str, &[u8])],
    ) -> Result<ClaimedBatch> {
        self.begin_claims(messages, claim::begin(pool)).await
    }

    /// [`begin_batch`](Inbox::begin_batch) in the transaction `begin` opens
    /// (awaited only once every id is valid): the consumer runtime opens
    /// its units' its own way.
    pub(crate) async fn begin_claims(
        &self,
        messages: &[(&str, &[u8])],
        begin: impl Future<Output = Result<Transaction<'static, Postgres>>>,
    ) -> Result<ClaimedBatch> {
        // An invalid id costs no round trip.
        for (id, _) in messages {
            validate_message_id(id)?;
        }
        // BEGIN, then the claims as an `INSERT ... ON CONFLICT DO NOTHING`
        // that reports what it inserted: a duplicate raises nothing (no
        // ERROR line in PostgreSQL's log, no aborted transaction).
        let mut tx = begin.await?;
        let claims = match messages {
            [(id, body)] => vec![self.claim(&mut tx, id, body).await?],
            _ => self.claim_batch(&mut tx, messages).await?,
        };
        // Nothing fresh: dropped, its ROLLBACK goes with the pool's check
        // of the released connection.
        let fresh = claims.contains(&Claim::Fresh);
        Ok(ClaimedBatch {
            claims,
            tx: fresh.then_some(tx),
        })
    }

    /// Commits a transaction in which `message_id` was claimed, after checking
    /// that the claim is still in it: two round trips, the check (a prepared
    /// statement) and `COMMIT` (see the [module docs](self#the-wire-shape)).
    ///
    /// Why not just `tx.commit()`: PostgreSQL answers `COMMIT` of an *aborted*
    /// transaction (one in which a statement failed, even if the caller ignored
    /// the error) with `ROLLBACK`, and sqlx reports success. The message would
    /// then be acknowledged with its effects and its claim rolled back: lost.
    /// And if the caller ended the transaction itself (`ROLLBACK`), there is
    /// nothing left to commit. The check is a primary-key lookup on the same
    /// connection that fails in an aborted transaction and when the claim is
    /// gone, and `COMMIT` runs only when it passed.
    ///
    /// `tx` may be a savepoint (a transaction begun inside another): then the
    /// check runs, and the savepoint is released, not committed.
    ///
    /// # Errors
    /// - [`Error::ClaimLost`] when the claim is no longer in the transaction;
    /// - [`Error::Database`] for which [`Error::is_aborted_transaction`] holds
    ///   when a statement had failed in it;
    /// - other [`Error::Database`] errors when the `COMMIT` failed (a deferred
    ///   constraint, a serialization failure): nothing was committed;
    /// - an error for which [`Error::is_connection_error`] holds: **the outcome
    ///   is unknown** if it came from the `COMMIT`; a new claim of the id tells
    ///   (duplicate: it committed).
    pub async fn commit(&self, tx: Transaction<'_, Postgres>, message_id: &str) -> Result<()> {
        claim::commit(tx, &self.consumer, message_id).await
    }

    /// What a [`claim`](Inbox::claim) of `message_id` by `consumer` with `body` would find
    /// now, without claiming anything: [`Claim::Fresh`] when the id was not
    /// processed (or its claim was reaped), [`Claim::Duplicate`] when it was,
    /// with this body (or by a row without a hash), [`Claim::Mismatch`] when it
    /// was processed with another body. One primary-key lookup; the answer can
    /// change as soon as it is given (a consumer may claim the id meanwhile).
    ///
    /// Used before replaying a dead letter: a mismatch would be dead-lettered
    /// again.
    ///
    /// ```no_run
    /// use idempo::inbox::{Claim, Inbox};
    /// # async fn doc(pool: sqlx::PgPool, body: &[u8]) -> idempo::Result<()> {
    /// if Inbox::new("billing").lookup(&pool, "pay-1", body).await? == Claim::Mismatch {
    ///     println!("pay-1 was processed with another body");
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Database`] when the query fails.
    pub async fn lookup<'e>(
        &self,
        executor: impl sqlx::PgExecutor<'e>,
        message_id: &str,
        body: &[u8],
    ) -> Result<Claim> {
        claim::lookup(executor, &self.consumer, message_id, body).await
    }

    /// Deletes `consumer`'s claims older than `age`, `batch` rows per statement,
    /// and returns how many rows went. A partitioned `processed_messages` loses
    /// nothing here (`ONLY`: a ctid names no row across partitions); its claims
    /// go with their partitions ([`Inbox::maintain`]).
    ///
    /// Each statement is its own short transaction and skips rows that another
    /// reaper has locked, so replicas reaping at once neither wait for nor
    /// deadlock with each other. Delete only what can no longer be redelivered: a
    /// redelivery that arrives after its claim is gone is processed again.
    ///
    /// # Errors
    /// [`Error::Database`] when a statement fails.
    pub async fn delete_processed_before(
        &self,
        pool: &PgPool,
        age: Duration,
        batch: i64,
    ) -> Result<u64> {
        retention::delete_processed_before(pool, &self.consumer, age, batch).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_hash_is_sha256() {
        let h = payload_sha256(b"abc");
        assert_eq!(h[..4], [0xba, 0x78, 0x16, 0xbf]);
    }
}
