//! The JetStream consumer's receiving side: connect (waiting while the
//! server is unreachable), check JetStream, the stream and the durable pull
//! consumer, then pull and hand the deliveries to the runtime; set the pull
//! up again when it ends.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, Context};

use super::connect;
use super::error::NatsError;
use super::feed::NatsFeed;
use super::transport::Nats;
use crate::Result;
use crate::backoff::Backoff;
use crate::runtime::dispatch::{Deliveries, FeedEnd};
use crate::runtime::health::{Health, RuntimeState};

/// How long a pull request waits on the server, and how often the server
/// says it is alive meanwhile (a missed heartbeat re-issues the pull).
const PULL_EXPIRES: Duration = Duration::from_secs(30);
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);

/// Receives the stream's deliveries until shutdown.
///
/// # Errors
/// A [`NatsError`](super::NatsError) before anything is consumed: the
/// server refuses the credentials, has no JetStream, or the stream or the
/// durable consumer conflicts with what the runtime needs.
impl Nats {
    pub(crate) async fn consume_stream(
        self: Arc<Self>,
        deliveries: &mut Deliveries<Nats>,
    ) -> Result<()> {
        let nats = self;
        let health = deliveries.health().clone();
        let Some(client) = connect::client(
            &nats.url,
            deliveries.consumer(),
            &health,
            deliveries.shutdown(),
        )
        .await?
        else {
            return Ok(());
        };
        let context = jetstream::new(client.clone());
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        // A JetStream that does not answer yet (a leader election) is waited
        // for; a conflict stops the start.
        let mut pull = loop {
            let ready = match connect::check_jetstream(&client, &nats.url).await {
                Ok(()) => nats.topology.ensure(&context).await,
                Err(e) => Err(e),
            };
            match ready {
                Ok(pull) => break pull,
                Err(e @ NatsError::Unavailable { .. }) => {
                    lost(&health, e.to_string());
                    tokio::select! {
                        () = deliveries.stopping() => return Ok(()),
                        () = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                }
                Err(e) => return Err(e.into()),
            }
        };
        backoff.reset();
        loop {
            let messages = pull
                .stream()
                // Twice what may be unacknowledged: the request stays open
                // while acks free room, instead of ending at each batch.
                .max_messages_per_batch((nats.topology.max_ack_pending as usize * 2).max(200))
                .expires(PULL_EXPIRES)
                .heartbeat(PULL_HEARTBEAT)
                .messages()
                .await;
            match messages {
                Ok(messages) => {
                    health.set_state(RuntimeState::Consuming);
                    tracing::info!(
                        consumer = %deliveries.consumer(),
                        stream = %nats.topology.stream,
                        subject = %nats.topology.subject,
                        "consuming"
                    );
                    backoff.reset();
                    let mut feed = NatsFeed::new(messages, health.clone(), nats.topology.ack_wait);
                    match deliveries.dispatch(&mut feed).await {
                        FeedEnd::Lost { error, .. } => lost(&health, error),
                        _ => {
                            // Stop pulling; the units in flight finish and are
                            // acknowledged before the consumer returns.
                            health.set_state(RuntimeState::Stopping);
                            deliveries.drain().await;
                            return Ok(());
                        }
                    }
                }
                Err(e) => lost(&health, format!("cannot pull from JetStream: {e}")),
            }
            health.set_state(RuntimeState::Reconnecting);
            tokio::select! {
                () = deliveries.stopping() => return Ok(()),
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
            match again(&nats, &context).await {
                Ok(again) => pull = again,
                Err(e) => lost(&health, format!("cannot set up the consumer again: {e}")),
            }
        }
    }
}

/// The stream and the durable consumer, checked and created again after
/// the pull ended (the consumer or the stream deleted, the server gone for
/// long).
async fn again(nats: &Nats, context: &Context) -> Result<PullConsumer> {
    Ok(nats.topology.ensure(context).await?)
}

fn lost(health: &Health, error: String) {
    tracing::warn!(%error);
    health.record_error(error);
}
