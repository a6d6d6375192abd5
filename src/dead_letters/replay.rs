//! A replay from the `dead_letters` table: through the outbox, exactly once.

use sqlx::{PgPool, QueryBuilder, Row};

use super::model::{Filter, LetterState, Refusal, ReplayEvent, ReplayOptions, ReplayReport};
use super::queries::{count, push_filter, stored};
use super::view::DeadLetter;
use crate::inbox::{self, Claim};
use crate::outbox::{self, OutboxError, OutboxMessage};
use crate::properties::Properties;
use crate::runtime::letter_table::text;
use crate::{Error, Result};

/// Letters per transaction (one with a throttle).
const BATCH: i64 = 100;

/// Replays the live letters of `filter` exactly once: per batch, one
/// transaction stages each letter in the outbox (its original message id,
/// body and properties, its failure history moved into the replay
/// headers) and marks it replayed; `on_event` hears of each letter once its
/// batch committed. Letters whose id the consumer already processed are
/// skipped unless `options.force`, and those bound for a queue in
/// `missing` (it does not exist) are skipped too.
///
/// # Errors
/// [`Error::Database`] when a batch fails (the batches before it are
/// replayed; that batch is untouched).
pub(crate) async fn replay(
    pool: &PgPool,
    filter: &Filter,
    options: &ReplayOptions,
    missing: &[String],
    mut on_event: impl FnMut(ReplayEvent<'_>),
) -> Result<ReplayReport> {
    let mut report = ReplayReport {
        dry_run: options.dry_run,
        ..ReplayReport::default()
    };
    let live = Filter {
        state: Some(LetterState::Live),
        any_state: false,
        ..filter.clone()
    };
    let selected = count(pool, &live).await?;
    let total = filter
        .limit
        .map_or(selected, |l| selected.min(u64::try_from(l).unwrap_or(0)));
    on_event(ReplayEvent::Started { total });
    if options.dry_run {
        report.replayed = total;
        return Ok(report);
    }
    let batch = if options.throttle.is_some() { 1 } else { BATCH };
    let mut skipped_ids: Vec<i64> = Vec::new();
    let mut left = filter.limit;
    loop {
        let take = left.map_or(batch, |l| l.min(batch));
        if take <= 0 {
            break;
        }
        let mut tx = pool.begin().await?;
        let mut q = QueryBuilder::new(
            "SELECT id, consumer, queue, message_id, envelope, properties, body, transport \
             FROM dead_letters",
        );
        push_filter(&mut q, &live);
        q.push(" AND NOT (id = ANY(")
            .push_bind(skipped_ids.clone())
            .push(")) ORDER BY id LIMIT ")
            .push_bind(take)
            .push(" FOR UPDATE SKIP LOCKED");
        let rows = q.build().fetch_all(&mut *tx).await?;
        if rows.is_empty() {
            tx.rollback().await?;
            break;
        }
        let mut messages = Vec::with_capacity(rows.len());
        let mut replayed: Vec<(i64, Option<String>, String)> = Vec::with_capacity(rows.len());
        let mut skipped: Vec<(i64, Option<String>, Refusal)> = Vec::new();
        // The claims the replayed letters hold: released, their copies are fresh.
        let mut held: Vec<(String, String)> = Vec::new();
        for row in &rows {
            let id: i64 = row.try_get("id")?;
            let consumer: String = row.try_get("consumer")?;
            let queue: String = row.try_get("queue")?;
            let message_id: Option<String> = row.try_get("message_id")?;
            let properties = stored(row.try_get("envelope")?, row.try_get("properties")?);
            let body: Vec<u8> = row.try_get("body")?;
            let transport: String = row.try_get("transport")?;
            let refusal = match (&message_id, options.force) {
                // In the batch's transaction: a second connection would
                // deadlock a small pool under concurrent replays.
                (Some(mid), false) => match inbox::Inbox::new(consumer.as_str())
                    .lookup(&mut *tx, mid, &body)
                    .await?
                {
                    Claim::Fresh => None,
                    Claim::Mismatch => Some(Refusal::PayloadMismatch),
                    Claim::Duplicate => Some(Refusal::AlreadyProcessed),
                },
                _ => None,
            };
            let refusal = refusal.or(properties.is_none().then_some(Refusal::Undecodable));
            if let Some(refusal) = refusal {
                skipped_ids.push(id);
                skipped.push((id, message_id, refusal));
                continue;
            }
            let to = options.to.clone().unwrap_or(queue);
            if missing.contains(&to) {
                skipped_ids.push(id);
                skipped.push((id, message_id, Refusal::NoSuchQueue));
                continue;
            }
            let properties = properties.unwrap_or_default();
            match replay_message(&properties, message_id.clone(), &to, body, transport) {
                Ok(message) => {
                    messages.push(message);
                    if let Some(mid) = &message_id {
                        held.push((consumer, mid.clone()));
                    }
                    replayed.push((id, message_id, to));
                }
                // This letter stays; the others go on.
                Err(refusal) => {
                    skipped_ids.push(id);
                    skipped.push((id, message_id, refusal));
                }
            }
        }
        if !messages.is_empty() {
            outbox::stage_all(&mut *tx, messages)
                .await
                .map_err(|e| Error::Other(Box::new(e)))?;
            let ids: Vec<i64> = replayed.iter().map(|(id, ..)| *id).collect();
            let targets: Vec<&str> = replayed.iter().map(|(.., to)| to.as_str()).collect();
            sqlx::query(
                "UPDATE dead_letters d SET state = 'replayed', replay_count = replay_count + 1, \
                     replayed_at = now(), replayed_by = $3, replayed_to = t.target \
                 FROM unnest($1::int8[], $2::text[]) AS t(id, target) WHERE d.id = t.id",
            )
            .bind(&ids)
            .bind(&targets)
            .bind(text(&options.by).as_ref())
            .execute(&mut *tx)
            .await?;
            for (consumer, message_id) in &held {
                crate::runtime::letter_hold::release(&mut *tx, consumer, message_id).await?;
            }
            if let Some(l) = left.as_mut() {
                *l -= ids.len() as i64;
            }
        }
        tx.commit().await?;
        // Told only now: a letter is replayed once its batch committed.
        for (row, message_id, refusal) in &skipped {
            report.skip(*refusal);
            on_event(ReplayEvent::Skipped {
                message_id: message_id.as_deref(),
                row: Some(*row),
                refusal: *refusal,
            });
        }
        for (_, message_id, to) in &replayed {
            report.replayed += 1;
            on_event(ReplayEvent::Replayed {
                message_id: message_id.as_deref(),
                queue: to,
            });
        }
        if let Some(pause) = options.throttle {
            tokio::time::sleep(pause).await;
        }
    }
    Ok(report)
}

/// The outbox message that replays a letter: through the default exchange
/// to `to`, with the letter's body and its exact properties (every basic
/// property, every header with its AMQP type), its failure history moved
/// into the replay headers (as [`DeadLetter::replay_properties`] writes
/// them). The outbox row carries the letter's id (also when the consumer
/// read it from a header, not the `message_id` property), and goes to the
/// relay of the letter's `transport`.
fn replay_message(
    properties: &Properties,
    message_id: Option<String>,
    to: &str,
    body: Vec<u8>,
    transport: String,
) -> std::result::Result<OutboxMessage, Refusal> {
    let replayed = DeadLetter::new(properties).replay_properties();
    let mut message = OutboxMessage::new("", to, body)
        .with_exact(replayed)
        .transport(transport);
    if let (None, Some(id)) = (message.id(), message_id) {
        message = message.row_id(id);
    }
    message.validate().map_err(|e| match e {
        OutboxError::TooLarge { .. } | OutboxError::HeadersTooLarge { .. } => Refusal::TooLarge,
        _ => Refusal::Unstageable,
    })?;
    Ok(message)
}
