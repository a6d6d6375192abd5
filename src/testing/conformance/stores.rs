//! What the store kits share: their timings, their runner (checks run
//! concurrently, the first failure in list order reported), and the
//! strings that break careless stores.

use std::future::Future;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use super::{ConformanceError, Failure, Report};

/// How long a lease or TTL that must run out during a check lasts.
pub(super) const SHORT: Duration = Duration::from_millis(200);
/// How long a check waits for [`SHORT`] to run out.
pub(super) const WAIT: Duration = Duration::from_millis(500);
/// How long a lease or TTL that must outlive a check lasts.
pub(super) const LONG: Duration = Duration::from_secs(30);
/// How many calls race on one key in the concurrency checks.
pub(super) const RACERS: usize = 16;

/// Names the step of a store call whose error fails the check.
pub(super) trait During<T> {
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

pub(super) type Check<'a> = (&'static str, BoxFuture<'a, Result<(), Failure>>);

/// Runs the checks concurrently and reports the first failure in list order.
pub(super) async fn run(checks: Vec<Check<'_>>) -> Result<Report, ConformanceError> {
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
            skipped: Vec::new(),
            elapsed: started.elapsed(),
        }),
        Some((check, failure)) => Err(ConformanceError {
            check,
            failure,
            also_failed: failures.map(|(name, _)| name).collect(),
        }),
    }
}

pub(super) fn check<'a>(
    name: &'static str,
    future: impl Future<Output = Result<(), Failure>> + Send + 'a,
) -> Check<'a> {
    (name, Box::pin(future))
}

/// Strings that break stores built carelessly: quotes and backslashes (SQL),
/// `%`, `_`, `*`, `?`, `[` (LIKE and glob patterns), `{`, `}` (Redis Cluster
/// hash tags), `:` (key separators), whitespace and line breaks, control
/// characters, non-ASCII text, and strings that are prefixes of each other.
pub(super) const HOSTILE: &[&str] = &[
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
