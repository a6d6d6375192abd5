//! # idempo
//!
//! Exactly-once **effects** on at-least-once infrastructure. Brokers redeliver,
//! clients retry, networks drop answers: idempo makes the second copy harmless.
//!
//! - [`inbox`]: claim a `(consumer, message_id)` in `processed_messages` inside
//!   your own sqlx PostgreSQL transaction; the primary key is the lock. Works
//!   from any worker loop.
//! - [`consumer`]: the consumer, written once for every transport. The
//!   claim, your handler's writes and the commit share one transaction; the
//!   delivery is settled only after the commit. Around that: delayed retries
//!   ([`consumer::RedeliveryPolicy`]), dead letters with their reason,
//!   reconnects, a gate that holds deliveries while PostgreSQL is down,
//!   retention of old claims, [`consumer::Health`] and `metrics` counters,
//!   graceful shutdown, and a batch mode for throughput
//!   ([`consumer::ConsumerBuilder::batch_handler`]).
//! - Its transports: [`amqp`] (feature `amqp`, on by default: RabbitMQ on
//!   lapin, with delay queues and a DLQ), `nats` (feature `nats`: JetStream
//!   on async-nats), and `testing` (feature `testing`: in memory, no broker).
//!
//! - [`outbox`] (feature `outbox`, on by default): messages a transaction
//!   emits, staged as rows in it and published after the commit by
//!   [`relay::Relay`] (every consumer runs one), with the id fixed at staging:
//!   the next idempo consumer applies each exactly once.
//!
//! ## What is guaranteed
//! Writes made **through the handler's transaction** happen exactly once per
//! `(consumer, message id)`. Anything outside it (an HTTP call, an e-mail) is
//! at-least-once unless it carries a key derived from the message id.
//!
//! ## Hello, consumer
//! ```no_run
//! use idempo::Tx;
//! use idempo::amqp::Consumer;
//! use idempo::consumer::JsonBody;
//!
//! #[derive(serde::Deserialize)]
//! struct Payment { account: String, amount_cents: i64 }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
//!     idempo::migrate(&pool).await?;
//!     Consumer::builder("amqp://guest:guest@127.0.0.1:5672/%2f", pool)
//!         .queue("payments")
//!         .handler(|tx: Tx, JsonBody(p): JsonBody<Payment>| async move {
//!             let mut tx = tx.try_lock()?;
//!             sqlx::query("INSERT INTO payments (account, amount_cents) VALUES ($1, $2)")
//!                 .bind(&p.account)
//!                 .bind(p.amount_cents)
//!                 .execute(&mut *tx)
//!                 .await?;
//!             Ok(())
//!         })
//!         .run_until_signal()
//!         .await?;
//!     Ok(())
//! }
//! ```
//!
//! ## Feature flags
//! | Name | Description | Default? |
//! |---|---|---|
//! | `runtime` | The consumer runtime every transport runs on (`consumer`); turned on by `amqp` and `nats` | yes (by `amqp`) |
//! | `amqp` | The RabbitMQ transport ([`amqp`]) on the consumer runtime | yes |
//! | `nats` | The NATS JetStream transport (`nats`) on the consumer runtime | no |
//! | `http` | The `Idempotency-Key` tower layer and axum extractor (`http`) | no |
//! | `window` | The SQS-FIFO-style deduplication window (`window`) | no |
//! | `outbox` | The transactional outbox (`outbox`): messages staged in your transaction, published by a relay after commit | yes |
//! | `saga` | Saga steps safe to re-execute and re-compensate (`saga`) | no |
//! | `retry` | A retrying reqwest client that keeps its `Idempotency-Key`, and a generic retry loop (`retry`) | no |
//! | `redis` | Redis stores for the modules that have one | no |
//! | `ops` | The operations behind the `idempo` command as library functions (`ops`): status, dead letters, replay, reaping, cleanup, partitions | no |
//! | `cli` | The `idempo` command (a thin client of `ops`) and its web dashboard | no |
//! | `testing` | A harness that runs a consumer's delivery path without a broker, and store contract tests (`testing`) | no |
//! | `tls` | TLS (rustls, no OpenSSL) to every service: `amqps://`, PostgreSQL `sslmode=require/verify-ca/verify-full`, `rediss://` | yes |
//! | `anyhow` | `?` on an `anyhow::Error` in a handler classifies the error it carries (a database error, an undecodable body) instead of an opaque wrapper | yes |
#![cfg_attr(
    all(
        feature = "amqp",
        feature = "outbox",
        feature = "http",
        feature = "window",
        feature = "saga",
        feature = "retry",
        feature = "redis",
        feature = "tls",
        feature = "anyhow",
        feature = "ops",
        feature = "testing"
    ),
    doc = "\n## The guide\n\nThe depth is in [`_guide`]: one page per topic (a consumer with \
           dedup, failures, batch mode, the outbox, HTTP, the window, sagas, retries, testing, \
           production, scale-out, operations), every code block compiled as a doctest."
)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// Exponential backoff with full jitter, one file per part (src/backoff/),
// each compiled with the features that use it.
#[cfg(any(idempo_runtime, feature = "retry", feature = "saga", feature = "http"))]
mod backoff {
    //! Exponential backoff with full jitter: the one implementation behind
    //! the consumer's reconnects, the database gate's probes, the relay, the
    //! saga's and the HTTP layer's retries, and the retrying client.

