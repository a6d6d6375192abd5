//! The per-delivery state machine; the only code that acks, nacks or dead-letters.
//!
//! ```text
//! received ─► id ─► decode ─► BEGIN ─► claim ─┬─ Fresh ─► handler ─┬─ Ok ─► claim still ours? ─► COMMIT ─┬─ ok ─► ack
//!              │       │                      │                    │                                     └─ failed/unknown ─► RETRY
//!              │       │                      ├─ Duplicate ─► ROLLBACK ─► ack
//!              │       │                      └─ Mismatch ──► ROLLBACK ─► DEAD-LETTER ─► ack
//!              │       └─ undecodable ─► DEAD-LETTER ─► ack  ├─ transient error / panic / timeout ─► ROLLBACK ─► RETRY
//!              └─ missing/invalid ─► DEAD-LETTER ─► ack      └─ permanent error ─► ROLLBACK ─► DEAD-LETTER ─► ack
//!
//! RETRY       = attempts left: publish to <queue>.retry.<delay> (confirmed) ─► ack
//!               none left: DEAD-LETTER; policy "requeue": pause ─► nack(requeue)
//! DEAD-LETTER = publish to <queue>.dlq (confirmed) ─► ack
//! a publish that is not confirmed ─► pause ─► nack(requeue): never acked
//! database unreachable anywhere ─► ROLLBACK ─► wait at the database gate ─► run again from BEGIN
//! ```
//!
//! Dropping the future (shutdown timeout) at any `.await` is safe: before the
//! commit, the transaction rolls back when dropped and the unacked delivery
//! returns to the queue when the channel closes; during or after the commit,
//! the redelivery is claimed as a duplicate and acknowledged.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::AMQPValue;
use sqlx::{PgPool, Postgres, Transaction};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span, field};

use super::acks::AckTracker;
use super::database_gate::{DatabaseGate, is_connection_error, is_connection_failure};
use super::dead_letter::DeadLetterReason;
use super::handler::{BoxedHandler, HandlerError, PreparedCall};
use super::headers::{
    CONSUMER_HEADER, ERROR_HEADER, Failures, MESSAGE_ID_HEADER, QUEUE_HEADER, REASON_HEADER,
    ROUTING_KEY_HEADER, original_routing_key,
};
use super::health::Health;
use super::republish::Republisher;
use super::retry::{Mode, RetryPolicy, delay_queue};
use super::stats::{Counter, Stats};
use super::{DecodeError, Message, MessageIdSource};
use crate::Tx;
use crate::inbox::{self, Claim, InvalidMessageId};

/// The claim relies on READ COMMITTED (a duplicate's follow-up read must see
/// the row another transaction just committed), whatever the database default.
pub(crate) const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Everything a delivery task needs, shared by all tasks of one consumer.
pub(crate) struct Pipeline {
    pub(crate) consumer: String,
    pub(crate) queue: String,
    pub(crate) dead_letter_queue: String,
    pub(crate) pool: PgPool,
    pub(crate) handler: BoxedHandler,
    pub(crate) message_id: MessageIdSource,
    pub(crate) retry: RetryPolicy,
    pub(crate) handler_timeout: Duration,
    /// The header of message groups (ids in a window count per group).
    #[cfg(feature = "window")]
    pub(crate) group_header: Option<String>,
    #[cfg(feature = "window")]
    pub(crate) window: Option<Arc<dyn crate::window::ErasedWindow>>,
    pub(crate) gate: Arc<DatabaseGate>,
    /// Copies to delay queues and to the DLQ, confirmed before the ack.
    pub(crate) republisher: Republisher,
    /// Fired when the republishing channels are gone: the session must end.
    pub(crate) broken: CancellationToken,
    /// Fired on shutdown: deliveries waiting for the database give up.
    pub(crate) shutdown: CancellationToken,
    pub(crate) health: Health,
    pub(crate) stats: Stats,
    /// Batch mode's coalesced acks for this session's channel.
    pub(crate) acks: AckTracker,
}

/// Passes that end in a connection error although the database answered in
/// between: after this many, the error is the message's (a statement that
/// kills its own connection, a second pool) and it is retried like any other.
pub(crate) const MAX_DATABASE_PASSES: u32 = 5;

/// Error texts in headers are cut to this: a frame carries the headers whole.
const MAX_ERROR_HEADER: usize = 4096;

