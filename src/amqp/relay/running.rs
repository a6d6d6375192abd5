//! A relay at work: its broker sessions (through the reconnect loop), the
//! wake-ups (`NOTIFY`, the consumer's link, the poll), and each batch:
//! lock rows, publish with confirms, write down what the broker said.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tracing::Instrument;

use super::broker_link::BrokerLink;
use super::frame::{broker_size_limit, frame};
use super::{CLEANUP_BATCH, CONTENDED_RETRY, LOCAL_LINGER, Publishing, Relay, RelayState};
use crate::amqp::fit;
use crate::amqp::publish::PublishError;
use crate::amqp::reconnect::{self, Reconnect, Session, Sessions};
use crate::backoff::Backoff;
use crate::outbox;
use crate::outbox::batch::{self, Batch, Failures, NOTIFY_CHANNEL, Row};
use crate::outbox::packed::Staged;
use crate::{Error, Result};

impl Relay {
    /// Publishes until the [`ShutdownHandle`](crate::amqp::ShutdownHandle) fires. A graceful shutdown
    /// finishes the batch in flight and what is pending, then returns; a
    /// [`shutdown_now`](crate::amqp::ShutdownHandle::shutdown_now) drops the batch in
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
        let mut run = Running::new(&self);
        if self.dormant && !run.wait_until_used().await {
            self.set_state(RelayState::Stopped);
            return Ok(());
        }
        let name = self
            .connection_name
            .clone()
            .unwrap_or_else(|| format!("idempo-relay:{}", std::process::id()));
        let mut link = Reconnect::new(self.broker.clone(), name, Duration::from_secs(30));
        if let Some(never) =
            reconnect::run(&mut run, &mut link, self.shutdown.graceful_token()).await
        {
            match never {}
        }
        self.set_state(RelayState::Stopped);
        Ok(())
    }
}

/// A picked row and what became of each of its messages.
struct Envelope {
    id: i64,
    attempts: i32,
    packed: bool,
    key: Option<String>,
    messages: Vec<Staged>,
}

/// What the broker said about one message of a batch.
enum Said {
    Confirmed,
    /// Refused because of the message itself (nacked, returned, a channel
    /// error over it, a header frame too large); `certain`: it can never
    /// go out (given up at once).
    Refused {
        error: String,
        certain: bool,
    },
    /// No answer that can be attributed: the broker may or may not hold it
    /// (the row stays pending and is published again, no attempt counted).
    Unknown(String),
}

impl Said {
    fn from_batch(result: std::result::Result<(), PublishError>) -> Said {
        match result {
            Ok(()) => Said::Confirmed,
            Err(e @ (PublishError::Nacked | PublishError::Returned(_))) => Said::Refused {
                error: e.to_string(),
                certain: false,
            },
            Err(e) => Said::Unknown(e.to_string()),
        }
    }

    fn unknown(&self) -> Option<&str> {
        match self {
            Said::Unknown(why) => Some(why),
            _ => None,
        }
    }
}