    mod jitter;
    pub(crate) use jitter::{ceiling, full_jitter};

    #[cfg(any(idempo_runtime, feature = "saga", feature = "http"))]
    mod pauses;
    #[cfg(any(idempo_runtime, feature = "saga", feature = "http"))]
    pub(crate) use pauses::Backoff;

    #[cfg(idempo_runtime)]
    mod reset;
}
pub mod certificate;
#[cfg(any(feature = "http", feature = "window"))]
mod cleanup;
mod client_tls;
#[cfg(feature = "amqp")]
mod duration;
mod error;
pub mod headers;
#[cfg(idempo_runtime)]
mod host;
pub mod inbox;
#[cfg(any(feature = "http", feature = "retry"))]
mod key;
#[cfg(all(feature = "outbox", idempo_runtime))]
mod literal;
mod message_id;
mod migrate;
pub mod probe;
// A message's properties at rest, in idempo's encoding (src/properties/):
// the values and their encoding wherever a copy is kept; their reading
// where a copy is published or replayed.
#[cfg(idempo_runtime)]
mod properties {
    mod value;
    pub(crate) use value::{Properties, Value};

    #[cfg(any(all(feature = "amqp", feature = "outbox"), feature = "nats"))]
    mod read;
}
// One file per kind of random value (src/random/), each compiled with the
// features that draw it.
#[cfg(any(
    idempo_runtime,
    feature = "outbox",
    feature = "retry",
    feature = "window",
    all(feature = "http", feature = "redis")
))]
mod random {
    //! Random ids and tokens from the operating system's generator: the one
    //! source for everything that must not collide across processes or be
    //! guessed (seal keys, fencing and reservation tokens, UUIDs for
    //! `Idempotency-Key`s and message ids).
    //!
    //! There is no fallback: a secret drawn from a weak generator is worse
    //! than an error, so when the operating system gives no randomness the
    //! caller fails with [`Error::Randomness`](crate::Error::Randomness).

    mod bytes;
    pub(crate) use bytes::bytes;

    #[cfg(test)]
    mod check;

