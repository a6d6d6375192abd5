//! [`replay`]: dead letters back to their work queue, each published with
//! confirms before its DLQ copy is acked.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime};

use lapin::message::Delivery;
use sqlx::PgPool;

use super::{DeadLetterSummary, Opened, Selection};
use crate::amqp::{DeadLetter, PublishError};
use crate::inbox::{self, Claim};
use crate::ops::{OpsError, Result, Services, queue_depth};

/// How [`replay`] runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Every dead letter (required when the [`Selection`] is empty).
    pub all: bool,
    /// Say what would be replayed; move nothing.
    pub dry_run: bool,
    /// The work queue for foreign dead letters (those without an original queue).
    pub to: Option<String>,
    /// Replay ids already processed with a different payload too (the
    /// consumer dead-letters them again, as a reused id).
    pub force: bool,
    /// Wait this long after each replayed message (spreads a large replay out).
    pub throttle: Option<Duration>,
    /// At most this many dead letters (selected ones, replayed or skipped).
    pub limit: Option<usize>,
}

/// Why a selected dead letter was not replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Refusal {
    /// Idempo did not dead-letter it, so it names no work queue, and
    /// [`ReplayOptions::to`] names none either.
    Foreign,
    /// Its consumer already processed its id with a different body: the
    /// copy would be dead-lettered again (unless [`ReplayOptions::force`]).
    PayloadMismatch,
    /// It was replayed after this replay started (by this replay, or by
    /// another one running beside it) and failed again: a replay sends each
    /// dead letter once.
    ReplayedDuringRun,
    /// Its replay copy (with its replay history) would not fit one frame of
    /// the connection.
    TooLarge,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refusal::Foreign => "foreign (no x-idempo-original-queue): it needs a target queue",
            Refusal::PayloadMismatch => "its id was already processed with a different payload",
            Refusal::ReplayedDuringRun => {
                "it was replayed after this replay started and failed again"
            }
            Refusal::TooLarge => "its replay copy would not fit the connection's frame size",
        })
    }
}

/// What [`replay`] reports as it goes, in order.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum ReplayEvent<'a> {
    /// The DLQ is open; at most `total` dead letters will be looked at.
    Started {
        /// The DLQ.
        dlq: &'a str,
        /// Its ready messages, or the limit if lower.
        total: u32,
    },
    /// A selected dead letter stays in the DLQ.
    Skipped {
        /// Its id.
        message_id: Option<&'a str>,
        /// Why.
        refusal: Refusal,
    },
    /// A dry run would replay it to `queue`.
    WouldReplay {
        /// Its id.
        message_id: Option<&'a str>,
        /// Its work queue.
        queue: &'a str,
    },
    /// It was replayed to `queue` (confirmed) and deleted from the DLQ.
    Replayed {
        /// Its id.
        message_id: Option<&'a str>,
        /// Its work queue.
        queue: &'a str,
    },
}

/// What [`replay`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplaySummary {
    /// Replayed (or, in a dry run, would have been).
    pub replayed: u64,
    /// Whether it was a dry run.
    pub dry_run: bool,
    /// Selected dead letters left in the DLQ, per refusal.
    pub skipped: BTreeMap<Refusal, u64>,
}

impl ReplaySummary {
    /// How many were skipped.
    pub fn skipped_total(&self) -> u64 {
        self.skipped.values().sum()
    }
}

