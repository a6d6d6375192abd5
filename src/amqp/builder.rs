//! [`ConsumerBuilder`]: every option of a [`Consumer`], checked once in `build`.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;

use super::batch::{BoxedBatchHandler, boxed_batch, per_message};
use super::consumer::{BatchMode, Config, Consumer, ShutdownHandle};
use super::handler::{self, BoxedHandler, HandlerError};
use super::health::Health;
use super::message::FromMessage;
use super::stats::Stats;
use super::topology::{QueueType, Topology};
use super::{MessageIdSource, RetryPolicy};
use crate::Tx;
use crate::{Error, Result};

/// Configures a [`Consumer`]. Created by [`Consumer::builder`].
///
/// # Default
/// - queue type: [`QueueType::Quorum`], declared durable, dead-lettering into `<queue>.dlq`;
/// - consumer name (the scope of message ids): the queue name;
/// - `prefetch`: 100, `concurrency`: 16;
/// - message id: the AMQP `message_id` property ([`MessageIdSource::Property`]);
/// - retries: [`RetryPolicy::default`] (delay queues of 1 s, 5 s, 30 s, 2 min,
///   10 min; 10 attempts, then the DLQ);
/// - `handler_timeout`: 5 min; `shutdown_timeout`: 30 s;
/// - `retention` of `processed_messages` rows: 7 days, reaped every 5 min;
/// - connection name: `idempo:<consumer>:<pid>`.
#[must_use]
pub struct ConsumerBuilder {
    amqp_url: String,
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
    retry: RetryPolicy,
    handler_timeout: Duration,
    shutdown_timeout: Duration,
    retention: Option<Duration>,
    retention_interval: Duration,
    connection_name: Option<String>,
    handler: Option<BoxedHandler>,
    batch_size: Option<usize>,
    batch_linger: Duration,
    group_header: Option<String>,
    #[cfg(feature = "window")]
    window: Option<std::sync::Arc<dyn crate::window::ErasedWindow>>,
    windowed_handler: bool,
    batch_handler: Option<BoxedBatchHandler>,
}

