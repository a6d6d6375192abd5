//! RabbitMQ, on lapin (feature `amqp`): the consumer's transport
//! ([`Amqp`]), its options (the methods of [`ConsumerBuilder`]), the broker's
//! addresses and TLS ([`Broker`]), and the topology idempo declares.
//!
//! A [`Consumer`] is the runtime's [`consumer::Consumer`](crate::consumer::Consumer)
//! on RabbitMQ: each delivery is claimed, handled and committed in one
//! PostgreSQL transaction, then acknowledged (see [`crate::consumer`] for
//! the guarantee and what happens on each failure). What RabbitMQ adds:
//!
//! | what happens | on RabbitMQ |
//! |---|---|
//! | processed, or a duplicate | `basic.ack` (batch mode: one multiple ack) |
//! | transient failure | a confirmed copy to the delay queue `<queue>.retry.<delay>`, whose TTL dead-letters it back into the queue, then ack |
//! | last attempt failed, or poison | a confirmed copy to `<queue>.dlq` with `x-idempo-reason` (or a row of the `dead_letters` table), then ack |
//! | a copy the broker will not take | the original is nacked and comes back after a pause |
//! | properties the client cannot parse | moved to the DLQ by a client of idempo's own (the quarantine) |
//! | connection or channel lost, consumer cancelled | reconnect with backoff to the next node, declare again |
//!
//! ```no_run
//! use idempo::Tx;
//! use idempo::amqp::Consumer;
//! use idempo::consumer::JsonBody;
//!
//! #[derive(serde::Deserialize)]
//! struct Payment { account: String, amount_cents: i64 }
//!
//! # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
//! idempo::migrate(&pool).await?;
//! Consumer::builder("amqp://guest:guest@127.0.0.1:5672/%2f", pool)
//!     .queue("payments")
//!     .prefetch(100)
//!     .concurrency(16)
//!     .handler(|tx: Tx, JsonBody(p): JsonBody<Payment>| async move {
//!         let mut tx = tx.try_lock()?;
//!         sqlx::query("UPDATE balances SET cents = cents + $2 WHERE account = $1")
//!             .bind(&p.account)
//!             .bind(p.amount_cents)
//!             .execute(&mut *tx)
//!             .await?;
//!         Ok(())
//!     })
//!     .run_until_signal()
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! [`Consumer::run`](crate::consumer::Consumer::run) returns
//! [`AmqpError::TopologyConflict`] when a queue exists with other arguments
//! than the runtime declares (unless
//! [`wait_for_topology`](ConsumerBuilder::wait_for_topology)), [`Error::Tls`](crate::Error::Tls)
//! when every node refuses the TLS handshake at start,
//! [`AmqpError::BrokerRefused`] when, before any connection worked, every
//! node refuses the credentials, the vhost or the scheme, and
//! [`AmqpError::AccessRefused`] when, before consuming ever worked, the
//! broker refuses to declare or consume. After a good start the same
//! refusals are retried with backoff, reported in the consumer's health and
//! counted in `idempo_broker_refusals_total`.
//!
//! See <https://www.rabbitmq.com/docs/confirms> for RabbitMQ's acknowledgement semantics.

/// The transport's name in the outbox, the dead-letter table and the
/// heartbeats.
pub(crate) const TRANSPORT: &str = <Amqp as crate::runtime::transport::Transport>::NAME;

mod acks;
pub(crate) mod broker;
mod builder;
pub(crate) mod copy;
mod delivery;
mod error;
mod feed;
pub(crate) mod fields;
pub(crate) mod fit;
mod message;
mod options;
pub(crate) mod publish;
mod quarantine;
pub(crate) mod reconnect;
#[cfg(feature = "outbox")]
pub(crate) mod relay;
pub(crate) mod republish;
mod session;
pub(crate) mod stored;
pub(crate) mod telemetry;
pub(crate) mod topology;
mod transport;
pub(crate) mod urls;
#[cfg(feature = "window")]
#[cfg_attr(docsrs, doc(cfg(feature = "window")))]
pub mod window;

#[cfg(feature = "ops")]
pub(crate) use crate::runtime::seal::consumers_with_keys;
pub use broker::Broker;
pub use transport::Amqp;

/// A consumer of a RabbitMQ queue: the runtime's consumer on [`Amqp`].
pub type Consumer = crate::runtime::consumer::Consumer<Amqp>;

/// The outbox relay to RabbitMQ (feature `outbox`): the relay on [`Amqp`].
#[cfg(feature = "outbox")]
#[cfg_attr(docsrs, doc(cfg(feature = "outbox")))]
pub type Relay = crate::relay::Relay<Amqp>;

/// Configures a RabbitMQ [`Consumer`]: the runtime's builder on [`Amqp`],
/// with the options of every transport and RabbitMQ's own (`queue`,
/// `queue_type`, `declare`, `bind`, `broker`, ...).
///
/// # RabbitMQ's defaults
/// - queue type: [`QueueType::Quorum`], declared durable, dead-lettering into `<queue>.dlq`;
/// - broker: the URL (or comma-separated node URLs) given to
///   [`Consumer::builder`], tried in order, 10 s connection timeout (see
///   [`broker`](crate::consumer::ConsumerBuilder::broker));
/// - connection name: `idempo:<consumer>:<host>:<pid>`.
pub type ConsumerBuilder<Mode = crate::runtime::mode::NoHandler> =
    crate::runtime::builder::ConsumerBuilder<Amqp, Mode>;
pub use error::{AmqpError, NodeFailure};
pub use message::AmqpDelivery;
pub use publish::PublishError;
pub use topology::QueueType;

pub use lapin;
