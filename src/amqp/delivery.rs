//! The per-delivery state machine, for per-message and batch mode alike; and
//! `settle`, the only code that acks, nacks, retries or dead-letters.
//!
//! A *unit* is one delivery (per-message mode) or a batch of them. Each unit
//! goes through the same steps; a batch that fails as a whole is split into
//! units of one, which go through them again:
//!
//! ```text
//! received ─► id ─► Decode ─► Begin ─► Claim ─┬─ all Duplicate/Mismatch ─► ROLLBACK ─► decided
//!              │       │                      └─ Fresh ─► Handle ─┬─ Ok ─► Commit (claim check + COMMIT, one round trip) ─► Processed
//!              │       └─ undecodable ─► DeadLetter                └─ error / panic / timeout ─► ROLLBACK ─► Failed
//!              └─ missing/invalid ─► DeadLetter
//!
//! Failed         = one delivery: its outcome (Retry, or DeadLetter for a permanent error)
//!                  a batch: Split ─► each delivery alone, from Decode
//! AwaitDatabase  = a connection-level error at any step ─► ROLLBACK ─► wait at the gate ─► Decode again
//!                  (shutdown or a closed channel: Abandoned; after 5 passes: Failed)
//! settle         = Processed, Duplicate ─► ack (batch mode: one multiple ack over settled tags)
//!                  DeadLetter ─► publish to <queue>.dlq (confirmed) ─► ack
//!                  Retry ─► publish to <queue>.retry.<delay> (confirmed) ─► ack; attempts used up: DeadLetter;
//!                           requeue policy: pause ─► nack(requeue)
//!                  a copy that is not confirmed ─► pause ─► nack(requeue): never acked
//!                  Abandoned ─► nothing: the delivery returns when its channel closes
//! ```
//!
//! Dropping the future (shutdown timeout) at any `.await` is safe: before the
//! commit, the transaction rolls back when dropped and the unacked delivery
//! returns to the queue when the channel closes; during or after the commit,
//! the redelivery is claimed as a duplicate and acknowledged.

use std::any::Any;
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::AMQPValue;
use sqlx::{PgPool, Postgres, Transaction};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span, field};

use super::acks::{AckTracker, Misplaced};
use super::database_gate::DatabaseGate;
use super::dead_letter::DeadLetterReason;
use super::handler::{Call, HandlerError, Prepare};
use super::headers::{
    CONSUMER_HEADER, ERROR_HEADER, Failures, MESSAGE_ID_HEADER, MESSAGE_ID_SEAL_HEADER,
    QUEUE_HEADER, REASON_HEADER, ROUTING_KEY_HEADER, original_routing_key,
};
use super::health::Health;
use super::publish::PublishError;
use super::redelivery::{Mode, RedeliveryPolicy, delay_queue};
use super::republish::Republisher;
use super::seal::{Keyring, claimed_id};
use super::stats::{Counter, Stats};
use super::{DecodeError, Message, MessageIdSource};
use crate::error::lost_connection;
use crate::inbox::{self, Claim, InvalidMessageId};
use crate::{Error, Tx};

/// The claim relies on READ COMMITTED (a duplicate's follow-up read must see
/// the row another transaction just committed), whatever the database default.
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Passes that end in a connection error although the database answered in
/// between: after this many, the error is the unit's (a statement that kills
/// its own connection, a second pool) and it fails like any other error.
const MAX_DATABASE_PASSES: u32 = 5;

/// Error texts in headers are cut to this: a frame carries the headers whole.
const MAX_ERROR_HEADER: usize = 4096;

/// A pause before handing a delivery back with nack when no confirmed
/// republish was possible, so a failing broker path is not hammered.
const FALLBACK_PAUSE: Duration = Duration::from_secs(1);

/// How long a copy waits for the consumer's key before it goes out unsealed.
const KEY_WAIT: Duration = Duration::from_millis(500);

/// How a delivery is to end: decided by the steps, carried out by `settle`.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// The handler ran and its transaction committed: ack.
    Processed,
    /// Already processed with the same body: ack without running the handler.
    Duplicate,
    /// Final failure: publish to the DLQ (confirmed), then ack.
    DeadLetter {
        reason: DeadLetterReason,
        error: String,
    },
    /// Might succeed later: retry per the policy.
    Retry {
        error: String,
        requested_delay: Option<Duration>,
    },
    /// Shutdown came, or the channel closed, while the delivery waited: leave
    /// it unacked; it returns to the queue when the channel closes.
    Abandoned,
}

/// How a delivery was settled: the `outcome` field of its span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    Processed,
    Duplicate,
    DeadLettered,
    /// Republished to a delay queue, or handed back with nack.
    Retried,
    /// Left unacked on purpose.
    Abandoned,
}

impl Settled {
    fn as_str(self) -> &'static str {
        match self {
            Settled::Processed => "processed",
            Settled::Duplicate => "duplicate",
            Settled::DeadLettered => "dead_lettered",
            Settled::Retried => "retried",
            Settled::Abandoned => "abandoned",
        }
    }
}

/// What decides the outcome of the deliveries of a unit: the inbox steps
/// below, or (feature `window`) the dedup window of `amqp::window`.
pub(crate) trait Decide: Send + Sync + 'static {
    /// One outcome per message, in order. Every message has its id.
    fn decide<'a>(
        &'a self,
        messages: &'a [Message],
        abandon: &'a Abandon,
    ) -> BoxFuture<'a, Vec<Outcome>>;
}

