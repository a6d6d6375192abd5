//! The outbox relay's RabbitMQ side ([`Relay`](crate::amqp::Relay) is the
//! relay on [`Amqp`]): its sessions, through the one reconnect loop; a
//! batch published with confirms in flight together, the channel's failures
//! traced to the message they are about; each message's AMQP publish and its
//! PRODUCER span.

mod confirms;
pub(crate) mod frame;
mod link;
mod send_span;

use std::time::Duration;

use sqlx::PgPool;

use super::broker::Broker;
use super::reconnect::{self, Loss, Reconnect, Session, Sessions};
use super::transport::Amqp;
use crate::Result;
use crate::relay::running::Running;
use crate::relay::{Publish, Relay};
use link::BrokerLink;

impl crate::relay::publish_sealed::Sealed for Amqp {}

impl Publish for Amqp {
    type Target = Broker;
    const NAME: &'static str = <Amqp as crate::runtime::transport::Transport>::NAME;

    async fn sessions(relay: &Relay<Amqp>, running: &Running<'_, Amqp>) -> Result<()> {
        let mut link = Reconnect::new(
            relay.target.clone(),
            relay.connection_name_or_default(),
            Duration::from_secs(30),
        );
        let mut sessions = RelaySessions { relay, running };
        if let Some(never) =
            reconnect::run(&mut sessions, &mut link, relay.shutdown.graceful_token()).await
        {
            match never {}
        }
        Ok(())
    }
}

impl Relay<Amqp> {
    /// A relay for the outbox in `pool`'s database, publishing to the broker
    /// at `amqp_url` (one URL, or comma-separated node URLs).
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) when the URL does not parse.
    pub fn new(amqp_url: &str, pool: PgPool) -> Result<Self> {
        Ok(Self::with_broker(Broker::new(amqp_url)?, pool))
    }

    /// A relay publishing to `broker` (several nodes, TLS settings).
    pub fn with_broker(broker: Broker, pool: PgPool) -> Self {
        Self::with_target(broker, pool)
    }
}

/// The relay's sessions with RabbitMQ, one after the other.
struct RelaySessions<'r, 'a> {
    relay: &'r Relay<Amqp>,
    running: &'r Running<'a, Amqp>,
}

impl Sessions for RelaySessions<'_, '_> {
    type Fatal = std::convert::Infallible;

    async fn session(&mut self, link: &mut Reconnect) -> Session<Self::Fatal> {
        self.running.connecting();
        let started = std::time::Instant::now();
        let session = async {
            let connection = link.connect().await.map_err(|e| e.to_string())?;
            let mut broker = BrokerLink::open(connection, self.relay.confirms_within()).await?;
            let outcome = self.running.session(&mut broker).await;
            broker.close().await;
            outcome
        };
        match session.await {
            Ok(()) => Session::Stopped,
            Err(error) => Session::Lost {
                error,
                lasted: started.elapsed(),
            },
        }
    }

    async fn lost(&mut self, loss: &Loss) {
        self.running.lost(&loss.error, loss.logged, &loss.note());
    }
}
