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

use super::step::{StepError, compensate, execute, idempotency_key};
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
/// ([`execute`]); when a step fails `attempts` times in a row (default 1),
/// the completed steps are compensated in reverse order ([`compensate`]).
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
///             let mut conn = tx.lock()?;
///             sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'x'")
///                 .execute(&mut *conn).await?;
///             Ok(1_i64)
///         },
///         |tx, _reserved: i64| async move {
///             let mut conn = tx.lock()?;
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
    /// # Errors
    /// A database error, or a compensation that failed: nothing is lost; run
    /// the same saga id again to resume.
    pub async fn run(&self, saga_id: &str) -> Result<SagaOutcome, StepError> {
        let mut results = BTreeMap::new();
        for (index, step) in self.steps.iter().enumerate() {
            let mut attempt = 0;
            let value = loop {
                attempt += 1;
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
                    Err(StepError::Failed { .. }) if attempt < self.attempts => continue,
                    Err(StepError::Failed { source, .. }) => {
                        return self
                            .compensate_through(saga_id, index, source.to_string())
                            .await;
                    }
                    // An earlier run began compensating: finish that.
                    Err(StepError::Compensated { .. }) => {
                        let error = "an earlier run was compensating".to_owned();
                        return self.compensate_through(saga_id, index, error).await;
                    }
                    Err(other) => return Err(other),
                }
            };
            results.insert(step.name.clone(), value);
        }
        Ok(SagaOutcome::Completed(results))
    }

    /// Compensates step `failed` (a no-op mark: it never completed) and every
    /// step before it, last first.
    async fn compensate_through(
        &self,
        saga_id: &str,
        failed: usize,
        error: String,
    ) -> Result<SagaOutcome, StepError> {
        for step in self.steps[..=failed].iter().rev() {
            let compensation = step.compensation.clone();
            compensate(&self.pool, saga_id, &step.name, move |tx, value: Value| {
                compensation(tx, value)
            })
            .await?;
        }
        Ok(SagaOutcome::Compensated {
            failed_step: self.steps[failed].name.clone(),
            error,
        })
    }
}
