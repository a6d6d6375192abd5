//! One saga step: [`execute`] and [`compensate`], each safe to run again.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sqlx::{PgPool, Postgres, Row, Transaction};

pub(crate) use super::error::StepError;
use super::json::round_trip;
use super::name;
use crate::Tx;
use crate::backoff::Backoff;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Checks a saga id and a step name (see [`NameError`](super::NameError)).
pub(crate) fn check_names(saga_id: &str, step: &str) -> Result<(), StepError> {
    name::check_saga_id(saga_id).map_err(StepError::InvalidSagaId)?;
    check_step_name(step)
}

pub(crate) fn check_step_name(step: &str) -> Result<(), StepError> {
    name::check_step(step).map_err(|source| StepError::InvalidStepName {
        step: step.to_owned(),
        source,
    })
}

/// What a failed step records as its error when its result could not be
/// stored (also what a saga that gives up on it reports).
pub(crate) fn not_storable(source: &serde_json::Error) -> String {
    format!("the result cannot be stored: {source}")
}

/// The pauses of a run that found a row held by another execution: short at
/// first (steps are usually quick), never more than a second apart.
pub(crate) fn busy_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(5), Duration::from_secs(1))
}

/// Rows are locked `NOWAIT`: a row held by another transaction fails the
/// statement at once (`55P03`), and the caller rolls back and retries after
/// a pause instead of waiting inside PostgreSQL on a pooled connection,
/// which the execution it waits for may need.
pub(crate) fn is_busy(e: &sqlx::Error) -> bool {
    crate::sqlstate::is(e, LOCK_NOT_AVAILABLE)
}

/// `lock_not_available`: a `NOWAIT` lock held by another transaction.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// A step's row, locked for the transaction, with the state of its saga's
/// row (share-locked; `None` when the step is used without a
/// [`Saga`](super::Saga), or when it was not needed).
struct Locked {
    tx: Transaction<'static, Postgres>,
    state: String,
    result: Option<Value>,
    attempts: i32,
    error: Option<String>,
    saga: Option<String>,
}

