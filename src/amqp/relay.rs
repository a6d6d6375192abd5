//! [`Relay`]: publishes the [outbox](crate::outbox)'s committed rows to
//! RabbitMQ, and deletes each only after the broker confirmed it.
//!
//! One batch is one PostgreSQL transaction:
//!
//! 1. lock up to `batch_size` due pending rows, lowest id first, `FOR UPDATE
//!    SKIP LOCKED` (another relay's rows are skipped, not waited for);
//! 2. of each ordering key, keep only the rows that no earlier pending row of
//!    the same key precedes (that one is another relay's, or waits for a
//!    retry): the relay holding a key's first row is the only one that
//!    publishes that key;
//! 3. publish them with confirms in flight together (`mandatory`);
//! 4. delete the confirmed rows (or mark them done), record failures with a
//!    backoff, commit.
//!
//! A crash before the commit rolls it all back: the rows are published again
//! with the same ids. `idle_in_transaction_session_timeout` bounds how long a
//! relay whose host vanished keeps its locks.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable};
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::watch;
use tracing::Instrument;

use super::broker::Broker;
use super::consumer::ShutdownHandle;
use super::health::Health;
use super::publish::{ConfirmChannel, OutgoingFrame, PublishError};
use crate::backoff::{self, Backoff};
use crate::outbox::packed::{self, Staged};
use crate::outbox::{self, NOTIFY_CHANNEL, OutboxStatus};
use crate::{Error, Result};

/// Where a relay is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RelayState {
    /// Run by a consumer whose process has not used the outbox yet: it checks
    /// for pending rows every poll interval and starts when it finds some or
    /// when the process stages a message.
    Dormant,
    /// Connecting to the broker (first time or after a loss).
    Connecting,
    /// Publishing (or waiting for `NOTIFY`).
    Running,
    /// The broker connection was lost; waiting before reconnecting.
    Reconnecting,
    /// `run` returned.
    Stopped,
}

/// A snapshot of a relay's health.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RelaySnapshot {
    /// Where the relay is.
    pub state: RelayState,
    /// Rows this relay published (confirmed by the broker).
    pub published: u64,
    /// Rows this relay gave up on (marked failed).
    pub failed: u64,
    /// The outbox when last counted (at most once a second while busy).
    pub outbox: OutboxStatus,
    /// The last error the relay met, if any.
    pub last_error: Option<String>,
}

/// Live health of a [`Relay`]. Cheap to clone; all clones see the same state.
#[derive(Debug, Clone)]
pub struct RelayHealth {
    inner: Arc<watch::Sender<RelaySnapshot>>,
}

impl RelayHealth {
    fn new(state: RelayState) -> Self {
        RelayHealth {
            inner: Arc::new(watch::Sender::new(RelaySnapshot {
                state,
                published: 0,
                failed: 0,
                outbox: OutboxStatus::default(),
                last_error: None,
            })),
        }
    }

    /// The current state.
    pub fn snapshot(&self) -> RelaySnapshot {
        self.inner.borrow().clone()
    }

    /// Waits until `condition` holds, and returns that state.
    pub async fn wait_for(
        &self,
        mut condition: impl FnMut(&RelaySnapshot) -> bool,
    ) -> RelaySnapshot {
        let mut rx = self.inner.subscribe();
        let state = rx
            .wait_for(|s| condition(s))
            .await
            .expect("the sender lives as long as self");
        state.clone()
    }

    fn update(&self, f: impl FnOnce(&mut RelaySnapshot)) {
        self.inner.send_modify(f);
    }
}

/// Publishes the outbox's committed rows: run one (or several, on several
/// hosts) per database. Every [`Consumer`](super::Consumer) runs one for its
/// pool unless [`ConsumerBuilder::relay`](super::ConsumerBuilder::relay)
/// turns it off; run one yourself in a process that stages without
/// consuming (an axum service).
///
/// ```no_run
/// use idempo::amqp::Relay;
///
/// # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
/// let relay = Relay::new("amqp://guest:guest@127.0.0.1:5672/%2f", pool)?;
/// let stop = relay.shutdown_handle();
/// let running = tokio::spawn(relay.run());
/// // ... serve requests that stage messages ...
/// stop.shutdown(); // finishes the batch in flight, drains what is pending
/// running.await.expect("relay task")?;
/// # Ok(()) }
/// ```
///
/// # Default
/// - batches of 500 rows; confirms awaited together, within 10 s;
/// - wakes on `NOTIFY idempo_outbox` (sent when a staging transaction
///   commits), and polls every 5 s as a fallback;
/// - a refused (nacked) or unroutable message is retried with exponential
///   backoff (1 s doubling to 5 min, jittered), and after 10 attempts marked
///   `failed` with its reason ([`outbox::failed`], [`outbox::retry_failed`]);
/// - published rows are deleted at once (see [`keep_published`](Self::keep_published));
/// - takeover: a relay whose host vanished mid-batch loses its row locks after
///   15 s (`idle_in_transaction_session_timeout`); a killed relay's locks go at
///   once. Another relay picks the rows up at its next wake, within the poll
///   interval.
///
/// # Connections
/// One PostgreSQL connection of its own for `LISTEN`, and one of the pool's
/// for the length of each batch. One AMQP connection.
pub struct Relay {
    broker: Broker,
    pool: PgPool,
    batch_size: usize,
    poll_interval: Duration,
    max_attempts: u32,
    retry_min: Duration,
    retry_max: Duration,
    confirm_timeout: Duration,
    takeover_after: Duration,
    keep_published: Option<Duration>,
    connection_name: Option<String>,
    dormant: bool,
    shutdown: ShutdownHandle,
    health: RelayHealth,
    consumer_health: Option<Health>,
}

