//! The consumer runtime: connect, declare, consume, dispatch, reconnect, shut down.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use std::panic::AssertUnwindSafe;

use futures::future::Shared;
use futures::{FutureExt, StreamExt};
use lapin::Connection;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio::sync::oneshot;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::MessageIdSource;
use super::acks::AckTracker;
use super::broker::Broker;
use super::builder::ConsumerBuilder;
use super::delivery::{Pipeline, Settled};
use super::health::{Health, RuntimeState};
use super::mode::{Dispatch, NoHandler};
use super::quarantine;
use super::redelivery::RedeliveryPolicy;
use super::republish::Republisher;
use super::retention;
use super::seal::Keyring;
use super::stats::{Counter, Stats};
use super::topology::Topology;
use crate::backoff::Backoff;
use crate::{Error, Result};

/// Batches processed at once in batch mode (each on its own connection).
const BATCHES_IN_FLIGHT: usize = 2;

/// How many confirm-mode channels publish retries and dead letters side by side.
const REPUBLISH_CHANNELS: usize = 4;

/// RabbitMQ's default `consumer_timeout`: an unacked delivery older than this
/// makes the broker close the channel, and the message is redelivered.
const BROKER_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// An exactly-once-effects consumer of one RabbitMQ queue.
///
/// Build it with [`Consumer::builder`], then [`run`](Consumer::run) it (until
/// a [`ShutdownHandle`] fires) or [`run_until_signal`](Consumer::run_until_signal)
/// (until SIGTERM or SIGINT). Read its [`Stats`] and [`Health`] meanwhile.
///
/// # Example
/// ```no_run
/// use idempo::Tx;
/// use idempo::amqp::{Consumer, JsonBody};
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
///     .handler(|tx: Tx, JsonBody(p): JsonBody<Payment>| async move {
///         let mut tx = tx.try_lock()?;
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
/// # Broker and database loss
/// The runtime never exits because a connection died. When the AMQP
/// connection or a channel is lost (broker restart, `rabbitmqctl
/// close_all_connections`, missed heartbeats) or the broker cancels the
/// subscription (queue deleted: reported in [`Health`] and logged), it
/// reconnects with exponential backoff and jitter, declares its topology
/// again and resubscribes. Handlers in flight carry on; if their ack can no
/// longer be sent, the redelivery is claimed as a duplicate. When PostgreSQL
/// is unreachable, deliveries wait at a gate that probes the database with
/// backoff, and run again once it answers: they use up no retry attempt and
/// are never acked in between.
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
    pub(crate) config: Config,
    pub(crate) dispatch: Dispatch,
    pub(crate) shutdown: ShutdownHandle,
    pub(crate) stats: Stats,
    pub(crate) health: Health,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) broker: Broker,
    pub(crate) pool: PgPool,
    pub(crate) consumer: String,
    pub(crate) topology: Topology,
    pub(crate) declare: bool,
    pub(crate) prefetch: u16,
    pub(crate) concurrency: usize,
    pub(crate) message_id: MessageIdSource,
    pub(crate) redelivery: RedeliveryPolicy,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) retention: Option<Duration>,
    pub(crate) retention_interval: Duration,
    pub(crate) connection_name: String,
    /// Keep retrying when the queues exist with other arguments.
    pub(crate) wait_for_topology: bool,
    /// Queues declared like the work queue (for a consumer downstream).
    pub(crate) also_declare: Vec<String>,
    /// Run an outbox relay for the pool.
    #[cfg_attr(not(feature = "outbox"), allow(dead_code))]
    pub(crate) relay: bool,
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

    /// Fired when a graceful shutdown begins.
    pub(crate) fn graceful_token(&self) -> CancellationToken {
        self.graceful.clone()
    }

    /// Fired when the shutdown must not wait any longer.
    #[cfg_attr(not(feature = "outbox"), allow(dead_code))]
    pub(crate) fn now_token(&self) -> CancellationToken {
        self.now.clone()
    }
}

