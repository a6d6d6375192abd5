//! [`ConsumerBuilder`]: every option of a [`Consumer`] and its default;
//! the mode (see [`mode`](crate::consumer::mode)) is the builder's type.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::amqp::broker::Broker;
use crate::amqp::config::Config;
use crate::amqp::consumer::Consumer;
use crate::amqp::topology::{QueueType, Topology, check_name, dead_letter_queue};
use crate::consumer::{MessageIdSource, RedeliveryPolicy};
use crate::runtime::database_gate::DatabaseGate;
use crate::runtime::forwarding::Forwarding;
use crate::runtime::handler::{EachMessage, Handler, WholeBatch};
use crate::runtime::health::Health;
use crate::runtime::message::FromMessage;
use crate::runtime::mode::{Batched, IntoDispatch, NoHandler, Parts, PerMessage};
use crate::runtime::redelivery::delay_queue;
use crate::runtime::shutdown::ShutdownHandle;
use crate::runtime::stats::Stats;
use crate::{Error, Result, Schema};

/// Configures a [`Consumer`]. Created by [`Consumer::builder`].
///
/// The type parameter is the consumer's [mode](crate::consumer::mode): a handler
/// method moves the builder from [`NoHandler`] into [`PerMessage`] or
/// [`Batched`] (or, with feature `window`, a windowed mode), and `build` /
/// `run` exist only once there is a handler.
///
/// # Default
/// - queue type: [`QueueType::Quorum`], declared durable, dead-lettering into `<queue>.dlq`;
/// - consumer name (the scope of message ids): the queue name;
/// - `prefetch`: 100, `concurrency`: 16;
/// - message id: the AMQP `message_id` property ([`MessageIdSource::Property`]);
/// - retries: [`RedeliveryPolicy::default`] (delay queues of 1 s, 5 s, 30 s,
///   2 min, 10 min; 10 attempts, then the DLQ);
/// - `handler_timeout`: 5 min; `shutdown_timeout`: 30 s;
/// - `retention` of `processed_messages` rows: 7 days, reaped every 5 min;
/// - broker: the URL (or comma-separated node URLs) given to
///   [`Consumer::builder`], tried in order, 10 s connection timeout (see
///   [`broker`](ConsumerBuilder::broker));
/// - connection name: `idempo:<consumer>:<host>:<pid>`;
/// - batch mode: batches of 100 (or the size given), `batch_linger` 5 ms;
/// - an outbox [`Relay`](crate::relay::Relay) for the pool (feature `outbox`),
///   dormant until the process uses the outbox (see [`relay`](ConsumerBuilder::relay)).
#[must_use]
pub struct ConsumerBuilder<Mode = NoHandler> {
    pub(crate) settings: Settings,
    pub(crate) mode: Mode,
}

/// The options every mode has.
pub(crate) struct Settings {
    amqp_url: String,
    broker: Option<Broker>,
    pool: PgPool,
    queue: Option<String>,
    consumer: Option<String>,
    dead_letter_queue: Option<String>,
    queue_type: QueueType,
    declare: bool,
    bindings: Vec<(String, String)>,
    prefetch: u16,
    concurrency: usize,
    message_id: MessageIdSource,
    redelivery: RedeliveryPolicy,
    pub(crate) handler_timeout: Duration,
    checked_acquire: bool,
    shutdown_timeout: Duration,
    retention: Option<Duration>,
    retention_interval: Duration,
    partitioning: Option<crate::inbox::partitioned::Partitioning>,
    connection_name: Option<String>,
    wait_for_topology: bool,
    also_declare: Vec<String>,
    relay: bool,
    schema: Schema,
    #[cfg(feature = "outbox")]
    dead_letters: crate::dead_letters::DeadLetters,
    #[cfg(feature = "outbox")]
    dead_letters_kept: Duration,
}

/// How long a batch waits for more deliveries after its first one.
const DEFAULT_LINGER: Duration = Duration::from_millis(5);

/// The batch size of [`ConsumerBuilder::batch_handler`] unless
/// [`batch`](ConsumerBuilder::batch) says otherwise.
const DEFAULT_BATCH: usize = 100;

