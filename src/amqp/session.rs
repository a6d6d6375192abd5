//! The consumer's broker sessions: connect, declare, subscribe, hand the
//! deliveries to the runtime until shutdown or loss, close; between
//! sessions, the reconnect loop ([`reconnect::run`]) and, after a delivery
//! the client cannot parse, the quarantine.

use std::sync::Arc;
use std::time::Duration;

use lapin::Connection;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use super::acks::AckTracker;
use super::delivery::SessionLink;
use super::feed::AmqpFeed;
use super::quarantine;
use super::reconnect::{self, Loss, Reconnect, Session, Sessions};
use super::republish::Republisher;
use super::topology::{Topology, dead_letter_queue};
use super::transport::Amqp;
use crate::amqp::AmqpError;
use crate::runtime::dead_letter::DeadLetterReason;
use crate::runtime::dispatch::{Deliveries, FeedEnd};
use crate::runtime::health::RuntimeState;
use crate::runtime::stats::Counter;
use crate::{Error, Result};

/// How many confirm-mode channels publish retries and dead letters side by side.
const REPUBLISH_CHANNELS: usize = 4;

/// A session that consumed this long proves the queue is not wedged.
const STABLE_SESSION: Duration = Duration::from_secs(30);

/// Bounds on broker round trips during setup and teardown, so a half-open
/// broker cannot hang a reconnect or a shutdown.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Receives the queue's deliveries, session after session, until shutdown
/// or a configuration error (returned).
impl Amqp {
    pub(crate) async fn consume_sessions(
        self: Arc<Self>,
        deliveries: &mut Deliveries<Amqp>,
    ) -> Result<()> {
        let amqp = self;
        let mut link = Reconnect::new(
            amqp.broker.clone(),
            amqp.connection_name.clone(),
            Duration::from_secs(30),
        );
        let stop = deliveries.shutdown().graceful_token().clone();
        let mut sessions = AmqpSessions {
            amqp,
            deliveries,
            wedged: 0,
            unresponsive: false,
            unparseable: false,
            node: None,
            consumed: false,
        };
        match reconnect::run(&mut sessions, &mut link, &stop).await {
            Some(fatal) => Err(fatal),
            None => Ok(()),
        }
    }
}

/// The state that outlives broker sessions.
struct AmqpSessions<'d> {
    amqp: Arc<Amqp>,
    deliveries: &'d mut Deliveries<Amqp>,
    /// Sessions in a row ended by a delivery that could not be moved away.
    wedged: u32,
    /// The broker left a round trip of this session's shutdown unanswered.
    unresponsive: bool,
    /// The last session ended on a delivery the client could not parse.
    unparseable: bool,
    /// The node of the last session: the quarantine's client goes there.
    node: Option<usize>,
    /// A session reached consuming once: from then on, a refusal by the
    /// broker (credentials, permissions) is retried, not fatal.
    consumed: bool,
}

