//! [`Consumer`]: a consumer of one JetStream stream, and how it runs and
//! stops: connect, check or create the stream and its durable pull
//! consumer, pull deliveries into units, run each through the
//! [`Pipeline`], drain at shutdown.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, Context};
use futures::StreamExt;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::connect;
use super::pipeline::Pipeline;
use super::topology::Topology;
use crate::backoff::Backoff;
use crate::runtime::health::{Health, RuntimeState};
use crate::runtime::heartbeat;
use crate::runtime::message_id::MessageIdSource;
use crate::runtime::mode::Dispatch;
use crate::runtime::redelivery::RedeliveryPolicy;
use crate::runtime::route::Router;
use crate::runtime::seal::Keyring;
use crate::runtime::settle::LogLimit;
use crate::runtime::shutdown::{self, ShutdownHandle};
use crate::runtime::stats::Stats;
use crate::runtime::{database_gate, retention};
use crate::{Result, Schema};

/// Batches processed at once in batch mode: one committing while the next
/// is claimed.
const BATCHES_IN_FLIGHT: usize = 2;

/// How long a pull request waits on the server, and how often the server
/// says it is alive meanwhile (a missed heartbeat re-issues the pull).
const PULL_EXPIRES: Duration = Duration::from_secs(30);
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);

/// A consumer of one JetStream stream with exactly-once effects: the
/// handler runs in the transaction that claims the message id, and the
/// message is acknowledged (confirmed by the server) only after the commit.
///
/// # Example
/// ```no_run
/// use idempo::Tx;
/// use idempo::consumer::JsonBody;
/// use idempo::nats::Consumer;
///
/// #[derive(serde::Deserialize)]
/// struct Payment { account: String, amount_cents: i64 }
///
/// # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
/// idempo::migrate(&pool).await?;
/// Consumer::builder("nats://127.0.0.1:4222", pool)
///     .stream("payments")
///     .handler(|tx: Tx, JsonBody(p): JsonBody<Payment>| async move {
///         let mut tx = tx.try_lock()?;
///         sqlx::query("UPDATE balances SET cents = cents + $2 WHERE account = $1")
///             .bind(&p.account)
///             .bind(p.amount_cents)
///             .execute(&mut *tx)
///             .await?;
///         Ok(())
///     })
///     .build()?
///     .run_until_signal()
///     .await?;
/// # Ok(()) }
/// ```
///
/// # Failures
/// A transient failure is NAKed with the [`RedeliveryPolicy`]'s delay;
/// JetStream counts the deliveries, and after the policy's last attempt the
/// message goes to the `dead_letters` table (JetStream has no dead-letter
/// stream), from which `idempo dlq replay` publishes it again. Poison (no
/// id, an undecodable body, a reused id) goes there at once. The durable
/// consumer has no `MaxDeliver`: JetStream would stop redelivering without
/// telling anyone.
///
/// # Connection loss and shutdown
/// The NATS client reconnects by itself; deliveries in flight keep their
/// ack subjects, and an ack that is not confirmed leaves a redelivery that
/// is claimed as a duplicate. At shutdown the consumer stops pulling, lets
/// the units in flight finish (bounded by the shutdown timeout), and
/// returns; what it had pulled and not started is redelivered after the
/// ack wait.
pub struct Consumer {
    parts: Parts,
}