impl<Mode: fmt::Debug> fmt::Debug for ConsumerBuilder<Mode> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("queue", &self.settings.queue)
            .field("consumer", &self.settings.consumer)
            .field("prefetch", &self.settings.prefetch)
            .field("concurrency", &self.settings.concurrency)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// Starts configuring a consumer that connects to `amqp_url` and runs its
    /// handler in transactions on `pool`.
    ///
    /// Size the pool to at least [`concurrency`](ConsumerBuilder::concurrency)
    /// connections: each running handler holds one. The outbox relay (once
    /// the handlers stage messages) takes one more for each of its batches,
    /// and opens one connection of its own for `LISTEN`.
    pub fn builder(amqp_url: impl Into<String>, pool: PgPool) -> ConsumerBuilder<NoHandler> {
        ConsumerBuilder::new(amqp_url.into(), pool)
    }
}

impl ConsumerBuilder<NoHandler> {
    pub(crate) fn new(amqp_url: String, pool: PgPool) -> Self {
        ConsumerBuilder {
            settings: Settings {
                amqp_url,
                broker: None,
                pool,
                queue: None,
                consumer: None,
                dead_letter_queue: None,
                queue_type: QueueType::default(),
                declare: true,
                bindings: Vec::new(),
                prefetch: 100,
                concurrency: 16,
                message_id: MessageIdSource::default(),
                redelivery: RedeliveryPolicy::default(),
                handler_timeout: Duration::from_secs(300),
                checked_acquire: false,
                shutdown_timeout: Duration::from_secs(30),
                retention: Some(Duration::from_secs(7 * 24 * 3600)),
                retention_interval: Duration::from_secs(300),
                partitioning: None,
                connection_name: None,
                wait_for_topology: false,
                also_declare: Vec::new(),
                relay: cfg!(feature = "outbox"),
                schema: Schema::default(),
                #[cfg(feature = "outbox")]
                dead_letters: crate::dead_letters::DeadLetters::default(),
                #[cfg(feature = "outbox")]
                dead_letters_kept: Duration::from_secs(30 * 24 * 3600),
            },
            mode: NoHandler(()),
        }
    }

    /// Per-message mode with this handler (see [`Handler`]): a closure or
    /// async fn `(Tx, M) -> impl Future<Output = Result<(), HandlerError>>`
    /// where `M` is [`JsonBody<T>`](super::JsonBody), [`Message`](super::Message)
    /// or another [`FromMessage`] type. It runs in the transaction that
    /// claimed the message id; it must not commit or roll back (the runtime
    /// commits after `Ok`, then acks). State goes into the closure (a pool, a
    /// client, ...); it is shared by every delivery, not copied.
    ///
    /// [`HandlerError`]: super::HandlerError
    pub fn handler<M, H>(self, handler: H) -> ConsumerBuilder<PerMessage>
    where
        M: FromMessage,
        H: Handler<M>,
    {
        self.into_mode(PerMessage {
            handler: std::sync::Arc::new(EachMessage::new(handler)),
            groups: None,
        })
    }

    /// Batch mode with a handler for a whole batch: a [`Handler`] of
    /// `Vec<M>`, called once per batch with the fresh (not yet processed)
    /// messages, in delivery order. Batches of 100 unless
    /// [`batch`](ConsumerBuilder::batch) says otherwise. When it fails, the
    /// batch rolls back and each delivery is handled on its own (the handler
    /// is called with a batch of one), so only the failing message takes the
    /// failure path.
    ///
    /// # Example
    /// ```no_run
    /// # use idempo::Tx;
    /// # use idempo::amqp::Consumer, idempo::consumer::{JsonBody, Message};
    /// # #[derive(serde::Deserialize)] struct Payment { account: String, amount_cents: i64 }
    /// # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
    /// Consumer::builder("amqp://127.0.0.1", pool)
    ///     .queue("payments")
    ///     .prefetch(1500)
    ///     .batch_handler(|tx: Tx, batch: Vec<(JsonBody<Payment>, Message)>| async move {
    ///         let ids: Vec<&str> = batch.iter().map(|(_, m)| m.id()).collect();
    ///         let accounts: Vec<&str> = batch.iter().map(|(p, _)| p.0.account.as_str()).collect();
    ///         let amounts: Vec<i64> = batch.iter().map(|(p, _)| p.0.amount_cents).collect();
    ///         let mut tx = tx.try_lock()?;
    ///         sqlx::query("INSERT INTO payments (message_id, account, amount_cents) \
    ///                      SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])")
    ///             .bind(&ids).bind(&accounts).bind(&amounts)
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         Ok(())
    ///     })
    ///     .batch(500)
    ///     .run_until_signal()
    ///     .await
    /// # }
    /// ```
    pub fn batch_handler<M, H>(self, handler: H) -> ConsumerBuilder<Batched>
    where
        M: FromMessage,
        H: Handler<Vec<M>>,
    {
        self.into_mode(Batched {
            handler: std::sync::Arc::new(WholeBatch::new(handler)),
            size: DEFAULT_BATCH,
            linger: DEFAULT_LINGER,
        })
    }
}

