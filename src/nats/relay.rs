//! [`Relay`]: publishes the [outbox](crate::outbox)'s committed rows to
//! JetStream, each with `Nats-Msg-Id` set to the row's stable message id,
//! and deletes a row only after JetStream's PubAck.
//!
//! A relay that dies between the publish and the delete publishes the row
//! again: JetStream's duplicate window drops the second copy (its PubAck
//! says `duplicate`), so the window must cover the relay's retry horizon
//! (the stream's `duplicate_window`, 2 minutes by default, longer than a
//! relay's restart); a copy after the window is still claimed as a
//! duplicate by the consumer's inbox. The outbox's SQL is the AMQP relay's
//! (`outbox::batch`): rows are locked `FOR UPDATE SKIP LOCKED`, the first
//! of each ordering key only, so relays share a table safely.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, Context};
use sqlx::PgPool;

use super::connect;
use super::envelope::MSG_ID_HEADER;
use super::topology::Topology;
use crate::Result;
use crate::backoff::Backoff;
use crate::outbox::batch::{Batch, Failures, RetrySchedule};
use crate::outbox::packed::Staged;
use crate::outbox::{Publishing, RelayLink};
use crate::runtime::headers::REPLAY_HISTORY_HEADER;
use crate::runtime::health::Health;
use crate::runtime::shutdown::ShutdownHandle;

/// How long an idle relay waits before it looks at the outbox again.
const IDLE: Duration = Duration::from_millis(100);

/// The outbox relay to JetStream: the staged message's routing key is the
/// subject it is published on. It publishes the messages staged for the
/// `nats` transport: those a JetStream consumer's handlers stage, and those
/// staged elsewhere with [`OutboxMessage::transport`](crate::outbox::OutboxMessage::transport)`("nats")`.
///
/// ```no_run
/// # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
/// idempo::nats::Relay::new("nats://127.0.0.1:4222", pool)
///     .create_stream("shipments")
///     .run()
///     .await
/// # }
/// ```
#[derive(Debug)]
pub struct Relay {
    url: String,
    pool: PgPool,
    batch_size: usize,
    streams: Vec<String>,
    schedule: RetrySchedule,
    takeover_after: Duration,
    duplicate_window: Option<Duration>,
    /// The consumer's link: woken after its commits that staged.
    link: Option<RelayLink>,
    shutdown: ShutdownHandle,
    health: Health,
}

impl Relay {
    /// A relay of the outbox in `pool` to the NATS server at `nats_url`.
    pub fn new(nats_url: impl Into<String>, pool: PgPool) -> Relay {
        Relay {
            url: nats_url.into(),
            pool,
            batch_size: 100,
            streams: Vec::new(),
            schedule: RetrySchedule {
                max_attempts: 10,
                min: Duration::from_secs(1),
                max: Duration::from_secs(300),
            },
            takeover_after: Duration::from_secs(15),
            duplicate_window: None,
            link: None,
            shutdown: ShutdownHandle::default(),
            health: Health::default(),
        }
    }

    /// Messages per batch (one transaction, PubAcks awaited together).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// Creates the stream `name` (taking the subject `name`) at start when
    /// it is missing, so that the first publishes find it.
    pub fn create_stream(mut self, name: impl Into<String>) -> Self {
        self.streams.push(name.into());
        self
    }

