//! The small trait every dedup-window store implements, and the limits every
//! store enforces alike.

use std::future::Future;
use std::time::Duration;

use crate::{Error, Result};

/// The longest window or lease a store keeps an entry for: longer ones are
/// cut to it (ten years). Far beyond any real window, and far enough from
/// every store's own limit (the monotonic clock, Redis's expire times,
/// PostgreSQL's timestamps) that no duration can overflow one of them.
pub(crate) const MAX_WINDOW: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);

/// The longest store key, in bytes: the scope (queue, or exchange and routing
/// key; the group) and the id together. PostgreSQL cannot index a key much
/// longer (a B-tree entry must fit in a third of a page), and every store
/// refuses the same keys, so that switching stores cannot surface a new error.
pub(crate) const MAX_KEY_LEN: usize = 2048;

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

/// What [`WindowStore::insert`] (and
/// [`DedupWindow::insert_value`](super::DedupWindow::insert_value)) found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Insertion {
    /// The id was absent: it is now recorded as seen, with the value given.
    New,
    /// Someone holds a live reservation of the id: the work it guards has
    /// not finished (or failed) yet. Not new.
    Pending,
    /// The id was recorded within its window, with this value. Not new.
    Seen(String),
}

impl Insertion {
    /// Whether the id was new (and is now recorded).
    pub fn is_new(&self) -> bool {
        matches!(self, Insertion::New)
    }
}

/// `d`, cut to ten years.
pub(crate) fn bounded(d: Duration) -> Duration {
    d.min(MAX_WINDOW)
}

/// Refuses a key that some store could not hold: longer than
/// 2,048 bytes, or with a NUL byte (PostgreSQL text cannot hold one).
/// idempo's stores call it first; a [`WindowStore`] of your own should
/// refuse them too, so that switching stores surfaces no new error (the
/// conformance kit of `idempo::testing`, feature `testing`, checks it).
pub(crate) fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::Config(format!(
            "the dedup window key {}... is {} bytes long; at most {MAX_KEY_LEN} are allowed \
             (the queue or exchange and routing key, the group and the id together)",
            preview(key),
            key.len()
        )));
    }
    if let Some(position) = key.find('\0') {
        return Err(Error::Config(format!(
            "the dedup window key {} has a NUL byte at {position}: queue, exchange, routing key \
             and group names cannot contain NUL",
            preview(key)
        )));
    }
    Ok(())
}

/// Refuses a recorded value with a NUL byte (PostgreSQL text cannot hold
/// one), as [`check_key`] a key.
pub(crate) fn check_value(value: &str) -> Result<()> {
    match value.find('\0') {
        Some(position) => Err(Error::Config(format!(
            "the value {} to record in the dedup window has a NUL byte at {position}",
            preview(value)
        ))),
        None => Ok(()),
    }
}

/// The first 64 characters, quoted and escaped: enough to recognise a key
/// without pasting 10 kB into a log.
fn preview(text: &str) -> String {
    let head: String = text.chars().take(64).collect();
    format!("{head:?}")
}

/// Where seen ids live: "insert this id unless it was seen within the
/// window", atomically. Implemented by [`MemoryWindow`](super::MemoryWindow),
/// [`PostgresWindow`](super::PostgresWindow) and, with feature `redis`,
/// `RedisWindow`.
///
/// Keys come from [`Scope::key`](super::Scope::key). Each method is one atomic
/// step per key; an entry past its expiry counts as absent.
///
/// The stores idempo ships treat their inputs alike: a window or lease longer
/// than ten years is cut to it, and a key longer than 2,048 bytes or
/// with a NUL byte (or a value with a NUL byte) is refused with
/// [`Error::Config`] before the store is asked.
pub trait WindowStore: Send + Sync + 'static {
    /// Records `key` as seen for `window`, with `value`, unless it is present
    /// (seen or reserved); says what it found.
    fn insert(
        &self,
        key: &str,
        value: &str,
        window: Duration,
    ) -> impl Future<Output = Result<Insertion>> + Send;

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

    /// Deletes expired entries every `every` (at least 1 ms), in batches of
    /// 1,000, forever. Errors are logged and retried at the next tick.
    ///
    /// Only the PostgreSQL window needs it: its expired rows stay until deleted
    /// (an insert of the same key takes its row over, other keys pile up), while
    /// Redis expires keys by itself and the memory window evicts expired entries
    /// when it fills. Spawn it once per database (replicas sharing one can each
    /// run it: they skip the rows another is deleting), and abort it at shutdown:
    ///
    /// ```no_run
    /// # async fn doc(pool: sqlx::PgPool) {
    /// use std::time::Duration;
    /// use idempo::window::{DedupWindow, PostgresWindow, WindowStore};
    ///
    /// let window = DedupWindow::new(PostgresWindow::new(pool));
    /// let cleanup = tokio::spawn(window.store().clone().run_cleanup(Duration::from_secs(60)));
    /// // ... use the window ...
    /// cleanup.abort();
    /// # }
    /// ```
    ///
    /// (It is a future rather than a spawned task with a handle because the
    /// `window` feature does not pull in tokio's runtime.)
    fn run_cleanup(self, every: Duration) -> impl Future<Output = ()> + Send
    where
        Self: Sized,
    {
        async move {
            // A zero period would make tokio's interval panic.
            let every = every.max(Duration::from_millis(1));
            crate::cleanup::delete_expired_forever("dedup window entries", every, |n| {
                self.delete_expired(n)
            })
            .await
        }
    }
}

impl<T: WindowStore> WindowStore for std::sync::Arc<T> {
    fn insert(
        &self,
        key: &str,
        value: &str,
        window: Duration,
    ) -> impl Future<Output = Result<Insertion>> + Send {
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
