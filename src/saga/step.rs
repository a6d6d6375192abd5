//! One saga step: [`execute`] and [`compensate`], each safe to run again.

use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::Tx;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a step did not produce a result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// The action failed: its writes rolled back, and the step is recorded
    /// as `failed` with this error and its attempt count. Executing it again
    /// is allowed.
    #[error("step {step:?} failed (attempt {attempts}): {source}")]
    Failed {
        /// The step.
        step: String,
        /// Attempts so far, this one included.
        attempts: i32,
        /// The action's error.
        #[source]
        source: BoxError,
    },
    /// The step was compensated: it cannot run again.
    #[error("step {step:?} was compensated and cannot run again")]
    Compensated {
        /// The step.
        step: String,
    },
    /// The compensation failed: its writes rolled back, its error is stored
    /// on the step (which stays `completed`). Run it again.
    #[error("compensating step {step:?} failed: {source}")]
    CompensationFailed {
        /// The step.
        step: String,
        /// The compensation's error.
        #[source]
        source: BoxError,
    },
    /// The stored result does not deserialize into the requested type.
    #[error("the stored result of step {step:?} does not match its type: {source}")]
    Result {
        /// The step.
        step: String,
        /// serde's error.
        #[source]
        source: serde_json::Error,
    },
    /// The handle of the step's transaction outlived the action (kept by a
    /// task it spawned): nothing was committed.
    #[error("step {step:?}: the action kept its transaction past its end; rolled back")]
    TransactionKept {
        /// The step.
        step: String,
    },
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Locks the step's row for this transaction, creating it as `pending` if it
/// is new; returns its state and stored result. A concurrent execution of the
/// same step waits here until this transaction ends, then sees its outcome.
async fn lock_step(
    tx: &mut Transaction<'static, Postgres>,
    saga_id: &str,
    step: &str,
) -> sqlx::Result<(String, Option<serde_json::Value>)> {
    sqlx::query(
        "INSERT INTO saga_steps (saga_id, step, state) VALUES ($1, $2, 'pending')
         ON CONFLICT (saga_id, step) DO NOTHING",
    )
    .bind(saga_id)
    .bind(step)
    .execute(&mut **tx)
    .await?;
    let row = sqlx::query(
        "SELECT state, result FROM saga_steps WHERE saga_id = $1 AND step = $2 FOR UPDATE",
    )
    .bind(saga_id)
    .bind(step)
    .fetch_one(&mut **tx)
    .await?;
    Ok((row.get("state"), row.get("result")))
}

