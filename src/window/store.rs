//! The small trait every dedup-window store implements.

use std::future::Future;
use std::time::Duration;

use crate::Result;

/// What [`WindowStore::reserve`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reservation {
    /// The caller holds the id for the lease: do the work, then
    /// [`record`](WindowStore::record) it (or [`release`](WindowStore::release)).
    Reserved {
        /// Proves the reservation is the caller's.
        token: i64,
    },
    /// Someone else holds a live reservation of the id.
    Pending,
    /// The id was recorded within its window; the value recorded with it
    /// (for a publisher: the first message's id).
    Seen(String),
}

/// Where seen ids live: "insert this id unless it was seen within the
/// window", atomically. Implemented by [`MemoryWindow`](super::MemoryWindow),
/// [`PostgresWindow`](super::PostgresWindow) and, with feature `redis`,
/// `RedisWindow`.
///
/// Keys come from [`Scope::key`](super::Scope::key). Each method is one atomic
/// step per key; an entry past its expiry counts as absent.
pub trait WindowStore: Send + Sync + 'static {
    /// Records `key` as seen for `window` unless it is present. `true` when
    /// it was new.
    fn insert(
        &self,
        key: &str,
        value: &str,
        window: Duration,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Reserves `key` for `lease` unless it is present (seen or reserved):
    /// the first half of "record only after the work succeeded".
    fn reserve(
        &self,
        key: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<Reservation>> + Send;

    /// Turns the caller's reservation into a seen entry for `window`, with
    /// `value`. `false` if the reservation was lost (its lease ran out).
    fn record(
        &self,
        key: &str,
        token: i64,
        value: &str,
        window: Duration,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Drops the caller's reservation, so the id can be tried again.
    fn release(&self, key: &str, token: i64) -> impl Future<Output = Result<bool>> + Send;

    /// Deletes up to `limit` expired entries; 0 where entries expire by
    /// themselves (Redis).
    fn delete_expired(&self, limit: usize) -> impl Future<Output = Result<u64>> + Send;
}

/// Deletes expired entries every `every`, in batches of 1,000, forever (the
/// PostgreSQL window keeps expired rows until then). Spawn it once per store:
/// `tokio::spawn(run_cleanup(PostgresWindow::new(pool), Duration::from_secs(60)))`.
/// Errors are logged and retried at the next tick.
pub async fn run_cleanup<S: WindowStore>(store: S, every: Duration) {
    crate::cleanup::delete_expired_forever("dedup window entries", every, |n| {
        store.delete_expired(n)
    })
    .await
}

impl<T: WindowStore> WindowStore for std::sync::Arc<T> {
    fn insert(
        &self,
        key: &str,
        value: &str,
        window: Duration,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).insert(key, value, window)
    }

    fn reserve(
        &self,
        key: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<Reservation>> + Send {
        (**self).reserve(key, lease)
    }

    fn record(
        &self,
        key: &str,
        token: i64,
        value: &str,
        window: Duration,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).record(key, token, value, window)
    }

    fn release(&self, key: &str, token: i64) -> impl Future<Output = Result<bool>> + Send {
        (**self).release(key, token)
    }

    fn delete_expired(&self, limit: usize) -> impl Future<Output = Result<u64>> + Send {
        (**self).delete_expired(limit)
    }
}
