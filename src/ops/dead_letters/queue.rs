//! A RabbitMQ DLQ as a [`Source`]: every operation opens the DLQ
//! ([`Opened`]), walks it and closes it, putting back what it did not
//! delete.

use sqlx::PgPool;

use super::dlq::{Opened, Visit, detail_of, letter_of};
use super::queue_purge::{self, Held};
use super::queue_replay;
use super::source::Source;
use crate::dead_letters::model::{
    Filter, Group, Letter, LetterDetail, LetterRef, ReplayEvent, ReplayOptions, ReplayReport,
};
use crate::ops::{OpsError, Result, Services};

/// A work queue's DLQ.
pub(super) struct QueueSource {
    services: Services,
    dlq: String,
}

impl QueueSource {
    /// The DLQ of `queue` (`queue` itself when it already is one).
    pub(super) fn new(services: Services, queue: &str) -> Self {
        QueueSource {
            services,
            dlq: crate::amqp::Amqp::dead_letter_queue(crate::amqp::Amqp::work_queue(queue)),
        }
    }

    pub(super) fn dlq(&self) -> &str {
        &self.dlq
    }

    /// The DLQ, opened, when `filter` asks only what a DLQ can answer.
    async fn open(&self, filter: &Filter) -> Result<Opened> {
        self.refuse(filter.table_only())?;
        Opened::new(&self.services, &self.dlq).await
    }

    /// `Err(NeedsTable)` when `what` needs the table.
    fn refuse(&self, what: Option<&'static str>) -> Result<()> {
        what.map_or(Ok(()), |what| Err(self.needs_table(what)))
    }

    /// The error for `what`, which only the table store answers.
    pub(super) fn needs_table(&self, what: &'static str) -> OpsError {
        OpsError::NeedsTable {
            what,
            dlq: self.dlq.clone(),
        }
    }
}

impl Source for QueueSource {
    type Plan = Held;

    async fn list(&self, filter: &Filter) -> Result<Vec<Letter>> {
        let opened = self.open(filter).await?;
        let mut letters = Vec::new();
        let limit = usize::try_from(filter.limit.unwrap_or(100)).unwrap_or(0);
        let walked = opened
            .walk(
                filter,
                limit,
                |_| true,
                |delivery| {
                    letters.push(letter_of(delivery));
                    Visit::PutBack
                },
            )
            .await;
        opened.close("browsed").await;
        walked?;
        Ok(letters)
    }

    async fn groups(&self, _: &Filter) -> Result<Vec<Group>> {
        self.refuse(Some("cause (grouping)"))?;
        Ok(Vec::new())
    }

    async fn show(&self, which: &LetterRef) -> Result<Option<LetterDetail>> {
        let message_id = match which {
            LetterRef::MessageId(id) => id.clone(),
            LetterRef::Row(_) => {
                self.refuse(Some("row id"))?;
                return Ok(None);
            }
        };
        let filter = Filter {
            message_ids: vec![message_id],
            ..Filter::default()
        };
        let opened = self.open(&filter).await?;
        let mut found = None;
        let walked = opened
            .walk(
                &filter,
                1,
                |_| true,
                |delivery| {
                    found = Some(detail_of(delivery));
                    Visit::PutBack
                },
            )
            .await;
        opened.close("browsed").await;
        walked?;
        Ok(found)
    }

    async fn count(&self, filter: &Filter) -> Result<u64> {
        let opened = self.open(filter).await?;
        let mut count = 0;
        let walked = opened
            .walk(
                filter,
                usize::MAX,
                |_| true,
                |_| {
                    count += 1;
                    Visit::PutBack
                },
            )
            .await;
        opened.close("counted").await;
        walked?;
        Ok(count)
    }

    async fn replay(
        &self,
        filter: &Filter,
        options: &ReplayOptions,
        on_event: impl FnMut(ReplayEvent<'_>) + Send,
    ) -> Result<ReplayReport> {
        let pool: &PgPool = self.services.database().await?;
        queue_replay::replay(pool, || self.open(filter), filter, options, on_event).await
    }

    async fn purge(&self, filter: &Filter) -> Result<Held> {
        queue_purge::purge(self.open(filter).await?, filter).await
    }

    async fn purge_now(&self, filter: &Filter) -> Result<u64> {
        queue_purge::purge_now(self.open(filter).await?, filter).await
    }

    async fn discard(&self, _: &Filter, _: &str) -> Result<u64> {
        self.refuse(Some("discarding (a DLQ can only be purged)"))?;
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_or_its_dlq_names_the_dlq() {
        let services = Services::new("amqp://127.0.0.1:5672", "postgres://127.0.0.1/x");
        assert_eq!(
            QueueSource::new(services.clone(), "payments").dlq(),
            "payments.dlq"
        );
        assert_eq!(
            QueueSource::new(services, "payments.dlq").dlq(),
            "payments.dlq"
        );
    }
}
