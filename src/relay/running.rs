//! A relay at work, whatever its transport: the dormant start, the
//! wake-ups (`NOTIFY`, the consumer's link, the poll), and each batch:
//! lock rows, publish through the session's [`Link`], write down what the
//! broker said. The transport runs the sessions
//! ([`Publish::sessions`](super::Publish::sessions)).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tracing::Instrument;

use super::said::{Envelope, Said};
use super::{CLEANUP_BATCH, CONTENDED_RETRY, LOCAL_LINGER, Link, Publish, Relay, RelayState};
use crate::backoff::Backoff;
use crate::outbox;
use crate::outbox::Publishing;
use crate::outbox::batch::{self, Batch, Failures, NOTIFY_CHANNEL, Row};
use crate::{Error, Result};
use tokio_util::sync::CancellationToken;

impl<T: Publish> Relay<T> {
    /// Publishes until the [`ShutdownHandle`](crate::consumer::ShutdownHandle) fires. A graceful shutdown
    /// finishes the batch in flight and what is pending, then returns; a
    /// [`shutdown_now`](crate::consumer::ShutdownHandle::shutdown_now) drops the batch in
    /// flight (its transaction rolls back: those rows are published again
    /// later, with the same ids). Broker and database losses are retried,
    /// not returned.
    ///
    /// # Errors
    /// [`Error::Config`] for an impossible configuration (a batch size or
    /// attempt count of zero, a confirm timeout not below the takeover
    /// time); the transport's refusal of what it must create at start (a
    /// JetStream stream).
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
        // A relay of its own (not a consumer's) says it is alive: the
        // dashboard and `idempo status` list it with the consumers.
        let beats = (!self.dormant).then(|| {
            let stop = CancellationToken::new();
            let task = tokio::spawn(super::heartbeat::beat_for_relay(
                self.pool.clone(),
                self.health.clone(),
                stop.clone(),
            ));
            (stop, task)
        });
        let result = T::sessions(&self, &run).await;
        self.set_state(RelayState::Stopped);
        if let Some((stop, task)) = beats {
            stop.cancel();
            let _ = task.await;
        }
        result
    }

    /// The name of the relay's connection to the broker.
    pub(crate) fn connection_name_or_default(&self) -> String {
        self.connection_name
            .clone()
            .unwrap_or_else(|| format!("idempo-relay:{}", std::process::id()))
    }

    /// How long the broker may take to confirm a batch.
    pub(crate) fn confirms_within(&self) -> Duration {
        self.confirm_timeout
    }
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
    /// The broker blocks the connection (a resource alarm): wait for it.
    blocked: Option<String>,
    /// A key waits: for another relay (soon) or for a retry (its time).
    retry_in: Option<Duration>,
}

/// The relay's state while it runs.
pub struct Running<'a, T: Publish> {
    relay: &'a Relay<T>,
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

impl<T: Publish> std::fmt::Debug for Running<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").finish_non_exhaustive()
    }
}

