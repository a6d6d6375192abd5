//! [`ConsumerBuilder`]: every option of a [`Consumer`] that holds on every
//! transport, and its default; the transport's own options are methods of
//! `ConsumerBuilder<ThatTransport, _>` in its module, and the mode (see
//! [`mode`](crate::consumer::mode)) is the builder's second type.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

#[cfg(doc)]
use super::consumer::Consumer;
use super::handler::{EachMessage, Handler, WholeBatch};
use super::message::FromMessage;
use super::message_id::MessageIdSource;
use super::mode::{Batched, NoHandler, PerMessage};
use super::redelivery::RedeliveryPolicy;
use super::transport::Transport;
use crate::Schema;

/// Configures a [`Consumer`]. Created by the transport's `Consumer::builder`
/// ([`amqp::Consumer::builder`](crate::amqp::Consumer::builder),
/// [`nats::Consumer::builder`](crate::nats::Consumer::builder)).
///
/// `T` is the transport; the options only it has are methods of
/// `ConsumerBuilder<T, _>` in its module (the queue of RabbitMQ, the stream
/// of JetStream). `Mode` is the consumer's [mode](crate::consumer::mode): a
/// handler method moves the builder from [`NoHandler`] into [`PerMessage`]
/// or [`Batched`] (or, with feature `window`, a windowed mode), and `build`
/// / `run` exist only once there is a handler.
///
/// # Default
/// - consumer name (the scope of message ids): the queue's or stream's name;
/// - `prefetch`: 100, `concurrency`: 16;
/// - message id: the transport's own id field ([`MessageIdSource::Property`]);
/// - retries: [`RedeliveryPolicy::default`] (after 1 s, 5 s, 30 s, 2 min,
///   10 min; 10 attempts, then a dead letter);
/// - dead letters: the transport's own store where it has one (RabbitMQ's
///   `<queue>.dlq`), else the `dead_letters` table; settled table letters
///   kept 30 days;
/// - `handler_timeout`: 5 min; `shutdown_timeout`: 30 s;
/// - `retention` of `processed_messages` rows: 7 days, reaped every 5 min;
/// - the schema: [`Schema::Unchecked`] (the application migrates);
/// - batch mode: batches of 100 (or the size given), `batch_linger` 5 ms;
/// - an outbox relay for the pool (feature `outbox`), dormant until the
///   process uses the outbox (see [`relay`](ConsumerBuilder::relay)).
#[must_use]
pub struct ConsumerBuilder<T: Transport, Mode = NoHandler> {
    pub(crate) settings: Settings,
    pub(crate) options: T::Options,
    pub(crate) mode: Mode,
}

/// The options of every transport and mode.
pub(crate) struct Settings {
    pub(crate) pool: PgPool,
    pub(crate) consumer: Option<String>,
    pub(crate) prefetch: u16,
    pub(crate) concurrency: usize,
    pub(crate) message_id: MessageIdSource,
    pub(crate) redelivery: RedeliveryPolicy,
    pub(crate) handler_timeout: Duration,
    pub(crate) checked_acquire: bool,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) retention: Option<Duration>,
    pub(crate) retention_interval: Duration,
    pub(crate) partitioning: Option<crate::inbox::partitioned::Partitioning>,
    pub(crate) relay: bool,
    pub(crate) schema: Schema,
    /// Where dead letters go; `None`: the transport's default.
    pub(crate) dead_letters: Option<super::letters::DeadLetters>,
    pub(crate) dead_letters_kept: Duration,
}

/// How long a batch waits for more deliveries after its first one.
const DEFAULT_LINGER: Duration = Duration::from_millis(5);

/// The batch size of [`ConsumerBuilder::batch_handler`] unless
/// [`batch`](ConsumerBuilder::batch) says otherwise.
const DEFAULT_BATCH: usize = 100;

