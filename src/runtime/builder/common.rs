//! The options every transport and mode has.

use std::time::Duration;

use super::ConsumerBuilder;
use crate::Schema;
use crate::runtime::message_id::MessageIdSource;
use crate::runtime::redelivery::RedeliveryPolicy;
use crate::runtime::transport::Transport;

impl<T: Transport, Mode> ConsumerBuilder<T, Mode> {
    pub(crate) fn into_mode<Next>(self, mode: Next) -> ConsumerBuilder<T, Next> {
        ConsumerBuilder {
            settings: self.settings,
            options: self.options,
            mode,
        }
    }

    /// The same configuration on another pool (the test harness's own schema).
    #[cfg(feature = "testing")]
    pub(crate) fn with_pool(mut self, pool: sqlx::PgPool) -> Self {
        self.settings.pool = pool;
        self
    }

    /// The name that scopes message ids in `processed_messages` (default: the
    /// queue's or stream's name). Two consumers of one message (fan-out) must
    /// have different names to each process it once; replicas of one
    /// consumer share a name.
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.settings.consumer = Some(name.into());
        self
    }

    /// How many unsettled deliveries the broker may hand this consumer
    /// ahead (default: 100; RabbitMQ's prefetch, JetStream's
    /// `max_ack_pending`). Must be at least [`concurrency`](Self::concurrency).
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.settings.prefetch = prefetch;
        self
    }

    /// How many handlers run at once (default: 16). Each holds a database
    /// connection from the pool while it runs.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.settings.concurrency = concurrency;
        self
    }

    /// Where the message id comes from (default: the transport's own id
    /// field: RabbitMQ's `message_id` property, JetStream's `Nats-Msg-Id`).
    pub fn message_id(mut self, source: MessageIdSource) -> Self {
        self.settings.message_id = source;
        self
    }

    /// How a delivery that failed transiently is delivered again (default:
    /// [`RedeliveryPolicy::default`]). *Redelivery* is the consumer's word
    /// for it; *retry* is the outgoing side's (`idempo::retry`).
    pub fn redelivery(mut self, policy: RedeliveryPolicy) -> Self {
        self.settings.redelivery = policy;
        self
    }

    /// How long `processed_messages` rows of this consumer are kept (default:
    /// 7 days). A redelivery that arrives after its row was deleted is
    /// processed again, so keep rows longer than a message can take to come
    /// back: the retry schedule plus the broker's own redelivery horizon (a
    /// warning is logged at start otherwise).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.settings.retention = Some(retention);
        self
    }

    /// Keep `processed_messages` rows forever (or delete them yourself, e.g.
    /// with [`Inbox::delete_processed_before`](crate::inbox::Inbox::delete_processed_before)).
    pub fn without_retention(mut self) -> Self {
        self.settings.retention = None;
        self
    }

    /// Claim in the partitioned `processed_messages`
    /// ([`inbox::partitioned`](crate::inbox::partitioned)) instead of the
    /// plain table: retention by `DETACH`/`DROP PARTITION` instead of
    /// `DELETE`, at the price of a probe per partition in each claim. The
    /// database must have been switched (`idempo partitions switch`); the
    /// consumer refuses to start otherwise. The retention reaper then
    /// maintains the partitions (one instance at a time), every
    /// [`retention_interval`](Self::retention_interval) and at least once a
    /// period.
    ///
    /// # Default
    /// The plain table.
    pub fn partitioned(mut self, partitioning: crate::inbox::partitioned::Partitioning) -> Self {
        self.settings.partitioning = Some(partitioning);
        self
    }

    /// How often the retention reaper runs (default: 5 min).
    pub fn retention_interval(mut self, interval: Duration) -> Self {
        self.settings.retention_interval = interval;
        self
    }

    /// Whether each unit's connection goes through the pool's acquire-time
    /// checks: sqlx's ping (`test_before_acquire`) and the pool's
    /// `before_acquire` hook (default: no). Without them the consumer takes
    /// an idle connection as it is (`Pool::try_begin`), a round trip less per
    /// message; one that died while idle only fails its `BEGIN`, which wrote
    /// nothing, and the unit begins again through the checked path. Turn
    /// them on when the pool's `before_acquire` hook must run for the
    /// consumer's connections.
    pub fn checked_acquire(mut self, checked: bool) -> Self {
        self.settings.checked_acquire = checked;
        self
    }

    /// How long one handler may run (default: 5 min). A handler that takes
    /// longer is dropped, its transaction rolls back, and the delivery is
    /// retried: a hung call must not hold a connection and the claim's row
    /// lock forever. Keep it below the broker's own limit on an unsettled
    /// delivery (RabbitMQ's `consumer_timeout`, 30 min by default).
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.settings.handler_timeout = timeout;
        self
    }

    /// How long a shutdown waits for handlers in flight (default: 30 s).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.settings.shutdown_timeout = timeout;
        self
    }

    /// Whether the consumer runs an outbox relay for its pool (default:
    /// `true` with feature `outbox`), publishing what its handlers stage to
    /// its transport's broker. It stays dormant, without a broker
    /// connection, until the process stages a message or finds pending
    /// rows. Turn it off when a separate relay process serves the database.
    pub fn relay(mut self, relay: bool) -> Self {
        self.settings.relay = relay;
        self
    }

    /// What the consumer does with idempo's schema at start (default
    /// [`Schema::Unchecked`]: the application migrates). [`Schema::Migrate`]
    /// applies the migrations (DDL only when some are missing);
    /// [`Schema::Check`] refuses to start with
    /// [`Error::SchemaBehind`](crate::Error::SchemaBehind) when they are not
    /// all applied, and runs no DDL, for a role without `CREATE`. While the
    /// database is unreachable at start, the consumer waits for it.
    pub fn schema(mut self, schema: Schema) -> Self {
        self.settings.schema = schema;
        self
    }

    /// Where dead letters go: the transport's own store
    /// ([`DeadLetters::Queue`](crate::consumer::DeadLetters::Queue):
    /// RabbitMQ's `<queue>.dlq`, the default where the transport has one),
    /// or the `dead_letters` table
    /// ([`DeadLetters::Table`](crate::consumer::DeadLetters::Table), the only
    /// store on JetStream): queryable, grouped by cause, replayed exactly
    /// once through the outbox (see `idempo::ops::dead_letters`). With the
    /// table, each dead letter is inserted in a transaction of its own and
    /// acknowledged only after that commit; while PostgreSQL cannot take it,
    /// the delivery waits. A letter the table refuses for another reason
    /// goes to the transport's store instead, where it has one, so that
    /// nothing is lost.
    pub fn dead_letters(mut self, store: crate::runtime::letters::DeadLetters) -> Self {
        self.settings.dead_letters = Some(store);
        self
    }

    /// How long the table store keeps replayed and discarded dead letters
    /// (for audit) before the retention reaper deletes them: 30 days by
    /// default. Live letters are never reaped.
    pub fn dead_letter_retention(mut self, keep: Duration) -> Self {
        self.settings.dead_letters_kept = keep;
        self
    }
}