    /// The duplicate window of the streams it creates (JetStream's default,
    /// 2 minutes, when unset): keep it longer than a relay takes to restart.
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = Some(window);
        self
    }

    /// The relay a consumer runs: woken through `link` after a commit that
    /// staged, instead of at its next look.
    pub(crate) fn woken_by(mut self, link: RelayLink) -> Self {
        self.link = Some(link);
        self
    }

    /// Attempts before a message JetStream refuses is given up (marked
    /// failed in the outbox): 10.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.schedule.max_attempts = attempts.max(1);
        self
    }

    /// A handle that stops the relay after its current batch.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Publishes until the [`ShutdownHandle`] fires; a graceful shutdown
    /// publishes what is pending first.
    ///
    /// # Errors
    /// A [`NatsError`](super::NatsError) at start: the server refuses the
    /// connection, has no JetStream, or a stream to create is refused.
    pub async fn run(self) -> Result<()> {
        let name = "relay";
        let Some(client) = connect::client(&self.url, name, &self.health, &self.shutdown).await?
        else {
            return Ok(());
        };
        connect::check_jetstream(&client, &self.url).await?;
        let context = jetstream::new(client);
        for stream in &self.streams {
            Topology::create_stream_if_missing(&context, stream, self.duplicate_window).await?;
        }
        let stop = self.shutdown.graceful_token().clone();
        let _publishing = self.link.as_ref().map(Publishing::start);
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        loop {
            let wait = match self.batch(&context).await {
                Ok(0) => IDLE,
                Ok(_) => {
                    backoff.reset();
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "outbox relay: the database failed the batch");
                    backoff.next_delay()
                }
            };
            // A graceful stop publishes what is pending first (the
            // drained handlers' last forwards): it returns once a batch
            // found nothing, or failed.
            if stop.is_cancelled() || self.shutdown.now_token().is_cancelled() {
                return Ok(());
            }
            let woken = async {
                match &self.link {
                    Some(link) => link.woken().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep(wait) => {}
                // The consumer committed what its handlers staged.
                () = woken => {}
            }
        }
    }

    /// One batch: lock the due rows, publish their messages, wait for the
    /// PubAcks, delete the published rows and record the refusals.
    async fn batch(&self, context: &Context) -> std::result::Result<usize, sqlx::Error> {
        let mut batch = Batch::begin(&self.pool, self.takeover_after).await?;
        let rows = batch
            .lock_due(super::TRANSPORT, self.batch_size, &[])
            .await?;
        if rows.is_empty() {
            batch.rollback().await?;
            return Ok(0);
        }
        let (rows, _held_back) = batch.first_of_each_key(rows).await?;
        let mut failures = Failures::default();
        let mut confirmed = Vec::with_capacity(rows.len());
        let mut settled = 0;
        for row in rows {
            let (id, attempts, first_id) = (row.id, row.attempts, row.message_id.clone());
            let messages = match row.unpack() {
                Ok(messages) => messages,
                Err(why) => {
                    let error = format!("cannot read the packed row: {why}");
                    failures.push(&self.schedule, (id, attempts, &first_id), error, true);
                    continue;
                }
            };
            settled += messages.len();
            // A packed row is published whole again after any refusal: the
            // copies JetStream already took are dropped as duplicates.
            match publish_all(context, id, &messages).await {
                Ok(()) => confirmed.push(id),
                Err(error) => {
                    failures.push(&self.schedule, (id, attempts, &first_id), error, false);
                }
            }
        }
        batch
            .settle(&confirmed, false, Vec::new(), &mut failures)
            .await?;
        Ok(settled)
    }
}

/// Publishes every message of the outbox row `row` and waits for each
/// PubAck.
async fn publish_all(
    context: &Context,
    row: i64,
    messages: &[Staged],
) -> std::result::Result<(), String> {
    let mut acks = Vec::with_capacity(messages.len());
    for message in messages {
        if !message.exchange.is_empty() {
            return Err(format!(
                "message {:?} names the exchange {:?}: on NATS the routing key is the subject",
                message.message_id, message.exchange
            ));
        }
        let ack = context
            .publish_with_headers(
                message.routing_key.clone(),
                headers(row, message),
                message.body.clone().into(),
            )
            .await
            .map_err(|e| format!("publish to {:?}: {e}", message.routing_key))?;
        acks.push(ack);
    }
    // IntoFuture only: awaited together through their futures.
    let acks = acks.into_iter().map(std::future::IntoFuture::into_future);
    for (ack, message) in futures::future::join_all(acks)
        .await
        .into_iter()
        .zip(messages)
    {
        ack.map_err(|e| format!("no PubAck for {:?}: {e}", message.routing_key))?;
    }
    Ok(())
}

/// The message's NATS headers: its exact properties' headers (a replayed
/// letter's) or its staged JSON headers, as text, its content type, and
/// `Nats-Msg-Id`: its stable id, or for a replay, that id and the outbox
/// row, so that JetStream's window, which may still hold the original's id,
/// does not drop the replay (the consumer claims the replay on the sealed
/// id it carries).
fn headers(row: i64, message: &Staged) -> HeaderMap {
    let mut texts: Vec<(String, String)> = Vec::new();
    let exact = message
        .exact
        .as_deref()
        .and_then(|e| crate::properties::Properties::decode(e).ok());
    match &exact {
        Some(exact) => {
            for (name, value) in exact.headers.iter().flatten() {
                if let Some(text) = value.text() {
                    texts.push((name.clone(), text));
                }
            }
        }
        None => {
            if let Ok(serde_json::Value::Object(headers)) = serde_json::from_str(&message.headers) {
                for (name, value) in headers {
                    let text = match value {
                        serde_json::Value::String(s) => s,
                        serde_json::Value::Number(n) => n.to_string(),
                        serde_json::Value::Bool(b) => b.to_string(),
                        _ => continue,
                    };
                    texts.push((name, text));
                }
            }
        }
    }
    let mut map = HeaderMap::new();
    let mut replay = false;
    for (name, text) in &texts {
        // A value NATS cannot carry in a header (a line break) is left out.
        if text.contains(['\r', '\n']) {
            continue;
        }
        replay |= name == REPLAY_HISTORY_HEADER;
        if name != MSG_ID_HEADER {
            map.append(name.as_str(), text.as_str());
        }
    }
    if let Some(content_type) = &message.content_type {
        map.insert("Content-Type", content_type.as_str());
    }
    let id = if replay {
        format!("{}:replay:{row}", message.message_id)
    } else {
        message.message_id.clone()
    };
    map.insert(MSG_ID_HEADER, id.as_str());
    map
}
