//! A replay from a RabbitMQ DLQ: each copy published with confirms before
//! its letter is acked.

use std::future::Future;
use std::time::{Duration, SystemTime};

use lapin::message::Delivery;
use sqlx::PgPool;

use super::dlq::{Opened, letter_of};
use crate::amqp::PublishError;
use crate::dead_letters::model::{Filter, Refusal, ReplayEvent, ReplayOptions, ReplayReport};
use crate::dead_letters::view::DeadLetter;
use crate::inbox::{self, Claim};
use crate::ops::{OpsError, Result, queue_depth};

/// Replays the letters of a DLQ that `filter` selects (see
/// [`DeadLetterStore::replay`](super::DeadLetterStore::replay)).
///
/// # Once per run
/// A replay works on the dead letters present when it started: it reads at
/// most as many as the DLQ held then, so the copies that fail again and
/// come back during the run (behind them) are not replayed again by it. Two
/// replays of one DLQ at once share its dead letters (the broker hands each
/// to one of them); a dead letter that one replayed and that came back
/// before the other finished carries a replay record dated after the other's
/// start and is skipped ([`Refusal::ReplayedDuringRun`]), provided the
/// clocks of the hosts running them agree.
pub(super) async fn replay<F: Future<Output = Result<Opened>>>(
    pool: &PgPool,
    open: impl FnOnce() -> F,
    filter: &Filter,
    options: &ReplayOptions,
    mut on_event: impl FnMut(ReplayEvent<'_>),
) -> Result<ReplayReport> {
    // Before the DLQ's count is taken: a replay record dated later is one
    // made during this run (records are written to the millisecond).
    let started = SystemTime::now() - Duration::from_millis(1);
    let opened = open().await?;
    let mut run = Run {
        pool,
        opened: &opened,
        options,
        checked: Vec::new(),
        started,
    };
    let outcome = run.all(filter, &mut on_event).await;
    opened.close("replayed").await;
    outcome
}

/// One replay in progress.
struct Run<'a> {
    pool: &'a PgPool,
    opened: &'a Opened,
    options: &'a ReplayOptions,
    /// Work queues known to exist.
    checked: Vec<String>,
    /// When the run started.
    started: SystemTime,
}

impl Run<'_> {
    async fn all(
        &mut self,
        filter: &Filter,
        on_event: &mut impl FnMut(ReplayEvent<'_>),
    ) -> Result<ReplayReport> {
        let limit = filter
            .limit
            .map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(0));
        on_event(ReplayEvent::Started {
            total: u64::from(self.opened.ready).min(limit as u64),
        });
        let mut summary = ReplayReport {
            dry_run: self.options.dry_run,
            ..ReplayReport::default()
        };
        let mut seen = 0usize;
        // The dead letters present at the start, and no more: what comes
        // back during the run queues up behind them.
        let snapshot = self.opened.ready as usize;
        let mut read = 0usize;
        while seen < limit && read < snapshot {
            let Some(delivery) = self.opened.next().await? else {
                break;
            };
            read += 1;
            let dead = letter_of(&delivery);
            if !filter.matches(&dead) {
                // Back at once: a long run holds one letter at a time.
                self.opened.put_back(delivery.delivery_tag).await?;
                continue;
            }
            seen += 1;
            let message_id = dead.message_id.as_deref();
            let target = match self.refusal(&delivery).await? {
                Err(refusal) => {
                    summary.skip(refusal);
                    on_event(ReplayEvent::Skipped {
                        message_id,
                        row: None,
                        refusal,
                    });
                    self.opened.put_back(delivery.delivery_tag).await?;
                    continue;
                }
                Ok(target) => target,
            };
            if !self.exists(&target).await? {
                // This letter stays; the others go on.
                summary.skip(Refusal::NoSuchQueue);
                on_event(ReplayEvent::Skipped {
                    message_id,
                    row: None,
                    refusal: Refusal::NoSuchQueue,
                });
                self.opened.put_back(delivery.delivery_tag).await?;
                continue;
            }
            if self.options.dry_run {
                summary.replayed += 1;
                on_event(ReplayEvent::WouldReplay {
                    message_id,
                    queue: &target,
                });
                self.opened.put_back(delivery.delivery_tag).await?;
                continue;
            }
            // Crash here: nothing published; the message is in the DLQ.
            let stored = super::dlq::stored_of(&delivery);
            let Ok(properties) =
                crate::amqp::stored::from_stored(&DeadLetter::new(&stored).replay_properties())
            else {
                // Read from AMQP, it goes back to AMQP: only a bug lands here.
                summary.skip(Refusal::Undecodable);
                self.opened.put_back(delivery.delivery_tag).await?;
                continue;
            };
            let published = self
                .opened
                .confirms
                .publish("", &target, &delivery.data, properties)
                .await;
            match published {
                Ok(()) => {}
                Err(PublishError::TooLarge { .. }) => {
                    summary.skip(Refusal::TooLarge);
                    on_event(ReplayEvent::Skipped {
                        message_id,
                        row: None,
                        refusal: Refusal::TooLarge,
                    });
                    self.opened.put_back(delivery.delivery_tag).await?;
                    continue;
                }
                Err(source) => {
                    return Err(OpsError::NotConfirmed {
                        message_id: dead.message_id.clone(),
                        queue: target.clone(),
                        source: Box::new(source),
                    });
                }
            }
            // Crash here: the copy is in the work queue and the original in the
            // DLQ; a second replay publishes it again and the consumer drops it
            // as a duplicate.
            self.opened
                .ack(delivery.delivery_tag)
                .await
                .map_err(OpsError::Ack)?;
            summary.replayed += 1;
            on_event(ReplayEvent::Replayed {
                message_id,
                queue: &target,
            });
            if let Some(pause) = self.options.throttle {
                tokio::time::sleep(pause).await;
            }
        }
        Ok(summary)
    }

    /// The work queue to replay `delivery` to, or why not.
    async fn refusal(&self, delivery: &Delivery) -> Result<Result<String, Refusal>> {
        let stored = super::dlq::stored_of(delivery);
        let dead = DeadLetter::new(&stored);
        // Replayed by this run (or one beside it) and dead-lettered again.
        if dead.last_replayed().is_some_and(|at| at >= self.started) {
            return Ok(Err(Refusal::ReplayedDuringRun));
        }
        let target = dead.original_queue().or_else(|| self.options.to.clone());
        let mismatch = match (dead.consumer(), dead.message_id()) {
            (Some(consumer), Some(id)) => {
                inbox::Inbox::new(consumer)
                    .lookup(self.pool, &id, &delivery.data)
                    .await?
                    == Claim::Mismatch
            }
            _ => false,
        };
        Ok(match target {
            None => Err(Refusal::Foreign),
            Some(_) if mismatch && !self.options.force => Err(Refusal::PayloadMismatch),
            Some(target) => Ok(target),
        })
    }

    /// Whether a work queue exists (asked once per queue): a publish to a
    /// missing queue through the default exchange would be returned.
    async fn exists(&mut self, target: &str) -> Result<bool> {
        if self.checked.iter().any(|q| q == target) {
            return Ok(true);
        }
        if queue_depth(&self.opened.connection, target)
            .await?
            .is_none()
        {
            return Ok(false);
        }
        self.checked.push(target.to_owned());
        Ok(true)
    }
}