impl fmt::Debug for Relay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("broker", &self.broker)
            .field("batch_size", &self.batch_size)
            .field("poll_interval", &self.poll_interval)
            .field("max_attempts", &self.max_attempts)
            .finish_non_exhaustive()
    }
}

/// Rows per cleanup `DELETE` of kept published rows.
const CLEANUP_BATCH: i64 = 5_000;

/// How long the relay waits, once a local consumer committed, for more of
/// its commits before publishing: fewer, larger batches under load.
const LOCAL_LINGER: Duration = Duration::from_millis(10);

/// How long a relay waits before retrying a key whose first row another
/// relay holds.
const CONTENDED_RETRY: Duration = Duration::from_millis(50);

impl Relay {
    /// A relay for the outbox in `pool`'s database, publishing to the broker
    /// at `amqp_url` (one URL, or comma-separated node URLs).
    ///
    /// # Errors
    /// [`Error::Config`] when the URL does not parse.
    pub fn new(amqp_url: &str, pool: PgPool) -> Result<Self> {
        Ok(Self::with_broker(Broker::new(amqp_url)?, pool))
    }

    /// A relay publishing to `broker` (several nodes, TLS settings).
    pub fn with_broker(broker: Broker, pool: PgPool) -> Self {
        Relay {
            broker,
            pool,
            batch_size: 500,
            poll_interval: Duration::from_secs(5),
            max_attempts: 10,
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(300),
            confirm_timeout: Duration::from_secs(10),
            takeover_after: Duration::from_secs(15),
            keep_published: None,
            connection_name: None,
            dormant: false,
            shutdown: ShutdownHandle::default(),
            health: RelayHealth::new(RelayState::Connecting),
            consumer_health: None,
        }
    }

    /// The relay a consumer runs: dormant until its process uses the outbox.
    pub(crate) fn for_consumer(
        broker: Broker,
        pool: PgPool,
        consumer: &str,
        health: Health,
    ) -> Self {
        let mut relay = Self::with_broker(broker, pool);
        relay.dormant = true;
        relay.health = RelayHealth::new(RelayState::Dormant);
        relay.connection_name = Some(format!("idempo-relay:{consumer}:{}", std::process::id()));
        health.set_relay(Some(RelayState::Dormant));
        relay.consumer_health = Some(health);
        relay
    }

    /// Rows per batch (default: 500).
    #[must_use]
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.batch_size = rows;
        self
    }

    /// The fallback poll, for missed notifications and a lost `LISTEN`
    /// connection (default: 5 s).
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Attempts before a refused or unroutable message is marked failed
    /// (default: 10).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The backoff between attempts of a refused or unroutable message:
    /// `min` doubling up to `max`, jittered (default: 1 s to 5 min).
    #[must_use]
    pub fn retry_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.retry_min = min;
        self.retry_max = max;
        self
    }

    /// How long the confirms of one batch may take (default: 10 s). Keep it
    /// below [`takeover_after`](Self::takeover_after).
    #[must_use]
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// How long PostgreSQL lets a silent relay keep its rows locked before it
    /// ends the session, so another relay can take over (default: 15 s).
    #[must_use]
    pub fn takeover_after(mut self, timeout: Duration) -> Self {
        self.takeover_after = timeout;
        self
    }

    /// Keep published rows (state `done`) this long for audit, then delete
    /// them in bounded batches (default: delete at once).
    #[must_use]
    pub fn keep_published(mut self, keep: Duration) -> Self {
        self.keep_published = Some(keep);
        self
    }

    /// The AMQP connection name (default: `idempo-relay:<pid>`).
    #[must_use]
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// A handle that stops the relay from another task.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// The relay's live health.
    pub fn health(&self) -> RelayHealth {
        self.health.clone()
    }

    /// Publishes until the [`ShutdownHandle`] fires. A graceful shutdown
    /// finishes the batch in flight and what is pending, then returns; a
    /// [`shutdown_now`](ShutdownHandle::shutdown_now) drops the batch in
    /// flight (its transaction rolls back: those rows are published again
    /// later, with the same ids). Broker and database losses are retried,
    /// not returned.
    ///
    /// # Errors
    /// [`Error::Config`] for an impossible configuration (a batch size or
    /// attempt count of zero, a confirm timeout not below the takeover time).
    pub async fn run(self) -> Result<()> {
        if self.batch_size == 0 || self.max_attempts == 0 || self.poll_interval.is_zero() {
            return Err(Error::Config(
                "the relay's batch_size, max_attempts and poll_interval must be positive".into(),
            ));
        }
        if self.confirm_timeout >= self.takeover_after {
            return Err(Error::Config(format!(
                "the relay's confirm_timeout ({:?}) must be below takeover_after ({:?})",
                self.confirm_timeout, self.takeover_after
            )));
        }
        let run = Running::new(&self);
        if self.dormant && !run.wait_until_used().await {
            self.set_state(RelayState::Stopped);
            return Ok(());
        }
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
        let mut last_node = None;
        let graceful = self.shutdown.graceful_token();
        loop {
            self.set_state(RelayState::Connecting);
            match run.session(&mut last_node).await {
                Ok(()) => break,
                Err(error) => {
                    tracing::warn!(%error, "outbox relay: broker session lost; reconnecting");
                    self.health.update(|s| s.last_error = Some(error));
                    self.set_state(RelayState::Reconnecting);
                    let pause = backoff.next_delay();
                    tokio::select! {
                        () = tokio::time::sleep(pause) => {}
                        () = graceful.cancelled() => break,
                    }
                }
            }
        }
        self.set_state(RelayState::Stopped);
        Ok(())
    }

    fn set_state(&self, state: RelayState) {
        self.health.update(|s| s.state = state);
        if let Some(health) = &self.consumer_health {
            health.set_relay(Some(state));
        }
    }
}

