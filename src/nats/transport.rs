//! [`Nats`]: JetStream as a [`Transport`] of the consumer runtime: its
//! options checked once, its pull consumer (`consumer.rs`), its settling
//! (`pipeline.rs`), its span and its relay.

use std::sync::Arc;
use std::time::Duration;

use super::names::{check_name, check_subject};
use super::options::NatsOptions;
use super::pipeline::{self, Receipt};
use super::topology::Topology;
use crate::runtime::dispatch::Deliveries;
use crate::runtime::message::Message;
use crate::runtime::transport::{Finished, Later, Letter, Refused, Setup, Transport};
use crate::{Error, Result};

/// NATS JetStream, on async-nats: the transport of
/// [`nats::Consumer`](crate::nats::Consumer).
///
/// A durable pull consumer named after the idempo consumer reads the
/// stream, so that competing processes share its deliveries. A delivery is
/// acknowledged (confirmed by the server) after the commit; a transient
/// failure is NAKed with the retry policy's delay, and its attempts are
/// JetStream's delivery count; a dead letter goes to the `dead_letters`
/// table (JetStream has no dead-letter stream), then the message is
/// acknowledged. While a unit runs, its messages get in-progress acks every
/// third of the ack wait.
#[derive(Debug)]
pub struct Nats {
    pub(crate) url: String,
    pub(crate) topology: Topology,
    pub(crate) relay_streams: Vec<String>,
}

impl Transport for Nats {
    type Options = NatsOptions;
    type Receipt = Receipt;
    const NAME: &'static str = "nats";
    // JetStream counts deliveries, crashed ones included.
    const COUNTS_DELIVERIES: bool = true;
    const OWN_DEAD_LETTERS: bool = false;

    fn build(options: NatsOptions, setup: &Setup<'_>) -> Result<Self> {
        let o = options;
        let stream = o
            .stream
            .ok_or_else(|| Error::Config("a stream is required: call .stream(name)".into()))?;
        let subject = o.subject.unwrap_or_else(|| stream.clone());
        let durable = setup.consumer().unwrap_or(&stream).to_owned();
        check_name("stream", &stream)?;
        check_subject(&subject)?;
        check_name("consumer", &durable)?;
        for stream in &o.relay_streams {
            check_name("stream", stream)?;
        }
        if o.ack_wait < Duration::from_secs(1) {
            return Err(Error::Config("ack_wait must be at least 1 s".into()));
        }
        Ok(Nats {
            url: o.url,
            topology: Topology {
                stream,
                subject,
                durable,
                create_stream: o.create_stream,
                ack_wait: o.ack_wait,
                max_ack_pending: i64::from(setup.prefetch()),
                duplicate_window: o.duplicate_window,
                claim_retention: setup.claim_retention(),
            },
            relay_streams: o.relay_streams,
        })
    }

    fn source(&self) -> &str {
        &self.topology.stream
    }

    async fn consume(self: Arc<Self>, deliveries: &mut Deliveries<Self>) -> Result<()> {
        self.consume_stream(deliveries).await
    }

    fn span(&self, consumer: &str, messages: &[Message]) -> tracing::Span {
        super::telemetry::process_span(consumer, &self.topology.subject, messages)
    }

    fn while_running(&self, receipts: &[Receipt]) -> impl Future<Output = ()> + Send + 'static {
        pipeline::in_progress(receipts, self.topology.ack_wait / 3)
    }

    fn redelivery_horizon(&self) -> Duration {
        // A delivery whose process died comes back after the ack wait.
        self.topology.ack_wait
    }

    #[cfg(feature = "outbox")]
    fn relay(
        &self,
        context: crate::runtime::relay_task::RelayContext<'_>,
    ) -> Option<crate::runtime::relay_task::RelayTask> {
        let relay = self.relay_streams.iter().fold(
            crate::relay::Relay::<Nats>::new(self.url.clone(), context.pool.clone()),
            |relay, stream| relay.create_stream(stream),
        );
        let relay = match self.topology.duplicate_window {
            Some(window) => relay.duplicate_window(window),
            None => relay,
        };
        let relay = relay.for_consumer(context.consumer, context.link.clone());
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
        _message: &Message,
        receipt: &Receipt,
        later: Later<'_>,
    ) -> std::result::Result<(), Refused> {
        pipeline::nak(receipt, later.delay).await;
        Ok(())
    }

    async fn dead_letter(
        &self,
        _message: &Message,
        _receipt: &Receipt,
        _letter: Letter<'_>,
    ) -> std::result::Result<Vec<(String, usize)>, Refused> {
        // Reached only when the dead-letter table refused the letter.
        Err(Refused::Failed(
            "JetStream has no dead-letter stream; the dead-letter table refused the letter".into(),
        ))
    }

    async fn letter_stored(&self, _message: &Message, receipt: &Receipt, _letter: Letter<'_>) {
        pipeline::ack(receipt).await;
    }

    async fn requeue(&self, _message: &Message, receipt: &Receipt, pause: Duration, _error: &str) {
        pipeline::nak(receipt, pause).await;
    }

    async fn reject(&self, receipt: &Receipt) {
        pipeline::term(receipt).await;
    }

    async fn finish(&self, unit: Vec<Finished<Receipt>>) {
        let acks = unit.iter().filter_map(|finished| match finished {
            Finished::Ack { receipt, .. } => Some(pipeline::ack(receipt)),
            _ => None,
        });
        futures::future::join_all(acks).await;
    }
}
