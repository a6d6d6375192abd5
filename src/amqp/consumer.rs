//! The consumer runtime: connect, declare, consume, dispatch, shut down.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::MessageIdSource;
use super::dead_letter::DeadLetterPublisher;
use super::delivery::Pipeline;
use super::handler::{self, BoxedHandler, HandlerError, Tx};
use super::message::FromMessage;
use super::stats::Stats;
use super::topology::{QueueType, Topology};
use crate::{Error, Result};

/// An exactly-once-effects consumer of one RabbitMQ queue.
///
/// Build it with [`Consumer::builder`], then [`run`](Consumer::run) it (until
/// a [`ShutdownHandle`] fires) or [`run_until_signal`](Consumer::run_until_signal)
/// (until SIGTERM or SIGINT).
///
/// # Example
/// ```no_run
/// use idempo::amqp::{Consumer, Json};
///
/// #[derive(serde::Deserialize)]
/// struct Payment { account: String, amount_cents: i64 }
///
/// # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
/// idempo::migrate(&pool).await?;
/// Consumer::builder("amqp://guest:guest@127.0.0.1:5672/%2f", pool)
///     .queue("payments")
///     .prefetch(100)
///     .concurrency(16)
///     .handler(|tx, Json(p): Json<Payment>| async move {
///         let mut tx = tx.lock()?;
///         sqlx::query("UPDATE balances SET cents = cents + $2 WHERE account = $1")
///             .bind(&p.account)
///             .bind(p.amount_cents)
///             .execute(&mut *tx)
///             .await?;
///         Ok(())
///     })
///     .run_until_signal()
///     .await?;
/// # Ok(()) }
/// ```
///
/// # Shutdown
/// When the [`ShutdownHandle`] fires (or a signal arrives), the runtime cancels
/// its broker subscription, lets the handlers in flight finish (bounded by
/// [`ConsumerBuilder::shutdown_timeout`]), commits and acks them, closes the
/// channel and the connection, and returns `Ok`. Deliveries that had not
/// started go back to the queue when the channel closes. Handlers still
/// running at the timeout (or at [`ShutdownHandle::shutdown_now`], or at a
/// second signal) are dropped: their transactions roll back and their
/// deliveries are redelivered.
pub struct Consumer {
    config: Config,
    handler: BoxedHandler,
    shutdown: ShutdownHandle,
    stats: Stats,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
struct Config {
    amqp_url: String,
    pool: PgPool,
    consumer: String,
    topology: Topology,
    declare: bool,
    prefetch: u16,
    concurrency: usize,
    message_id: MessageIdSource,
    requeue_delay: Duration,
    handler_timeout: Duration,
    shutdown_timeout: Duration,
    connection_name: Option<String>,
}

/// Stops a running [`Consumer`] from another task. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct ShutdownHandle {
    graceful: CancellationToken,
    now: CancellationToken,
}

impl ShutdownHandle {
    /// Asks the consumer to stop after the handlers in flight: see
    /// [Shutdown](Consumer#shutdown).
    pub fn shutdown(&self) {
        self.graceful.cancel();
    }

    /// Stops without waiting for the handlers in flight: their transactions
    /// roll back and their deliveries are redelivered. Nothing is lost.
    pub fn shutdown_now(&self) {
        self.graceful.cancel();
        self.now.cancel();
    }

    /// Whether shutdown was requested.
    pub fn is_shutdown(&self) -> bool {
        self.graceful.is_cancelled()
    }
}

impl Consumer {
    /// Starts configuring a consumer that connects to `amqp_url` and runs its
    /// handler in transactions on `pool`.
    ///
    /// Size the pool to at least [`concurrency`](ConsumerBuilder::concurrency)
    /// connections: each running handler holds one.
    pub fn builder(amqp_url: impl Into<String>, pool: PgPool) -> ConsumerBuilder {
        ConsumerBuilder::new(amqp_url.into(), pool)
    }

    /// A handle that stops this consumer gracefully from another task.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// The consumer's live counters.
    pub fn stats(&self) -> Stats {
        self.stats.clone()
    }