/// A row as the relay reads it.
#[derive(sqlx::FromRow)]
struct Row {
    id: i64,
    exchange: String,
    routing_key: String,
    message_id: String,
    body: Vec<u8>,
    content_type: Option<String>,
    correlation_id: Option<String>,
    persistent: bool,
    headers: String,
    ordering_key: Option<String>,
    attempts: i32,
    packed: Option<Vec<u8>>,
    messages: i32,
}

impl Row {
    /// The messages the row carries: itself, or its packed ones.
    fn unpack(self) -> std::result::Result<Vec<Staged>, String> {
        match self.packed {
            Some(packed) => packed::decode(&packed),
            None => Ok(vec![Staged {
                exchange: self.exchange,
                routing_key: self.routing_key,
                message_id: self.message_id,
                content_type: self.content_type,
                correlation_id: self.correlation_id,
                persistent: self.persistent,
                headers: self.headers,
                body: self.body,
            }]),
        }
    }
}

/// A picked row and what became of each of its messages.
struct Envelope {
    id: i64,
    attempts: i32,
    packed: bool,
    messages: Vec<Staged>,
}

/// What one batch did, and when the next is worth running.
struct BatchOutcome {
    /// More rows may be due right away (the query filled its limit, or
    /// rows were left for the next batch).
    full: bool,
    /// Rows published or recorded as failed attempts.
    settled: usize,
    /// The broker connection failed mid-batch: reconnect before the next.
    broker_lost: Option<String>,
    /// A key waits: for another relay (soon) or for a retry (its time).
    retry_in: Option<Duration>,
}

/// The relay's state while it runs.
struct Running<'a> {
    relay: &'a Relay,
    /// A pool of one for `LISTEN`: the notification connection is held for
    /// good, and must not take a slot that handlers wait for.
    listen_pool: PgPool,
    /// Keys whose first pending row waits for its retry: left out of the
    /// batch query until then, so they block neither this relay nor other keys.
    parked: std::sync::Mutex<HashMap<String, Instant>>,
    last_status: std::sync::Mutex<Option<Instant>>,
    /// Rows deleted since the last `VACUUM` this relay ran.
    deleted: std::sync::atomic::AtomicU64,
}

/// Deleted rows after which a relay vacuums the table itself when the server
/// does not (autovacuum off): deleted rows keep their space until a VACUUM.
const VACUUM_AFTER: u64 = 50_000;

impl<'a> Running<'a> {
    fn new(relay: &'a Relay) -> Self {
        let options = relay.pool.connect_options().as_ref().clone();
        Running {
            relay,
            listen_pool: PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(10))
                .connect_lazy_with(options),
            parked: std::sync::Mutex::new(HashMap::new()),
            last_status: std::sync::Mutex::new(None),
            deleted: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Dormant until this process stages a message or pending rows show up;
    /// `false` if shutdown came first.
    async fn wait_until_used(&self) -> bool {
        let stop = self.relay.shutdown.graceful_token();
        loop {
            let staged = outbox::staged_in_process().notified();
            let pending: std::result::Result<bool, sqlx::Error> =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox WHERE state = 'pending')")
                    .fetch_one(&self.relay.pool)
                    .await;
            match pending {
                Ok(true) => return true,
                Ok(false) => {}
                // No outbox table (migrations not run) or no database yet.
                Err(e) => tracing::debug!(error = %e, "outbox relay: cannot look for pending rows"),
            }
            tokio::select! {
                () = staged => return true,
                () = tokio::time::sleep(self.relay.poll_interval) => {}
                () = stop.cancelled() => return false,
            }
        }
    }

