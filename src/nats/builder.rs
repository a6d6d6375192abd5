//! [`ConsumerBuilder`]: every option of a JetStream [`Consumer`] and its
//! default; the mode (per message or batched) is the builder's type, as on
//! AMQP ([`crate::consumer::mode`]).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use super::consumer::{Consumer, Parts as ConsumerParts};
use super::names::{check_name, check_subject};
use super::topology::Topology;
use crate::runtime::database_gate::DatabaseGate;
use crate::runtime::forwarding::Forwarding;
use crate::runtime::handler::{EachMessage, Handler, WholeBatch};
use crate::runtime::health::Health;
use crate::runtime::message::FromMessage;
use crate::runtime::message_id::MessageIdSource;
use crate::runtime::mode::{Batched, IntoDispatch, NoHandler, Parts, PerMessage};
use crate::runtime::redelivery::RedeliveryPolicy;
use crate::runtime::shutdown::ShutdownHandle;
use crate::runtime::stats::Stats;
use crate::{Error, Result, Schema};

/// How long a batch waits for more deliveries after its first one.
const DEFAULT_LINGER: Duration = Duration::from_millis(5);

/// Configures a JetStream [`Consumer`]. Created by [`Consumer::builder`].
///
/// # Default
/// - stream: the one named with [`stream`](Self::stream), created (file
///   storage, limits retention, taking the subject) when missing;
/// - subject: the stream's name;
/// - durable consumer and idempo consumer name (the scope of message ids):
///   the stream's name;
/// - `max_ack_pending`: 100, `concurrency`: 16, `ack_wait`: 30 s (a running
///   handler's messages are kept with in-progress acks every 10 s);
/// - message id: the `Nats-Msg-Id` header ([`MessageIdSource::Property`]);
/// - retries: [`RedeliveryPolicy::default`]'s delays, as NAKs with delay;
///   after its last attempt, the message goes to the `dead_letters` table;
/// - `handler_timeout`: 5 min; `shutdown_timeout`: 30 s;
/// - `retention` of `processed_messages` rows: 7 days, reaped every 5 min;
/// - an outbox [`Relay`](super::Relay) to JetStream (see [`relay`](Self::relay)).
#[must_use]
pub struct ConsumerBuilder<Mode = NoHandler> {
    settings: Settings,
    mode: Mode,
}

struct Settings {
    url: String,
    pool: PgPool,
    stream: Option<String>,
    subject: Option<String>,
    consumer: Option<String>,
    create_stream: bool,
    max_ack_pending: u16,
    concurrency: usize,
    ack_wait: Duration,
    message_id: MessageIdSource,
    redelivery: RedeliveryPolicy,
    handler_timeout: Duration,
    checked_acquire: bool,
    shutdown_timeout: Duration,
    retention: Option<Duration>,
    retention_interval: Duration,
    schema: Schema,
    relay: bool,
    relay_streams: Vec<String>,
}

impl<Mode: fmt::Debug> fmt::Debug for ConsumerBuilder<Mode> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("stream", &self.settings.stream)
            .field("subject", &self.settings.subject)
            .field("consumer", &self.settings.consumer)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// Starts configuring a consumer of a JetStream stream on the NATS
    /// server at `nats_url` (`nats://127.0.0.1:4222`; or several URLs
    /// separated by commas, one per node of a cluster) that runs its handler
    /// in transactions on `pool` (size it to at least `concurrency`).
    pub fn builder(nats_url: impl Into<String>, pool: PgPool) -> ConsumerBuilder<NoHandler> {
        ConsumerBuilder {
            settings: Settings {
                url: nats_url.into(),
                pool,
                stream: None,
                subject: None,
                consumer: None,
                create_stream: true,
                max_ack_pending: 100,
                concurrency: 16,
                ack_wait: Duration::from_secs(30),
                message_id: MessageIdSource::default(),
                redelivery: RedeliveryPolicy::default(),
                handler_timeout: Duration::from_secs(300),
                checked_acquire: false,
                shutdown_timeout: Duration::from_secs(30),
                retention: Some(Duration::from_secs(7 * 24 * 3600)),
                retention_interval: Duration::from_secs(300),
                schema: Schema::default(),
                relay: true,
                relay_streams: Vec::new(),
            },
            mode: NoHandler(()),
        }
    }
}

