//! Dispatch: a session's deliveries become units (one delivery, or a batch
//! collected within the linger), each run as a task once it has a slot (a
//! handler's, or one of the batches in flight); message groups run one at a
//! time in arrival order. The tasks outlive the session that fed them.
//! Written once for every transport: a transport hands its deliveries over
//! as a [`Feed`].

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::Shared;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::health::Health;
use super::message::Message;
use super::mode::Dispatch;
use super::outcome::Settled;
use super::shutdown::ShutdownHandle;
use super::stats::Stats;
use super::transport::Transport;
use super::units::Units;

/// Batches processed at once in batch mode (each on its own connection).
const BATCHES_IN_FLIGHT: usize = 2;

/// One session's deliveries, as a transport hands them to the runtime.
pub trait Feed<R>: Send {
    /// The next delivery with its receipt, or why the session is lost.
    /// Cancel-safe: dropping the future before it resolves loses no
    /// delivery (the runtime drops it to stop, or at the end of a batch's
    /// linger).
    fn next(&mut self) -> impl Future<Output = Result<(Message, R), String>> + Send;
}

/// How [`Deliveries::dispatch`] ended.
#[derive(Debug)]
#[non_exhaustive]
pub enum FeedEnd {
    /// The consumer is stopping: stop receiving (the units in flight carry
    /// on; [`Deliveries::drain`] waits for them).
    Stopped,
    /// The feed said the session is lost (or a unit broke it).
    Lost {
        /// Why.
        error: String,
        /// How long the session had been consuming.
        lasted: Duration,
    },
}

/// The runtime's side of a transport's [`consume`](Transport::consume):
/// where each session's deliveries go.
pub struct Deliveries<T: Transport> {
    dispatcher: Dispatcher,
    units: Arc<Units<T>>,
    shutdown: ShutdownHandle,
    drain_timeout: Duration,
}

impl<T: Transport> std::fmt::Debug for Deliveries<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deliveries")
            .field("consumer", &self.units.router.consumer)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Deliveries<T> {
    pub(crate) fn new(
        dispatch: &Dispatch,
        concurrency: usize,
        units: Arc<Units<T>>,
        shutdown: ShutdownHandle,
        drain_timeout: Duration,
    ) -> Self {
        Deliveries {
            dispatcher: Dispatcher::new(dispatch, concurrency),
            units,
            shutdown,
            drain_timeout,
        }
    }

    /// Runs the units of `feed`'s deliveries until the consumer stops
    /// ([`FeedEnd::Stopped`]) or the feed is lost. Each unit runs in a task
    /// of its own once it has a slot, so deliveries beyond the slots wait
    /// in the broker (bound them with the prefetch).
    pub async fn dispatch(&mut self, feed: &mut impl Feed<T::Receipt>) -> FeedEnd {
        let stop = self.shutdown.graceful_token().clone();
        self.dispatcher.run(feed, &self.units, &stop).await
    }

    /// Lets the units in flight finish, bounded by the consumer's shutdown
    /// timeout (or cut short by an immediate shutdown); drops the rest,
    /// rolling them back.
    pub async fn drain(&mut self) {
        self.dispatcher
            .drain(self.drain_timeout, self.shutdown.now_token())
            .await;
    }

    /// Resolves when the consumer begins to stop.
    pub async fn stopping(&self) {
        self.shutdown.graceful_token().cancelled().await;
    }

    /// Whether the consumer is stopping.
    pub fn is_stopping(&self) -> bool {
        self.shutdown.is_shutdown()
    }

    /// The consumer's shutdown: an immediate one means the transport must
    /// not wait for the broker either.
    pub fn shutdown(&self) -> &ShutdownHandle {
        &self.shutdown
    }

    /// The consumer's health, where a transport reports its connection.
    pub fn health(&self) -> &Health {
        &self.units.health
    }

    /// The consumer's counters.
    pub fn stats(&self) -> &Stats {
        &self.units.stats
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        &self.units.router.consumer
    }

    /// Batch mode's size and linger, if the consumer batches.
    pub fn batch(&self) -> Option<(usize, Duration)> {
        self.dispatcher.batch
    }
}