    /// One broker connection: publish until shutdown (`Ok`) or a loss (`Err`).
    async fn session(&self, last_node: &mut Option<usize>) -> std::result::Result<(), String> {
        let relay = self.relay;
        let name = relay
            .connection_name
            .clone()
            .unwrap_or_else(|| format!("idempo-relay:{}", std::process::id()));
        let (connection, node) = relay
            .broker
            .connect_from(*last_node, &name)
            .await
            .map_err(|e| e.to_string())?;
        *last_node = Some(node);
        let channel = match ConfirmChannel::open(&connection, relay.confirm_timeout).await {
            Ok(channel) => channel,
            Err(e) => {
                let _ = connection.close(200, "idempo relay".into()).await;
                return Err(e.to_string());
            }
        };
        relay.set_state(RelayState::Running);
        let local = outbox::LocalRelay::running();
        let outcome = self.publish_until_stopped(&channel).await;
        drop(local);
        channel.close().await;
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            connection.close(200, "idempo relay stopped".into()),
        )
        .await;
        outcome
    }

    async fn publish_until_stopped(
        &self,
        channel: &ConfirmChannel,
    ) -> std::result::Result<(), String> {
        let relay = self.relay;
        let graceful = relay.shutdown.graceful_token();
        let now = relay.shutdown.now_token();
        let mut listener: Option<PgListener> = None;
        let mut database_backoff = Backoff::new(Duration::from_millis(200), relay.poll_interval);
        let mut last_cleanup: Option<Instant> = None;
        loop {
            if listener.is_none() && !graceful.is_cancelled() {
                listener = self.listen().await;
            }
            // Drain: batch after batch while they come back full.
            let wait = loop {
                if !channel.is_open().await {
                    return Err("the relay's channel was closed".into());
                }
                let outcome = tokio::select! {
                    outcome = self.batch(channel) => outcome,
                    () = now.cancelled() => return Ok(()),
                };
                match outcome {
                    Ok(outcome) => {
                        database_backoff.reset();
                        self.refresh_status().await;
                        if let Some(lost) = outcome.broker_lost {
                            return Err(lost);
                        }
                        // A full batch: more may be due, unless every row
                        // was held back (its key's first row is elsewhere).
                        if outcome.full && outcome.settled > 0 {
                            continue;
                        }
                        let poll = if graceful.is_cancelled() {
                            return Ok(());
                        } else {
                            relay.poll_interval
                        };
                        break outcome.retry_in.map_or(poll, |d| d.min(poll));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "outbox relay: database error; retrying");
                        relay
                            .health
                            .update(|s| s.last_error = Some(format!("database: {e}")));
                        if graceful.is_cancelled() {
                            return Ok(());
                        }
                        break database_backoff.next_delay();
                    }
                }
            };
            if let Some(keep) = relay.keep_published
                && last_cleanup.is_none_or(|t| t.elapsed() >= keep.min(Duration::from_secs(60)))
            {
                last_cleanup = Some(Instant::now());
                self.cleanup(keep).await;
            }
            self.vacuum_if_nobody_does().await;
            self.refresh_status().await;
            let notified = async {
                match listener.as_mut() {
                    Some(l) => l.recv().await.map(|_| ()),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                received = notified => {
                    if let Err(e) = received {
                        tracing::debug!(error = %e, "outbox relay: LISTEN connection lost; polling until it is back");
                        listener = None;
                    }
                    // One batch serves every commit that notified meanwhile.
                    if let Some(l) = listener.as_mut() {
                        while l.next_buffered().is_some() {}
                    }
                }
                // A consumer here committed what it staged without NOTIFY.
                () = outbox::committed_in_process().notified() => {
                    // Let the consumer's next commits join this batch: its
                    // handlers commit continuously under load.
                    tokio::time::sleep(LOCAL_LINGER).await;
                }
                () = tokio::time::sleep(wait) => {}
                // Graceful shutdown: one more drain, then stop.
                () = graceful.cancelled() => {}
            }
        }
    }

    async fn listen(&self) -> Option<PgListener> {
        let connected = async {
            let mut listener = PgListener::connect_with(&self.listen_pool).await?;
            listener.listen(NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match tokio::time::timeout(Duration::from_secs(10), connected).await {
            Ok(Ok(listener)) => Some(listener),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "outbox relay: cannot LISTEN; polling");
                None
            }
            Err(_) => None,
        }
    }

    /// One batch, in one transaction.
    async fn batch(
        &self,
        channel: &ConfirmChannel,
    ) -> std::result::Result<BatchOutcome, sqlx::Error> {
        let relay = self.relay;
        let parked: Vec<String> = {
            let mut parked = self.parked.lock().expect("not poisoned");
            let now = Instant::now();
            parked.retain(|_, until| *until > now);
            parked.keys().cloned().collect()
        };
        // The takeover bound rides on BEGIN: no round trip of its own. The
        // commit need not wait for its flush: a mark lost in a server crash
        // only makes those rows go out again, with the same ids.
        let begin = format!(
            "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {}; \
             SET LOCAL synchronous_commit = off",
            relay.takeover_after.as_millis()
        );
        let mut tx = relay.pool.begin_with(sqlx::AssertSqlSafe(begin)).await?;
        let mut rows: Vec<Row> = sqlx::query_as(
            "SELECT id, exchange, routing_key, message_id, body, content_type, correlation_id, \
                    persistent, headers::text AS headers, ordering_key, attempts, packed, messages \
             FROM outbox \
             WHERE state = 'pending' AND next_attempt_at <= now() \
               AND (ordering_key IS NULL OR NOT (ordering_key = ANY($2::text[]))) \
             ORDER BY id LIMIT $1 \
             FOR UPDATE SKIP LOCKED",
        )
        .bind(relay.batch_size as i64)
        .bind(&parked)
        .fetch_all(&mut *tx)
        .await?;
        // More rows may be due when the query filled its limit.
        let full = rows.len() == relay.batch_size;
        // At most batch_size messages (packed rows carry several), at least one row.
        let mut total = 0;
        let keep = rows
            .iter()
            .take_while(|r| {
                total += r.messages.max(1) as usize;
                total <= relay.batch_size
            })
            .count()
            .max(1);
        let full = full || keep < rows.len();
        rows.truncate(keep);
        let picked = rows.len();
        if rows.is_empty() {
            tx.rollback().await?;
            return Ok(BatchOutcome {
                full: false,
                settled: 0,
                broker_lost: None,
                retry_in: None,
            });
        }
        let span = tracing::info_span!(
            "outbox_relay_batch",
            rows = picked,
            published = tracing::field::Empty,
            failed = tracing::field::Empty
        );
        async move {
            let (rows, retry_in) = self.first_of_each_key(&mut tx, rows).await?;
            let mut failures = Failures::default();
            let mut envelopes = Vec::with_capacity(rows.len());
            for row in rows {
                let (id, attempts, packed) = (row.id, row.attempts, row.packed.is_some());
                let first_id = row.message_id.clone();
                match row.unpack() {
                    Ok(messages) => envelopes.push(Envelope {
                        id,
                        attempts,
                        packed,
                        messages,
                    }),
                    Err(why) => failures.push(
                        relay,
                        (id, attempts, &first_id),
                        format!("cannot read the packed row: {why}"),
                        true,
                    ),
                }
            }
            let frames = envelopes
                .iter()
                .flat_map(|e| e.messages.iter().map(frame))
                .collect();
            let mut outcomes = channel.publish_all(frames).await.into_iter();
            let mut confirmed = Vec::new();
            let mut unpacked = Vec::new();
            let mut broker_lost = None;
            let mut published = 0;
            for envelope in &envelopes {
                let results: Vec<_> = outcomes.by_ref().take(envelope.messages.len()).collect();
                let too_large = results.iter().find_map(|o| match o {
                    Err(PublishError::Lost(why)) => broker_size_limit(why),
                    _ => None,
                });
                // Per message: None confirmed, Some((error, certain)) refused.
                let mut refused = Vec::with_capacity(results.len());
                let mut lost = false;
                for (message, result) in envelope.messages.iter().zip(results) {
                    refused.push(match result {
                        Ok(()) => None,
                        Err(e @ (PublishError::Nacked | PublishError::Returned(_))) => {
                            Some((e.to_string(), false))
                        }
                        Err(e) if too_large.is_some_and(|limit| message.body.len() > limit) => {
                            Some((format!("the broker refused it: {e}"), true))
                        }
                        // The broker closed the channel over another message
                        // of this row: not sent; an attempt, retried.
                        Err(e) if too_large.is_some() => {
                            broker_lost.get_or_insert_with(|| e.to_string());
                            Some((format!("not sent: {e}"), false))
                        }
                        Err(e) => {
                            // The broker may or may not hold it: the row
                            // stays pending and is published again.
                            broker_lost.get_or_insert_with(|| e.to_string());
                            lost = true;
                            None
                        }
                    });
                }
                if lost {
                    continue;
                }
                let accepted = refused.iter().filter(|r| r.is_none()).count();
                published += accepted;
                if accepted == refused.len() {
                    confirmed.push(envelope.id);
                } else if !envelope.packed {
                    let (error, certain) = refused.pop().flatten().expect("one refused message");
                    let m = &envelope.messages[0];
                    failures.push(
                        relay,
                        (envelope.id, envelope.attempts, &m.message_id),
                        error,
                        certain,
                    );
                } else {
                    // The confirmed ones are out; the refused ones become
                    // rows of their own, each with its attempt recorded.
                    confirmed.push(envelope.id);
                    let mut retry = Failures::default();
                    let mut messages = Vec::new();
                    for (message, refusal) in envelope.messages.iter().zip(refused) {
                        if let Some((error, certain)) = refusal {
                            retry.push(
                                relay,
                                (0, envelope.attempts, &message.message_id),
                                error,
                                certain,
                            );
                            messages.push(message.clone());
                        }
                    }
                    unpacked.push((envelope.id, messages, retry));
                }
            }
            for (row, messages, retry) in &unpacked {
                retry.insert_unpacked(&mut tx, *row, messages).await?;
            }
            if !confirmed.is_empty() {
                let query = match relay.keep_published {
                    None => "DELETE FROM outbox WHERE id = ANY($1)",
                    Some(_) => {
                        "UPDATE outbox SET state = 'done', published_at = now(), \
                         attempts = attempts + 1 WHERE id = ANY($1)"
                    }
                };
                let deleted = sqlx::query(query)
                    .bind(&confirmed)
                    .execute(&mut *tx)
                    .await?;
                if relay.keep_published.is_none() {
                    self.deleted.fetch_add(
                        deleted.rows_affected(),
                        std::sync::atomic::Ordering::Relaxed,
                    );
                }
            }
            for (_, _, retry) in unpacked {
                failures.absorb(retry);
            }
            let given_up = failures.record(&mut tx).await?;
            tx.commit().await?;
            let span = tracing::Span::current();
            span.record("published", published);
            span.record("failed", failures.attempts());
            metrics::counter!("idempo_outbox_published_total").increment(published as u64);
            metrics::counter!("idempo_outbox_retried_total")
                .increment(failures.attempts().saturating_sub(given_up) as u64);
            metrics::counter!("idempo_outbox_failed_total").increment(given_up as u64);
            relay.health.update(|s| {
                s.published += published as u64;
                s.failed += given_up as u64;
            });
            // Wake for the earliest retry this batch scheduled.
            let retry_in = failures.next_retry().into_iter().chain(retry_in).min();
            Ok(BatchOutcome {
                full,
                settled: published + failures.attempts(),
                broker_lost,
                retry_in,
            })
        }
        .instrument(span)
        .await
    }

    /// The rows this relay may publish now: all unkeyed ones, and of each
    /// key the run of rows that starts at the key's first pending row (an
    /// earlier one held by another relay, or waiting for its retry, holds the
    /// key back). Also returns when a held-back key is worth another look.
    async fn first_of_each_key(
        &self,
        tx: &mut sqlx::PgConnection,
        rows: Vec<Row>,
    ) -> std::result::Result<(Vec<Row>, Option<Duration>), sqlx::Error> {
        let mut keys: Vec<&str> = rows
            .iter()
            .filter_map(|r| r.ordering_key.as_deref())
            .collect();
        if keys.is_empty() {
            return Ok((rows, None));
        }
        keys.sort_unstable();
        keys.dedup();
        let last = rows.last().map_or(0, |r| r.id);
        // A plain read: it sees rows that other relays hold locked.
        let pending: Vec<(String, i64, Option<f64>)> = sqlx::query_as(
            "SELECT ordering_key, id, \
                    CASE WHEN next_attempt_at > now() \
                         THEN extract(epoch FROM next_attempt_at - now())::float8 END \
             FROM outbox \
             WHERE state = 'pending' AND ordering_key = ANY($1) AND id <= $2 \
             ORDER BY ordering_key, id",
        )
        .bind(&keys)
        .bind(last)
        .fetch_all(&mut *tx)
        .await?;
        let mut mine: HashMap<&str, Vec<i64>> = HashMap::new();
        for row in &rows {
            if let Some(key) = &row.ordering_key {
                mine.entry(key).or_default().push(row.id);
            }
        }
        // Per key: how many of my rows continue the key's run of pending rows.
        let mut allowed: HashMap<String, usize> = HashMap::new();
        let mut blocked: HashMap<String, Option<f64>> = HashMap::new();
        for (key, id, wait) in pending {
            let Some(ids) = mine.get(key.as_str()) else {
                continue;
            };
            if blocked.contains_key(&key) {
                continue;
            }
            let n = allowed.entry(key.clone()).or_insert(0);
            if ids.get(*n) == Some(&id) {
                *n += 1;
            } else {
                blocked.insert(key, wait);
            }
        }
        let mut retry_in: Option<Duration> = None;
        {
            let mut parked = self.parked.lock().expect("not poisoned");
            for (key, wait) in blocked {
                let delay = match wait {
                    // Waiting for its retry: park the key until then.
                    Some(secs) => {
                        let delay = Duration::from_secs_f64(secs.max(0.0));
                        parked.insert(key, Instant::now() + delay);
                        delay
                    }
                    // Held by another relay, which publishes it now.
                    None => CONTENDED_RETRY,
                };
                retry_in = Some(retry_in.map_or(delay, |d| d.min(delay)));
            }
        }
        let mut kept = Vec::with_capacity(rows.len());
        for row in rows {
            let Some(key) = row.ordering_key.as_deref() else {
                kept.push(row);
                continue;
            };
            if let Some(n) = allowed.get_mut(key).filter(|n| **n > 0) {
                *n -= 1;
                kept.push(row);
            }
        }
        Ok((kept, retry_in))
    }

    /// Counts the outbox into the gauges and the health, at most once a
    /// second (the count reads the whole table), and when going idle after
    /// a second without one.
    async fn refresh_status(&self) {
        {
            let mut last = self.last_status.lock().expect("not poisoned");
            if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
                return;
            }
            *last = Some(Instant::now());
        }
        if let Ok(status) = outbox::status(&self.relay.pool).await {
            metrics::gauge!("idempo_outbox_pending").set(status.pending as f64);
            metrics::gauge!("idempo_outbox_failed").set(status.failed as f64);
            metrics::gauge!("idempo_outbox_oldest_pending_seconds")
                .set(status.oldest_pending_age.map_or(0.0, |d| d.as_secs_f64()));
            self.relay.health.update(|s| s.outbox = status);
        }
    }

    /// Vacuums the outbox once many rows were deleted, if autovacuum is off:
    /// the table then stays as large as its backlog, not its history.
    async fn vacuum_if_nobody_does(&self) {
        use std::sync::atomic::Ordering;
        if self.deleted.load(Ordering::Relaxed) < VACUUM_AFTER {
            return;
        }
        self.deleted.store(0, Ordering::Relaxed);
        let autovacuum: std::result::Result<String, sqlx::Error> =
            sqlx::query_scalar("SELECT current_setting('autovacuum')")
                .fetch_one(&self.relay.pool)
                .await;
        if !autovacuum.is_ok_and(|setting| setting == "off") {
            return;
        }
        // Not in a transaction: VACUUM refuses to run inside one.
        if let Err(e) = sqlx::raw_sql("VACUUM outbox")
            .execute(&self.relay.pool)
            .await
        {
            tracing::warn!(error = %e, "outbox relay: autovacuum is off and VACUUM outbox failed; the table keeps the space of deleted rows");
        }
    }

    /// Deletes kept published rows past their audit period, batch by batch.
    async fn cleanup(&self, keep: Duration) {
        loop {
            match outbox::delete_published_before(&self.relay.pool, keep, CLEANUP_BATCH).await {
                Ok(n) => {
                    self.deleted
                        .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                    if n as i64 != CLEANUP_BATCH {
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "outbox relay: cannot delete old published rows");
                    return;
                }
            }
        }
    }
}