/// How much longer than the confirm timeout a publish may take before it is
/// dropped: `ConfirmChannel` closes a timed-out channel, and a blocked
/// connection never sends that close.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

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

    /// Dormant until the consumer's handlers stage a message (the link is
    /// woken) or pending rows show up;
    /// `false` if shutdown came first.
    async fn wait_until_used(&self) -> bool {
        let stop = self.relay.shutdown.graceful_token();
        loop {
            let staged = self.relay.link.wake.notified();
            match batch::any_pending(&self.relay.pool).await {
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
    async fn session_on(&self, link: &mut Reconnect) -> std::result::Result<(), String> {
        let relay = self.relay;
        let connection = link.connect().await.map_err(|e| e.to_string())?;
        let mut broker = BrokerLink::open(connection, relay.confirm_timeout).await?;
        relay.set_state(RelayState::Running);
        let publishing = Publishing::start(&relay.link);
        let outcome = self.publish_until_stopped(&mut broker).await;
        drop(publishing);
        self.set_blocked(None);
        broker.close().await;
        outcome
    }

    async fn publish_until_stopped(
        &self,
        broker: &mut BrokerLink,
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
                // A channel the broker closed over a row: a new one.
                broker.ensure_channel().await?;
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
                () = relay.link.wake.notified() => {
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
    async fn wait_while_blocked(&self, broker: &mut BrokerLink, reason: String) {
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
    async fn batch(
        &self,
        broker: &mut BrokerLink,
    ) -> std::result::Result<BatchOutcome, sqlx::Error> {
        let relay = self.relay;
        let parked: Vec<String> = {
            let mut parked = self.parked.lock().expect("not poisoned");
            let now = Instant::now();
            parked.retain(|_, until| *until > now);
            parked.keys().cloned().collect()
        };
        let mut batch = Batch::begin(&relay.pool, relay.takeover_after).await?;
        let mut rows: Vec<Row> = batch.lock_due(relay.batch_size, &parked).await?;
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
            let mut said = self.publish(broker, &envelopes).await;
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
                    None => match broker.replace_channel().await {
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

    /// Publishes the batch's messages with their confirms in flight
    /// together; then, if the channel failed under them on a live
    /// connection, the unanswered ones one at a time. Says what became of
    /// each message of each envelope.
    async fn publish(&self, broker: &mut BrokerLink, envelopes: &[Envelope]) -> Vec<Vec<Said>> {
        let relay = self.relay;
        let frame_max = broker.frame_max();
        let mut said: Vec<Vec<Said>> = Vec::with_capacity(envelopes.len());
        let mut sent = Vec::new();
        let mut frames = Vec::new();
        for (e, envelope) in envelopes.iter().enumerate() {
            let mut row = Vec::with_capacity(envelope.messages.len());
            for (i, message) in envelope.messages.iter().enumerate() {
                let frame = frame(message);
                // A header frame over frame_max closes the whole connection
                // (FRAME_ERROR): never sent.
                match fit::check(&frame.properties, frame_max) {
                    Ok(()) => {
                        sent.push((e, i));
                        frames.push(frame);
                        row.push(Said::Unknown(String::new()));
                    }
                    Err(fit::TooLarge { size, .. }) => row.push(Said::Refused {
                        error: format!(
                            "its properties and headers take {size} bytes, above the connection's \
                             frame_max of {frame_max} bytes (the broker would close the connection: FRAME_ERROR)"
                        ),
                        certain: true,
                    }),
                }
            }
            said.push(row);
        }
        if frames.is_empty() {
            return said;
        }
        let deadline = Instant::now() + relay.confirm_timeout;
        // Bounded here too: a timed-out channel is closed, and a blocked
        // connection never sends the close.
        let results = tokio::time::timeout(
            relay.confirm_timeout + CLOSE_GRACE,
            broker.channel().publish_all(frames),
        )
        .await;
        match results {
            Ok(results) => {
                for ((e, i), result) in sent.into_iter().zip(results) {
                    said[e][i] = Said::from_batch(result);
                }
            }
            Err(_) => {
                let why = format!("no publisher confirm within {:?}", relay.confirm_timeout);
                for (e, i) in sent {
                    said[e][i] = Said::Unknown(why.clone());
                }
            }
        }
        let unanswered = said.iter().flatten().any(|s| s.unknown().is_some());
        if unanswered && broker.is_connected() && broker.blocked().is_none() {
            self.isolate(broker, envelopes, &mut said, deadline).await;
        }
        said
    }

    /// After the channel failed under a batch on a live connection (the
    /// broker closes a channel over one message: `NOT_FOUND` for a missing
    /// exchange, `PRECONDITION_FAILED`), finds that message so that the
    /// error is its refusal (an attempt) and the others go out: the
    /// unanswered messages are published again on a new channel, those the
    /// broker's reason names (the missing exchange, a body over its size
    /// limit) one at a time first, the rest together, halved while a half
    /// keeps failing. A key with a refused message keeps its later ones for
    /// after its retry. Stops at `deadline` (the batch's rows stay locked
    /// meanwhile), or when the connection is lost or blocked: the rest stay
    /// unknown.
    async fn isolate(
        &self,
        broker: &mut BrokerLink,
        envelopes: &[Envelope],
        said: &mut [Vec<Said>],
        deadline: Instant,
    ) {
        let mut groups = VecDeque::new();
        let mut failed: Vec<(usize, usize)> = positions(said, |s| s.unknown().is_some());
        loop {
            if !failed.is_empty() {
                if !broker.is_connected()
                    || broker.blocked().is_some()
                    || broker.channel().is_usable()
                {
                    // Not a channel the broker closed over a message: no answer.
                    return;
                }
                let (e, i) = failed[0];
                let why = said[e][i].unknown().unwrap_or_default().to_owned();
                if let [(e, i)] = failed[..] {
                    // The one message the channel failed under.
                    let message = &envelopes[e].messages[i];
                    // A body over the broker's max_message_size never fits.
                    let certain =
                        broker_size_limit(&why).is_some_and(|limit| message.body.len() > limit);
                    said[e][i] = Said::Refused {
                        error: format!("the broker closed the channel over it: {why}"),
                        certain,
                    };
                } else {
                    let (named, others): (Vec<_>, Vec<_>) = failed
                        .drain(..)
                        .partition(|&(e, i)| named_by(&why, &envelopes[e].messages[i]));
                    if named.is_empty() {
                        let (first, second) = others.split_at(others.len() / 2);
                        groups.push_front(second.to_vec());
                        groups.push_front(first.to_vec());
                    } else {
                        groups.push_front(others);
                        for one in named.into_iter().rev() {
                            groups.push_front(vec![one]);
                        }
                    }
                }
            }
            let Some(group) = groups.pop_front() else {
                return;
            };
            if Instant::now() >= deadline
                || broker.blocked().is_some()
                || broker.ensure_channel().await.is_err()
            {
                return;
            }
            let group = publishable(envelopes, said, group);
            let frames = group
                .iter()
                .map(|&(e, i)| frame(&envelopes[e].messages[i]))
                .collect();
            let results = tokio::time::timeout_at(
                (deadline + CLOSE_GRACE).into(),
                broker.channel().publish_all(frames),
            )
            .await;
            let Ok(results) = results else { return };
            for (&(e, i), result) in group.iter().zip(results) {
                said[e][i] = Said::from_batch(result);
            }
            failed = group
                .into_iter()
                .filter(|&(e, i)| said[e][i].unknown().is_some())
                .collect();
        }
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

impl Sessions for Running<'_> {
    type Fatal = std::convert::Infallible;

    async fn session(&mut self, link: &mut Reconnect) -> Session<Self::Fatal> {
        self.relay.set_state(RelayState::Connecting);
        let started = Instant::now();
        match self.session_on(link).await {
            Ok(()) => Session::Stopped,
            Err(error) => Session::Lost {
                error,
                lasted: started.elapsed(),
            },
        }
    }

    async fn lost(&mut self, error: String, _lasted: Duration, _pause: Duration) {
        tracing::warn!(%error, "outbox relay: broker session lost; reconnecting");
        self.relay.health.update(|s| s.last_error = Some(error));
        self.relay.set_state(RelayState::Reconnecting);
    }
}

/// The (envelope, message) positions whose outcome satisfies `which`, in
/// batch order.
fn positions(said: &[Vec<Said>], which: impl Fn(&Said) -> bool) -> Vec<(usize, usize)> {
    said.iter()
        .enumerate()
        .flat_map(|(e, row)| row.iter().enumerate().map(move |(i, s)| (e, i, s)))
        .filter(|(_, _, s)| which(s))
        .map(|(e, i, _)| (e, i))
        .collect()
}

/// The messages of `group` that may go out now: not those of a key whose
/// earlier message was refused or is still unanswered outside the group
/// (the channel keeps the group's own order).
fn publishable(
    envelopes: &[Envelope],
    said: &[Vec<Said>],
    group: Vec<(usize, usize)>,
) -> Vec<(usize, usize)> {
    let mut kept = Vec::with_capacity(group.len());
    let mut in_group = HashSet::new();
    for (e, i) in group {
        let held = envelopes[e].key.as_deref().is_some_and(|key| {
            (0..e).any(|earlier| {
                envelopes[earlier].key.as_deref() == Some(key)
                    && said[earlier].iter().enumerate().any(|(j, s)| match s {
                        Said::Refused { .. } => true,
                        Said::Unknown(_) => !in_group.contains(&(earlier, j)),
                        Said::Confirmed => false,
                    })
            })
        });
        if !held {
            kept.push((e, i));
            in_group.insert((e, i));
        }
    }
    kept
}

/// Whether the broker's reason for closing the channel names `message`:
/// its exchange (`NOT_FOUND - no exchange 'x'`, `ACCESS_REFUSED`), or its
/// body's size (`message size .. is larger than configured max size ..`).
fn named_by(reason: &str, message: &Staged) -> bool {
    (!message.exchange.is_empty() && reason.contains(&format!("exchange '{}'", message.exchange)))
        || broker_size_limit(reason).is_some_and(|limit| message.body.len() > limit)
}
