//! The queues the runtime declares: the work queue and its dead-letter queue.

use lapin::Channel;
use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::Result;

/// The kind of RabbitMQ queue to declare.
///
/// # Default
/// [`QueueType::Quorum`]: replicated with Raft, RabbitMQ's recommendation when
/// messages must not be lost. See <https://www.rabbitmq.com/docs/quorum-queues>.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// A replicated quorum queue.
    #[default]
    Quorum,
    /// A classic (single-node) durable queue.
    Classic,
}

impl QueueType {
    fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

/// What to declare, derived from the builder.
#[derive(Debug, Clone)]
pub(crate) struct Topology {
    pub(crate) queue: String,
    pub(crate) dead_letter_queue: String,
    pub(crate) queue_type: QueueType,
    pub(crate) bindings: Vec<(String, String)>,
}

impl Topology {
    /// Declares the durable dead-letter queue, then the durable work queue
    /// dead-lettering into it (through the default exchange), then the bindings.
    ///
    /// The broker-side dead-lettering is a safety net for messages rejected
    /// without requeue; idempo itself publishes dead letters with a reason.
    ///
    /// # Errors
    /// A queue that exists with other arguments fails with `PRECONDITION_FAILED`
    /// (and closes the channel): declare it the same way, or turn declaring off.
    pub(crate) async fn declare(&self, channel: &Channel) -> Result<()> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let mut dlq_args = FieldTable::default();
        dlq_args.insert("x-queue-type".into(), queue_type_value(self.queue_type));
        channel
            .queue_declare(self.dead_letter_queue.as_str().into(), durable, dlq_args)
            .await?;

        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), queue_type_value(self.queue_type));
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(self.dead_letter_queue.as_str().into()),
        );
        channel
            .queue_declare(self.queue.as_str().into(), durable, args)
            .await?;

        for (exchange, routing_key) in &self.bindings {
            channel
                .queue_bind(
                    self.queue.as_str().into(),
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok(())
    }
}

fn queue_type_value(t: QueueType) -> AMQPValue {
    AMQPValue::LongString(t.as_str().into())
}