/// Failed attempts of one batch, written with one statement.
#[derive(Default)]
struct Failures {
    ids: Vec<i64>,
    errors: Vec<String>,
    give_up: Vec<bool>,
    delays: Vec<f64>,
    /// Give-ups and delays of unpacked messages, written by `insert_unpacked`.
    counted: Vec<(bool, f64)>,
}

impl Failures {
    /// A failed attempt of `(row id, its attempts so far, message id)`.
    fn push(&mut self, relay: &Relay, row: (i64, i32, &str), error: String, certain: bool) {
        let (id, attempts, message_id) = row;
        let attempt = u32::try_from(attempts).unwrap_or(0).saturating_add(1);
        let give_up = certain || attempt >= relay.max_attempts;
        let delay =
            backoff::full_jitter(backoff::ceiling(relay.retry_min, relay.retry_max, attempt))
                .max(relay.retry_min);
        if give_up {
            tracing::error!(%message_id, %error, attempts = attempt, "outbox relay: giving up on a message; it stays in the outbox as failed");
        } else {
            tracing::warn!(%message_id, %error, attempt, ?delay, "outbox relay: message not accepted; retrying later");
        }
        self.ids.push(id);
        self.errors.push(error);
        self.give_up.push(give_up);
        self.delays.push(delay.as_secs_f64());
    }

