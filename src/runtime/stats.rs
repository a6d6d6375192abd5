//! Counters a host can read while the consumer runs, mirrored to the `metrics` facade.
//!
//! Every counter is also emitted through the [`metrics`] crate with a
//! `consumer` label, so any exporter (Prometheus, StatsD, ...) installed by
//! the host picks them up:
//!
//! | metric | kind |
//! |---|---|
//! | `idempo_deliveries_total` | counter |
//! | `idempo_processed_total` | counter |
//! | `idempo_duplicates_total` | counter |
//! | `idempo_payload_mismatches_total` | counter |
//! | `idempo_retried_total` | counter |
//! | `idempo_dead_lettered_total` | counter |
//! | `idempo_commit_failures_total` | counter |
//! | `idempo_reconnects_total` | counter |
//! | `idempo_database_outages_total` | counter |
//! | `idempo_publish_failures_total` | counter |
//! | `idempo_session_failures_total` | counter |
//! | `idempo_poison_frames_total` | counter |
//! | `idempo_broker_refusals_total` | counter |
//! | `idempo_handler_duration_seconds` | histogram |
//!
//! Every counter's series exists (at zero) from the moment the consumer is
//! built, so a dashboard shows a consumer that never reached consuming.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Live counters of one consumer. Cheap to clone; all clones see the same
/// numbers. Read them with [`Stats::snapshot`] (`Debug` prints one).
#[derive(Clone)]
pub struct Stats {
    inner: Arc<Counters>,
}

impl std::fmt::Debug for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stats")
            .field("consumer", &self.inner.consumer)
            .field("now", &self.snapshot())
            .finish()
    }
}

struct Counters {
    consumer: String,
    cells: [AtomicU64; Counter::ALL.len()],
    /// The same counts as OpenTelemetry instruments (see [`crate::otel`]).
    #[cfg(feature = "otel")]
    otel: crate::otel::metrics::Consumer,
}

/// The counters at one instant (as JSON in the consumer's heartbeat).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Deliveries received from the broker.
    pub deliveries: u64,
    /// Deliveries whose handler ran and whose transaction committed.
    pub processed: u64,
    /// Deliveries acknowledged as already processed, without running the handler.
    pub duplicates: u64,
    /// Deliveries whose id was already processed with a different body.
    pub payload_mismatches: u64,
    /// Deliveries handed back for a later retry: transient errors, and
    /// retries or dead letters whose publish was not confirmed.
    pub retried: u64,
    /// Deliveries published to the dead-letter queue.
    pub dead_lettered: u64,
    /// Commits that failed or whose outcome is unknown.
    pub commit_failures: u64,
    /// Reconnections to the broker after a lost session.
    pub reconnects: u64,
    /// Retry and dead-letter copies the broker did not confirm (the
    /// original was handed back instead).
    pub publish_failures: u64,
    /// Broker sessions that ended in an error, whether or not they reached
    /// consuming (a refused connection, a topology conflict, a lost one).
    pub session_failures: u64,
    /// Deliveries whose frames the AMQP client could not parse (a property
    /// that is not valid UTF-8), moved to the dead-letter queue.
    pub poison_frames: u64,
    /// Times the database was found unreachable (deliveries then wait).
    pub database_outages: u64,
    /// Broker sessions, after the first good one, that the broker refused
    /// for a configuration reason (credentials, vhost, permissions, TLS):
    /// retried with backoff, and reported in `Health`.
    pub broker_refusals: u64,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    Deliveries,
    Processed,
    Duplicates,
    PayloadMismatches,
    Retried,
    DeadLettered,
    CommitFailures,
    Reconnects,
    DatabaseOutages,
    PublishFailures,
    SessionFailures,
    PoisonFrames,
    BrokerRefusals,
}