impl ConsumerBuilder<NoHandler> {
    /// Per-message mode with this handler: the same [`Handler`]s as on AMQP
    /// (`(Tx, M)` with `M` a [`JsonBody`](crate::consumer::JsonBody), a
    /// [`Message`](crate::consumer::Message) or another [`FromMessage`]), run in
    /// the transaction that claimed the message id.
    pub fn handler<M, H>(self, handler: H) -> ConsumerBuilder<PerMessage>
    where
        M: FromMessage,
        H: Handler<M>,
    {
        self.into_mode(PerMessage {
            handler: Arc::new(EachMessage::new(handler)),
            groups: None,
        })
    }

    /// Batch mode with a handler of `Vec<M>`: up to 100 deliveries (or
    /// [`batch`](ConsumerBuilder::batch)) per transaction; a failing batch
    /// is rolled back and each message handled on its own.
    pub fn batch_handler<M, H>(self, handler: H) -> ConsumerBuilder<Batched>
    where
        M: FromMessage,
        H: Handler<Vec<M>>,
    {
        self.into_mode(Batched {
            handler: Arc::new(WholeBatch::new(handler)),
            size: 100,
            linger: DEFAULT_LINGER,
        })
    }
}

impl ConsumerBuilder<PerMessage> {
    /// Batch mode with the per-message handler: up to `size` deliveries
    /// per transaction.
    pub fn batch(self, size: usize) -> ConsumerBuilder<Batched> {
        let PerMessage { handler, .. } = self.mode;
        ConsumerBuilder {
            settings: self.settings,
            mode: Batched {
                handler,
                size,
                linger: DEFAULT_LINGER,
            },
        }
    }
}

impl ConsumerBuilder<Batched> {
    /// Up to `size` deliveries per transaction.
    pub fn batch(mut self, size: usize) -> Self {
        self.mode.size = size;
        self
    }

    /// How long a batch waits for more deliveries after its first (5 ms).
    pub fn batch_linger(mut self, linger: Duration) -> Self {
        self.mode.linger = linger;
        self
    }
}

impl<Mode> ConsumerBuilder<Mode> {
    fn into_mode<Next>(self, mode: Next) -> ConsumerBuilder<Next> {
        ConsumerBuilder {
            settings: self.settings,
            mode,
        }
    }

    /// The stream to consume (required). Its name is also the default
    /// subject and consumer name.
    pub fn stream(mut self, stream: impl Into<String>) -> Self {
        self.settings.stream = Some(stream.into());
        self
    }

    /// The subject to consume (a filter on the stream; wildcards allowed).
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.settings.subject = Some(subject.into());
        self
    }

    /// The consumer name: the durable JetStream consumer's, and the scope of
    /// message ids in `processed_messages`. Competing processes share it.
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.settings.consumer = Some(name.into());
        self
    }

    /// Whether a missing stream is created (default) or an error at start.
    pub fn create_stream(mut self, create: bool) -> Self {
        self.settings.create_stream = create;
        self
    }

    /// Deliveries held by this process at once (JetStream's
    /// `max_ack_pending` for the durable consumer, which competing
    /// processes share).
    pub fn max_ack_pending(mut self, n: u16) -> Self {
        self.settings.max_ack_pending = n;
        self
    }

    /// Handlers running at once (per-message mode).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.settings.concurrency = concurrency;
        self
    }

    /// How long JetStream waits for an acknowledgement before redelivering;
    /// a running unit sends in-progress acks every third of it.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.settings.ack_wait = ack_wait;
        self
    }

    /// Where the id to deduplicate on comes from.
    pub fn message_id(mut self, source: MessageIdSource) -> Self {
        self.settings.message_id = source;
        self
    }

    /// The retry policy: its delays become NAK delays; after its attempts
    /// (JetStream's delivery count), the message is dead-lettered.
    pub fn redelivery(mut self, policy: RedeliveryPolicy) -> Self {
        self.settings.redelivery = policy;
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

    /// How long a handler may run before it is abandoned and retried.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.settings.handler_timeout = timeout;
        self
    }

    /// How long shutdown waits for the handlers in flight.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.settings.shutdown_timeout = timeout;
        self
    }

    /// How long `processed_messages` rows are kept (7 days): longer than
    /// any redelivery can come.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.settings.retention = Some(retention);
        self
    }

    /// Whether the consumer runs an outbox [`Relay`](super::Relay) to
    /// JetStream (default): it publishes what handlers stage and what
    /// `idempo dlq replay` stages from the dead-letter table.
    pub fn relay(mut self, relay: bool) -> Self {
        self.settings.relay = relay;
        self
    }

    /// A stream the consumer's relay publishes to (subject = name), created
    /// at start when missing: where handlers forward.
    pub fn relay_stream(mut self, name: impl Into<String>) -> Self {
        self.settings.relay_streams.push(name.into());
        self
    }

    /// Migrate or check idempo's schema at start ([`Schema::default`]: neither).
    pub fn schema(mut self, schema: Schema) -> Self {
        self.settings.schema = schema;
        self
    }
}

