//! [`purge`]: dead letters picked, then deleted once the caller confirms.

use std::fmt;
use std::time::{Duration, SystemTime};

use lapin::message::Delivery;

use super::{DeadLetterSummary, Opened, Selection, Visit};
use crate::amqp::DeadLetter;
use crate::ops::{Result, Services};

/// What [`purge`] picks besides its [`Selection`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PurgeOptions {
    /// Only dead letters whose last failure is older than this (one without
    /// a failure time is never old enough).
    pub older_than: Option<Duration>,
    /// At most this many.
    pub limit: Option<usize>,
}

/// Dead letters picked for deletion and held: nothing is deleted until
/// [`delete`](Self::delete); [`keep`](Self::keep) puts them back.
pub struct PurgePlan {
    opened: Opened,
    /// The tags and summaries of the letters picked (their bodies are held
    /// by `opened`, for putting them back).
    picked: Vec<(u64, DeadLetterSummary)>,
}

impl fmt::Debug for PurgePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // No bodies in logs.
        f.debug_struct("PurgePlan")
            .field("dlq", &self.opened.dlq)
            .field("picked", &self.picked.len())
            .finish_non_exhaustive()
    }
}

impl PurgePlan {
    /// The DLQ.
    pub fn dlq(&self) -> &str {
        &self.opened.dlq
    }

    /// How many dead letters were picked.
    pub fn len(&self) -> usize {
        self.picked.len()
    }

    /// Whether none was picked.
    pub fn is_empty(&self) -> bool {
        self.picked.is_empty()
    }

    /// The dead letters picked.
    pub fn dead_letters(&self) -> Vec<DeadLetterSummary> {
        self.picked.iter().map(|(_, s)| s.clone()).collect()
    }

    /// Deletes the dead letters picked; returns how many.
    ///
    /// # Errors
    /// An ack failed (the channel closed): those not acked stay in the DLQ.
    pub async fn delete(self) -> Result<usize> {
        let mut acked = Ok(());
        for (tag, _) in &self.picked {
            acked = self.opened.ack(*tag).await;
            if acked.is_err() {
                break;
            }
        }
        // The close waits for the acks to be sent.
        self.opened.close("purged").await;
        acked?;
        Ok(self.picked.len())
    }

    /// Deletes nothing: every dead letter picked is put back into the DLQ
    /// (without spending a delivery attempt: see the [module docs](super)).
    pub async fn keep(self) {
        self.opened.close("not purged").await;
    }
}

/// Picks the dead letters of `queue` to delete (see [`PurgePlan`]): those
/// `selection` picks whose last failure is older than
/// [`PurgeOptions::older_than`].
///
/// ```no_run
/// use std::time::Duration;
/// use idempo::ops::{Services, dlq};
///
/// # async fn doc(services: Services) -> idempo::ops::Result<()> {
/// let options = dlq::PurgeOptions { older_than: Some(Duration::from_secs(7 * 86_400)), limit: None };
/// let plan = dlq::purge(&services, "payments", &dlq::Selection::default(), &options).await?;
/// println!("deleting {} dead letters from {}", plan.len(), plan.dlq());
/// plan.delete().await?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`OpsError::DeadLetterQueueNotFound`](crate::ops::OpsError::DeadLetterQueueNotFound);
/// connection and channel errors.
pub async fn purge(
    services: &Services,
    queue: &str,
    selection: &Selection,
    options: &PurgeOptions,
) -> Result<PurgePlan> {
    let opened = Opened::new(services, queue).await?;
    let mut picked = Vec::new();
    let walked = opened
        .walk(
            selection,
            options.limit.unwrap_or(usize::MAX),
            old_enough(options),
            |delivery| {
                picked.push((delivery.delivery_tag, DeadLetterSummary::of(delivery)));
                Visit::Hold
            },
        )
        .await;
    match walked {
        Ok(()) => Ok(PurgePlan { opened, picked }),
        Err(e) => {
            opened.close("not purged").await;
            Err(e)
        }
    }
}

/// Deletes the dead letters of `queue` that [`purge`] would pick, as it
/// walks the DLQ (no plan, no question): it holds one letter at a time,
/// however large the DLQ. Returns the DLQ and how many it deleted.
///
/// # Errors
/// [`OpsError::DeadLetterQueueNotFound`](crate::ops::OpsError::DeadLetterQueueNotFound);
/// connection and channel errors (those deleted before stay deleted).
pub async fn purge_now(
    services: &Services,
    queue: &str,
    selection: &Selection,
    options: &PurgeOptions,
) -> Result<(String, usize)> {
    let opened = Opened::new(services, queue).await?;
    let mut deleted = 0;
    let walked = opened
        .walk(
            selection,
            options.limit.unwrap_or(usize::MAX),
            old_enough(options),
            |_| {
                deleted += 1;
                Visit::Delete
            },
        )
        .await;
    let dlq = opened.dlq.clone();
    opened.close("purged").await;
    walked?;
    Ok((dlq, deleted))
}

/// Whether a dead letter's last failure is older than the options ask.
fn old_enough(options: &PurgeOptions) -> impl FnMut(&Delivery) -> bool + '_ {
    let now = SystemTime::now();
    move |delivery: &Delivery| match options.older_than {
        None => true,
        Some(age) => DeadLetter::from_delivery(delivery)
            .last_failure()
            .is_some_and(|t| now.duration_since(t).unwrap_or_default() >= age),
    }
}