impl<'a, T: Publish> Running<'a, T> {
    fn new(relay: &'a Relay<T>) -> Self {
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

    /// Dormant until the consumer's handlers stage a message (the link is
    /// woken) or pending rows show up;
    /// `false` if shutdown came first.
    async fn wait_until_used(&self) -> bool {
        let stop = self.relay.shutdown.graceful_token();
        loop {
            let staged = self.relay.link.woken();
            match batch::any_pending(&self.relay.pool, T::NAME).await {
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

    /// One session with the broker, connected: publishes until shutdown
    /// (`Ok`) or a loss (`Err`, why). The transport closes it afterwards.
    pub(crate) async fn session<L: Link>(&self, link: &mut L) -> std::result::Result<(), String> {
        let relay = self.relay;
        relay.set_state(RelayState::Running);
        let publishing = Publishing::start(&relay.link);
        let outcome = self.publish_until_stopped(link).await;
        drop(publishing);
        self.set_blocked(None);
        outcome
    }

    /// Reports a lost session: its error in the health, the state
    /// reconnecting; logged at its level when `logged`.
    pub(crate) fn lost(&self, error: &str, logged: bool, note: &str) {
        if logged {
            tracing::warn!(%error, %note, "outbox relay: broker session lost; reconnecting");
        } else {
            tracing::debug!(%error, "outbox relay: reconnecting");
        }
        let error = error.to_owned();
        self.relay.health.update(|s| s.last_error = Some(error));
        self.relay.set_state(RelayState::Reconnecting);
    }

    /// Where the relay is: connecting to the broker.
    pub(crate) fn connecting(&self) {
        self.relay.set_state(RelayState::Connecting);
    }

    async fn publish_until_stopped<L: Link>(
        &self,
        broker: &mut L,
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
                if let Some(reason) = broker.blocked() {
                    self.wait_while_blocked(broker, reason).await;
                    if graceful.is_cancelled() {
                        return Ok(());
                    }
                }
                // Ready for a batch (AMQP: a channel the broker closed
                // over a row is opened again).
                broker.prepare().await?;
                let outcome = tokio::select! {
                    outcome = self.batch(broker) => outcome,
                    () = now.cancelled() => return Ok(()),
                };
                match outcome {
                    Ok(outcome) => {
                        database_backoff.reset();
                        self.refresh_status().await;
                        if let Some(lost) = outcome.broker_lost {
                            return Err(lost);
                        }
                        if outcome.blocked.is_some() {
                            continue;
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
                // The consumer committed what it staged without NOTIFY.
                () = relay.link.woken() => {
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

    /// Waits out a broker that blocks the connection (a memory or disk
    /// alarm: it reads no publish, confirms nothing): says so once in the
    /// log, in the health and in `idempo_broker_blocked`, and keeps the
    /// outbox gauges true meanwhile. Returns once unblocked, the connection
    /// lost, or on a graceful shutdown.
    async fn wait_while_blocked<L: Link>(&self, broker: &mut L, reason: String) {
        tracing::warn!(%reason, "outbox relay: the broker blocks publishing (a resource alarm); the outbox waits");
        self.set_blocked(Some(reason));
        let since = Instant::now();
        let graceful = self.relay.shutdown.graceful_token();
        loop {
            self.refresh_status().await;
            tokio::select! {
                () = broker.unblocked() => break,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = graceful.cancelled() => return,
            }
        }
        if broker.is_connected() {
            tracing::info!(waited = ?since.elapsed(), "outbox relay: the broker unblocked publishing");
        }
        self.set_blocked(None);
    }

    /// Reports the broker's block of the connection (`Some(reason)`) or its end.
    fn set_blocked(&self, reason: Option<String>) {
        metrics::gauge!("idempo_broker_blocked").set(if reason.is_some() { 1.0 } else { 0.0 });
        self.relay.health.update(|s| {
            match &reason {
                Some(why) => {
                    s.state = RelayState::Blocked;
                    s.last_error = Some(format!("the broker blocks publishing: {why}"));
                }
                None if s.state == RelayState::Blocked => s.state = RelayState::Running,
                None => {}
            }
            s.broker_blocked = reason;
        });
    }

    /// One batch, in one transaction.
    async fn batch<L: Link>(
        &self,
        broker: &mut L,
    ) -> std::result::Result<BatchOutcome, sqlx::Error> {
        let relay = self.relay;
        let parked: Vec<String> = {
            let mut parked = self.parked.lock().expect("not poisoned");
            let now = Instant::now();
            parked.retain(|_, until| *until > now);
            parked.keys().cloned().collect()
        };
        let mut batch = Batch::begin(&relay.pool, relay.takeover_after).await?;
        let mut rows: Vec<Row> = batch.lock_due(T::NAME, relay.batch_size, &parked).await?;
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
            batch.rollback().await?;
            return Ok(BatchOutcome {
                full: false,
                settled: 0,
                broker_lost: None,
                blocked: None,
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
            let (rows, blocked) = batch.first_of_each_key(rows).await?;
            let retry_in = self.park(blocked);
            let schedule = relay.schedule();
            let mut failures = Failures::default();
            let mut envelopes = Vec::with_capacity(rows.len());
            for row in rows {
                let (id, attempts, packed) = (row.id, row.attempts, row.packed.is_some());
                let first_id = row.message_id.clone();
                let key = row.ordering_key.clone();
                match row.unpack() {
                    Ok(messages) => envelopes.push(Envelope {
                        id,
                        attempts,
                        packed,
                        key,
                        messages,
                    }),
                    Err(why) => failures.push(
                        &schedule,
                        (id, attempts, &first_id),
                        format!("cannot read the packed row: {why}"),
                        true,
                    ),
                }
            }
            let mut said = broker.publish(&envelopes).await;
            let unknown = said
                .iter()
                .flatten()
                .find_map(Said::unknown)
                .map(str::to_owned);
            let (broker_lost, blocked) = match unknown {
                None => (None, None),
                Some(why) if !broker.is_connected() => (Some(why), None),
                Some(why) => match broker.blocked() {
                    Some(reason) => (None, Some(reason)),
                    // No answer in time on a live connection: the next
                    // batch goes on a new channel, so that nothing late on
                    // this one is credited to it.
                    None => match broker.after_unanswered().await {
                        Ok(()) => (None, None),
                        Err(e) => (Some(format!("{why}; {e}")), None),
                    },
                },
            };
            let mut confirmed = Vec::new();
            let mut unpacked = Vec::new();
            let mut published = 0;
            for (envelope, said) in envelopes.iter().zip(said.drain(..)) {
                if said.iter().any(|s| s.unknown().is_some()) {
                    // The broker may or may not hold some of it: the row
                    // stays pending and is published again.
                    continue;
                }
                // Per message: None confirmed, Some((error, certain)) refused.
                let mut refused: Vec<Option<(String, bool)>> = said
                    .into_iter()
                    .map(|s| match s {
                        Said::Refused { error, certain } => Some((error, certain)),
                        _ => None,
                    })
                    .collect();
                let accepted = refused.iter().filter(|r| r.is_none()).count();
                published += accepted;
                if accepted == refused.len() {
                    confirmed.push(envelope.id);
                } else if !envelope.packed {
                    let (error, certain) = refused.pop().flatten().expect("one refused message");
                    let m = &envelope.messages[0];
                    failures.push(
                        &schedule,
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
                                &schedule,
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
            let (deleted, given_up) = batch
                .settle(
                    &confirmed,
                    relay.keep_published.is_some(),
                    unpacked,
                    &mut failures,
                )
                .await?;
            self.deleted.fetch_add(deleted, Ordering::Relaxed);
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
                blocked,
                retry_in,
            })
        }
        .instrument(span)
        .await
    }

    /// Parks the keys whose first row waits for its retry until then; says
    /// when a held-back key is worth another look.
    fn park(&self, blocked: Vec<batch::Blocked>) -> Option<Duration> {
        let mut parked = self.parked.lock().expect("not poisoned");
        blocked
            .into_iter()
            .map(|(key, wait)| match wait {
                Some(delay) => {
                    parked.insert(key, Instant::now() + delay);
                    delay
                }
                // Held by another relay, which publishes it now.
                None => CONTENDED_RETRY,
            })
            .min()
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
        if let Ok(status) = outbox::OutboxStatus::read(&self.relay.pool).await {
            metrics::gauge!("idempo_outbox_pending").set(status.pending as f64);
            metrics::gauge!("idempo_outbox_failed").set(status.failed as f64);
            metrics::gauge!("idempo_outbox_oldest_pending_seconds")
                .set(status.oldest_pending_age.map_or(0.0, |d| d.as_secs_f64()));
            #[cfg(feature = "otel")]
            crate::otel::metrics::Relay::get()
                .outbox(status.pending.max(0) as u64, status.oldest_pending_age);
            self.relay.health.update(|s| s.outbox = status);
        }
    }

    /// Vacuums the outbox once many rows were deleted, if autovacuum is off:
    /// the table then stays as large as its backlog, not its history.
    async fn vacuum_if_nobody_does(&self) {
        if self.deleted.load(Ordering::Relaxed) < VACUUM_AFTER {
            return;
        }
        self.deleted.store(0, Ordering::Relaxed);
        if let Err(e) = batch::vacuum_if_autovacuum_is_off(&self.relay.pool).await {
            tracing::warn!(error = %e, "outbox relay: autovacuum is off and VACUUM outbox failed; the table keeps the space of deleted rows");
        }
    }

    /// Deletes kept published rows past their audit period, batch by batch.
    async fn cleanup(&self, keep: Duration) {
        loop {
            match outbox::delete_published_before(&self.relay.pool, keep, CLEANUP_BATCH).await {
                Ok(n) => {
                    self.deleted.fetch_add(n, Ordering::Relaxed);
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