impl ConsumerBuilder<PerMessage> {
    /// Turns on message groups (SQS FIFO's `MessageGroupId`): deliveries
    /// whose header `x-group-id` holds the same value are processed one at a
    /// time, in the order they arrived; different groups (and deliveries
    /// without the header) run in parallel up to [`concurrency`](Self::concurrency).
    ///
    /// A delivery that fails is retried through a delay queue and so leaves
    /// its place in the group (the group does not block behind it, unlike
    /// SQS). A delivery takes a concurrency slot only once its predecessor is
    /// done, so a busy group cannot starve the others. If a predecessor is
    /// abandoned (shutdown, a lost channel), the rest of its group is left
    /// unacked too and comes back in order with the redelivery.
    pub fn message_groups(self) -> Self {
        self.message_groups_by("x-group-id")
    }

    /// [`message_groups`](Self::message_groups) with the group id in another
    /// header.
    pub fn message_groups_by(mut self, header: impl Into<String>) -> Self {
        self.mode.groups = Some(header.into());
        self
    }

    /// Batch mode with this per-message handler: batches of up to `size`
    /// deliveries share one transaction, and the handler runs over each fresh
    /// message of a batch in turn (see the [batch mode](super#batch-mode)
    /// docs). A [`batch_handler`](ConsumerBuilder::batch_handler) gets them
    /// all at once, which is where bulk statements pay off. Set `prefetch` to
    /// about three times the batch size: two batches in flight hold their
    /// deliveries unacked while the next one is collected.
    pub fn batch(self, size: usize) -> ConsumerBuilder<Batched> {
        let handler = self.mode.handler.clone();
        self.into_mode(Batched {
            handler,
            size,
            linger: DEFAULT_LINGER,
        })
    }
}

impl ConsumerBuilder<Batched> {
    /// Batches of up to `size` deliveries (default: 100). Set `prefetch` to
    /// about three times the batch size.
    pub fn batch(mut self, size: usize) -> Self {
        self.mode.size = size;
        self
    }

    /// How long a batch waits for more deliveries after its first one
    /// (default: 5 ms).
    pub fn batch_linger(mut self, linger: Duration) -> Self {
        self.mode.linger = linger;
        self
    }
}

impl<Mode> ConsumerBuilder<Mode> {
    /// Where dead letters go (feature `outbox`): the RabbitMQ queue
    /// `<queue>.dlq` ([`DeadLetters::Queue`](crate::consumer::DeadLetters::Queue), the
    /// default), or the `dead_letters` table
    /// ([`DeadLetters::Table`](crate::consumer::DeadLetters::Table)): queryable,
    /// grouped by cause, replayed exactly once through the outbox (see
    /// `idempo::ops::dead_letters`). With the table, each dead
    /// letter is inserted in a transaction of its own and acked only after
    /// that commit; while PostgreSQL cannot take it, the delivery waits
    /// (unacked). A letter the table refuses for another reason goes to the
    /// queue instead, so that nothing is lost.
    #[cfg(feature = "outbox")]
    #[cfg_attr(docsrs, doc(cfg(feature = "outbox")))]
    pub fn dead_letters(mut self, store: crate::dead_letters::DeadLetters) -> Self {
        self.settings.dead_letters = store;
        self
    }

    /// How long the table store keeps replayed and discarded dead letters
    /// (for audit) before the retention reaper deletes them: 30 days by
    /// default. Live letters are never reaped.
    #[cfg(feature = "outbox")]
    #[cfg_attr(docsrs, doc(cfg(feature = "outbox")))]
    pub fn dead_letter_retention(mut self, keep: Duration) -> Self {
        self.settings.dead_letters_kept = keep;
        self
    }

