//! [`import`]: a RabbitMQ dead-letter queue moved into the table store.

use super::dlq::{Opened, without_broker_headers};
use super::queue::QueueSource;
use crate::dead_letters;
use crate::dead_letters::view::DeadLetter;
use crate::ops::{OpsError, Result, Services};
use crate::runtime::header_names::{
    CONSUMER_HEADER, FIRST_FAILURE_HEADER, LAST_FAILURE_HEADER, QUEUE_HEADER, ROUTING_KEY_HEADER,
};

/// What [`Services::import_dead_letters`] moved.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ImportReport {
    /// The dead-letter queue read.
    pub dlq: String,
    /// Dead letters now in the table (and gone from the queue).
    pub imported: u64,
}

impl Services {
    /// Moves every dead letter of `queue`'s RabbitMQ DLQ (or of that DLQ) into
    /// the `dead_letters` table: each is acked only after its row committed. A
    /// kill in between leaves the message in the queue *and* its row: the next
    /// import finds the row (same consumer, queue, id and body, still live) and
    /// counts a second delivery on it instead of adding a row. `progress` sees
    /// the count after each letter.
    ///
    /// # Errors
    /// [`OpsError::DeadLetterQueueNotFound`]; [`OpsError::Idempo`] when the
    /// table does not exist (run `idempo migrate`) or refuses a letter (the
    /// letters before it are imported, the rest stay in the queue); connection
    /// errors.
    pub async fn import_dead_letters(
        &self,
        queue: &str,
        mut progress: impl FnMut(u64),
    ) -> Result<ImportReport> {
        let pool = self.database().await?.clone();
        if !dead_letters::queries::table_exists(&pool).await? {
            return Err(OpsError::Idempo(crate::Error::Config(
                "the dead_letters table does not exist: run `idempo migrate` first".into(),
            )));
        }
        let dlq = QueueSource::new(self.clone(), queue).dlq().to_owned();
        let opened = Opened::new(self, &dlq).await?;
        let work = crate::amqp::Amqp::work_queue(&opened.dlq).to_owned();
        let mut imported = 0;
        let moved: Result<()> = async {
            while let Some(delivery) = opened.next().await? {
                let stored = super::dlq::stored_of(&delivery);
                let dead = DeadLetter::new(&stored);
                let properties = without_broker_headers(delivery.properties.clone());
                let consumer = dead.header(CONSUMER_HEADER).unwrap_or_else(|| work.clone());
                let letter_queue = dead.header(QUEUE_HEADER).unwrap_or_else(|| work.clone());
                let routing_key = dead
                    .header(ROUTING_KEY_HEADER)
                    .unwrap_or_else(|| delivery.routing_key.to_string());
                let reason = dead.reason().unwrap_or_else(|| "imported".into());
                let error = dead.error().unwrap_or_default();
                let message_id = dead.message_id().unwrap_or_default();
                let first = dead.header(FIRST_FAILURE_HEADER).unwrap_or_default();
                let last = dead.header(LAST_FAILURE_HEADER).unwrap_or_default();
                let exchange = delivery.exchange.to_string();
                let letter = crate::runtime::letter_table::Row {
                    transport: crate::amqp::TRANSPORT,
                    consumer: &consumer,
                    queue: &letter_queue,
                    message_id: &message_id,
                    exchange: &exchange,
                    routing_key: &routing_key,
                    properties: &crate::amqp::stored::to_stored(&properties),
                    body: &delivery.data,
                    reason: &reason,
                    error: &error,
                    attempts: dead.attempts().unwrap_or(0),
                    first_failed_at: &first,
                    last_failed_at: &last,
                };
                let filing = crate::runtime::letter_table::insert(&pool, &letter).await?;
                opened.ack(delivery.delivery_tag).await?;
                if filing == crate::runtime::letters::Filing::Processed {
                    // A replay would skip it as processed: it is no letter.
                    tracing::info!(%message_id, "not imported: the message was processed");
                    continue;
                }
                imported += 1;
                progress(imported);
            }
            Ok(())
        }
        .await;
        let dlq = opened.dlq.clone();
        opened.close("imported").await;
        moved.map(|()| ImportReport { dlq, imported })
    }
}
