//! [`Consumer`]: a consumer of one queue or stream, on any transport, and
//! its life: the checks at start, the reaper, the relay, the heartbeats, the
//! transport's sessions, the drain. Written once, so it holds for every
//! transport.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use super::database_gate;
use super::dispatch::Deliveries;
use super::forwarding::Forwarding;
use super::health::{Health, RuntimeState};
use super::heartbeat;
use super::letters::LetterStore;
use super::message_id::MessageIdSource;
use super::mode::Dispatch;
use super::outcome::Decide;
use super::redelivery::RedeliveryPolicy;
use super::retention;
use super::route::Router;
use super::seal::Keyring;
use super::settle::LogLimit;
use super::shutdown::{self, ShutdownHandle};
use super::stats::Stats;
use super::transport::Transport;
use super::units::Units;
use crate::{Error, Result, Schema};

/// An exactly-once-effects consumer of one queue or stream, on the transport
/// `T` ([`amqp::Consumer`](crate::amqp::Consumer) on RabbitMQ,
/// [`nats::Consumer`](crate::nats::Consumer) on JetStream).
///
/// Build it with the transport's `Consumer::builder`, then
/// [`run`](Consumer::run) it (until a [`ShutdownHandle`] fires),
/// [`run_until_signal`](Consumer::run_until_signal) (until SIGTERM or
/// SIGINT) or [`run_until`](Consumer::run_until) (until a future of yours
/// completes). Read its [`Stats`] and [`Health`] meanwhile.
///
/// # Broker and database loss
/// The consumer never exits because a connection died. When the broker
/// connection is lost, the transport reconnects with backoff and carries on;
/// handlers in flight carry on too, and if their settlement can no longer
/// reach the broker, the redelivery is claimed as a duplicate. When
/// PostgreSQL is unreachable, deliveries wait at a gate that probes the
/// database with backoff, and run again once it answers: they use up no
/// retry attempt and are never acknowledged in between.
///
/// # Shutdown
/// When the [`ShutdownHandle`] fires (or a signal arrives), the transport
/// stops receiving, the handlers in flight finish (bounded by the shutdown
/// timeout) and their deliveries are settled, the relay publishes what they
/// staged, and `run` returns `Ok`. Deliveries that had not started are
/// delivered again by the broker. Handlers still running at the timeout (or
/// at [`ShutdownHandle::shutdown_now`], or at a second signal) are dropped:
/// their transactions roll back and their deliveries are redelivered.
pub struct Consumer<T: Transport> {
    pub(crate) transport: Arc<T>,
    pub(crate) config: Config,
    pub(crate) dispatch: Dispatch,
    pub(crate) forwarding: Arc<Forwarding>,
    pub(crate) shutdown: ShutdownHandle,
    pub(crate) stats: Stats,
    pub(crate) health: Health,
}

/// A consumer's settings once the builder checked them.
pub(crate) struct Config {
    pub(crate) pool: PgPool,
    pub(crate) consumer: String,
    pub(crate) concurrency: usize,
    pub(crate) message_id: MessageIdSource,
    pub(crate) redelivery: RedeliveryPolicy,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) retention: Option<Duration>,
    pub(crate) retention_interval: Duration,
    pub(crate) partitioning: Option<crate::inbox::partitioned::Partitioning>,
    pub(crate) schema: Schema,
    /// The dead-letter table, when letters go there, and how long its
    /// settled letters are kept.
    pub(crate) letters: Option<(Arc<dyn LetterStore>, Duration)>,
}

