//! Batch mode: many deliveries, one transaction, one claim statement, one handler call.
//!
//! The runtime collects up to `batch_size` deliveries (or what arrived within
//! the linger time), claims all their ids in one `INSERT ... SELECT unnest(..)
//! ON CONFLICT DO NOTHING RETURNING` (ids sorted, so two batches claiming
//! overlapping ids lock them in the same order and cannot deadlock), runs the
//! handler once over the fresh messages, commits once, then acks. Duplicates
//! are acked without running the handler; mismatches and poison follow the
//! per-message rules. No savepoints on the happy path: if the batch fails, it
//! rolls back and each of its deliveries is processed on its own, so only the
//! failing one takes the failure path.

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use lapin::Acker;
use sqlx::{Postgres, Transaction};
use tracing::Instrument;

use super::database_gate::{is_connection_error, is_connection_failure};
use super::delivery::{
    HandlerRun, MAX_DATABASE_PASSES, Outcome, Pipeline, channel_closed, invalid_id, undecodable,
};
use super::handler::{BoxedHandler, HandlerError, PreparedCall};
use super::message::{DecodeError, FromMessage, Message, decode};
use super::stats::Counter;
use crate::Tx;
use crate::inbox::payload_sha256;

/// The handler bound to a batch of decoded messages, waiting for the transaction.
pub(crate) type BatchCall = PreparedCall;

/// A batch handler with its message type erased: decodes every message, or
/// says which one (by index) does not decode.
pub(crate) type BoxedBatchHandler =
    Arc<dyn Fn(&[Message]) -> Result<BatchCall, (usize, DecodeError)> + Send + Sync>;

