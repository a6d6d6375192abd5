//! [`Harness`]: a consumer's real delivery path (ids, decode, claim,
//! handler, commit, route) fed in process instead of by lapin,
//! on a PostgreSQL schema of its own.

use std::future::IntoFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use lapin::BasicProperties;
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::delivered::Delivered;
use super::fault::{Fault, Faulty, Outage, Plan};
use super::schema::{drop_schema, isolate};
use super::transport::{Memory, MemoryOptions, Recording};
use crate::consumer::{FromMessage, Handler, Message};
use crate::outbox::OutboxMessage;
use crate::runtime::builder::{ConsumerBuilder, finish};
use crate::runtime::consumer::Consumer;
use crate::runtime::mode::{Batched, NoHandler, PerMessage};
use crate::runtime::route::Router;
use crate::runtime::settle::LogLimit;
use crate::runtime::units::Units;
use crate::{Error, Result};

/// A consumer's delivery path without a broker: deliver messages, read how
/// each delivery ended ([`Delivered`]), inject faults, see what the handler
/// staged in the outbox. See the [module docs](super) for an example.
///
/// Each harness works in a PostgreSQL schema of its own (created, migrated,
/// and dropped by [`close`](Harness::close); one left behind is dropped by
/// a later harness after an hour), through a pool of 4 connections whose
/// `search_path` is that schema: the handler's unqualified table names
/// resolve there, so create your tables with
/// [`setup`](HarnessBuilder::setup).
pub struct Harness {
    router: Arc<Router>,
    /// Keeps the decision's parts (database gate, stats) alive.
    consumer: Consumer<Memory>,
    pool: PgPool,
    admin: PgPool,
    schema: String,
    plan: Arc<Plan>,
    outage: Arc<Outage>,
    tags: AtomicU64,
    cuts: AtomicU64,
    hold_timeout: Duration,
    /// The consumer's handler timeout ([`Fault::Timeout`] waits for it).
    handler_timeout: Duration,
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness")
            .field("consumer", &self.router.consumer)
            .field("queue", &self.router.queue)
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

/// A [`Harness`] being configured: a [`ConsumerBuilder`] (no broker is
/// ever contacted) and the harness's own options. Give it a handler, then
/// `.await` it.
pub struct HarnessBuilder<Mode = NoHandler> {
    consumer: ConsumerBuilder<Memory, Mode>,
    admin: PgPool,
    setup: Vec<String>,
    hold_timeout: Duration,
}

impl<Mode> std::fmt::Debug for HarnessBuilder<Mode> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HarnessBuilder")
            .field("setup", &self.setup)
            .field("hold_timeout", &self.hold_timeout)
            .finish_non_exhaustive()
    }
}

impl Harness {
    /// A harness for a consumer of `queue` on the PostgreSQL behind `pool`
    /// (which it uses only to create, and later drop, its own schema).
    #[allow(clippy::new_ret_no_self)]
    pub fn new(pool: PgPool, queue: impl Into<String>) -> HarnessBuilder<NoHandler> {
        HarnessBuilder {
            // Checked: a database outage is applied as connections are acquired.
            consumer: ConsumerBuilder::with_options(
                pool.clone(),
                MemoryOptions {
                    queue: queue.into(),
                    broker: None,
                },
            )
            .checked_acquire(true),
            admin: pool,
            setup: Vec::new(),
            hold_timeout: Duration::from_secs(5),
        }
    }
}

impl HarnessBuilder<NoHandler> {
    /// Per-message mode with this handler, as
    /// [`ConsumerBuilder::handler`].
    pub fn handler<M, H>(self, handler: H) -> HarnessBuilder<PerMessage>
    where
        M: FromMessage,
        H: Handler<M>,
    {
        self.into_mode(|c| c.handler(handler))
    }

    /// Batch mode with this batch handler, as
    /// [`ConsumerBuilder::batch_handler`]: [`Harness::deliver_all`]
    /// delivers its messages as one batch.
    pub fn batch_handler<M, H>(self, handler: H) -> HarnessBuilder<Batched>
    where
        M: FromMessage,
        H: Handler<Vec<M>>,
    {
        self.into_mode(|c| c.batch_handler(handler))
    }
}

