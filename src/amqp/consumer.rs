//! [`Consumer`]: a consumer of one queue, and how it runs and stops.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::amqp::config::Config;
use crate::amqp::consumer_relay::RunningRelay;
use crate::amqp::session::Runtime;
use crate::runtime::database_gate;
use crate::runtime::forwarding::Forwarding;
use crate::runtime::health::Health;
use crate::runtime::heartbeat;
use crate::runtime::mode::Dispatch;
use crate::runtime::retention;
use crate::runtime::shutdown::{self, ShutdownHandle};
use crate::runtime::stats::Stats;
use crate::{Error, Result};

/// An exactly-once-effects consumer of one RabbitMQ queue.
///
/// Build it with [`Consumer::builder`], then [`run`](Consumer::run) it (until
/// a [`ShutdownHandle`] fires), [`run_until_signal`](Consumer::run_until_signal)
/// (until SIGTERM or SIGINT) or [`run_until`](Consumer::run_until) (until a
/// future of yours completes). Read its [`Stats`] and [`Health`] meanwhile.
///
/// # Example
/// ```no_run
/// use idempo::Tx;
/// use idempo::amqp::Consumer, idempo::consumer::JsonBody;
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
/// [`ConsumerBuilder::shutdown_timeout`](super::ConsumerBuilder::shutdown_timeout)), commits and acks them, closes the
/// channel and the connection, and returns `Ok`. Deliveries that had not
/// started go back to the queue when the channel closes. Handlers still
/// running at the timeout (or at [`ShutdownHandle::shutdown_now`], or at a
/// second signal) are dropped: their transactions roll back and their
/// deliveries are redelivered.
pub struct Consumer {
    pub(crate) config: Config,
    pub(crate) dispatch: Dispatch,
    pub(crate) forwarding: Arc<Forwarding>,
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

impl Consumer {
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
        shutdown::until_signal(&handle, self.run()).await
    }

    /// Runs until `stop` completes (or the [`ShutdownHandle`] fires), then
    /// shuts down gracefully and returns `Ok`: the way to tie a consumer to
    /// the rest of an application's shutdown, such as a
    /// [`CancellationToken`](tokio_util::sync::CancellationToken) or a
    /// channel.
    ///
    /// ```no_run
    /// # async fn doc(consumer: idempo::amqp::Consumer) -> idempo::Result<()> {
    /// let token = tokio_util::sync::CancellationToken::new();
    /// let running = tokio::spawn(consumer.run_until(token.clone().cancelled_owned()));
    /// // ... later, when the application stops:
    /// token.cancel();
    /// running.await.expect("consumer task")?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Consumer::run`].
    pub async fn run_until(self, stop: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let handle = self.shutdown.clone();
        shutdown::until(&handle, stop, self.run()).await
    }

    /// Connects, declares the topology (unless turned off), consumes and
    /// processes deliveries until the [`ShutdownHandle`] fires; reconnects
    /// whenever the broker connection is lost. Also runs the retention reaper
    /// and, with feature `outbox`, the consumer's outbox relay.
    ///
    /// # Errors
    /// [`AmqpError::TopologyConflict`](crate::amqp::AmqpError::TopologyConflict) when a queue exists with other arguments
    /// than the runtime declares (unless
    /// [`wait_for_topology`](super::ConsumerBuilder::wait_for_topology)): a
    /// configuration error that no reconnect can fix. [`Error::Tls`] when
    /// PostgreSQL or every broker node refuses the TLS handshake at start
    /// (a wrong CA, a host name the certificate does not name, a port without
    /// TLS). [`AmqpError::BrokerRefused`](crate::amqp::AmqpError::BrokerRefused) when, before any connection worked,
    /// every broker node refuses the credentials (`ACCESS_REFUSED`), the
    /// vhost (`NOT_ALLOWED`) or the scheme (`amqp://` to a TLS port);
    /// [`AmqpError::AccessRefused`](crate::amqp::AmqpError::AccessRefused) when, before consuming ever worked, the
    /// broker refuses to declare a queue (configure permission) or to
    /// consume from it (read permission); [`Error::Certificate`] when
    /// `SSL_CERT_FILE` is unusable. After a good start, the same refusals
    /// are retried with backoff, reported in [`Health`] and counted in
    /// `idempo_broker_refusals_total`. Connection failures (refused TCP, no
    /// answer within the connection timeout) are retried, not returned.
    pub async fn run(self) -> Result<()> {
        let Consumer {
            config,
            dispatch,
            forwarding,
            shutdown,
            stats,
            health,
        } = self;
        config.warn_if_retention_too_short();
        if let Some(refusal) = postgres_tls_refusal(&config.pool).await {
            return Err(refusal);
        }
        if !database_gate::schema_ready(&config.schema, &config.pool, &shutdown).await? {
            return Ok(());
        }
        if config.partitioning.is_some()
            && !crate::inbox::partitioned::is_partitioned(&config.pool).await?
        {
            return Err(crate::inbox::partitioned::PartitionError::NotPartitioned.into());
        }
        let reaping = config.retention.is_some() || config.partitioning.is_some();
        let reaper = reaping.then(|| {
            tokio::spawn(retention::reap_periodically(
                config.pool.clone(),
                config.consumer.clone(),
                config.retention,
                config.partitioning,
                config.retention_interval,
                config.letter_store().zip(config.dead_letter_retention()),
                shutdown.graceful_token().clone(),
            ))
        });
        let relay = RunningRelay::start(
            &forwarding,
            &config.broker,
            &config.pool,
            &config.consumer,
            &health,
        );
        let beating = heartbeat::Identity::new(&config.consumer, &config.topology.queue);
        let beats = tokio::spawn(heartbeat::beat_periodically(
            config.pool.clone(),
            beating.clone(),
            stats.clone(),
            health.clone(),
            shutdown.graceful_token().clone(),
        ));
        let (pool, last) = (config.pool.clone(), (stats.clone(), health.clone()));
        let shutdown_timeout = config.shutdown_timeout;
        let mut runtime = Runtime::new(config, dispatch, shutdown, stats, health);
        // Load the key for the ids on copies now, so that the first copies
        // are sealed; deliveries that need it wait for it anyway.
        let keys = runtime.router.keys.clone();
        let stop = runtime.shutdown.graceful_token().clone();
        let loader = tokio::spawn(async move {
            keys.wait(stop.cancelled()).await;
        });
        let result = runtime.run().await;
        // After the handlers drained, so that what they staged is published
        // (or, past the timeout, left pending for the next relay).
        relay.stop(shutdown_timeout).await;
        loader.abort();
        if let Some(reaper) = reaper {
            reaper.abort();
        }
        beats.abort();
        // The last heartbeat says so, so that the dashboard stops counting it.
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            heartbeat::beat_once(&pool, &beating, &last.0, &last.1, Some("stopped")),
        )
        .await;
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
    // rustls's refusals of the handshake reach sqlx as I/O errors that carry
    // the rustls error: told from a refused TCP connection by its type.
    let tls = match &error {
        sqlx::Error::Tls(_) => true,
        #[cfg(feature = "tls")]
        sqlx::Error::Io(io) => crate::error::tls_failure(io).is_some(),
        _ => false,
    };
    tls.then(|| Error::Tls {
        service: "PostgreSQL".into(),
        reason: error.to_string(),
    })
}
