//! The outbox relay a consumer runs beside itself (feature `outbox`): the
//! transport starts it ([`Transport::relay`](super::transport::Transport::relay)),
//! the runtime mirrors its state in the consumer's health and stops it after
//! the handlers drained, so that what they staged goes out.

use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;

use super::health::{Health, RelayState};
use super::shutdown::ShutdownHandle;
use crate::outbox::RelayLink;

/// What a transport's relay needs from the consumer it runs beside.
#[derive(Debug)]
pub struct RelayContext<'a> {
    pub(crate) pool: &'a PgPool,
    pub(crate) consumer: &'a str,
    /// Woken after a commit that staged; tells staging whether it publishes.
    pub(crate) link: &'a RelayLink,
    /// The consumer's health, where the relay's state is mirrored.
    pub(crate) health: &'a Health,
}

/// A relay's reports of its state, and how to read a state out of one.
pub(crate) type States<S> = (tokio::sync::watch::Receiver<S>, fn(&S) -> RelayState);

/// A relay running beside a consumer, started by its transport.
#[derive(Debug)]
pub struct RelayTask {
    stop: ShutdownHandle,
    task: tokio::task::JoinHandle<()>,
}

impl RelayTask {
    /// Runs `run` (a relay stopped by `stop`) with its state mirrored in the
    /// consumer's `health`: read with `state` from `states` when the relay
    /// reports them, else running until it returns.
    pub(crate) fn start<S: Send + Sync + 'static>(
        stop: ShutdownHandle,
        run: impl Future<Output = crate::Result<()>> + Send + 'static,
        states: Option<States<S>>,
        health: &Health,
    ) -> RelayTask {
        let mirror = health.clone();
        let task = tokio::spawn(async move {
            let forward = async {
                let Some((mut states, state_of)) = states else {
                    mirror.update(|s| s.relay = Some(RelayState::Running));
                    return std::future::pending().await;
                };
                loop {
                    let state = state_of(&states.borrow_and_update());
                    if mirror.snapshot().relay != Some(state) {
                        mirror.update(|s| s.relay = Some(state));
                    }
                    if states.changed().await.is_err() {
                        return std::future::pending().await;
                    }
                }
            };
            tokio::select! {
                done = run => {
                    if let Err(e) = done {
                        tracing::error!(error = %e, "the consumer's outbox relay stopped");
                    }
                }
                () = forward => {}
            }
            mirror.update(|s| s.relay = Some(RelayState::Stopped));
        });
        RelayTask { stop, task }
    }

    /// Stops the relay: what the drained handlers staged is published
    /// first, within `timeout`; past it, left pending for the next relay.
    pub(crate) async fn stop(self, timeout: Duration) {
        let RelayTask { stop, mut task } = self;
        stop.shutdown();
        if tokio::time::timeout(timeout, &mut task).await.is_err() {
            stop.shutdown_now();
            let _ = task.await;
        }
    }
}