impl<Mode> HarnessBuilder<Mode> {
    fn into_mode<Next>(
        self,
        f: impl FnOnce(ConsumerBuilder<Memory, Mode>) -> ConsumerBuilder<Memory, Next>,
    ) -> HarnessBuilder<Next> {
        HarnessBuilder {
            consumer: f(self.consumer),
            admin: self.admin,
            setup: self.setup,
            hold_timeout: self.hold_timeout,
        }
    }

    /// Configures the consumer as in production, with the options every
    /// transport has: `.configure(|c| c.redelivery(policy).handler_timeout(d).message_id(source))`.
    pub fn configure(
        self,
        f: impl FnOnce(ConsumerBuilder<Memory, Mode>) -> ConsumerBuilder<Memory, Mode>,
    ) -> Self {
        self.into_mode(f)
    }

    /// SQL run in the harness's schema after idempo's migrations: your
    /// tables (unqualified names land in the harness's schema). May hold
    /// several statements; called again, it adds more.
    pub fn setup(mut self, sql: impl Into<String>) -> Self {
        self.setup.push(sql.into());
        self
    }

    /// How long a delivery may wait at the database gate before the harness
    /// reports it [`Held`](Delivered::Held) (default 5 s).
    pub fn hold_timeout(mut self, timeout: Duration) -> Self {
        self.hold_timeout = timeout;
        self
    }
}

/// `.await` on a builder with a handler: the harness.
macro_rules! awaitable {
    ($mode:ty) => {
        impl IntoFuture for HarnessBuilder<$mode> {
            type Output = Result<Harness>;
            type IntoFuture = BoxFuture<'static, Result<Harness>>;

            /// Creates and migrates the harness's schema, runs the setup SQL,
            /// and builds the consumer.
            ///
            /// # Errors
            /// [`Error::Config`] naming the URL when PostgreSQL is
            /// unreachable, or when the consumer's configuration is invalid;
            /// [`Error::Migrate`] / [`Error::Database`] when the migrations
            /// or the setup SQL fail.
            fn into_future(self) -> Self::IntoFuture {
                Box::pin(async move {
                    let plan = Arc::new(Plan::default());
                    let mut this = self;
                    let inner = this.consumer.mode.handler.clone();
                    this.consumer.mode.handler = Arc::new(Faulty {
                        inner,
                        plan: plan.clone(),
                    });
                    let handler_timeout = this.consumer.settings.handler_timeout;
                    let HarnessBuilder {
                        consumer,
                        admin,
                        setup,
                        hold_timeout,
                    } = this;
                    let outage = Arc::new(Outage::default());
                    let (pool, schema) = isolate(&admin, &setup, &outage).await?;
                    let consumer = match finish(consumer.with_pool(pool.clone())) {
                        Ok(consumer) => consumer,
                        Err(e) => {
                            drop_schema(&admin, &pool, &schema).await;
                            return Err(e);
                        }
                    };
                    Ok(Harness::assemble(
                        consumer,
                        pool,
                        admin,
                        schema,
                        (plan, outage),
                        (hold_timeout, handler_timeout),
                    ))
                })
            }
        }
    };
}

awaitable!(PerMessage);
awaitable!(Batched);

impl Harness {
    fn assemble(
        consumer: Consumer<Memory>,
        pool: PgPool,
        admin: PgPool,
        schema: String,
        (plan, outage): (Arc<Plan>, Arc<Outage>),
        (hold_timeout, handler_timeout): (Duration, Duration),
    ) -> Self {
        let router = Arc::new(consumer.router(consumer.dispatch.decide.clone()));
        Harness {
            router,
            consumer,
            pool,
            admin,
            schema,
            plan,
            outage,
            tags: AtomicU64::new(1),
            cuts: AtomicU64::new(0),
            hold_timeout,
            handler_timeout,
        }
    }

    /// The pool of the harness's schema: read what the handler wrote.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The harness's schema.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The consumer's name (whose claims the inbox holds).
    pub fn consumer(&self) -> &str {
        &self.router.consumer
    }

    /// The consumer's counters, as the runtime keeps them.
    pub fn stats(&self) -> crate::consumer::Stats {
        self.consumer.stats()
    }

    /// A message with this id (the AMQP `message_id` property) and body, as
    /// a producer would publish it to the queue.
    ///
    /// # Panics
    /// When `id` is longer than 255 bytes, which AMQP cannot carry in a
    /// property.
    pub fn message(&self, id: &str, body: impl Into<Vec<u8>>) -> Message {
        let properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_delivery_mode(2);
        self.incoming(body.into(), properties)
    }