    /// The same configuration on another pool (the test harness's own schema).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) fn with_pool(mut self, pool: PgPool) -> Self {
        self.settings.pool = pool;
        self
    }

    pub(crate) fn into_mode<Next>(self, mode: Next) -> ConsumerBuilder<Next> {
        ConsumerBuilder {
            settings: self.settings,
            mode,
        }
    }

    /// The queue to consume (required). Unless [`declare`](Self::declare) is
    /// turned off, it is declared durable, dead-lettering into `<queue>.dlq`.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.settings.queue = Some(queue.into());
        self
    }

    /// The name that scopes message ids in `processed_messages` (default: the
    /// queue name). Two consumers of one message (fan-out) must have different
    /// names to each process it once; replicas of one consumer share a name.
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.settings.consumer = Some(name.into());
        self
    }

    /// The dead-letter queue (default: `<queue>.dlq`).
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.settings.dead_letter_queue = Some(queue.into());
        self
    }

    /// The type of the queues the runtime declares (default: quorum).
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.settings.queue_type = queue_type;
        self
    }

    /// Whether to declare the queues (default: `true`). Turn it off when the
    /// topology is managed elsewhere; the dead-letter queue must then exist.
    pub fn declare(mut self, declare: bool) -> Self {
        self.settings.declare = declare;
        self
    }

    /// Binds the queue to an existing exchange with a routing key, at start.
    pub fn bind(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.settings
            .bindings
            .push((exchange.into(), routing_key.into()));
        self
    }

    /// How many unacknowledged deliveries the broker may send ahead (default: 100).
    /// Must be at least [`concurrency`](Self::concurrency).
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.settings.prefetch = prefetch;
        self
    }

    /// How many handlers run at once (default: 16). Each holds a database
    /// connection from the pool while it runs.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.settings.concurrency = concurrency;
        self
    }

    /// Where the message id comes from (default: the AMQP `message_id` property).
    pub fn message_id(mut self, source: MessageIdSource) -> Self {
        self.settings.message_id = source;
        self
    }

    /// How a delivery that failed transiently is delivered again (default:
    /// [`RedeliveryPolicy::default`]). *Redelivery* is the consumer's word
    /// for it; *retry* is the outgoing side's (`idempo::retry`).
    pub fn redelivery(mut self, policy: RedeliveryPolicy) -> Self {
        self.settings.redelivery = policy;
        self
    }

    /// How long `processed_messages` rows of this consumer are kept (default:
    /// 7 days). A redelivery that arrives after its row was deleted is
    /// processed again, so keep rows longer than a message can take to come
    /// back: the retry schedule plus the broker's `consumer_timeout` (a
    /// warning is logged at start otherwise).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.settings.retention = Some(retention);
        self
    }

    /// Keep `processed_messages` rows forever (or delete them yourself, e.g.
    /// with [`Inbox::delete_processed_before`](crate::inbox::Inbox::delete_processed_before)).
    pub fn without_retention(mut self) -> Self {
        self.settings.retention = None;
        self
    }

    /// Claim in the partitioned `processed_messages`
    /// ([`inbox::partitioned`](crate::inbox::partitioned)) instead of the
    /// plain table: retention by `DETACH`/`DROP PARTITION` instead of
    /// `DELETE`, at the price of a probe per partition in each claim. The
    /// database must have been switched (`idempo partitions switch`); the
    /// consumer refuses to start otherwise. The retention reaper then
    /// maintains the partitions (one instance at a time), every
    /// [`retention_interval`](Self::retention_interval) and at least once a
    /// period.
    ///
    /// # Default
    /// The plain table.
    pub fn partitioned(mut self, partitioning: crate::inbox::partitioned::Partitioning) -> Self {
        self.settings.partitioning = Some(partitioning);
        self
    }

    /// How often the retention reaper runs (default: 5 min).
    pub fn retention_interval(mut self, interval: Duration) -> Self {
        self.settings.retention_interval = interval;
        self
    }

    /// Whether each unit's connection goes through the pool's acquire-time
    /// checks: sqlx's ping (`test_before_acquire`) and the pool's
    /// `before_acquire` hook (default: no). Without them the consumer takes
    /// an idle connection as it is (`Pool::try_begin`), a round trip less per
    /// message; one that died while idle only fails its `BEGIN`, which wrote
    /// nothing, and the unit begins again through the checked path. Turn
    /// them on when the pool's `before_acquire` hook must run for the
    /// consumer's connections.
    pub fn checked_acquire(mut self, checked: bool) -> Self {
        self.settings.checked_acquire = checked;
        self
    }

    /// How long one handler may run (default: 5 min). A handler that takes
    /// longer is dropped, its transaction rolls back, and the delivery is
    /// retried: a hung call must not hold a connection and the claim's row
    /// lock forever. Keep it below the broker's `consumer_timeout` (30 min by
    /// default), after which RabbitMQ closes the channel.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.settings.handler_timeout = timeout;
        self
    }

    /// How long a shutdown waits for handlers in flight (default: 30 s).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.settings.shutdown_timeout = timeout;
        self
    }

    /// The broker in full: several nodes, TLS settings, timeouts (see
    /// [`Broker`]). Replaces the URL given to [`Consumer::builder`], which
    /// may itself be a comma-separated list of node URLs.
    pub fn broker(mut self, broker: Broker) -> Self {
        self.settings.broker = Some(broker);
        self
    }

    /// Keep retrying (with backoff, reported in [`Health`]) when a queue
    /// exists with other arguments than the runtime declares, for a
    /// deployment in which someone else fixes the topology. By default that
    /// is a configuration error: [`Consumer::run`] returns
    /// [`AmqpError::TopologyConflict`](crate::amqp::AmqpError::TopologyConflict).
    pub fn wait_for_topology(mut self, wait: bool) -> Self {
        self.settings.wait_for_topology = wait;
        self
    }

    /// Also declares `queue` as the work queue is declared (same type,
    /// dead-lettering into `<queue>.dlq`), e.g. the queue this consumer's
    /// handler emits to through the outbox, so that the consumer downstream
    /// finds it with the arguments it declares itself. Without its delay
    /// queues: the consumer of `queue` declares those for its own retry policy.
    pub fn declare_like_own(mut self, queue: impl Into<String>) -> Self {
        self.settings.also_declare.push(queue.into());
        self
    }

    /// Whether the consumer runs an outbox [`Relay`](crate::relay::Relay) for
    /// its pool (default: `true` with feature `outbox`). It stays dormant,
    /// without a broker connection, until the process stages a message or
    /// finds pending rows. Turn it off when a separate relay process serves
    /// the database.
    pub fn relay(mut self, relay: bool) -> Self {
        self.settings.relay = relay;
        self
    }

    /// What the consumer does with idempo's schema at start (default
    /// [`Schema::Unchecked`]: the application migrates). [`Schema::Migrate`]
    /// applies the migrations (DDL only when some are missing);
    /// [`Schema::Check`] refuses to start with
    /// [`Error::SchemaBehind`](crate::Error::SchemaBehind) when they are not
    /// all applied, and runs no DDL, for a role without `CREATE`. While the
    /// database is unreachable at start, the consumer waits for it.
    pub fn schema(mut self, schema: Schema) -> Self {
        self.settings.schema = schema;
        self
    }

    /// The connection name shown in RabbitMQ's management UI and `rabbitmqctl`
    /// (default: `idempo:<consumer>:<pid>`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.settings.connection_name = Some(name.into());
        self
    }
}