    /// Takes over the (already written) failures of unpacked messages, for
    /// the counts.
    fn absorb(&mut self, other: Failures) {
        self.counted
            .extend(other.give_up.into_iter().zip(other.delays));
    }

    /// Every failed attempt of the batch, written here or unpacked.
    fn attempts(&self) -> usize {
        self.ids.len() + self.counted.len()
    }

    /// When the earliest retry scheduled by the batch is due.
    fn next_retry(&self) -> Option<Duration> {
        self.give_up
            .iter()
            .copied()
            .zip(self.delays.iter().copied())
            .chain(self.counted.iter().copied())
            .filter(|(given_up, _)| !given_up)
            .map(|(_, secs)| Duration::from_secs_f64(secs))
            .min()
    }

    /// Writes the refused messages of packed row `row` as rows of their own,
    /// with their attempt recorded and the packed row's age.
    async fn insert_unpacked(
        &self,
        tx: &mut sqlx::PgConnection,
        row: i64,
        messages: &[Staged],
    ) -> std::result::Result<(), sqlx::Error> {
        let text = |f: fn(&Staged) -> Option<&str>| -> Vec<Option<&str>> {
            messages.iter().map(f).collect()
        };
        let bodies: Vec<&[u8]> = messages.iter().map(|m| m.body.as_slice()).collect();
        let persistent: Vec<bool> = messages.iter().map(|m| m.persistent).collect();
        sqlx::query(
            "INSERT INTO outbox (exchange, routing_key, message_id, body, content_type, \
                                 correlation_id, persistent, headers, attempts, last_error, \
                                 state, next_attempt_at, created_at) \
             SELECT e, r, i, b, c, k, p, h::jsonb, o.attempts + 1, err, \
                    CASE WHEN g THEN 'failed' ELSE 'pending' END, \
                    now() + make_interval(secs => d), o.created_at \
             FROM outbox AS o, \
                  unnest($2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[], \
                         $7::text[], $8::bool[], $9::text[], $10::text[], $11::bool[], \
                         $12::float8[]) WITH ORDINALITY AS t(e, r, i, b, c, k, p, h, err, g, d, n) \
             WHERE o.id = $1 ORDER BY n",
        )
        .bind(row)
        .bind(text(|m| Some(&m.exchange)))
        .bind(text(|m| Some(&m.routing_key)))
        .bind(text(|m| Some(&m.message_id)))
        .bind(&bodies)
        .bind(text(|m| m.content_type.as_deref()))
        .bind(text(|m| m.correlation_id.as_deref()))
        .bind(&persistent)
        .bind(text(|m| Some(&m.headers)))
        .bind(&self.errors)
        .bind(&self.give_up)
        .bind(&self.delays)
        .execute(tx)
        .await?;
        Ok(())
    }