    /// A message as the broker hands it over, its [`id`](Message::id) the
    /// one the consumer's id source reads (when it reads one).
    fn incoming(&self, body: Vec<u8>, properties: BasicProperties) -> Message {
        let mut message =
            Message::with_properties(body, properties, "", &self.router.queue, false, 0);
        if let Ok(id) = self.router.message_id.extract(&message) {
            message.set_id(id);
        }
        message
    }

    /// A message without a `message_id` property, as a foreign producer
    /// may send one.
    pub fn message_without_id(&self, body: impl Into<Vec<u8>>) -> Message {
        let properties = BasicProperties::default().with_delivery_mode(2);
        self.incoming(body.into(), properties)
    }

    /// A message with this id whose body is `value` as JSON.
    ///
    /// # Panics
    /// When `value` cannot be serialized as JSON (a map with non-string keys).
    pub fn json<T: Serialize + ?Sized>(&self, id: &str, value: &T) -> Message {
        let body = serde_json::to_vec(value).expect("the test message serializes as JSON");
        let properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        self.incoming(body, properties)
    }

    /// A message the harness's consumer would receive once `message`,
    /// staged in another service's outbox, was published by its relay: the
    /// relay's own mapping of ids, headers and properties. Chains one
    /// harness's [`drain`](Harness::drain) into another's input.
    pub fn forwarded(&self, message: &OutboxMessage) -> Message {
        let staged = message.to_staged();
        let frame = crate::amqp::relay::frame::frame(&staged);
        let mut forwarded = Message::with_properties(
            staged.body.clone(),
            frame.properties,
            frame.exchange,
            frame.routing_key,
            false,
            0,
        );
        if let Ok(id) = self.router.message_id.extract(&forwarded) {
            forwarded.set_id(id);
        }
        forwarded
    }

    /// Delivers `message` once and says how the runtime would settle it.
    ///
    /// # Errors
    /// None today; reserved for the harness's own database work.
    pub async fn deliver(&self, message: Message) -> Result<Delivered> {
        Ok(self.unit(vec![(message, None)]).await?.remove(0))
    }

    /// Delivers every message: in batch mode as one batch (one transaction,
    /// split on failure as the runtime does), in per-message mode each on
    /// its own, all at once. Outcomes in the messages' order.
    ///
    /// # Errors
    /// As [`deliver`](Harness::deliver).
    pub async fn deliver_all(
        &self,
        messages: impl IntoIterator<Item = Message>,
    ) -> Result<Vec<Delivered>> {
        self.deliver_all_with(messages.into_iter().map(|m| (m, None)))
            .await
    }

    /// As [`deliver_all`](Harness::deliver_all), each message with its own
    /// [`Fault`] or none: in batch mode, one faulty message in a batch (the
    /// runtime splits the batch to find it, as in production).
    ///
    /// # Errors
    /// As [`deliver_with`](Harness::deliver_with).
    pub async fn deliver_all_with(
        &self,
        messages: impl IntoIterator<Item = (Message, Option<Fault>)>,
    ) -> Result<Vec<Delivered>> {
        let messages: Vec<(Message, Option<Fault>)> = messages.into_iter().collect();
        if self.consumer.dispatch.batch.is_some() {
            return self.unit(messages).await;
        }
        let each = messages.into_iter().map(|m| self.unit(vec![m]));
        let mut all = Vec::new();
        for delivered in futures::future::join_all(each).await {
            all.extend(delivered?);
        }
        Ok(all)
    }

    /// Delivers `n` copies of `message` at once, each on its own (as
    /// redeliveries racing on several consumers would): exactly one should
    /// be acked and the others duplicates.
    ///
    /// # Errors
    /// As [`deliver`](Harness::deliver).
    pub async fn deliver_concurrently(&self, message: Message, n: usize) -> Result<Vec<Delivered>> {
        self.deliver_all_with((0..n).map(|_| (message.clone(), None)))
            .await
    }

