//! [`DedupPublisher`]: publish once per dedup id within the window.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use lapin::types::{AMQPValue, ShortString};
use lapin::{BasicProperties, Connection};
use tokio::sync::Mutex;
use tokio::time::{Instant, timeout, timeout_at};

use crate::amqp::publish::{ConfirmChannel, PublishError};
use crate::amqp::reconnect::Reconnect;
use crate::amqp::{AmqpError, Broker};
use crate::window::store::MAX_WINDOW;
use crate::window::{DedupId, DedupWindow, Reservation, Scope, WindowStore};
use crate::{Error, Result};

/// How long a reservation lasts by default: it outlasts the default confirm
/// timeout (30 s) with room for the store's calls.
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(70);

/// How long a publish waits for a channel and the broker's confirm, by default.
pub(crate) const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// A message to publish with [`DedupPublisher::publish`].
#[derive(Debug, Clone)]
pub struct Outgoing {
    body: Vec<u8>,
    properties: BasicProperties,
    dedup_id: Option<DedupId>,
    group: Option<String>,
}

impl Outgoing {
    /// The header that carries a message's dedup id.
    pub const DEDUP_ID_HEADER: &'static str = "x-idempo-dedup-id";
    /// The header that carries a message's group id (SQS's `MessageGroupId`).
    pub const GROUP_ID_HEADER: &'static str = "x-group-id";

    /// A persistent message (delivery mode 2) with `body`, deduplicated on its
    /// content unless [`dedup_id`](Self::dedup_id) is set.
    pub fn new(body: impl Into<Vec<u8>>) -> Self {
        Outgoing {
            body: body.into(),
            properties: BasicProperties::default().with_delivery_mode(2),
            dedup_id: None,
            group: None,
        }
    }

    /// Deduplicate on this id instead of the body's hash.
    #[must_use]
    pub fn dedup_id(mut self, id: DedupId) -> Self {
        self.dedup_id = Some(id);
        self
    }

    /// Puts the message in a group: header [`GROUP_ID_HEADER`](Outgoing::GROUP_ID_HEADER), and ids count
    /// per group.
    #[must_use]
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }

    /// The AMQP properties. They are lapin's: use them through idempo's
    /// re-export, [`idempo::amqp::lapin`](crate::amqp::lapin), so that your
    /// lapin is always the one idempo was built with.
    ///
    /// ```
    /// use idempo::amqp::lapin::BasicProperties;
    /// use idempo::amqp::window::Outgoing;
    ///
    /// let message = Outgoing::new(r#"{"order": 17}"#).properties(
    ///     BasicProperties::default()
    ///         .with_content_type("application/json".into())
    ///         .with_message_id("order-17".into()),
    /// );
    /// ```
    ///
    /// - A `message_id` set here is kept; otherwise a random UUID is assigned.
    /// - A `delivery_mode` left unset stays persistent (2), as with
    ///   [`new`](Self::new); set 1 for a transient message.
    /// - The headers are kept; [`DEDUP_ID_HEADER`](Outgoing::DEDUP_ID_HEADER) (and [`GROUP_ID_HEADER`](Outgoing::GROUP_ID_HEADER)
    ///   for a [`group`](Self::group)) are added.
    #[must_use]
    pub fn properties(mut self, properties: BasicProperties) -> Self {
        self.properties = match properties.delivery_mode() {
            Some(_) => properties,
            None => properties.with_delivery_mode(2),
        };
        self
    }
}

/// What [`DedupPublisher::publish`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The `message_id` of the message on the queue: for a duplicate, the
    /// first publish's (as SQS returns it).
    pub message_id: String,
    /// `true` when nothing was sent because the id was seen in the window.
    pub duplicate: bool,
}

