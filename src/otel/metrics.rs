//! The instruments idempo records through the global meter: what the
//! application's meter provider (if any) exports. Names and units follow
//! the messaging conventions where they have one.

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter};

const GROUP: &str = "messaging.consumer.group.name";

fn meter() -> Meter {
    opentelemetry::global::meter("idempo")
}

/// A consumer's instruments, with its group attribute made once.
pub(crate) struct Consumer {
    group: KeyValue,
    consumed: Counter<u64>,
    claims: Counter<u64>,
    retries: Counter<u64>,
    dead_letters: Counter<u64>,
    process: Histogram<f64>,
}

impl Consumer {
    pub(crate) fn new(consumer: &str) -> Self {
        let meter = meter();
        Consumer {
            // Shared, so that each record's copy is a reference count.
            group: KeyValue::new(GROUP, std::sync::Arc::<str>::from(consumer)),
            consumed: meter
                .u64_counter("messaging.client.consumed.messages")
                .with_unit("{message}")
                .with_description("Messages delivered to the consumer")
                .build(),
            claims: meter
                .u64_counter("idempo.claims")
                .with_unit("{claim}")
                .with_description("Inbox claims by outcome (fresh, duplicate, mismatch)")
                .build(),
            retries: meter
                .u64_counter("idempo.retries")
                .with_unit("{message}")
                .with_description("Deliveries sent to be redelivered later")
                .build(),
            dead_letters: meter
                .u64_counter("idempo.dead_letters")
                .with_unit("{message}")
                .with_description("Deliveries dead-lettered, by reason (error.type)")
                .build(),
            process: meter
                .f64_histogram("messaging.process.duration")
                .with_unit("s")
                .with_description("Duration of the handler's run on a delivery")
                .build(),
        }
    }

    pub(crate) fn consumed(&self) {
        self.consumed.add(1, std::slice::from_ref(&self.group));
    }

    pub(crate) fn claim(&self, outcome: &'static str) {
        self.claims.add(
            1,
            &[self.group.clone(), KeyValue::new("idempo.claim", outcome)],
        );
    }

    pub(crate) fn retried(&self) {
        self.retries.add(1, std::slice::from_ref(&self.group));
    }

    pub(crate) fn dead_lettered(&self, reason: &'static str) {
        self.dead_letters.add(
            1,
            &[self.group.clone(), KeyValue::new("error.type", reason)],
        );
    }

    pub(crate) fn processed_in(&self, elapsed: Duration) {
        self.process
            .record(elapsed.as_secs_f64(), std::slice::from_ref(&self.group));
    }
}

/// The relay's instruments (one set per process).
#[cfg(feature = "outbox")]
pub(crate) struct Relay {
    sent: Counter<u64>,
    send: Histogram<f64>,
    pending: opentelemetry::metrics::Gauge<u64>,
    oldest: opentelemetry::metrics::Gauge<f64>,
}

#[cfg(feature = "outbox")]
impl Relay {
    pub(crate) fn get() -> &'static Relay {
        static RELAY: std::sync::OnceLock<Relay> = std::sync::OnceLock::new();
        RELAY.get_or_init(|| {
            let meter = meter();
            Relay {
                sent: meter
                    .u64_counter("messaging.client.sent.messages")
                    .with_unit("{message}")
                    .with_description("Outbox messages the broker confirmed")
                    .build(),
                send: meter
                    .f64_histogram("messaging.client.operation.duration")
                    .with_unit("s")
                    .with_description("Publish latency: from sending to the broker's confirm")
                    .build(),
                pending: meter
                    .u64_gauge("idempo.outbox.pending")
                    .with_unit("{message}")
                    .with_description("Rows waiting in the outbox")
                    .build(),
                oldest: meter
                    .f64_gauge("idempo.outbox.oldest_age")
                    .with_unit("s")
                    .with_description("Age of the oldest row waiting in the outbox")
                    .build(),
            }
        })
    }

    /// One message confirmed by the broker, sent to `destination`.
    pub(crate) fn sent(&self, destination: String) {
        let attributes = [
            KeyValue::new("messaging.operation.name", "send"),
            KeyValue::new("messaging.destination.name", destination),
        ];
        self.sent.add(1, &attributes);
    }

    /// A batch's publish, from the first message sent to the last answer.
    pub(crate) fn published_in(&self, elapsed: Duration) {
        self.send.record(
            elapsed.as_secs_f64(),
            &[KeyValue::new("messaging.operation.name", "send")],
        );
    }

    pub(crate) fn outbox(&self, pending: u64, oldest: Option<Duration>) {
        self.pending.record(pending, &[]);
        self.oldest
            .record(oldest.map_or(0.0, |d| d.as_secs_f64()), &[]);
    }
}