/// What [`ConsumerBuilder::build`](super::ConsumerBuilder::build) checked and assembled.
pub(crate) struct Parts {
    pub(crate) url: String,
    pub(crate) pool: PgPool,
    pub(crate) consumer: String,
    pub(crate) topology: Topology,
    pub(crate) concurrency: usize,
    pub(crate) message_id: MessageIdSource,
    pub(crate) redelivery: RedeliveryPolicy,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) retention: Option<Duration>,
    pub(crate) retention_interval: Duration,
    pub(crate) schema: Schema,
    /// The relay's streams to create, when the consumer runs a relay.
    pub(crate) relay: Option<Vec<String>>,
    pub(crate) dispatch: Dispatch,
    pub(crate) shutdown: ShutdownHandle,
    pub(crate) stats: Stats,
    pub(crate) health: Health,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("consumer", &self.parts.consumer)
            .field("topology", &self.parts.topology)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    pub(crate) fn new(parts: Parts) -> Self {
        Consumer { parts }
    }

    /// A handle that stops this consumer gracefully from another task.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.parts.shutdown.clone()
    }

    /// The consumer's live counters.
    pub fn stats(&self) -> Stats {
        self.parts.stats.clone()
    }

    /// The consumer's live health.
    pub fn health(&self) -> Health {
        self.parts.health.clone()
    }

    /// The consumer name that scopes its message ids in `processed_messages`
    /// (also the durable JetStream consumer's name).
    pub fn name(&self) -> &str {
        &self.parts.consumer
    }

    /// Runs until SIGTERM or SIGINT (or the [`ShutdownHandle`]); a second
    /// signal stops at once.
    ///
    /// # Errors
    /// As [`Consumer::run`].
    pub async fn run_until_signal(self) -> Result<()> {
        let handle = self.parts.shutdown.clone();
        shutdown::until_signal(&handle, self.run()).await
    }

    /// Runs until `stop` completes (or the [`ShutdownHandle`] fires).
    ///
    /// # Errors
    /// As [`Consumer::run`].
    pub async fn run_until(self, stop: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let handle = self.parts.shutdown.clone();
        shutdown::until(&handle, stop, self.run()).await
    }

    /// Connects (waiting while the server is unreachable), checks JetStream,
    /// the stream and the durable consumer, then consumes until the
    /// [`ShutdownHandle`] fires. Also reaps old `processed_messages` rows,
    /// writes the heartbeat `idempo status` reads and runs the outbox relay
    /// to JetStream.
    ///
    /// # Errors
    /// A [`NatsError`](super::NatsError) before anything is consumed: the
    /// server refuses the credentials, has no JetStream, or the stream or
    /// the durable consumer conflicts with what the runtime needs.
    pub async fn run(self) -> Result<()> {
        let p = self.parts;
        if !database_gate::schema_ready(&p.schema, &p.pool, &p.shutdown).await? {
            return Ok(());
        }
        p.health.set_state(RuntimeState::Connecting);
        let Some(client) = connect::client(&p.url, &p.consumer, &p.health, &p.shutdown).await?
        else {
            return Ok(());
        };
        connect::check_jetstream(&client, &p.url).await?;
        let context = jetstream::new(client);
        let pull = p.topology.ensure(&context).await?;
        let stop = p.shutdown.graceful_token().clone();
        let relay = p.relay.as_ref().map(|streams| {
            let relay = streams.iter().fold(
                super::Relay::new(p.url.clone(), p.pool.clone()),
                |relay, stream| relay.create_stream(stream),
            );
            (relay.shutdown_handle(), tokio::spawn(relay.run()))
        });
        let letters = crate::dead_letters::TableStore {
            pool: p.pool.clone(),
        };
        let letters: Arc<dyn crate::runtime::letters::LetterStore> = Arc::new(letters);
        let reaper = p.retention.map(|keep| {
            tokio::spawn(retention::reap_periodically(
                p.pool.clone(),
                p.consumer.clone(),
                Some(keep),
                None,
                p.retention_interval,
                None,
                stop.clone(),
            ))
        });
        let beating =
            heartbeat::Identity::new(&p.consumer, &p.topology.stream).on(super::TRANSPORT);
        let beats = tokio::spawn(heartbeat::beat_periodically(
            p.pool.clone(),
            beating.clone(),
            p.stats.clone(),
            p.health.clone(),
            stop.clone(),
        ));
        let router = Arc::new(Router {
            transport: super::TRANSPORT,
            consumer: p.consumer.clone(),
            queue: p.topology.stream.clone(),
            message_id: p.message_id.clone(),
            keys: Arc::new(Keyring::new(p.pool.clone(), p.consumer.clone())),
            decide: p.dispatch.decide.clone(),
            redelivery: p.redelivery.clone(),
            letters: Some(letters),
            // JetStream counts deliveries, crashed ones included.
            counts_deliveries: true,
        });
        let pipeline = Arc::new(Pipeline {
            router,
            subject: p.topology.subject.clone(),
            progress_every: p.topology.ack_wait / 3,
            shutdown: stop.clone(),
            health: p.health.clone(),
            stats: p.stats.clone(),
            log_limit: LogLimit::default(),
        });
        let slots = match p.dispatch.batch {
            Some(_) => BATCHES_IN_FLIGHT,
            None => p.concurrency,
        };
        let mut pump = Pump {
            pipeline,
            batch: p.dispatch.batch,
            slots: Arc::new(Semaphore::new(slots)),
            tasks: JoinSet::new(),
            health: p.health.clone(),
        };
        pump.run(pull, &context, &p.topology, &stop).await;
        p.health.set_state(RuntimeState::Stopping);
        pump.drain(p.shutdown_timeout, p.shutdown.now_token()).await;
        if let Some((stop, running)) = relay {
            // After the drain, so that what the handlers staged is published
            // (or left pending for the next relay).
            stop.shutdown();
            match tokio::time::timeout(p.shutdown_timeout, running).await {
                Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the outbox relay stopped"),
                Ok(_) => {}
                Err(_) => tracing::warn!("the outbox relay did not stop in time"),
            }
        }
        if let Some(reaper) = reaper {
            reaper.abort();
        }
        beats.abort();
        p.health.set_state(RuntimeState::Stopped);
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            heartbeat::beat_once(&p.pool, &beating, &p.stats, &p.health, Some("stopped")),
        )
        .await;
        Ok(())
    }
}

