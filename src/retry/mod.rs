//! Client-side retry safety (feature `retry`): "server idempotency is useless
//! without correct client retries".
//!
//! - [`RetryPolicy`]: max retries (3), base delay (200 ms), max delay (30 s),
//!   retryable statuses (408, 409, 429, 500, 502, 503, 504), exponential
//!   backoff with full jitter, `Retry-After` honoured, an overall deadline and
//!   a cancellation token.
//! - [`RetryPolicy::retry`]: the loop for any async work.
//! - [`RetryingClient`]: reqwest with one `Idempotency-Key` (a fresh UUID v4,
//!   or yours, checked against the server's syntax) sent on **every**
//!   attempt, so an idempotent server (such as
//!   [`IdempotencyLayer`](crate#feature-flags)) executes the request once.
//!   Each attempt has 10 s to get an answer before it is retried. It returns
//!   a final answer ([`Retried`]) or [`SendError::GaveUp`], which carries
//!   the last retryable response (a 503 when the retries ran out) so that it
//!   cannot pass for one.
//!
//! The header is `Idempotency-Key`. (The consumer's broker-side
//! delay tiers are a different thing, `amqp::RedeliveryPolicy`.)

mod client;
mod policy;
mod run;

pub use client::{AttemptError, Retried, RetryingClient, SendError};
pub use policy::RetryPolicy;
pub use run::{Attempt, RetryError};
