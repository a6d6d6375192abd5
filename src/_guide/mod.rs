//! After this page you can find where each topic is explained, from a first
//! consumer to the 3 a.m. page: the guide, one topic per page.
//!
//! Every code block in the guide is compiled as a doctest by
//! `cargo test --all-features`, so what you copy from here compiles against
//! this version of idempo. The guide is rendered with every feature on (as
//! docs.rs renders it); in a checkout, `cargo doc --all-features --open` and
//! follow `idempo::_guide`, or read the Markdown in `src/_guide/`.
//!
//! # Where a newcomer starts
//!
//! | to … | read |
//! |---|---|
//! | write a consumer whose writes happen once per message (dedup) | [`consumer`], "A consumer with dedup" |
//! | forward a message to the next service through the outbox | [`outbox`], "Forwarding from a handler" |
//! | test a handler without a broker | [`testing`], "A handler test" |
//!
//! # The pages
//!
//! **Using idempo**
//!
//! - [`consumer`]: the guarantee, a consumer with dedup, handlers and their
//!   transaction, errors, message ids, shutdown, the inbox without AMQP.
//! - [`failures`]: what happens on every failure; retries through delay
//!   queues; dead letters (RabbitMQ queue or PostgreSQL table); errors at start.
//! - [`batch`]: batch mode, one transaction for many deliveries.
//! - [`nats`]: the same handlers on NATS JetStream, and what differs there.
//! - [`outbox`]: messages a handler emits, published after the commit, exactly
//!   once downstream.
//! - [`http`]: the `Idempotency-Key` tower layer for axum.
//! - [`window`]: an SQS-FIFO-style deduplication window and publisher.
//! - [`saga`]: saga steps that are safe to run again and to compensate again.
//! - [`retry`]: a retrying HTTP client that keeps one `Idempotency-Key`.
//! - [`testing`]: the harness that runs a handler's real delivery path without
//!   a broker, and store contract tests.
//!
//! **Running idempo**
//!
//! - [`production`]: schema and migrations, pool sizes, TLS, health, metrics,
//!   retention (plain and partitioned).
//! - [`scale_out`]: several broker nodes, many replicas, failover, a cluster
//!   on one machine.
//! - [`operations`]: the `idempo` command and its dashboard; the 3 a.m.
//!   walkthroughs for dead letters, the outbox and the partitions.
//!
//! # The guarantee in one paragraph
//!
//! Writes a handler makes **through its transaction** ([`Tx`](crate::Tx))
//! happen exactly once per `(consumer, message id)`, and so do the messages
//! it stages in the [outbox](crate::outbox) (published at least once, with a
//! fixed id the next idempo consumer deduplicates). Everything else a
//! handler does (an HTTP call, an e-mail, a write on another connection) is
//! at-least-once unless it carries a key derived from the message id.
//! [`consumer`] says it precisely.
//!
//! Contributors: the design, the delivery state machine and the failure table
//! with the test that proves each line are in `ARCHITECTURE.md` in the
//! repository.

#[doc = include_str!("consumer.md")]
pub mod consumer {}

#[doc = include_str!("failures.md")]
pub mod failures {}

#[doc = include_str!("batch.md")]
pub mod batch {}

#[doc = include_str!("nats.md")]
pub mod nats {}

#[doc = include_str!("outbox.md")]
pub mod outbox {}

#[doc = include_str!("http.md")]
pub mod http {}

#[doc = include_str!("window.md")]
pub mod window {}

#[doc = include_str!("saga.md")]
pub mod saga {}

#[doc = include_str!("retry.md")]
pub mod retry {}

#[doc = include_str!("testing.md")]
pub mod testing {}

#[doc = include_str!("production.md")]
pub mod production {}

#[doc = include_str!("scale_out.md")]
pub mod scale_out {}

#[doc = include_str!("operations.md")]
pub mod operations {}
