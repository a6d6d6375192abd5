//! The inbox steps of one unit, for per-message and batch mode alike: the
//! state machine that decides each delivery's [`Outcome`].
//!
//! A *unit* is one delivery (per-message mode) or a batch of them. Each unit
//! goes through the same steps; a batch that fails as a whole is split into
//! units of one, which go through them again:
//!
//! ```text
//! Decode ─► Claim (BEGIN, then the claims) ─┬─ all Duplicate/Mismatch ─► decided (no transaction)
//!    │                                        └─ Fresh ─► Handle ─┬─ Ok ─► Commit (SELECT; COMMIT AND CHAIN, one round trip) ─► Processed
//!    └─ undecodable ─► DeadLetter                                 └─ error / panic / timeout ─► ROLLBACK ─► Failed
//!
//! Failed         = one delivery: its outcome (Retry, or DeadLetter for a permanent error)
//!                  a batch: Split ─► each delivery alone, from Decode
//! AwaitDatabase  = a connection-level error at any step ─► ROLLBACK ─► wait at the gate ─► Decode again
//!                  (shutdown or a closed channel: Abandoned; after 5 passes: Failed)
//! ```
//!
//! Dropping the future (shutdown timeout) at any `.await` is safe: before the
//! commit, the transaction rolls back when dropped and the unacked delivery
//! returns to the queue when the channel closes; during or after the commit,
//! the redelivery is claimed as a duplicate and acknowledged.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::{PgPool, Postgres, Transaction};

use crate::Error;
use crate::inbox::{Claim, Inbox};
use crate::runtime::database_gate::DatabaseGate;
use crate::runtime::dead_letter::DeadLetterReason;
use crate::runtime::forwarding::Forwarding;
use crate::runtime::handler::{Call, Prepare};
use crate::runtime::letter_table;
use crate::runtime::message::Message;
use crate::runtime::outcome::{
    Abandon, Decide, HandlerRun, Outcome, RetryCause, guarded, handler_failed, mismatch, retry,
    timed_out, undecodable,
};
use crate::runtime::stats::{Counter, Stats};
use crate::runtime::unit_tx::{self, Isolation};

/// Passes that end in a connection error although the database answered in
/// between: after this many, the error is the unit's (a statement that kills
/// its own connection, a second pool) and it fails like any other error.
const MAX_DATABASE_PASSES: u32 = 5;

