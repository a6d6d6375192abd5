//! NATS names in the OpenTelemetry messaging conventions: the process span a
//! unit of JetStream deliveries runs in (the runtime records the rest of its
//! fields: `runtime/trace.rs`). The destination is the subject.

use tracing::{Span, field};

use crate::runtime::message::Message;

/// The CONSUMER span `process <subject>` of a unit: one delivery, or a batch
/// (then named after the consumed subject, with the message count).
pub(crate) fn process_span(consumer: &str, subject: &str, messages: &[Message]) -> Span {
    match messages {
        [one] => {
            let span = tracing::info_span!(
                "process",
                otel.name = field::Empty,
                otel.kind = "consumer",
                otel.status_code = field::Empty,
                messaging.system = "nats",
                messaging.operation.name = "process",
                "messaging.operation.type" = "process",
                messaging.destination.name = one.routing_key(),
                messaging.consumer.group.name = consumer,
                messaging.message.id = field::Empty,
                messaging.message.body.size = one.body().len(),
                idempo.stream_sequence = one.delivery_tag(),
                idempo.redelivered = one.redelivered(),
                idempo.claim = field::Empty,
                idempo.attempt = field::Empty,
                idempo.settlement = field::Empty,
                idempo.retry.delay_ms = field::Empty,
                "error.type" = field::Empty,
            );
            if !span.is_disabled() {
                span.record("otel.name", format!("process {}", one.routing_key()));
            }
            span
        }
        many => tracing::info_span!(
            "process",
            otel.name = format!("process {subject}"),
            otel.kind = "consumer",
            messaging.system = "nats",
            messaging.operation.name = "process",
            "messaging.operation.type" = "process",
            messaging.destination.name = subject,
            messaging.consumer.group.name = consumer,
            messaging.batch.message_count = many.len(),
        ),
    }
}