    /// The consumer name that scopes its message ids in `processed_messages`.
    pub fn name(&self) -> &str {
        &self.config.consumer
    }

    /// Runs until SIGTERM or SIGINT (or the [`ShutdownHandle`]), then shuts
    /// down gracefully and returns `Ok`. A second signal during the drain stops
    /// at once, as [`ShutdownHandle::shutdown_now`].
    ///
    /// # Errors
    /// As [`Consumer::run`].
    pub async fn run_until_signal(self) -> Result<()> {
        let handle = self.shutdown.clone();
        let signals = tokio::spawn(async move {
            let mut signals = Signals::new();
            signals.recv().await;
            tracing::info!("shutdown signal received; draining (a second signal stops at once)");
            handle.shutdown();
            signals.recv().await;
            tracing::warn!("second signal: stopping without waiting for handlers in flight");
            handle.shutdown_now();
        });
        let result = self.run().await;
        signals.abort();
        result
    }

    /// Connects, declares the topology (unless turned off), consumes and
    /// processes deliveries until the [`ShutdownHandle`] fires.
    ///
    /// # Errors
    /// - [`Error::Amqp`] when the broker is unreachable, a declaration is
    ///   refused, or the connection is lost while consuming;
    /// - [`Error::ConsumerCancelled`] when the broker cancels the subscription
    ///   (the queue was deleted);
    /// - [`Error::DeadLetterChannelLost`] when dead letters can no longer be
    ///   published.
    ///
    /// In both cases the handlers in flight are first drained as in a shutdown;
    /// nothing that was not committed is acknowledged.
    pub async fn run(self) -> Result<()> {
        let Consumer {
            config,
            handler,
            shutdown,
            stats,
        } = self;
        let mut properties = ConnectionProperties::default();
        if let Some(name) = &config.connection_name {
            properties = properties.with_connection_name(name.as_str().into());
        }
        let connection = Connection::connect(&config.amqp_url, properties).await?;
        let result = consume(&config, handler, &shutdown, stats, &connection).await;
        if let Err(e) = connection
            .close(200, "idempo consumer stopped".into())
            .await
        {
            tracing::debug!(error = %e, "closing the connection failed");
        }
        result
    }
}

async fn consume(
    config: &Config,
    handler: BoxedHandler,
    shutdown: &ShutdownHandle,
    stats: Stats,
    connection: &Connection,
) -> Result<()> {
    let channel = connection.create_channel().await?;
    if config.declare {
        config.topology.declare(&channel).await?;
    }
    let dead_letters = connection.create_channel().await?;
    dead_letters
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    channel
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            config.topology.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let tag = deliveries.tag();
    tracing::info!(
        consumer = %config.consumer,
        queue = %config.topology.queue,
        prefetch = config.prefetch,
        concurrency = config.concurrency,
        "consuming"
    );

    let broken = CancellationToken::new();
    let pipeline = Arc::new(Pipeline {
        consumer: config.consumer.clone(),
        pool: config.pool.clone(),
        handler,
        message_id: config.message_id.clone(),
        requeue_delay: config.requeue_delay,
        handler_timeout: config.handler_timeout,
        dead_letters: DeadLetterPublisher::new(
            dead_letters,
            config.topology.dead_letter_queue.clone(),
            config.consumer.clone(),
            config.topology.queue.clone(),
        ),
        broken: broken.clone(),
        stats,
    });
    let permits = Arc::new(Semaphore::new(config.concurrency));
    let mut tasks = JoinSet::new();

    let result = loop {
        while let Some(done) = tasks.try_join_next() {
            log_task_failure(done);
        }
        let next = tokio::select! {
            biased;
            () = shutdown.graceful.cancelled() => break Ok(()),
            () = broken.cancelled() => break Err(Error::DeadLetterChannelLost),
            next = deliveries.next() => next,
        };
        let delivery = match next {
            Some(Ok(delivery)) => delivery,
            Some(Err(e)) => break Err(Error::from(e)),
            None => {
                break Err(Error::ConsumerCancelled {
                    queue: config.topology.queue.clone(),
                });
            }
        };
        // Wait for a free handler slot; a delivery that never gets one is
        // left unacked and returns to the queue when the channel closes.
        let permit = tokio::select! {
            biased;
            () = shutdown.graceful.cancelled() => break Ok(()),
            () = broken.cancelled() => break Err(Error::DeadLetterChannelLost),
            permit = permits.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
        };
        let pipeline = pipeline.clone();
        tasks.spawn(async move {
            pipeline.run(delivery).await;
            drop(permit);
        });
    };

    // Stop new deliveries first, so that nothing arrives while we drain.
    if channel.status().connected()
        && let Err(e) = channel
            .basic_cancel(tag, BasicCancelOptions::default())
            .await
    {
        tracing::debug!(error = %e, "basic.cancel failed");
    }
    let drain = async {
        while let Some(done) = tasks.join_next().await {
            log_task_failure(done);
        }
    };
    let drained = tokio::select! {
        drained = tokio::time::timeout(config.shutdown_timeout, drain) => drained.is_ok(),
        () = shutdown.now.cancelled() => false,
    };
    if !drained {
        tracing::warn!(
            remaining = tasks.len(),
            "dropping handlers in flight; their transactions roll back and their deliveries will be redelivered"
        );
        tasks.shutdown().await;
    }
    // Closing the channel hands every unacked delivery back to the broker.
    if channel.status().connected() {
        let _ = channel.close(200, "idempo consumer stopped".into()).await;
    }
    tracing::info!(consumer = %config.consumer, "stopped consuming");
    result
}