impl<T: Transport, Mode: fmt::Debug> fmt::Debug for ConsumerBuilder<T, Mode> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("transport", &T::NAME)
            .field("consumer", &self.settings.consumer)
            .field("prefetch", &self.settings.prefetch)
            .field("concurrency", &self.settings.concurrency)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> ConsumerBuilder<T, NoHandler> {
    /// A builder with every default, the transport's `options` and `pool`
    /// (what each transport's `Consumer::builder` calls).
    pub(crate) fn with_options(pool: PgPool, options: T::Options) -> Self {
        ConsumerBuilder {
            settings: Settings {
                pool,
                consumer: None,
                prefetch: 100,
                concurrency: 16,
                message_id: MessageIdSource::default(),
                redelivery: RedeliveryPolicy::default(),
                handler_timeout: Duration::from_secs(300),
                checked_acquire: false,
                shutdown_timeout: Duration::from_secs(30),
                retention: Some(Duration::from_secs(7 * 24 * 3600)),
                retention_interval: Duration::from_secs(300),
                partitioning: None,
                relay: cfg!(feature = "outbox"),
                schema: Schema::default(),
                dead_letters: None,
                dead_letters_kept: Duration::from_secs(30 * 24 * 3600),
            },
            options,
            mode: NoHandler(()),
        }
    }

    /// Per-message mode with this handler (see [`Handler`]): a closure or
    /// async fn `(Tx, M) -> impl Future<Output = Result<(), HandlerError>>`
    /// where `M` is [`JsonBody<T>`](crate::consumer::JsonBody),
    /// [`Message`](crate::consumer::Message) or another [`FromMessage`]
    /// type. It runs in the transaction that claimed the message id; it must
    /// not commit or roll back (the runtime commits after `Ok`, then
    /// acknowledges). State goes into the closure (a pool, a client, ...);
    /// it is shared by every delivery, not copied.
    ///
    /// [`HandlerError`]: crate::consumer::HandlerError
    pub fn handler<M, H>(self, handler: H) -> ConsumerBuilder<T, PerMessage>
    where
        M: FromMessage,
        H: Handler<M>,
    {
        self.into_mode(PerMessage {
            handler: Arc::new(EachMessage::new(handler)),
            groups: None,
        })
    }

    /// Batch mode with a handler for a whole batch: a [`Handler`] of
    /// `Vec<M>`, called once per batch with the fresh (not yet processed)
    /// messages, in delivery order. Batches of 100 unless
    /// [`batch`](ConsumerBuilder::batch) says otherwise. When it fails, the
    /// batch rolls back and each delivery is handled on its own (the handler
    /// is called with a batch of one), so only the failing message takes the
    /// failure path.
    ///
    /// # Example
    /// ```no_run
    /// # use idempo::Tx;
    /// # use idempo::amqp::Consumer;
    /// # use idempo::consumer::{JsonBody, Message};
    /// # #[derive(serde::Deserialize)] struct Payment { account: String, amount_cents: i64 }
    /// # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
    /// Consumer::builder("amqp://127.0.0.1", pool)
    ///     .queue("payments")
    ///     .prefetch(1500)
    ///     .batch_handler(|tx: Tx, batch: Vec<(JsonBody<Payment>, Message)>| async move {
    ///         let ids: Vec<&str> = batch.iter().map(|(_, m)| m.id()).collect();
    ///         let accounts: Vec<&str> = batch.iter().map(|(p, _)| p.0.account.as_str()).collect();
    ///         let amounts: Vec<i64> = batch.iter().map(|(p, _)| p.0.amount_cents).collect();
    ///         let mut tx = tx.try_lock()?;
    ///         sqlx::query("INSERT INTO payments (message_id, account, amount_cents) \
    ///                      SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])")
    ///             .bind(&ids).bind(&accounts).bind(&amounts)
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         Ok(())
    ///     })
    ///     .batch(500)
    ///     .run_until_signal()
    ///     .await
    /// # }
    /// ```
    pub fn batch_handler<M, H>(self, handler: H) -> ConsumerBuilder<T, Batched>
    where
        M: FromMessage,
        H: Handler<Vec<M>>,
    {
        self.into_mode(Batched {
            handler: Arc::new(WholeBatch::new(handler)),
            size: DEFAULT_BATCH,
            linger: DEFAULT_LINGER,
        })
    }
}

