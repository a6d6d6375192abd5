//! W3C trace context in and out of message headers: the creation context a
//! message carries (read by the consumer runtime and the relay), and the
//! current span's context for what is staged (the outbox).

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt;
#[cfg(idempo_runtime)]
use opentelemetry::{Context, propagation::Extractor, trace::SpanContext};
use opentelemetry_sdk::propagation::TraceContextPropagator;

use crate::headers::TRACEPARENT_HEADER;

#[cfg(idempo_runtime)]
struct Carrier<'a> {
    traceparent: &'a str,
    tracestate: Option<&'a str>,
}

#[cfg(idempo_runtime)]
impl Extractor for Carrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT_HEADER => Some(self.traceparent),
            crate::headers::TRACESTATE_HEADER => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT_HEADER, crate::headers::TRACESTATE_HEADER]
    }
}

/// The span context a `traceparent` (and `tracestate`) names, when valid.
#[cfg(idempo_runtime)]
pub(crate) fn span_context(traceparent: &str, tracestate: Option<&str>) -> Option<SpanContext> {
    // The propagator does not check the shape whole (it takes
    // `00-abc-def-01` for a trace).
    crate::trace_id::trace_id(traceparent)?;
    let carrier = Carrier {
        traceparent,
        tracestate,
    };
    let cx = TraceContextPropagator::new().extract(&carrier);
    let span = cx.span().span_context().clone();
    span.is_valid().then_some(span)
}

/// A context whose (remote) parent is `span`.
#[cfg(idempo_runtime)]
pub(crate) fn remote_parent(span: SpanContext) -> Context {
    Context::new().with_remote_span_context(span)
}

/// The current `tracing` span's OpenTelemetry context as a `traceparent`,
/// when there is a traced span (an OpenTelemetry layer is installed).
#[cfg(feature = "outbox")]
pub(crate) fn current_traceparent() -> Option<String> {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut headers = std::collections::HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut headers);
    headers.remove(TRACEPARENT_HEADER)
}

#[cfg(all(test, idempo_runtime))]
mod tests {
    use super::*;

    #[test]
    fn a_valid_traceparent_names_its_span() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let span = span_context(tp, Some("vendor=x")).expect("valid");
        assert_eq!(
            span.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(span.span_id().to_string(), "00f067aa0ba902b7");
        assert!(span.is_remote());
        assert_eq!(span.trace_state().get("vendor"), Some("x"));
    }

    #[test]
    fn garbage_names_no_span() {
        assert!(span_context("00-abc-def-01", None).is_none());
        assert!(span_context("", None).is_none());
        let upper = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01";
        assert!(span_context(upper, None).is_none());
        let extra = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x";
        assert!(span_context(extra, None).is_none());
        assert!(
            span_context(
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                None
            )
            .is_none()
        );
    }

    #[test]
    fn without_a_layer_there_is_no_current_context() {
        let span = tracing::info_span!("plain");
        let _entered = span.enter();
        assert_eq!(current_traceparent(), None);
    }
}
