//! The queues the runtime declares: the work queue and its dead-letter queue.

use std::time::Duration;

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

impl super::Amqp {
    /// The dead-letter queue a consumer of `queue` declares unless told
    /// otherwise: `<queue>.dlq`. Dead letters carry their reason and history
    /// in `x-idempo-*` headers (`idempo::ops::dead_letters` reads them).
    ///
    /// ```
    /// use idempo::amqp::Amqp;
    /// assert_eq!(Amqp::dead_letter_queue("payments"), "payments.dlq");
    /// ```
    pub fn dead_letter_queue(queue: &str) -> String {
        dead_letter_queue(queue)
    }

    /// The inverse of [`dead_letter_queue`](Self::dead_letter_queue): the
    /// work queue that `name` refers to, whether it names the work queue or
    /// its dead-letter queue (operators type either).
    ///
    /// ```
    /// use idempo::amqp::Amqp;
    /// assert_eq!(Amqp::work_queue("payments.dlq"), "payments");
    /// assert_eq!(Amqp::work_queue("payments"), "payments");
    /// ```
    pub fn work_queue(name: &str) -> &str {
        work_queue(name)
    }
}

/// `<queue>.dlq`, the rule behind [`Amqp::dead_letter_queue`](super::Amqp::dead_letter_queue).
pub(crate) fn dead_letter_queue(queue: &str) -> String {
    format!("{queue}{DLQ_SUFFIX}")
}

/// What [`dead_letter_queue`] appends.
const DLQ_SUFFIX: &str = ".dlq";

/// The inverse of [`dead_letter_queue`].
pub(crate) fn work_queue(name: &str) -> &str {
    name.strip_suffix(DLQ_SUFFIX).unwrap_or(name)
}

/// The longest name AMQP carries (a queue, an exchange, a routing key): a
/// short string of 255 bytes.
pub(crate) const MAX_NAME_LEN: usize = 255;

/// Checks that `name` (a `what`: "queue", "exchange", "routing key") fits an
/// AMQP short string, so that an overlong name is refused up front with the
/// name in the error, instead of failing deep in the client.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) naming the name and its length.
pub(crate) fn check_name(what: &str, name: &str) -> Result<()> {
    if name.len() <= MAX_NAME_LEN {
        return Ok(());
    }
    let mut shown = MAX_NAME_LEN.min(60);
    while !name.is_char_boundary(shown) {
        shown -= 1;
    }
    Err(crate::Error::Config(format!(
        "the {what} name {:?}… is {} bytes long; AMQP names hold at most {MAX_NAME_LEN} bytes",
        &name[..shown],
        name.len()
    )))
}

/// What to declare, derived from the builder.
#[derive(Debug, Clone)]
pub(crate) struct Topology {
    pub(crate) queue: String,
    pub(crate) dead_letter_queue: String,
    pub(crate) queue_type: QueueType,
    pub(crate) bindings: Vec<(String, String)>,
    /// One delay queue per retry delay (empty when retries requeue).
    pub(crate) retry_delays: Vec<Duration>,
}

impl Topology {
    /// Declares the durable dead-letter queue, the durable work queue
    /// dead-lettering into it (through the default exchange), the delay
    /// queues of the retry policy, then the bindings.
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
        dead_letter_into(&mut args, &self.dead_letter_queue, self.queue_type);
        channel
            .queue_declare(self.queue.as_str().into(), durable, args)
            .await?;

        for delay in &self.retry_delays {
            channel
                .queue_declare(
                    delay_queue(&self.queue, *delay).as_str().into(),
                    durable,
                    self.delay_queue_arguments(*delay),
                )
                .await?;
        }

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

impl Topology {
    /// A delay queue holds each message for `delay`, then dead-letters it back
    /// into the work queue. It is a quorum queue whatever the work queue's
    /// type: a classic queue dead-letters at-most-once, so a retry whose
    /// original was already acked could be dropped on its way back.
    fn delay_queue_arguments(&self, delay: Duration) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), queue_type_value(QueueType::Quorum));
        args.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(delay.as_millis() as i64),
        );
        dead_letter_into(&mut args, &self.queue, QueueType::Quorum);
        args
    }
}

/// Dead-letters (through the default exchange) into `target`. On quorum
/// queues this is `at-least-once` (which needs `reject-publish` overflow): the
/// broker keeps the message until `target` confirmed it.
fn dead_letter_into(args: &mut FieldTable, target: &str, queue_type: QueueType) {
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(target.into()),
    );
    if queue_type == QueueType::Quorum {
        args.insert(
            "x-dead-letter-strategy".into(),
            AMQPValue::LongString("at-least-once".into()),
        );
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
    }
}

fn queue_type_value(t: QueueType) -> AMQPValue {
    AMQPValue::LongString(t.as_str().into())
}

/// The delay queue a consumer of `queue` declares for `delay`:
/// `<queue>.retry.<delay>`, the delay written exactly and short (`1s`, `2m`,
/// `250ms`, `1h`). For tools that inspect the topology (the `idempo` command's
/// `status`).
pub(crate) fn delay_queue(queue: &str, delay: Duration) -> String {
    format!("{queue}.retry.{}", crate::duration::exact_label(delay))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn delay_queue_names_are_short_and_exact() {
        assert_eq!(delay_queue("payments", secs(30)), "payments.retry.30s");
        assert_eq!(delay_queue("payments", secs(120)), "payments.retry.2m");
        assert_eq!(delay_queue("p", secs(7200)), "p.retry.2h");
        assert_eq!(
            delay_queue("p", Duration::from_millis(1500)),
            "p.retry.1500ms"
        );
    }

    #[test]
    fn the_dead_letter_queue_is_the_queue_name_with_a_dlq_suffix() {
        assert_eq!(dead_letter_queue("payments"), "payments.dlq");
        // A queue that is itself a DLQ gets its own: nothing is stripped.
        assert_eq!(dead_letter_queue("payments.dlq"), "payments.dlq.dlq");
    }
}
