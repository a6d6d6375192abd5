//! Dispatch: a session's deliveries become units (one delivery, or a batch
//! collected within the linger), each run as a task once it has a slot (a
//! handler's, or one of the batches in flight); message groups run one at a
//! time in arrival order. The tasks outlive the session that fed them.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::Shared;
use futures::{FutureExt, StreamExt};
use lapin::Connection;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::amqp::delivery::Pipeline;
use crate::amqp::fields::string_header;
use crate::runtime::mode::Dispatch;
use crate::runtime::outcome::Settled;

/// Batches processed at once in batch mode (each on its own connection).
const BATCHES_IN_FLIGHT: usize = 2;

/// How a session's stream of deliveries ended.
pub(crate) enum FeedEnd {
    /// Shutdown was requested.
    Shutdown,
    /// The connection, a channel or the subscription was lost.
    Lost {
        error: String,
        /// The client could not parse a delivery's frames.
        unparseable: bool,
    },
}

/// The delivery stream of one session, and what ends it.
pub(crate) struct Feed<'a> {
    pub(crate) deliveries: &'a mut lapin::Consumer,
    pub(crate) channel: &'a lapin::Channel,
    pub(crate) connection: &'a Connection,
    /// Fired when the session must end (republishing channels gone, a tag
    /// the ack bookkeeping cannot place).
    pub(crate) broken: &'a CancellationToken,
    pub(crate) shutdown: &'a CancellationToken,
    pub(crate) queue: &'a str,
}

/// What the delivery stream gave.
enum Next {
    Delivery(Box<lapin::message::Delivery>),
    /// The batch's linger time is over.
    Deadline,
    End(FeedEnd),
}

impl Feed<'_> {
    async fn next(&mut self, deadline: Option<tokio::time::Instant>) -> Next {
        let lost = |error: String| {
            Next::End(FeedEnd::Lost {
                error,
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
            () = self.shutdown.cancelled() => return Next::End(FeedEnd::Shutdown),
            () = self.broken.cancelled() => return lost("the republishing channels were lost".into()),
            next = self.deliveries.next() => next,
            () = linger => return Next::Deadline,
        };
        match next {
            Some(Ok(delivery)) => Next::Delivery(Box::new(delivery)),
            Some(Err(e)) if matches!(e.kind(), lapin::ErrorKind::ParsingError(_)) => {
                Next::End(FeedEnd::Lost {
                    error: format!("a delivery could not be parsed: {e}"),
                    unparseable: true,
                })
            }
            Some(Err(e)) => lost(format!("consuming failed: {e}")),
            None if self.channel.status().connected() && self.connection.status().connected() => {
                let error = crate::amqp::AmqpError::ConsumerCancelled {
                    queue: self.queue.to_owned(),
                };
                lost(format!("{error} (was the queue deleted?)"))
            }
            None => lost("the channel closed".into()),
        }
    }

    /// The next unit: one delivery, or a batch of up to `size` collected
    /// within `linger` of its first.
    async fn unit(
        &mut self,
        batch: Option<(usize, Duration)>,
    ) -> Result<Vec<lapin::message::Delivery>, FeedEnd> {
        let first = loop {
            match self.next(None).await {
                Next::Delivery(delivery) => break delivery,
                Next::End(end) => return Err(end),
                Next::Deadline => continue,
            }
        };
        let Some((size, linger)) = batch else {
            return Ok(vec![*first]);
        };
        let deadline = tokio::time::Instant::now() + linger;
        let mut unit = vec![*first];
        while unit.len() < size {
            match self.next(Some(deadline)).await {
                Next::Delivery(delivery) => unit.push(*delivery),
                Next::Deadline => break,
                // Deliveries collected when the session ends stay unacked
                // and return to the queue when the channel closes.
                Next::End(end) => return Err(end),
            }
        }
        Ok(unit)
    }
}

/// The units in flight, across sessions: handlers of a lost session carry on
/// (their ack may fail; the redelivery is deduplicated).
pub(crate) struct Dispatcher {
    permits: Arc<Semaphore>,
    tasks: JoinSet<()>,
    groups: GroupChains,
    /// Batch mode: up to this many deliveries per unit, within the linger.
    batch: Option<(usize, Duration)>,
    /// Message groups: the header that names a delivery's group.
    group_header: Option<String>,
}

impl Dispatcher {
    pub(crate) fn new(dispatch: &Dispatch, concurrency: usize) -> Self {
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

    /// Runs units from `feed` until shutdown or the session's loss; returns
    /// how it ended and how long it had been consuming.
    pub(crate) async fn run(
        &mut self,
        mut feed: Feed<'_>,
        pipeline: Arc<Pipeline>,
    ) -> (FeedEnd, Duration) {
        let since = Instant::now();
        let end = loop {
            while let Some(done) = self.tasks.try_join_next() {
                log_task_failure(done);
            }
            let unit = match feed.unit(self.batch).await {
                Ok(unit) => unit,
                Err(end) => break end,
            };
            // In a group, wait for the delivery that arrived before this one.
            let (predecessor, done) = match (unit.as_slice(), &self.group_header) {
                ([delivery], Some(header)) => {
                    match string_header(delivery.properties.headers().as_ref(), header) {
                        Some(group) => {
                            let (predecessor, done) = self.groups.enqueue(group);
                            (predecessor, Some(done))
                        }
                        None => (None, None),
                    }
                }
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
                    () = feed.shutdown.cancelled() => break FeedEnd::Shutdown,
                    permit = self.permits.clone().acquire_owned() => Some(permit.expect("the semaphore is never closed")),
                }
            };
            let (permits, shutdown) = (self.permits.clone(), feed.shutdown.clone());
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
        (end, since.elapsed().max(Duration::from_nanos(1)))
    }

    /// Lets the units in flight finish (bounded by `timeout`, or cut short
    /// by `now`); drops the rest, rolling them back.
    pub(crate) async fn drain(&mut self, timeout: Duration, now: &CancellationToken) {
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

/// Handler panics are caught inside the task; a failed task means a bug in
/// idempo itself. Its delivery stays unacked and is redelivered.
fn log_task_failure(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && !e.is_cancelled()
    {
        tracing::error!(error = %e, "delivery task failed");
    }
}