/// Publishes through a confirm-mode channel, at most once per dedup id
/// within the window.
///
/// ```no_run
/// # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
/// use idempo::amqp::Broker;
/// use idempo::amqp::window::{DedupPublisher, Outgoing};
/// use idempo::window::{DedupId, DedupWindow, RedisWindow};
///
/// let window = DedupWindow::new(RedisWindow::connect("redis://127.0.0.1:6379").await?);
/// let broker = Broker::new("amqp://guest:guest@127.0.0.1:5672/%2f")?;
/// let publisher = DedupPublisher::connect(&broker, window).await?;
/// let sent = publisher
///     .publish("", "orders", Outgoing::new("{}").dedup_id(DedupId::new("order-17")?))
///     .await?;
/// # Ok(()) }
/// ```
///
/// The id is *reserved* before publishing and *recorded* only after the
/// broker confirmed the publish: a publish that certainly did not reach the
/// broker (nacked, returned as unroutable, refused with `NOT_FOUND` or
/// `ACCESS_REFUSED`, never sent) releases it, so it does not poison the id,
/// and a concurrent publish of the same id waits for the first to settle
/// (then returns its message id, or publishes itself if the first failed). A
/// process that dies between the confirm and the record leaves a reservation
/// that expires after its lease (70 s, 70 s); a retry after that
/// publishes again: the window is at-least-once at that point. So does a
/// publish whose confirm never came (the broker may hold it): it returns an
/// error but keeps the id reserved for the lease.
///
/// # Reconnects
/// The publisher owns its connection and one channel. A channel the broker
/// closed (after a `NOT_FOUND`, say) is reopened, and a lost connection
/// reconnected through the [`Broker`] (trying its nodes in turn), by the next
/// publish; while the broker cannot be reached, attempts are spaced by a
/// jittered backoff (0.1 s doubling up to 5 s) and the publishes in between
/// fail at once with [`AmqpError::PublishNotConfirmed`], reserving nothing.
pub struct DedupPublisher<S> {
    link: Link,
    window: DedupWindow<S>,
    lease: Duration,
    confirm_timeout: Duration,
}

impl<S> fmt::Debug for DedupPublisher<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DedupPublisher")
            .field("broker", &self.link.broker)
            .field("connection_name", &self.link.name)
            .field("lease", &self.lease)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

/// Configures a [`DedupPublisher`]: [`DedupPublisher::builder`].
///
/// # Default
/// - lease: 70 s (70 s);
/// - confirm timeout: 30 s (30 s);
/// - connection name: `idempo-publisher:<pid>`.
pub struct DedupPublisherBuilder<S> {
    broker: Broker,
    window: DedupWindow<S>,
    lease: Duration,
    confirm_timeout: Duration,
    connection_name: Option<String>,
}

impl<S> fmt::Debug for DedupPublisherBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DedupPublisherBuilder")
            .field("broker", &self.broker)
            .field("lease", &self.lease)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connection_name", &self.connection_name)
            .finish_non_exhaustive()
    }
}

impl<S: WindowStore> DedupPublisherBuilder<S> {
    /// How long a reservation holds the id while its publish is in flight
    /// (default 70 s; at most ten years). It must outlast the
    /// confirm timeout, with room for the store's calls: a lease that runs out
    /// before the confirm lets a concurrent publisher of the id send a second
    /// copy. It is also how long an id stays blocked after a publish whose
    /// outcome is unknown (no confirm, a lost connection).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.min(MAX_WINDOW);
        self
    }

    /// How long one publish may take, from waiting for a channel (and
    /// reconnecting) to the broker's confirm (default
    /// 30 s, 30 s; at least 1 ms).
    #[must_use]
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout.clamp(Duration::from_millis(1), MAX_WINDOW);
        self
    }

    /// The client-provided connection name the broker shows
    /// (`rabbitmqctl list_connections client_properties`, the management UI).
    #[must_use]
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// Connects and opens the confirm-mode channel.
    ///
    /// # Errors
    /// [`Error::Config`] when the lease does not outlast the confirm timeout;
    /// the broker's error when it cannot be reached
    /// ([`AmqpError::BrokerUnreachable`], [`AmqpError::BrokerRefused`], [`Error::Tls`]).
    pub async fn build(self) -> Result<DedupPublisher<S>> {
        if self.lease <= self.confirm_timeout {
            return Err(Error::Config(format!(
                "the dedup publisher's lease ({:?}) must outlast its confirm timeout ({:?}): \
                 otherwise a concurrent publisher of an id could send it again while its \
                 first publish awaits the confirm",
                self.lease, self.confirm_timeout
            )));
        }
        let name = self
            .connection_name
            .unwrap_or_else(|| format!("idempo-publisher:{}", std::process::id()));
        let link = Link {
            broker: self.broker.clone(),
            name: name.clone(),
            confirm_timeout: self.confirm_timeout,
            state: Mutex::new(LinkState {
                connection: None,
                channel: None,
                reconnect: Reconnect::new(self.broker, name, Duration::from_secs(5)),
                next_attempt: None,
            }),
        };
        // Connect now: a wrong address or TLS setting is reported at start.
        link.channel().await?;
        Ok(DedupPublisher {
            link,
            window: self.window,
            lease: self.lease,
            confirm_timeout: self.confirm_timeout,
        })
    }
}

