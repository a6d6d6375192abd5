//! One session's deliveries as the runtime's [`Feed`]: lapin's consumer
//! stream, each delivery turned into the runtime's message and a receipt of
//! its session, and what ends the session.

use std::sync::Arc;

use futures::StreamExt;
use lapin::Connection;

use super::delivery::{Receipt, SessionLink};
use crate::runtime::dispatch::Feed;
use crate::runtime::message::Message;

/// The delivery stream of one session, and what ends it.
pub(crate) struct AmqpFeed<'a> {
    pub(crate) deliveries: &'a mut lapin::Consumer,
    pub(crate) channel: &'a lapin::Channel,
    pub(crate) connection: &'a Connection,
    pub(crate) session: Arc<SessionLink>,
    /// The session ended on a delivery the client could not parse.
    pub(crate) unparseable: bool,
}

impl Feed<Receipt> for AmqpFeed<'_> {
    async fn next(&mut self) -> Result<(Message, Receipt), String> {
        let next = tokio::select! {
            biased;
            () = self.session.broken.cancelled() => {
                return Err("the session's republishing channels or acks broke".into());
            }
            next = self.deliveries.next() => next,
        };
        match next {
            Some(Ok(delivery)) => {
                let receipt = Receipt::new(
                    delivery.acker.clone(),
                    delivery.delivery_tag,
                    self.session.clone(),
                );
                Ok((Message::from_delivery(delivery), receipt))
            }
            Some(Err(e)) if matches!(e.kind(), lapin::ErrorKind::ParsingError(_)) => {
                self.unparseable = true;
                Err(format!("a delivery could not be parsed: {e}"))
            }
            Some(Err(e)) => Err(format!("consuming failed: {e}")),
            None if self.channel.status().connected() && self.connection.status().connected() => {
                let error = crate::amqp::AmqpError::ConsumerCancelled {
                    queue: self.session.queue.clone(),
                };
                Err(format!("{error} (was the queue deleted?)"))
            }
            None => Err("the channel closed".into()),
        }
    }
}