/// The steps of one unit through the inbox: BEGIN, claim, handler, commit.
pub(crate) struct InboxSteps {
    pub(crate) consumer: String,
    pub(crate) pool: PgPool,
    pub(crate) handler: Arc<dyn Prepare>,
    pub(crate) handler_timeout: Duration,
    pub(crate) gate: Arc<DatabaseGate>,
    pub(crate) stats: Stats,
    /// How the unit commits what its handler staged.
    pub(crate) forwarding: Arc<Forwarding>,
    /// Whether the pool's sessions default to READ COMMITTED, once known:
    /// the claims then skip `SET TRANSACTION`.
    pub(crate) sessions: tokio::sync::OnceCell<unit_tx::Sessions>,
    /// Where the claims go (plain or partitioned).
    pub(crate) inbox: Inbox,
    /// Every unit's connection goes through the pool's acquire-time checks
    /// (else an idle one is taken as it is).
    pub(crate) checked_acquire: bool,
    /// The dead letters are in the table: a redelivery of a message already
    /// lettered there (its settlement lost) is settled again, not handled.
    pub(crate) letters_in_table: bool,
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
    /// Claim every id of the unit, opening the transaction (`BEGIN`, then
    /// one statement for the claims).
    Claim(Unit, Call),
    /// Run the handler over the unit, now only fresh messages.
    Handle(Unit, Call, Transaction<'static, Postgres>),
    /// COMMIT, unless the transaction is aborted or the handler ended it;
    /// with what the handler staged in the outbox.
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
                    Step::Claim(unit, call) => self.claim(unit, call, messages, &mut decided).await,
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
                Ok(call) => return Step::Claim(unit, call),
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
        messages: &[Message],
        decided: &mut [Option<Outcome>],
    ) -> Step {
        let ids = unit.ids(messages);
        // Asked once; until an answer comes, the claim sets the level itself.
        let isolation = match self
            .sessions
            .get_or_try_init(|| unit_tx::sessions(&self.pool))
            .await
        {
            Ok(sessions) if sessions.read_committed => Isolation::Default,
            _ => Isolation::Set,
        };
        let claimed = self
            .inbox
            .begin_claims(
                &ids,
                unit_tx::begin(&self.pool, isolation, !self.checked_acquire),
            )
            .await;
        let (claims, tx) = match claimed {
            Ok(claimed) => (claimed.claims, claimed.tx),
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
        // A dead letter is stored with its claim, then its delivery settled:
        // a crash in between brings it back as a duplicate, settled as the
        // letter it is (its deliveries counted). One stored before letters
        // held claims comes back fresh: not run again either.
        let asked: Vec<usize> = unit
            .members
            .iter()
            .copied()
            .filter(|&m| {
                self.letters_in_table
                    && messages[m].redelivered()
                    && matches!(decided[m], None | Some(Outcome::Duplicate))
            })
            .collect();
        let mut tx = tx.filter(|_| !fresh.is_empty());
        if !asked.is_empty() {
            let pairs: Vec<(&str, &[u8])> = asked
                .iter()
                .map(|&m| (messages[m].id(), messages[m].body()))
                .collect();
            let lettered = match tx.as_mut() {
                Some(tx) => letter_table::live(tx, &self.consumer, &pairs).await,
                None => match self.pool.acquire().await {
                    Ok(mut conn) => letter_table::live(&mut conn, &self.consumer, &pairs).await,
                    Err(e) => Err(e),
                },
            };
            match lettered {
                Ok(lettered) => {
                    let before = fresh.len();
                    for (&m, letter) in asked.iter().zip(lettered) {
                        if let Some((reason, error)) = letter {
                            decided[m] = Some(Outcome::DeadLetter {
                                reason: DeadLetterReason::from_str_value(&reason)
                                    .unwrap_or(DeadLetterReason::PermanentError),
                                error,
                            });
                            fresh.retain(|&f| f != m);
                        }
                    }
                    if fresh.len() < before {
                        // This transaction holds the lettered ones' claims too:
                        // the others (a batch's) are claimed again in a new one.
                        if let Some(tx) = tx.take() {
                            rollback(tx).await;
                        }
                        if fresh.is_empty() {
                            return Step::Done;
                        }
                        return Step::Decode(Unit {
                            members: fresh,
                            passes: unit.passes,
                        });
                    }
                }
                Err(e) => {
                    if let Some(tx) = tx.take() {
                        rollback(tx).await;
                        return database_error(
                            unit,
                            "the dead-letter check failed",
                            Error::from(e),
                        );
                    }
                    // Duplicates only: acknowledged as such, their letters untouched.
                }
            }
        }
        let Some(tx) = tx else {
            return Step::Done;
        };
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
        let (tx, staging) = self.forwarding.open(tx);
        let run = guarded(|| call(tx.clone()), self.handler_timeout, &self.stats).await;

        let Some(tx) = tx.take() else {
            // The guard lives on in a task the handler spawned; the
            // transaction rolls back when that guard is dropped.
            return Step::Failed(
                unit,
                retry(
                    RetryCause::Handler,
                    "handler finished while a task it spawned still holds the transaction",
                    "rolled back",
                ),
            );
        };
        match run {
            HandlerRun::Done => Step::Commit(unit, tx, staging),
            HandlerRun::Failed(e) => {
                rollback(tx).await;
                if database_unavailable(e.source()) {
                    return Step::AwaitDatabase(
                        unit,
                        format!("the database refused the handler: {e}"),
                    );
                }
                Step::Failed(unit, handler_failed(e))
            }
            HandlerRun::Panicked(panic) => {
                rollback(tx).await;
                Step::Failed(unit, retry(RetryCause::Panic, "handler panicked", panic))
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
        // The first id names the unit in an error: an aborted or ended
        // transaction took every claim.
        let id = messages[unit.members[0]].id();
        let committed = self.forwarding.commit(&staging, tx, id).await;
        match committed {
            Ok(()) => Step::Decided(unit, Outcome::Processed),
            Err(e) if e.is_connection_error() => {
                // Maybe committed, maybe not: never ack. The next pass (or
                // the redelivery) is either claimed as a duplicate or runs afresh.
                self.stats.incr(Counter::CommitFailures);
                Step::AwaitDatabase(unit, format!("commit outcome unknown: {e}"))
            }
            Err(e) if e.is_unavailable() => {
                // Refused, so not committed (a read-only or full server).
                Step::AwaitDatabase(unit, format!("commit refused: {e}"))
            }
            Err(Error::ClaimLost { .. }) => Step::Failed(
                unit,
                retry(
                    RetryCause::Handler,
                    "the handler ended the transaction itself",
                    "its writes and the claim are gone",
                ),
            ),
            Err(e) if e.is_aborted_transaction() => Step::Failed(
                unit,
                retry(
                    RetryCause::Handler,
                    "the handler left the transaction aborted (did it ignore a failed statement?)",
                    e,
                ),
            ),
            Err(e) => {
                self.stats.incr(Counter::CommitFailures);
                Step::Failed(unit, retry(RetryCause::Database, "commit failed", e))
            }
        }
    }

    async fn await_database(&self, mut unit: Unit, error: String, abandon: &Abandon) -> Step {
        unit.passes += 1;
        if unit.passes >= MAX_DATABASE_PASSES {
            return Step::Failed(
                unit,
                retry(
                    RetryCause::Database,
                    "connection errors although the database answers",
                    error,
                ),
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

/// What a unit's handler staged in the outbox, for its commit.
type Staging = crate::runtime::forwarding::Unit;

/// A database that cannot take writes now sends the unit to the gate;
/// anything else fails it.
fn database_error(unit: Unit, context: &str, e: Error) -> Step {
    if e.is_unavailable() {
        Step::AwaitDatabase(unit, format!("{context}: {e}"))
    } else {
        Step::Failed(unit, retry(RetryCause::Database, context, e))
    }
}

/// Whether an error of any type (a handler's) is, or wraps, a database that
/// cannot take writes now ([`Error::is_unavailable`]).
fn database_unavailable(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(sqlx) = e.downcast_ref::<sqlx::Error>() {
            return crate::sqlstate::is_unavailable(sqlx);
        }
        if let Some(ours) = e.downcast_ref::<Error>() {
            return ours.is_unavailable();
        }
        current = e.source();
    }
    false
}

async fn rollback(tx: Transaction<'static, Postgres>) {
    if let Err(e) = tx.rollback().await {
        // A broken connection rolls back by itself on the server.
        tracing::debug!(error = %e, "rollback failed");
    }
}

/// The state machine against the real PostgreSQL, without a broker: each test
/// decides synthetic messages and checks the outcomes and what committed.
#[cfg(test)]
mod tests;
