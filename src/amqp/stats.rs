//! Counters a host can read while the consumer runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of one consumer. Cheap to clone; all clones see the same
/// numbers. Read them with [`Stats::snapshot`].
#[derive(Debug, Clone, Default)]
pub struct Stats {
    inner: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    deliveries: AtomicU64,
    processed: AtomicU64,
    duplicates: AtomicU64,
    payload_mismatches: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    commit_failures: AtomicU64,
}

/// The counters at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
    /// Deliveries handed back for a later retry (transient errors).
    pub retried: u64,
    /// Deliveries published to the dead-letter queue.
    pub dead_lettered: u64,
    /// Commits that failed or whose outcome is unknown.
    pub commit_failures: u64,
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
}

impl Stats {
    pub(crate) fn incr(&self, counter: Counter) {
        let c = &self.inner;
        let cell = match counter {
            Counter::Deliveries => &c.deliveries,
            Counter::Processed => &c.processed,
            Counter::Duplicates => &c.duplicates,
            Counter::PayloadMismatches => &c.payload_mismatches,
            Counter::Retried => &c.retried,
            Counter::DeadLettered => &c.dead_lettered,
            Counter::CommitFailures => &c.commit_failures,
        };
        cell.fetch_add(1, Ordering::Relaxed);
    }

    /// The current values.
    pub fn snapshot(&self) -> StatsSnapshot {
        let c = &self.inner;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            deliveries: get(&c.deliveries),
            processed: get(&c.processed),
            duplicates: get(&c.duplicates),
            payload_mismatches: get(&c.payload_mismatches),
            retried: get(&c.retried),
            dead_lettered: get(&c.dead_lettered),
            commit_failures: get(&c.commit_failures),
        }
    }
}
