//! The partitioned inbox: `processed_messages` partitioned by `processed_at`,
//! retired by `DETACH PARTITION CONCURRENTLY` and `DROP TABLE`, so that
//! retention costs the same at any claim rate (no `DELETE`, no VACUUM debt).
//!
//! Opt-in: the plain table stays the default. A database switches once
//! ([`Partitioning::switch`], `idempo partitions switch`); from then on
//! every consumer of that database claims through an
//! [`Inbox`](super::Inbox) made [`partitioned`](super::Inbox::partitioned)
//! (its `begin`, `begin_batch`, `claim`, `claim_batch`) and commits with
//! [`Inbox::commit`](super::Inbox::commit) as before, and one of them at a time
//! runs [`Inbox::maintain`](super::Inbox::maintain) (the AMQP consumer does, with
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
//! A fresh claim is still one statement, but the probe reads
//! one index per attached partition, so keep the partitions few: the
//! default period is an eighth of the retention, with two periods created
//! ahead. [`Inbox::commit`](super::Inbox::commit)'s claim check reads them too.
//!
//! # Switching
//! [`Partitioning::switch`] turns the plain table into the partitioned one,
//! keeping every claim: the plain table becomes the oldest partition.
//! The steps, each its own transaction:
//! 1. `ACCESS EXCLUSIVE` on the plain table for a moment (waiting for the
//!    claims in flight): the switch time T, a `NOT VALID` check
//!    `processed_at < T`, and a column `claimed_under_lock` (`NOT NULL`,
//!    no default once added) that only the partitioned claim fills in.
//!    From here on a plain-mode claim fails (and its delivery is retried):
//!    claims must not go where the partitioned probe does not look;
//! 2. `VALIDATE` the check: one scan of the table, under `SHARE UPDATE
//!    EXCLUSIVE` only;
//! 3. `ACCESS EXCLUSIVE` for a moment: the plain table renamed
//!    `processed_messages_before_<T>`, the partitioned `processed_messages`
//!    created, the old table attached as its partition `[MINVALUE, T)`
//!    (no scan: the check proves it), and the partitions from T on created.
//!
//! # Example: any worker loop
//! ```no_run
//! use idempo::inbox::{Begun, Inbox, partitioned::Partitioning};
//!
//! # async fn doc(pool: sqlx::PgPool, id: &str, body: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = Inbox::new("billing").partitioned(true);
//! match inbox.begin(&pool, id, body).await? {
//!     Begun::Fresh(mut tx) => {
//!         sqlx::query("UPDATE accounts SET balance = balance + 10 WHERE id = 1")
//!             .execute(&mut *tx)
//!             .await?;
//!         inbox.commit(tx, id).await?;
//!     }
//!     Begun::Duplicate => {}
//!     Begun::Mismatch => {}
//! }
//! // Elsewhere, periodically (one instance at a time does the work):
//! let retention = std::time::Duration::from_secs(7 * 24 * 3600);
//! inbox.maintain(&pool, Some(retention), &Partitioning::new()).await?;
//! # Ok(()) }
//! ```

use std::time::Duration;

use crate::error::Error;

mod maintenance;

pub use maintenance::{Maintained, Partition, Switched};

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
         idempo::inbox::partitioned::Partitioning::switch)"
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
