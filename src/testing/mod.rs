//! Test your handlers without a broker (feature `testing`).
//!
//! After reading this page you can test a handler's exactly-once behaviour
//! in a few lines: redeliveries, lost acks, failures of each kind, poison,
//! races on one id, and what it staged in the outbox.
//!
//! A [`Harness`] runs the consumer's **real** delivery path (id, decode,
//! claim, handler, commit, and the routing of every outcome:
//! ack, retry with the policy's delay, dead letter) against a real
//! PostgreSQL, fed in process instead of by RabbitMQ. It is built from the
//! same [`ConsumerBuilder`](crate::amqp::ConsumerBuilder) configuration as
//! production, works in a schema of its own (tests run in parallel), and
//! reports each delivery as a [`Delivered`] value.
//!
//! ```no_run
//! use idempo::Tx;
//! use idempo::consumer::{HandlerError, JsonBody, Message};
//! use idempo::testing::{Fault, Harness};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Payment { account: String, amount_cents: i64 }
//!
//! async fn handle_payment(tx: Tx, (JsonBody(p), m): (JsonBody<Payment>, Message)) -> Result<(), HandlerError> {
//!     let mut tx = tx.try_lock()?;
//!     sqlx::query("INSERT INTO payments (message_id, account, amount_cents) VALUES ($1, $2, $3)")
//!         .bind(m.id()).bind(&p.account).bind(p.amount_cents)
//!         .execute(&mut *tx).await?;
//!     Ok(())
//! }
//!
//! # async fn doc() -> anyhow::Result<()> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/postgres").await?;
//! let h = Harness::new(pool, "payments")
//!     .setup("CREATE TABLE payments (message_id text PRIMARY KEY, account text, amount_cents bigint)")
//!     .handler(handle_payment)
//!     .await?;
//! let m = h.json("p-1", &Payment { account: "a".into(), amount_cents: 500 });
//! assert!(h.deliver(m.clone()).await?.is_acked());
//! assert!(h.deliver(m.clone()).await?.is_duplicate());          // redelivery: handler not run
//! let other = h.json("p-1", &Payment { account: "b".into(), amount_cents: 1 });
//! assert!(h.deliver(other).await?.is_mismatch());               // same id, other body
//! let m2 = h.json("p-2", &Payment { account: "a".into(), amount_cents: 7 });
//! let d = h.deliver_with(m2.clone(), Fault::Transient).await?;  // fails once: retried
//! assert_eq!(d.retry_delay(), Some(std::time::Duration::from_secs(1)), "{d}");
//! assert!(h.deliver(d.redelivery().unwrap()).await?.is_acked()); // the retry copy succeeds
//! h.close().await;
//! # Ok(()) }
//! ```
//!
//! What a harness gives:
//! - **Outcomes** ([`Delivered`]): acked, duplicate, mismatch, retried (the
//!   delay the [`RedeliveryPolicy`](crate::consumer::RedeliveryPolicy) chose, the
//!   attempt, and the copy to deliver next), dead-lettered (the reason and
//!   the dead letter), held at the database gate.
//! - **Faults** ([`Fault`], [`Harness::deliver_with`], one message of a
//!   batch with [`deliver_all_with`](Harness::deliver_all_with)): a
//!   transient or permanent error, a panic or a timeout after the handler
//!   ran (its writes must roll back), a connection that dies in `COMMIT`, a
//!   database that cannot take work (the delivery is held); each belongs to
//!   its delivery, not to a copy of the same id beside it; and
//!   [`deliver_after_lost_ack`](Harness::deliver_after_lost_ack),
//!   [`deliver_concurrently`](Harness::deliver_concurrently) (N copies of one
//!   id at once: one effect). A poison body is just a message:
//!   `h.message("id", "not json")`.
//! - **The outbox**: [`Delivered::staged`] is what one delivery's
//!   transaction staged; [`outbox`](Harness::outbox) lists what committed
//!   handlers staged; [`drain`](Harness::drain) runs the relay's batches
//!   against an in-memory sink and returns the messages in publish order;
//!   [`forwarded`](Harness::forwarded) turns one into the delivery another
//!   service's harness receives (a chain of services in one test).
//! - **Isolation**: a schema per harness (created, migrated with idempo's
//!   tables, your [`setup`](HarnessBuilder::setup) SQL; dropped by
//!   [`close`](Harness::close)), 4 connections. An unreachable PostgreSQL is
//!   an [`Error::Database`](crate::Error::Database) that names its URL
//!   ([`is_unavailable`](crate::Error::is_unavailable) says so).
//! - **Contract kits** ([`conformance`]): the transport kit, which every
//!   transport must pass (a consumer on an in-memory [`MemoryBroker`]
//!   passes it too), and the store kits, which come with the stores'
//!   feature as well: `features = ["testing", "http"]` for an
//!   `IdempotencyStore`, `["testing", "window"]` for a `WindowStore`.
//!
//! Batch handlers: build with [`batch_handler`](HarnessBuilder::batch_handler);
//! [`deliver_all`](Harness::deliver_all) delivers a batch as one unit.
//!
#![doc = include_str!("recipes.md")]

mod delivered;
mod fault;
mod harness;
mod memory;
mod outbox;
mod schema;
mod transport;

pub use delivered::Delivered;
pub use fault::Fault;
pub use harness::{Harness, HarnessBuilder};
pub use memory::MemoryBroker;
pub use transport::Memory;

pub mod conformance;
