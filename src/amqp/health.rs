//! What the host can read about a running consumer: [`Health`].

use std::sync::Arc;

use tokio::sync::watch;

/// Where the runtime is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RuntimeState {
    /// Built, not yet running.
    Idle,
    /// Connecting to the broker (first time or after a loss).
    Connecting,
    /// Subscribed and processing deliveries.
    Consuming,
    /// The connection or subscription was lost; waiting before reconnecting.
    Reconnecting,
    /// Shutting down: no new deliveries, handlers in flight finishing.
    Stopping,
    /// `run` returned.
    Stopped,
}

/// A snapshot of a consumer's health.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HealthSnapshot {
    /// Where the runtime is.
    pub state: RuntimeState,
    /// Whether the database answered the last time it was used or probed.
    pub database_available: bool,
    /// The last error the runtime met (connection loss, consumer cancel,
    /// database outage), if any.
    pub last_error: Option<String>,
    /// How many times the runtime reconnected to the broker.
    pub reconnects: u64,
    /// Broker sessions in a row that a delivery the AMQP client cannot parse
    /// ended (a property that is not valid UTF-8) without the runtime moving
    /// it to the DLQ: the queue is stuck behind it until someone removes it.
    pub wedged_sessions: u32,
    /// The state of the outbox relay the consumer runs (`None` without one).
    #[cfg(feature = "outbox")]
    pub relay: Option<super::RelayState>,
}

impl HealthSnapshot {
    /// Connected to the broker and consuming (`state == Consuming`).
    pub fn is_consuming(&self) -> bool {
        self.state == RuntimeState::Consuming
    }

    /// Consuming, the database reachable, and no delivery wedging the
    /// queue: the consumer is doing its job.
    pub fn is_healthy(&self) -> bool {
        self.is_consuming() && self.database_available && self.wedged_sessions < 3
    }
}

/// Live health of a consumer, for readiness probes and dashboards. Cheap to
/// clone; all clones see the same state.
#[derive(Debug, Clone)]
pub struct Health {
    inner: Arc<watch::Sender<HealthSnapshot>>,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            inner: Arc::new(watch::Sender::new(HealthSnapshot {
                state: RuntimeState::Idle,
                database_available: true,
                last_error: None,
                reconnects: 0,
                wedged_sessions: 0,
                #[cfg(feature = "outbox")]
                relay: None,
            })),
        }
    }
}

impl Health {
    /// The current state.
    pub fn snapshot(&self) -> HealthSnapshot {
        self.inner.borrow().clone()
    }

    /// Waits until `condition` holds for the state, and returns that state.
    pub async fn wait_for(
        &self,
        mut condition: impl FnMut(&HealthSnapshot) -> bool,
    ) -> HealthSnapshot {
        let mut rx = self.inner.subscribe();
        let state = rx
            .wait_for(|s| condition(s))
            .await
            .expect("the sender lives as long as self");
        state.clone()
    }

    pub(crate) fn set_state(&self, state: RuntimeState) {
        self.inner.send_modify(|s| s.state = state);
    }

    pub(crate) fn record_error(&self, error: String) {
        self.inner.send_modify(|s| s.last_error = Some(error));
    }

    pub(crate) fn set_wedged_sessions(&self, n: u32) {
        self.inner.send_modify(|s| s.wedged_sessions = n);
    }

    pub(crate) fn record_reconnect(&self) {
        self.inner.send_modify(|s| s.reconnects += 1);
    }

    #[cfg(feature = "outbox")]
    pub(crate) fn set_relay(&self, relay: Option<super::RelayState>) {
        self.inner.send_modify(|s| s.relay = relay);
    }

    pub(crate) fn set_database(&self, available: bool, error: Option<String>) {
        self.inner.send_modify(|s| {
            s.database_available = available;
            if error.is_some() {
                s.last_error = error;
            }
        });
    }
}