/// What makes a waiting delivery give up: shutdown, or its channel closing
/// (a reconnect, the broker's consumer timeout), after which the broker
/// redelivers it anyway.
pub(crate) struct Abandon {
    pub(crate) shutdown: CancellationToken,
    /// A delivery of the unit: its channel is the unit's.
    pub(crate) channel: Option<Acker>,
}

impl Abandon {
    /// Resolves when waiting is pointless.
    pub(crate) async fn wait(&self) {
        let closed = async {
            match &self.channel {
                // lapin poisons every acker of a channel that closed.
                Some(acker) => {
                    while !acker.poisoned() {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = self.shutdown.cancelled() => {}
            () = closed => {}
        }
    }
}

/// The steps of one unit through the inbox: BEGIN, claim, handler, commit.
pub(crate) struct InboxSteps {
    pub(crate) consumer: String,
    pub(crate) pool: PgPool,
    pub(crate) handler: Arc<dyn Prepare>,
    pub(crate) handler_timeout: Duration,
    pub(crate) gate: Arc<DatabaseGate>,
    pub(crate) stats: Stats,
}

/// Deliveries that go through the steps together: indexes into the messages.
struct Unit {
    members: Vec<usize>,
    /// Passes that ended at the database gate.
    passes: u32,
}

impl Unit {
    fn new(members: Vec<usize>) -> Self {
        Unit { members, passes: 0 }
    }

    fn ids<'m>(&self, messages: &'m [Message]) -> Vec<(&'m str, &'m [u8])> {
        self.members
            .iter()
            .map(|&m| (messages[m].id(), messages[m].body()))
            .collect()
    }

    fn messages(&self, messages: &[Message]) -> Vec<Message> {
        self.members.iter().map(|&m| messages[m].clone()).collect()
    }
}

/// Where a unit stands.
enum Step {
    /// Decode the bodies; one that does not decode leaves the unit, dead-lettered.
    Decode(Unit),
    Begin(Unit, Call),
    /// Claim every id of the unit in the transaction.
    Claim(Unit, Call, Transaction<'static, Postgres>),
    /// Run the handler over the unit, now only fresh messages.
    Handle(Unit, Call, Transaction<'static, Postgres>),
    /// Check that the claims are still in the transaction, and COMMIT.
    /// With what the handler staged in the outbox.
    Commit(Unit, Transaction<'static, Postgres>, Staging),
    /// A connection-level database error: wait at the gate, then decode again.
    AwaitDatabase(Unit, String),
    /// The unit failed: the outcome a delivery on its own gets; a batch is
    /// split instead.
    Failed(Unit, Outcome),
    /// Every member of the unit ends this way.
    Decided(Unit, Outcome),
    /// Every member's outcome is recorded.
    Done,
}

/// How a handler call ended.
pub(crate) enum HandlerRun {
    Done,
    Failed(HandlerError),
    Panicked(String),
    TimedOut,
}

impl Decide for InboxSteps {
    fn decide<'a>(
        &'a self,
        messages: &'a [Message],
        abandon: &'a Abandon,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(self.run(messages, abandon))
    }
}

impl InboxSteps {
    /// Drives every unit to its end: the state machine.
    async fn run(&self, messages: &[Message], abandon: &Abandon) -> Vec<Outcome> {
        let mut decided: Vec<Option<Outcome>> = vec![None; messages.len()];
        let mut units = VecDeque::from([Unit::new((0..messages.len()).collect())]);
        while let Some(unit) = units.pop_front() {
            let mut step = Step::Decode(unit);
            loop {
                step = match step {
                    Step::Decode(unit) => self.decode(unit, messages, &mut decided),
                    Step::Begin(unit, call) => match self.pool.begin_with(BEGIN).await {
                        Ok(tx) => Step::Claim(unit, call, tx),
                        Err(e) => database_error(unit, "cannot begin a transaction", e.into()),
                    },
                    Step::Claim(unit, call, tx) => {
                        self.claim(unit, call, tx, messages, &mut decided).await
                    }
                    Step::Handle(unit, call, tx) => self.handle(unit, call, tx).await,
                    Step::Commit(unit, tx, staged) => self.commit(unit, tx, staged, messages).await,
                    Step::AwaitDatabase(unit, error) => {
                        self.await_database(unit, error, abandon).await
                    }
                    Step::Failed(unit, outcome) if unit.members.len() == 1 => {
                        Step::Decided(unit, outcome)
                    }
                    Step::Failed(unit, outcome) => {
                        // Something failed that may concern one delivery only:
                        // each goes through the steps on its own, in order.
                        let reason = match &outcome {
                            Outcome::DeadLetter { error, .. } | Outcome::Retry { error, .. } => {
                                error.as_str()
                            }
                            _ => "",
                        };
                        tracing::warn!(error = %reason, size = unit.members.len(), "batch failed; processing its deliveries one by one");
                        for &member in unit.members.iter().rev() {
                            units.push_front(Unit::new(vec![member]));
                        }
                        Step::Done
                    }
                    Step::Decided(unit, outcome) => {
                        for &member in &unit.members {
                            decided[member] = Some(outcome.clone());
                        }
                        Step::Done
                    }
                    Step::Done => break,
                };
            }
        }
        // Every member is decided above; a gap would be a bug, and leaving
        // that delivery unacked (redelivered) is the safe way to survive it.
        decided
            .into_iter()
            .map(|o| o.unwrap_or(Outcome::Abandoned))
            .collect()
    }

    fn decode(
        &self,
        mut unit: Unit,
        messages: &[Message],
        decided: &mut [Option<Outcome>],
    ) -> Step {
        loop {
            if unit.members.is_empty() {
                return Step::Done;
            }
            match self.handler.prepare(&unit.messages(messages)) {
                Ok(call) => return Step::Begin(unit, call),
                Err((i, e)) => {
                    let member = unit.members.remove(i);
                    decided[member] = Some(undecodable(&e));
                }
            }
        }
    }

    async fn claim(
        &self,
        unit: Unit,
        call: Call,
        mut tx: Transaction<'static, Postgres>,
        messages: &[Message],
        decided: &mut [Option<Outcome>],
    ) -> Step {
        let ids = unit.ids(messages);
        let claims = match ids.as_slice() {
            [(id, body)] => inbox::claim(&mut tx, &self.consumer, id, body)
                .await
                .map(|claim| vec![claim]),
            _ => inbox::claim_batch(&mut tx, &self.consumer, &ids).await,
        };
        let claims = match claims {
            Ok(claims) => claims,
            Err(e) => return database_error(unit, "claim failed", e),
        };
        let mut fresh = Vec::with_capacity(claims.len());
        for (&member, claim) in unit.members.iter().zip(claims) {
            match claim {
                Claim::Fresh => fresh.push(member),
                Claim::Duplicate => decided[member] = Some(Outcome::Duplicate),
                Claim::Mismatch => decided[member] = Some(self.mismatch(&messages[member])),
            }
        }
        if fresh.is_empty() {
            rollback(tx).await;
            return Step::Done;
        }
        let all_fresh = fresh.len() == unit.members.len();
        let unit = Unit {
            members: fresh,
            passes: unit.passes,
        };
        // The usual case: the call decoded for the whole unit serves.
        if all_fresh {
            return Step::Handle(unit, call, tx);
        }
        match self.handler.prepare(&unit.messages(messages)) {
            Ok(call) => Step::Handle(unit, call, tx),
            // Decoded once already: a type that decodes differently the
            // second time fails the unit.
            Err((_, e)) => {
                rollback(tx).await;
                Step::Failed(unit, undecodable(&e))
            }
        }
    }

    async fn handle(&self, unit: Unit, call: Call, tx: Transaction<'static, Postgres>) -> Step {
        let tx = Tx::new(tx);
        // The connection's address once it sits in the handle (it moves no more).
        #[cfg(feature = "outbox")]
        let staging: Staging = std::sync::Arc::new(match tx.try_lock() {
            Ok(guard) => crate::outbox::UnitStaging::on(&guard),
            Err(_) => crate::outbox::UnitStaging::default(),
        });
        #[cfg(not(feature = "outbox"))]
        let staging: Staging = ();
        #[cfg(feature = "outbox")]
        let run = crate::outbox::in_unit(
            staging.clone(),
            guarded(|| call(tx.clone()), self.handler_timeout, &self.stats),
        )
        .await;
        #[cfg(not(feature = "outbox"))]
        let run = guarded(|| call(tx.clone()), self.handler_timeout, &self.stats).await;

        let Some(tx) = tx.take() else {
            // The guard lives on in a task the handler spawned; the
            // transaction rolls back when that guard is dropped.
            return Step::Failed(
                unit,
                retry(
                    "handler finished while a task it spawned still holds the transaction",
                    "rolled back",
                ),
            );
        };
        match run {
            HandlerRun::Done => Step::Commit(unit, tx, staging),
            HandlerRun::Failed(e) => {
                rollback(tx).await;
                if lost_connection(e.source()) {
                    return Step::AwaitDatabase(unit, format!("handler lost its connection: {e}"));
                }
                Step::Failed(unit, handler_failed(e))
            }
            HandlerRun::Panicked(panic) => {
                rollback(tx).await;
                Step::Failed(unit, retry("handler panicked", panic))
            }
            HandlerRun::TimedOut => {
                rollback(tx).await;
                Step::Failed(unit, timed_out(self.handler_timeout))
            }
        }
    }

    async fn commit(
        &self,
        unit: Unit,
        tx: Transaction<'static, Postgres>,
        staging: Staging,
        messages: &[Message],
    ) -> Step {
        // One claim tells for the whole unit: a statement fails in an aborted
        // transaction, and a ROLLBACK took every claim.
        let id = messages[unit.members[0]].id();
        #[cfg(feature = "outbox")]
        let (staged, committed) = {
            let deferred = staging.take_deferred();
            let committed = if deferred.is_empty() {
                inbox::commit(tx, &self.consumer, id).await
            } else {
                crate::outbox::commit_unit(tx, &self.consumer, id, deferred).await
            };
            (staging.staged(), committed)
        };
        #[cfg(not(feature = "outbox"))]
        let (staged, committed) = {
            let () = staging;
            (false, inbox::commit(tx, &self.consumer, id).await)
        };
        match committed {
            Ok(()) => {
                // Staged without NOTIFY when a relay runs here: wake it now.
                #[cfg(feature = "outbox")]
                if staged {
                    crate::outbox::committed_in_process().notify_one();
                }
                let _ = staged;
                Step::Decided(unit, Outcome::Processed)
            }
            Err(e) if e.is_connection_error() => {
                // Maybe committed, maybe not: never ack. The next pass (or
                // the redelivery) is either claimed as a duplicate or runs afresh.
                self.stats.incr(Counter::CommitFailures);
                Step::AwaitDatabase(unit, format!("commit outcome unknown: {e}"))
            }
            Err(Error::ClaimLost { .. }) => Step::Failed(
                unit,
                retry(
                    "the handler ended the transaction itself",
                    "its writes and the claim are gone",
                ),
            ),
            Err(e) if e.is_aborted_transaction() => Step::Failed(
                unit,
                retry(
                    "the handler left the transaction aborted (did it ignore a failed statement?)",
                    e,
                ),
            ),
            Err(e) => {
                self.stats.incr(Counter::CommitFailures);
                Step::Failed(unit, retry("commit failed", e))
            }
        }
    }

    async fn await_database(&self, mut unit: Unit, error: String, abandon: &Abandon) -> Step {
        unit.passes += 1;
        if unit.passes >= MAX_DATABASE_PASSES {
            return Step::Failed(
                unit,
                retry("connection errors although the database answers", error),
            );
        }
        self.gate.report_down(&error);
        tokio::select! {
            () = self.gate.wait_available() => Step::Decode(unit),
            () = abandon.wait() => Step::Decided(unit, Outcome::Abandoned),
        }
    }

    fn mismatch(&self, message: &Message) -> Outcome {
        mismatch(&self.consumer, &self.stats, message)
    }

    #[cfg(test)]
    fn gate_is_open(&self) -> bool {
        self.gate.is_available()
    }
}

/// A reused id: counted, logged, and dead-lettered.
pub(crate) fn mismatch(consumer: &str, stats: &Stats, message: &Message) -> Outcome {
    let id = message.id();
    stats.incr(Counter::PayloadMismatches);
    tracing::warn!(message_id = %id, "message id reused with a different payload");
    Outcome::DeadLetter {
        reason: DeadLetterReason::PayloadMismatch,
        error: format!(
            "message id {id:?} was already processed by {consumer:?} with a different body"
        ),
    }
}

/// Runs user code (the call that makes the handler's future, and the future)
/// bounded by `timeout`, with panics caught.
pub(crate) async fn guarded<F, Fut>(make: F, timeout: Duration, stats: &Stats) -> HandlerRun
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<(), HandlerError>>,
{
    let started = std::time::Instant::now();
    let result = tokio::time::timeout(
        timeout,
        AssertUnwindSafe(async { make().await }).catch_unwind(),
    )
    .await;
    stats.handler_duration(started.elapsed());
    match result {
        Ok(Ok(Ok(()))) => HandlerRun::Done,
        Ok(Ok(Err(e))) => HandlerRun::Failed(e),
        Ok(Err(panic)) => HandlerRun::Panicked(panic_message(&*panic).to_owned()),
        Err(_) => HandlerRun::TimedOut,
    }
}

/// What a unit's handler staged in the outbox, for its commit.
#[cfg(feature = "outbox")]
type Staging = std::sync::Arc<crate::outbox::UnitStaging>;
#[cfg(not(feature = "outbox"))]
type Staging = ();

/// A connection error goes to the gate; anything else fails the unit.
fn database_error(unit: Unit, context: &str, e: Error) -> Step {
    if e.is_connection_error() {
        Step::AwaitDatabase(unit, format!("{context}: {e}"))
    } else {
        Step::Failed(unit, retry(context, e))
    }
}

/// Everything a session's delivery tasks share.
pub(crate) struct Pipeline {
    pub(crate) consumer: String,
    pub(crate) queue: String,
    pub(crate) dead_letter_queue: String,
    pub(crate) message_id: MessageIdSource,
    /// Seals the ids idempo's copies carry forward, and checks them.
    pub(crate) keys: Arc<Keyring>,
    pub(crate) decide: Arc<dyn Decide>,
    pub(crate) redelivery: RedeliveryPolicy,
    /// Whether the runtime declares its queues (and so may declare a missing
    /// one again).
    pub(crate) declare: bool,
    /// Copies to delay queues and to the DLQ, confirmed before the ack.
    pub(crate) republisher: Republisher,
    /// Batch mode: coalesced acks for this session's channel.
    pub(crate) coalesced: Option<AckTracker>,
    /// Fired when the session must end (republishing channels gone, a tag
    /// the ack bookkeeping cannot place).
    pub(crate) broken: CancellationToken,
    /// Fired on shutdown: deliveries waiting for the database give up.
    pub(crate) shutdown: CancellationToken,
    pub(crate) health: Health,
    pub(crate) stats: Stats,
    pub(crate) log_limit: LogLimit,
}

/// Lets a repeated log line through once per interval.
#[derive(Debug, Default)]
pub(crate) struct LogLimit {
    last: std::sync::Mutex<Option<std::time::Instant>>,
}

impl LogLimit {
    const EVERY: Duration = Duration::from_secs(10);

    fn allow(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        match *last {
            Some(at) if now.duration_since(at) < Self::EVERY => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

/// One delivery on its way: the message and what settles it.
struct Item {
    message: Message,
    acker: Acker,
}

impl Pipeline {
    /// Takes a unit of deliveries (one, or a batch) through the steps and
    /// settles each, inside a span that records the outcome.
    pub(crate) async fn run(
        self: Arc<Self>,
        deliveries: Vec<lapin::message::Delivery>,
    ) -> Vec<Settled> {
        let span = match deliveries.as_slice() {
            [one] => tracing::info_span!(
                "delivery",
                consumer = %self.consumer,
                message_id = field::Empty,
                delivery_tag = one.delivery_tag,
                redelivered = one.redelivered,
                outcome = field::Empty,
            ),
            many => tracing::info_span!("batch", consumer = %self.consumer, size = many.len()),
        };
        async {
            let mut items: Vec<Item> = deliveries
                .into_iter()
                .map(|delivery| {
                    self.stats.incr(Counter::Deliveries);
                    Item {
                        acker: delivery.acker.clone(),
                        message: Message::from_delivery(delivery),
                    }
                })
                .collect();
            // Ids first: a delivery without a usable id is final at once.
            let abandon = Abandon {
                shutdown: self.shutdown.clone(),
                channel: items.first().map(|item| item.acker.clone()),
            };
            let mut outcomes: Vec<Option<Outcome>> = vec![None; items.len()];
            for (item, outcome) in items.iter_mut().zip(&mut outcomes) {
                match self.identify(&item.message, &abandon).await {
                    Ok(id) => item.message.set_id(id),
                    Err(settle) => *outcome = Some(settle),
                }
            }
            if let [item] = items.as_slice() {
                Span::current().record("message_id", item.message.id());
            }
            let pending: Vec<usize> = (0..items.len())
                .filter(|&i| outcomes[i].is_none())
                .collect();
            if !pending.is_empty() {
                let messages: Vec<Message> =
                    pending.iter().map(|&i| items[i].message.clone()).collect();
                let abandon = Abandon {
                    shutdown: self.shutdown.clone(),
                    channel: Some(items[pending[0]].acker.clone()),
                };
                let decided = self.decide.decide(&messages, &abandon).await;
                for (i, outcome) in pending.into_iter().zip(decided) {
                    outcomes[i] = Some(outcome);
                }
            }
            let outcomes = outcomes
                .into_iter()
                .map(|o| o.unwrap_or(Outcome::Abandoned))
                .collect();
            let settled = self.settle(items, outcomes).await;
            if let [one] = settled.as_slice() {
                Span::current().record("outcome", one.as_str());
            }
            settled
        }
        .instrument(span)
        .await
    }

    /// The id to deduplicate `message` on: the one an idempo copy carries
    /// forward under a valid seal, else the configured source's. A copy's
    /// seal needs the consumer's key: while the database cannot give it, the
    /// delivery waits (and is abandoned at shutdown).
    async fn identify(&self, message: &Message, abandon: &Abandon) -> Result<String, Outcome> {
        if claimed_id(message).is_some() {
            let Some(seal) = self.keys.wait(abandon.wait()).await else {
                return Err(Outcome::Abandoned);
            };
            if let Some(id) = seal.carried_id(message) {
                return crate::inbox::validate_message_id(&id)
                    .map(|()| id)
                    .map_err(invalid_id);
            }
        }
        self.message_id.extract(message).map_err(invalid_id)
    }

    /// Acks, dead-letters or retries each delivery, and says which it did.
    /// Nothing is acked before its effects, its retry copy or its dead letter
    /// are durable. In batch mode, processed and duplicate deliveries are
    /// acked together with one multiple ack, once every lower tag is settled.
    async fn settle(&self, items: Vec<Item>, outcomes: Vec<Outcome>) -> Vec<Settled> {
        let mut settled = Vec::with_capacity(items.len());
        let mut tags: Vec<(u64, Option<Acker>)> = Vec::with_capacity(items.len());
        for (item, outcome) in items.into_iter().zip(outcomes) {
            let tag = item.message.delivery_tag();
            let done = match outcome {
                Outcome::Processed | Outcome::Duplicate => {
                    let (counter, done) = match outcome {
                        Outcome::Processed => (Counter::Processed, Settled::Processed),
                        _ => {
                            tracing::debug!("duplicate acknowledged without running the handler");
                            (Counter::Duplicates, Settled::Duplicate)
                        }
                    };
                    self.stats.incr(counter);
                    if self.coalesced.is_some() {
                        tags.push((tag, Some(item.acker)));
                    } else {
                        ack(&item.acker, false).await;
                    }
                    settled.push(done);
                    continue;
                }
                Outcome::DeadLetter { reason, error } => {
                    let failures = Failures::record(&item.message);
                    self.dead_letter(&item, reason, &error, failures).await
                }
                Outcome::Retry {
                    error,
                    requested_delay,
                } => self.retry(&item, &error, requested_delay).await,
                // Never recorded: no multiple ack may cover it.
                Outcome::Abandoned => {
                    settled.push(Settled::Abandoned);
                    continue;
                }
            };
            tags.push((tag, None));
            settled.push(done);
        }
        if let Some(tracker) = &self.coalesced {
            let mut acks = tracker.lock().await;
            match acks.record(tags) {
                // Sent under the lock: multiple acks leave in increasing order.
                Ok(Some(acker)) => ack(&acker, true).await,
                Ok(None) => {}
                Err(Misplaced(tag)) => {
                    tracing::error!(
                        tag,
                        watermark = acks.watermark(),
                        "delivery tag reported twice or out of range; reconnecting"
                    );
                    self.broken.cancel();
                }
            }
        }
        settled
    }

    async fn retry(&self, item: &Item, error: &str, requested_delay: Option<Duration>) -> Settled {
        let failures = Failures::record(&item.message);
        match &self.redelivery.mode {
            Mode::Requeue(pause) => {
                tracing::warn!(%error, "transient failure; requeueing");
                self.stats.incr(Counter::Retried);
                nack_after(&item.acker, *pause).await;
                Settled::Retried
            }
            Mode::Delayed(_) if failures.attempts >= self.redelivery.max_attempts => {
                let error = format!("{} attempts failed; the last: {error}", failures.attempts);
                self.dead_letter(item, DeadLetterReason::AttemptsExhausted, &error, failures)
                    .await
            }
            Mode::Delayed(_) => {
                let delay = self
                    .redelivery
                    .delay_for(failures.attempts, requested_delay);
                let queue = delay_queue(&self.queue, delay);
                let headers = self.failure_headers(&item.message, error, &failures).await;
                let mut published = self
                    .republisher
                    .publish(&queue, &item.message, headers.clone())
                    .await;
                if let Err(PublishError::Returned(_)) = &published {
                    // The delay queue is gone (deleted by hand). Retry through
                    // the work queue itself, with the attempt counted, so
                    // that the attempts still run out; a pause stands in for
                    // the delay.
                    self.missing_queue(&queue);
                    tokio::time::sleep(FALLBACK_PAUSE).await;
                    published = self
                        .republisher
                        .publish(&self.queue, &item.message, headers)
                        .await;
                }
                match published {
                    Ok(()) => {
                        tracing::warn!(%error, attempts = failures.attempts, ?delay, "transient failure; retrying later");
                        self.stats.incr(Counter::Retried);
                        ack(&item.acker, false).await;
                    }
                    Err(e) => {
                        let error = format!("cannot publish the retry to {queue:?}: {e}");
                        self.publish_failed(&item.acker, error).await;
                    }
                }
                Settled::Retried
            }
        }
    }

    async fn dead_letter(
        &self,
        item: &Item,
        reason: DeadLetterReason,
        error: &str,
        failures: Failures,
    ) -> Settled {
        let mut headers = self.failure_headers(&item.message, error, &failures).await;
        headers.push((REASON_HEADER, AMQPValue::LongString(reason.as_str().into())));
        match self
            .republisher
            .publish(&self.dead_letter_queue, &item.message, headers)
            .await
        {
            Ok(()) => {
                self.stats.incr(Counter::DeadLettered);
                tracing::warn!(%reason, %error, "dead-lettered");
                ack(&item.acker, false).await;
                Settled::DeadLettered
            }
            Err(e) => {
                if let PublishError::Returned(_) = e {
                    self.missing_queue(&self.dead_letter_queue);
                }
                let error = format!(
                    "cannot dead-letter ({reason}) to {:?}: {e}",
                    self.dead_letter_queue
                );
                self.publish_failed(&item.acker, error).await;
                Settled::Retried
            }
        }
    }

    async fn failure_headers(
        &self,
        message: &Message,
        error: &str,
        failures: &Failures,
    ) -> Vec<(&'static str, AMQPValue)> {
        let text = |s: &str| AMQPValue::LongString(s.into());
        let mut headers = vec![
            (ERROR_HEADER, text(truncate(error, MAX_ERROR_HEADER))),
            (CONSUMER_HEADER, text(&self.consumer)),
            (QUEUE_HEADER, text(&self.queue)),
            (ROUTING_KEY_HEADER, text(&original_routing_key(message))),
        ];
        // An id-less original has nothing to carry forward (an empty header
        // would only get in the way of an operator who adds one to replay it).
        if !message.id().is_empty() {
            headers.push((MESSAGE_ID_HEADER, text(message.id())));
            // Without the key (the database down since the start), the copy
            // goes out unsealed: its id is then taken from its properties
            // again. Waited for briefly only: poison is dead-lettered while
            // the database is down.
            let seal = match self.keys.loaded() {
                Some(seal) => Some(seal),
                None => tokio::time::timeout(KEY_WAIT, self.keys.get())
                    .await
                    .ok()
                    .and_then(|loaded| loaded.ok()),
            };
            match seal {
                Some(seal) => {
                    let seal = seal.seal(message.id(), message);
                    headers.push((MESSAGE_ID_SEAL_HEADER, text(&seal)));
                }
                None => tracing::debug!("copy sent without a seal: the key is not loaded yet"),
            }
        }
        headers.extend(failures.headers());
        headers
    }

    /// A copy was returned as unroutable: `queue` is gone (an operator
    /// deleted it). When the runtime declares its queues, a new session
    /// declares them again; otherwise only a human can create it.
    fn missing_queue(&self, queue: &str) {
        let error = if self.declare {
            self.broken.cancel();
            format!("queue {queue:?} is missing; reconnecting to declare the topology again")
        } else {
            format!(
                "queue {queue:?} does not exist, and this consumer does not declare queues \
                 (declare(false)): create it"
            )
        };
        tracing::warn!(%error);
        self.health.record_error(error);
    }

    /// No confirmed copy: hand the original back instead. If the publishing
    /// channels are gone, the session must reconnect.
    async fn publish_failed(&self, acker: &Acker, error: String) {
        // At ERROR once every 10 s: a missing queue fails every copy.
        if self.log_limit.allow() {
            tracing::error!(%error, "requeueing the original instead");
        } else {
            tracing::debug!(%error, "requeueing the original instead");
        }
        self.health.record_error(error);
        if !self.republisher.is_open().await {
            self.broken.cancel();
        }
        self.stats.incr(Counter::Retried);
        self.stats.incr(Counter::PublishFailures);
        nack_after(acker, FALLBACK_PAUSE).await;
    }
}

/// Hands the delivery back after a pause, so a failing dependency is not
/// hammered in a tight redelivery loop.
async fn nack_after(acker: &Acker, pause: Duration) {
    tokio::time::sleep(pause).await;
    let nack = BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    };
    match acker.nack(nack).await {
        Ok(true) => {}
        // The channel is gone: the broker requeues every unacked delivery.
        Ok(false) => tracing::warn!("nack not sent (channel closed); the broker will redeliver"),
        Err(e) => tracing::warn!(error = %e, "nack failed; the broker will redeliver"),
    }
}

async fn ack(acker: &Acker, multiple: bool) {
    // Either way the work is durable; the redelivery will be claimed as a duplicate.
    match acker.ack(BasicAckOptions { multiple }).await {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!("ack not sent (channel closed); the redelivery will be deduplicated")
        }
        Err(e) => {
            tracing::warn!(error = %e, "ack failed; the redelivery will be deduplicated")
        }
    }
}

async fn rollback(tx: Transaction<'static, Postgres>) {
    if let Err(e) = tx.rollback().await {
        // A broken connection rolls back by itself on the server.
        tracing::debug!(error = %e, "rollback failed");
    }
}

/// The outcome of a handler's error.
pub(crate) fn handler_failed(e: HandlerError) -> Outcome {
    // `msg.json()?` inside a handler: a body that cannot decode never will,
    // whatever kind the `?` conversion gave the error.
    if let Some(decode) = e.source().downcast_ref::<DecodeError>() {
        undecodable(decode)
    } else if e.is_permanent() {
        Outcome::DeadLetter {
            reason: DeadLetterReason::PermanentError,
            error: e.to_string(),
        }
    } else {
        Outcome::Retry {
            requested_delay: e.requested_delay(),
            error: format!("handler failed: {e}"),
        }
    }
}

pub(crate) fn timed_out(timeout: Duration) -> Outcome {
    retry("handler timed out after", format!("{timeout:?}"))
}

pub(crate) fn undecodable(e: &DecodeError) -> Outcome {
    Outcome::DeadLetter {
        reason: DeadLetterReason::UndecodableBody,
        error: e.to_string(),
    }
}

fn invalid_id(e: InvalidMessageId) -> Outcome {
    let reason = match e {
        InvalidMessageId::Missing => DeadLetterReason::MissingMessageId,
        _ => DeadLetterReason::InvalidMessageId,
    };
    Outcome::DeadLetter {
        reason,
        error: e.to_string(),
    }
}

pub(crate) fn retry(context: &str, e: impl std::fmt::Display) -> Outcome {
    Outcome::Retry {
        error: format!("{context}: {e}"),
        requested_delay: None,
    }
}

/// `text`, cut at a character boundary to at most `max` bytes.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s
    } else {
        "non-string panic payload"
    }
}

/// The state machine against the real PostgreSQL, without a broker: each test
/// decides synthetic messages and checks the outcomes and what committed.
#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    use super::*;
    use crate::amqp::JsonBody;
    use crate::amqp::handler::{EachMessage, WholeBatch};
    use crate::amqp::health::Health;

    /// A schema of its own (named like the integration tests' schemas, so
    /// that their cleanup also removes leftovers), migrated; 3 connections.
    struct TestDb {
        pool: PgPool,
        admin: PgPool,
        schema: String,
    }

    impl TestDb {
        async fn new() -> TestDb {
            let url = std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
            let admin = PgPoolOptions::new()
                .max_connections(1)
                .connect(&url)
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "PostgreSQL is not reachable at {url}: {e}\nstart it with \
                         `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`"
                    )
                });
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs();
            let schema = format!("idempo_test_db_{secs}_unit_{}", crate::random::token());
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "CREATE SCHEMA {schema}; CREATE TABLE {schema}.effects (id text NOT NULL)"
            )))
            .execute(&admin)
            .await
            .expect("create the test schema");
            let options = PgConnectOptions::from_str(&url)
                .unwrap()
                .options([("search_path", schema.as_str())]);
            let pool = PgPoolOptions::new()
                .max_connections(3)
                .connect_with(options)
                .await
                .expect("connect to the test schema");
            crate::migrate(&pool).await.expect("migrate");
            TestDb {
                pool,
                admin,
                schema,
            }
        }

        async fn effects(&self) -> Vec<String> {
            sqlx::query_scalar("SELECT id FROM effects ORDER BY id")
                .fetch_all(&self.pool)
                .await
                .unwrap()
        }

        async fn claims(&self) -> i64 {
            sqlx::query_scalar("SELECT count(*) FROM processed_messages")
                .fetch_one(&self.pool)
                .await
                .unwrap()
        }

        async fn drop(self) {
            self.pool.close().await;
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA {} CASCADE",
                self.schema
            )))
            .execute(&self.admin)
            .await;
        }
    }

    fn steps(pool: &PgPool, handler: Arc<dyn Prepare>) -> InboxSteps {
        let stats = Stats::new("unit");
        let gate = DatabaseGate::new(
            pool.clone(),
            Health::default(),
            stats.clone(),
            CancellationToken::new(),
        );
        InboxSteps {
            consumer: "unit".into(),
            pool: pool.clone(),
            handler,
            handler_timeout: Duration::from_secs(5),
            gate,
            stats,
        }
    }

    fn nobody_leaves() -> Abandon {
        Abandon {
            shutdown: CancellationToken::new(),
            channel: None,
        }
    }

    /// Records the message id in `effects`; ids starting with `fail` fail
    /// transiently after writing, `bad` fail permanently, `swallow` ignore a
    /// failed statement, `rollback` end the transaction themselves.
    async fn effect(tx: Tx, message: Message) -> Result<(), HandlerError> {
        let id = message.id().to_owned();
        let mut conn = tx.try_lock()?;
        sqlx::query("INSERT INTO effects (id) VALUES ($1)")
            .bind(&id)
            .execute(&mut *conn)
            .await?;
        if id.starts_with("fail") {
            return Err(HandlerError::transient("injected"));
        }
        if id.starts_with("bad") {
            return Err(HandlerError::permanent("a business rule"));
        }
        if id.starts_with("swallow") {
            let _ = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
        }
        if id.starts_with("rollback") {
            sqlx::query("ROLLBACK").execute(&mut *conn).await?;
        }
        Ok(())
    }

    fn each() -> Arc<dyn Prepare> {
        Arc::new(EachMessage::new(effect))
    }

    fn kinds(outcomes: &[Outcome]) -> Vec<String> {
        outcomes
            .iter()
            .map(|o| match o {
                Outcome::Processed => "processed".to_owned(),
                Outcome::Duplicate => "duplicate".to_owned(),
                Outcome::DeadLetter { reason, .. } => format!("dead letter: {reason}"),
                Outcome::Retry { .. } => "retry".to_owned(),
                Outcome::Abandoned => "abandoned".to_owned(),
            })
            .collect()
    }

    async fn decide(steps: &InboxSteps, messages: &[Message]) -> Vec<String> {
        kinds(&steps.run(messages, &nobody_leaves()).await)
    }

    #[tokio::test]
    async fn a_fresh_message_commits_once_and_its_copies_are_duplicates_or_mismatches() {
        let db = TestDb::new().await;
        let steps = steps(&db.pool, each());
        let first = Message::for_test("pay-1", b"100");
        assert_eq!(
            decide(&steps, std::slice::from_ref(&first)).await,
            ["processed"]
        );
        assert_eq!(decide(&steps, &[first]).await, ["duplicate"]);
        let reused = Message::for_test("pay-1", b"999");
        assert_eq!(
            decide(&steps, &[reused]).await,
            ["dead letter: message id reused with a different payload"]
        );
        assert_eq!(db.effects().await, ["pay-1"], "one effect");
        db.drop().await;
    }

    #[tokio::test]
    async fn failing_handlers_commit_nothing_and_say_how_to_settle() {
        let db = TestDb::new().await;
        let steps = steps(&db.pool, each());
        for (id, expected) in [
            ("fail-1", "retry"),
            ("bad-1", "dead letter: permanent handler error"),
            ("swallow-1", "retry"),
            ("rollback-1", "retry"),
        ] {
            let outcome = decide(&steps, &[Message::for_test(id, b"{}")]).await;
            assert_eq!(outcome, [expected], "{id}");
        }
        assert!(db.effects().await.is_empty(), "every write rolled back");
        assert_eq!(db.claims().await, 0, "and every claim");
        db.drop().await;
    }

    #[tokio::test]
    async fn an_undecodable_body_is_dead_lettered_before_any_database_work() {
        let db = TestDb::new().await;
        let typed = |_tx: Tx, JsonBody(_n): JsonBody<i64>| async { Ok(()) };
        let steps = steps(&db.pool, Arc::new(EachMessage::new(typed)));
        let outcome = decide(&steps, &[Message::for_test("pay-x", b"not json")]).await;
        assert_eq!(outcome, ["dead letter: undecodable body"]);
        assert_eq!(db.claims().await, 0);
        db.drop().await;
    }

    #[tokio::test]
    async fn a_batch_claims_once_and_a_failure_splits_it_into_single_deliveries() {
        let db = TestDb::new().await;
        let steps = steps(&db.pool, each());
        assert_eq!(
            decide(&steps, &[Message::for_test("b-0", b"0")]).await,
            ["processed"]
        );
        let batch = [
            Message::for_test("b-1", b"1"),
            Message::for_test("b-0", b"0"), // processed before: duplicate
            Message::for_test("b-0", b"zzz"), // reused with another body
            Message::for_test("b-2", b"2"),
            Message::for_test("b-1", b"1"), // twice in the batch: the first wins
            Message::for_test("fail-b", b"3"), // fails the batch: split
        ];
        assert_eq!(
            decide(&steps, &batch).await,
            [
                "processed",
                "duplicate",
                "dead letter: message id reused with a different payload",
                "processed",
                "duplicate",
                "retry",
            ]
        );
        assert_eq!(db.effects().await, ["b-0", "b-1", "b-2"]);
        db.drop().await;
    }

    #[tokio::test]
    async fn a_batch_handler_gets_the_fresh_messages_of_a_batch_at_once() {
        let db = TestDb::new().await;
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = calls.clone();
        let batch_handler = move |tx: Tx, batch: Vec<Message>| {
            seen.lock().unwrap().push(batch.len());
            async move {
                for message in batch {
                    effect(tx.clone(), message).await?;
                }
                Ok(())
            }
        };
        let steps = steps(&db.pool, Arc::new(WholeBatch::new(batch_handler)));
        let first = [
            Message::for_test("w-1", b"1"),
            Message::for_test("w-2", b"2"),
        ];
        assert_eq!(decide(&steps, &first).await, ["processed", "processed"]);
        let again = [
            Message::for_test("w-1", b"1"),
            Message::for_test("w-3", b"3"),
            Message::for_test("w-4", b"4"),
        ];
        assert_eq!(
            decide(&steps, &again).await,
            ["duplicate", "processed", "processed"]
        );
        assert_eq!(
            *calls.lock().unwrap(),
            [2, 2],
            "one call per batch, fresh only"
        );
        db.drop().await;
    }

    #[tokio::test]
    async fn a_delivery_waiting_for_the_database_is_abandoned_at_shutdown() {
        // A pool on a port where nothing listens: every BEGIN fails to connect.
        let pool = PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(200))
            .connect_lazy("postgres://postgres@127.0.0.1:9/none")
            .unwrap();
        let steps = steps(&pool, each());
        let abandon = nobody_leaves();
        abandon.shutdown.cancel();
        let outcomes = steps
            .run(&[Message::for_test("pay-1", b"1")], &abandon)
            .await;
        assert_eq!(kinds(&outcomes), ["abandoned"], "left unacked, not retried");
        assert!(!steps.gate_is_open(), "the gate knows the database is down");
    }
}