    /// Delivers `message`, loses the ack after its commit, and delivers the
    /// broker's redelivery: returns how the *redelivery* ended (a duplicate,
    /// when all is well). If the first delivery was not acked, returns its
    /// outcome instead, so that the assertion shows what went wrong.
    ///
    /// # Errors
    /// As [`deliver`](Harness::deliver).
    pub async fn deliver_after_lost_ack(&self, message: Message) -> Result<Delivered> {
        let first = self.deliver(message.clone()).await?;
        if !first.is_acked() {
            return Ok(first);
        }
        let again = message.delivered_again(true, 0);
        self.deliver(again).await
    }

    /// Delivers `message` with a [`Fault`] injected; the fault concerns this
    /// delivery only (every handler run of it, in a batch too), not a copy
    /// of the same id delivered beside it. The database's faults
    /// ([`CommitConnectionLost`](Fault::CommitConnectionLost),
    /// [`DatabaseUnavailable`](Fault::DatabaseUnavailable)) concern its id.
    ///
    /// # Errors
    /// [`Error::Config`] for [`Fault::Timeout`] with a handler timeout over
    /// 30 s (the delivery would wait for it: set a short one with
    /// `.configure(|c| c.handler_timeout(..))`); [`Error::Database`] when
    /// a database fault cannot be set up in the harness's schema. A message
    /// without a usable id is delivered as it is (and dead-lettered).
    pub async fn deliver_with(&self, message: Message, fault: Fault) -> Result<Delivered> {
        if fault == Fault::Timeout && self.handler_timeout > Duration::from_secs(30) {
            return Err(Error::Config(format!(
                "Fault::Timeout waits for the handler timeout, {:?} here: set a short one \
                 with .configure(|c| c.handler_timeout(Duration::from_millis(200)))",
                self.handler_timeout
            )));
        }
        let Ok(id) = self.router.message_id.extract(&message) else {
            return self.deliver(message).await;
        };
        match fault {
            Fault::CommitConnectionLost => {
                let n = self.cuts.fetch_add(1, Ordering::Relaxed);
                super::fault::plan_cut(&self.pool, &id, n).await?;
                let delivered = self.deliver(message).await;
                super::fault::end_cut(&self.pool, &id).await?;
                delivered
            }
            Fault::DatabaseUnavailable => {
                self.outage.set(true);
                let delivered = self.deliver(message).await;
                self.outage.set(false);
                delivered
            }
            fault => Ok(self.unit(vec![(message, Some(fault))]).await?.remove(0)),
        }
    }

    /// Drops the harness's schema and closes its pool.
    pub async fn close(self) {
        drop_schema(&self.admin, &self.pool, &self.schema).await;
    }

    fn next_tag(&self) -> u64 {
        self.tags.fetch_add(1, Ordering::Relaxed)
    }

    /// One unit through the runtime's units (the decision and the
    /// settling of production), the transport recording each settlement as
    /// a value; the handler faults planned for its deliveries while it lasts.
    async fn unit(&self, messages: Vec<(Message, Option<Fault>)>) -> Result<Vec<Delivered>> {
        let mut unit: Vec<Message> = Vec::with_capacity(messages.len());
        let mut faulted = Vec::new();
        for (m, fault) in messages {
            let delivery = m.delivered_again(m.redelivered(), self.next_tag());
            if let Some(fault) = fault {
                self.plan.set(delivery.delivery_tag(), fault);
                faulted.push(delivery.delivery_tag());
            }
            unit.push(delivery);
        }
        // Only a wait at the gate, for the key or for the dead-letter table
        // gives up, after the hold timeout.
        let give_up = CancellationToken::new();
        let timer = tokio::spawn({
            let give_up = give_up.clone();
            let hold = self.hold_timeout;
            async move {
                tokio::time::sleep(hold).await;
                give_up.cancel();
            }
        });
        let units = Arc::new(Units {
            transport: self.consumer.transport.clone(),
            router: self.router.clone(),
            shutdown: give_up,
            health: self.consumer.health.clone(),
            stats: self.consumer.stats.clone(),
            log_limit: LogLimit::default(),
        });
        let (recording, slots) = Recording::new(unit.len());
        let decided = units.decide(unit.into_iter().zip(slots).collect()).await;
        timer.abort();
        for tag in faulted {
            self.plan.clear(tag);
        }
        let mut delivered = recording.delivered();
        for (d, (_, id)) in delivered.iter_mut().zip(&decided) {
            if let Delivered::Acked { staged } = d {
                *staged = self.staged_by(id).await?;
            }
        }
        Ok(delivered)
    }
}
