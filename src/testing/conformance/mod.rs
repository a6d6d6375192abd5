//! Contract tests for your own stores: one call runs idempo's checks of the
//! [`IdempotencyStore`](crate::http::IdempotencyStore) contract (feature
//! `http`) or of the [`WindowStore`](crate::window::WindowStore) contract
//! (feature `window`) against a store, and says which check failed and how.
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
//! let report = conformance::idempotency_store(&MemoryStore::new()).await?;
//! assert_eq!(report.passed.len(), conformance::IDEMPOTENCY_STORE_CHECKS.len());
//!
//! let report = conformance::window_store(&MemoryWindow::new(10_000)).await?;
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
//! The checks are listed in [`IDEMPOTENCY_STORE_CHECKS`] and
//! [`WINDOW_STORE_CHECKS`], in the order a failure is reported when several
//! fail.

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

/// How long a lease or TTL that must run out during a check lasts.
const SHORT: Duration = Duration::from_millis(200);
/// How long a check waits for [`SHORT`] to run out.
const WAIT: Duration = Duration::from_millis(500);
/// How long a lease or TTL that must outlive a check lasts.
const LONG: Duration = Duration::from_secs(30);
/// How many calls race on one key in the concurrency checks.
const RACERS: usize = 16;

/// What a passing run did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// The checks that ran, all passed, in the order they are listed.
    pub passed: Vec<&'static str>,
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
        )
    }
}

/// A store broke its contract: which check caught it, and how.
///
/// When several checks fail, this is the first of them in the list
/// ([`IDEMPOTENCY_STORE_CHECKS`], [`WINDOW_STORE_CHECKS`]), and
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

/// Names the step of a store call whose error fails the check.
trait During<T> {
    fn during(self, step: &str) -> Result<T, Failure>;
}

impl<T> During<T> for crate::Result<T> {
    fn during(self, step: &str) -> Result<T, Failure> {
        self.map_err(|source| Failure::Store {
            step: step.to_owned(),
            source,
        })
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

type Check<'a> = (&'static str, BoxFuture<'a, Result<(), Failure>>);

/// Runs the checks concurrently and reports the first failure in list order.
async fn run(checks: Vec<Check<'_>>) -> Result<Report, ConformanceError> {
    let started = Instant::now();
    let (names, futures): (Vec<_>, Vec<_>) = checks.into_iter().unzip();
    let outcomes = futures::future::join_all(futures).await;
    let mut failures = names
        .iter()
        .zip(outcomes)
        .filter_map(|(name, outcome)| outcome.err().map(|failure| (*name, failure)))
        .collect::<Vec<_>>()
        .into_iter();
    match failures.next() {
        None => Ok(Report {
            passed: names,
            elapsed: started.elapsed(),
        }),
        Some((check, failure)) => Err(ConformanceError {
            check,
            failure,
            also_failed: failures.map(|(name, _)| name).collect(),
        }),
    }
}

/// The checks named by their functions, each called with `ctx`.
macro_rules! checks {
    ($ctx:expr; $($name:ident,)+) => {
        vec![$(check(stringify!($name), $name($ctx))),+]
    };
}

fn check<'a>(
    name: &'static str,
    future: impl Future<Output = Result<(), Failure>> + Send + 'a,
) -> Check<'a> {
    (name, Box::pin(future))
}

/// Strings that break stores built carelessly: quotes and backslashes (SQL),
/// `%`, `_`, `*`, `?`, `[` (LIKE and glob patterns), `{`, `}` (Redis Cluster
/// hash tags), `:` (key separators), whitespace and line breaks, control
/// characters, non-ASCII text, and strings that are prefixes of each other.
const HOSTILE: &[&str] = &[
    "'",
    "''",
    "\\",
    "\\'",
    "\"",
    "$1",
    "$$x$$",
    "'); DROP TABLE t; --",
    "%",
    "_",
    "*",
    "?",
    "[a-z]",
    "{",
    "}",
    "{tag}",
    ":",
    "::",
    "a:b",
    "a",
    "a:",
    " ",
    "line\nbreak\r\n",
    "\t\u{1}\u{7f}",
    "💸🦀",
    "\u{202E}evil",
    "e\u{301}",
    "\u{feff}",
];

#[cfg(feature = "http")]
mod idempotency_store;
#[cfg(feature = "window")]
mod window_store;

#[cfg(feature = "http")]
pub use self::idempotency_store::{IDEMPOTENCY_STORE_CHECKS, idempotency_store};
#[cfg(feature = "window")]
pub use self::window_store::{WINDOW_STORE_CHECKS, window_store};