/// What the feed gave.
enum Next<R> {
    Delivery(Message, R),
    /// The batch's linger time is over.
    Deadline,
    End(FeedEnd),
}

/// The units in flight, across sessions: handlers of a lost session carry on
/// (their settlement may fail; the redelivery is deduplicated).
struct Dispatcher {
    permits: Arc<Semaphore>,
    tasks: JoinSet<()>,
    groups: GroupChains,
    /// Batch mode: up to this many deliveries per unit, within the linger.
    batch: Option<(usize, Duration)>,
    /// Message groups: the header that names a delivery's group.
    group_header: Option<String>,
}

impl Dispatcher {
    fn new(dispatch: &Dispatch, concurrency: usize) -> Self {
        Dispatcher {
            // In batch mode the slots are batches in flight: one committing
            // while the next is collected and claimed.
            permits: Arc::new(Semaphore::new(match dispatch.batch {
                Some(_) => BATCHES_IN_FLIGHT,
                None => concurrency,
            })),
            tasks: JoinSet::new(),
            groups: GroupChains::default(),
            batch: dispatch.batch,
            group_header: dispatch.groups.clone(),
        }
    }

    async fn next<R>(
        feed: &mut impl Feed<R>,
        stop: &CancellationToken,
        broken: &CancellationToken,
        deadline: Option<tokio::time::Instant>,
        since: Instant,
    ) -> Next<R> {
        let linger = async {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        let lost = |error: String| {
            Next::End(FeedEnd::Lost {
                error,
                lasted: since.elapsed().max(Duration::from_nanos(1)),
            })
        };
        tokio::select! {
            biased;
            () = stop.cancelled() => Next::End(FeedEnd::Stopped),
            () = broken.cancelled() => {
                lost("a delivery task panicked outside the handler".into())
            }
            next = feed.next() => match next {
                Ok((message, receipt)) => Next::Delivery(message, receipt),
                Err(error) => lost(error),
            },
            () = linger => Next::Deadline,
        }
    }

    /// The next unit: one delivery, or a batch of up to `size` collected
    /// within `linger` of its first.
    async fn unit<R>(
        &self,
        feed: &mut impl Feed<R>,
        stop: &CancellationToken,
        broken: &CancellationToken,
        since: Instant,
    ) -> Result<Vec<(Message, R)>, FeedEnd> {
        let first = loop {
            match Self::next(feed, stop, broken, None, since).await {
                Next::Delivery(message, receipt) => break (message, receipt),
                Next::End(end) => return Err(end),
                Next::Deadline => continue,
            }
        };
        let Some((size, linger)) = self.batch else {
            return Ok(vec![first]);
        };
        let deadline = tokio::time::Instant::now() + linger;
        let mut unit = vec![first];
        while unit.len() < size {
            match Self::next(feed, stop, broken, Some(deadline), since).await {
                Next::Delivery(message, receipt) => unit.push((message, receipt)),
                Next::Deadline => break,
                // Deliveries collected when the session ends stay unsettled
                // and are delivered again.
                Next::End(end) => return Err(end),
            }
        }
        Ok(unit)
    }

    /// Runs units from `feed` until `stop` or the feed's loss.
    async fn run<T: Transport>(
        &mut self,
        feed: &mut impl Feed<T::Receipt>,
        units: &Arc<Units<T>>,
        stop: &CancellationToken,
    ) -> FeedEnd {
        let since = Instant::now();
        // Fired by a unit that panicked outside the handler: its deliveries
        // are unsettled, and a new session hands them back.
        let broken = CancellationToken::new();
        loop {
            while let Some(done) = self.tasks.try_join_next() {
                log_task_failure(done);
            }
            let unit = match self.unit(feed, stop, &broken, since).await {
                Ok(unit) => unit,
                Err(end) => return end,
            };
            // In a group, wait for the delivery that arrived before this one.
            let (predecessor, done) = match (unit.as_slice(), &self.group_header) {
                ([(message, _)], Some(header)) => match message.header_text(header) {
                    Some(group) => {
                        let (predecessor, done) = self.groups.enqueue(group);
                        (predecessor, Some(done))
                    }
                    None => (None, None),
                },
                _ => (None, None),
            };
            // Wait for a free slot (a handler, or one of the batches in
            // flight); work that never gets one is left unsettled. A grouped
            // delivery takes its slot only once its predecessor is done, so
            // a busy group never holds slots the other groups need.
            let (unit, permit) = if done.is_some() {
                (unit, None)
            } else if let Ok(permit) = self.permits.clone().try_acquire_owned() {
                (unit, Some(permit))
            } else {
                let permits = self.permits.clone();
                let (unit, permit) = kept_alive(units, unit, async {
                    tokio::select! {
                        biased;
                        () = stop.cancelled() => None,
                        permit = permits.acquire_owned() => Some(permit.expect("the semaphore is never closed")),
                    }
                })
                .await;
                match permit {
                    Some(permit) => (unit, Some(permit)),
                    None => return FeedEnd::Stopped,
                }
            };
            let (permits, stop) = (self.permits.clone(), stop.clone());
            let (units, broken) = (units.clone(), broken.clone());
            self.tasks.spawn(async move {
                let mut permit = permit;
                let mut unit = unit;
                if done.is_some() {
                    let (waited, slot) = kept_alive(&units, unit, async {
                        // The predecessor must have settled: if it was
                        // abandoned (shutdown, a lost channel, a panic),
                        // running this one would overtake its redelivery.
                        // Leave it unsettled: the broker hands it back in order.
                        let settled = match predecessor {
                            Some(predecessor) => matches!(predecessor.await, Ok(true)),
                            None => true,
                        };
                        if !settled || stop.is_cancelled() {
                            return None;
                        }
                        tokio::select! {
                            biased;
                            () = stop.cancelled() => None,
                            slot = permits.acquire_owned() => Some(slot.expect("the semaphore is never closed")),
                        }
                    })
                    .await;
                    match slot {
                        Some(slot) => permit = Some(slot),
                        None => return, // `done` drops unsent: the group's next one abandons too
                    }
                    unit = waited;
                }
                // A panic outside the handler (a message-id function, a
                // FromMessage impl) leaves deliveries unsettled; in AMQP's
                // batch mode it would also stall the coalesced acks. A new
                // session hands them all back.
                match AssertUnwindSafe(units.run(unit)).catch_unwind().await {
                    Ok(settled) => {
                        if let Some(done) = done {
                            let _ = done.send(!settled.contains(&Settled::Abandoned));
                        }
                    }
                    Err(_) => {
                        tracing::error!(
                            "a delivery task panicked outside the handler; reconnecting"
                        );
                        broken.cancel();
                    }
                }
                drop(permit);
            });
        }
    }

    /// Lets the units in flight finish (bounded by `timeout`, or cut short
    /// by `now`); drops the rest, rolling them back.
    async fn drain(&mut self, timeout: Duration, now: &CancellationToken) {
        let tasks = &mut self.tasks;
        let drain = async {
            while let Some(done) = tasks.join_next().await {
                log_task_failure(done);
            }
        };
        let drained = tokio::select! {
            drained = tokio::time::timeout(timeout, drain) => drained.is_ok(),
            () = now.cancelled() => false,
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
    last: HashMap<String, Shared<oneshot::Receiver<bool>>>,
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

/// Waits for `wait` while the transport keeps `unit`'s deliveries alive: a
/// delivery waiting for a slot (or for its group's predecessor) is not
/// redelivered meanwhile, as JetStream does once its ack wait has run.
async fn kept_alive<T: Transport, R>(
    units: &Units<T>,
    unit: Vec<(Message, T::Receipt)>,
    wait: impl Future<Output = R>,
) -> (Vec<(Message, T::Receipt)>, R) {
    let (messages, receipts): (Vec<Message>, Vec<T::Receipt>) = unit.into_iter().unzip();
    let waited = {
        let alive = units.transport.while_running(&receipts);
        tokio::pin!(wait);
        tokio::select! {
            waited = &mut wait => waited,
            () = alive => wait.await,
        }
    };
    (messages.into_iter().zip(receipts).collect(), waited)
}

/// Handler panics are caught inside the task; a failed task means a bug in
/// idempo itself. Its delivery stays unsettled and is redelivered.
fn log_task_failure(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && !e.is_cancelled()
    {
        tracing::error!(error = %e, "delivery task failed");
    }
}
