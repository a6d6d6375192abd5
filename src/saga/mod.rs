//! Saga steps that are safe to re-execute and re-compensate (feature `saga`).
//!
//! A step's state lives in `saga_steps(saga_id, step, state, result, error,
//! attempts, updated_at)`. [`Saga::execute`] runs an action at most once with
//! effect: its writes and the `completed` record (with its result) commit in
//! one transaction, so a re-execution returns the stored result instead of
//! acting again. [`Saga::compensate`] undoes a completed step at most once, the same
//! way. [`Saga`] runs steps in order and compensates in reverse on a permanent
//! failure; running the same saga id again resumes it. A run needs one pool
//! connection at a time, and waiting for an overlapping run holds none (see
//! [`Saga::run`]).
//!
//! Effects outside the step's transaction (an HTTP call to a payment
//! provider) are at-least-once: give them [`Saga::idempotency_key`]`(saga_id, step)`
//! (the same on every re-execution) so that the other side runs them once.
//! Saga ids and step names are checked up front so that this key is a valid
//! `Idempotency-Key` ([`NameError`]).

mod direct;
mod error;
mod json;
mod name;
mod runner;
mod step;

pub use error::StepError;
pub use name::NameError;
pub use runner::{Saga, SagaOutcome, StepContext};
