//! The outbox relay's JetStream side ([`Relay`](crate::nats::Relay) is the
//! relay on [`Nats`]): its session (the client reconnects by itself), the
//! streams it creates, and a batch published with each message's
//! `Nats-Msg-Id` set to its stable id, the PubAcks awaited together.
//!
//! A relay that dies between the publish and the delete publishes the row
//! again: JetStream's duplicate window drops the second copy (its PubAck
//! says `duplicate`), so the window must cover the relay's restart (the
//! stream's `duplicate_window`, 2 minutes by default); a copy after the
//! window is still claimed as a duplicate by the consumer's inbox.

use std::collections::HashSet;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, Context};
use sqlx::PgPool;

use super::connect;
use super::envelope::MSG_ID_HEADER;
use super::error::NatsError;
use super::topology::Topology;
use super::transport::Nats;
use crate::Result;
use crate::backoff::Backoff;
use crate::outbox::packed::Staged;
use crate::relay::running::Running;
use crate::relay::said::{Envelope, Said};
use crate::relay::{Link, Publish, Relay};
use crate::runtime::header_names::REPLAY_HISTORY_HEADER;
use crate::runtime::health::Health;

/// Where the JetStream relay publishes.
#[derive(Debug)]
pub struct NatsTarget {
    url: String,
    /// Streams created at start when missing (subject = name).
    streams: Vec<String>,
    /// The duplicate window of the streams it creates.
    duplicate_window: Option<Duration>,
}

impl crate::relay::publish_sealed::Sealed for Nats {}

impl Publish for Nats {
    type Target = NatsTarget;
    const NAME: &'static str = <Nats as crate::runtime::transport::Transport>::NAME;

