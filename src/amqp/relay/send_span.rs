//! The PRODUCER span `send <destination>` of each outbox message the relay
//! publishes, by the messaging conventions (see [`crate::otel`]): a child of
//! the message's creation context (the `traceparent` staged with it), which
//! the message carries on unchanged, so that its consumer ties back to the
//! code that staged it.

use std::time::Instant;

use tracing::{Span, field};

use crate::amqp::telemetry::destination_name;
use crate::outbox::packed::Staged;
use crate::relay::said::{Envelope, Said};

/// The send spans of a batch's messages, open while it is published.
pub(super) struct Sends {
    spans: Vec<Vec<Span>>,
    started: Instant,
}

impl Sends {
    /// Opens a span for each message of `envelopes`, before they are sent.
    pub(super) fn open(envelopes: &[Envelope]) -> Sends {
        Sends {
            spans: envelopes
                .iter()
                .map(|e| e.messages.iter().map(open).collect())
                .collect(),
            started: Instant::now(),
        }
    }

    /// Closes each span with what the broker said of its message, and
    /// records the batch's publish latency.
    pub(super) fn close(self, envelopes: &[Envelope], said: &[Vec<Said>]) {
        #[cfg(feature = "otel")]
        crate::otel::metrics::Relay::get().published_in(self.started.elapsed());
        #[cfg(not(feature = "otel"))]
        let _ = self.started;
        for ((envelope, row), spans) in envelopes.iter().zip(said).zip(self.spans) {
            for ((message, said), span) in envelope.messages.iter().zip(row).zip(spans) {
                close(span, message, said);
            }
        }
    }
}

/// Opens the span of `message`: its destination's name is made only when
/// the span is recorded.
fn open(message: &Staged) -> Span {
    let span = tracing::info_span!(
        "send",
        otel.name = field::Empty,
        otel.kind = "producer",
        otel.status_code = field::Empty,
        messaging.system = "rabbitmq",
        messaging.operation.name = "send",
        "messaging.operation.type" = "send",
        messaging.destination.name = field::Empty,
        messaging.message.id = message.message_id.as_str(),
        messaging.message.body.size = message.body.len(),
        messaging.rabbitmq.destination.routing_key = message.routing_key.as_str(),
        "error.type" = field::Empty,
    );
    if span.is_disabled() {
        return span;
    }
    let destination = destination_name(&message.exchange, &message.routing_key, None);
    span.record("otel.name", format!("send {destination}"));
    span.record("messaging.destination.name", destination);
    #[cfg(feature = "otel")]
    if let Some(creation) = creation_context(message) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        // Without an OpenTelemetry layer there is nothing to parent.
        let _ = span.set_parent(crate::otel::context::remote_parent(creation));
    }
    span
}

/// Closes `span` with what the broker said of its message.
fn close(span: Span, message: &Staged, said: &Said) {
    let error_type = match said {
        Said::Confirmed => {
            #[cfg(feature = "otel")]
            crate::otel::metrics::Relay::get().sent(destination_name(
                &message.exchange,
                &message.routing_key,
                None,
            ));
            None
        }
        Said::Refused { .. } => Some("refused"),
        Said::Unknown(_) => Some("unconfirmed"),
    };
    if let Some(error_type) = error_type {
        span.record("error.type", error_type);
        span.record("otel.status_code", "ERROR");
    }
    #[cfg(not(feature = "otel"))]
    let _ = message;
}

/// The `traceparent` (and `tracestate`) staged with the message.
#[cfg(feature = "otel")]
fn creation_context(message: &Staged) -> Option<opentelemetry::trace::SpanContext> {
    use crate::headers::{TRACEPARENT_HEADER, TRACESTATE_HEADER};
    if !message.headers.contains(TRACEPARENT_HEADER) {
        return None;
    }
    let headers: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&message.headers).ok()?;
    let traceparent = headers.get(TRACEPARENT_HEADER)?.as_str()?;
    let tracestate = headers.get(TRACESTATE_HEADER).and_then(|v| v.as_str());
    crate::otel::context::span_context(traceparent, tracestate)
}
