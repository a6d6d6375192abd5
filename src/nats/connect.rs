//! The NATS connection: made with backoff while the server is unreachable,
//! refused at once when the server refuses it for good, reported in
//! [`Health`] as the client loses and regains it (it reconnects by itself),
//! and checked for JetStream before anything else.

use std::time::Duration;

use async_nats::{Client, ConnectErrorKind, ConnectOptions, Event, RequestErrorKind};

use super::error::NatsError;
use crate::backoff::Backoff;
use crate::redact::redact_url;
use crate::runtime::health::{Health, RuntimeState};
use crate::runtime::shutdown::ShutdownHandle;

/// How long one connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A connected client, or `None` when shutdown came first.
pub(crate) async fn client(
    url: &str,
    consumer: &str,
    health: &Health,
    shutdown: &ShutdownHandle,
) -> Result<Option<Client>, NatsError> {
    let shown = redact_url(url);
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        let events = health.clone();
        let options = ConnectOptions::new()
            .name(crate::host::connection_name(consumer))
            .connection_timeout(CONNECT_TIMEOUT)
            // Reconnect forever: a consumer outlives its server's restarts.
            .max_reconnects(None)
            .event_callback(move |event| {
                let health = events.clone();
                async move { on_event(&health, event) }
            });
        let error = match options.connect(servers(url)).await {
            Ok(client) => return Ok(Some(client)),
            Err(e) => e,
        };
        if matches!(
            error.kind(),
            ConnectErrorKind::Authentication
                | ConnectErrorKind::AuthorizationViolation
                | ConnectErrorKind::Tls
                | ConnectErrorKind::ServerParse
        ) {
            return Err(NatsError::Refused {
                url: shown,
                reason: error.to_string(),
            });
        }
        let why = format!(
            "cannot reach NATS at {shown}: {error}; retrying (start the server with: \
             nats-server -js)"
        );
        tracing::warn!("{why}");
        health.record_error(why);
        tokio::select! {
            () = shutdown.graceful_token().cancelled() => return Ok(None),
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

/// The servers of `url`: one URL, or several separated by commas (one per
/// node of a cluster; the client picks among them and fails over).
pub(crate) fn servers(url: &str) -> Vec<&str> {
    url.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

fn on_event(health: &Health, event: Event) {
    match event {
        Event::Disconnected => {
            tracing::warn!("NATS connection lost; the client reconnects");
            health.record_reconnect();
            health.set_state(RuntimeState::Reconnecting);
        }
        Event::Connected => {
            tracing::info!("NATS connection (re)established");
            // Back to consuming after a loss; the first connection is not
            // consuming yet (the stream and the durable are set up first).
            if health.snapshot().state == RuntimeState::Reconnecting {
                health.set_state(RuntimeState::Consuming);
            }
        }
        other => tracing::debug!(event = %other, "NATS"),
    }
}

/// Fails when the server has no JetStream (or not for this account). Asks
/// `$JS.API.INFO` itself: async-nats's typed account query fails to parse
/// some servers' answers (2.9's), which would hide the real cause.
pub(crate) async fn check_jetstream(client: &Client, url: &str) -> Result<(), NatsError> {
    let no_jetstream = |reason: String| NatsError::NoJetStream {
        url: redact_url(url),
        reason,
    };
    let answer = tokio::time::timeout(
        CONNECT_TIMEOUT,
        client.request("$JS.API.INFO", Default::default()),
    )
    .await
    // A server without JetStream says so at once (no responders); silence
    // is a cluster without a leader, or a server busy: waited out.
    .map_err(|_| NatsError::Unavailable {
        action: "the account's JetStream information".into(),
        reason: "no answer to $JS.API.INFO".into(),
    })?
    .map_err(|e| match e.kind() {
        RequestErrorKind::NoResponders => no_jetstream("no responders to $JS.API.INFO".into()),
        RequestErrorKind::TimedOut => NatsError::Unavailable {
            action: "the account's JetStream information".into(),
            reason: e.to_string(),
        },
        _ => NatsError::Api {
            action: "the account's JetStream information".into(),
            reason: e.to_string(),
        },
    })?;
    let info: serde_json::Value = serde_json::from_slice(&answer.payload).unwrap_or_default();
    match info.get("error") {
        Some(error) => Err(no_jetstream(
            error["description"]
                .as_str()
                .unwrap_or("refused")
                .to_owned(),
        )),
        None => Ok(()),
    }
}
