//! [`Config`]: a consumer's settings once the builder checked them, read by
//! every part of the runtime.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::Schema;
use crate::amqp::broker::Broker;
use crate::amqp::topology::Topology;
use crate::runtime::message_id::MessageIdSource;
use crate::runtime::outcome::Decide;
use crate::runtime::redelivery::RedeliveryPolicy;
use crate::runtime::route::Router;
use crate::runtime::seal::Keyring;

/// RabbitMQ's default `consumer_timeout`: an unacked delivery older than this
/// makes the broker close the channel, and the message is redelivered.
const BROKER_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) broker: Broker,
    pub(crate) pool: PgPool,
    pub(crate) consumer: String,
    pub(crate) topology: Topology,
    pub(crate) declare: bool,
    pub(crate) prefetch: u16,
    pub(crate) concurrency: usize,
    pub(crate) message_id: MessageIdSource,
    pub(crate) redelivery: RedeliveryPolicy,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) retention: Option<Duration>,
    pub(crate) retention_interval: Duration,
    /// The partitioned inbox, when chosen.
    pub(crate) partitioning: Option<crate::inbox::partitioned::Partitioning>,
    pub(crate) connection_name: String,
    /// Keep retrying when the queues exist with other arguments.
    pub(crate) wait_for_topology: bool,
    /// Queues declared like the work queue (for a consumer downstream).
    pub(crate) also_declare: Vec<String>,
    /// What to do with idempo's schema at start.
    pub(crate) schema: Schema,
    /// Where dead letters go.
    #[cfg(feature = "outbox")]
    pub(crate) dead_letters: crate::dead_letters::DeadLetters,
    /// How long replayed and discarded letters of the table store are kept.
    #[cfg(feature = "outbox")]
    pub(crate) dead_letters_kept: Duration,
}

impl Config {
    /// The runtime's router for this consumer, deciding with `decide`.
    pub(crate) fn router(&self, decide: Arc<dyn Decide>) -> Router {
        Router {
            transport: crate::amqp::TRANSPORT,
            consumer: self.consumer.clone(),
            queue: self.topology.queue.clone(),
            message_id: self.message_id.clone(),
            keys: Arc::new(Keyring::new(self.pool.clone(), self.consumer.clone())),
            decide,
            redelivery: self.redelivery.clone(),
            letters: self.letter_store(),
            // The attempts are idempo's failure header, not a delivery count.
            counts_deliveries: false,
        }
    }

    /// The runtime's letter store: the `dead_letters` table when chosen,
    /// otherwise none (the transport's DLQ).
    pub(crate) fn letter_store(&self) -> Option<Arc<dyn crate::runtime::letters::LetterStore>> {
        #[cfg(feature = "outbox")]
        if self.dead_letters == crate::dead_letters::DeadLetters::Table {
            return Some(Arc::new(crate::dead_letters::TableStore {
                pool: self.pool.clone(),
            }));
        }
        None
    }

    /// With the table store, how long its settled dead letters are kept.
    pub(crate) fn dead_letter_retention(&self) -> Option<Duration> {
        #[cfg(feature = "outbox")]
        {
            (self.dead_letters == crate::dead_letters::DeadLetters::Table)
                .then_some(self.dead_letters_kept)
        }
        #[cfg(not(feature = "outbox"))]
        {
            None
        }
    }

    /// A redelivery that arrives after retention deleted its claim is
    /// processed again: warn when the retention does not cover the longest
    /// way back.
    pub(crate) fn warn_if_retention_too_short(&self) {
        let Some(retention) = self.retention else {
            return;
        };
        let longest = self.redelivery.total_delay() + BROKER_CONSUMER_TIMEOUT;
        if retention < longest {
            tracing::warn!(
                ?retention,
                ?longest,
                "retention is shorter than the longest possible redelivery (retry schedule plus the broker's 30 min consumer timeout): a late redelivery could be processed twice"
            );
        }
    }
}
