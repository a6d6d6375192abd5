//! The seam of the dead-letter stores: what the table and a RabbitMQ DLQ
//! each answer (a transport without a DLQ keeps its letters in the table).

use crate::dead_letters::model::{
    Filter, Group, Letter, LetterDetail, LetterRef, ReplayEvent, ReplayOptions, ReplayReport,
};
use crate::ops::Result;

/// What a store of dead letters does.
pub(crate) trait Source {
    /// The letters `filter` selects, oldest first.
    async fn list(&self, filter: &Filter) -> Result<Vec<Letter>>;
    /// The letters `filter` selects, by cause.
    async fn groups(&self, filter: &Filter) -> Result<Vec<Group>>;
    /// One letter whole.
    async fn show(&self, which: &LetterRef) -> Result<Option<LetterDetail>>;
    /// How many letters `filter` selects.
    async fn count(&self, filter: &Filter) -> Result<u64>;
    /// Replays the letters `filter` selects.
    async fn replay(
        &self,
        filter: &Filter,
        options: &ReplayOptions,
        on_event: impl FnMut(ReplayEvent<'_>) + Send,
    ) -> Result<ReplayReport>;
    /// Letters picked for deletion and held ([`PurgePlan`](super::PurgePlan) wraps them).
    type Plan;

    /// Picks the letters `filter` selects for deletion.
    async fn purge(&self, filter: &Filter) -> Result<Self::Plan>;
    /// Deletes the letters `filter` selects now.
    async fn purge_now(&self, filter: &Filter) -> Result<u64>;
    /// Marks the letters `filter` selects discarded by `who`.
    async fn discard(&self, filter: &Filter, who: &str) -> Result<u64>;
}