macro_rules! build {
    ($mode:ty) => {
        impl ConsumerBuilder<$mode> {
            /// Checks the configuration and builds the consumer.
            ///
            /// # Errors
            /// [`Error::Config`] without a stream or for impossible values;
            /// [`NatsError::InvalidName`](super::NatsError::InvalidName) for a
            /// stream, subject or consumer name NATS refuses.
            pub fn build(self) -> Result<Consumer> {
                finish(self)
            }
        }
    };
}

build!(PerMessage);
build!(Batched);

fn finish<Mode: IntoDispatch>(builder: ConsumerBuilder<Mode>) -> Result<Consumer> {
    let ConsumerBuilder { settings: s, mode } = builder;
    let stream = s
        .stream
        .ok_or_else(|| Error::Config("a stream is required: call .stream(name)".into()))?;
    let subject = s.subject.unwrap_or_else(|| stream.clone());
    let consumer = s.consumer.unwrap_or_else(|| stream.clone());
    check_name("stream", &stream)?;
    check_subject(&subject)?;
    check_name("consumer", &consumer)?;
    for stream in &s.relay_streams {
        check_name("stream", stream)?;
    }
    if s.concurrency == 0 || usize::from(s.max_ack_pending) < s.concurrency {
        return Err(Error::Config(format!(
            "concurrency ({}) must be at least 1 and at most max_ack_pending ({})",
            s.concurrency, s.max_ack_pending
        )));
    }
    if s.ack_wait < Duration::from_secs(1) {
        return Err(Error::Config("ack_wait must be at least 1 s".into()));
    }
    s.redelivery.validate().map_err(Error::Config)?;
    let stats = Stats::new(&consumer);
    let health = Health::default();
    let shutdown = ShutdownHandle::default();
    let gate = DatabaseGate::new(
        s.pool.clone(),
        health.clone(),
        stats.clone(),
        shutdown.graceful_token().clone(),
    );
    let forwarding = Arc::new(Forwarding::new(false, super::TRANSPORT));
    let dispatch = mode.into_dispatch(&Parts {
        consumer: &consumer,
        queue: &subject,
        pool: &s.pool,
        prefetch: s.max_ack_pending,
        handler_timeout: s.handler_timeout,
        gate: &gate,
        stats: &stats,
        forwarding: &forwarding,
        partitioned: false,
        checked_acquire: s.checked_acquire,
    })?;
    Ok(Consumer::new(ConsumerParts {
        url: s.url,
        pool: s.pool,
        consumer: consumer.clone(),
        topology: Topology {
            stream,
            subject,
            durable: consumer,
            create_stream: s.create_stream,
            ack_wait: s.ack_wait,
            max_ack_pending: i64::from(s.max_ack_pending),
        },
        concurrency: s.concurrency,
        message_id: s.message_id,
        redelivery: s.redelivery,
        shutdown_timeout: s.shutdown_timeout,
        retention: s.retention,
        retention_interval: s.retention_interval,
        schema: s.schema,
        relay: s.relay.then_some(s.relay_streams),
        dispatch,
        shutdown,
        stats,
        health,
    }))
}
