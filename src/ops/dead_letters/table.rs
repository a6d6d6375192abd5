//! The `dead_letters` table as a [`Source`].

use sqlx::PgPool;

use super::source::Source;
use crate::dead_letters::model::{Filter, Group, Letter, LetterDetail, LetterRef};
use crate::dead_letters::model::{ReplayEvent, ReplayOptions, ReplayReport};
use crate::dead_letters::{queries as sql, replay};
use crate::ops::{Result, Services};

/// The table, for the letters of one work queue (or, unnamed, of the
/// queues the filters name).
pub(super) struct TableSource {
    pool: PgPool,
    queue: String,
    /// Where the replays' queues are checked, when known.
    broker: Option<Services>,
}

impl TableSource {
    pub(super) fn new(pool: PgPool, queue: String, broker: Option<Services>) -> Self {
        TableSource {
            pool,
            queue,
            broker,
        }
    }

    /// The RabbitMQ queues a replay of `filter` would publish to that do
    /// not exist (none known without a broker, or when it cannot be asked:
    /// the relay then marks such a message failed, and `idempo outbox
    /// failed` shows it). Letters of another transport go back to it; its
    /// relay publishes them (and creates nothing it was not told to).
    async fn missing(&self, filter: &Filter, options: &ReplayOptions) -> Result<Vec<String>> {
        let Some(services) = &self.broker else {
            return Ok(Vec::new());
        };
        let queues = sql::queues(&self.pool, filter, crate::amqp::TRANSPORT).await?;
        let targets = match &options.to {
            Some(to) if !queues.is_empty() => vec![to.clone()],
            Some(_) => Vec::new(),
            None => queues,
        };
        if targets.is_empty() {
            return Ok(Vec::new());
        }
        let connection = match services.broker().await {
            Ok(connection) => connection,
            Err(e) => {
                tracing::warn!(error = %e, "replay: cannot ask RabbitMQ which queues exist");
                return Ok(Vec::new());
            }
        };
        let mut missing = Vec::new();
        for target in targets {
            match crate::ops::queue_depth(&connection, &target).await {
                Ok(None) => missing.push(target),
                Ok(Some(_)) => {}
                // A name AMQP refuses: no queue can have it.
                Err(crate::ops::OpsError::Idempo(crate::Error::Config(_))) => missing.push(target),
                Err(e) => {
                    tracing::warn!(queue = %target, error = %e, "replay: cannot check a queue")
                }
            }
        }
        crate::ops::close(&connection).await;
        Ok(missing)
    }

    /// Whether the table exists and holds letters (in any state) of `queue`.
    pub(super) async fn holds(services: &Services, queue: &str) -> Result<bool> {
        let pool = services.database().await?;
        Ok(sql::table_exists(pool).await? && sql::holds(pool, queue).await?)
    }

    pub(super) async fn reap(
        &self,
        consumer: Option<&str>,
        older_than: std::time::Duration,
        batch: i64,
    ) -> Result<u64> {
        Ok(crate::runtime::letter_table::reap(&self.pool, consumer, older_than, batch).await?)
    }

    /// `filter`, of this source's queue when it names none.
    fn scoped(&self, filter: &Filter) -> Filter {
        let mut scoped = filter.clone();
        if let (None, false) = (&scoped.queue, self.queue.is_empty()) {
            scoped.queue = Some(self.queue.clone());
        }
        if let Some(queue) = &mut scoped.queue {
            *queue = crate::amqp::Amqp::work_queue(queue).to_owned();
        }
        scoped
    }
}

impl Source for TableSource {
    type Plan = Picked;

    async fn list(&self, filter: &Filter) -> Result<Vec<Letter>> {
        Ok(sql::list(&self.pool, &self.scoped(filter)).await?)
    }

    async fn groups(&self, filter: &Filter) -> Result<Vec<Group>> {
        Ok(sql::groups(&self.pool, &self.scoped(filter)).await?)
    }

    async fn show(&self, which: &LetterRef) -> Result<Option<LetterDetail>> {
        let row = match which {
            LetterRef::Row(row) => *row,
            LetterRef::MessageId(message_id) => {
                let filter = Filter {
                    message_ids: vec![message_id.clone()],
                    any_state: true,
                    limit: Some(i64::MAX),
                    ..self.scoped(&Filter::default())
                };
                // The latest (a replayed letter may have failed again).
                match sql::list(&self.pool, &filter).await?.last() {
                    Some(Letter { id: Some(row), .. }) => *row,
                    _ => return Ok(None),
                }
            }
        };
        Ok(sql::show(&self.pool, row).await?)
    }

    async fn count(&self, filter: &Filter) -> Result<u64> {
        Ok(sql::count(&self.pool, &self.scoped(filter)).await?)
    }

    async fn replay(
        &self,
        filter: &Filter,
        options: &ReplayOptions,
        on_event: impl FnMut(ReplayEvent<'_>) + Send,
    ) -> Result<ReplayReport> {
        let filter = self.scoped(filter);
        let missing = self.missing(&filter, options).await?;
        Ok(replay::replay(&self.pool, &filter, options, &missing, on_event).await?)
    }

    async fn purge(&self, filter: &Filter) -> Result<Picked> {
        let filter = Filter {
            limit: filter.limit.or(Some(i64::MAX)),
            ..self.scoped(filter)
        };
        let letters = sql::list(&self.pool, &filter).await?;
        Ok(Picked {
            pool: self.pool.clone(),
            filter,
            letters,
        })
    }

    async fn purge_now(&self, filter: &Filter) -> Result<u64> {
        self.purge(filter).await?.delete().await
    }

    async fn discard(&self, filter: &Filter, who: &str) -> Result<u64> {
        Ok(sql::discard(&self.pool, &self.scoped(filter), who).await?)
    }
}

/// Table letters picked for deletion: deleted by row, still selected.
pub(super) struct Picked {
    pool: PgPool,
    filter: Filter,
    letters: Vec<Letter>,
}

impl Picked {
    pub(super) fn len(&self) -> usize {
        self.letters.len()
    }

    pub(super) fn letters(&self) -> &[Letter] {
        &self.letters
    }

    pub(super) async fn delete(self) -> Result<u64> {
        if self.letters.is_empty() {
            return Ok(0);
        }
        // Only those picked, and only while the filter still selects them
        // (a replay meanwhile moved a live letter out of it).
        let filter = Filter {
            ids: self.letters.iter().filter_map(|l| l.id).collect(),
            limit: None,
            after_id: None,
            ..self.filter
        };
        Ok(sql::purge(&self.pool, &filter).await?)
    }
}