/// A pause before handing a delivery back with nack when no confirmed
/// republish was possible, so a failing broker path is not hammered.
const FALLBACK_PAUSE: Duration = Duration::from_secs(1);

/// What the claim, the handler and the commit decided.
#[derive(Debug)]
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
    /// Shutdown came while the delivery waited for the database: leave it
    /// unacked; it returns to the queue when the channel closes.
    Abandoned,
    /// Might succeed later: retry per the policy.
    Retry {
        error: String,
        requested_delay: Option<Duration>,
    },
}

/// How a handler call ended.
pub(crate) enum HandlerRun {
    Done,
    Failed(HandlerError),
    Panicked(String),
    TimedOut,
}

/// One pass through claim, handler and commit.
enum Pass {
    Done(Outcome),
    /// The database connection failed: nothing of this pass survived (or the
    /// commit's outcome is unknown, which a new pass resolves through the claim).
    DatabaseDown(String),
}

impl Pipeline {
    /// Processes one delivery to its end, inside a span that records its outcome.
    /// Returns how it was settled (`"abandoned"` when it was left unacked).
    pub(crate) async fn run(self: Arc<Self>, delivery: lapin::message::Delivery) -> &'static str {
        self.stats.incr(Counter::Deliveries);
        let acker = delivery.acker.clone();
        let message = Message::from_delivery(delivery);
        self.run_message(acker, message).await
    }

    /// The per-message path for a delivery already received (also a batch's
    /// fallback when the batch as a whole failed).
    pub(crate) async fn run_message(
        self: Arc<Self>,
        acker: Acker,
        mut message: Message,
    ) -> &'static str {
        let span = tracing::info_span!(
            "delivery",
            consumer = %self.consumer,
            message_id = field::Empty,
            delivery_tag = message.delivery_tag(),
            redelivered = message.redelivered(),
            outcome = field::Empty,
        );
        async {
            // A batch's fallback hands over messages whose id is already known.
            let id = match message.id() {
                "" => self.message_id.extract(&message),
                known => Ok(known.to_owned()),
            };
            let outcome = match id {
                Ok(id) => {
                    Span::current().record("message_id", id.as_str());
                    if message.id().is_empty() {
                        message.set_id(id);
                    }
                    self.decide(&message, &acker).await
                }
                Err(e) => invalid_id(e),
            };
            let settled = self.settle(&acker, &message, outcome).await;
            Span::current().record("outcome", settled);
            settled
        }
        .instrument(span)
        .await
    }

    /// Decodes, then claims, runs the handler and commits, as many passes as
    /// database outages need; says how to settle the delivery.
    async fn decide(&self, message: &Message, acker: &Acker) -> Outcome {
        for _ in 1..MAX_DATABASE_PASSES {
            match self.pass(message, acker).await {
                Pass::Done(outcome) => return outcome,
                Pass::DatabaseDown(error) => {
                    self.gate.report_down(&error);
                    tokio::select! {
                        () = self.gate.wait_available() => {}
                        () = self.shutdown.cancelled() => return Outcome::Abandoned,
                        // The channel died meanwhile (reconnect, broker
                        // consumer timeout): the broker redelivers; stop here.
                        () = channel_closed(acker) => return Outcome::Abandoned,
                    }
                }
            }
        }
        match self.pass(message, acker).await {
            Pass::Done(outcome) => outcome,
            Pass::DatabaseDown(error) => {
                retry("connection errors although the database answers", error)
            }
        }
    }

    #[cfg_attr(not(feature = "window"), allow(unused_variables))]
    async fn pass(&self, message: &Message, acker: &Acker) -> Pass {
        // Decode before touching the database: a bad body is final.
        let call = match (self.handler)(message.clone()) {
            Ok(call) => call,
            Err(e) => return Pass::Done(undecodable(&e)),
        };
        #[cfg(feature = "window")]
        if let Some(window) = &self.window {
            return Pass::Done(self.window_pass(&**window, call, message, acker).await);
        }
        let id = message.id();
        let mut tx = match self.pool.begin_with(BEGIN).await {
            Ok(tx) => tx,
            Err(e) => return database_error("cannot begin a transaction", e),
        };
        match inbox::claim(&mut tx, &self.consumer, id, message.body()).await {
            Err(crate::Error::Database(e)) => return database_error("claim failed", e),
            Err(e) => return Pass::Done(retry("claim failed", e)),
            Ok(Claim::Duplicate) => {
                rollback(tx).await;
                return Pass::Done(Outcome::Duplicate);
            }
            Ok(Claim::Mismatch) => {
                rollback(tx).await;
                return Pass::Done(self.mismatch(message));
            }
            Ok(Claim::Fresh) => {}
        }

        let (run, tx) = self.call_handler(call, tx).await;
        let Some(tx) = tx else {
            // The guard lives on in a task the handler spawned; the
            // transaction rolls back when that guard is dropped.
            return Pass::Done(retry(
                "handler finished while a task it spawned still holds the transaction",
                "rolled back",
            ));
        };
        match run {
            HandlerRun::Done => self.commit(tx, id).await,
            HandlerRun::Failed(e) => {
                rollback(tx).await;
                if is_connection_failure(e.source()) {
                    return Pass::DatabaseDown(format!("handler lost its connection: {e}"));
                }
                Pass::Done(handler_failed(e))
            }
            HandlerRun::Panicked(panic) => {
                rollback(tx).await;
                Pass::Done(retry("handler panicked", panic))
            }
            HandlerRun::TimedOut => {
                rollback(tx).await;
                Pass::Done(retry(
                    "handler timed out after",
                    format!("{:?}", self.handler_timeout),
                ))
            }
        }
    }

    /// Runs a handler call on `tx`, bounded by the handler timeout, with
    /// panics caught; then takes the transaction back (`None` if a guard
    /// outlived the call in a task it spawned).
    pub(crate) async fn call_handler(
        &self,
        call: PreparedCall,
        tx: Transaction<'static, Postgres>,
    ) -> (HandlerRun, Option<Transaction<'static, Postgres>>) {
        let tx = Tx::new(tx);
        let run = self.run_call(call, tx.clone()).await;
        (run, tx.take())
    }

    /// Runs a handler call with `tx`, bounded by the handler timeout, with
    /// panics caught.
    async fn run_call(&self, call: PreparedCall, tx: Tx) -> HandlerRun {
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(
            self.handler_timeout,
            // The call itself inside the guard: user code runs before it
            // returns its future too.
            AssertUnwindSafe(async { call(tx.clone()).await }).catch_unwind(),
        )
        .await;
        self.stats.handler_duration(started.elapsed());
        match result {
            Ok(Ok(Ok(()))) => HandlerRun::Done,
            Ok(Ok(Err(e))) => HandlerRun::Failed(e),
            Ok(Err(panic)) => HandlerRun::Panicked(panic_message(&*panic).to_owned()),
            Err(_) => HandlerRun::TimedOut,
        }
    }

    /// Window mode: reserve the id in the window, run the handler without a
    /// transaction, record the id after success or release it after a failure.
    #[cfg(feature = "window")]
    async fn window_pass(
        &self,
        window: &dyn crate::window::ErasedWindow,
        call: PreparedCall,
        message: &Message,
        acker: &Acker,
    ) -> Outcome {
        use crate::window::{Reservation, Scope};
        let group = self
            .group_header
            .as_deref()
            .and_then(|h| super::headers::string_header(message.headers(), h));
        let scope = match group {
            Some(group) => Scope::group(&self.queue, &group),
            None => Scope::queue(&self.queue),
        };
        let key = scope.key_of(message.id());
        // Recorded with the id, so a reused id with another body is caught.
        let body_hash = crate::window::DedupId::content(message.body());
        // The reservation outlives the longest handler run (bounded, so that
        // a huge handler timeout cannot overflow the clock).
        let lease = self
            .handler_timeout
            .saturating_add(Duration::from_secs(5))
            .min(Duration::from_secs(24 * 60 * 60));
        let deadline = tokio::time::Instant::now() + lease;
        let token = loop {
            match window.reserve(&key, lease).await {
                Err(e) => return retry("the dedup window failed", e),
                Ok(Reservation::Seen(seen)) if seen == body_hash.as_str() => {
                    return Outcome::Duplicate;
                }
                Ok(Reservation::Seen(_)) => return self.mismatch(message),
                Ok(Reservation::Reserved { token }) => break token,
                // A copy is being processed right now: wait for its outcome.
                Ok(_) if tokio::time::Instant::now() < deadline => {
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(25)) => {}
                        () = self.shutdown.cancelled() => return Outcome::Abandoned,
                        () = channel_closed(acker) => return Outcome::Abandoned,
                    }
                }
                Ok(_) => return retry("the id stayed reserved by another copy", "in the window"),
            }
        };
        let run = self.run_call(call, Tx::detached()).await;
        let failed = !matches!(run, HandlerRun::Done);
        if failed && let Err(e) = window.release(&key, token).await {
            tracing::warn!(error = %e, "could not release the id in the dedup window");
        }
        match run {
            HandlerRun::Done => {
                match window.record(&key, token, body_hash.as_str()).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!("the window reservation expired before it was recorded")
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "could not record the id in the dedup window")
                    }
                }
                Outcome::Processed
            }
            HandlerRun::Failed(e) => handler_failed(e),
            HandlerRun::Panicked(panic) => retry("handler panicked", panic),
            HandlerRun::TimedOut => retry(
                "handler timed out after",
                format!("{:?}", self.handler_timeout),
            ),
        }
    }

    async fn commit(&self, mut tx: Transaction<'static, Postgres>, id: &str) -> Pass {
        // COMMIT of an aborted transaction (a handler that ignored a failed
        // statement) reports success while it rolls back; a handler that ran
        // ROLLBACK itself leaves nothing to commit. Check the claim is still ours.
        let ours =
            sqlx::query("SELECT 1 FROM processed_messages WHERE consumer = $1 AND message_id = $2")
                .bind(&self.consumer)
                .bind(id)
                .fetch_optional(&mut *tx)
                .await;
        match ours {
            Ok(Some(_)) => {}
            Ok(None) => {
                rollback(tx).await;
                return Pass::Done(retry(
                    "the handler ended the transaction itself",
                    "its writes and the claim are gone",
                ));
            }
            Err(e) if is_connection_error(&e) => {
                return database_error("lost the connection before commit", e);
            }
            Err(e) => {
                rollback(tx).await;
                return Pass::Done(retry(
                    "the handler left the transaction aborted (did it ignore a failed statement?)",
                    e,
                ));
            }
        }
        match tx.commit().await {
            Ok(()) => Pass::Done(Outcome::Processed),
            Err(e) => {
                // Maybe committed, maybe not: never ack. The next pass (or
                // redelivery) is either claimed as a duplicate or runs afresh.
                self.stats.incr(Counter::CommitFailures);
                if is_connection_error(&e) {
                    database_error("commit outcome unknown", e)
                } else {
                    Pass::Done(retry("commit failed", e))
                }
            }
        }
    }

    /// Acks, dead-letters or retries, and says which it did. Nothing is acked
    /// before its effects, its retry copy or its dead letter are durable.
    /// A reused id: counted, logged, and dead-lettered.
    pub(crate) fn mismatch(&self, message: &Message) -> Outcome {
        let id = message.id();
        self.stats.incr(Counter::PayloadMismatches);
        tracing::warn!(message_id = %id, "message id reused with a different payload");
        Outcome::DeadLetter {
            reason: DeadLetterReason::PayloadMismatch,
            error: format!(
                "message id {id:?} was already processed by {:?} with a different body",
                self.consumer
            ),
        }
    }

    pub(crate) async fn settle(
        &self,
        acker: &Acker,
        message: &Message,
        outcome: Outcome,
    ) -> &'static str {
        match outcome {
            Outcome::Processed => {
                self.stats.incr(Counter::Processed);
                ack(acker).await;
                "processed"
            }
            Outcome::Duplicate => {
                self.stats.incr(Counter::Duplicates);
                tracing::debug!("duplicate acknowledged without running the handler");
                ack(acker).await;
                "duplicate"
            }
            Outcome::DeadLetter { reason, error } => {
                self.dead_letter(acker, message, reason, &error, Failures::record(message))
                    .await
            }
            Outcome::Retry {
                error,
                requested_delay,
            } => self.retry(acker, message, &error, requested_delay).await,
            Outcome::Abandoned => "abandoned",
        }
    }

    async fn retry(
        &self,
        acker: &Acker,
        message: &Message,
        error: &str,
        requested_delay: Option<Duration>,
    ) -> &'static str {
        let failures = Failures::record(message);
        match &self.retry.mode {
            Mode::Requeue(pause) => {
                tracing::warn!(%error, "transient failure; requeueing");
                self.stats.incr(Counter::Retried);
                nack_after(acker, *pause).await;
                "retried"
            }
            Mode::Delayed(_) if failures.attempts >= self.retry.max_attempts => {
                let error = format!("{} attempts failed; the last: {error}", failures.attempts);
                self.dead_letter(
                    acker,
                    message,
                    DeadLetterReason::AttemptsExhausted,
                    &error,
                    failures,
                )
                .await
            }
            Mode::Delayed(_) => {
                let delay = self.retry.delay_for(failures.attempts, requested_delay);
                let queue = delay_queue(&self.queue, delay);
                let headers = self.failure_headers(message, error, &failures);
                match self.republisher.publish(&queue, message, headers).await {
                    Ok(()) => {
                        tracing::warn!(%error, attempts = failures.attempts, ?delay, "transient failure; retrying later");
                        self.stats.incr(Counter::Retried);
                        ack(acker).await;
                        "retried"
                    }
                    Err(e) => {
                        let error = format!("cannot publish the retry to {queue:?}: {e}");
                        self.publish_failed(acker, error).await;
                        "retried"
                    }
                }
            }
        }
    }

    async fn dead_letter(
        &self,
        acker: &Acker,
        message: &Message,
        reason: DeadLetterReason,
        error: &str,
        failures: Failures,
    ) -> &'static str {
        let mut headers = self.failure_headers(message, error, &failures);
        headers.push((REASON_HEADER, AMQPValue::LongString(reason.as_str().into())));
        match self
            .republisher
            .publish(&self.dead_letter_queue, message, headers)
            .await
        {
            Ok(()) => {
                self.stats.incr(Counter::DeadLettered);
                tracing::warn!(%reason, %error, "dead-lettered");
                ack(acker).await;
                "dead_lettered"
            }
            Err(e) => {
                let error = format!(
                    "cannot dead-letter ({reason}) to {:?}: {e}",
                    self.dead_letter_queue
                );
                self.publish_failed(acker, error).await;
                "retried"
            }
        }
    }

    fn failure_headers(
        &self,
        message: &Message,
        error: &str,
        failures: &Failures,
    ) -> Vec<(&'static str, AMQPValue)> {
        let text = |s: &str| AMQPValue::LongString(s.into());
        let mut headers = vec![
            (MESSAGE_ID_HEADER, text(message.id())),
            (ERROR_HEADER, text(truncate(error, MAX_ERROR_HEADER))),
            (CONSUMER_HEADER, text(&self.consumer)),
            (QUEUE_HEADER, text(&self.queue)),
            (ROUTING_KEY_HEADER, text(&original_routing_key(message))),
        ];
        headers.extend(failures.headers());
        headers
    }

    /// No confirmed copy: hand the original back instead. If the publishing
    /// channels are gone, the session must reconnect.
    async fn publish_failed(&self, acker: &Acker, error: String) {
        tracing::error!(%error, "requeueing the original instead");
        self.health.record_error(error);
        if !self.republisher.is_open().await {
            self.broken.cancel();
        }
        self.stats.incr(Counter::Retried);
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

async fn ack(acker: &Acker) {
    // Either way the work is durable; the redelivery will be claimed as a duplicate.
    match acker.ack(BasicAckOptions::default()).await {
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

fn handler_failed(e: HandlerError) -> Outcome {
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

pub(crate) fn undecodable(e: &DecodeError) -> Outcome {
    Outcome::DeadLetter {
        reason: DeadLetterReason::UndecodableBody,
        error: e.to_string(),
    }
}

pub(crate) fn invalid_id(e: InvalidMessageId) -> Outcome {
    let reason = match e {
        InvalidMessageId::Missing => DeadLetterReason::MissingMessageId,
        _ => DeadLetterReason::InvalidMessageId,
    };
    Outcome::DeadLetter {
        reason,
        error: e.to_string(),
    }
}

fn retry(context: &str, e: impl std::fmt::Display) -> Outcome {
    Outcome::Retry {
        error: format!("{context}: {e}"),
        requested_delay: None,
    }
}

/// A database error before or at commit: a connection failure goes to the
/// gate, anything else is retried like a handler error.
fn database_error(context: &str, e: sqlx::Error) -> Pass {
    if is_connection_error(&e) {
        Pass::DatabaseDown(format!("{context}: {e}"))
    } else {
        Pass::Done(retry(context, e))
    }
}

/// Resolves once the delivery's channel is closed (its acker poisoned).
pub(crate) async fn channel_closed(acker: &Acker) {
    while !acker.poisoned() {
        tokio::time::sleep(Duration::from_secs(1)).await;
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