impl<T: Transport> fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("transport", &T::NAME)
            .field("consumer", &self.config.consumer)
            .field("source", &self.transport.source())
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Consumer<T> {
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

    /// The transport, as built from its options.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The runtime's router for this consumer, deciding with `decide`.
    pub(crate) fn router(&self, decide: Arc<dyn Decide>) -> Router {
        let c = &self.config;
        Router {
            transport: T::NAME,
            consumer: c.consumer.clone(),
            queue: self.transport.source().to_owned(),
            message_id: c.message_id.clone(),
            keys: Arc::new(Keyring::new(c.pool.clone(), c.consumer.clone())),
            decide,
            redelivery: c.redelivery.clone(),
            letters: c.letters.as_ref().map(|(store, _)| store.clone()),
            counts_deliveries: T::COUNTS_DELIVERIES,
        }
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

    /// Checks the database (its TLS, the schema as configured, the
    /// partitioned inbox when chosen), starts the retention reaper, the
    /// outbox relay and the heartbeats, then receives and processes
    /// deliveries through the transport until the [`ShutdownHandle`] fires.
    ///
    /// # Errors
    /// [`Error::Tls`] when PostgreSQL refuses the TLS handshake at start;
    /// [`Error::SchemaBehind`] with [`Schema::Check`] when a migration is
    /// missing; a partitioning error when the inbox was not switched; and
    /// the transport's configuration errors (refused credentials before
    /// anything worked, a conflicting topology: see the transport's docs).
    /// Connection failures are retried, not returned.
    pub async fn run(self) -> Result<()> {
        let router = Arc::new(self.router(self.dispatch.decide.clone()));
        let Consumer {
            transport,
            config,
            dispatch,
            forwarding,
            shutdown,
            stats,
            health,
        } = self;
        config.warn_if_retention_too_short(transport.redelivery_horizon());
        if let Some(refusal) = postgres_tls_refusal(&config.pool).await {
            return Err(refusal);
        }
        if !database_gate::schema_ready(&config.schema, &config.pool, &shutdown).await? {
            return Ok(());
        }
        if config.partitioning.is_some()
            && !crate::inbox::partitioned::Partitioning::table_is_partitioned(&config.pool).await?
        {
            return Err(crate::inbox::partitioned::PartitionError::NotPartitioned.into());
        }
        let stop = shutdown.graceful_token().clone();
        let reaping =
            config.retention.is_some() || config.partitioning.is_some() || config.letters.is_some();
        let reaper = reaping.then(|| {
            tokio::spawn(retention::reap_periodically(
                config.pool.clone(),
                config.consumer.clone(),
                config.retention,
                config.partitioning,
                config.retention_interval,
                config.letters.clone(),
                stop.clone(),
            ))
        });
        let relay = start_relay(&*transport, &forwarding, &config, &health);
        let beating = heartbeat::Identity::new(&config.consumer, transport.source()).on(T::NAME);
        let beats = tokio::spawn(heartbeat::beat_periodically(
            config.pool.clone(),
            beating.clone(),
            stats.clone(),
            health.clone(),
            stop.clone(),
        ));
        // Load the key for the ids on copies now, so that the first copies
        // are sealed; deliveries that need it wait for it anyway.
        let keys = router.keys.clone();
        let loader = tokio::spawn({
            let stop = stop.clone();
            async move {
                keys.wait(stop.cancelled()).await;
            }
        });
        let units = Arc::new(Units {
            transport: transport.clone(),
            router,
            shutdown: stop.clone(),
            health: health.clone(),
            stats: stats.clone(),
            log_limit: LogLimit::default(),
        });
        let mut deliveries = Deliveries::new(
            &dispatch,
            config.concurrency,
            units,
            shutdown.clone(),
            config.shutdown_timeout,
        );
        health.set_state(RuntimeState::Connecting);
        let result = transport.clone().consume(&mut deliveries).await;
        if let Err(error) = &result {
            tracing::error!(%error, "cannot run; stopping");
            health.record_error(error.to_string());
        }
        // Units of lost sessions may still run: let them end their
        // transactions (a no-op after a drained session).
        health.set_state(RuntimeState::Stopping);
        deliveries.drain().await;
        health.set_state(RuntimeState::Stopped);
        tracing::info!(consumer = %config.consumer, "stopped");
        // After the handlers drained, so that what they staged is published
        // (or, past the timeout, left pending for the next relay).
        #[cfg(feature = "outbox")]
        if let Some(relay) = relay {
            relay.stop(config.shutdown_timeout).await;
        }
        #[cfg(not(feature = "outbox"))]
        let () = relay;
        loader.abort();
        if let Some(reaper) = reaper {
            reaper.abort();
        }
        beats.abort();
        // The last heartbeat says so, so that the dashboard stops counting it.
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            heartbeat::beat_once(&config.pool, &beating, &stats, &health, Some("stopped")),
        )
        .await;
        result
    }
}

/// The relay the transport runs beside the consumer, when the consumer runs
/// one (feature `outbox`).
#[cfg(feature = "outbox")]
fn start_relay<T: Transport>(
    transport: &T,
    forwarding: &Forwarding,
    config: &Config,
    health: &Health,
) -> Option<super::relay_task::RelayTask> {
    let link = forwarding.relay_link()?;
    let task = transport.relay(super::relay_task::RelayContext {
        pool: &config.pool,
        consumer: &config.consumer,
        link,
        health,
    });
    if task.is_none() {
        tracing::debug!(
            transport = T::NAME,
            "the transport runs no outbox relay; a relay elsewhere publishes what the handlers stage"
        );
    }
    task
}

#[cfg(not(feature = "outbox"))]
fn start_relay<T: Transport>(_: &T, _: &Forwarding, _: &Config, _: &Health) {}

impl Config {
    /// A redelivery that arrives after retention deleted its claim is
    /// processed again: warn when the retention does not cover the longest
    /// way back (the retry schedule and the transport's own horizon).
    fn warn_if_retention_too_short(&self, horizon: Duration) {
        let Some(retention) = self.retention else {
            return;
        };
        let longest = self.redelivery.total_delay() + horizon;
        if retention < longest {
            tracing::warn!(
                ?retention,
                ?longest,
                "retention is shorter than the longest possible redelivery (the retry schedule plus the broker's own redelivery horizon): a late redelivery could be processed twice"
            );
        }
    }
}

/// A TLS handshake PostgreSQL refuses at start, as [`Error::Tls`]: the
/// database gate would otherwise wait for it forever, as for an outage. Any
/// other outcome (connected, or unreachable for now) lets the consumer start.
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
        sqlx::Error::Io(io) => crate::tls::tls_failure(io).is_some(),
        _ => false,
    };
    tls.then(|| Error::Tls {
        service: "PostgreSQL".into(),
        reason: error.to_string(),
    })
}