impl fmt::Debug for ConsumerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("queue", &self.queue)
            .field("consumer", &self.consumer)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl ConsumerBuilder {
    pub(crate) fn new(amqp_url: String, pool: PgPool) -> Self {
        ConsumerBuilder {
            amqp_url,
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
            retry: RetryPolicy::default(),
            handler_timeout: Duration::from_secs(300),
            shutdown_timeout: Duration::from_secs(30),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            retention_interval: Duration::from_secs(300),
            connection_name: None,
            handler: None,
            batch_size: None,
            batch_linger: Duration::from_millis(5),
            group_header: None,
            #[cfg(feature = "window")]
            window: None,
            windowed_handler: false,
            batch_handler: None,
        }
    }

    /// The queue to consume (required). Unless [`declare`](Self::declare) is
    /// turned off, it is declared durable, dead-lettering into `<queue>.dlq`.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// The name that scopes message ids in `processed_messages` (default: the
    /// queue name). Two consumers of one message (fan-out) must have different
    /// names to each process it once; replicas of one consumer share a name.
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.consumer = Some(name.into());
        self
    }

    /// The dead-letter queue (default: `<queue>.dlq`).
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter_queue = Some(queue.into());
        self
    }

    /// The type of the queues the runtime declares (default: quorum).
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Whether to declare the queues (default: `true`). Turn it off when the
    /// topology is managed elsewhere; the dead-letter queue must then exist.
    pub fn declare(mut self, declare: bool) -> Self {
        self.declare = declare;
        self
    }

    /// Binds the queue to an existing exchange with a routing key, at start.
    pub fn bind(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.bindings.push((exchange.into(), routing_key.into()));
        self
    }

    /// How many unacknowledged deliveries the broker may send ahead (default: 100).
    /// Must be at least [`concurrency`](Self::concurrency).
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// How many handlers run at once (default: 16). Each holds a database
    /// connection from the pool while it runs.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Where the message id comes from (default: the AMQP `message_id` property).
    pub fn message_id(mut self, source: MessageIdSource) -> Self {
        self.message_id = source;
        self
    }

    /// How transient failures are retried (default: [`RetryPolicy::default`]).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How long `processed_messages` rows of this consumer are kept (default:
    /// 7 days). A redelivery that arrives after its row was deleted is
    /// processed again, so keep rows longer than a message can take to come
    /// back: the retry schedule plus the broker's `consumer_timeout` (a
    /// warning is logged at start otherwise).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Keep `processed_messages` rows forever (or delete them yourself, e.g.
    /// with [`inbox::delete_processed_before`](crate::inbox::delete_processed_before)).
    pub fn without_retention(mut self) -> Self {
        self.retention = None;
        self
    }

    /// How often the retention reaper runs (default: 5 min).
    pub fn retention_interval(mut self, interval: Duration) -> Self {
        self.retention_interval = interval;
        self
    }

    /// How long one handler may run (default: 5 min). A handler that takes
    /// longer is dropped, its transaction rolls back, and the delivery is
    /// retried: a hung call must not hold a connection and the claim's row
    /// lock forever. Keep it below the broker's `consumer_timeout` (30 min by
    /// default), after which RabbitMQ closes the channel.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// How long a shutdown waits for handlers in flight (default: 30 s).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// The connection name shown in RabbitMQ's management UI and `rabbitmqctl`
    /// (default: `idempo:<consumer>:<pid>`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// The handler (required): a closure or async fn
    /// `(Tx, M) -> impl Future<Output = Result<(), HandlerError>>` where `M` is
    /// [`Json<T>`](super::Json), [`Message`](super::Message) or another
    /// [`FromMessage`] type. It runs in the transaction that claimed the
    /// message id; it must not commit or roll back (the runtime commits after
    /// `Ok`, then acks). State goes into the closure (an `Arc`, a pool, ...).
    pub fn handler<M, F, Fut>(mut self, handler: F) -> Self
    where
        M: FromMessage,
        F: Fn(Tx, M) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        self.handler = Some(handler::boxed(handler));
        self.windowed_handler = false;
        self
    }

    /// Deduplicates with a [`DedupWindow`](crate::window::DedupWindow) instead
    /// of the PostgreSQL inbox (feature `window`), for handlers that touch no
    /// database; set the handler with [`window_handler`](Self::window_handler).
    ///
    /// The guarantee is weaker, and only this: a copy of a message id that
    /// arrives **within the window** after the first copy was processed is
    /// acked without running the handler. The id is reserved while the
    /// handler runs (a concurrent copy waits) and recorded after it
    /// succeeded, so a failed attempt does not hide its retry; but recording
    /// is not transactional with the handler's effects (a crash between the
    /// two runs the redelivery again), and copies after the window pass.
    /// Message groups scope ids per group. The body's hash is recorded with
    /// the id, so an id reused with another body is dead-lettered, as with
    /// the inbox. A store that fails is a transient failure: the delivery is
    /// retried through the delay queues and uses an attempt (unlike a
    /// database outage with the inbox, which waits at the gate).
    #[cfg(feature = "window")]
    #[cfg_attr(docsrs, doc(cfg(feature = "window")))]
    pub fn dedup_window<S>(mut self, window: crate::window::DedupWindow<S>) -> Self
    where
        S: crate::window::WindowStore + fmt::Debug,
    {
        self.window = Some(std::sync::Arc::new(window));
        self
    }

    /// The handler of a consumer with a [`dedup_window`](Self::dedup_window):
    /// `(M) -> impl Future<Output = Result<(), HandlerError>>`, with no
    /// transaction. Errors, retries and dead letters work as with
    /// [`handler`](Self::handler).
    pub fn window_handler<M, F, Fut>(mut self, handler: F) -> Self
    where
        M: FromMessage,
        F: Fn(M) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        self.handler = Some(handler::boxed(move |_tx: Tx, message: M| handler(message)));
        self.windowed_handler = true;
        self
    }

    /// Turns on batch mode with batches of up to `size` deliveries (see the
    /// [batch mode](super#batch-mode) docs). With a per-message
    /// [`handler`](Self::handler), it runs over each fresh message of a batch
    /// in one transaction; with a [`batch_handler`](Self::batch_handler), it
    /// gets them all at once, which is where bulk statements pay off.
    /// Set `prefetch` to about three times the batch size: two batches in
    /// flight hold their deliveries unacked while the next one is collected.
    pub fn batch(mut self, size: usize) -> Self {
        self.batch_size = Some(size);
        self
    }

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
    /// unacked too and comes back in order with the redelivery. Not
    /// available with [`batch`](Self::batch).
    pub fn message_groups(self) -> Self {
        self.message_groups_by("x-group-id")
    }

    /// [`message_groups`](Self::message_groups) with the group id in another
    /// header.
    pub fn message_groups_by(mut self, header: impl Into<String>) -> Self {
        self.group_header = Some(header.into());
        self
    }

    /// How long a batch waits for more deliveries after its first one
    /// (default: 5 ms).
    pub fn batch_linger(mut self, linger: Duration) -> Self {
        self.batch_linger = linger;
        self
    }

    /// A handler for a whole batch: `(Tx, Vec<M>) -> Result<(), HandlerError>`,
    /// called once per batch with the fresh (not yet processed) messages, in
    /// delivery order. Turns on batch mode (batches of 100 unless
    /// [`batch`](Self::batch) says otherwise). When it fails, the batch rolls
    /// back and each delivery is handled on its own (the handler is called with
    /// a batch of one), so only the failing message takes the failure path.
    ///
    /// # Example
    /// ```no_run
    /// # use idempo::amqp::{Consumer, Json, Message};
    /// # #[derive(serde::Deserialize)] struct Payment { account: String, amount_cents: i64 }
    /// # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
    /// Consumer::builder("amqp://127.0.0.1", pool)
    ///     .queue("payments")
    ///     .prefetch(1500)
    ///     .batch(500)
    ///     .batch_handler(|tx, batch: Vec<(Json<Payment>, Message)>| async move {
    ///         let ids: Vec<&str> = batch.iter().map(|(_, m)| m.id()).collect();
    ///         let accounts: Vec<&str> = batch.iter().map(|(p, _)| p.0.account.as_str()).collect();
    ///         let amounts: Vec<i64> = batch.iter().map(|(p, _)| p.0.amount_cents).collect();
    ///         let mut tx = tx.lock()?;
    ///         sqlx::query("INSERT INTO payments (message_id, account, amount_cents) \
    ///                      SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])")
    ///             .bind(&ids).bind(&accounts).bind(&amounts)
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         Ok(())
    ///     })
    ///     .run_until_signal()
    ///     .await
    /// # }
    /// ```
    pub fn batch_handler<M, F, Fut>(mut self, handler: F) -> Self
    where
        M: FromMessage,
        F: Fn(Tx, Vec<M>) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        let (batch, one) = boxed_batch(handler);
        self.batch_handler = Some(batch);
        self.handler = Some(one);
        self.batch_size.get_or_insert(100);
        self
    }

    /// Checks the configuration and builds the consumer.
    ///
    /// # Errors
    /// [`Error::Config`] when the queue or handler is missing, `concurrency`
    /// is 0, or `prefetch` is below `concurrency`.
    pub fn build(self) -> Result<Consumer> {
        let queue = self
            .queue
            .ok_or_else(|| Error::Config("a queue is required: call .queue(name)".into()))?;
        let handler = self
            .handler
            .ok_or_else(|| Error::Config("a handler is required: call .handler(f)".into()))?;
        if self.concurrency == 0 {
            return Err(Error::Config("concurrency must be at least 1".into()));
        }
        if usize::from(self.prefetch) < self.concurrency {
            return Err(Error::Config(format!(
                "prefetch ({}) must be at least concurrency ({}): handlers beyond the prefetch would never get a delivery",
                self.prefetch, self.concurrency
            )));
        }
        let consumer = self.consumer.unwrap_or_else(|| queue.clone());
        if consumer.is_empty() {
            return Err(Error::Config("the consumer name must not be empty".into()));
        }
        self.retry.validate().map_err(Error::Config)?;
        if self.retention.is_some_and(|r| r.is_zero()) || self.retention_interval.is_zero() {
            return Err(Error::Config(
                "retention and retention_interval must be positive".into(),
            ));
        }
        let dead_letter_queue = self
            .dead_letter_queue
            .unwrap_or_else(|| format!("{queue}.dlq"));
        let connection_name = self
            .connection_name
            .unwrap_or_else(|| format!("idempo:{consumer}:{}", std::process::id()));
        let stats = Stats::new(&consumer);
        #[cfg(feature = "window")]
        let window = self.window;
        #[cfg(not(feature = "window"))]
        let window: Option<()> = None;
        match (window.is_some(), self.windowed_handler) {
            (true, false) => {
                return Err(Error::Config(
                    "a consumer with a dedup window needs .window_handler(..): its handler gets no transaction".into(),
                ));
            }
            (false, true) => {
                return Err(Error::Config(
                    ".window_handler(..) needs .dedup_window(..) (feature `window`)".into(),
                ));
            }
            _ => {}
        }
        if window.is_some() && self.batch_size.is_some() {
            return Err(Error::Config(
                "a dedup window needs per-message mode: drop .batch(..)".into(),
            ));
        }
        if self.batch_size.is_some() && self.group_header.is_some() {
            return Err(Error::Config(
                "message groups need per-message mode: drop .batch(..) or .message_groups()".into(),
            ));
        }
        let batch = match self.batch_size {
            None => None,
            Some(0) => return Err(Error::Config("the batch size must be at least 1".into())),
            Some(size) if usize::from(self.prefetch) < size => {
                return Err(Error::Config(format!(
                    "prefetch ({}) must be at least the batch size ({size}); twice is better",
                    self.prefetch
                )));
            }
            Some(size) => Some(BatchMode {
                size,
                linger: self.batch_linger,
                handler: self
                    .batch_handler
                    .unwrap_or_else(|| per_message(handler.clone())),
            }),
        };
        Ok(Consumer {
            config: Config {
                amqp_url: self.amqp_url,
                pool: self.pool,
                consumer,
                topology: Topology {
                    queue,
                    dead_letter_queue,
                    queue_type: self.queue_type,
                    bindings: self.bindings,
                    retry_delays: self.retry.delays().to_vec(),
                },
                declare: self.declare,
                prefetch: self.prefetch,
                concurrency: self.concurrency,
                message_id: self.message_id,
                retry: self.retry,
                handler_timeout: self.handler_timeout,
                shutdown_timeout: self.shutdown_timeout,
                retention: self.retention,
                retention_interval: self.retention_interval,
                connection_name,
                batch,
                group_header: self.group_header,
                #[cfg(feature = "window")]
                window,
            },
            handler,
            shutdown: ShutdownHandle::default(),
            stats,
            health: Health::default(),
        })
    }

    /// Builds and [runs](Consumer::run) the consumer.
    ///
    /// # Errors
    /// As [`build`](Self::build) and [`Consumer::run`].
    pub async fn run(self) -> Result<()> {
        self.build()?.run().await
    }

    /// Builds and [runs until a signal](Consumer::run_until_signal).
    ///
    /// # Errors
    /// As [`build`](Self::build) and [`Consumer::run`].
    pub async fn run_until_signal(self) -> Result<()> {
        self.build()?.run_until_signal().await
    }
}
