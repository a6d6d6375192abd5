//! [`StepError`]: why a step, or a saga run, did not produce a result.

use super::name::{NameError, shorten};

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a step (or a [`Saga`](super::Saga) run) did not produce a result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// The action failed: its writes rolled back, and the step is recorded
    /// as `failed` with this error and its attempt count. Executing it again
    /// is allowed. (Within a [`Saga`](super::Saga) run, also a step whose
    /// attempts earlier runs used up: the action did not run, and `source`
    /// is the stored error.)
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
    /// The action succeeded but its result cannot be stored as JSON and
    /// read back as the same value (a NaN or infinite float, a map whose
    /// keys are not strings, a `Deserialize` that disagrees with its
    /// `Serialize`). It is handled like a failed action, so that no
    /// re-execution can return something else than the first did: the
    /// writes rolled back and the step is recorded as `failed`.
    #[error("step {step:?} returned a result that cannot be stored (attempt {attempts}): {source}")]
    ResultNotStorable {
        /// The step.
        step: String,
        /// Attempts so far, this one included.
        attempts: i32,
        /// serde's error.
        #[source]
        source: serde_json::Error,
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
    /// The result stored by an earlier execution does not deserialize into
    /// the type asked for now (the step's result type changed).
    #[error("the stored result of step {step:?} does not deserialize into its type: {source}")]
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
    /// The saga completed ([`Saga::run`](super::Saga::run) recorded it), and
    /// a completed saga is final: its steps cannot be compensated, and a
    /// step that never completed cannot run. Undoing a completed saga is a
    /// new saga (a refund, a cancellation).
    #[error("saga {saga_id:?} completed: step {step:?} can neither be compensated nor run now")]
    SagaCompleted {
        /// The saga.
        saga_id: String,
        /// The step.
        step: String,
    },
    /// The saga is being compensated: no step runs forward any more.
    /// [`Saga::run`](super::Saga::run) handles this itself (it joins the
    /// compensation); [`Saga::execute`](super::Saga::execute) returns it.
    #[error("saga {saga_id:?} is being compensated: step {step:?} cannot run")]
    SagaCompensating {
        /// The saga.
        saga_id: String,
        /// The step.
        step: String,
    },
    /// Two steps of a [`Saga`](super::Saga) have this name; refused by
    /// `run` before anything was sent to the database.
    #[error("the saga has two steps named {step:?}; step names must be unique")]
    DuplicateStep {
        /// The name.
        step: String,
    },
    /// The saga id was refused before anything was sent to the database.
    #[error("invalid saga id: {0}")]
    InvalidSagaId(#[source] NameError),
    /// A step name was refused before anything was sent to the database.
    #[error("invalid step name {}: {source}", shorten(.step))]
    InvalidStepName {
        /// The name.
        step: String,
        /// What is wrong with it.
        #[source]
        source: NameError,
    },
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}