impl AmqpSessions<'_> {
    /// One connection's life: connect, declare, subscribe, dispatch until
    /// shutdown or loss.
    async fn session_on(&mut self, link: &mut Reconnect) -> Session<Error> {
        self.unresponsive = false;
        self.unparseable = false;
        let lost = |error: String| Session::Lost {
            error,
            lasted: Duration::ZERO,
        };
        let stop = self.deliveries.shutdown().graceful_token().clone();
        let connection = tokio::select! {
            connected = link.connect() => match connected {
                // Shared with the republisher, which reopens channels on it.
                Ok(connection) => Arc::new(connection),
                // Refused by every node (TLS, credentials, vhost) before
                // anything ever worked: a configuration error, not an outage.
                Err(e) if refusal(&e) && !link.has_connected() => return Session::Fatal(e),
                Err(e) => {
                    if refusal(&e) {
                        self.deliveries.stats().incr(Counter::BrokerRefusals);
                    }
                    return lost(e.to_string());
                }
            },
            () = stop.cancelled() => return Session::Stopped,
        };
        let subscribed = tokio::time::timeout(SETUP_TIMEOUT, self.subscribe(&connection)).await;
        let end = match subscribed {
            Ok(Ok((channel, deliveries, session))) => {
                self.consume(&connection, channel, deliveries, session)
                    .await
            }
            Ok(Err(e))
                if is(&e, |a| matches!(a, AmqpError::TopologyConflict { .. }))
                    && !self.amqp.wait_for_topology =>
            {
                Session::Fatal(e)
            }
            // A permission missing at start is a configuration error; once
            // consuming worked, an operator is changing permissions: retried.
            Ok(Err(e))
                if is(&e, |a| matches!(a, AmqpError::AccessRefused { .. })) && !self.consumed =>
            {
                Session::Fatal(e)
            }
            Ok(Err(e)) if is(&e, |a| matches!(a, AmqpError::AccessRefused { .. })) => {
                self.deliveries.stats().incr(Counter::BrokerRefusals);
                lost(format!("cannot set up the subscription: {e}"))
            }
            Ok(Err(e)) => lost(format!("cannot set up the subscription: {e}")),
            Err(_) => lost(format!(
                "setting up the subscription took over {SETUP_TIMEOUT:?}"
            )),
        };
        // Closing the connection hands every unacked delivery back to the
        // broker (so does dropping it, if the broker does not answer).
        if connection.status().connected() {
            let close = connection.close(200, "idempo consumer stopped".into());
            let _ = self.bounded(close).await;
        }
        end
    }

    /// A broker round trip of the shutdown path: at most `CLOSE_TIMEOUT`;
    /// none at all once `shutdown_now` (or a second signal) fired, or once
    /// the broker left one unanswered in this session (in a resource alarm it
    /// answers none, and each would only add to the shutdown's length).
    async fn bounded<F: Future>(&mut self, call: F) -> Option<F::Output> {
        let now = self.deliveries.shutdown().now_token().clone();
        if now.is_cancelled() || self.unresponsive {
            return None;
        }
        let done = tokio::select! {
            done = tokio::time::timeout(CLOSE_TIMEOUT, call) => done.ok(),
            () = now.cancelled() => None,
        };
        self.unresponsive |= done.is_none();
        done
    }

    async fn subscribe(
        &self,
        connection: &Arc<Connection>,
    ) -> Result<(lapin::Channel, lapin::Consumer, Arc<SessionLink>)> {
        let amqp = &self.amqp;
        let channel = connection.create_channel().await?;
        if amqp.declare {
            amqp.topology
                .declare(&channel)
                .await
                .map_err(|e| topology_error(&amqp.topology.queue, e))?;
            for queue in &amqp.also_declare {
                let like_ours = Topology {
                    queue: queue.clone(),
                    dead_letter_queue: dead_letter_queue(queue),
                    queue_type: amqp.topology.queue_type,
                    bindings: Vec::new(),
                    retry_delays: Vec::new(),
                };
                like_ours
                    .declare(&channel)
                    .await
                    .map_err(|e| topology_error(queue, e))?;
            }
        }
        let republisher = Republisher::open(connection, REPUBLISH_CHANNELS).await?;
        channel
            .basic_qos(amqp.prefetch, BasicQosOptions::default())
            .await?;
        let deliveries = channel
            .basic_consume(
                amqp.topology.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                access_refused(
                    format!("consume from queue {:?}", amqp.topology.queue),
                    e.into(),
                )
            })?;
        let session = Arc::new(SessionLink {
            queue: amqp.topology.queue.clone(),
            dead_letter_queue: amqp.topology.dead_letter_queue.clone(),
            declare: amqp.declare,
            republisher,
            // Batch mode acks processed deliveries with multiple acks.
            coalesced: amqp.batched.then(AckTracker::new),
            broken: CancellationToken::new(),
            health: self.deliveries.health().clone(),
        });
        Ok((channel, deliveries, session))
    }

    /// Dispatches the subscription's deliveries until shutdown or loss; on
    /// shutdown, cancels the subscription and drains the handlers first.
    async fn consume(
        &mut self,
        connection: &Connection,
        channel: lapin::Channel,
        mut deliveries: lapin::Consumer,
        session: Arc<SessionLink>,
    ) -> Session<Error> {
        self.consumed = true;
        let health = self.deliveries.health().clone();
        health.set_state(RuntimeState::Consuming);
        tracing::info!(
            consumer = %self.deliveries.consumer(),
            queue = %self.amqp.topology.queue,
            prefetch = self.amqp.prefetch,
            batch = self.deliveries.batch().map(|(size, _)| size),
            "consuming"
        );
        let mut feed = AmqpFeed {
            deliveries: &mut deliveries,
            channel: &channel,
            connection,
            session: session.clone(),
            unparseable: false,
        };
        let end = self.deliveries.dispatch(&mut feed).await;
        let unparseable = feed.unparseable;
        if let FeedEnd::Stopped = end {
            health.set_state(RuntimeState::Stopping);
            // Stop new deliveries first, so that nothing arrives while we
            // drain. Bounded: a broker in a resource alarm stops reading a
            // connection that published, and would never answer.
            if channel.status().connected() {
                let cancel = channel.basic_cancel(deliveries.tag(), BasicCancelOptions::default());
                match self.bounded(cancel).await {
                    Some(Ok(())) => {}
                    Some(Err(e)) => tracing::debug!(error = %e, "basic.cancel failed"),
                    None => tracing::warn!("basic.cancel unanswered; draining anyway"),
                }
            }
            // Before the channel closes: the drained units' acks go out on it.
            self.deliveries.drain().await;
        }
        if channel.status().connected() {
            let close = channel.close(200, "idempo consumer stopped".into());
            let _ = self.bounded(close).await;
        }
        // Closed here rather than when the last task drops them: a channel
        // dropped while the connection closes makes lapin log an ERROR.
        let _ = self.bounded(session.republisher.close()).await;
        match end {
            FeedEnd::Lost { error, lasted } => {
                self.unparseable = unparseable;
                Session::Lost { error, lasted }
            }
            _ => Session::Stopped,
        }
    }

    /// A delivery lapin cannot parse ended the session, and would end every
    /// next one: move such deliveries at the head of the queue to the DLQ
    /// with a client of our own (see `quarantine`).
    async fn quarantine(&mut self, node: usize) {
        let amqp = &self.amqp;
        let target = quarantine::Target {
            broker: &amqp.broker,
            node,
            queue: &amqp.topology.queue,
            dead_letter_queue: &amqp.topology.dead_letter_queue,
            consumer: &amqp.consumer,
            limit: usize::from(amqp.prefetch) + 1,
            table: amqp.letters_table.as_ref(),
        };
        let moved = tokio::select! {
            moved = quarantine::run(&target) => moved,
            () = self.deliveries.stopping() => return,
        };
        let (stats, health) = (self.deliveries.stats(), self.deliveries.health());
        match moved {
            Ok(n) if n > 0 => {
                for _ in 0..n {
                    stats.incr(Counter::PoisonFrames);
                    stats.dead_lettered(DeadLetterReason::UndecodableProperties);
                }
                self.wedged = 0;
                health.record_error(format!(
                    "moved {n} delivery(ies) whose properties are not valid UTF-8 to {:?}",
                    amqp.topology.dead_letter_queue
                ));
            }
            outcome => {
                self.wedged += 1;
                let why = match outcome {
                    Ok(_) => "none found at the head of the queue".to_owned(),
                    Err(e) => e.to_string(),
                };
                let error = format!(
                    "a delivery the AMQP client cannot parse ended {} session(s) in a row, and could not be moved to the DLQ ({why}); the queue is stuck behind it",
                    self.wedged
                );
                tracing::error!(%error);
                health.record_error(error);
            }
        }
        let wedged = self.wedged;
        health.update(|s| s.wedged_sessions = wedged);
    }
}