impl<S: WindowStore> DedupPublisher<S> {
    /// Connects to `broker` and opens a confirm-mode channel, with the
    /// defaults of [`DedupPublisherBuilder`].
    ///
    /// # Errors
    /// As [`DedupPublisherBuilder::build`].
    pub async fn connect(broker: &Broker, window: DedupWindow<S>) -> Result<Self> {
        Self::builder(broker.clone(), window).build().await
    }

    /// A publisher to `broker` with other settings than the defaults (lease,
    /// confirm timeout, connection name).
    pub fn builder(broker: Broker, window: DedupWindow<S>) -> DedupPublisherBuilder<S> {
        DedupPublisherBuilder {
            broker,
            window,
            lease: DEFAULT_LEASE,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            connection_name: None,
        }
    }

    /// Publishes `message` to `exchange` with `routing_key` (the default
    /// exchange `""` and a queue name publish to that queue), unless its
    /// dedup id was seen within the window in the same scope (the exchange
    /// and routing key, and the group if any).
    ///
    /// # Errors
    /// Where the id is **released** (publishing again is safe):
    /// [`AmqpError::PublishNotConfirmed`] when the broker nacked the message or
    /// returned it as unroutable, or it was never sent (no channel to the
    /// broker, see [Reconnects](Self#reconnects)); [`AmqpError::Client`] when the
    /// broker refused it with a channel error (`NOT_FOUND`: no such exchange;
    /// `ACCESS_REFUSED`); the broker's error when reconnecting failed.
    ///
    /// Where the outcome is **unknown** (the id stays reserved for its lease):
    /// [`AmqpError::PublishNotConfirmed`] when no confirm came within the confirm
    /// timeout; [`AmqpError::Client`] when the connection failed in flight.
    ///
    /// And the store's error; [`Error::Config`] for a `message_id` with a NUL
    /// byte or a scope no store can hold (over 2,048 bytes).
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: Outgoing,
    ) -> Result<Published> {
        let id = message
            .dedup_id
            .clone()
            .unwrap_or_else(|| DedupId::content(&message.body));
        let message_id = match &message.properties.message_id() {
            Some(known) => known.to_string(),
            None => crate::random::uuid_v4()?,
        };
        // Recorded after the confirm: refuse it before anything is sent.
        crate::window::store::check_value(&message_id)?;
        // The exchange's length keeps ("", "a/b") and ("a", "b") apart.
        let destination = if exchange.is_empty() {
            routing_key.to_owned()
        } else {
            format!("{}:{exchange}/{routing_key}", exchange.len())
        };
        let scope = match &message.group {
            Some(group) => Scope::group(&destination, group),
            None => Scope::queue(&destination),
        };
        let started = Instant::now();
        let patience = self.lease.saturating_add(self.confirm_timeout);
        loop {
            match self.window.reserve(&scope, &id, self.lease).await? {
                Reservation::Seen(message_id) => {
                    return Ok(Published {
                        message_id,
                        duplicate: true,
                    });
                }
                Reservation::Pending if started.elapsed() < patience => {
                    // Another publisher holds the id: wait for it to settle.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Reservation::Pending => {
                    return Err(AmqpError::PublishNotConfirmed(format!(
                        "dedup id {id} stayed reserved by another publisher"
                    ))
                    .into());
                }
                Reservation::Reserved { token } => {
                    let sent = self
                        .send(exchange, routing_key, &message, &id, &message_id)
                        .await;
                    return match sent {
                        Ok(()) => {
                            // The message is out: a failure to record is logged,
                            // not returned (the caller would publish it again).
                            match self.window.record(&scope, &id, token, &message_id).await {
                                Ok(true) => {}
                                Ok(false) => {
                                    tracing::warn!(%id, "the reservation expired before the publish was recorded")
                                }
                                Err(e) => {
                                    tracing::warn!(%id, error = %e, "the publish could not be recorded in the window")
                                }
                            }
                            Ok(Published {
                                message_id,
                                duplicate: false,
                            })
                        }
                        // No confirm: the broker may hold the message. Keep the
                        // reservation (it expires with its lease) rather than let
                        // a retry publish a second copy at once.
                        Err(Sent::Unknown(error)) => Err(error),
                        Err(Sent::No(error)) => {
                            if let Err(e) = self.window.release(&scope, &id, token).await {
                                tracing::warn!(%id, error = %e, "could not release the dedup id");
                            }
                            Err(error)
                        }
                    };
                }
            }
        }
    }

    /// Whether the publisher's channel is open now. A closed one is reopened
    /// (and a lost connection reconnected) by the next publish.
    pub async fn is_connected(&self) -> bool {
        let state = self.link.state.lock().await;
        state.channel.as_ref().is_some_and(|c| c.is_usable())
    }

    /// Closes the channel and the connection (waiting up to the confirm
    /// timeout for a publish in flight, then at most 2 s for the broker). A
    /// publish after this connects again.
    pub async fn close(&self) {
        let mut state = self.link.state.lock().await;
        if let Some(channel) = state.channel.take() {
            let _ = timeout(self.confirm_timeout, channel.close()).await;
        }
        if let Some(connection) = state.connection.take()
            && connection.status().connected()
        {
            let _ = timeout(
                Duration::from_secs(2),
                connection.close(200, "idempo publisher closed".into()),
            )
            .await;
        }
    }

    /// Publishes and waits for the confirm, reconnecting first if needed; all
    /// of it within the confirm timeout, so that the reservation (whose lease
    /// outlasts that timeout) is still held when the publish is recorded.
    async fn send(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Outgoing,
        id: &DedupId,
        message_id: &str,
    ) -> std::result::Result<(), Sent> {
        let deadline = Instant::now() + self.confirm_timeout;
        let mut headers = message.properties.headers().clone().unwrap_or_default();
        headers.insert(
            Outgoing::DEDUP_ID_HEADER.into(),
            AMQPValue::LongString(id.as_str().into()),
        );
        if let Some(group) = &message.group {
            headers.insert(
                Outgoing::GROUP_ID_HEADER.into(),
                AMQPValue::LongString(group.as_str().into()),
            );
        }
        let properties = message
            .properties
            .clone()
            .with_message_id(ShortString::from(message_id.to_owned()))
            .with_headers(headers);
        let mut reopened = false;
        loop {
            let channel = match timeout_at(deadline, self.link.channel()).await {
                Ok(Ok(channel)) => channel,
                Ok(Err(e)) => return Err(Sent::No(e)),
                Err(_) => {
                    return Err(Sent::No(
                        AmqpError::PublishNotConfirmed(format!(
                            "no channel to the broker within {:?}; nothing was sent",
                            self.confirm_timeout
                        ))
                        .into(),
                    ));
                }
            };
            let published = channel
                .publish_by(
                    deadline,
                    exchange,
                    routing_key,
                    &message.body,
                    properties.clone(),
                )
                .await;
            let e = match published {
                Ok(()) => return Ok(()),
                // The channel closed after we took it (its connection was
                // cut, say) and nothing was sent: once more on a fresh one.
                Err(PublishError::Closed(_)) if !reopened => {
                    reopened = true;
                    continue;
                }
                Err(e) => e,
            };
            let certain = e.certainly_not_sent();
            let error = match e {
                PublishError::Amqp(e) | PublishError::Closed(e) => AmqpError::Client(e),
                PublishError::Timeout(_) => AmqpError::PublishNotConfirmed(format!(
                    "no confirm within {:?}; the outcome is unknown and the id stays reserved for its lease",
                    self.confirm_timeout
                )),
                other => AmqpError::PublishNotConfirmed(other.to_string()),
            };
            return Err(if certain {
                Sent::No(error.into())
            } else {
                Sent::Unknown(error.into())
            });
        }
    }
}