/// Executes a step at most once with effect.
///
/// - **completed** before: returns the stored result; `action` does not run.
/// - **compensated**: [`StepError::Compensated`].
/// - otherwise: runs `action` on a [`Tx`] and records `completed` with its
///   result **in the same transaction** as the action's writes. If the action
///   fails, its writes roll back and `failed` (with the error and the attempt
///   count) is recorded in a transaction of its own, so it stays visible.
///
/// Concurrent executions of one step serialize on its row: one runs the
/// action, the others wait and return its result.
///
/// ```no_run
/// # async fn doc(pool: sqlx::PgPool) -> Result<(), idempo::saga::StepError> {
/// let reservation: i64 = idempo::saga::execute(&pool, "order-17", "reserve-stock", |tx| async move {
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
/// See [`StepError`].
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
    let mut tx = pool.begin().await?;
    let (state, stored) = lock_step(&mut tx, saga_id, step).await?;
    match state.as_str() {
        "completed" => {
            tx.rollback().await?;
            let stored = stored.unwrap_or(serde_json::Value::Null);
            return serde_json::from_value(stored).map_err(|source| StepError::Result {
                step: step.to_owned(),
                source,
            });
        }
        "compensated" => {
            tx.rollback().await?;
            return Err(StepError::Compensated {
                step: step.to_owned(),
            });
        }
        _ => {}
    }

    let handle = Tx::new(tx);
    let outcome = action(handle.clone()).await;
    let Some(mut tx) = handle.take() else {
        return Err(StepError::TransactionKept {
            step: step.to_owned(),
        });
    };
    match outcome {
        Ok(value) => {
            let result = serde_json::to_value(&value).map_err(|source| StepError::Result {
                step: step.to_owned(),
                source,
            })?;
            sqlx::query(
                "UPDATE saga_steps SET state = 'completed', result = $3, error = NULL,
                     attempts = attempts + 1, updated_at = now()
                 WHERE saga_id = $1 AND step = $2",
            )
            .bind(saga_id)
            .bind(step)
            .bind(result)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(value)
        }
        Err(source) => {
            tx.rollback().await?;
            let attempts: i32 = sqlx::query_scalar(
                "INSERT INTO saga_steps (saga_id, step, state, error, attempts)
                 VALUES ($1, $2, 'failed', $3, 1)
                 ON CONFLICT (saga_id, step) DO UPDATE SET
                     state = 'failed', error = EXCLUDED.error,
                     attempts = saga_steps.attempts + 1, updated_at = now()
                 WHERE saga_steps.state IN ('pending', 'failed')
                 RETURNING attempts",
            )
            .bind(saga_id)
            .bind(step)
            .bind(source.to_string())
            .fetch_optional(pool)
            .await?
            .unwrap_or(0);
            Err(StepError::Failed {
                step: step.to_owned(),
                attempts,
                source,
            })
        }
    }
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
/// # Errors
/// [`StepError::CompensationFailed`] when the compensation fails (its writes
/// roll back and the error is stored on the step: run it again),
/// [`StepError::Database`].
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
    let mut tx = pool.begin().await?;
    let (state, stored) = lock_step(&mut tx, saga_id, step).await?;
    let mark = "UPDATE saga_steps SET state = 'compensated', updated_at = now()
                WHERE saga_id = $1 AND step = $2";
    match state.as_str() {
        "compensated" => {
            tx.rollback().await?;
            return Ok(false);
        }
        "completed" => {}
        _ => {
            sqlx::query(mark)
                .bind(saga_id)
                .bind(step)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            return Ok(false);
        }
    }
    let result: T =
        serde_json::from_value(stored.unwrap_or(serde_json::Value::Null)).map_err(|source| {
            StepError::Result {
                step: step.to_owned(),
                source,
            }
        })?;
    let handle = Tx::new(tx);
    let outcome = compensation(handle.clone(), result).await;
    let Some(mut tx) = handle.take() else {
        return Err(StepError::TransactionKept {
            step: step.to_owned(),
        });
    };
    match outcome {
        Ok(()) => {
            sqlx::query(mark)
                .bind(saga_id)
                .bind(step)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(true)
        }
        Err(source) => {
            tx.rollback().await?;
            sqlx::query(
                "UPDATE saga_steps SET error = $3, updated_at = now()
                 WHERE saga_id = $1 AND step = $2 AND state = 'completed'",
            )
            .bind(saga_id)
            .bind(step)
            .bind(format!("compensation: {source}"))
            .execute(pool)
            .await?;
            Err(StepError::CompensationFailed {
                step: step.to_owned(),
                source,
            })
        }
    }
}

/// A step's recorded state and attempt count (`None` if it never ran).
pub(crate) async fn step_state(
    pool: &PgPool,
    saga_id: &str,
    step: &str,
) -> sqlx::Result<Option<(String, i32)>> {
    sqlx::query_as("SELECT state, attempts FROM saga_steps WHERE saga_id = $1 AND step = $2")
        .bind(saga_id)
        .bind(step)
        .fetch_optional(pool)
        .await
}

/// The idempotency key for an external call made inside a step:
/// `{saga_id}:{step}`. The same on every re-execution of the step, so the
/// other side (an [`IdempotencyLayer`](crate#feature-flags) server, Stripe)
/// runs the call once. Pass it to the retry client.
pub fn idempotency_key(saga_id: &str, step: &str) -> String {
    format!("{saga_id}:{step}")
}
