//! The transport kit: what every transport must show, run against a real
//! consumer on it (Watermill's `tests.TestPubSub` is the model). idempo
//! runs it on RabbitMQ, JetStream and [`MemoryBroker`](crate::testing::MemoryBroker);
//! a fourth transport runs it by implementing [`TransportUnderTest`].
//!
//! Each check starts a consumer of a queue or stream of its own (through
//! [`TransportUnderTest::consumer`]), publishes payments whose body says how
//! the kit's handler behaves, and compares what became of each: applied
//! once, a duplicate, a dead letter with its reason, when each attempt ran,
//! what a graceful stop left, what the outbox relay published.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::{ConformanceError, Failure, Report, run_id, unexpected};
use crate::consumer::transport::Transport;
use crate::consumer::{
    Consumer, ConsumerBuilder, DeadLetters, HandlerError, Message, RedeliveryPolicy, RuntimeState,
};
use crate::outbox::{self, OutboxMessage};

/// The checks of [`Report::transport`], in the order a failure is reported.
const CHECKS: [&str; 8] = [
    "exactly_once_under_redelivery",
    "a_group_keeps_its_order",
    "retry_later_after_the_policys_delay",
    "a_dead_letter_carries_its_reason",
    "poison_never_blocks_the_queue",
    "a_graceful_stop_settles_what_is_in_flight",
    "it_reconnects_after_a_cut",
    "the_outbox_forwards_with_a_stable_id",
];

/// The retry delay the checks configure: long enough to measure.
pub(super) const DELAY: Duration = Duration::from_millis(400);
/// How long a check waits for what it expects.
pub(super) const PATIENCE: Duration = Duration::from_secs(60);

/// A transport the kit can run against: how to start a consumer on it,
/// publish to it, cut it, and read what its relay published.
pub trait TransportUnderTest: Send + Sync {
    /// The transport.
    type Transport: Transport;

    /// A consumer of the fresh queue or stream `source`, running in
    /// transactions on `pool`, with the transport's options set (its
    /// `Consumer::builder(url, pool)` and its source): the kit sets the
    /// rest.
    fn consumer(&self, source: &str, pool: PgPool) -> ConsumerBuilder<Self::Transport>;

    /// Publishes a message with `id` in the transport's own id field (or
    /// wherever the consumer reads its id), `headers` as text headers and
    /// `body` to `source`, once its consumer is consuming, and waits until
    /// the broker holds it.
    fn publish(
        &self,
        source: &str,
        id: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> impl Future<Output = Result<(), String>> + Send;

    /// Cuts the consumer's connection to its broker, as a network or a
    /// broker restart would; `false` when that cannot be done from outside
    /// (the check is then reported skipped).
    fn cut(&self, source: &str) -> impl Future<Output = bool> + Send {
        let _ = source;
        async { false }
    }

    /// Sets `consumer` up so that its outbox relay publishes to
    /// `destination` (declares or creates it); `None` when the transport has
    /// no relay (the check is then reported skipped).
    fn forward_to(
        &self,
        consumer: ConsumerBuilder<Self::Transport>,
        destination: &str,
    ) -> Option<ConsumerBuilder<Self::Transport>> {
        let _ = destination;
        let _ = consumer;
        None
    }

    /// The transport ids of the messages at `destination` so far.
    fn received(
        &self,
        destination: &str,
    ) -> impl Future<Output = Result<Vec<String>, String>> + Send {
        let _ = destination;
        async { Ok(Vec::new()) }
    }
}

/// A kit message: a payment, and how the handler behaves with it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct KitBody {
    #[serde(default)]
    pub(super) fail: Fail,
    #[serde(default)]
    pub(super) sleep_ms: u64,
    #[serde(default)]
    pub(super) forward_to: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Fail {
    #[default]
    Never,
    /// A transient error on the first attempt only.
    Once,
    /// A permanent error on every attempt.
    Always,
}

/// When each id's handler attempts started.
type Attempts = Arc<Mutex<HashMap<String, Vec<Instant>>>>;

impl Report {
    /// Runs the kit against `under_test`, its consumers on `pool` (idempo's
    /// migrations are applied; the kit writes its effects in a table of its
    /// own, `idempo_conformance_effects`). The checks run one after another,
    /// each on a queue or stream of its own; a check the transport cannot show
    /// ([`cut`](TransportUnderTest::cut), [`forward_to`](TransportUnderTest::forward_to))
    /// is listed in [`Report::skipped`].
    ///
    /// # Errors
    /// [`ConformanceError`] naming the first check that failed, and how.
    pub async fn transport<U: TransportUnderTest>(
        under_test: &U,
        pool: &PgPool,
    ) -> Result<Report, ConformanceError> {
        let started = Instant::now();
        let setup = async {
            crate::migrate(pool).await?;
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS idempo_conformance_effects \
             (source text NOT NULL, message_id text NOT NULL)",
            )
            .execute(pool)
            .await?;
            Ok::<_, crate::Error>(())
        };
        if let Err(source) = setup.await {
            return Err(ConformanceError {
                check: CHECKS[0],
                failure: Failure::Store {
                    step: "set up the kit's table".into(),
                    source,
                },
                also_failed: Vec::new(),
            });
        }
        let kit = Kit {
            under_test,
            pool,
            run: run_id(),
        };
        let mut report = Report {
            passed: Vec::new(),
            skipped: Vec::new(),
            elapsed: Duration::ZERO,
        };
        let mut failures = Vec::new();
        for check in CHECKS {
            let outcome = match check {
                "exactly_once_under_redelivery" => kit.exactly_once(check).await,
                "a_group_keeps_its_order" => kit.group_order(check).await,
                "retry_later_after_the_policys_delay" => kit.retry_later(check).await,
                "a_dead_letter_carries_its_reason" => kit.dead_letter(check).await,
                "poison_never_blocks_the_queue" => kit.poison(check).await,
                "a_graceful_stop_settles_what_is_in_flight" => kit.graceful_stop(check).await,
                "it_reconnects_after_a_cut" => kit.reconnects(check).await,
                _ => kit.forwards(check).await,
            };
            match outcome {
                Ok(true) => report.passed.push(check),
                Ok(false) => report.skipped.push(check),
                Err(failure) => failures.push((check, failure)),
            }
        }
        report.elapsed = started.elapsed();
        let mut failures = failures.into_iter();
        match failures.next() {
            None => Ok(report),
            Some((check, failure)) => Err(ConformanceError {
                check,
                failure,
                also_failed: failures.map(|(name, _)| name).collect(),
            }),
        }
    }
}

