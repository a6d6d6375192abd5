//! What the runtime writes on a unit's process span: the fields a
//! transport's span declares (the transport opens the span, since its
//! attributes name its broker; see [`crate::otel`] for the whole list) and
//! the producers' contexts it ties the span to.
//!
//! The fields the runtime records, by name: `messaging.message.id`,
//! `idempo.claim`, `idempo.attempt`, `idempo.settlement`,
//! `idempo.retry.delay_ms`, `error.type` and `otel.status_code`. A field
//! the span does not declare is ignored by `tracing`.

use tracing::Span;

use crate::runtime::dead_letter::DeadLetterReason;
use crate::runtime::message::Message;
use crate::runtime::outcome::Settled;
use crate::runtime::route::Route;

/// Ties `span` to the creation context of each message (the `traceparent`
/// header): a link for every one, and the parent for a unit of one. Called
/// before the span is first entered (its parent is fixed from then on).
pub(crate) fn link_producers(span: &Span, messages: &[Message]) {
    #[cfg(feature = "otel")]
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;

        use crate::headers::{TRACEPARENT_HEADER, TRACESTATE_HEADER};
        use crate::otel::context;

        if span.is_disabled() {
            return;
        }
        for message in messages {
            let Some(traceparent) = message.header_text(TRACEPARENT_HEADER) else {
                continue;
            };
            let tracestate = message.header_text(TRACESTATE_HEADER);
            let Some(producer) = context::span_context(&traceparent, tracestate.as_deref()) else {
                continue;
            };
            if messages.len() == 1 {
                // Without an OpenTelemetry layer there is nothing to parent.
                let _ = span.set_parent(context::remote_parent(producer.clone()));
            }
            span.add_link(producer);
        }
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = (span, messages);
    }
}

/// Records what was decided for the one message of a unit: its id, its
/// attempt, the claim's outcome and, for a failure, its class.
pub(crate) fn decided(span: &Span, message: &Message, route: &Route) {
    if span.is_disabled() {
        return;
    }
    span.record("messaging.message.id", message.id());
    span.record(
        "idempo.attempt",
        message.failed_attempts().saturating_add(1),
    );
    if let Some(claim) = claim(route) {
        span.record("idempo.claim", claim);
    }
    if let Route::Delay { delay, .. } = route {
        span.record("idempo.retry.delay_ms", delay.as_millis() as u64);
    }
    if let Some(error_type) = error_type(route) {
        span.record("error.type", error_type);
        span.record("otel.status_code", "ERROR");
    }
}

/// Records how the unit's one message was settled.
pub(crate) fn settled(span: &Span, settled: Settled) {
    span.record("idempo.settlement", settled.as_str());
}

/// The class of a failed delivery's error: the dead letter's reason, or the
/// cause of its retry.
fn error_type(route: &Route) -> Option<&'static str> {
    match route {
        Route::Ack { .. } | Route::Abandon => None,
        Route::DeadLetter { reason, .. } => Some(reason.error_type()),
        Route::Delay { cause, .. } | Route::Requeue { cause, .. } => Some(cause.error_type()),
    }
}

/// The claim's outcome a route implies: none when the message never reached
/// the inbox (no usable id, an undecodable body).
fn claim(route: &Route) -> Option<&'static str> {
    match route {
        Route::Ack { duplicate: true } => Some("duplicate"),
        Route::DeadLetter {
            reason:
                DeadLetterReason::MissingMessageId
                | DeadLetterReason::InvalidMessageId
                | DeadLetterReason::UndecodableBody
                | DeadLetterReason::UndecodableProperties
                | DeadLetterReason::HeadersTooLarge,
            ..
        }
        | Route::Abandon => None,
        Route::DeadLetter {
            reason: DeadLetterReason::PayloadMismatch,
            ..
        } => Some("mismatch"),
        _ => Some("fresh"),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::runtime::headers::Failures;
    use crate::runtime::outcome::RetryCause;

    #[test]
    fn the_claim_follows_the_route() {
        assert_eq!(claim(&Route::Ack { duplicate: false }), Some("fresh"));
        assert_eq!(claim(&Route::Ack { duplicate: true }), Some("duplicate"));
        let letter = |reason| Route::DeadLetter {
            reason,
            error: String::new(),
            failures: Failures {
                attempts: 1,
                first_failure: String::new(),
                last_failure: String::new(),
            },
        };
        assert_eq!(
            claim(&letter(DeadLetterReason::PayloadMismatch)),
            Some("mismatch")
        );
        assert_eq!(claim(&letter(DeadLetterReason::UndecodableBody)), None);
        assert_eq!(
            claim(&letter(DeadLetterReason::PermanentError)),
            Some("fresh")
        );
        assert_eq!(claim(&Route::Abandon), None);
    }

    #[test]
    fn a_failure_is_classed_by_its_reason_or_its_retry_cause() {
        use crate::runtime::handler::HandlerError;
        use crate::runtime::outcome::{Outcome, handler_failed, timed_out};

        let cause = |outcome: Outcome| match outcome {
            Outcome::Retry { cause, .. } => Route::Requeue {
                pause: Duration::ZERO,
                cause,
                error: String::new(),
            },
            other => panic!("not a retry: {other:?}"),
        };
        let handler = cause(handler_failed(HandlerError::transient("busy")));
        assert_eq!(error_type(&handler), Some("handler_error"));
        let timeout = cause(timed_out(Duration::from_secs(1)));
        assert_eq!(error_type(&timeout), Some("timeout"));
        let delayed = Route::Delay {
            delay: Duration::from_secs(1),
            cause: RetryCause::Database,
            error: String::new(),
            failures: Failures {
                attempts: 1,
                first_failure: String::new(),
                last_failure: String::new(),
            },
        };
        assert_eq!(error_type(&delayed), Some("database"));
        assert_eq!(error_type(&Route::Ack { duplicate: false }), None);
    }
}
