//! OpenTelemetry (feature `otel`): traces and metrics by the
//! [semantic conventions for messaging](https://opentelemetry.io/docs/specs/semconv/messaging/)
//! (v1.44.0, status *development*), and [`Telemetry`] for an application
//! that exports them over OTLP/HTTP.
//!
//! The library installs nothing global. It instruments through `tracing`:
//! its spans carry the conventions' attributes as fields (and `otel.name`,
//! `otel.kind`, `otel.status_code`), which `tracing-opentelemetry` turns
//! into OpenTelemetry spans when your subscriber has its layer. Metrics go
//! to the global meter (`opentelemetry::global::meter("idempo")`), which
//! records nothing until the application sets a meter provider.
//!
//! # Spans
//!
//! | span | kind | when |
//! |---|---|---|
//! | `process <destination>` | CONSUMER | each delivery, or each batch in batch mode |
//! | `send <destination>` | PRODUCER | each outbox message the relay publishes |
//!
//! A process span carries `messaging.system`, `messaging.operation.name`
//! (`process`), `messaging.operation.type` (`process`),
//! `messaging.destination.name`, `messaging.consumer.group.name` (the idempo
//! consumer), `messaging.message.id`, `messaging.message.body.size`, the
//! transport's own (`messaging.rabbitmq.destination.routing_key`,
//! `messaging.rabbitmq.message.delivery_tag`), and idempo's:
//! `idempo.claim` (`fresh`, `duplicate`, `mismatch`), `idempo.attempt` (1 for
//! a first delivery), `idempo.settlement` (`processed`, `duplicate`,
//! `retried`, `dead_lettered`, `abandoned`) and `idempo.retry.delay_ms`. A
//! failure sets status ERROR with `error.type`: the dead letter's reason
//! (`undecodable_body`, `payload_mismatch`, `permanent_error`,
//! `attempts_exhausted`, ...) or, for a delivery retried later, its cause:
//! `handler_error` (a transient error returned), `timeout`, `panic`,
//! `database` (the claim or the commit failed) or `dedup_window`.
//! Batch spans carry `messaging.batch.message_count` instead of the
//! per-message attributes. The handler's own `tracing` spans are children of
//! the process span.
//!
//! **Producer context.** A message's `traceparent` (and `tracestate`)
//! headers hold its creation context. Every process span **links** to the
//! creation context of each of its messages, as the conventions ask. A
//! process span of **one** message also takes that context as its **parent**,
//! so that the producer, the consumer and what the consumer publishes in turn
//! read as one trace in Jaeger or Tempo; a batch span has only the links.
//! Retry and delay copies, dead letters (in the queue or the table) and
//! replays keep the original headers byte for byte, so each later attempt
//! and each replay joins the trace of the message's first delivery.
//!
//! **The outbox.** With a traced span current, [`stage`](crate::outbox::stage)
//! writes that span's context as the message's `traceparent` (the creation
//! context); the relay's `send` span is its child, and the message goes out
//! with the creation context, so the next consumer ties back to the one
//! that staged it.
//!
//! # Metrics
//!
//! | instrument | kind | attributes |
//! |---|---|---|
//! | `messaging.process.duration` (s) | histogram | `messaging.consumer.group.name` |
//! | `messaging.client.consumed.messages` | counter | `messaging.consumer.group.name` |
//! | `idempo.claims` | counter | the group, `idempo.claim` |
//! | `idempo.retries` | counter | the group |
//! | `idempo.dead_letters` | counter | the group, `error.type` (the reason) |
//! | `messaging.client.sent.messages` | counter | `messaging.destination.name` |
//! | `messaging.client.operation.duration` (s) | histogram | `messaging.operation.name` = `send` (the relay's publish latency) |
//! | `idempo.outbox.pending` | gauge | rows waiting in the outbox, as the relay last counted |
//! | `idempo.outbox.oldest_age` (s) | gauge | the age of the oldest waiting row |
//!
//! # Exporting
//!
//! ```no_run
//! use tracing_subscriber::layer::SubscriberExt;
//! use tracing_subscriber::util::SubscriberInitExt;
//!
//! # fn main() -> Result<(), idempo::otel::TelemetryError> {
//! // None when no OTLP endpoint is configured: nothing is exported.
//! let telemetry = idempo::otel::Telemetry::from_env("payments")?;
//! tracing_subscriber::registry()
//!     .with(telemetry.as_ref().map(|t| t.layer()))
//!     .init();
//! // ... run the consumer; at the end, flush what is buffered:
//! if let Some(telemetry) = telemetry {
//!     telemetry.shutdown();
//! }
//! # Ok(())
//! # }
//! ```

// The trace context is read by the consumer runtime and the relay, and
// written by the outbox's staging; the instruments are the runtime's and
// the relay's.
#[cfg(any(idempo_runtime, feature = "outbox"))]
pub(crate) mod context;
#[cfg(idempo_runtime)]
pub(crate) mod metrics;
mod telemetry;

pub use telemetry::{Telemetry, TelemetryError};