/// A `Fn(Tx, Vec<M>)` batch handler, erased; and the same handler over a
/// batch of one, for the per-message fallback.
pub(crate) fn boxed_batch<M, F, Fut>(handler: F) -> (BoxedBatchHandler, BoxedHandler)
where
    M: FromMessage,
    F: Fn(Tx, Vec<M>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    let single = handler.clone();
    let batch: BoxedBatchHandler = Arc::new(move |messages: &[Message]| {
        let decoded = messages
            .iter()
            .enumerate()
            .map(|(i, m)| decode::<M>(m.clone()).map_err(|e| (i, e)))
            .collect::<Result<Vec<M>, _>>()?;
        let handler = handler.clone();
        Ok(
            Box::new(move |tx| Box::pin(handler(tx, decoded)) as BoxFuture<'static, _>)
                as BatchCall,
        )
    });
    let one: BoxedHandler = Arc::new(move |message: Message| {
        let decoded = decode::<M>(message)?;
        let handler = single.clone();
        Ok(
            Box::new(move |tx| Box::pin(handler(tx, vec![decoded])) as BoxFuture<'static, _>)
                as super::handler::PreparedCall,
        )
    });
    (batch, one)
}

/// A per-message handler run over each fresh message of a batch in turn, on
/// the batch's transaction.
pub(crate) fn per_message(handler: BoxedHandler) -> BoxedBatchHandler {
    Arc::new(move |messages: &[Message]| {
        let calls = messages
            .iter()
            .enumerate()
            .map(|(i, m)| handler(m.clone()).map_err(|e| (i, e)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Box::new(move |tx: Tx| {
            Box::pin(async move {
                for call in calls {
                    call(tx.clone()).await?;
                }
                Ok(())
            }) as BoxFuture<'static, _>
        }) as BatchCall)
    })
}

/// How each claimed message of a batch ended up.
enum Verdict {
    Fresh,
    Duplicate,
    Mismatch,
    /// Conflicted, yet no row is there (retention deleted it meanwhile):
    /// never guess; the per-message claim sorts it out.
    Vanished,
}

/// What a batch pass decided.
enum BatchPass {
    /// Committed (or nothing to commit): settle each delivery with its verdict.
    Done(Vec<Verdict>),
    /// The database connection failed: wait at the gate, then try again.
    DatabaseDown(String),
    /// Something failed that may concern one delivery only: process each on its own.
    Split(String),
}

impl Pipeline {
    /// Settles one delivery of a batch on its own (dead letter, retry), then
    /// records its tag as settled.
    async fn settle_alone(&self, acker: &Acker, message: &Message, outcome: Outcome, tag: u64) {
        if self.settle(acker, message, outcome).await != "abandoned" {
            self.acks.settle([(tag, None)]).await;
        }
    }

    /// Processes one collected batch to its end.
    pub(crate) async fn run_batch(
        self: Arc<Self>,
        batch: &BoxedBatchHandler,
        deliveries: Vec<lapin::message::Delivery>,
    ) {
        let span = tracing::info_span!("batch", consumer = %self.consumer, size = deliveries.len());
        async {
            // Ids first: a delivery without a usable id leaves the batch at once.
            let mut items: Vec<(Acker, Message)> = Vec::with_capacity(deliveries.len());
            for delivery in deliveries {
                self.stats.incr(Counter::Deliveries);
                let acker = delivery.acker.clone();
                let mut message = Message::from_delivery(delivery);
                match self.message_id.extract(&message) {
                    Ok(id) => {
                        message.set_id(id);
                        items.push((acker, message));
                    }
                    Err(e) => {
                        let tag = message.delivery_tag();
                        self.settle_alone(&acker, &message, invalid_id(e), tag)
                            .await;
                    }
                }
            }
            // Then bodies: an undecodable one is dead-lettered and leaves too.
            let decoded = loop {
                if items.is_empty() {
                    return;
                }
                let messages: Vec<Message> = items.iter().map(|(_, m)| m.clone()).collect();
                match batch(&messages) {
                    Ok(call) => break call,
                    Err((i, e)) => {
                        let (acker, message) = items.remove(i);
                        let tag = message.delivery_tag();
                        self.settle_alone(&acker, &message, undecodable(&e), tag)
                            .await;
                    }
                }
            };
            self.claim_and_handle(batch, items, decoded).await;
        }
        .instrument(span)
        .await
    }

    async fn claim_and_handle(
        self: &Arc<Self>,
        batch: &BoxedBatchHandler,
        items: Vec<(Acker, Message)>,
        decoded: BatchCall,
    ) {
        let messages: Vec<Message> = items.iter().map(|(_, m)| m.clone()).collect();
        let mut database_passes = 0;
        let mut decoded = Some(decoded);
        loop {
            // The call decoded for the whole batch serves the first pass if
            // every message is fresh (the usual case); otherwise the fresh
            // ones are decoded again.
            let pass = match self.batch_pass(batch, &messages, decoded.take()).await {
                // As in per-message mode: connection errors although the
                // database answers are the batch's own problem.
                BatchPass::DatabaseDown(error) if database_passes + 1 >= MAX_DATABASE_PASSES => {
                    BatchPass::Split(format!(
                        "connection errors although the database answers: {error}"
                    ))
                }
                pass => pass,
            };
            match pass {
                BatchPass::Done(verdicts) => {
                    // Processed and duplicates: one multiple ack for the lot,
                    // once every lower tag is settled. Reused ids: dead-lettered.
                    let mut coalesced = Vec::with_capacity(items.len());
                    let mut alone = Vec::new();
                    for ((acker, message), verdict) in items.iter().zip(verdicts) {
                        let counter = match verdict {
                            Verdict::Fresh => Counter::Processed,
                            // A batch pass never ends Done with a vanished row.
                            Verdict::Duplicate | Verdict::Vanished => Counter::Duplicates,
                            Verdict::Mismatch => {
                                alone.push((acker, message, self.mismatch(message)));
                                continue;
                            }
                        };
                        self.stats.incr(counter);
                        coalesced.push((message.delivery_tag(), Some(acker.clone())));
                    }
                    for (acker, message, outcome) in alone {
                        self.settle_alone(acker, message, outcome, message.delivery_tag())
                            .await;
                    }
                    self.acks.settle(coalesced).await;
                    return;
                }
                BatchPass::DatabaseDown(error) => {
                    database_passes += 1;
                    self.gate.report_down(&error);
                    tokio::select! {
                        () = self.gate.wait_available() => {}
                        // Unacked: the deliveries return when the channel closes.
                        () = self.shutdown.cancelled() => return,
                        () = channel_closed(&items[0].0) => return,
                    }
                }
                BatchPass::Split(error) => {
                    tracing::warn!(%error, size = items.len(), "batch failed; processing its deliveries one by one");
                    for (acker, message) in &items {
                        let settled = self
                            .clone()
                            .run_message(acker.clone(), message.clone())
                            .await;
                        if settled != "abandoned" {
                            self.acks.settle([(message.delivery_tag(), None)]).await;
                        }
                    }
                    return;
                }
            }
        }
    }

    async fn batch_pass(
        &self,
        batch: &BoxedBatchHandler,
        messages: &[Message],
        decoded: Option<BatchCall>,
    ) -> BatchPass {
        let mut tx = match self.pool.begin_with(super::delivery::BEGIN).await {
            Ok(tx) => tx,
            Err(e) => return database_error("cannot begin a transaction", e),
        };
        let verdicts = match self.claim_all(&mut tx, messages).await {
            Ok(verdicts) => verdicts,
            Err(e) => return database_error("batch claim failed", e),
        };
        if verdicts.iter().any(|v| matches!(v, Verdict::Vanished)) {
            let _ = tx.rollback().await;
            return BatchPass::Split("a claimed id vanished during the batch claim".into());
        }
        let fresh: Vec<Message> = messages
            .iter()
            .zip(&verdicts)
            .filter(|(_, v)| matches!(v, Verdict::Fresh))
            .map(|(m, _)| m.clone())
            .collect();
        if fresh.is_empty() {
            let _ = tx.rollback().await;
            return BatchPass::Done(verdicts);
        }
        let call = match decoded.filter(|_| fresh.len() == messages.len()) {
            Some(call) => Ok(call),
            None => batch(&fresh),
        };
        let call = match call {
            Ok(call) => call,
            // Decoded once already; a handler type that decodes differently
            // the second time is handled one by one.
            Err((_, e)) => return BatchPass::Split(e.to_string()),
        };
        let (run, tx) = self.call_handler(call, tx).await;
        let Some(mut tx) = tx else {
            return BatchPass::Split(
                "a task the handler spawned still holds the transaction".into(),
            );
        };
        let failure = match run {
            HandlerRun::Done => None,
            HandlerRun::Failed(e) if is_connection_failure(e.source()) => {
                let _ = tx.rollback().await;
                return BatchPass::DatabaseDown(format!("batch handler lost its connection: {e}"));
            }
            HandlerRun::Failed(e) => Some(format!("batch handler failed: {e}")),
            HandlerRun::Panicked(panic) => Some(format!("batch handler panicked: {panic}")),
            HandlerRun::TimedOut => Some(format!(
                "batch handler timed out after {:?}",
                self.handler_timeout
            )),
        };
        if let Some(failure) = failure {
            let _ = tx.rollback().await;
            return BatchPass::Split(failure);
        }
        // As in per-message mode: COMMIT of an aborted transaction would
        // report success while rolling back. One claim row tells: a statement
        // fails in an aborted transaction, and a ROLLBACK took every claim.
        let ours: Result<Option<i32>, sqlx::Error> = sqlx::query_scalar(
            "SELECT 1 FROM processed_messages WHERE consumer = $1 AND message_id = $2",
        )
        .bind(&self.consumer)
        .bind(fresh[0].id())
        .fetch_optional(&mut *tx)
        .await;
        match ours {
            Ok(Some(_)) => {}
            Ok(None) => {
                let _ = tx.rollback().await;
                return BatchPass::Split("the batch handler ended the transaction itself".into());
            }
            Err(e) if is_connection_error(&e) => {
                return BatchPass::DatabaseDown(format!("lost the connection before commit: {e}"));
            }
            Err(e) => {
                let _ = tx.rollback().await;
                return BatchPass::Split(format!(
                    "the batch handler left the transaction aborted: {e}"
                ));
            }
        }
        match tx.commit().await {
            Ok(()) => BatchPass::Done(verdicts),
            Err(e) => {
                self.stats.incr(Counter::CommitFailures);
                if is_connection_error(&e) {
                    BatchPass::DatabaseDown(format!("batch commit outcome unknown: {e}"))
                } else {
                    BatchPass::Split(format!("batch commit failed: {e}"))
                }
            }
        }
    }

    /// Claims every id in one statement and classifies each message.
    async fn claim_all(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        messages: &[Message],
    ) -> Result<Vec<Verdict>, sqlx::Error> {
        let ids: Vec<&str> = messages.iter().map(|m| m.id()).collect();
        let hashes: Vec<Vec<u8>> = messages
            .iter()
            .map(|m| payload_sha256(m.body()).to_vec())
            .collect();
        // Sorted, so that batches claiming overlapping ids lock them in one
        // order; a repeated id conflicts with its own first row and is
        // skipped, and the delivery order breaks ties, so the first copy wins
        // as in per-message mode.
        let inserted: Vec<String> = sqlx::query_scalar(
            "INSERT INTO processed_messages (consumer, message_id, payload_sha256) \
             SELECT $1, id, hash FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS t(id, hash, ord) \
             ORDER BY id, ord \
             ON CONFLICT DO NOTHING RETURNING message_id",
        )
        .bind(&self.consumer)
        .bind(&ids)
        .bind(&hashes)
        .fetch_all(&mut **tx)
        .await?;
        let mut fresh: HashMap<String, bool> = inserted.into_iter().map(|id| (id, false)).collect();
        let mut stored: HashMap<String, Option<Vec<u8>>> = HashMap::new();
        if fresh.len() < ids.len() {
            // Also what this batch inserted, for ids that occur twice in it.
            // A join with unnest, not `= ANY($2)`: the generic plan of the
            // latter can scan the whole table.
            let rows: Vec<(String, Option<Vec<u8>>)> = sqlx::query_as(
                "SELECT p.message_id, p.payload_sha256 FROM unnest($2::text[]) AS t(id) \
                 JOIN processed_messages p ON p.consumer = $1 AND p.message_id = t.id",
            )
            .bind(&self.consumer)
            .bind(&ids)
            .fetch_all(&mut **tx)
            .await?;
            stored.extend(rows);
        }
        Ok(messages
            .iter()
            .zip(&hashes)
            .map(|(m, hash)| {
                if let Some(taken) = fresh.get_mut(m.id())
                    && !*taken
                    && stored
                        .get(m.id())
                        .is_none_or(|s| s.as_deref() == Some(hash.as_slice()))
                {
                    // The first copy in the batch with the inserted body.
                    *taken = true;
                    return Verdict::Fresh;
                }
                match stored.get(m.id()) {
                    None => Verdict::Vanished,
                    Some(Some(s)) if s != hash => Verdict::Mismatch,
                    Some(_) => Verdict::Duplicate,
                }
            })
            .collect())
    }
}

fn database_error(context: &str, e: sqlx::Error) -> BatchPass {
    if is_connection_error(&e) {
        BatchPass::DatabaseDown(format!("{context}: {e}"))
    } else {
        BatchPass::Split(format!("{context}: {e}"))
    }
}
