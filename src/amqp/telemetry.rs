//! RabbitMQ's names in the OpenTelemetry messaging conventions: the
//! destination a span names, and the process span a unit of deliveries runs
//! in (the runtime records the rest of its fields: `runtime/trace.rs`).

use tracing::{Span, field};

use crate::runtime::message::Message;

/// `messaging.destination.name` for RabbitMQ: `{exchange}:{routing key}` for
/// a send, with `:{queue}` for a receive; empty parts are left out, and a
/// routing key equal to the queue's name is named once.
pub(crate) fn destination_name(exchange: &str, routing_key: &str, queue: Option<&str>) -> String {
    let mut parts: Vec<&str> = Vec::with_capacity(3);
    if !exchange.is_empty() {
        parts.push(exchange);
    }
    if !routing_key.is_empty() && Some(routing_key) != queue {
        parts.push(routing_key);
    }
    if let Some(queue) = queue.filter(|q| !q.is_empty()) {
        parts.push(queue);
    }
    parts.join(":")
}

/// The CONSUMER span `process <destination>` of a unit: one delivery, or a
/// batch (then named after the queue, with the message count).
pub(crate) fn process_span(consumer: &str, queue: &str, messages: &[Message]) -> Span {
    match messages {
        [one] => {
            let span = one_span(consumer, one);
            if !span.is_disabled() {
                // Made only when the span is recorded.
                let destination = destination_name(exchange(one), one.routing_key(), Some(queue));
                span.record("otel.name", format!("process {destination}"));
                span.record("messaging.destination.name", destination);
            }
            span
        }
        many => tracing::info_span!(
            "process",
            otel.name = format!("process {queue}"),
            otel.kind = "consumer",
            messaging.system = "rabbitmq",
            messaging.operation.name = "process",
            "messaging.operation.type" = "process",
            messaging.destination.name = queue,
            messaging.consumer.group.name = consumer,
            messaging.batch.message_count = many.len(),
        ),
    }
}

/// The exchange an AMQP delivery was published to.
fn exchange(message: &Message) -> &str {
    message.amqp().map_or("", |amqp| amqp.exchange())
}

/// The span of a single delivery, its destination's name left to record.
fn one_span(consumer: &str, one: &Message) -> Span {
    tracing::info_span!(
        "process",
        otel.name = field::Empty,
        otel.kind = "consumer",
        otel.status_code = field::Empty,
        messaging.system = "rabbitmq",
        messaging.operation.name = "process",
        "messaging.operation.type" = "process",
        messaging.destination.name = field::Empty,
        messaging.consumer.group.name = consumer,
        messaging.message.id = field::Empty,
        messaging.message.body.size = one.body().len(),
        messaging.rabbitmq.destination.routing_key = one.routing_key(),
        messaging.rabbitmq.message.delivery_tag = one.delivery_tag(),
        idempo.redelivered = one.redelivered(),
        idempo.claim = field::Empty,
        idempo.attempt = field::Empty,
        idempo.settlement = field::Empty,
        idempo.retry.delay_ms = field::Empty,
        "error.type" = field::Empty,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_leave_out_empty_and_repeated_parts() {
        assert_eq!(
            destination_name("", "payments", Some("payments")),
            "payments"
        );
        assert_eq!(
            destination_name("shop", "paid", Some("payments")),
            "shop:paid:payments"
        );
        assert_eq!(destination_name("shop", "paid", None), "shop:paid");
        assert_eq!(destination_name("", "payments", None), "payments");
        assert_eq!(destination_name("shop", "", Some("q")), "shop:q");
    }
}
