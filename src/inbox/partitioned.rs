//! The partitioned inbox: `processed_messages` partitioned by `processed_at`,
//! retired by `DETACH PARTITION CONCURRENTLY` and `DROP TABLE`, so that
//! retention costs the same at any claim rate (no `DELETE`, no VACUUM debt).
//!
//! Opt-in: the plain table stays the default. A database switches once
//! ([`switch_to_partitioned`], `idempo partitions switch`); from then on
//! every consumer of that database claims with this module ([`begin_claim`],
//! [`begin_claim_batch`], [`claim`], [`claim_batch`]) and commits with
//! [`inbox::commit`](super::commit) as before, and one of them at a time
//! runs [`maintain`] (the AMQP consumer does, with
//! `ConsumerBuilder::partitioned`).
//!
//! # How a claim stays exactly-once across partitions
//! A partition's primary key covers only that partition, and a redelivery may
//! come after the partition of its first claim was closed. So the lock is a
//! transaction-scoped advisory lock on `(consumer, message id)`, and the
//! claim probes *every* partition before it inserts into the current one, in
//! one statement (the function `idempo_claim_partitioned` of migration 0009):
//!
//! 1. lock the ids, in sorted order (two claims sharing ids cannot deadlock);
//! 2. a new statement, so a new READ COMMITTED snapshot taken *after* the
//!    locks were granted: read the claims of those ids in all partitions;
//! 3. insert the ids not found (`processed_at = now()` routes each to the
//!    current partition).
//!
//! Two copies racing, on either side of a partition boundary: the second
//! waits for the first's lock, which PostgreSQL releases only after the
//! first transaction's commit is visible, so its probe sees the first claim
//! (`Duplicate`), or, if the first rolled back, finds nothing (`Fresh`).
//!
//! **The guarantee, for every kind of id** (UUIDs of any version, broker
//! ids, business keys): a copy is `Duplicate` (or `Mismatch`) when a claim of
//! the same `(consumer, id)` committed before its claim and that claim's
//! partition is still attached, that is for at least the retention (a
//! partition goes when its *upper* bound is older than the longest retention
//! any consumer registered, so a claim lives between the retention and the
//! retention plus one period). Copies in flight at the same time serialize:
//! exactly one is `Fresh`. This holds only at READ COMMITTED: at
//! REPEATABLE READ or SERIALIZABLE the probe would read the transaction's
//! older snapshot and could miss a copy committed meanwhile, so the claim is
//! **refused** ([`PartitionError::NotReadCommitted`]) instead. The
//! `begin_*` functions set READ COMMITTED themselves.
//!
//! Why not partition by a time carried in the id (UUID v7), which would
//! keep the primary key as the lock: only some ids carry a time, the time is
//! the producer's clock, and an id whose time falls in a retired partition
//! (or beyond the partitions created) would have nowhere to go. One rule for
//! every id is simpler to state and to hold.
//!
//! # The price
//! A fresh claim is still one round trip with `BEGIN`, but the probe reads
//! one index per attached partition, so keep the partitions few: the
//! default period is an eighth of the retention, with two periods created
//! ahead. [`inbox::commit`](super::commit)'s claim check reads them too.
//!
//! # Example: any worker loop
//! ```no_run
//! use idempo::inbox::{self, Begun, partitioned};
//!
//! # async fn doc(pool: sqlx::PgPool, id: &str, body: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! match partitioned::begin_claim(&pool, "billing", id, body).await? {
//!     Begun::Fresh(mut tx) => {
//!         sqlx::query("UPDATE accounts SET balance = balance + 10 WHERE id = 1")
//!             .execute(&mut *tx)
//!             .await?;
//!         inbox::commit(tx, "billing", id).await?;
//!     }
//!     Begun::Duplicate => {}
//!     Begun::Mismatch => {}
//! }
//! // Elsewhere, periodically (one instance at a time does the work):
//! let retention = std::time::Duration::from_secs(7 * 24 * 3600);
//! partitioned::maintain(&pool, "billing", Some(retention), &partitioned::Partitioning::new()).await?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};

use super::{
    Begun, Claim, ClaimedBatch, Isolation, Row, begin_claims_by, compare, payload_sha256,
    validate_message_id,
};
use crate::error::{Error, Result};
use crate::literal;

mod maintenance;

pub use maintenance::{
    Maintained, Partition, Switched, is_partitioned, maintain, partitions, switch_to_partitioned,
};