impl Counter {
    const ALL: [Counter; 13] = [
        Counter::Deliveries,
        Counter::Processed,
        Counter::Duplicates,
        Counter::PayloadMismatches,
        Counter::Retried,
        Counter::DeadLettered,
        Counter::CommitFailures,
        Counter::Reconnects,
        Counter::DatabaseOutages,
        Counter::PublishFailures,
        Counter::SessionFailures,
        Counter::PoisonFrames,
        Counter::BrokerRefusals,
    ];

    fn metric(self) -> &'static str {
        match self {
            Counter::Deliveries => "idempo_deliveries_total",
            Counter::Processed => "idempo_processed_total",
            Counter::Duplicates => "idempo_duplicates_total",
            Counter::PayloadMismatches => "idempo_payload_mismatches_total",
            Counter::Retried => "idempo_retried_total",
            Counter::DeadLettered => "idempo_dead_lettered_total",
            Counter::CommitFailures => "idempo_commit_failures_total",
            Counter::Reconnects => "idempo_reconnects_total",
            Counter::DatabaseOutages => "idempo_database_outages_total",
            Counter::PublishFailures => "idempo_publish_failures_total",
            Counter::SessionFailures => "idempo_session_failures_total",
            Counter::PoisonFrames => "idempo_poison_frames_total",
            Counter::BrokerRefusals => "idempo_broker_refusals_total",
        }
    }
}

impl Stats {
    pub(crate) fn new(consumer: &str) -> Self {
        for counter in Counter::ALL {
            // Registers the series at zero without touching its value.
            metrics::counter!(counter.metric(), "consumer" => consumer.to_owned()).increment(0);
        }
        Stats {
            inner: Arc::new(Counters {
                consumer: consumer.to_owned(),
                cells: Default::default(),
                #[cfg(feature = "otel")]
                otel: crate::otel::metrics::Consumer::new(consumer),
            }),
        }
    }

    pub(crate) fn incr(&self, counter: Counter) {
        self.inner.cells[counter as usize].fetch_add(1, Ordering::Relaxed);
        metrics::counter!(counter.metric(), "consumer" => self.inner.consumer.clone()).increment(1);
        #[cfg(feature = "otel")]
        {
            let otel = &self.inner.otel;
            match counter {
                Counter::Deliveries => otel.consumed(),
                Counter::Processed => otel.claim("fresh"),
                Counter::Duplicates => otel.claim("duplicate"),
                Counter::PayloadMismatches => otel.claim("mismatch"),
                Counter::Retried => otel.retried(),
                _ => {}
            }
        }
    }

    /// Counts a dead letter, with its reason for the OpenTelemetry counter.
    pub(crate) fn dead_lettered(&self, reason: crate::runtime::dead_letter::DeadLetterReason) {
        self.incr(Counter::DeadLettered);
        #[cfg(feature = "otel")]
        self.inner.otel.dead_lettered(reason.error_type());
        #[cfg(not(feature = "otel"))]
        let _ = reason;
    }

    pub(crate) fn handler_duration(&self, elapsed: Duration) {
        metrics::histogram!("idempo_handler_duration_seconds", "consumer" => self.inner.consumer.clone())
            .record(elapsed.as_secs_f64());
        #[cfg(feature = "otel")]
        self.inner.otel.processed_in(elapsed);
    }

    /// The current values.
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: Counter| self.inner.cells[c as usize].load(Ordering::Relaxed);
        StatsSnapshot {
            deliveries: get(Counter::Deliveries),
            processed: get(Counter::Processed),
            duplicates: get(Counter::Duplicates),
            payload_mismatches: get(Counter::PayloadMismatches),
            retried: get(Counter::Retried),
            dead_lettered: get(Counter::DeadLettered),
            commit_failures: get(Counter::CommitFailures),
            reconnects: get(Counter::Reconnects),
            database_outages: get(Counter::DatabaseOutages),
            publish_failures: get(Counter::PublishFailures),
            session_failures: get(Counter::SessionFailures),
            poison_frames: get(Counter::PoisonFrames),
            broker_refusals: get(Counter::BrokerRefusals),
        }
    }
}
