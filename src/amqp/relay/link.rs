//! The relay's end of one RabbitMQ session: the connection, its confirm
//! channel (opened again when the broker closed it over a row, or retired
//! after a timeout), its `frame_max`, and whether the broker blocks it
//! (`connection.blocked`, a resource alarm).

use std::time::Duration;

use futures::StreamExt;
use lapin::{Connection, Event};
use tokio::sync::watch;

use crate::amqp::publish::ConfirmChannel;

/// How long closing a channel or the connection may take: a blocked
/// connection never sends the close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// A broker session of the relay.
pub(crate) struct BrokerLink {
    connection: Connection,
    channel: ConfirmChannel,
    pub(super) confirm_timeout: Duration,
    /// The broker's reason while it blocks the connection.
    blocked: watch::Receiver<Option<String>>,
    events: tokio::task::JoinHandle<()>,
}

impl BrokerLink {
    /// Opens the confirm channel on `connection` and starts watching the
    /// connection's `blocked`/`unblocked` notices.
    pub(crate) async fn open(
        connection: Connection,
        confirm_timeout: Duration,
    ) -> Result<Self, String> {
        let channel = match ConfirmChannel::open(&connection, confirm_timeout).await {
            Ok(channel) => channel,
            Err(e) => {
                let _ = tokio::time::timeout(
                    CLOSE_TIMEOUT,
                    connection.close(200, "idempo relay".into()),
                )
                .await;
                return Err(e.to_string());
            }
        };
        let (notify, blocked) = watch::channel(None);
        let mut events = connection.events_listener();
        let events = tokio::spawn(async move {
            while let Some(event) = events.next().await {
                match event {
                    Event::ConnectionBlocked(reason) => notify.send_replace(Some(reason)),
                    Event::ConnectionUnblocked => notify.send_replace(None),
                    _ => continue,
                };
            }
        });
        Ok(BrokerLink {
            connection,
            channel,
            confirm_timeout,
            blocked,
            events,
        })
    }

    /// The channel to publish on.
    pub(crate) fn channel(&self) -> &ConfirmChannel {
        &self.channel
    }

    /// The connection's negotiated `frame_max`: a message's header frame
    /// must fit in it.
    pub(crate) fn frame_max(&self) -> usize {
        crate::amqp::fit::frame_max(&self.connection)
    }

    /// Whether the connection is still up.
    pub(crate) fn is_connected(&self) -> bool {
        self.connection.status().connected()
    }

    /// The broker's reason, while it blocks the connection (publishes are
    /// not read; nothing is confirmed until it unblocks).
    pub(crate) fn blocked(&self) -> Option<String> {
        if !self.connection.status().blocked() {
            return None;
        }
        Some(
            self.blocked
                .borrow()
                .clone()
                .unwrap_or_else(|| "no reason given".into()),
        )
    }

    /// Waits until the broker unblocks the connection (or it is lost).
    pub(crate) async fn unblocked(&mut self) {
        while self.is_connected() && self.connection.status().blocked() {
            // The notice, or a second: lapin's status is the truth.
            let _ = tokio::time::timeout(Duration::from_secs(1), self.blocked.changed()).await;
        }
    }

    /// A channel that is open: the current one, or a new one when the
    /// broker closed it (a row's channel error) or it was retired (a
    /// confirm timeout). `Err` when the connection is gone.
    pub(crate) async fn ensure_channel(&mut self) -> Result<(), String> {
        if self.channel.is_usable() {
            return Ok(());
        }
        self.replace_channel().await
    }

    /// Replaces the channel with a new one, so that nothing late on the old
    /// one (a confirm, a return) is credited to what comes next.
    pub(crate) async fn replace_channel(&mut self) -> Result<(), String> {
        if !self.is_connected() {
            return Err("the relay's connection was closed".into());
        }
        let opened = tokio::time::timeout(
            self.confirm_timeout,
            ConfirmChannel::open(&self.connection, self.confirm_timeout),
        )
        .await;
        let channel = match opened {
            Ok(Ok(channel)) => channel,
            Ok(Err(e)) => return Err(format!("cannot open a channel: {e}")),
            Err(_) => return Err("cannot open a channel: no answer".into()),
        };
        let old = std::mem::replace(&mut self.channel, channel);
        // Closed aside: a blocked connection sends the close only later.
        tokio::spawn(async move {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, old.close()).await;
        });
        Ok(())
    }

    /// Closes the channel and the connection, each within a bound.
    pub(crate) async fn close(self) {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.channel.close()).await;
        let _ = tokio::time::timeout(
            CLOSE_TIMEOUT,
            self.connection.close(200, "idempo relay stopped".into()),
        )
        .await;
    }
}

impl Drop for BrokerLink {
    fn drop(&mut self) {
        self.events.abort();
    }
}