impl Sessions for AmqpSessions<'_> {
    type Fatal = Error;

    async fn session(&mut self, link: &mut Reconnect) -> Session<Error> {
        self.deliveries.health().set_state(RuntimeState::Connecting);
        let end = self.session_on(link).await;
        if !matches!(end, Session::Stopped) {
            self.deliveries.stats().incr(Counter::SessionFailures);
        }
        self.node = link.node();
        end
    }

    async fn lost(&mut self, loss: &Loss) {
        let (error, lasted, pause) = (&loss.error, loss.lasted, loss.pause);
        match (loss.logged, loss.never_connected) {
            (true, true) => tracing::error!(
                %error, ?pause, note = %loss.note(),
                "cannot reach RabbitMQ: is it running at that address? retrying"
            ),
            (true, false) => tracing::error!(
                %error, ?pause, note = %loss.note(), "broker session lost; reconnecting"
            ),
            (false, _) => tracing::debug!(%error, ?pause, in_row = loss.in_row, "reconnecting"),
        }
        let health = self.deliveries.health().clone();
        health.record_error(error.clone());
        // After the loss is recorded, so that what the quarantine found is
        // the last word in Health.
        if self.unparseable {
            self.quarantine(self.node.unwrap_or(0)).await;
        } else if lasted >= STABLE_SESSION {
            self.wedged = 0;
            health.update(|s| s.wedged_sessions = 0);
        }
        if !lasted.is_zero() {
            health.record_reconnect();
            self.deliveries.stats().incr(Counter::Reconnects);
        }
        health.set_state(RuntimeState::Reconnecting);
    }
}

/// A declaration the broker refused because the queue exists with other
/// arguments (PRECONDITION_FAILED, 406), or for lack of the configure
/// permission (ACCESS_REFUSED, 403), is a configuration error.
fn topology_error(queue: &str, error: Error) -> Error {
    match AmqpError::of(&error) {
        Some(AmqpError::Client(e)) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 406 => {
                AmqpError::TopologyConflict {
                    queue: queue.to_owned(),
                    broker: amqp.get_message().to_string(),
                }
                .into()
            }
            _ => access_refused(format!("declare queue {queue:?}"), error),
        },
        _ => error,
    }
}

/// `operation`'s error as [`Error::AccessRefused`] when the broker refused
/// it for lack of a permission (ACCESS_REFUSED, 403).
fn access_refused(operation: String, error: Error) -> Error {
    match AmqpError::of(&error) {
        Some(AmqpError::Client(e)) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 403 => {
                AmqpError::AccessRefused {
                    operation,
                    broker: amqp.get_message().to_string(),
                }
                .into()
            }
            _ => error,
        },
        _ => error,
    }
}

/// Whether `error` is an AMQP error that `what` accepts.
fn is(error: &Error, what: impl Fn(&AmqpError) -> bool) -> bool {
    AmqpError::of(error).is_some_and(what)
}

/// Whether connecting failed because the broker refused this client's
/// configuration on every node (TLS, credentials, vhost, an unusable
/// certificate file), as opposed to an outage.
fn refusal(error: &Error) -> bool {
    matches!(error, Error::Tls { .. } | Error::Certificate(_))
        || is(error, |a| matches!(a, AmqpError::BrokerRefused { .. }))
}
