//! The one reconnect-with-backoff of the consumer, the relay and the dedup
//! publisher: [`Reconnect`] (which node next, how long to wait) and
//! [`run`], the loop of broker sessions that the consumer and the relay run.

use std::time::{Duration, Instant};

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use crate::Result;
use crate::amqp::broker::Broker;
use crate::backoff::Backoff;

/// A session that lasted this long starts the backoff over: shorter ones
/// (a broker that accepts and then drops us) keep backing off.
const STABLE_SESSION: Duration = Duration::from_secs(30);

/// During an outage a loss is logged at least this often, besides the 1st,
/// 2nd, 4th, 8th… in a row.
const LOG_AT_LEAST_EVERY: Duration = Duration::from_secs(300);

/// Where a long-lived client stands with the broker: the node it last used,
/// the backoff between attempts.
#[derive(Debug)]
pub(crate) struct Reconnect {
    broker: Broker,
    name: String,
    node: Option<usize>,
    backoff: Backoff,
    connected_once: bool,
    /// Sessions lost in a row without one that worked.
    losses_in_row: u32,
    last_logged: Option<Instant>,
}

/// One lost session, as the client reports it.
#[derive(Debug)]
pub(crate) struct Loss {
    /// Why it ended.
    pub(crate) error: String,
    /// How long it had been working (zero: the attempt failed).
    pub(crate) lasted: Duration,
    /// The pause before the next attempt.
    pub(crate) pause: Duration,
    /// The how-many-th loss in a row (1 after a session that worked).
    pub(crate) in_row: u32,
    /// Whether to log it at its level: the 1st, 2nd, 4th, 8th… loss in a
    /// row and one every five minutes, so that an outage does not flood the
    /// log; the others go to `debug`.
    pub(crate) logged: bool,
    /// No connection ever succeeded: the broker is down or misaddressed
    /// since the start.
    pub(crate) never_connected: bool,
}

impl Loss {
    /// "attempt 8; logging the 1st, 2nd, 4th, 8th… in a row" for the log.
    pub(crate) fn note(&self) -> String {
        format!(
            "failure {} in a row; logging the 1st, 2nd, 4th, 8th… and one every {} min",
            self.in_row,
            LOG_AT_LEAST_EVERY.as_secs() / 60
        )
    }
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
            losses_in_row: 0,
            last_logged: None,
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

    /// A session was lost after `lasted`: the pause before the next attempt
    /// and whether to log it.
    pub(crate) fn lose(&mut self, error: String, lasted: Duration) -> Loss {
        if !lasted.is_zero() {
            self.losses_in_row = 0;
        }
        self.losses_in_row = self.losses_in_row.saturating_add(1);
        let now = Instant::now();
        let logged = self.losses_in_row.is_power_of_two()
            || self
                .last_logged
                .is_none_or(|at| now.duration_since(at) >= LOG_AT_LEAST_EVERY);
        if logged {
            self.last_logged = Some(now);
        }
        Loss {
            error,
            lasted,
            pause: self.pause_after(lasted),
            in_row: self.losses_in_row,
            logged,
            never_connected: !self.connected_once,
        }
    }

    /// After a success: the next loss starts from the shortest pause (the
    /// dedup publisher's reconnects are attempts, not sessions).
    #[cfg(feature = "window")]
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

    /// A session was lost: report it; the next one starts after `loss.pause`.
    async fn lost(&mut self, loss: &Loss);
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
                let loss = link.lose(error, lasted);
                client.lost(&loss).await;
                tokio::select! {
                    () = tokio::time::sleep(loss.pause) => {}
                    () = stop.cancelled() => return None,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> Reconnect {
        let broker = Broker::new("amqp://127.0.0.1:1").unwrap();
        Reconnect::new(broker, "test".into(), Duration::from_secs(30))
    }

    #[test]
    fn an_outage_logs_the_1st_2nd_4th_8th_loss_in_a_row() {
        let mut link = link();
        let logged: Vec<u32> = (0..20)
            .map(|_| link.lose("refused".into(), Duration::ZERO))
            .filter(|loss| loss.logged)
            .map(|loss| loss.in_row)
            .collect();
        assert_eq!(logged, [1, 2, 4, 8, 16]);
        assert!(link.lose("refused".into(), Duration::ZERO).never_connected);
    }

    #[test]
    fn a_session_that_worked_starts_the_count_over() {
        let mut link = link();
        for _ in 0..5 {
            link.lose("refused".into(), Duration::ZERO);
        }
        let loss = link.lose("lost".into(), Duration::from_secs(1));
        assert_eq!((loss.in_row, loss.logged), (1, true));
    }

    #[test]
    fn a_long_outage_is_still_logged_every_five_minutes() {
        let mut link = link();
        for _ in 0..5 {
            link.lose("refused".into(), Duration::ZERO);
        }
        link.last_logged = Instant::now().checked_sub(LOG_AT_LEAST_EVERY);
        let loss = link.lose("refused".into(), Duration::ZERO);
        assert_eq!((loss.in_row, loss.logged), (6, true));
    }
}
