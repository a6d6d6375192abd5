//! A JetStream consumer's builder: [`Consumer::builder`] and the methods
//! that set its [`NatsOptions`] on `ConsumerBuilder<Nats, _>`.

use std::time::Duration;

use sqlx::PgPool;

use super::options::NatsOptions;
use super::transport::Nats;
use crate::runtime::builder::ConsumerBuilder;
use crate::runtime::consumer::Consumer;
use crate::runtime::mode::NoHandler;

impl Consumer<Nats> {
    /// Starts configuring a consumer of a JetStream stream on the NATS
    /// server at `nats_url` (`nats://127.0.0.1:4222`; or several URLs
    /// separated by commas, one per node of a cluster) that runs its handler
    /// in transactions on `pool` (size it to at least `concurrency`).
    pub fn builder(nats_url: impl Into<String>, pool: PgPool) -> ConsumerBuilder<Nats, NoHandler> {
        ConsumerBuilder::with_options(pool, NatsOptions::new(nats_url.into()))
    }
}

impl<Mode> ConsumerBuilder<Nats, Mode> {
    /// The stream to consume (required). Its name is also the default
    /// subject and consumer name.
    pub fn stream(mut self, stream: impl Into<String>) -> Self {
        self.options.stream = Some(stream.into());
        self
    }

    /// The subject to consume (a filter on the stream; wildcards allowed).
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.options.subject = Some(subject.into());
        self
    }

    /// Whether a missing stream is created (default) or an error at start.
    pub fn create_stream(mut self, create: bool) -> Self {
        self.options.create_stream = create;
        self
    }

    /// How long JetStream waits for an acknowledgement before redelivering;
    /// a running unit sends in-progress acks every third of it.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.options.ack_wait = ack_wait;
        self
    }

    /// The duplicate window of the streams idempo creates (the consumed
    /// one, and the relay's): how long JetStream drops a publish whose
    /// `Nats-Msg-Id` it saw. Keep it longer than a relay takes to restart,
    /// so that a relay that died between publish and delete is deduplicated
    /// by JetStream (the consumer's claim catches a copy after the window
    /// anyway). Default: JetStream's, 2 minutes. Streams that exist are left
    /// as they are.
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.options.duplicate_window = Some(window);
        self
    }

    /// A stream the consumer's relay publishes to (subject = name), created
    /// at start when missing: where handlers forward.
    pub fn relay_stream(mut self, name: impl Into<String>) -> Self {
        self.options.relay_streams.push(name.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::PgPool;

    use crate::consumer::{DeadLetters, HandlerError, Message};
    use crate::nats::Consumer;
    use crate::{Error, Tx};

    async fn noop(_tx: Tx, _m: Message) -> std::result::Result<(), HandlerError> {
        Ok(())
    }

    fn builder() -> crate::nats::ConsumerBuilder {
        let pool = PgPool::connect_lazy("postgres://postgres@127.0.0.1:5432/postgres").unwrap();
        Consumer::builder("nats://127.0.0.1:4222", pool).stream("payments")
    }

    #[tokio::test]
    async fn the_settings_of_every_transport_hold_on_jetstream() {
        let consumer = builder()
            .duplicate_window(Duration::from_secs(600))
            .retention_interval(Duration::from_secs(60))
            .handler(noop)
            .build()
            .unwrap();
        assert_eq!(consumer.name(), "payments");
        assert_eq!(consumer.transport().topology.durable, "payments");
        assert_eq!(
            consumer.transport().topology.duplicate_window,
            Some(Duration::from_secs(600))
        );
        assert_eq!(consumer.config.retention_interval, Duration::from_secs(60));
        let (_, kept) = consumer
            .config
            .letters
            .as_ref()
            .expect("JetStream's dead letters go to the table: the reaper keeps it");
        assert_eq!(*kept, Duration::from_secs(30 * 24 * 3600));
    }

    #[tokio::test]
    async fn a_dead_letter_queue_is_refused_on_jetstream() {
        match builder()
            .dead_letters(DeadLetters::Queue)
            .handler(noop)
            .build()
        {
            Err(Error::Config(why)) => assert!(why.contains("no dead-letter store"), "{why}"),
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }
}