/// Handler panics are caught inside the task; a failed task means a bug in
/// idempo itself. Its delivery stays unacked and is redelivered.
fn log_task_failure(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && !e.is_cancelled()
    {
        tracing::error!(error = %e, "delivery task failed");
    }
}

/// SIGTERM and SIGINT, installed once so that a second signal is seen too.
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Signals {
                term: signal(SignalKind::terminate()).expect("cannot install a SIGTERM handler"),
                int: signal(SignalKind::interrupt()).expect("cannot install a SIGINT handler"),
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Configures a [`Consumer`]. Created by [`Consumer::builder`].
///
/// # Default
/// - queue type: [`QueueType::Quorum`], declared durable, dead-lettering into `<queue>.dlq`;
/// - consumer name (the scope of message ids): the queue name;
/// - `prefetch`: 100, `concurrency`: 16;
/// - message id: the AMQP `message_id` property ([`MessageIdSource::Property`]);
/// - `requeue_delay`: 1 s; `handler_timeout`: 5 min; `shutdown_timeout`: 30 s.
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
    requeue_delay: Duration,
    handler_timeout: Duration,
    shutdown_timeout: Duration,
    connection_name: Option<String>,
    handler: Option<BoxedHandler>,
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
    fn new(amqp_url: String, pool: PgPool) -> Self {
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
            requeue_delay: Duration::from_secs(1),
            handler_timeout: Duration::from_secs(300),
            shutdown_timeout: Duration::from_secs(30),
            connection_name: None,
            handler: None,
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

    /// How long a transiently failed delivery waits before it is handed back
    /// to the broker (default: 1 s). It keeps its prefetch slot meanwhile.
    pub fn requeue_delay(mut self, delay: Duration) -> Self {
        self.requeue_delay = delay;
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

    /// The connection name shown in RabbitMQ's management UI and `rabbitmqctl`.
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
        let dead_letter_queue = self
            .dead_letter_queue
            .unwrap_or_else(|| format!("{queue}.dlq"));
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
                },
                declare: self.declare,
                prefetch: self.prefetch,
                concurrency: self.concurrency,
                message_id: self.message_id,
                requeue_delay: self.requeue_delay,
                handler_timeout: self.handler_timeout,
                shutdown_timeout: self.shutdown_timeout,
                connection_name: self.connection_name,
            },
            handler,
            shutdown: ShutdownHandle::default(),
            stats: Stats::default(),
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
