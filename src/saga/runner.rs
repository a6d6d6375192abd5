//! [`Saga`]: steps in order; on a permanent failure, compensation in reverse.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sqlx::PgPool;

use super::name;
use super::step::{
    StepError, check_step_name, compensate_step, execute_step, idempotency_key, lock_saga,
    not_storable,
};
use crate::Tx;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;
/// Executes one step (with the saga's attempt budget); returns its stored result.
type Execute = Arc<
    dyn Fn(PgPool, StepContext, i32) -> BoxFuture<'static, Result<Value, StepError>> + Send + Sync,
>;
/// Compensates one step; returns whether its compensation ran.
type Compensate =
    Arc<dyn Fn(PgPool, StepContext) -> BoxFuture<'static, Result<bool, StepError>> + Send + Sync>;

/// What a step's action and its compensation know: which saga and step it
/// is, and the results of the steps before it.
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
    /// the same on every re-execution (see [`Saga::idempotency_key`]). A refund
    /// made by the compensation can send it too: it names the charge.
    pub fn idempotency_key(&self) -> String {
        idempotency_key(&self.saga_id, &self.step)
    }
}

struct Step {
    name: String,
    execute: Execute,
    compensate: Compensate,
}

/// How a run ended (both are final for this saga id).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum SagaOutcome {
    /// Every step completed; their results by step name.
    Completed(BTreeMap<String, Value>),
    /// A step failed permanently, or was compensated from outside, or an
    /// earlier run had begun compensating: every completed step was
    /// compensated, in reverse order.
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
/// ([`Saga::execute`]); when a step has failed `attempts` times
/// (default 1, counted in the database across runs), the completed steps
/// are compensated in reverse order ([`Saga::compensate`]).
/// Running the same saga id again after a crash resumes: completed steps are
/// not re-run (their stored results are used), and an interrupted
/// compensation continues. Both outcomes are final: a completed saga's
/// steps cannot be compensated afterwards ([`StepError::SagaCompleted`]).
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
///         |tx, _reserved: i64, ctx| async move {
///             println!("undoing {} of {}", ctx.step(), ctx.saga_id());
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
    /// result (stored as JSON; it must read back as the same value, see
    /// [`StepError::ResultNotStorable`]); `compensation` undoes it, given
    /// that result and the same [`StepContext`] as the action.
    ///
    /// Step names must be unique within the saga and follow the rules of
    /// [`NameError`](super::NameError); [`run`](Saga::run) refuses a saga
    /// that breaks them before it touches the database.
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
        C: Fn(Tx, T, StepContext) -> CF + Send + Sync + 'static,
        CF: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        let action = Arc::new(action);
        let execute: Execute = Arc::new(move |pool, context, budget| {
            let action = action.clone();
            Box::pin(async move {
                let (saga_id, step) = (context.saga_id.clone(), context.step.clone());
                let run = move |tx| action(tx, context);
                let (_, stored): (T, Value) =
                    execute_step(&pool, &saga_id, &step, Some(budget), run).await?;
                Ok(stored)
            })
        });
        let compensation = Arc::new(compensation);
        let compensate: Compensate = Arc::new(move |pool, context| {
            let compensation = compensation.clone();
            Box::pin(async move {
                let (saga_id, step) = (context.saga_id.clone(), context.step.clone());
                let decode = move |stored| {
                    let result: T = serde_json::from_value(stored)?;
                    Ok(move |tx| compensation(tx, result, context))
                };
                compensate_step(&pool, &saga_id, &step, decode).await
            })
        });
        self.steps.push(Step {
            name: name.into(),
            execute,
            compensate,
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
    /// The saga's own row in `sagas` says whether it runs forward or
    /// compensates, so a rerun resumes the right way: a saga that began
    /// compensating never runs forward again, and a completed one does
    /// nothing but return the stored results.
    ///
    /// # Connections
    /// A run needs **one connection of the pool at a time**: the transaction
    /// of the step it executes or compensates (the one its action or
    /// compensation gets as [`Tx`]; a failure is recorded in it too), or one
    /// short statement in between. It never holds a connection while it
    /// waits: a row held by an overlapping run makes it roll back, give the
    /// connection back and try again after a pause (5 ms, doubling up to
    /// 1 s, jittered). So any number of concurrent runs share a pool of any
    /// size (they queue for its connections); connections that actions
    /// acquire themselves come on top.
    ///
    /// # Overlapping runs
    /// Runs of one saga id may overlap (a retry while the first run is still
    /// going, two processes). They take turns per step: one executes (or
    /// compensates) a step while the others wait for it and then use its
    /// outcome. A step runs forward only while the saga's row says
    /// `running` (checked in the step's transaction, which share-locks the
    /// row), and the row turns to `compensating` or `completed` only while
    /// no step is in flight, so each effect and each compensation happens
    /// once and overlapping runs that succeed return the same outcome.
    ///
    /// # Cancel safety
    /// Dropping the future rolls back the step in flight (its transaction
    /// goes with its connection); run the saga id again to resume.
    ///
    /// # Errors
    /// [`StepError::InvalidSagaId`], [`StepError::InvalidStepName`] and
    /// [`StepError::DuplicateStep`] before anything is sent to the database.
    /// A database error, or a compensation that failed: nothing is lost; run
    /// the same saga id again to resume.
    pub async fn run(&self, saga_id: &str) -> Result<SagaOutcome, StepError> {
        self.check(saga_id)?;
        // Committed on its own, like a step's row: overlapping runs never
        // wait on an uncommitted insert.
        sqlx::query(
            "INSERT INTO sagas (saga_id, state)
             SELECT $1, 'running' WHERE NOT EXISTS (SELECT 1 FROM sagas WHERE saga_id = $1)
             ON CONFLICT (saga_id) DO NOTHING",
        )
        .bind(saga_id)
        .execute(&self.pool)
        .await?;
        let state: String = sqlx::query_scalar("SELECT state FROM sagas WHERE saga_id = $1")
            .bind(saga_id)
            .fetch_one(&self.pool)
            .await?;
        if !matches!(state.as_str(), "compensating" | "compensated")
            && let Some(results) = self.forward(saga_id).await?
        {
            return Ok(SagaOutcome::Completed(results));
        }
        self.compensate_all(saga_id).await
    }

    /// The saga id, every step name, and their uniqueness (a second step of
    /// the same name would share the first one's row and never run).
    fn check(&self, saga_id: &str) -> Result<(), StepError> {
        name::check_saga_id(saga_id).map_err(StepError::InvalidSagaId)?;
        let mut seen = HashSet::new();
        for step in &self.steps {
            check_step_name(&step.name)?;
            if !seen.insert(step.name.as_str()) {
                return Err(StepError::DuplicateStep {
                    step: step.name.clone(),
                });
            }
        }
        Ok(())
    }

    /// Runs the steps in order; `None` when the saga compensates instead
    /// (recorded in its row before this returns).
    async fn forward(&self, saga_id: &str) -> Result<Option<BTreeMap<String, Value>>, StepError> {
        let budget = i32::try_from(self.attempts).unwrap_or(i32::MAX);
        let mut results = BTreeMap::new();
        for step in &self.steps {
            let value = loop {
                let context = StepContext {
                    saga_id: saga_id.to_owned(),
                    step: step.name.clone(),
                    results: Arc::new(results.clone()),
                };
                let error = match (step.execute)(self.pool.clone(), context, budget).await {
                    Ok(value) => break value,
                    // Counted in the database, so a rerun does not get a
                    // fresh budget (and the step does not run when an
                    // earlier run used it up).
                    Err(
                        StepError::Failed { attempts, .. }
                        | StepError::ResultNotStorable { attempts, .. },
                    ) if attempts < budget => continue,
                    Err(StepError::Failed { source, .. }) => source.to_string(),
                    Err(StepError::ResultNotStorable { source, .. }) => not_storable(&source),
                    // Compensated outside a run of this saga: undo the rest.
                    Err(StepError::Compensated { .. }) => "the step was compensated".to_owned(),
                    // An overlapping run began the compensation.
                    Err(StepError::SagaCompensating { .. }) => return Ok(None),
                    Err(other) => return Err(other),
                };
                self.begin_compensation(saga_id, &step.name, &error).await?;
                return Ok(None);
            };
            results.insert(step.name.clone(), value);
        }
        if self.complete(saga_id).await? {
            Ok(Some(results))
        } else {
            Ok(None)
        }
    }

    /// Records that the saga compensates, before anything is undone (so a
    /// rerun continues the compensation), unless an overlapping run already
    /// did. Waits for steps in flight: none runs forward afterwards.
    async fn begin_compensation(
        &self,
        saga_id: &str,
        failed_step: &str,
        error: &str,
    ) -> Result<(), StepError> {
        let (mut tx, (state, _, _)) = lock_saga(&self.pool, saga_id).await?;
        match state.as_str() {
            "running" => {
                sqlx::query(
                    "UPDATE sagas SET state = 'compensating', failed_step = $2, error = $3,
                         updated_at = now()
                     WHERE saga_id = $1",
                )
                .bind(saga_id)
                .bind(failed_step)
                .bind(error)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(())
            }
            // Cannot happen: a completed saga has no failing step, and its
            // steps cannot be compensated. Refused rather than undone.
            "completed" => {
                tx.rollback().await?;
                Err(StepError::SagaCompleted {
                    saga_id: saga_id.to_owned(),
                    step: failed_step.to_owned(),
                })
            }
            _ => {
                tx.rollback().await?;
                Ok(())
            }
        }
    }

    /// Records that the saga completed; `false` when it compensates instead:
    /// an overlapping run began the compensation, or one of its steps was
    /// compensated from outside after it completed (then this begins it).
    async fn complete(&self, saga_id: &str) -> Result<bool, StepError> {
        let (mut tx, (state, _, _)) = lock_saga(&self.pool, saga_id).await?;
        if state != "running" {
            tx.rollback().await?;
            return Ok(state == "completed");
        }
        // Under the saga's row lock, which `compensate` shares: no step can
        // be compensated between this check and the update.
        let names: Vec<&str> = self.steps.iter().map(|s| s.name.as_str()).collect();
        let compensated: Option<String> = sqlx::query_scalar(
            "SELECT step FROM saga_steps
             WHERE saga_id = $1 AND state = 'compensated' AND step = ANY($2)
             ORDER BY array_position($2, step) LIMIT 1",
        )
        .bind(saga_id)
        .bind(&names)
        .fetch_optional(&mut *tx)
        .await?;
        let (state, failed_step, error) = match &compensated {
            Some(step) => (
                "compensating",
                Some(step.as_str()),
                Some("the step was compensated"),
            ),
            None => ("completed", None, None),
        };
        sqlx::query(
            "UPDATE sagas SET state = $2, failed_step = $3, error = $4, updated_at = now()
             WHERE saga_id = $1",
        )
        .bind(saga_id)
        .bind(state)
        .bind(failed_step)
        .bind(error)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(compensated.is_none())
    }

    /// Compensates every step, last first: completed ones run their
    /// compensation, the others are only marked. Each compensation gets the
    /// results of the steps before it, as its action did.
    async fn compensate_all(&self, saga_id: &str) -> Result<SagaOutcome, StepError> {
        let stored: HashMap<String, Value> = sqlx::query_as(
            "SELECT step, result FROM saga_steps WHERE saga_id = $1 AND result IS NOT NULL",
        )
        .bind(saga_id)
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .collect();
        for (i, step) in self.steps.iter().enumerate().rev() {
            let earlier = self.steps[..i]
                .iter()
                .filter_map(|s| Some((s.name.clone(), stored.get(&s.name)?.clone())))
                .collect();
            let context = StepContext {
                saga_id: saga_id.to_owned(),
                step: step.name.clone(),
                results: Arc::new(earlier),
            };
            (step.compensate)(self.pool.clone(), context).await?;
        }
        let (mut tx, (state, failed_step, error)) = lock_saga(&self.pool, saga_id).await?;
        if state == "compensating" {
            sqlx::query(
                "UPDATE sagas SET state = 'compensated', updated_at = now() WHERE saga_id = $1",
            )
            .bind(saga_id)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(SagaOutcome::Compensated {
            failed_step: failed_step.unwrap_or_default(),
            error: error.unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noop(saga: Saga, name: &str) -> Saga {
        saga.step(
            name,
            |_tx, _ctx| async { Ok(()) },
            |_tx, (), _ctx| async { Ok(()) },
        )
    }

    /// A pool that cannot connect: any statement would fail with an I/O
    /// error, so a refusal proves nothing was sent.
    fn unreachable_pool() -> PgPool {
        PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/none").unwrap()
    }

    #[tokio::test]
    async fn duplicate_step_names_are_refused_before_the_database() {
        let saga = noop(noop(noop(Saga::new(unreachable_pool()), "a"), "b"), "a");
        let error = saga.run("order-1").await.unwrap_err();
        assert!(
            matches!(&error, StepError::DuplicateStep { step } if step == "a"),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            "the saga has two steps named \"a\"; step names must be unique"
        );
    }

    #[tokio::test]
    async fn bad_names_are_refused_before_the_database() {
        let saga = noop(Saga::new(unreachable_pool()), "a");
        let error = saga.run(&"x".repeat(10_000)).await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid saga id: 10000 bytes long, at most 190 are allowed"
        );
        assert!(matches!(
            saga.run("a\0b").await,
            Err(StepError::InvalidSagaId(
                name::NameError::InvalidCharacter { position: 1 }
            ))
        ));
        let saga = noop(Saga::new(unreachable_pool()), "b:c");
        assert!(matches!(
            saga.run("a").await,
            Err(StepError::InvalidStepName { step, .. }) if step == "b:c"
        ));
    }
}