/// `build`, `run` and `run_until_signal`, for each mode that has a handler.
macro_rules! runnable {
    ($mode:ty) => {
        impl $crate::amqp::ConsumerBuilder<$mode> {
            /// Checks the configuration and builds the consumer.
            ///
            /// # Errors
            /// [`Error::Config`](crate::Error::Config) when the queue is
            /// missing, `concurrency` is 0, `prefetch` is below `concurrency`
            /// (or, in batch mode, below the batch size), the consumer name
            /// is empty, or the retry policy or retention is impossible.
            pub fn build(self) -> $crate::Result<$crate::amqp::Consumer> {
                $crate::amqp::builder::finish(self)
            }

            /// Builds and [runs](crate::amqp::Consumer::run) the consumer.
            ///
            /// # Errors
            /// As [`build`](Self::build) and [`Consumer::run`](crate::amqp::Consumer::run).
            pub async fn run(self) -> $crate::Result<()> {
                self.build()?.run().await
            }

            /// Builds and [runs until a signal](crate::amqp::Consumer::run_until_signal).
            ///
            /// # Errors
            /// As [`build`](Self::build) and [`Consumer::run`](crate::amqp::Consumer::run).
            pub async fn run_until_signal(self) -> $crate::Result<()> {
                self.build()?.run_until_signal().await
            }
        }
    };
}
#[cfg(feature = "window")]
pub(crate) use runnable;

runnable!(PerMessage);
runnable!(Batched);

/// The builder's checks, without a broker or a database (the pool is lazy).
mod finish;
#[cfg(test)]
mod tests;

pub(crate) use finish::finish;