/// The publisher's connection and channel, reopened when lost.
struct Link {
    /// For `Debug`.
    broker: Broker,
    name: String,
    confirm_timeout: Duration,
    state: Mutex<LinkState>,
}

struct LinkState {
    connection: Option<Connection>,
    /// Shared with the publishes in flight on it: a new channel can replace
    /// it while they finish.
    channel: Option<Arc<ConfirmChannel>>,
    /// Which node next, and the backoff between attempts.
    reconnect: Reconnect,
    /// After a failed attempt: no new one before this instant, and why.
    next_attempt: Option<(Instant, String)>,
}

impl Link {
    /// The open channel; reopens it (and reconnects) when it was lost.
    ///
    /// Concurrent callers wait for one attempt instead of each making their
    /// own; after a failed attempt they fail at once until the backoff's
    /// pause has passed.
    async fn channel(&self) -> Result<Arc<ConfirmChannel>> {
        let mut state = self.state.lock().await;
        if let Some(channel) = &state.channel
            && channel.is_usable()
        {
            return Ok(channel.clone());
        }
        if let Some((at, why)) = &state.next_attempt {
            let now = Instant::now();
            if now < *at {
                return Err(AmqpError::PublishNotConfirmed(format!(
                    "not connected to the broker ({why}); nothing was sent; next attempt in {:?}",
                    *at - now
                ))
                .into());
            }
        }
        match self.reopen(&mut state).await {
            Ok(channel) => {
                state.reconnect.reset();
                state.next_attempt = None;
                Ok(channel)
            }
            Err(e) => {
                let pause = state.reconnect.pause_after(Duration::ZERO);
                state.next_attempt = Some((Instant::now() + pause, e.to_string()));
                tracing::warn!(error = %e, ?pause, "the dedup publisher cannot reach the broker");
                Err(e)
            }
        }
    }

