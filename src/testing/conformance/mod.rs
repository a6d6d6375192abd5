//! Contract tests for your own transports and stores: one call runs
//! idempo's checks of the [transport seam](crate::consumer::transport)
//! ([`Report::transport`]: a consumer on it must be exactly once under redelivery,
//! keep a group's order, retry after the policy's delay, dead-letter with a
//! reason, never let poison block the queue, settle what is in flight on a
//! graceful stop, reconnect after a cut, and forward through the outbox with
//! a stable id), of the [`IdempotencyStore`](crate::http::IdempotencyStore)
//! contract (feature `http`) or of the [`WindowStore`](crate::window::WindowStore)
//! contract (feature `window`), and says which check failed and how. idempo
//! runs the transport kit on RabbitMQ, JetStream and the in-memory
//! [`MemoryBroker`](crate::testing::MemoryBroker) (`tests/transports.rs`).
//!
//! ```no_run
//! use idempo::consumer::ConsumerBuilder;
//! use idempo::testing::conformance::{self, TransportUnderTest};
//! use idempo::testing::{Memory, MemoryBroker};
//!
//! /// Your transport here: how the kit starts a consumer on it and
//! /// publishes to it (and, optionally, cuts it and reads forwards).
//! struct InMemory(MemoryBroker);
//!
//! impl TransportUnderTest for InMemory {
//!     type Transport = Memory;
//!
//!     fn consumer(&self, source: &str, pool: sqlx::PgPool) -> ConsumerBuilder<Memory> {
//!         self.0.consumer(source, pool)
//!     }
//!
//!     async fn publish(&self, source: &str, id: &str, headers: &[(&str, &str)], body: &[u8])
//!         -> Result<(), String>
//!     {
//!         self.0.publish(source, id, body, headers);
//!         Ok(())
//!     }
//! }
//!
//! # async fn doc(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let report = conformance::Report::transport(&InMemory(MemoryBroker::new()), &pool).await?;
//! println!("{report}"); // "6 checks passed in 3.8s: ...; skipped: it_reconnects_after_a_cut, ..."
//! # Ok(()) }
//! ```
//!
//! The store kits:
//!
//! ```
//! # #[cfg(all(feature = "http", feature = "window"))]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use idempo::http::MemoryStore;
//! use idempo::testing::conformance;
//! use idempo::window::MemoryWindow;
//!
//! // In your test suite, pass your own store instead.
//! let report = conformance::Report::idempotency_store(&MemoryStore::new()).await?;
//! assert_eq!(report.passed.len(), conformance::Report::IDEMPOTENCY_STORE_CHECKS.len());
//!
//! let report = conformance::Report::window_store(&MemoryWindow::new(10_000)).await?;
//! println!("{report}"); // "14 checks passed in 510ms: insert_records_a_new_id, ..."
//! # Ok(()) }
//! # #[cfg(not(all(feature = "http", feature = "window")))]
//! # fn main() {}
//! ```
//!
//! A failure is a [`ConformanceError`] that names the check, the step and
//! what was expected and found, for example:
//!
//! ```text
//! the store failed the conformance check `another_fingerprint_is_a_mismatch`:
//! begin with another fingerprint while the first request runs:
//! expected Mismatch, found InProgress { lease_left: Some(29.99s) }
//! ```
//!
//! # How the checks run
//! - **On a shared store.** Each run picks a random run id, and every check
//!   works on keys of its own under it (users `idempo-conformance-<run>` for
//!   idempotency records, keys `idempo-conformance:<run>:...` in a window).
//!   So the kit can run against a store that other tests, or other runs of
//!   the kit, use at the same time; it never looks at other keys.
//! - **Concurrently.** The checks run at the same time, and some race many
//!   calls on one key: that is where a store that is not atomic shows.
//! - **In about half a second.** The checks that need time to pass use leases
//!   and TTLs of 200 ms and wait 500 ms, in real time: run the kit on a
//!   runtime whose clock is not paused (a paused clock does not move a
//!   database's or Redis's clock). Everything else the kit writes lives 30
//!   seconds, so a store whose entries expire by themselves is clean a
//!   minute later; a store that keeps expired rows until its
//!   `delete_expired` runs keeps the kit's until then.
//! - **Against the contract, not one implementation.** What a check asks is
//!   what the trait's documentation promises; where idempo's own stores
//!   legitimately differ (after a dead holder's lease ran out, PostgreSQL and
//!   memory still know the record's fingerprint while Redis does not) no
//!   check asks.
//!
//! idempo runs this kit against its own stores (memory, PostgreSQL, Redis).
//! The checks are listed in [`Report::IDEMPOTENCY_STORE_CHECKS`] and
//! [`Report::WINDOW_STORE_CHECKS`], in the order a failure is reported when several
//! fail.

