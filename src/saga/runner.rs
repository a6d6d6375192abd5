//! [`Saga`]: steps in order; on a permanent failure, compensation in reverse.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sqlx::PgPool;

use super::step::{StepError, compensate, execute, idempotency_key, step_state};
use crate::Tx;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;
type Action =
    Arc<dyn Fn(Tx, StepContext) -> BoxFuture<'static, Result<Value, BoxError>> + Send + Sync>;
type Compensation =
    Arc<dyn Fn(Tx, Value) -> BoxFuture<'static, Result<(), BoxError>> + Send + Sync>;

/// What a step's action knows: which saga and step it is, and the results of
/// the steps before it.
#[derive(Debug, Clone)]
pub struct StepContext {
    saga_id: String,
    step: String,
    results: Arc<BTreeMap<String, Value>>,
}

impl StepContext {
    /// The saga's id.
    pub fn saga_id(&self) -> &str {
        &self.saga_id
    }

    /// This step's name.
    pub fn step(&self) -> &str {
        &self.step
    }

    /// The result of an earlier step, if it ran and has that type.
    pub fn result<T: DeserializeOwned>(&self, step: &str) -> Option<T> {
        serde_json::from_value(self.results.get(step)?.clone()).ok()
    }

    /// `{saga_id}:{step}`: the key for an external call made by this step,
    /// the same on every re-execution (see [`idempotency_key`]).
    pub fn idempotency_key(&self) -> String {
        idempotency_key(&self.saga_id, &self.step)
    }
}

struct Step {
    name: String,
    action: Action,
    compensation: Compensation,
}

/// How a run ended (both are final for this saga id).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum SagaOutcome {
    /// Every step completed; their results by step name.
    Completed(BTreeMap<String, Value>),
    /// A step failed permanently (or an earlier run had begun compensating):
    /// every completed step was compensated, in reverse order.
    Compensated {
        /// The step that failed.
        failed_step: String,
        /// Its error.
        error: String,
    },
}

/// A sequence of steps that is safe to run again with the same saga id.
///
/// Each step's action runs in a transaction that also records its result
/// ([`execute`]); when a step has failed `attempts` times (default 1, counted
/// in the database across runs), the completed steps are compensated in
/// reverse order ([`compensate`]).
/// Running the same saga id again after a crash resumes: completed steps are
/// not re-run (their stored results are used), and an interrupted
/// compensation continues.
///
/// ```no_run
/// # async fn doc(pool: sqlx::PgPool) -> Result<(), idempo::saga::StepError> {
/// use idempo::saga::{Saga, SagaOutcome};
///
/// let saga = Saga::new(pool)
///     .step(
///         "reserve",
///         |tx, _ctx| async move {
///             let mut conn = tx.try_lock()?;
///             sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'x'")
///                 .execute(&mut *conn).await?;
///             Ok(1_i64)
///         },
///         |tx, _reserved: i64| async move {
///             let mut conn = tx.try_lock()?;
///             sqlx::query("UPDATE stock SET reserved = reserved - 1 WHERE sku = 'x'")
///                 .execute(&mut *conn).await?;
///             Ok(())
///         },
///     );
/// match saga.run("order-17").await? {
///     SagaOutcome::Completed(results) => println!("done: {results:?}"),
///     SagaOutcome::Compensated { failed_step, error } => println!("{failed_step}: {error}"),
///     _ => {}
/// }
/// # Ok(()) }
/// ```
pub struct Saga {
    pool: PgPool,
    steps: Vec<Step>,
    attempts: u32,
}

impl fmt::Debug for Saga {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Saga")
            .field(
                "steps",
                &self.steps.iter().map(|s| &s.name).collect::<Vec<_>>(),
            )
            .field("attempts", &self.attempts)
            .finish_non_exhaustive()
    }
}

impl Saga {
    /// A saga with no steps on `pool` (run [`migrate`](crate::migrate) first).
    pub fn new(pool: PgPool) -> Self {
        Saga {
            pool,
            steps: Vec::new(),
            attempts: 1,
        }
    }

