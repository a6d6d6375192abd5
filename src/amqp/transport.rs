//! [`Amqp`]: RabbitMQ as a [`Transport`] of the consumer runtime: its
//! options checked once, its sessions (`session.rs`), its settling
//! (`delivery.rs`), its span and its relay.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use super::broker::Broker;
use super::delivery::{self, Receipt};
use super::options::AmqpOptions;
use super::topology::{Topology, check_name, dead_letter_queue, delay_queue};
use crate::Result;
use crate::runtime::dispatch::Deliveries;
use crate::runtime::message::Message;
use crate::runtime::transport::{Finished, Later, Letter, Refused, Setup, Transport};

/// RabbitMQ's default `consumer_timeout`: an unacked delivery older than this
/// makes the broker close the channel, and the message is redelivered.
const BROKER_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// RabbitMQ, on lapin: the transport of [`amqp::Consumer`](crate::amqp::Consumer).
///
/// Each delivery of the queue is claimed, handled and committed by the
/// runtime, then acknowledged. A delivery to retry is republished (with
/// publisher confirms) to the delay queue of its delay,
/// `<queue>.retry.<delay>`, whose TTL dead-letters it back into the queue;
/// a dead letter is republished to `<queue>.dlq` with its reason (or stored
/// in the `dead_letters` table). Both copies carry idempo's failure headers
/// and the id the original was deduplicated on, sealed.
#[derive(Debug)]
pub struct Amqp {
    pub(crate) broker: Broker,
    pub(crate) topology: Topology,
    pub(crate) declare: bool,
    pub(crate) also_declare: Vec<String>,
    pub(crate) wait_for_topology: bool,
    pub(crate) connection_name: String,
    pub(crate) consumer: String,
    pub(crate) prefetch: u16,
    /// Batch mode: processed deliveries are acked with multiple acks.
    pub(crate) batched: bool,
    /// The table store's pool, when dead letters go there (the quarantine
    /// writes its letters there too).
    pub(crate) letters_table: Option<PgPool>,
}

impl Transport for Amqp {
    type Options = AmqpOptions;
    type Receipt = Receipt;
    const NAME: &'static str = "amqp";
    const OWN_DEAD_LETTERS: bool = true;

    fn build(options: AmqpOptions, setup: &Setup<'_>) -> Result<Self> {
        let o = options;
        let queue = o
            .queue
            .ok_or_else(|| crate::Error::Config("a queue is required: call .queue(name)".into()))?;
        let dead_letter_queue = o
            .dead_letter_queue
            .unwrap_or_else(|| dead_letter_queue(&queue));
        // Every name the runtime will send, derived ones included, fits AMQP.
        check_name("queue", &queue)?;
        check_name("dead-letter queue", &dead_letter_queue)?;
        if o.declare {
            for delay in setup.redelivery().delays() {
                check_name("delay queue", &delay_queue(&queue, *delay))?;
            }
        }
        for other in &o.also_declare {
            check_name("queue", other)?;
            check_name(
                "dead-letter queue",
                &super::topology::dead_letter_queue(other),
            )?;
        }
        for (exchange, routing_key) in &o.bindings {
            check_name("exchange", exchange)?;
            check_name("routing key", routing_key)?;
        }
        let broker = match o.broker {
            Some(broker) => broker,
            None => Broker::new(&o.amqp_url)?,
        };
        let consumer = setup.consumer().unwrap_or(&queue).to_owned();
        let connection_name = o
            .connection_name
            .unwrap_or_else(|| crate::host::connection_name(&consumer));
        Ok(Amqp {
            broker,
            topology: Topology {
                queue,
                dead_letter_queue,
                queue_type: o.queue_type,
                bindings: o.bindings,
                retry_delays: setup.redelivery().delays().to_vec(),
            },
            declare: o.declare,
            also_declare: o.also_declare,
            wait_for_topology: o.wait_for_topology,
            connection_name,
            consumer,
            prefetch: setup.prefetch(),
            batched: setup.batch().is_some(),
            letters_table: setup.letters_in_table().then(|| setup.pool().clone()),
        })
    }

    fn source(&self) -> &str {
        &self.topology.queue
    }

    async fn consume(self: Arc<Self>, deliveries: &mut Deliveries<Self>) -> Result<()> {
        self.consume_sessions(deliveries).await
    }

    fn span(&self, consumer: &str, messages: &[Message]) -> tracing::Span {
        super::telemetry::process_span(consumer, &self.topology.queue, messages)
    }

    fn gone(&self, receipt: &Receipt) -> Option<Box<dyn Fn() -> bool + Send + Sync>> {
        Some(receipt.probe())
    }

    fn redelivery_horizon(&self) -> Duration {
        BROKER_CONSUMER_TIMEOUT
    }

    #[cfg(feature = "outbox")]
    fn relay(
        &self,
        context: crate::runtime::relay_task::RelayContext<'_>,
    ) -> Option<crate::runtime::relay_task::RelayTask> {
        let relay =
            crate::relay::Relay::<Amqp>::with_broker(self.broker.clone(), context.pool.clone())
                .for_consumer(context.consumer, context.link.clone());
        let states = relay.health().subscribe();
        let stop = relay.shutdown_handle();
        Some(crate::runtime::relay_task::RelayTask::start(
            stop,
            relay.run(),
            Some((states, |s: &crate::relay::RelaySnapshot| s.state)),
            context.health,
        ))
    }

    async fn retry_later(
        &self,
        message: &Message,
        receipt: &Receipt,
        later: Later<'_>,
    ) -> std::result::Result<(), Refused> {
        delivery::retry_later(message, receipt, later).await
    }

    async fn dead_letter(
        &self,
        message: &Message,
        receipt: &Receipt,
        letter: Letter<'_>,
    ) -> std::result::Result<Vec<(String, usize)>, Refused> {
        delivery::dead_letter(message, receipt, letter).await
    }

    async fn letter_stored(&self, _message: &Message, receipt: &Receipt, _letter: Letter<'_>) {
        delivery::letter_stored(receipt).await;
    }

    async fn requeue(&self, _message: &Message, receipt: &Receipt, pause: Duration, _error: &str) {
        delivery::requeue(receipt, pause).await;
    }

    async fn reject(&self, receipt: &Receipt) {
        delivery::reject(receipt).await;
    }

    async fn finish(&self, unit: Vec<Finished<Receipt>>) {
        delivery::finish(unit).await;
    }
}