impl Consumer {
    /// Starts configuring a consumer that connects to `amqp_url` and runs its
    /// handler in transactions on `pool`.
    ///
    /// Size the pool to at least [`concurrency`](ConsumerBuilder::concurrency)
    /// connections: each running handler holds one. The outbox relay (once
    /// the process stages messages) takes one more for each of its batches,
    /// and opens one connection of its own for `LISTEN`.
    pub fn builder(amqp_url: impl Into<String>, pool: PgPool) -> ConsumerBuilder<NoHandler> {
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

    /// The consumer's live health: connected, consuming, database, last error.
    pub fn health(&self) -> Health {
        self.health.clone()
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
    /// processes deliveries until the [`ShutdownHandle`] fires; reconnects
    /// whenever the broker connection is lost. Also runs the retention reaper.
    ///
    /// # Errors
    /// [`Error::TopologyConflict`] when a queue exists with other arguments
    /// than the runtime declares (unless
    /// [`wait_for_topology`](ConsumerBuilder::wait_for_topology)): a
    /// configuration error that no reconnect can fix. [`Error::Tls`] when
    /// PostgreSQL or every broker node refuses the TLS handshake at start
    /// (a wrong CA, a host name the certificate does not name, a port without
    /// TLS). Connection failures are retried, not returned.
    pub async fn run(self) -> Result<()> {
        let Consumer {
            config,
            dispatch,
            shutdown,
            stats,
            health,
        } = self;
        warn_if_retention_too_short(&config);
        if let Some(refusal) = postgres_tls_refusal(&config.pool).await {
            return Err(refusal);
        }
        let reaper = config.retention.map(|retention| {
            tokio::spawn(retention::reap_periodically(
                config.pool.clone(),
                config.consumer.clone(),
                retention,
                config.retention_interval,
                shutdown.graceful.clone(),
            ))
        });
        #[cfg(feature = "outbox")]
        let relay = config.relay.then(|| {
            let relay = super::relay::Relay::for_consumer(
                config.broker.clone(),
                config.pool.clone(),
                &config.consumer,
                health.clone(),
            );
            let stop = relay.shutdown_handle();
            (stop, tokio::spawn(relay.run()))
        });
        let shutdown_timeout = config.shutdown_timeout;
        let mut runtime = Runtime {
            // In batch mode the slots are batches in flight: one committing
            // while the next is collected and claimed.
            permits: Arc::new(Semaphore::new(match &dispatch.batch {
                Some(_) => BATCHES_IN_FLIGHT,
                None => config.concurrency,
            })),
            tasks: JoinSet::new(),
            groups: GroupChains::default(),
            keys: Arc::new(Keyring::new(config.pool.clone(), config.consumer.clone())),
            wedged: 0,
            unresponsive: false,
            node: None,
            connected_once: false,
            config,
            dispatch,
            shutdown,
            stats,
            health,
        };
        // Load the key for the ids on copies now, so that the first copies
        // are sealed; deliveries that need it wait for it anyway.
        let keys = runtime.keys.clone();
        let stop = runtime.shutdown.graceful.clone();
        let loader = tokio::spawn(async move {
            keys.wait(stop.cancelled()).await;
        });
        let result = runtime.run().await;
        // After the handlers drained, so that what they staged is published
        // (or, past the timeout, left pending for the next relay).
        #[cfg(feature = "outbox")]
        if let Some((stop, mut task)) = relay {
            stop.shutdown();
            if tokio::time::timeout(shutdown_timeout, &mut task)
                .await
                .is_err()
            {
                stop.shutdown_now();
                let _ = task.await;
            }
        }
        #[cfg(not(feature = "outbox"))]
        let _ = shutdown_timeout;
        loader.abort();
        if let Some(reaper) = reaper {
            reaper.abort();
        }
        result
    }
}

/// A TLS handshake PostgreSQL refuses at start, as [`Error::Tls`]: the
/// database gate would otherwise wait for it forever, as for an outage. Any
/// other outcome (connected, or unreachable for now) lets the runtime start.
async fn postgres_tls_refusal(pool: &PgPool) -> Option<Error> {
    let error = match tokio::time::timeout(Duration::from_secs(10), pool.acquire()).await {
        Ok(Err(error)) => error,
        _ => return None,
    };
    // rustls's refusals reach sqlx as I/O errors ("invalid peer certificate"):
    // only the text tells them from a refused TCP connection.
    let tls = match &error {
        sqlx::Error::Tls(_) => true,
        sqlx::Error::Io(_) => crate::error::looks_like_tls_failure(&error.to_string()),
        _ => false,
    };
    tls.then(|| Error::Tls {
        service: "PostgreSQL".into(),
        reason: error.to_string(),
    })
}

/// The state that outlives broker sessions: handlers in flight keep running
/// across a reconnect (their ack may fail; the redelivery is deduplicated).
struct Runtime {
    config: Config,
    dispatch: Dispatch,
    shutdown: ShutdownHandle,
    stats: Stats,
    health: Health,
    permits: Arc<Semaphore>,
    tasks: JoinSet<()>,
    groups: GroupChains,
    /// The consumer's key for the ids its copies carry (loaded on first use).
    keys: Arc<Keyring>,
    /// Sessions in a row ended by a delivery that could not be moved away.
    wedged: u32,
    /// The broker left a round trip of this session's shutdown unanswered.
    unresponsive: bool,
    /// The node of the last session: the next one starts with the node after it.
    node: Option<usize>,
    /// Whether a session ever connected (a TLS refusal before that is fatal).
    connected_once: bool,
}

/// How a broker session ended.
enum SessionEnd {
    /// Shutdown was requested; everything is drained and closed.
    Shutdown,
    /// The connection, a channel or the subscription was lost.
    Lost {
        error: String,
        /// How long the session had been consuming (zero if it never did).
        consumed_for: Duration,
        /// The client could not parse a delivery's frames.
        unparseable: bool,
    },
    /// A configuration error that no reconnect can fix: `run` returns it.
    Fatal(Error),
}

/// A session that consumed this long resets the reconnect backoff: shorter
/// ones (a broker that accepts and then drops us) keep backing off.
const STABLE_SESSION: Duration = Duration::from_secs(30);

/// Bounds on broker round trips during setup and teardown, so a half-open
/// broker cannot hang a reconnect or a shutdown.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

impl Runtime {
    async fn run(&mut self) -> Result<()> {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
        let mut fatal = None;
        loop {
            self.health.set_state(RuntimeState::Connecting);
            let end = self.session().await;
            if !matches!(end, SessionEnd::Shutdown) {
                self.stats.incr(Counter::SessionFailures);
            }
            match end {
                SessionEnd::Shutdown => break,
                SessionEnd::Fatal(error) => {
                    tracing::error!(%error, "cannot run; stopping");
                    self.health.record_error(error.to_string());
                    fatal = Some(error);
                    break;
                }
                SessionEnd::Lost {
                    error,
                    consumed_for,
                    unparseable,
                } => {
                    if consumed_for >= STABLE_SESSION {
                        backoff.reset();
                    }
                    let pause = backoff.next_delay();
                    tracing::error!(%error, ?pause, "broker session lost; reconnecting");
                    self.health.record_error(error);
                    // After the loss is recorded, so that what the quarantine
                    // found is the last word in Health.
                    if unparseable {
                        self.quarantine().await;
                    } else if consumed_for >= STABLE_SESSION {
                        self.wedged = 0;
                        self.health.set_wedged_sessions(0);
                    }
                    if !consumed_for.is_zero() {
                        self.health.record_reconnect();
                        self.stats.incr(Counter::Reconnects);
                    }
                    self.health.set_state(RuntimeState::Reconnecting);
                    tokio::select! {
                        () = tokio::time::sleep(pause) => {}
                        () = self.shutdown.graceful.cancelled() => break,
                    }
                }
            }
        }
        // Handlers of lost sessions may still run: they can no longer ack, but
        // let them end their transactions (a no-op after a drained session).
        self.health.set_state(RuntimeState::Stopping);
        self.drain().await;
        self.health.set_state(RuntimeState::Stopped);
        tracing::info!(consumer = %self.config.consumer, "stopped");
        fatal.map_or(Ok(()), Err)
    }

    /// A delivery lapin cannot parse ended the session, and would end every
    /// next one: move such deliveries at the head of the queue to the DLQ
    /// with a client of our own (see `quarantine`).
    async fn quarantine(&mut self) {
        let config = &self.config;
        let target = quarantine::Target {
            broker: &config.broker,
            node: self.node.unwrap_or(0),
            queue: &config.topology.queue,
            dead_letter_queue: &config.topology.dead_letter_queue,
            consumer: &config.consumer,
            limit: usize::from(config.prefetch) + 1,
        };
        let moved = tokio::select! {
            moved = quarantine::run(&target) => moved,
            () = self.shutdown.graceful.cancelled() => return,
        };
        match moved {
            Ok(n) if n > 0 => {
                for _ in 0..n {
                    self.stats.incr(Counter::PoisonFrames);
                    self.stats.incr(Counter::DeadLettered);
                }
                self.wedged = 0;
                self.health.record_error(format!(
                    "moved {n} delivery(ies) whose properties are not valid UTF-8 to {:?}",
                    config.topology.dead_letter_queue
                ));
            }
            outcome => {
                self.wedged += 1;
                let why = match outcome {
                    Ok(_) => "none found at the head of the queue".to_owned(),
                    Err(e) => e.to_string(),
                };
                let error = format!(
                    "a delivery the AMQP client cannot parse ended {} session(s) in a row, and could not be moved to the DLQ ({why}); the queue is stuck behind it",
                    self.wedged
                );
                tracing::error!(%error);
                self.health.record_error(error);
            }
        }
        self.health.set_wedged_sessions(self.wedged);
    }

    /// One connection's life: connect, declare, subscribe, dispatch until
    /// shutdown or loss.
    async fn session(&mut self) -> SessionEnd {
        self.unresponsive = false;
        let lost = |error: String| SessionEnd::Lost {
            error,
            consumed_for: Duration::ZERO,
            unparseable: false,
        };
        let connecting = self
            .config
            .broker
            .connect_from(self.node, &self.config.connection_name);
        let connection = tokio::select! {
            connected = connecting => match connected {
                Ok((connection, node)) => {
                    self.node = Some(node);
                    self.connected_once = true;
                    connection
                }
                // A refused TLS handshake on every node, before anything ever
                // worked: a configuration error, not an outage.
                Err(e @ Error::Tls { .. }) if !self.connected_once => return SessionEnd::Fatal(e),
                Err(e) => return lost(format!("cannot connect to the broker: {e}")),
            },
            () = self.shutdown.graceful.cancelled() => return SessionEnd::Shutdown,
        };
        let subscribed = tokio::time::timeout(SETUP_TIMEOUT, self.subscribe(&connection)).await;
        let end = match subscribed {
            Ok(Ok((channel, deliveries, pipeline, broken))) => {
                self.dispatch(&connection, channel, deliveries, pipeline, broken)
                    .await
            }
            Ok(Err(e @ Error::TopologyConflict { .. })) if !self.config.wait_for_topology => {
                SessionEnd::Fatal(e)
            }
            Ok(Err(e)) => lost(format!("cannot set up the subscription: {e}")),
            Err(_) => lost(format!(
                "setting up the subscription took over {SETUP_TIMEOUT:?}"
            )),
        };
        // Closing the connection hands every unacked delivery back to the
        // broker (so does dropping it, if the broker does not answer).
        if connection.status().connected() {
            let close = connection.close(200, "idempo consumer stopped".into());
            let _ = self.bounded(close).await;
        }
        end
    }

    /// A broker round trip of the shutdown path: at most `CLOSE_TIMEOUT`;
    /// none at all once `shutdown_now` (or a second signal) fired, or once
    /// the broker left one unanswered in this session (in a resource alarm it
    /// answers none, and each would only add to the shutdown's length).
    async fn bounded<F: Future>(&mut self, call: F) -> Option<F::Output> {
        if self.shutdown.now.is_cancelled() || self.unresponsive {
            return None;
        }
        let done = tokio::select! {
            done = tokio::time::timeout(CLOSE_TIMEOUT, call) => done.ok(),
            () = self.shutdown.now.cancelled() => None,
        };
        self.unresponsive |= done.is_none();
        done
    }

    async fn subscribe(
        &self,
        connection: &Connection,
    ) -> Result<(
        lapin::Channel,
        lapin::Consumer,
        Arc<Pipeline>,
        CancellationToken,
    )> {
        let config = &self.config;
        let channel = connection.create_channel().await?;
        if config.declare {
            config
                .topology
                .declare(&channel)
                .await
                .map_err(|e| topology_error(&config.topology.queue, e))?;
            for queue in &config.also_declare {
                let like_ours = Topology {
                    queue: queue.clone(),
                    dead_letter_queue: format!("{queue}.dlq"),
                    queue_type: config.topology.queue_type,
                    bindings: Vec::new(),
                    retry_delays: Vec::new(),
                };
                like_ours
                    .declare(&channel)
                    .await
                    .map_err(|e| topology_error(queue, e))?;
            }
        }
        let republisher = Republisher::open(connection, REPUBLISH_CHANNELS).await?;
        channel
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await?;
        let deliveries = channel
            .basic_consume(
                config.topology.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let broken = CancellationToken::new();
        let pipeline = Arc::new(Pipeline {
            consumer: config.consumer.clone(),
            queue: config.topology.queue.clone(),
            dead_letter_queue: config.topology.dead_letter_queue.clone(),
            message_id: config.message_id.clone(),
            keys: self.keys.clone(),
            decide: self.dispatch.decide.clone(),
            redelivery: config.redelivery.clone(),
            declare: config.declare,
            republisher,
            // Batch mode acks processed deliveries with multiple acks.
            coalesced: self.dispatch.batch.map(|_| AckTracker::new()),
            broken: broken.clone(),
            shutdown: self.shutdown.graceful.clone(),
            health: self.health.clone(),
            stats: self.stats.clone(),
            log_limit: Default::default(),
        });
        Ok((channel, deliveries, pipeline, broken))
    }

    async fn dispatch(
        &mut self,
        connection: &Connection,
        channel: lapin::Channel,
        mut deliveries: lapin::Consumer,
        pipeline: Arc<Pipeline>,
        broken: CancellationToken,
    ) -> SessionEnd {
        let config = &self.config;
        self.health.set_state(RuntimeState::Consuming);
        tracing::info!(
            consumer = %config.consumer,
            queue = %config.topology.queue,
            prefetch = config.prefetch,
            concurrency = config.concurrency,
            batch = self.dispatch.batch.map(|(size, _)| size),
            "consuming"
        );
        let mut feed = Feed {
            deliveries: &mut deliveries,
            channel: &channel,
            connection,
            broken: &broken,
            shutdown: &self.shutdown.graceful,
            queue: &config.topology.queue,
            consuming_since: std::time::Instant::now(),
        };
        let end = loop {
            while let Some(done) = self.tasks.try_join_next() {
                log_task_failure(done);
            }
            let first = match feed.next(None).await {
                Next::Delivery(delivery) => delivery,
                Next::End(end) => break end,
                Next::Deadline => continue,
            };
            let unit = match self.dispatch.batch {
                None => vec![*first],
                Some((size, linger)) => {
                    // Collect up to `size`, or what arrives within the linger.
                    let deadline = tokio::time::Instant::now() + linger;
                    let mut batch = vec![*first];
                    let mut ended = None;
                    while batch.len() < size {
                        match feed.next(Some(deadline)).await {
                            Next::Delivery(delivery) => batch.push(*delivery),
                            Next::Deadline => break,
                            Next::End(end) => {
                                ended = Some(end);
                                break;
                            }
                        }
                    }
                    // Deliveries collected when the session ends stay unacked
                    // and return to the queue when the channel closes.
                    if let Some(end) = ended {
                        break end;
                    }
                    batch
                }
            };
            // In a group, wait for the delivery that arrived before this one.
            let (predecessor, done) = match (unit.as_slice(), &self.dispatch.groups) {
                ([delivery], Some(header)) => match group_of(delivery, header) {
                    Some(group) => {
                        let (predecessor, done) = self.groups.enqueue(group);
                        (predecessor, Some(done))
                    }
                    None => (None, None),
                },
                _ => (None, None),
            };
            // Wait for a free slot (a handler, or one of the batches in
            // flight); work that never gets one is left unacked. A grouped
            // delivery takes its slot only once its predecessor is done, so
            // a busy group never holds slots the other groups need.
            let permit = if done.is_some() {
                None
            } else {
                tokio::select! {
                    biased;
                    () = self.shutdown.graceful.cancelled() => break SessionEnd::Shutdown,
                    permit = self.permits.clone().acquire_owned() => Some(permit.expect("the semaphore is never closed")),
                }
            };
            let (permits, shutdown) = (self.permits.clone(), self.shutdown.graceful.clone());
            let pipeline = pipeline.clone();
            self.tasks.spawn(async move {
                let mut permit = permit;
                if done.is_some() {
                    // The predecessor must have settled: if it was abandoned
                    // (shutdown, a lost channel, a panic), running this one
                    // would overtake its redelivery. Leave it unacked: the
                    // channel that is going away hands it back in order.
                    let settled = match predecessor {
                        Some(predecessor) => matches!(predecessor.await, Ok(true)),
                        None => true,
                    };
                    if !settled || shutdown.is_cancelled() {
                        return; // `done` drops unsent: the group's next one abandons too
                    }
                    let slot = tokio::select! {
                        biased;
                        () = shutdown.cancelled() => return,
                        slot = permits.acquire_owned() => slot.expect("the semaphore is never closed"),
                    };
                    permit = Some(slot);
                }
                let work = pipeline.clone().run(unit);
                // A panic outside the handler (a message-id function, a
                // FromMessage impl) leaves deliveries unsettled; in batch mode
                // it would also stall the coalesced acks. Reconnecting hands
                // them all back.
                match AssertUnwindSafe(work).catch_unwind().await {
                    Ok(settled) => {
                        if let Some(done) = done {
                            let _ = done.send(!settled.contains(&Settled::Abandoned));
                        }
                    }
                    Err(_) => {
                        tracing::error!("a delivery task panicked outside the handler; reconnecting");
                        pipeline.broken.cancel();
                    }
                }
                drop(permit);
            });
        };

        if let SessionEnd::Shutdown = end {
            self.health.set_state(RuntimeState::Stopping);
            // Stop new deliveries first, so that nothing arrives while we
            // drain. Bounded: a broker in a resource alarm stops reading a
            // connection that published, and would never answer.
            if channel.status().connected() {
                let cancel = channel.basic_cancel(deliveries.tag(), BasicCancelOptions::default());
                match self.bounded(cancel).await {
                    Some(Ok(())) => {}
                    Some(Err(e)) => tracing::debug!(error = %e, "basic.cancel failed"),
                    None => tracing::warn!("basic.cancel unanswered; draining anyway"),
                }
            }
            self.drain().await;
        }
        if channel.status().connected() {
            let close = channel.close(200, "idempo consumer stopped".into());
            let _ = self.bounded(close).await;
        }
        // Closed here rather than when the last task drops them: a channel
        // dropped while the connection closes makes lapin log an ERROR.
        let _ = self.bounded(pipeline.republisher.close()).await;
        end
    }

    /// Lets the handlers in flight finish (bounded by `shutdown_timeout`, or
    /// cut short by `shutdown_now`); drops the rest, rolling them back.
    async fn drain(&mut self) {
        let tasks = &mut self.tasks;
        let drain = async {
            while let Some(done) = tasks.join_next().await {
                log_task_failure(done);
            }
        };
        let drained = tokio::select! {
            drained = tokio::time::timeout(self.config.shutdown_timeout, drain) => drained.is_ok(),
            () = self.shutdown.now.cancelled() => false,
        };
        if !drained {
            tracing::warn!(
                remaining = self.tasks.len(),
                "dropping handlers in flight; their transactions roll back and their deliveries will be redelivered"
            );
            self.tasks.shutdown().await;
        }
    }
}

/// Per message group, the completion of the delivery that arrived last:
/// the next delivery of the group waits for it, so a group runs one at a
/// time in arrival order while groups run in parallel. The completion says
/// whether that delivery settled (`true`) or was abandoned.
#[derive(Default)]
struct GroupChains {
    last: std::collections::HashMap<String, Shared<oneshot::Receiver<bool>>>,
    enqueued: usize,
}

impl GroupChains {
    /// The predecessor to wait for, and the sender that reports this
    /// delivery's end to the group's next one.
    fn enqueue(
        &mut self,
        group: String,
    ) -> (
        Option<Shared<oneshot::Receiver<bool>>>,
        oneshot::Sender<bool>,
    ) {
        let (done, finished) = oneshot::channel();
        let predecessor = self.last.insert(group, finished.shared());
        self.enqueued += 1;
        if self.enqueued.is_multiple_of(1024) {
            // Forget groups whose last delivery is over. Polling a clone is
            // what completes a `Shared` (peek alone never would here).
            self.last
                .retain(|_, last| last.clone().now_or_never().is_none());
        }
        (predecessor, done)
    }
}

/// The group id of a delivery: a string header.
fn group_of(delivery: &lapin::message::Delivery, header: &str) -> Option<String> {
    super::headers::string_header(delivery.properties.headers().as_ref(), header)
}

/// What the delivery stream gave.
enum Next {
    Delivery(Box<lapin::message::Delivery>),
    /// The batch's linger time is over.
    Deadline,
    /// Shutdown, or the session is lost.
    End(SessionEnd),
}

/// The delivery stream of one session, and what ends it.
struct Feed<'a> {
    deliveries: &'a mut lapin::Consumer,
    channel: &'a lapin::Channel,
    connection: &'a Connection,
    broken: &'a CancellationToken,
    shutdown: &'a CancellationToken,
    queue: &'a str,
    consuming_since: std::time::Instant,
}

impl Feed<'_> {
    async fn next(&mut self, deadline: Option<tokio::time::Instant>) -> Next {
        let consumed_for = self.consuming_since.elapsed().max(Duration::from_nanos(1));
        let lost = |error: String| {
            Next::End(SessionEnd::Lost {
                error,
                consumed_for,
                unparseable: false,
            })
        };
        let linger = async {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        let next = tokio::select! {
            biased;
            () = self.shutdown.cancelled() => return Next::End(SessionEnd::Shutdown),
            () = self.broken.cancelled() => return lost("the republishing channels were lost".into()),
            next = self.deliveries.next() => next,
            () = linger => return Next::Deadline,
        };
        match next {
            Some(Ok(delivery)) => Next::Delivery(Box::new(delivery)),
            Some(Err(e)) if matches!(e.kind(), lapin::ErrorKind::ParsingError(_)) => {
                Next::End(SessionEnd::Lost {
                    error: format!("a delivery could not be parsed: {e}"),
                    consumed_for,
                    unparseable: true,
                })
            }
            Some(Err(e)) => lost(format!("consuming failed: {e}")),
            None if self.channel.status().connected() && self.connection.status().connected() => {
                let error = Error::ConsumerCancelled {
                    queue: self.queue.to_owned(),
                };
                lost(format!("{error} (was the queue deleted?)"))
            }
            None => lost("the channel closed".into()),
        }
    }
}

/// A declaration the broker refused because the queue exists with other
/// arguments (PRECONDITION_FAILED, 406) is a configuration error.
fn topology_error(queue: &str, error: Error) -> Error {
    match &error {
        Error::Amqp(e) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 406 => {
                Error::TopologyConflict {
                    queue: queue.to_owned(),
                    broker: amqp.get_message().to_string(),
                }
            }
            _ => error,
        },
        _ => error,
    }
}

/// A redelivery that arrives after retention deleted its claim is processed
/// again: warn when the retention does not cover the longest way back.
fn warn_if_retention_too_short(config: &Config) {
    let Some(retention) = config.retention else {
        return;
    };
    let longest = config.redelivery.total_delay() + BROKER_CONSUMER_TIMEOUT;
    if retention < longest {
        tracing::warn!(
            ?retention,
            ?longest,
            "retention is shorter than the longest possible redelivery (retry schedule plus the broker's 30 min consumer timeout): a late redelivery could be processed twice"
        );
    }
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