    async fn reopen(&self, state: &mut LinkState) -> Result<Arc<ConfirmChannel>> {
        state.channel = None;
        let alive = state
            .connection
            .as_ref()
            .is_some_and(|c| c.status().connected());
        if !alive {
            // Dropping a dead connection's last handle is all it needs.
            state.connection = None;
            let connection = state.reconnect.connect().await?;
            tracing::info!(node = ?state.reconnect.node(), "the dedup publisher connected");
            state.connection = Some(connection);
        }
        let connection = state.connection.as_ref().expect("connected above");
        // Bounded: a half-open broker must not hold every publish.
        let opened = timeout(
            self.confirm_timeout,
            ConfirmChannel::open(connection, self.confirm_timeout),
        )
        .await;
        match opened {
            Ok(Ok(channel)) => {
                let channel = Arc::new(channel);
                state.channel = Some(channel.clone());
                Ok(channel)
            }
            failed => {
                // Whatever broke the channel, a fresh connection is the
                // surest cure on the next attempt.
                state.connection = None;
                Err(match failed {
                    Ok(Err(e)) => AmqpError::Client(e),
                    _ => AmqpError::PublishNotConfirmed(format!(
                        "the broker did not open a channel within {:?}",
                        self.confirm_timeout
                    )),
                }
                .into())
            }
        }
    }
}

/// Why a publish did not go out, and whether that is certain.
enum Sent {
    /// Certainly not delivered (nacked, returned, refused, never sent): the
    /// id can be released.
    No(Error),
    /// Perhaps delivered (no confirm, a connection lost in flight): keep the
    /// id reserved.
    Unknown(Error),
}
