//! [`DedupWindow`]: "drop this id if it was seen in the last five minutes".

use std::sync::Arc;
use std::time::Duration;

use super::dedup_id::{DedupId, Scope};
use super::store::{Insertion, MAX_WINDOW, Reservation, WindowStore};
use crate::Result;

/// SQS FIFO's deduplication interval.
pub(crate) const DEFAULT_WINDOW: Duration = Duration::from_secs(5 * 60);

/// A deduplication window over a [`WindowStore`]: an id seen within the
/// window (default five minutes) is a duplicate; after it,
/// the same id is new again.
///
/// ```
/// # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
/// use idempo::window::{DedupId, DedupWindow, MemoryWindow, Scope};
///
/// let window = DedupWindow::new(MemoryWindow::new(100_000));
/// let scope = Scope::queue("orders");
/// let id = DedupId::new("order-17")?;
/// assert!(window.insert(&scope, &id).await?);   // new
/// assert!(!window.insert(&scope, &id).await?);  // seen within five minutes
/// # Ok(()) }
/// ```
///
/// A window is weaker than the [inbox](crate::inbox): it forgets ids after
/// the window, and recording an id is not transactional with whatever the
/// message caused. Use it where there is no database to put the effect in.
#[derive(Debug)]
pub struct DedupWindow<S> {
    store: Arc<S>,
    window: Duration,
}

impl<S> Clone for DedupWindow<S> {
    fn clone(&self) -> Self {
        DedupWindow {
            store: self.store.clone(),
            window: self.window,
        }
    }
}

impl<S: WindowStore> DedupWindow<S> {
    /// A five-minute window on `store`.
    pub fn new(store: S) -> Self {
        DedupWindow {
            store: Arc::new(store),
            window: DEFAULT_WINDOW,
        }
    }

    /// Sets the window's length: at least 1 ms, at most ten
    /// years; a longer one, up to `Duration::MAX`, is cut to it).
    #[must_use]
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window.clamp(Duration::from_millis(1), MAX_WINDOW);
        self
    }

    /// The window's length.
    pub fn length(&self) -> Duration {
        self.window
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Records `id` in `scope` unless it was seen within the window: `true`
    /// when it is new. One atomic step: of concurrent inserts of one id,
    /// exactly one gets `true`. The same as
    /// `insert_value(scope, id, "").await?.is_new()`; use
    /// [`insert_value`](Self::insert_value) to learn what a duplicate was
    /// recorded with.
    ///
    /// # Errors
    /// The store's error ([`Error::Database`](crate::Error::Database),
    /// a [`StoreError`](crate::StoreError) (Redis, the window full,
    /// a timeout), or
    /// [`Error::Config`](crate::Error::Config) for a key no store can hold
    /// (scope and id together: at most 2,048 bytes).
    pub async fn insert(&self, scope: &Scope, id: &DedupId) -> Result<bool> {
        Ok(self.insert_value(scope, id, "").await?.is_new())
    }

    /// Records `id` in `scope` with `value` unless it was seen within the
    /// window, and says what it found: [`Insertion::New`], or what a
    /// duplicate was recorded with ([`Insertion::Seen`], as
    /// [`reserve`](Self::reserve) returns it), or [`Insertion::Pending`]
    /// while a reservation of the id is live.
    ///
    /// ```
    /// # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
    /// use idempo::window::{DedupId, DedupWindow, Insertion, MemoryWindow, Scope};
    ///
    /// let window = DedupWindow::new(MemoryWindow::new(100_000));
    /// let (scope, id) = (Scope::queue("orders"), DedupId::new("order-17")?);
    /// assert_eq!(window.insert_value(&scope, &id, "msg-1").await?, Insertion::New);
    /// assert_eq!(
    ///     window.insert_value(&scope, &id, "msg-2").await?,
    ///     Insertion::Seen("msg-1".into()),
    /// );
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As for [`insert`](Self::insert); [`Error::Config`](crate::Error::Config)
    /// too for a value with a NUL byte.
    pub async fn insert_value(
        &self,
        scope: &Scope,
        id: &DedupId,
        value: &str,
    ) -> Result<Insertion> {
        self.store.insert(&scope.key(id), value, self.window).await
    }

    /// Reserves `id` for `lease` (cut to ten years) while work that must
    /// happen once is done; then [`record`](Self::record) it, or
    /// [`release`](Self::release) it if the work failed, so that a retry is
    /// not taken for a duplicate.
    ///
    /// # Errors
    /// The store's error.
    pub async fn reserve(
        &self,
        scope: &Scope,
        id: &DedupId,
        lease: Duration,
    ) -> Result<Reservation> {
        self.store.reserve(&scope.key(id), lease).await
    }

    /// Records a reserved id as seen for the window, with `value` (returned
    /// to later duplicates as [`Reservation::Seen`]). `false` if the
    /// reservation's lease ran out first.
    ///
    /// # Errors
    /// The store's error.
    pub async fn record(
        &self,
        scope: &Scope,
        id: &DedupId,
        token: i64,
        value: &str,
    ) -> Result<bool> {
        self.store
            .record(&scope.key(id), token, value, self.window)
            .await
    }

    /// Drops a reservation.
    ///
    /// # Errors
    /// The store's error.
    pub async fn release(&self, scope: &Scope, id: &DedupId, token: i64) -> Result<bool> {
        self.store.release(&scope.key(id), token).await
    }
}