/// Replays the dead letters of `queue` that `selection` picks to their work
/// queue (or [`ReplayOptions::to`]), each with its id, body and properties,
/// the attempt counters moved into its history
/// ([`DeadLetter::replay_properties`]), so that its consumer retries it
/// afresh. `on_event` hears of each dead letter as it goes.
///
/// # Guarantee
/// Each copy is published `mandatory` with publisher confirms, and only
/// after the broker confirmed it is the dead letter acked (deleted). A crash
/// before the confirm leaves the dead letter in the DLQ; a crash between the
/// confirm and the ack leaves both, and replaying again publishes a second
/// copy that the consumer drops as a duplicate. Unselected and refused dead
/// letters stay in the DLQ (put back without spending a delivery attempt:
/// see the [module docs](super)).
///
/// # Once per run
/// A replay works on the dead letters present when it started: it reads at
/// most as many as the DLQ held then, so the copies that fail again and
/// come back during the run (behind them) are not replayed again by it. Two
/// replays of one DLQ at once share its dead letters (the broker hands each
/// to one of them); a dead letter that one replayed and that came back
/// before the other finished carries a replay record dated after the other's
/// start and is skipped ([`Refusal::ReplayedDuringRun`]). So no dead letter
/// is replayed twice over both runs, provided the clocks of the hosts
/// running them agree (the record's time is the replaying host's).
///
/// # Refusals
/// A foreign dead letter without a target, and one whose id its consumer
/// already processed with a different body (unless forced), are skipped and
/// counted in [`ReplaySummary::skipped`].
///
/// # Errors
/// [`OpsError::NothingSelected`] when neither the selection nor
/// [`ReplayOptions::all`] says what to replay; [`OpsError::TargetQueueNotFound`]
/// when a work queue does not exist; [`OpsError::NotConfirmed`]; connection,
/// channel and query errors. What was replayed before the error stays replayed.
///
/// ```no_run
/// use idempo::ops::{Services, dlq};
///
/// # async fn doc(services: Services) -> idempo::ops::Result<()> {
/// let selection = dlq::Selection { reason: Some("max attempts exceeded".into()), ..Default::default() };
/// let summary = dlq::replay(&services, "payments", &selection, &Default::default(), |event| {
///     if let dlq::ReplayEvent::Replayed { message_id, queue } = event {
///         println!("{message_id:?} -> {queue}");
///     }
/// })
/// .await?;
/// println!("replayed {}, skipped {}", summary.replayed, summary.skipped_total());
/// # Ok(()) }
/// ```
pub async fn replay(
    services: &Services,
    queue: &str,
    selection: &Selection,
    options: &ReplayOptions,
    mut on_event: impl FnMut(ReplayEvent<'_>),
) -> Result<ReplaySummary> {
    if !options.all && selection.ids.is_empty() && selection.reason.is_none() {
        return Err(OpsError::NothingSelected);
    }
    let pool = services.database().await?;
    // Before the DLQ's count is taken: a replay record dated later is one
    // made during this run (records are written to the millisecond).
    let started = SystemTime::now() - Duration::from_millis(1);
    let opened = Opened::new(services, queue).await?;
    let mut run = Run {
        pool,
        opened: &opened,
        options,
        checked: Vec::new(),
        started,
    };
    let outcome = run.all(selection, &mut on_event).await;
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
        selection: &Selection,
        on_event: &mut impl FnMut(ReplayEvent<'_>),
    ) -> Result<ReplaySummary> {
        let limit = self.options.limit.unwrap_or(usize::MAX);
        on_event(ReplayEvent::Started {
            dlq: &self.opened.dlq,
            total: self.opened.ready.min(limit.try_into().unwrap_or(u32::MAX)),
        });
        let mut summary = ReplaySummary {
            dry_run: self.options.dry_run,
            ..ReplaySummary::default()
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
            let dead = DeadLetterSummary::of(&delivery);
            if !selection.matches(&dead) {
                // Back at once: a long run holds one letter at a time.
                self.opened.put_back(delivery.delivery_tag).await?;
                continue;
            }
            seen += 1;
            let message_id = dead.message_id.as_deref();
            let target = match self.refusal(&delivery).await? {
                Err(refusal) => {
                    *summary.skipped.entry(refusal).or_default() += 1;
                    on_event(ReplayEvent::Skipped {
                        message_id,
                        refusal,
                    });
                    self.opened.put_back(delivery.delivery_tag).await?;
                    continue;
                }
                Ok(target) => target,
            };
            self.check(&target).await?;
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
            let properties = DeadLetter::from_delivery(&delivery).replay_properties();
            let published = self
                .opened
                .confirms
                .publish("", &target, &delivery.data, properties)
                .await;
            match published {
                Ok(()) => {}
                Err(PublishError::TooLarge { .. }) => {
                    *summary.skipped.entry(Refusal::TooLarge).or_default() += 1;
                    on_event(ReplayEvent::Skipped {
                        message_id,
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
        let dead = DeadLetter::from_delivery(delivery);
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

    /// Checks once per work queue that it exists: a publish to a missing
    /// queue through the default exchange would be returned.
    async fn check(&mut self, target: &str) -> Result<()> {
        if self.checked.iter().any(|q| q == target) {
            return Ok(());
        }
        if queue_depth(&self.opened.connection, target)
            .await?
            .is_none()
        {
            return Err(OpsError::TargetQueueNotFound {
                queue: target.to_owned(),
            });
        }
        self.checked.push(target.to_owned());
        Ok(())
    }
}
