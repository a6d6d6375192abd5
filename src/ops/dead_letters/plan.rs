//! A purge's plan: letters picked and held until the caller confirms.

use std::fmt;

use super::queue_purge::Held;
use super::table::Picked;
use crate::dead_letters::model::Letter;
use crate::ops::Result;

/// Letters picked for deletion: nothing is deleted until
/// [`delete`](Self::delete); [`keep`](Self::keep) lets them be (a DLQ's
/// are put back without spending a delivery attempt).
pub struct PurgePlan {
    plan: Plans,
}

enum Plans {
    // Boxed: a filter and an opened DLQ (connection, channels) are large.
    Table(Box<Picked>),
    Queue(Box<Held>),
}

impl From<Picked> for PurgePlan {
    fn from(picked: Picked) -> Self {
        PurgePlan {
            plan: Plans::Table(Box::new(picked)),
        }
    }
}

impl From<Held> for PurgePlan {
    fn from(held: Held) -> Self {
        PurgePlan {
            plan: Plans::Queue(Box::new(held)),
        }
    }
}

impl fmt::Debug for PurgePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // No bodies in logs.
        f.debug_struct("PurgePlan")
            .field("letters", &self.len())
            .finish_non_exhaustive()
    }
}

impl PurgePlan {
    /// How many letters were picked.
    pub fn len(&self) -> usize {
        match &self.plan {
            Plans::Table(p) => p.len(),
            Plans::Queue(p) => p.len(),
        }
    }

    /// Whether none was picked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The letters picked.
    pub fn letters(&self) -> &[Letter] {
        match &self.plan {
            Plans::Table(p) => p.letters(),
            Plans::Queue(p) => p.letters(),
        }
    }

    /// Deletes the letters picked (those a table replay took meanwhile
    /// excepted); returns how many.
    ///
    /// # Errors
    /// A query or an ack failed: those not deleted stay.
    pub async fn delete(self) -> Result<u64> {
        match self.plan {
            Plans::Table(p) => (*p).delete().await,
            Plans::Queue(p) => (*p).delete().await,
        }
    }

    /// Deletes nothing.
    pub async fn keep(self) {
        if let Plans::Queue(p) = self.plan {
            (*p).keep().await;
        }
    }
}