/// Why the partitioned mode refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PartitionError {
    /// The claim ran in a transaction that is not READ COMMITTED: its probe
    /// could miss a copy committed after the transaction's snapshot.
    #[error(
        "the partitioned claim needs a READ COMMITTED transaction (the probe of older partitions \
         must see copies committed meanwhile); this one is {level}"
    )]
    NotReadCommitted {
        /// The transaction's level.
        level: String,
    },
    /// `processed_messages` is still the plain table.
    #[error(
        "processed_messages is not partitioned: switch it first (`idempo partitions switch` or \
         idempo::inbox::partitioned::switch_to_partitioned)"
    )]
    NotPartitioned,
    /// `processed_messages` does not exist: migrate first.
    #[error("processed_messages does not exist: run idempo's migrations first")]
    MissingTable,
}

impl From<PartitionError> for Error {
    fn from(e: PartitionError) -> Self {
        Error::Other(Box::new(e))
    }
}

/// How `processed_messages` is cut into partitions: their length (the
/// *period*) and how many are created ahead of the current one.
///
/// # Default
/// A period of an eighth of the retention (at least one second; one hour
/// without retention), two periods ahead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Partitioning {
    period: Option<Duration>,
    ahead: Option<u32>,
}

impl Partitioning {
    /// The default partitioning.
    pub fn new() -> Self {
        Self::default()
    }

    /// Each partition covers `period` of claims (rounded up to whole
    /// seconds). Shorter periods retire claims closer to the retention but
    /// make every claim probe more partitions.
    pub fn period(mut self, period: Duration) -> Self {
        self.period = Some(period);
        self
    }

    /// How many periods beyond the current one are created in advance, so
    /// that claims find their partition while maintenance lags (at least 1).
    pub fn ahead(mut self, periods: u32) -> Self {
        self.ahead = Some(periods.max(1));
        self
    }

    /// The period in whole seconds, for a consumer kept `retention`.
    pub(crate) fn period_secs(&self, retention: Option<Duration>) -> i64 {
        let period = self.period.unwrap_or(match retention {
            Some(r) => r / 8,
            None => Duration::from_secs(3600),
        });
        (period.as_secs() + u64::from(period.subsec_nanos() > 0)).clamp(1, i64::MAX as u64) as i64
    }

    pub(crate) fn ahead_periods(&self) -> i64 {
        i64::from(self.ahead.unwrap_or(2))
    }
}

/// [`inbox::begin_claim`](super::begin_claim) on a partitioned
/// `processed_messages`: `BEGIN` and the claim in one round trip; a
/// duplicate costs a second (the read of the stored hash) and leaves no
/// transaction open. Commit with [`inbox::commit`](super::commit).
///
/// # Errors
/// As [`begin_claim_batch`].
pub async fn begin_claim(
    pool: &PgPool,
    consumer: &str,
    message_id: &str,
    body: &[u8],
) -> Result<Begun> {
    let mut claimed = begin_claim_batch(pool, consumer, &[(message_id, body)]).await?;
    Ok(match (claimed.claims[0], claimed.tx.take()) {
        (Claim::Fresh, Some(tx)) => Begun::Fresh(tx),
        (Claim::Mismatch, _) => Begun::Mismatch,
        _ => Begun::Duplicate,
    })
}

/// [`inbox::begin_claim_batch`](super::begin_claim_batch) on a partitioned
/// `processed_messages`: one round trip opens a READ COMMITTED transaction
/// with every claim in it; when some ids were claimed already, their hashes
/// are read and the rest claimed again.
///
/// # Errors
/// [`Error::InvalidMessageId`]; [`Error::Database`] when a statement fails
/// (also when no partition covers the current time: [`maintain`] has not
/// run for longer than the partitions created ahead).
pub async fn begin_claim_batch(
    pool: &PgPool,
    consumer: &str,
    messages: &[(&str, &[u8])],
) -> Result<ClaimedBatch> {
    begin_claims(pool, consumer, messages, Isolation::Set).await
}

