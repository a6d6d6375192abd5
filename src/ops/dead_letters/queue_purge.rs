//! A purge of a RabbitMQ DLQ: letters picked and held, deleted (acked) once
//! the caller confirms, or walked and deleted at once.

use super::dlq::{Opened, Visit, letter_of};
use crate::dead_letters::model::{Filter, Letter};
use crate::ops::Result;

/// Letters of a DLQ picked for deletion, held unacked (their bodies by the
/// opened DLQ, for putting them back).
pub(super) struct Held {
    opened: Opened,
    tags: Vec<u64>,
    letters: Vec<Letter>,
}

impl Held {
    pub(super) fn len(&self) -> usize {
        self.letters.len()
    }

    pub(super) fn letters(&self) -> &[Letter] {
        &self.letters
    }

    pub(super) async fn delete(self) -> Result<u64> {
        let mut acked = Ok(());
        for tag in &self.tags {
            acked = self.opened.ack(*tag).await;
            if acked.is_err() {
                break;
            }
        }
        // The close waits for the acks to be sent.
        self.opened.close("purged").await;
        acked.map_err(crate::ops::OpsError::Ack)?;
        Ok(self.tags.len() as u64)
    }

    /// Puts every letter picked back into the DLQ (without spending a
    /// delivery attempt).
    pub(super) async fn keep(self) {
        self.opened.close("not purged").await;
    }
}

/// Picks the letters `filter` selects and holds them.
pub(super) async fn purge(opened: Opened, filter: &Filter) -> Result<Held> {
    let (mut tags, mut letters) = (Vec::new(), Vec::new());
    let walked = opened
        .walk(
            filter,
            limit(filter),
            |_| true,
            |delivery| {
                tags.push(delivery.delivery_tag);
                letters.push(letter_of(delivery));
                Visit::Hold
            },
        )
        .await;
    match walked {
        Ok(()) => Ok(Held {
            opened,
            tags,
            letters,
        }),
        Err(e) => {
            opened.close("not purged").await;
            Err(e)
        }
    }
}

/// Deletes the letters `filter` selects as it walks the DLQ, holding one
/// at a time.
pub(super) async fn purge_now(opened: Opened, filter: &Filter) -> Result<u64> {
    let mut deleted = 0;
    let walked = opened
        .walk(
            filter,
            limit(filter),
            |_| true,
            |_| {
                deleted += 1;
                Visit::Delete
            },
        )
        .await;
    opened.close("purged").await;
    walked?;
    Ok(deleted)
}

fn limit(filter: &Filter) -> usize {
    filter
        .limit
        .map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(0))
}