/// Pulls deliveries and runs them as units, each in a task holding a slot.
struct Pump {
    pipeline: Arc<Pipeline>,
    batch: Option<(usize, Duration)>,
    slots: Arc<Semaphore>,
    tasks: JoinSet<()>,
    health: Health,
}

impl Pump {
    /// Consumes until `stop`; when the pull stream ends (the consumer or
    /// the stream deleted, the server gone for long), sets them up again.
    async fn run(
        &mut self,
        mut pull: PullConsumer,
        context: &Context,
        topology: &Topology,
        stop: &tokio_util::sync::CancellationToken,
    ) {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        loop {
            let messages = pull
                .stream()
                // Twice what may be unacknowledged: the request stays open
                // while acks free room, instead of ending at each batch.
                .max_messages_per_batch((topology.max_ack_pending as usize * 2).max(200))
                .expires(PULL_EXPIRES)
                .heartbeat(PULL_HEARTBEAT)
                .messages()
                .await;
            match messages {
                Ok(mut messages) => {
                    self.health.set_state(RuntimeState::Consuming);
                    backoff.reset();
                    if self.consume(&mut messages, stop).await {
                        return;
                    }
                }
                Err(e) => self.lost(format!("cannot pull from JetStream: {e}")),
            }
            self.health.set_state(RuntimeState::Reconnecting);
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
            match topology.ensure(context).await {
                Ok(again) => pull = again,
                Err(e) => self.lost(format!("cannot set up the consumer again: {e}")),
            }
        }
    }

    /// Runs units from `messages`; `true` when stopped, `false` when the
    /// stream ended.
    async fn consume(
        &mut self,
        messages: &mut async_nats::jetstream::consumer::pull::Stream,
        stop: &tokio_util::sync::CancellationToken,
    ) -> bool {
        loop {
            // Take a slot first, so that deliveries wait in JetStream, not here.
            let slot = tokio::select! {
                () = stop.cancelled() => return true,
                slot = self.slots.clone().acquire_owned() => slot.expect("never closed"),
            };
            let first = tokio::select! {
                () = stop.cancelled() => return true,
                next = messages.next() => next,
            };
            let mut unit = match first {
                Some(Ok(message)) => vec![message],
                Some(Err(e)) => {
                    // Missed heartbeats and failed pulls are re-issued by the client.
                    tracing::debug!(error = %e, "JetStream pull");
                    self.health.record_error(format!("JetStream pull: {e}"));
                    continue;
                }
                None => {
                    self.lost("the JetStream pull stream ended".into());
                    return false;
                }
            };
            if let Some((size, linger)) = self.batch {
                let deadline = tokio::time::Instant::now() + linger;
                while unit.len() < size {
                    match tokio::time::timeout_at(deadline, messages.next()).await {
                        Ok(Some(Ok(message))) => unit.push(message),
                        Ok(Some(Err(e))) => tracing::debug!(error = %e, "JetStream pull"),
                        Ok(None) | Err(_) => break,
                    }
                }
            }
            let pipeline = self.pipeline.clone();
            self.tasks.spawn(async move {
                pipeline.run(unit).await;
                drop(slot);
            });
            // Reap finished tasks so the set does not grow.
            while self.tasks.try_join_next().is_some() {}
        }
    }

    /// Waits for the units in flight, up to `timeout` or `now`; the rest are
    /// dropped (rolled back, redelivered after the ack wait).
    async fn drain(&mut self, timeout: Duration, now: &tokio_util::sync::CancellationToken) {
        let all = async { while self.tasks.join_next().await.is_some() {} };
        tokio::select! {
            () = all => {}
            () = tokio::time::sleep(timeout) => {
                tracing::warn!("shutdown timeout: dropping the units still running");
            }
            () = now.cancelled() => {}
        }
        self.tasks.abort_all();
    }

    fn lost(&self, error: String) {
        tracing::warn!(%error);
        self.health.record_error(error);
    }
}