pub(super) struct Kit<'a, U> {
    pub(super) under_test: &'a U,
    pub(super) pool: &'a PgPool,
    run: String,
}

/// A consumer the kit started, and what it saw.
pub(super) struct Started<T: Transport> {
    pub(super) source: String,
    pub(super) attempts: Attempts,
    pub(super) stats: crate::consumer::Stats,
    pub(super) health: crate::consumer::Health,
    pub(super) stop: crate::consumer::ShutdownHandle,
    pub(super) task: tokio::task::JoinHandle<crate::Result<()>>,
    _transport: std::marker::PhantomData<T>,
}

impl<U: TransportUnderTest> Kit<'_, U> {
    pub(super) fn source(&self, check: &str) -> String {
        // Short and plain: a queue, a stream and a subject name alike.
        let short: String = check.split('_').filter_map(|w| w.chars().next()).collect();
        format!("idempo_kit_{}_{short}", self.run)
    }

    /// A consumer of `source` with the kit's handler, started, consuming.
    pub(super) async fn start(
        &self,
        source: &str,
        configure: impl FnOnce(ConsumerBuilder<U::Transport>) -> Option<ConsumerBuilder<U::Transport>>,
    ) -> Result<Option<Started<U::Transport>>, Failure> {
        self.start_with(source, configure, false).await
    }

    pub(super) async fn start_with(
        &self,
        source: &str,
        configure: impl FnOnce(ConsumerBuilder<U::Transport>) -> Option<ConsumerBuilder<U::Transport>>,
        groups: bool,
    ) -> Result<Option<Started<U::Transport>>, Failure> {
        let attempts = Attempts::default();
        let builder = self
            .under_test
            .consumer(source, self.pool.clone())
            .consumer_name(source)
            .concurrency(2)
            .prefetch(10)
            .dead_letters(DeadLetters::Table)
            .redelivery(RedeliveryPolicy::delayed([DELAY]).max_attempts(3))
            .shutdown_timeout(Duration::from_secs(10));
        let Some(builder) = configure(builder) else {
            return Ok(None);
        };
        let builder = builder.handler(handler(attempts.clone(), source.to_owned()));
        let builder = if groups {
            builder.message_groups()
        } else {
            builder
        };
        let consumer: Consumer<U::Transport> =
            builder.build().map_err(|source| Failure::Store {
                step: "build the consumer".into(),
                source,
            })?;
        let (stats, health, stop) = (
            consumer.stats(),
            consumer.health(),
            consumer.shutdown_handle(),
        );
        let task = tokio::spawn(consumer.run());
        let consuming = tokio::time::timeout(
            PATIENCE,
            health.wait_for(|h| h.state == RuntimeState::Consuming),
        );
        if consuming.await.is_err() {
            stop.shutdown_now();
            return Err(unexpected(
                "start the consumer",
                "consuming",
                health.snapshot(),
            ));
        }
        Ok(Some(Started {
            source: source.to_owned(),
            attempts,
            stats,
            health,
            stop,
            task,
            _transport: std::marker::PhantomData,
        }))
    }

    /// [`start`](Self::start) with message groups on `x-group-id`.
    pub(super) async fn start_grouped(
        &self,
        source: &str,
    ) -> Result<Option<Started<U::Transport>>, Failure> {
        self.start_with(source, Some, true).await
    }

    pub(super) async fn publish(
        &self,
        source: &str,
        id: &str,
        body: &KitBody,
    ) -> Result<(), Failure> {
        self.publish_with(source, id, &[], body).await
    }

    pub(super) async fn publish_with(
        &self,
        source: &str,
        id: &str,
        headers: &[(&str, &str)],
        body: &KitBody,
    ) -> Result<(), Failure> {
        let bytes = serde_json::to_vec(body).expect("a kit body serialises");
        self.under_test
            .publish(source, id, headers, &bytes)
            .await
            .map_err(|e| unexpected(&format!("publish {id}"), "published", e))
    }

    pub(super) async fn effects(&self, source: &str, id: &str) -> Result<i64, Failure> {
        sqlx::query_scalar(
            "SELECT count(*) FROM idempo_conformance_effects WHERE source = $1 AND message_id = $2",
        )
        .bind(source)
        .bind(id)
        .fetch_one(self.pool)
        .await
        .map_err(|e| Failure::Store {
            step: format!("count the effects of {id}"),
            source: e.into(),
        })
    }

    pub(super) async fn letter_reason(
        &self,
        source: &str,
        id: &str,
    ) -> Result<Option<String>, Failure> {
        sqlx::query_scalar(
            "SELECT reason FROM dead_letters WHERE consumer = $1 AND message_id IS NOT DISTINCT FROM $2",
        )
        .bind(source)
        .bind(id)
        .fetch_optional(self.pool)
        .await
        .map_err(|e| Failure::Store {
            step: format!("read the dead letter of {id}"),
            source: e.into(),
        })
    }
}

