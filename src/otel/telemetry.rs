//! An application's OpenTelemetry export, configured by the standard
//! `OTEL_*` environment variables only.

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{MetricExporter, SpanExporter};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetryLayer;

/// The endpoints that turn the export on: any one of them set.
const ENDPOINTS: [&str; 3] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
];

/// How long [`Telemetry::shutdown`] waits for the last export.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the export could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TelemetryError {
    /// `OTEL_EXPORTER_OTLP_PROTOCOL` names a protocol idempo is not built with.
    #[error(
        "OTEL_EXPORTER_OTLP_PROTOCOL={0:?} is not supported: idempo exports over \
         OTLP/HTTP with protobuf (set it to \"http/protobuf\", or unset it)"
    )]
    Protocol(String),
    /// The exporter refused its configuration (an endpoint that is not a URL,
    /// an invalid header).
    #[error("cannot set up the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// Traces and metrics exported over OTLP/HTTP (protobuf), as the standard
/// variables configure them: `OTEL_EXPORTER_OTLP_ENDPOINT` (or the
/// per-signal `…_TRACES_ENDPOINT` / `…_METRICS_ENDPOINT`),
/// `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_EXPORTER_OTLP_HEADERS`,
/// `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_SERVICE_NAME`,
/// `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` (and `_ARG`),
/// `OTEL_BSP_*` for the span queue and `OTEL_METRIC_EXPORT_INTERVAL`.
///
/// Spans wait in a bounded queue (`OTEL_BSP_MAX_QUEUE_SIZE`, 2,048 by
/// default) and leave from a thread of their own: a collector that is down
/// or slow never blocks a delivery; when the queue is full new spans are
/// dropped, and the SDK reports how many at shutdown. For the application's
/// `main` (the examples and the `idempo` binary use it); the library itself
/// installs nothing. See [the module](crate::otel) for what is recorded.
#[derive(Debug)]
pub struct Telemetry {
    tracer_provider: SdkTracerProvider,
    meter_provider: SdkMeterProvider,
    tracer: SdkTracer,
}

impl Telemetry {
    /// Builds the export from the environment, or `None` when no OTLP
    /// endpoint is set (or `OTEL_SDK_DISABLED=true`): then nothing is
    /// exported and nothing is said about it. `service_name` is the
    /// `service.name` unless `OTEL_SERVICE_NAME` or
    /// `OTEL_RESOURCE_ATTRIBUTES` names one.
    ///
    /// Sets the global meter provider (the library's metrics go to the
    /// global meter); the traces go through [`layer`](Self::layer).
    pub fn from_env(service_name: &str) -> Result<Option<Telemetry>, TelemetryError> {
        let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
        if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"))
            || !ENDPOINTS.iter().any(|name| set(name))
        {
            return Ok(None);
        }
        if let Ok(protocol) = std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL") {
            let protocol = protocol.trim();
            if !protocol.is_empty() && protocol != "http/protobuf" {
                return Err(TelemetryError::Protocol(protocol.to_owned()));
            }
        }
        let resource = resource(service_name);
        let spans = SpanExporter::builder().with_http().build()?;
        let tracer_provider = SdkTracerProvider::builder()
            .with_batch_exporter(spans)
            .with_resource(resource.clone())
            .build();
        let metrics = MetricExporter::builder().with_http().build()?;
        let meter_provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(metrics).build())
            .with_resource(resource)
            .build();
        opentelemetry::global::set_meter_provider(meter_provider.clone());
        let tracer = tracer_provider.tracer("idempo");
        Ok(Some(Telemetry {
            tracer_provider,
            meter_provider,
            tracer,
        }))
    }

    /// The `tracing` layer that turns spans into OpenTelemetry spans and
    /// hands them to the exporter: add it to your subscriber.
    ///
    /// Trimmed to what a trace backend shows of a message: no source
    /// location, thread, target or busy/idle attributes, and no OpenTelemetry
    /// context made current on every poll of a span's future (a delivery's
    /// span is entered at each of its awaits). Each costs CPU per span; build
    /// your own `tracing_opentelemetry::layer()` over [`tracer`](Self::tracer)
    /// for them.
    pub fn layer<S>(&self) -> OpenTelemetryLayer<S, SdkTracer>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.tracer.clone())
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_context_activation(false)
    }

    /// The tracer the layer exports through.
    pub fn tracer(&self) -> SdkTracer {
        self.tracer.clone()
    }

    /// Exports what is buffered and stops, waiting up to 5 s for the
    /// collector. Call it once the consumer has drained (after SIGTERM).
    /// Blocks: in async code, call it from `spawn_blocking`.
    pub fn shutdown(self) {
        if let Err(e) = self.tracer_provider.shutdown_with_timeout(FLUSH_TIMEOUT) {
            tracing::warn!(error = %e, "OpenTelemetry: the last spans were not exported");
        }
        if let Err(e) = self.meter_provider.shutdown_with_timeout(FLUSH_TIMEOUT) {
            tracing::warn!(error = %e, "OpenTelemetry: the last metrics were not exported");
        }
    }
}

/// The resource: the SDK's detectors (`OTEL_SERVICE_NAME`,
/// `OTEL_RESOURCE_ATTRIBUTES`), with `service_name` when they name none.
fn resource(service_name: &str) -> Resource {
    let detected = Resource::builder().build();
    let named = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.trim().is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| {
            v.split(',')
                .any(|kv| kv.trim().starts_with("service.name="))
        });
    if named {
        detected
    } else {
        Resource::builder()
            .with_service_name(service_name.to_owned())
            .build()
    }
}