use std::fmt;
use std::time::Duration;

/// What a passing run did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// The checks that ran, all passed, in the order they are listed.
    pub passed: Vec<&'static str>,
    /// The checks the subject cannot show (a transport that cannot be cut
    /// from outside, or has no outbox relay), not run.
    pub skipped: Vec<&'static str>,
    /// How long the run took.
    pub elapsed: Duration,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} checks passed in {:?}: {}",
            self.passed.len(),
            self.elapsed,
            self.passed.join(", ")
        )?;
        if !self.skipped.is_empty() {
            write!(f, "; skipped: {}", self.skipped.join(", "))?;
        }
        Ok(())
    }
}

/// A store broke its contract: which check caught it, and how.
///
/// When several checks fail, this is the first of them in the list
/// ([`Report::IDEMPOTENCY_STORE_CHECKS`], [`Report::WINDOW_STORE_CHECKS`]), and
/// [`also_failed`](Self::also_failed) names the others.
#[derive(Debug, thiserror::Error)]
#[error("the store failed the conformance check `{check}`: {failure}{}", also(.also_failed))]
#[non_exhaustive]
pub struct ConformanceError {
    /// The name of the check that failed.
    pub check: &'static str,
    /// What it found.
    pub failure: Failure,
    /// The other checks that failed in the same run.
    pub also_failed: Vec<&'static str>,
}

fn also(others: &[&'static str]) -> String {
    if others.is_empty() {
        String::new()
    } else {
        format!(" (also failed: {})", others.join(", "))
    }
}

/// How a check failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Failure {
    /// The store answered, but not as the contract says.
    #[error("{step}: expected {expected}, found {found}")]
    Unexpected {
        /// The step of the check (what it called, and in which state).
        step: String,
        /// What the contract says the answer is.
        expected: String,
        /// What the store answered.
        found: String,
    },
    /// The store returned an error where the contract expects an answer.
    #[error("{step}: the store returned an error: {source}")]
    Store {
        /// The step of the check.
        step: String,
        /// The store's error.
        #[source]
        source: crate::Error,
    },
}

fn unexpected(step: &str, expected: impl Into<String>, found: impl fmt::Debug) -> Failure {
    Failure::Unexpected {
        step: step.to_owned(),
        expected: expected.into(),
        found: format!("{found:?}"),
    }
}

/// `found` must be `want`.
fn expect_eq<T: PartialEq + fmt::Debug>(step: &str, found: T, want: T) -> Result<(), Failure> {
    if found == want {
        Ok(())
    } else {
        Err(unexpected(step, format!("{want:?}"), found))
    }
}

/// A random id for one run: its keys are no other run's.
fn run_id() -> String {
    hex::encode(crate::random::bytes::<8>().expect("the operating system gives random bytes"))
}

/// The checks named by their functions, each called with `ctx`.
#[cfg(any(feature = "http", feature = "window"))]
macro_rules! checks {
    ($ctx:expr; $($name:ident,)+) => {
        vec![$(check(stringify!($name), $name($ctx))),+]
    };
}

#[cfg(feature = "http")]
mod idempotency_store;
#[cfg(any(feature = "http", feature = "window"))]
mod stores;
mod transport;
mod transport_checks;
#[cfg(any(feature = "http", feature = "window"))]
use stores::*;
#[cfg(feature = "window")]
mod window_store;

pub use self::transport::TransportUnderTest;