    /// Appends a step: `action` does the work on a [`Tx`] and returns a
    /// result (stored as JSON); `compensation` undoes it, given that result.
    /// Step names must be unique within the saga.
    #[must_use]
    pub fn step<T, A, AF, C, CF>(
        mut self,
        name: impl Into<String>,
        action: A,
        compensation: C,
    ) -> Self
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        A: Fn(Tx, StepContext) -> AF + Send + Sync + 'static,
        AF: Future<Output = Result<T, BoxError>> + Send + 'static,
        C: Fn(Tx, T) -> CF + Send + Sync + 'static,
        CF: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        let action: Action = Arc::new(move |tx, ctx| {
            let run = action(tx, ctx);
            Box::pin(async move { Ok(serde_json::to_value(run.await?)?) })
        });
        let compensation = Arc::new(compensation);
        let compensation: Compensation = Arc::new(move |tx, value| {
            let compensation = compensation.clone();
            Box::pin(async move {
                let result: T = serde_json::from_value(value)?;
                compensation(tx, result).await
            })
        });
        self.steps.push(Step {
            name: name.into(),
            action,
            compensation,
        });
        self
    }

    /// How many times a failing step is executed before the saga gives up
    /// and compensates (default 1; at least 1).
    #[must_use]
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// Runs (or resumes) the saga `saga_id`.
    ///
    /// Runs of one saga id are serialized by a PostgreSQL advisory lock held
    /// on a connection of their own for the whole run, closed at its end (so
    /// the lock goes with it, also when the run's future is dropped or the
    /// process dies). A run needs up to three connections of the pool. The saga's own row in `sagas`
    /// says whether it runs forward or compensates, so a rerun resumes the
    /// right way: a saga that began compensating never runs forward again.
    ///
    /// # Errors
    /// A database error, or a compensation that failed: nothing is lost; run
    /// the same saga id again to resume.
    pub async fn run(&self, saga_id: &str) -> Result<SagaOutcome, StepError> {
        let mut lock = self.pool.acquire().await?;
        // The lock is the connection's: closing it (not returning it to the
        // pool) releases the lock even when this future is dropped mid-run.
        lock.close_on_drop();
        sqlx::query("SELECT pg_advisory_lock(hashtextextended('idempo.saga:' || $1, 0))")
            .bind(saga_id)
            .execute(&mut *lock)
            .await?;
        let outcome = self.run_locked(saga_id).await;
        let unlocked =
            sqlx::query("SELECT pg_advisory_unlock(hashtextextended('idempo.saga:' || $1, 0))")
                .bind(saga_id)
                .execute(&mut *lock)
                .await;
        if unlocked.is_err() {
            // The lock must not outlive the run on a pooled connection.
            lock.close_on_drop();
        }
        outcome
    }

    async fn run_locked(&self, saga_id: &str) -> Result<SagaOutcome, StepError> {
        let saga: Option<(String, Option<String>, Option<String>)> =
            sqlx::query_as("SELECT state, failed_step, error FROM sagas WHERE saga_id = $1")
                .bind(saga_id)
                .fetch_optional(&self.pool)
                .await?;
        if let Some((state, failed_step, error)) = saga
            && (state == "compensating" || state == "compensated")
        {
            let failed_step = failed_step.unwrap_or_default();
            return self
                .compensate_all(saga_id, failed_step, error.unwrap_or_default())
                .await;
        }
        self.set_state(saga_id, "running", None, None).await?;

        let mut results = BTreeMap::new();
        for step in &self.steps {
            let value = loop {
                // A step that already used its attempts (in an earlier run
                // that died before compensating) is not tried again.
                if let Some((state, attempts)) = step_state(&self.pool, saga_id, &step.name).await?
                    && state == "failed"
                    && attempts >= self.attempts as i32
                {
                    let error = self.step_error(saga_id, &step.name).await?;
                    return self.give_up(saga_id, &step.name, error).await;
                }
                let context = StepContext {
                    saga_id: saga_id.to_owned(),
                    step: step.name.clone(),
                    results: Arc::new(results.clone()),
                };
                let action = step.action.clone();
                let run = execute(&self.pool, saga_id, &step.name, move |tx| {
                    action(tx, context)
                });
                match run.await {
                    Ok(value) => break value,
                    // Counted in the database, so a rerun does not get a fresh budget.
                    Err(StepError::Failed { attempts, .. }) if attempts < self.attempts as i32 => {
                        continue;
                    }
                    Err(StepError::Failed { source, .. }) => {
                        return self.give_up(saga_id, &step.name, source.to_string()).await;
                    }
                    // Compensated outside a run of this saga: undo the rest.
                    Err(StepError::Compensated { .. }) => {
                        let error = "the step was compensated".to_owned();
                        return self.give_up(saga_id, &step.name, error).await;
                    }
                    Err(other) => return Err(other),
                }
            };
            results.insert(step.name.clone(), value);
        }
        self.set_state(saga_id, "completed", None, None).await?;
        Ok(SagaOutcome::Completed(results))
    }

    /// Records that the saga compensates (before anything is undone, so a
    /// rerun continues the compensation), then compensates.
    async fn give_up(
        &self,
        saga_id: &str,
        failed_step: &str,
        error: String,
    ) -> Result<SagaOutcome, StepError> {
        self.set_state(saga_id, "compensating", Some(failed_step), Some(&error))
            .await?;
        self.compensate_all(saga_id, failed_step.to_owned(), error)
            .await
    }

    /// Compensates every step, last first: completed ones run their
    /// compensation, the others are only marked.
    async fn compensate_all(
        &self,
        saga_id: &str,
        failed_step: String,
        error: String,
    ) -> Result<SagaOutcome, StepError> {
        for step in self.steps.iter().rev() {
            let compensation = step.compensation.clone();
            compensate(&self.pool, saga_id, &step.name, move |tx, value: Value| {
                compensation(tx, value)
            })
            .await?;
        }
        self.set_state(saga_id, "compensated", Some(&failed_step), Some(&error))
            .await?;
        Ok(SagaOutcome::Compensated { failed_step, error })
    }

    async fn set_state(
        &self,
        saga_id: &str,
        state: &str,
        failed_step: Option<&str>,
        error: Option<&str>,
    ) -> sqlx::Result<()> {
        sqlx::query(
            "INSERT INTO sagas (saga_id, state, failed_step, error) VALUES ($1, $2, $3, $4)
             ON CONFLICT (saga_id) DO UPDATE SET state = EXCLUDED.state,
                 failed_step = EXCLUDED.failed_step, error = EXCLUDED.error, updated_at = now()",
        )
        .bind(saga_id)
        .bind(state)
        .bind(failed_step)
        .bind(error)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn step_error(&self, saga_id: &str, step: &str) -> sqlx::Result<String> {
        let error: Option<String> =
            sqlx::query_scalar("SELECT error FROM saga_steps WHERE saga_id = $1 AND step = $2")
                .bind(saga_id)
                .bind(step)
                .fetch_one(&self.pool)
                .await?;
        Ok(error.unwrap_or_default())
    }
}
