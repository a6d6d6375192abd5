//! The atomic phase: [`Tx`] as an axum extractor, so that a handler's writes
//! commit in the same transaction that completes its idempotency record.

use std::fmt;
use std::sync::Arc;

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, Response};
use http::request::Parts;
use sqlx::PgPool;
use tokio::sync::Mutex;

use super::problem::Problem;
use crate::Tx;

/// Put in the request's extensions by the layer when it passes a request
/// through because it carries no `Idempotency-Key`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WithoutKey;

/// Put in the request's extensions by the layer when its store lives in
/// PostgreSQL: the pool to begin the handler's transaction on, and the slot
/// the layer takes it back from.
#[derive(Clone)]
pub(crate) struct AtomicPhase {
    pool: PgPool,
    /// Bounds the wait for a connection (the layer's store timeout).
    timeout: std::time::Duration,
    tx: Arc<Mutex<Option<Tx>>>,
}

impl AtomicPhase {
    pub(crate) fn new(pool: PgPool, timeout: std::time::Duration) -> Self {
        AtomicPhase {
            pool,
            timeout,
            tx: Arc::new(Mutex::new(None)),
        }
    }

    /// The request's transaction, begun on first use; every extractor of one
    /// request shares it.
    async fn transaction(&self) -> Result<Tx, sqlx::Error> {
        let mut slot = self.tx.lock().await;
        if let Some(tx) = &*slot {
            return Ok(tx.clone());
        }
        let begin = tokio::time::timeout(self.timeout, self.pool.begin());
        let tx = Tx::new(begin.await.map_err(|_| sqlx::Error::PoolTimedOut)??, None);
        *slot = Some(tx.clone());
        Ok(tx)
    }

    /// Takes the transaction back once the handler returned (`None` if it
    /// never asked for one).
    pub(crate) async fn take(&self) -> Option<Tx> {
        self.tx.lock().await.take()
    }
}

/// In a handler behind an [`IdempotencyLayer`](super::IdempotencyLayer) on a
/// [`PostgresStore`](super::PostgresStore), `Tx` is the transaction that will
/// also complete the request's idempotency record: the writes made through it
/// and the stored response commit together, after the handler returned. If
/// the response is not stored (a status such as 429, an error, a panic, a
/// response over the size limit) or the lease was lost, the writes roll back.
///
/// `?` works on idempo's and sqlx's errors: a handler can return
/// `Result<_, idempo::Error>`, whose error answers `application/problem+json`
/// (503 when the database is unreachable, 500 otherwise) and is never
/// stored, so the key is released and the client may retry.
///
/// ```no_run
/// use axum::{Json, http::StatusCode};
/// use idempo::Tx;
///
/// async fn create_payment(tx: Tx, Json(amount): Json<i64>) -> idempo::Result<StatusCode> {
///     let mut conn = tx.try_lock()?;
///     sqlx::query("INSERT INTO payments (amount_cents) VALUES ($1)")
///         .bind(amount)
///         .execute(&mut *conn)
///         .await?;
///     Ok(StatusCode::CREATED) // committed by the layer, with the stored 201
/// }
/// ```
///
/// A request without an `Idempotency-Key` on a route where the key is
/// optional gets 400 (`#missing-key`) from this extractor: the handler needs
/// the key's transaction. Take `Option<Tx>` to serve such requests too.
impl<S: Send + Sync> FromRequestParts<S> for Tx {
    type Rejection = TxRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        match parts.extensions.get::<AtomicPhase>() {
            Some(phase) => phase.transaction().await.map_err(TxRejection::Begin),
            None if parts.extensions.get::<WithoutKey>().is_some() => Err(TxRejection::MissingKey),
            None => Err(TxRejection::NotIdempotent),
        }
    }
}

/// `Option<Tx>`: `None` where the layer has no transaction to give (another
/// store, or no `Idempotency-Key` on the request), so one handler serves both
/// cases: write through the `Tx` when there is one, through the pool
/// otherwise.
impl<S: Send + Sync> OptionalFromRequestParts<S> for Tx {
    type Rejection = TxRejection;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        match parts.extensions.get::<AtomicPhase>() {
            None => Ok(None),
            Some(phase) => phase
                .transaction()
                .await
                .map(Some)
                .map_err(TxRejection::Begin),
        }
    }
}

/// Why the [`Tx`] extractor failed.
#[non_exhaustive]
pub enum TxRejection {
    /// The request carried no `Idempotency-Key` (400: the client must send one).
    MissingKey,
    /// The route has no idempotency layer on a store with the atomic phase
    /// (500: a server configuration error).
    NotIdempotent,
    /// The transaction could not be begun (503).
    Begin(sqlx::Error),
}

impl fmt::Debug for TxRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TxRejection::MissingKey => f.write_str("MissingKey"),
            TxRejection::NotIdempotent => f.write_str("NotIdempotent"),
            TxRejection::Begin(e) => f.debug_tuple("Begin").field(e).finish(),
        }
    }
}

impl IntoResponse for TxRejection {
    fn into_response(self) -> Response {
        match self {
            TxRejection::MissingKey => Problem::MissingKey.into_response(),
            TxRejection::NotIdempotent => Problem::NoTransaction.into_response(),
            TxRejection::Begin(error) => {
                tracing::warn!(%error, "could not begin the handler's transaction");
                Problem::StoreUnavailable.into_response()
            }
        }
    }
}