impl<T: Transport> ConsumerBuilder<T, PerMessage> {
    /// Turns on message groups (SQS FIFO's `MessageGroupId`): deliveries
    /// whose header `x-group-id` holds the same value are processed one at a
    /// time, in the order they arrived; different groups (and deliveries
    /// without the header) run in parallel up to [`concurrency`](Self::concurrency).
    ///
    /// A delivery that fails is redelivered later and so leaves its place in
    /// the group (the group does not block behind it, unlike SQS). A
    /// delivery takes a concurrency slot only once its predecessor is done,
    /// so a busy group cannot starve the others. If a predecessor is
    /// abandoned (shutdown, a lost channel), the rest of its group is left
    /// unsettled too and comes back in order with the redelivery.
    pub fn message_groups(self) -> Self {
        self.message_groups_by("x-group-id")
    }

    /// [`message_groups`](Self::message_groups) with the group id in another
    /// header.
    pub fn message_groups_by(mut self, header: impl Into<String>) -> Self {
        self.mode.groups = Some(header.into());
        self
    }

    /// Batch mode with this per-message handler: batches of up to `size`
    /// deliveries share one transaction, and the handler runs over each fresh
    /// message of a batch in turn (see the [batch mode](crate::consumer#batch-mode)
    /// docs). A [`batch_handler`](ConsumerBuilder::batch_handler) gets them
    /// all at once, which is where bulk statements pay off. Set `prefetch` to
    /// about three times the batch size: two batches in flight hold their
    /// deliveries unsettled while the next one is collected.
    pub fn batch(self, size: usize) -> ConsumerBuilder<T, Batched> {
        let handler = self.mode.handler.clone();
        self.into_mode(Batched {
            handler,
            size,
            linger: DEFAULT_LINGER,
        })
    }
}

impl<T: Transport> ConsumerBuilder<T, Batched> {
    /// Batches of up to `size` deliveries (default: 100). Set `prefetch` to
    /// about three times the batch size.
    pub fn batch(mut self, size: usize) -> Self {
        self.mode.size = size;
        self
    }

    /// How long a batch waits for more deliveries after its first one
    /// (default: 5 ms).
    pub fn batch_linger(mut self, linger: Duration) -> Self {
        self.mode.linger = linger;
        self
    }
}

/// The options every transport and mode has.
mod common;

/// `build`, `run` and `run_until_signal`, for each mode that has a handler.
macro_rules! runnable {
    ($mode:ty) => {
        impl<T: $crate::runtime::transport::Transport>
            $crate::runtime::builder::ConsumerBuilder<T, $mode>
        {
            /// Checks the configuration and builds the consumer.
            ///
            /// # Errors
            /// [`Error::Config`](crate::Error::Config) when the queue or
            /// stream is missing, `concurrency` is 0, `prefetch` is below
            /// `concurrency` (or, in batch mode, below the batch size), the
            /// consumer name is empty, the retry policy or retention is
            /// impossible, or the transport refuses its options.
            pub fn build(self) -> $crate::Result<$crate::runtime::consumer::Consumer<T>> {
                $crate::runtime::builder::finish(self)
            }

            /// Builds and [runs](crate::consumer::Consumer::run) the consumer.
            ///
            /// # Errors
            /// As [`build`](Self::build) and [`Consumer::run`](crate::consumer::Consumer::run).
            pub async fn run(self) -> $crate::Result<()> {
                self.build()?.run().await
            }

            /// Builds and [runs until a signal](crate::consumer::Consumer::run_until_signal).
            ///
            /// # Errors
            /// As [`build`](Self::build) and [`Consumer::run`](crate::consumer::Consumer::run).
            pub async fn run_until_signal(self) -> $crate::Result<()> {
                self.build()?.run_until_signal().await
            }
        }
    };
}
#[cfg(feature = "window")]
pub(crate) use runnable;

runnable!(PerMessage);
runnable!(Batched);

/// The builder's checks, without a broker or a database (the pool is lazy).
mod finish;

pub(crate) use finish::finish;