/// Opens the step's transaction with its row locked (created `pending` if it
/// is new) and its saga's row share-locked, so that the saga cannot change
/// direction (start compensating, complete) while the step runs. A row held
/// by another execution makes it pause without a connection and try again;
/// it then sees that execution's outcome.
///
/// An execution that finds the step completed or compensated does not need
/// the saga's row (`for_compensation` false): overlapping runs passing over
/// done steps then leave it alone, so that the lock that changes its state
/// (`NOWAIT`, which does not queue) is not starved by theirs.
async fn lock_step(
    pool: &PgPool,
    saga_id: &str,
    step: &str,
    for_compensation: bool,
) -> Result<Locked, StepError> {
    // Committed on its own: a concurrent first execution must not wait on
    // an uncommitted insert (`ON CONFLICT` would block on it). `NOT EXISTS`
    // (a plain read) skips the conflict check for a row that exists, which
    // would wait for a transaction about to update it.
    sqlx::query(
        "INSERT INTO saga_steps (saga_id, step, state)
         SELECT $1, $2, 'pending'
         WHERE NOT EXISTS (SELECT 1 FROM saga_steps WHERE saga_id = $1 AND step = $2)
         ON CONFLICT (saga_id, step) DO NOTHING",
    )
    .bind(saga_id)
    .bind(step)
    .execute(pool)
    .await?;
    let mut backoff = busy_backoff();
    loop {
        let mut tx = pool.begin().await?;
        match lock_rows(&mut tx, saga_id, step, for_compensation).await {
            Ok((state, result, attempts, error, saga)) => {
                return Ok(Locked {
                    tx,
                    state,
                    result,
                    attempts,
                    error,
                    saga,
                });
            }
            Err(e) if is_busy(&e) => {
                tx.rollback().await?;
                tokio::time::sleep(backoff.next_delay()).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

type Rows = (String, Option<Value>, i32, Option<String>, Option<String>);

async fn lock_rows(
    tx: &mut Transaction<'static, Postgres>,
    saga_id: &str,
    step: &str,
    for_compensation: bool,
) -> sqlx::Result<Rows> {
    let row = sqlx::query(
        "SELECT state, result, attempts, error FROM saga_steps
         WHERE saga_id = $1 AND step = $2 FOR UPDATE NOWAIT",
    )
    .bind(saga_id)
    .bind(step)
    .fetch_one(&mut **tx)
    .await?;
    let state: String = row.get("state");
    let saga: Option<String> =
        if for_compensation || !matches!(state.as_str(), "completed" | "compensated") {
            sqlx::query_scalar("SELECT state FROM sagas WHERE saga_id = $1 FOR SHARE NOWAIT")
                .bind(saga_id)
                .fetch_optional(&mut **tx)
                .await?
        } else {
            None
        };
    Ok((
        state,
        row.get("result"),
        row.get("attempts"),
        row.get("error"),
        saga,
    ))
}

/// A saga's row (`state`, `failed_step`, `error`), locked for an update of
/// its state in the returned transaction; pauses and retries while steps
/// in flight hold it.
pub(crate) async fn lock_saga(
    pool: &PgPool,
    saga_id: &str,
) -> Result<(Transaction<'static, Postgres>, SagaRow), StepError> {
    let mut backoff = busy_backoff();
    loop {
        let mut tx = pool.begin().await?;
        let row = sqlx::query_as(
            "SELECT state, failed_step, error FROM sagas WHERE saga_id = $1 FOR UPDATE NOWAIT",
        )
        .bind(saga_id)
        .fetch_one(&mut *tx)
        .await;
        match row {
            Ok(row) => return Ok((tx, row)),
            Err(e) if is_busy(&e) => {
                tx.rollback().await?;
                tokio::time::sleep(backoff.next_delay()).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// A saga's row: its state, and the step that failed and why.
pub(crate) type SagaRow = (String, Option<String>, Option<String>);

/// Where a step's action runs: rolling back to it undoes the action's writes
/// but keeps the step's row locked, so the failure is recorded before any
/// other execution can see the step, on the same connection.
const SAVEPOINT: &str = "SAVEPOINT idempo_saga_step";
const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idempo_saga_step";

/// [`Saga::execute`](super::Saga::execute).
pub(crate) async fn execute<T, F, Fut>(
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
    check_names(saga_id, step)?;
    let (value, _) = execute_step(pool, saga_id, step, None, action).await?;
    Ok(value)
}

/// [`execute`] without the name checks, returning the stored JSON too.
/// With a `budget`, a step that already failed that many times does not
/// run: [`StepError::Failed`] with the stored error (checked under the row
/// lock, so overlapping runs cannot exceed it).
pub(crate) async fn execute_step<T, F, Fut>(
    pool: &PgPool,
    saga_id: &str,
    step: &str,
    budget: Option<i32>,
    action: F,
) -> Result<(T, Value), StepError>
where
    T: Serialize + DeserializeOwned,
    F: FnOnce(Tx) -> Fut,
    Fut: Future<Output = Result<T, BoxError>>,
{
    let locked = lock_step(pool, saga_id, step, false).await?;
    let refused = match (locked.state.as_str(), locked.saga.as_deref()) {
        ("completed", _) => {
            locked.tx.rollback().await?;
            let stored = locked.result.unwrap_or(Value::Null);
            let value =
                serde_json::from_value(stored.clone()).map_err(|source| StepError::Result {
                    step: step.to_owned(),
                    source,
                })?;
            return Ok((value, stored));
        }
        ("compensated", _) => Some(StepError::Compensated {
            step: step.to_owned(),
        }),
        (_, Some("compensating" | "compensated")) => Some(StepError::SagaCompensating {
            saga_id: saga_id.to_owned(),
            step: step.to_owned(),
        }),
        (_, Some("completed")) => Some(StepError::SagaCompleted {
            saga_id: saga_id.to_owned(),
            step: step.to_owned(),
        }),
        ("failed", _) if budget.is_some_and(|budget| locked.attempts >= budget) => {
            Some(StepError::Failed {
                step: step.to_owned(),
                attempts: locked.attempts,
                source: locked.error.unwrap_or_default().into(),
            })
        }
        _ => None,
    };
    let mut tx = locked.tx;
    if let Some(refused) = refused {
        tx.rollback().await?;
        return Err(refused);
    }

    sqlx::query(SAVEPOINT).execute(&mut *tx).await?;
    let handle = Tx::new(tx, None);
    let outcome = action(handle.clone()).await;
    let Some(mut tx) = handle.take() else {
        return Err(StepError::TransactionKept {
            step: step.to_owned(),
        });
    };
    // The round trip is checked before the commit: a result that would not
    // come back must not let the action's writes commit.
    let failure = match outcome.map(|value| round_trip(&value)) {
        Ok(Ok(result)) => {
            // What a re-execution will get is what PostgreSQL gives back
            // (its text, parsed again: a float may land one ulp off the one
            // computed), so the value returned now is read from that too.
            let stored: Value = sqlx::query_scalar(
                "UPDATE saga_steps SET state = 'completed', result = $3, error = NULL,
                     attempts = attempts + 1, updated_at = now()
                 WHERE saga_id = $1 AND step = $2
                 RETURNING result",
            )
            .bind(saga_id)
            .bind(step)
            .bind(&result)
            .fetch_one(&mut *tx)
            .await?;
            match serde_json::from_value(stored.clone()) {
                Ok(value) => {
                    tx.commit().await?;
                    return Ok((value, stored));
                }
                Err(source) => Failure::NotStorable(source),
            }
        }
        Ok(Err(source)) => Failure::NotStorable(source),
        Err(source) => Failure::Action(source),
    };
    sqlx::query(ROLLBACK_TO_SAVEPOINT).execute(&mut *tx).await?;
    let error = match &failure {
        Failure::Action(source) => source.to_string(),
        Failure::NotStorable(source) => not_storable(source),
    };
    let attempts: i32 = sqlx::query_scalar(
        "UPDATE saga_steps SET state = 'failed', error = $3,
             attempts = attempts + 1, updated_at = now()
         WHERE saga_id = $1 AND step = $2
         RETURNING attempts",
    )
    .bind(saga_id)
    .bind(step)
    .bind(error)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    let step = step.to_owned();
    Err(match failure {
        Failure::Action(source) => StepError::Failed {
            step,
            attempts,
            source,
        },
        Failure::NotStorable(source) => StepError::ResultNotStorable {
            step,
            attempts,
            source,
        },
    })
}

/// Why an execution did not complete, before it is recorded.
enum Failure {
    Action(BoxError),
    NotStorable(serde_json::Error),
}

/// [`Saga::compensate`](super::Saga::compensate).
pub(crate) async fn compensate<T, F, Fut>(
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
    check_names(saga_id, step)?;
    compensate_step(pool, saga_id, step, move |stored| {
        let result: T = serde_json::from_value(stored)?;
        Ok(move |tx| compensation(tx, result))
    })
    .await
}

/// [`compensate`] without the name checks; `decode` turns the stored result
/// into the compensation to run.
pub(crate) async fn compensate_step<D, F, Fut>(
    pool: &PgPool,
    saga_id: &str,
    step: &str,
    decode: D,
) -> Result<bool, StepError>
where
    D: FnOnce(Value) -> Result<F, serde_json::Error>,
    F: FnOnce(Tx) -> Fut,
    Fut: Future<Output = Result<(), BoxError>>,
{
    let locked = lock_step(pool, saga_id, step, true).await?;
    let mut tx = locked.tx;
    let mark = "UPDATE saga_steps SET state = 'compensated', updated_at = now()
                WHERE saga_id = $1 AND step = $2";
    if locked.saga.as_deref() == Some("completed") {
        tx.rollback().await?;
        return Err(StepError::SagaCompleted {
            saga_id: saga_id.to_owned(),
            step: step.to_owned(),
        });
    }
    match locked.state.as_str() {
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
    let failure = match decode(locked.result.unwrap_or(Value::Null)) {
        Ok(compensation) => {
            sqlx::query(SAVEPOINT).execute(&mut *tx).await?;
            let handle = Tx::new(tx, None);
            let outcome = compensation(handle.clone()).await;
            let Some(taken) = handle.take() else {
                return Err(StepError::TransactionKept {
                    step: step.to_owned(),
                });
            };
            tx = taken;
            match outcome {
                Ok(()) => {
                    sqlx::query(mark)
                        .bind(saga_id)
                        .bind(step)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    return Ok(true);
                }
                Err(source) => {
                    sqlx::query(ROLLBACK_TO_SAVEPOINT).execute(&mut *tx).await?;
                    StepError::CompensationFailed {
                        step: step.to_owned(),
                        source,
                    }
                }
            }
        }
        Err(source) => StepError::Result {
            step: step.to_owned(),
            source,
        },
    };
    // The step stays `completed`; the error shows why it is not undone yet.
    let error = match &failure {
        StepError::CompensationFailed { source, .. } => format!("compensation: {source}"),
        other => format!("compensation: {other}"),
    };
    sqlx::query(
        "UPDATE saga_steps SET error = $3, updated_at = now()
         WHERE saga_id = $1 AND step = $2",
    )
    .bind(saga_id)
    .bind(step)
    .bind(error)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Err(failure)
}

/// [`Saga::idempotency_key`](super::Saga::idempotency_key).
pub(crate) fn idempotency_key(saga_id: &str, step: &str) -> String {
    format!("{saga_id}:{step}")
}