    #[cfg(any(
        feature = "window",
        all(feature = "http", feature = "redis"),
        feature = "testing",
        test
    ))]
    mod token;
    #[cfg(any(
        feature = "window",
        all(feature = "http", feature = "redis"),
        feature = "testing",
        test
    ))]
    pub(crate) use token::token;

    #[cfg(any(feature = "retry", all(feature = "amqp", feature = "window")))]
    mod uuid_v4;
    #[cfg(any(feature = "retry", all(feature = "amqp", feature = "window")))]
    pub(crate) use uuid_v4::uuid_v4;

    #[cfg(feature = "outbox")]
    mod uuid_v7;
    #[cfg(feature = "outbox")]
    pub(crate) use uuid_v7::uuid_v7;
}
mod redact;
// The Redis stores' connections: only the modules that have one.
#[cfg(all(feature = "redis", any(feature = "http", feature = "window")))]
mod redis_connection;
mod sqlstate;
#[cfg(any(feature = "http", feature = "window"))]
mod store_error;
// TLS (feature `tls`): a refused handshake told from an outage (for the
// consumer's PostgreSQL, RabbitMQ and Redis), and the PEM of a `ClientTls`
// (for RabbitMQ and Redis).
#[cfg(all(
    feature = "tls",
    any(
        idempo_runtime,
        all(feature = "redis", any(feature = "http", feature = "window"))
    )
))]
mod tls;
#[cfg(all(
    feature = "tls",
    any(
        feature = "amqp",
        all(feature = "redis", any(feature = "http", feature = "window"))
    )
))]
mod tls_pem;
// Only the runtimes that own a transaction hand out a `Tx`.
// A dead letter's trace (the operations), a message's parent span (the
// runtime with OpenTelemetry).
#[cfg(any(all(feature = "otel", idempo_runtime), feature = "ops"))]
mod trace_id;
#[cfg(any(idempo_runtime, feature = "http", feature = "saga"))]
mod tx;
#[cfg(idempo_runtime)]
mod wait;
#[cfg(any(feature = "amqp", feature = "outbox"))]
mod wire_size;

#[cfg(idempo_runtime)]
mod runtime;

#[cfg(idempo_runtime)]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub mod consumer;

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub mod amqp;

#[cfg(all(idempo_runtime, feature = "outbox"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "runtime", feature = "outbox"))))]
pub mod relay;

#[cfg(feature = "ops")]
pub(crate) mod dead_letters;

#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;

#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;

#[cfg(feature = "window")]
#[cfg_attr(docsrs, doc(cfg(feature = "window")))]
pub mod window;

#[cfg(feature = "saga")]
#[cfg_attr(docsrs, doc(cfg(feature = "saga")))]
pub mod saga;

#[cfg(feature = "outbox")]
#[cfg_attr(docsrs, doc(cfg(feature = "outbox")))]
pub mod outbox;

#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub mod otel;

#[cfg(feature = "retry")]
#[cfg_attr(docsrs, doc(cfg(feature = "retry")))]
pub mod retry;

#[cfg(feature = "ops")]
#[cfg_attr(docsrs, doc(cfg(feature = "ops")))]
pub mod ops;

#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

#[cfg(any(feature = "http", feature = "window"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "http", feature = "window"))))]
pub use cleanup::StateCount;
pub use client_tls::ClientTls;
pub use error::{Error, Result};
#[cfg(any(feature = "http", feature = "retry"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "http", feature = "retry"))))]
pub use key::KeyError;
#[cfg(any(feature = "http", feature = "window"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "http", feature = "window"))))]
pub use store_error::StoreError;

// The guide (src/_guide/): what the README leaves out, one topic per page,
// every code block a doctest. Compiled with every feature its examples use
// (`cargo test --all-features` tests them; docs.rs renders them).
#[cfg(all(
    feature = "amqp",
    feature = "outbox",
    feature = "http",
    feature = "window",
    feature = "saga",
    feature = "retry",
    feature = "redis",
    feature = "tls",
    feature = "anyhow",
    feature = "ops",
    feature = "testing"
))]
pub mod _guide;

/// The README's examples, compiled as doctests so that they cannot drift
/// from the code (`cargo test --all-features`).
#[cfg(all(
    doctest,
    feature = "amqp",
    feature = "http",
    feature = "redis",
    feature = "window",
    feature = "saga",
    feature = "retry",
    feature = "testing"
))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub use migrate::{Schema, migrate};
pub use redact::redact_url;
#[cfg(any(idempo_runtime, feature = "http", feature = "saga"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "runtime", feature = "http", feature = "saga")))
)]
pub use tx::{Tx, TxGuard};