/// Waits until `condition` holds of the consumer's counters.
pub(super) async fn settled<T: Transport>(
    c: &Started<T>,
    what: &str,
    condition: impl Fn(&crate::consumer::StatsSnapshot) -> bool,
) -> Result<(), Failure> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let stats = c.stats.snapshot();
        if condition(&stats) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(unexpected(
                &format!("wait for {what} on {}", c.source),
                "within a minute",
                stats,
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(super) async fn wait(what: &str, condition: impl Fn() -> bool) -> Result<(), Failure> {
    let deadline = Instant::now() + PATIENCE;
    while !condition() {
        if Instant::now() > deadline {
            return Err(unexpected(what, "within a minute", "not yet"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Stops the consumer gracefully: `run` must return `Ok`, in time.
pub(super) async fn stop<T: Transport>(c: Started<T>) -> Result<bool, Failure> {
    c.stop.shutdown();
    match tokio::time::timeout(PATIENCE, c.task).await {
        Ok(Ok(Ok(()))) => Ok(true),
        Ok(Ok(Err(error))) => Err(Failure::Store {
            step: format!("stop the consumer of {}", c.source),
            source: error,
        }),
        Ok(Err(panic)) => Err(unexpected("stop the consumer", "Ok", panic)),
        Err(_) => Err(unexpected(
            "stop the consumer",
            "within a minute",
            "still running",
        )),
    }
}

/// The kit's handler: records the attempt, then behaves as the body says;
/// a successful attempt writes its effect (and a forward) in the
/// delivery's transaction.
fn handler(
    attempts: Attempts,
    source: String,
) -> impl Fn(crate::Tx, Message) -> futures::future::BoxFuture<'static, Result<(), HandlerError>>
+ Send
+ Sync
+ 'static {
    move |tx: crate::Tx, message: Message| {
        let (attempts, source) = (attempts.clone(), source.clone());
        Box::pin(async move {
            let body: KitBody = message.json()?;
            let attempt = {
                let mut seen = attempts.lock().expect("not poisoned");
                let list = seen.entry(message.id().to_owned()).or_default();
                list.push(Instant::now());
                list.len()
            };
            if body.sleep_ms > 0 {
                tokio::time::sleep(Duration::from_millis(body.sleep_ms)).await;
            }
            match body.fail {
                Fail::Always => return Err(HandlerError::permanent("refused for good")),
                Fail::Once if attempt == 1 => {
                    return Err(HandlerError::transient("unavailable for now"));
                }
                _ => {}
            }
            let mut tx = tx.try_lock()?;
            sqlx::query(
                "INSERT INTO idempo_conformance_effects (source, message_id) VALUES ($1, $2)",
            )
            .bind(&source)
            .bind(message.id())
            .execute(&mut *tx)
            .await?;
            if let Some(to) = &body.forward_to {
                let forward = OutboxMessage::new("", to, message.body().to_vec())
                    .derived_id(message.id(), "kit");
                outbox::stage(&mut tx, forward).await?;
            }
            Ok(())
        })
    }
}
