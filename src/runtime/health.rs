//! What the host can read about a running consumer: [`Health`].

use crate::runtime::watched::Watched;

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
    pub relay: Option<RelayState>,
}

#[cfg(feature = "outbox")]
/// Where a relay is in its life (the relay's, kept here because a
/// consumer's health reports the state of the relay it runs).
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
    /// Connected, but the broker blocks publishing (`connection.blocked`: a
    /// memory or disk alarm): rows wait, nothing is retried or failed
    /// ([`RelaySnapshot::broker_blocked`](crate::relay::RelaySnapshot::broker_blocked)
    /// says why).
    Blocked,
    /// The broker connection was lost; waiting before reconnecting.
    Reconnecting,
    /// `run` returned.
    Stopped,
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

/// Live health of a consumer, for readiness probes and dashboards:
/// [`snapshot`](Watched::snapshot) and [`wait_for`](Watched::wait_for).
/// Cheap to clone; all clones see the same state.
pub type Health = Watched<HealthSnapshot>;

impl Default for Health {
    fn default() -> Self {
        Watched::new(HealthSnapshot {
            state: RuntimeState::Idle,
            database_available: true,
            last_error: None,
            reconnects: 0,
            wedged_sessions: 0,
            #[cfg(feature = "outbox")]
            relay: None,
        })
    }
}

impl Health {
    pub(crate) fn set_state(&self, state: RuntimeState) {
        self.update(|s| s.state = state);
    }

    pub(crate) fn record_error(&self, error: String) {
        self.update(|s| s.last_error = Some(error));
    }

    pub(crate) fn record_reconnect(&self) {
        self.update(|s| s.reconnects += 1);
    }

    pub(crate) fn set_database(&self, available: bool, error: Option<String>) {
        self.update(|s| {
            s.database_available = available;
            if error.is_some() {
                s.last_error = error;
            }
        });
    }
}
