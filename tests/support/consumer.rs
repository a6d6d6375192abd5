//! A consumer running in the background of a test, and handler builders.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use idempo::Tx;
use idempo::amqp::{Consumer, ConsumerBuilder};
use idempo::consumer::mode::{Batched, NoHandler, PerMessage};
use idempo::consumer::{
    HandlerError, Health, Message, RedeliveryPolicy, ShutdownHandle, Stats, StatsSnapshot,
};
use tokio::task::JoinHandle;

use super::{Db, eventually, payments};

pub const WAIT: Duration = Duration::from_secs(30);

/// A consumer running in the background.
pub struct Running {
    pub shutdown: ShutdownHandle,
    pub stats: Stats,
    pub health: Health,
    pub task: JoinHandle<idempo::Result<()>>,
}

/// A builder in a mode that can be built.
pub trait Build {
    fn build(self) -> idempo::Result<Consumer>;
}

impl Build for ConsumerBuilder<PerMessage> {
    fn build(self) -> idempo::Result<Consumer> {
        ConsumerBuilder::<PerMessage>::build(self)
    }
}

impl Build for ConsumerBuilder<Batched> {
    fn build(self) -> idempo::Result<Consumer> {
        ConsumerBuilder::<Batched>::build(self)
    }
}

#[cfg(feature = "window")]
impl Build for ConsumerBuilder<idempo::consumer::mode::Windowed> {
    fn build(self) -> idempo::Result<Consumer> {
        ConsumerBuilder::<idempo::consumer::mode::Windowed>::build(self)
    }
}

impl Running {
    pub fn start(builder: impl Build) -> Running {
        let consumer = builder.build().expect("valid configuration");
        let shutdown = consumer.shutdown_handle();
        let stats = consumer.stats();
        let health = consumer.health();
        let task = tokio::spawn(consumer.run());
        Running {
            shutdown,
            stats,
            health,
            task,
        }
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Waits until `n` deliveries reached an end (acked, dead-lettered).
    pub async fn settled(&self, n: u64) {
        eventually(&format!("{n} deliveries settled"), WAIT, || async {
            let s = self.stats();
            s.processed + s.duplicates + s.dead_lettered >= n
        })
        .await;
    }

    /// Waits until `n` deliveries settled, stops gracefully, and returns the
    /// final counters.
    pub async fn finish(self, n: u64) -> StatsSnapshot {
        self.settled(n).await;
        let stats = self.stats.clone();
        self.stop().await.expect("a graceful stop returns Ok");
        stats.snapshot()
    }

    pub async fn stop(self) -> idempo::Result<()> {
        self.shutdown.shutdown();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the consumer stops within the timeout")
            .expect("the consumer task does not panic")
    }
}

/// A consumer of `queue`, retrying quickly, still without a handler.
pub fn consumer_for(db: &Db, queue: &str) -> ConsumerBuilder<NoHandler> {
    Consumer::builder(super::amqp_url(), db.pool.clone())
        .queue(queue)
        .redelivery(RedeliveryPolicy::delayed([super::RETRY_DELAY]))
}

/// The payments consumer of `queue`, retrying quickly.
pub fn payments_consumer(db: &Db, queue: &str) -> ConsumerBuilder<PerMessage> {
    consumer_for(db, queue).handler(|tx, message| payments::handle(tx, message, 0.0))
}

pub type HandlerFuture = BoxFuture<'static, Result<(), HandlerError>>;

/// The payments handler followed by `after(attempt, tx)` on the same
/// transaction (attempt counts from 0); also returns the attempt counter.
pub fn payments_then<F, Fut>(
    after: F,
) -> (
    Arc<AtomicUsize>,
    impl Fn(Tx, Message) -> HandlerFuture + Clone + Send + Sync + 'static,
)
where
    F: Fn(usize, Tx) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    let attempts = Arc::new(AtomicUsize::new(0));
    let counter = attempts.clone();
    let handler = move |tx: Tx, message: Message| {
        let (counter, after) = (counter.clone(), after.clone());
        Box::pin(async move {
            let payment: payments::Payment = message.json()?;
            payments::apply(tx.clone(), message.id(), &payment, 0.0).await?;
            after(counter.fetch_add(1, Ordering::SeqCst), tx).await
        }) as HandlerFuture
    };
    (attempts, handler)
}

/// The payments handler, then a pause of `pause` after notifying `started`.
pub fn slow_payments(
    pause: Duration,
) -> (
    Arc<tokio::sync::Notify>,
    impl Fn(Tx, Message) -> HandlerFuture + Clone + Send + Sync + 'static,
) {
    let started = Arc::new(tokio::sync::Notify::new());
    let signal = started.clone();
    let (_, handler) = payments_then(move |_, _tx| {
        let signal = signal.clone();
        async move {
            signal.notify_one();
            tokio::time::sleep(pause).await;
            Ok(())
        }
    });
    (started, handler)
}

/// What a [`counting_payments`] handler saw: the `x-idempo-attempts` header of
/// each attempt, and when each attempt started.
#[derive(Debug, Default)]
pub struct Attempts {
    pub headers: Vec<Option<i64>>,
    pub at: Vec<std::time::Instant>,
}

/// The payments handler that records each attempt and fails the first
/// `failures` attempts (after writing) with a transient error, asking for
/// `retry_after` if given.
pub fn counting_payments(
    failures: usize,
    retry_after: Option<Duration>,
) -> (
    Arc<std::sync::Mutex<Attempts>>,
    impl Fn(Tx, Message) -> HandlerFuture + Clone + Send + Sync + 'static,
) {
    let (_, failing) = payments_then(move |attempt, _tx| async move {
        if attempt < failures {
            let error = HandlerError::transient("downstream unavailable");
            return Err(match retry_after {
                Some(delay) => error.retry_after(delay),
                None => error,
            });
        }
        Ok(())
    });
    let seen: Arc<std::sync::Mutex<Attempts>> = Arc::default();
    let record = seen.clone();
    let handler = move |tx: Tx, message: Message| {
        {
            let mut seen = record.lock().unwrap();
            let header = message.amqp().and_then(|m| m.header("x-idempo-attempts"));
            seen.headers.push(match header {
                Some(lapin::types::AMQPValue::LongLongInt(n)) => Some(*n),
                _ => None,
            });
            seen.at.push(std::time::Instant::now());
        }
        failing(tx, message)
    };
    (seen, handler)
}
