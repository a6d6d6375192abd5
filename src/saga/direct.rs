//! The steps of a saga one at a time, without a runner: [`Saga::execute`],
//! [`Saga::compensate`] and the key of a step's external calls. A
//! [`Saga`] runs the same steps in order and compensates in reverse.

use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::PgPool;

use super::runner::Saga;
use super::step::{self, StepError};
use crate::Tx;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl Saga {
    /// Executes a step at most once with effect.
    ///
    /// - **completed** before: returns the stored result; `action` does not run.
    /// - **compensated**: [`StepError::Compensated`].
    /// - otherwise: runs `action` on a [`Tx`] and records `completed` with its
    ///   result **in the same transaction** as the action's writes. If the action
    ///   fails, its writes roll back and `failed` (with the error and the attempt
    ///   count) is recorded and committed, so it stays visible.
    ///
    /// The result is stored as JSON and must read back as the same value; one
    /// that does not (a NaN) fails the step with
    /// [`StepError::ResultNotStorable`] before anything commits. What `execute`
    /// returns is the value read back from the stored JSON as PostgreSQL
    /// returns it, so the first execution and every re-execution return the
    /// same value.
    ///
    /// Concurrent executions of one step take turns on its row: one runs the
    /// action; the others pause (without holding a connection), retry, and
    /// return its result. An execution needs one connection of the pool at a
    /// time.
    ///
    /// For a step of a saga that [`Saga::run`](Saga::run) compensates or
    /// completed, an action that did not already complete does not run:
    /// [`StepError::SagaCompensating`], [`StepError::SagaCompleted`].
    ///
    /// ```no_run
    /// # async fn doc(pool: sqlx::PgPool) -> Result<(), idempo::saga::StepError> {
    /// let reservation: i64 = idempo::saga::Saga::execute(&pool, "order-17", "reserve-stock", |tx| async move {
    ///     let mut conn = tx.try_lock()?;
    ///     let id: i64 = sqlx::query_scalar("INSERT INTO reservations (sku) VALUES ('x') RETURNING id")
    ///         .fetch_one(&mut *conn)
    ///         .await?;
    ///     Ok(id)
    /// })
    /// .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// See [`StepError`]; a saga id or step name outside the rules of
    /// [`NameError`](super::NameError) is refused before anything is sent to the database.
    pub async fn execute<T, F, Fut>(
        pool: &PgPool,
        saga_id: &str,
        step: &str,
        action: F,
    ) -> Result<T, StepError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(Tx) -> Fut,
        Fut: Future<Output = Result<T, BoxError>>,
    {
        step::execute(pool, saga_id, step, action).await
    }

    /// Compensates a step at most once with effect: runs `compensation` with the
    /// step's stored result and records `compensated` in the same transaction.
    ///
    /// A step that never completed (absent, failed) has nothing to undo:
    /// `compensation` does not run (the no-op), but the step is marked
    /// `compensated`, so that a late execution (a straggler of a crashed run)
    /// cannot run it after the saga was undone. An already compensated step is a
    /// no-op. Returns whether `compensation` ran.
    ///
    /// A step of a saga that [`Saga::run`](Saga::run) completed is
    /// refused ([`StepError::SagaCompleted`]): a completed saga is final.
    /// Compensating a step of a saga that is still running is allowed; its run
    /// then compensates the rest.
    ///
    /// Like [`execute`](Saga::execute), it needs one connection at a time and waits for a
    /// concurrent execution or compensation of the step without one.
    ///
    /// # Errors
    /// [`StepError::CompensationFailed`] when the compensation fails (its writes
    /// roll back and the error is stored on the step: run it again),
    /// [`StepError::Result`] when the stored result does not deserialize into
    /// `T`, [`StepError::SagaCompleted`], [`StepError::Database`]; a saga id or
    /// step name outside the rules of [`NameError`](super::NameError) is refused before anything
    /// is sent to the database.
    pub async fn compensate<T, F, Fut>(
        pool: &PgPool,
        saga_id: &str,
        step: &str,
        compensation: F,
    ) -> Result<bool, StepError>
    where
        T: DeserializeOwned,
        F: FnOnce(Tx, T) -> Fut,
        Fut: Future<Output = Result<(), BoxError>>,
    {
        step::compensate(pool, saga_id, step, compensation).await
    }

    /// The idempotency key for an external call made inside a step:
    /// `{saga_id}:{step}`. The same on every re-execution of the step, so the
    /// other side (an [`IdempotencyLayer`](crate#feature-flags) server, Stripe)
    /// runs the call once. Pass it to the retry client. Within the limits of
    /// [`NameError`](super::NameError) it is a valid `Idempotency-Key` (visible ASCII, at most 255
    /// characters) and names one saga and step only.
    pub fn idempotency_key(saga_id: &str, step: &str) -> String {
        step::idempotency_key(saga_id, step)
    }
}
