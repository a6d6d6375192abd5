//! [`StoreError`]: what the stores of the HTTP layer and of the dedup window
//! report (full, too slow, Redis failing). It reaches callers inside the
//! crate's [`Error::Other`]: find it with [`StoreError::of`].

use std::time::Duration;

use crate::Error;

/// An error of a store (the idempotency stores, the dedup window's stores).
///
/// ```
/// use idempo::StoreError;
/// let error: idempo::Error = StoreError::Timeout(std::time::Duration::from_secs(5)).into();
/// assert!(matches!(StoreError::of(&error), Some(StoreError::Timeout(_))));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A bounded in-memory dedup window is full of live ids: refusing is
    /// safer than forgetting one (its duplicate would pass).
    #[error("the dedup window is full ({capacity} live ids)")]
    WindowFull {
        /// The store's capacity.
        capacity: usize,
    },

    /// A bounded in-memory idempotency store is full of live records.
    #[error("the idempotency store is full ({capacity} live records)")]
    IdempotencyStoreFull {
        /// The store's capacity.
        capacity: usize,
    },

    /// A store call took longer than allowed.
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),

    /// A Redis command failed (connection lost, timeout, script error).
    #[cfg(feature = "redis")]
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),
}

impl StoreError {
    /// The store error `error` carries, if any.
    pub fn of(error: &Error) -> Option<&StoreError> {
        error.downcast_ref()
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Error::Other(Box::new(e))
    }
}
