//! A RabbitMQ consumer's builder: [`Consumer::builder`] and the methods
//! that set its [`AmqpOptions`] on `ConsumerBuilder<Amqp, _>`.

use sqlx::PgPool;

use super::broker::Broker;
use super::options::AmqpOptions;
use super::topology::QueueType;
use super::transport::Amqp;
use crate::runtime::builder::ConsumerBuilder;
use crate::runtime::consumer::Consumer;
use crate::runtime::mode::NoHandler;

impl Consumer<Amqp> {
    /// Starts configuring a consumer that connects to `amqp_url` and runs its
    /// handler in transactions on `pool`.
    ///
    /// Size the pool to at least [`concurrency`](ConsumerBuilder::concurrency)
    /// connections: each running handler holds one. The outbox relay (once
    /// the handlers stage messages) takes one more for each of its batches,
    /// and opens one connection of its own for `LISTEN`.
    pub fn builder(amqp_url: impl Into<String>, pool: PgPool) -> ConsumerBuilder<Amqp, NoHandler> {
        ConsumerBuilder::with_options(pool, AmqpOptions::new(amqp_url.into()))
    }
}

impl<Mode> ConsumerBuilder<Amqp, Mode> {
    /// The queue to consume (required). Unless [`declare`](Self::declare) is
    /// turned off, it is declared durable, dead-lettering into `<queue>.dlq`.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.options.queue = Some(queue.into());
        self
    }

    /// The dead-letter queue (default: `<queue>.dlq`).
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.options.dead_letter_queue = Some(queue.into());
        self
    }

    /// The type of the queues the runtime declares (default: quorum).
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.options.queue_type = queue_type;
        self
    }

    /// Whether to declare the queues (default: `true`). Turn it off when the
    /// topology is managed elsewhere; the dead-letter queue must then exist.
    pub fn declare(mut self, declare: bool) -> Self {
        self.options.declare = declare;
        self
    }

    /// Binds the queue to an existing exchange with a routing key, at start.
    pub fn bind(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.options
            .bindings
            .push((exchange.into(), routing_key.into()));
        self
    }

    /// The broker in full: several nodes, TLS settings, timeouts (see
    /// [`Broker`]). Replaces the URL given to
    /// [`Consumer::builder`](crate::amqp::Consumer::builder), which may
    /// itself be a comma-separated list of node URLs.
    pub fn broker(mut self, broker: Broker) -> Self {
        self.options.broker = Some(broker);
        self
    }

    /// Keep retrying (with backoff, reported in the consumer's health) when
    /// a queue exists with other arguments than the runtime declares, for a
    /// deployment in which someone else fixes the topology. By default that
    /// is a configuration error:
    /// [`Consumer::run`](crate::consumer::Consumer::run) returns
    /// [`AmqpError::TopologyConflict`](crate::amqp::AmqpError::TopologyConflict).
    pub fn wait_for_topology(mut self, wait: bool) -> Self {
        self.options.wait_for_topology = wait;
        self
    }

    /// Also declares `queue` as the work queue is declared (same type,
    /// dead-lettering into `<queue>.dlq`), e.g. the queue this consumer's
    /// handler emits to through the outbox, so that the consumer downstream
    /// finds it with the arguments it declares itself. Without its delay
    /// queues: the consumer of `queue` declares those for its own retry policy.
    pub fn declare_like_own(mut self, queue: impl Into<String>) -> Self {
        self.options.also_declare.push(queue.into());
        self
    }

    /// The connection name shown in RabbitMQ's management UI and `rabbitmqctl`
    /// (default: `idempo:<consumer>:<host>:<pid>`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.options.connection_name = Some(name.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::PgPool;

    use crate::amqp::Consumer;
    use crate::consumer::{HandlerError, Message, RedeliveryPolicy};
    use crate::{Error, Result, Tx};

    async fn noop(_tx: Tx, _m: Message) -> std::result::Result<(), HandlerError> {
        Ok(())
    }

    async fn noop_batch(_tx: Tx, _m: Vec<Message>) -> std::result::Result<(), HandlerError> {
        Ok(())
    }

    fn builder() -> crate::amqp::ConsumerBuilder {
        let pool = PgPool::connect_lazy("postgres://postgres@127.0.0.1:5432/postgres").unwrap();
        Consumer::builder("amqp://127.0.0.1", pool).queue("payments")
    }

    fn refused(result: Result<Consumer>) -> String {
        match result {
            Err(Error::Config(why)) => why,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn defaults_build_and_the_consumer_is_named_after_the_queue() {
        let consumer = builder().handler(noop).build().unwrap();
        assert_eq!(consumer.name(), "payments");
        assert_eq!(
            consumer.transport().topology.dead_letter_queue,
            "payments.dlq"
        );
        assert_eq!(
            (consumer.transport().prefetch, consumer.config.concurrency),
            (100, 16)
        );
        assert!(consumer.dispatch.batch.is_none());
        assert!(
            consumer.config.letters.is_none(),
            "RabbitMQ keeps dead letters in its DLQ by default"
        );
        let batched = builder()
            .batch_handler(noop_batch)
            .prefetch(300)
            .build()
            .unwrap();
        assert_eq!(batched.dispatch.batch.map(|(size, _)| size), Some(100));
    }

    #[tokio::test]
    async fn impossible_settings_are_refused_with_the_reason() {
        let pool = PgPool::connect_lazy("postgres://127.0.0.1/x").unwrap();
        let no_queue = Consumer::builder("amqp://127.0.0.1", pool).handler(noop);
        assert!(refused(no_queue.build()).contains("a queue is required"));
        let why = refused(builder().prefetch(4).concurrency(8).handler(noop).build());
        assert!(
            why.contains("prefetch (4) must be at least concurrency (8)"),
            "{why}"
        );
        assert!(refused(builder().concurrency(0).handler(noop).build()).contains("at least 1"));
        assert!(refused(builder().consumer_name("").handler(noop).build()).contains("empty"));
        let zero = builder().retention(Duration::ZERO).handler(noop);
        assert!(refused(zero.build()).contains("retention"));
        let no_delays = builder()
            .redelivery(RedeliveryPolicy::delayed([]))
            .handler(noop);
        assert!(refused(no_delays.build()).contains("at least one delay"));
    }

    #[tokio::test]
    async fn batch_sizes_are_checked_against_the_prefetch() {
        let zero = builder().handler(noop).batch(0);
        assert!(refused(zero.build()).contains("at least 1"));
        let why = refused(builder().handler(noop).batch(500).build());
        assert!(
            why.contains("prefetch (100) must be at least the batch size (500)"),
            "{why}"
        );
        let fine = builder()
            .prefetch(1500)
            .handler(noop)
            .batch(500)
            .build()
            .unwrap();
        assert_eq!(fine.dispatch.batch.map(|(size, _)| size), Some(500));
    }
}