    async fn sessions(relay: &Relay<Nats>, running: &Running<'_, Nats>) -> Result<()> {
        let target = &relay.target;
        running.connecting();
        // The client's own health (its connection events); the relay's is
        // in `running`.
        let client_health = Health::default();
        let name = relay.connection_name_or_default();
        let Some(client) =
            connect::client(&target.url, &name, &client_health, &relay.shutdown).await?
        else {
            return Ok(());
        };
        let context = jetstream::new(client.clone());
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        // A JetStream that does not answer yet (a cluster without a leader)
        // is waited for, as by the consumer.
        loop {
            match ready(&client, &context, target).await {
                Ok(()) => break,
                Err(e @ NatsError::Unavailable { .. }) => {
                    running.lost(&e.to_string(), true, "asking JetStream again");
                    tokio::select! {
                        () = tokio::time::sleep(backoff.next_delay()) => {}
                        () = relay.shutdown.graceful_token().cancelled() => return Ok(()),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        backoff.reset();
        let mut link = NatsLink {
            context,
            confirm_timeout: relay.confirms_within(),
        };
        loop {
            match running.session(&mut link).await {
                Ok(()) => return Ok(()),
                Err(error) => {
                    running.lost(&error, true, "the NATS client reconnects by itself");
                    tokio::select! {
                        () = tokio::time::sleep(backoff.next_delay()) => {}
                        () = relay.shutdown.graceful_token().cancelled() => return Ok(()),
                    }
                }
            }
        }
    }
}

/// JetStream answers, and the relay's streams exist.
async fn ready(
    client: &async_nats::Client,
    context: &Context,
    target: &NatsTarget,
) -> std::result::Result<(), NatsError> {
    connect::check_jetstream(client, &target.url).await?;
    for stream in &target.streams {
        Topology::create_stream_if_missing(context, stream, target.duplicate_window).await?;
    }
    Ok(())
}

impl Relay<Nats> {
    /// A relay of the outbox in `pool` to the NATS server at `nats_url`: it
    /// publishes the messages staged for the `nats` transport (by a
    /// JetStream consumer's handlers, or anywhere with
    /// [`OutboxMessage::transport`](crate::outbox::OutboxMessage::transport)`("nats")`),
    /// on the subject named by each one's routing key.
    ///
    /// ```no_run
    /// # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
    /// idempo::nats::Relay::new("nats://127.0.0.1:4222", pool)
    ///     .create_stream("shipments")
    ///     .run()
    ///     .await
    /// # }
    /// ```
    pub fn new(nats_url: impl Into<String>, pool: PgPool) -> Self {
        Self::with_target(
            NatsTarget {
                url: nats_url.into(),
                streams: Vec::new(),
                duplicate_window: None,
            },
            pool,
        )
    }

    /// Creates the stream `name` (taking the subject `name`) at start when
    /// it is missing, so that the first publishes find it.
    #[must_use]
    pub fn create_stream(mut self, name: impl Into<String>) -> Self {
        self.target.streams.push(name.into());
        self
    }

    /// The duplicate window of the streams it creates (JetStream's default,
    /// 2 minutes, when unset): keep it longer than a relay takes to restart.
    #[must_use]
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.target.duplicate_window = Some(window);
        self
    }
}

/// The relay's JetStream session.
struct NatsLink {
    context: Context,
    confirm_timeout: Duration,
}

impl Link for NatsLink {
    /// Rows of one ordering key go out one after another, each once the one
    /// before it was confirmed: a refused or unanswered row holds the rest of
    /// its key (they stay pending, no attempt counted), as on RabbitMQ.
    /// Rows without a key, and the first row of each key, go out together.
    async fn publish(&mut self, envelopes: &[Envelope]) -> Vec<Vec<Said>> {
        let mut said: Vec<Vec<Said>> = envelopes
            .iter()
            .map(|e| {
                e.messages
                    .iter()
                    .map(|_| Said::Unknown(HELD.into()))
                    .collect()
            })
            .collect();
        let mut waiting: Vec<usize> = (0..envelopes.len()).collect();
        let mut held: HashSet<&str> = HashSet::new();
        while !waiting.is_empty() {
            let mut wave = Vec::new();
            let mut later = Vec::new();
            let mut in_wave: HashSet<&str> = HashSet::new();
            for e in waiting {
                match envelopes[e].key.as_deref() {
                    Some(key) if held.contains(key) => {}
                    Some(key) if !in_wave.insert(key) => later.push(e),
                    _ => wave.push(e),
                }
            }
            if !self.publish_wave(envelopes, &wave, &mut said).await {
                // No answer in time: what is left stays pending.
                break;
            }
            for &e in &wave {
                if let Some(key) = envelopes[e].key.as_deref()
                    && !said[e].iter().all(|s| matches!(s, Said::Confirmed))
                {
                    held.insert(key);
                }
            }
            waiting = later;
        }
        said
    }
}

/// What a message held behind an earlier one of its ordering key is told.
const HELD: &str = "held behind an unconfirmed earlier message of its ordering key";

impl NatsLink {
    /// Publishes the rows `wave` of `envelopes` and awaits their PubAcks
    /// together, writing what JetStream said into `said`; false when the
    /// PubAcks did not come within the confirm timeout.
    async fn publish_wave(
        &mut self,
        envelopes: &[Envelope],
        wave: &[usize],
        said: &mut [Vec<Said>],
    ) -> bool {
        let mut acks = Vec::new();
        for &e in wave {
            let envelope = &envelopes[e];
            for (i, message) in envelope.messages.iter().enumerate() {
                if !message.exchange.is_empty() {
                    said[e][i] = Said::Refused {
                        error: format!(
                            "message {:?} names the exchange {:?}: on NATS the routing key is the subject",
                            message.message_id, message.exchange
                        ),
                        certain: true,
                    };
                    continue;
                }
                let sent = self
                    .context
                    .publish_with_headers(
                        message.routing_key.clone(),
                        headers(envelope.id, message),
                        message.body.clone().into(),
                    )
                    .await;
                match sent {
                    Ok(ack) => {
                        acks.push(((e, i), ack));
                        said[e][i] = Said::Unknown(String::new());
                    }
                    // Not sent, or unknown whether: published again later.
                    Err(error) => {
                        said[e][i] =
                            Said::Unknown(format!("publish to {:?}: {error}", message.routing_key));
                    }
                }
            }
        }
        // IntoFuture only: awaited together through their futures.
        let (positions, acks): (Vec<_>, Vec<_>) = acks.into_iter().unzip();
        let acks = acks.into_iter().map(std::future::IntoFuture::into_future);
        let answered =
            tokio::time::timeout(self.confirm_timeout, futures::future::join_all(acks)).await;
        let Ok(answered) = answered else {
            let why = format!("no PubAck within {:?}", self.confirm_timeout);
            for (e, i) in positions {
                said[e][i] = Said::Unknown(why.clone());
            }
            return false;
        };
        for ((e, i), ack) in positions.into_iter().zip(answered) {
            let subject = &envelopes[e].messages[i].routing_key;
            said[e][i] = match ack {
                Ok(_) => Said::Confirmed,
                // JetStream answered and refused it (no stream takes the
                // subject, a limit): an attempt, retried with backoff.
                Err(error) if error.kind() == jetstream::context::PublishErrorKind::TimedOut => {
                    Said::Unknown(format!("no PubAck for {subject:?}: {error}"))
                }
                Err(error) => Said::Refused {
                    error: format!("JetStream refused {subject:?}: {error}"),
                    certain: false,
                },
            };
        }
        true
    }
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
