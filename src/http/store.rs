//! The small trait every idempotency store implements, and the cleanup loop.

use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::{PgConnection, PgPool};

use super::record::{Fingerprint, RecordKey, StoredResponse};
use crate::Result;

/// A token that proves ownership of an in-progress record.
///
/// Each start or takeover hands out a new token; [`complete`](IdempotencyStore::complete),
/// [`release`](IdempotencyStore::release) and [`extend`](IdempotencyStore::extend)
/// only act when the record still carries the caller's token. So a worker
/// whose lease expired and was taken over cannot overwrite the new owner's
/// record when it finally finishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken(i64);

impl FencingToken {
    /// Wraps a store's token.
    pub const fn new(token: i64) -> Self {
        FencingToken(token)
    }

    /// The raw value.
    pub const fn get(self) -> i64 {
        self.0
    }
}

/// What [`IdempotencyStore::begin`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Begin {
    /// The caller now owns the record (it was absent, expired, or its lease
    /// ran out): run the request, then complete or release.
    Started(FencingToken),
    /// Another request with this key is running and its lease is live.
    InProgress {
        /// How long the lease has left, when the store knows: the layer
        /// tells clients to wait that long once the holder stopped renewing.
        lease_left: Option<Duration>,
    },
    /// The operation finished: replay this.
    Completed(StoredResponse),
    /// The key names a different request (another fingerprint).
    Mismatch,
}

impl Begin {
    /// The key's outcome as the layer's span records it (`idempo.key.outcome`).
    pub(crate) fn outcome(&self) -> &'static str {
        match self {
            Begin::Started(_) => "new",
            Begin::Completed(_) => "replayed",
            Begin::InProgress { .. } => "in_progress",
            Begin::Mismatch => "conflict",
        }
    }
}

/// A request that wants to start the operation its key names.
#[derive(Debug, Clone, Copy)]
pub struct Operation<'a> {
    /// The record.
    pub key: &'a RecordKey,
    /// The request's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// How long the in-progress record is held before another request may
    /// take it over (renewed while the request runs).
    pub lease: Duration,
    /// How long a record lives (a completed one: from completion).
    pub ttl: Duration,
}

/// Where idempotency records live. Implemented by
/// [`PostgresStore`](super::PostgresStore), [`MemoryStore`](super::MemoryStore)
/// and, with feature `redis`, `RedisStore`.
///
/// A record is absent, **in progress** (with a lease and a [`FencingToken`]) or
/// **complete** (with a [`StoredResponse`]). Each method must be atomic with
/// respect to the others on the same record: that is what makes 64 concurrent
/// requests with one key produce one effect. A record past its TTL counts as
/// absent.
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Creates the record in progress, or takes over one whose lease (or TTL)
    /// ran out and whose fingerprint matches; otherwise reports what is
    /// there. A live record with another fingerprint is a [`Begin::Mismatch`].
    fn begin(&self, operation: Operation<'_>) -> impl Future<Output = Result<Begin>> + Send;

    /// Renews the lease of an in-progress record. `Ok(false)` if the record
    /// is no longer the caller's.
    fn extend(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Stores the response and marks the record complete, for `ttl` from
    /// now. `Ok(false)` (nothing written) if the record is no longer the
    /// caller's.
    fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Deletes the caller's in-progress record so that a retry runs the
    /// request again. `Ok(false)` if it was no longer the caller's.
    fn release(
        &self,
        key: &RecordKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Deletes up to `limit` expired records; returns how many. Stores whose
    /// records expire by themselves (Redis) return 0.
    fn delete_expired(&self, limit: usize) -> impl Future<Output = Result<u64>> + Send;

    /// Deletes expired records every `every`, in batches of 1,000, forever.
    /// Spawn it once per store:
    ///
    /// ```no_run
    /// # async fn doc(pool: sqlx::PgPool) {
    /// use std::sync::Arc;
    /// use idempo::http::{IdempotencyStore, PostgresStore};
    ///
    /// let store = Arc::new(PostgresStore::new(pool));
    /// tokio::spawn(store.clone().run_cleanup(std::time::Duration::from_secs(60)));
    /// # }
    /// ```
    ///
    /// Errors are logged and the loop goes on: a store that is down is retried
    /// at the next tick.
    fn run_cleanup(self, every: Duration) -> impl Future<Output = ()> + Send
    where
        Self: Sized,
    {
        async move {
            crate::cleanup::delete_expired_forever("idempotency records", every, |n| {
                self.delete_expired(n)
            })
            .await
        }
    }

    /// The store's [`AtomicStore`] capability, if it has one: then a handler
    /// can take the request's [`Tx`](crate::Tx), and its writes commit in the
    /// same transaction that completes the record.
    fn atomic(&self) -> Option<&dyn AtomicStore> {
        None
    }
}

/// The capability behind the *atomic phase*: a store whose records live in
/// the same PostgreSQL database as the handler's writes can complete a
/// record inside the handler's transaction. Implemented by
/// [`PostgresStore`](super::PostgresStore); a store offers it through
/// [`IdempotencyStore::atomic`].
pub trait AtomicStore: Send + Sync {
    /// The pool the handler's transaction is begun on.
    fn pool(&self) -> &PgPool;

    /// [`IdempotencyStore::complete`], as a statement in the caller's
    /// transaction `tx`: `Ok(false)` (nothing written) if the record is no
    /// longer the caller's, and the caller then rolls its writes back.
    fn complete_in<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        key: &'a RecordKey,
        token: FencingToken,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool>>;
}

impl<T: IdempotencyStore> IdempotencyStore for std::sync::Arc<T> {
    fn begin(&self, operation: Operation<'_>) -> impl Future<Output = Result<Begin>> + Send {
        (**self).begin(operation)
    }

    fn extend(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).extend(key, token, lease)
    }

    fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).complete(key, token, response, ttl)
    }

    fn release(
        &self,
        key: &RecordKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).release(key, token)
    }

    fn delete_expired(&self, limit: usize) -> impl Future<Output = Result<u64>> + Send {
        (**self).delete_expired(limit)
    }

    fn atomic(&self) -> Option<&dyn AtomicStore> {
        (**self).atomic()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn atomic_store_is_object_safe() {
        fn _obj_safe(_: &dyn super::AtomicStore) {}
    }
}
