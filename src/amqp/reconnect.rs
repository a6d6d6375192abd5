//! The one reconnect-with-backoff of the consumer, the relay and the dedup
//! publisher: [`Reconnect`] (which node next, how long to wait) and
//! [`run`], the loop of broker sessions that the consumer and the relay run.

use std::time::Duration;

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use super::broker::Broker;
use crate::Result;
use crate::backoff::Backoff;

/// A session that lasted this long starts the backoff over: shorter ones
/// (a broker that accepts and then drops us) keep backing off.
const STABLE_SESSION: Duration = Duration::from_secs(30);

/// Where a long-lived client stands with the broker: the node it last used,
/// the backoff between attempts.
#[derive(Debug)]
pub(crate) struct Reconnect {
    broker: Broker,
    name: String,
    node: Option<usize>,
    backoff: Backoff,
    connected_once: bool,
}

impl Reconnect {
    /// Connections named `name` (shown in the management UI), with pauses
    /// from 100 ms doubling up to `max`, jittered.
    pub(crate) fn new(broker: Broker, name: String, max: Duration) -> Self {
        Reconnect {
            broker,
            name,
            node: None,
            backoff: Backoff::new(Duration::from_millis(100), max),
            connected_once: false,
        }
    }

    /// Connects to a live node, trying first the one after the node of the
    /// last connection.
    ///
    /// # Errors
    /// As [`Broker::connect_from`].
    pub(crate) async fn connect(&mut self) -> Result<Connection> {
        let (connection, node) = self.broker.connect_from(self.node, &self.name).await?;
        self.node = Some(node);
        self.connected_once = true;
        Ok(connection)
    }

    /// The node of the last connection.
    pub(crate) fn node(&self) -> Option<usize> {
        self.node
    }

    /// Whether a connection ever succeeded (a TLS refusal before that is a
    /// configuration error, not an outage).
    pub(crate) fn has_connected(&self) -> bool {
        self.connected_once
    }

    /// The pause before the next attempt, after a session that lasted
    /// `lasted` (zero: the attempt failed).
    pub(crate) fn pause_after(&mut self, lasted: Duration) -> Duration {
        if lasted >= STABLE_SESSION {
            self.backoff.reset();
        }
        self.backoff.next_delay()
    }

    /// After a success: the next loss starts from the shortest pause (the
    /// dedup publisher's reconnects are attempts, not sessions).
    #[cfg_attr(not(feature = "window"), allow(dead_code))]
    pub(crate) fn reset(&mut self) {
        self.backoff.reset();
    }
}

/// How one broker session ended.
pub(crate) enum Session<F> {
    /// Shutdown was requested and the session wound down.
    Stopped,
    /// The connection, a channel or the subscription was lost.
    Lost {
        error: String,
        /// How long the session had been working (zero if it never did).
        lasted: Duration,
    },
    /// A configuration error that no reconnect can fix.
    Fatal(F),
}

/// A client that lives through broker sessions.
pub(crate) trait Sessions {
    /// What ends the client for good.
    type Fatal;

    /// One connection's life: connect (through `link`), work, end.
    async fn session(&mut self, link: &mut Reconnect) -> Session<Self::Fatal>;

    /// A session was lost: report it; the next one starts after `pause`.
    async fn lost(&mut self, error: String, lasted: Duration, pause: Duration);
}

/// Runs sessions one after the other until one stops, or a fatal error
/// (returned); after a lost one, waits the backoff's pause, cut short by
/// `stop`.
pub(crate) async fn run<S: Sessions>(
    client: &mut S,
    link: &mut Reconnect,
    stop: &CancellationToken,
) -> Option<S::Fatal> {
    loop {
        match client.session(link).await {
            Session::Stopped => return None,
            Session::Fatal(error) => return Some(error),
            Session::Lost { error, lasted } => {
                let pause = link.pause_after(lasted);
                client.lost(error, lasted, pause).await;
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = stop.cancelled() => return None,
                }
            }
        }
    }
}