    /// Records the attempts; returns how many messages were given up.
    async fn record(&self, tx: &mut sqlx::PgConnection) -> std::result::Result<usize, sqlx::Error> {
        let absorbed = self.counted.iter().filter(|(g, _)| *g).count();
        if self.ids.is_empty() {
            return Ok(absorbed);
        }
        sqlx::query(
            "UPDATE outbox AS o SET attempts = o.attempts + 1, last_error = f.error, \
                    state = CASE WHEN f.give_up THEN 'failed' ELSE 'pending' END, \
                    next_attempt_at = now() + make_interval(secs => f.delay) \
             FROM unnest($1::bigint[], $2::text[], $3::bool[], $4::float8[]) \
                  AS f(id, error, give_up, delay) \
             WHERE o.id = f.id",
        )
        .bind(&self.ids)
        .bind(&self.errors)
        .bind(&self.give_up)
        .bind(&self.delays)
        .execute(tx)
        .await?;
        Ok(self.give_up.iter().filter(|g| **g).count() + absorbed)
    }
}

/// The broker's `max_message_size`, when it closed the channel over a
/// message larger than that ("message size 2097152 is larger than
/// configured max size 1048576").
fn broker_size_limit(reason: &str) -> Option<usize> {
    let (_, after) = reason.split_once("larger than configured max size ")?;
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// A message as a publish.
fn frame(row: &Staged) -> OutgoingFrame<'_> {
    let mut properties = BasicProperties::default()
        .with_message_id(row.message_id.as_str().into())
        .with_delivery_mode(if row.persistent { 2 } else { 1 });
    if let Some(content_type) = &row.content_type {
        properties = properties.with_content_type(content_type.as_str().into());
    }
    if let Some(correlation_id) = &row.correlation_id {
        properties = properties.with_correlation_id(correlation_id.as_str().into());
    }
    if let Ok(serde_json::Value::Object(headers)) = serde_json::from_str(&row.headers)
        && !headers.is_empty()
    {
        properties = properties.with_headers(table(&headers));
    }
    OutgoingFrame {
        exchange: &row.exchange,
        routing_key: &row.routing_key,
        body: &row.body,
        properties,
    }
}

