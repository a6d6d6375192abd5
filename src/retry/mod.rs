//! Client-side retry safety (feature `retry`): "server idempotency is useless
//! without correct client retries".
//!
//! - [`RetryPolicy`]: max retries (3), base delay (200 ms), max delay (30 s),
//!   retryable statuses (408, 409, 429, 500, 502, 503, 504), exponential
//!   backoff with full jitter, `Retry-After` honoured, an overall deadline and
//!   a cancellation token.
//! - [`retry`]: the loop for any async work.
//! - [`RetryingClient`]: reqwest with one `Idempotency-Key` (a fresh UUID v4,
//!   or yours) sent on **every** attempt, so an idempotent server (such as
//!   [`IdempotencyLayer`](crate#feature-flags)) executes the request once.
//!
//! The header is [`crate::IDEMPOTENCY_KEY`]. (The consumer's broker-side
//! delay tiers are a different thing, `amqp::RedeliveryPolicy`.)

mod client;
mod policy;
mod run;

pub use client::{Retried, RetryingClient, SendError, new_key};
pub use policy::{RetryPolicy, parse_retry_after};
pub use run::{Attempt, RetryError, retry, retry_with};