/// [`begin_claim_batch`], with the isolation level set or known.
pub(crate) async fn begin_claims(
    pool: &PgPool,
    consumer: &str,
    messages: &[(&str, &[u8])],
    isolation: Isolation,
) -> Result<ClaimedBatch> {
    let sql = |consumer: &str, rows: &[&Row<'_>]| -> Result<String> {
        let mut ids = Vec::with_capacity(rows.len());
        let mut hashes = Vec::with_capacity(rows.len());
        for (id, hash) in rows {
            ids.push(literal::text("message id", id)?);
            hashes.push(literal::bytes(hash));
        }
        let set = match isolation {
            Isolation::Set => "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; ",
            Isolation::Default => "",
        };
        // IDP02 (some id claimed already) ends the implicit transaction
        // before its BEGIN, as a unique violation does in the plain mode.
        Ok(format!(
            "{set}SELECT count(*) FROM idempo_claim_partitioned({consumer}, \
             ARRAY[{}]::text[], ARRAY[{}]::bytea[], true); BEGIN",
            ids.join(", "),
            hashes.join(", ")
        ))
    };
    begin_claims_by(pool, consumer, messages, sql, "IDP02")
        .await
        .map_err(refusal)
}

/// [`inbox::claim`](super::claim) on a partitioned `processed_messages`,
/// inside the caller's transaction, which must be READ COMMITTED (see the
/// [module docs](self)). One round trip, fresh or not.
///
/// # Errors
/// [`PartitionError::NotReadCommitted`] (in [`Error::Other`]) at another
/// isolation level; otherwise as [`begin_claim_batch`].
pub async fn claim(
    tx: &mut Transaction<'_, Postgres>,
    consumer: &str,
    message_id: &str,
    body: &[u8],
) -> Result<Claim> {
    Ok(claim_batch(tx, consumer, &[(message_id, body)]).await?[0])
}

/// [`inbox::claim_batch`](super::claim_batch) on a partitioned
/// `processed_messages`: one [`Claim`] per message, in order; an id that
/// occurs twice is claimed by its first occurrence. One round trip.
///
/// # Errors
/// As [`claim`].
pub async fn claim_batch(
    tx: &mut Transaction<'_, Postgres>,
    consumer: &str,
    messages: &[(&str, &[u8])],
) -> Result<Vec<Claim>> {
    let mut firsts: HashMap<&str, usize> = HashMap::with_capacity(messages.len());
    let mut ids = Vec::with_capacity(messages.len());
    let mut hashes = Vec::with_capacity(messages.len());
    for (i, (id, body)) in messages.iter().enumerate() {
        validate_message_id(id)?;
        if !firsts.contains_key(id) {
            firsts.insert(id, i);
            ids.push(*id);
            hashes.push(payload_sha256(body).to_vec());
        }
    }
    let stored: HashMap<String, Option<Vec<u8>>> = sqlx::query_as::<_, (String, Option<Vec<u8>>)>(
        "SELECT claimed_id, stored_sha256 FROM idempo_claim_partitioned($1, $2, $3, false)",
    )
    .bind(consumer)
    .bind(&ids)
    .bind(&hashes)
    .fetch_all(&mut **tx)
    .await
    .map_err(|e| refusal(e.into()))?
    .into_iter()
    .collect();
    messages
        .iter()
        .enumerate()
        .map(|(i, (id, body))| {
            let hash = payload_sha256(body);
            let first = firsts[id];
            Ok(match compare(stored.get(*id), &hash) {
                Some(claim) => claim,
                None if first == i => Claim::Fresh,
                None if payload_sha256(messages[first].1) == hash => Claim::Duplicate,
                None => Claim::Mismatch,
            })
        })
        .collect()
}

/// IDP01 from the claim function as the typed refusal.
fn refusal(e: Error) -> Error {
    match &e {
        Error::Database(db) if crate::sqlstate::is(db, crate::sqlstate::ISOLATION_REFUSED) => {
            let level = db
                .as_database_error()
                .and_then(|d| d.message().rsplit_once(", not ").map(|(_, l)| l.to_owned()))
                .unwrap_or_default();
            PartitionError::NotReadCommitted { level }.into()
        }
        _ => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_period_is_an_eighth_of_the_retention_in_whole_seconds() {
        let p = Partitioning::new();
        assert_eq!(p.period_secs(Some(Duration::from_secs(800))), 100);
        assert_eq!(p.period_secs(Some(Duration::from_millis(1500))), 1);
        assert_eq!(p.period_secs(None), 3600);
        assert_eq!(p.period(Duration::from_millis(2500)).period_secs(None), 3);
        assert_eq!(p.ahead_periods(), 2);
        assert_eq!(p.ahead(0).ahead_periods(), 1);
    }
}