/// JSON headers as an AMQP table.
fn table(object: &serde_json::Map<String, serde_json::Value>) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in object {
        table.insert(name.as_str().into(), amqp_value(value));
    }
    table
}

fn amqp_value(value: &serde_json::Value) -> AMQPValue {
    use serde_json::Value;
    match value {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or_default()),
        },
        Value::String(s) => AMQPValue::LongString(s.as_str().into()),
        Value::Array(items) => AMQPValue::FieldArray(FieldArray::from(
            items.iter().map(amqp_value).collect::<Vec<_>>(),
        )),
        Value::Object(object) => AMQPValue::FieldTable(table(object)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_broker_size_limit_is_read_from_its_reason() {
        let why =
            "PRECONDITION_FAILED - message size 2097152 is larger than configured max size 1048576";
        assert_eq!(broker_size_limit(why), Some(1_048_576));
        assert_eq!(broker_size_limit("NOT_FOUND - no exchange"), None);
    }

    #[test]
    fn json_headers_become_amqp_values() {
        let headers =
            serde_json::json!({"s": "x", "i": 3, "b": true, "f": 1.5, "a": [1], "o": {"k": "v"}});
        let table = table(headers.as_object().unwrap());
        let inner = table.inner();
        assert_eq!(inner.get("i"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(inner.get("b"), Some(&AMQPValue::Boolean(true)));
        assert_eq!(inner.get("f"), Some(&AMQPValue::Double(1.5)));
        assert!(matches!(inner.get("s"), Some(AMQPValue::LongString(_))));
        assert!(matches!(inner.get("a"), Some(AMQPValue::FieldArray(_))));
        assert!(matches!(inner.get("o"), Some(AMQPValue::FieldTable(_))));
    }
}
