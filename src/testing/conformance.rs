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
    hex::encode(crate::random::bytes::<8>())
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
pub use self::idempotency_checks::{IDEMPOTENCY_STORE_CHECKS, idempotency_store};
#[cfg(feature = "window")]
pub use self::window_checks::{WINDOW_STORE_CHECKS, window_store};

#[cfg(feature = "http")]
mod idempotency_checks {
    use bytes::Bytes;
    use http::{HeaderName, HeaderValue, StatusCode, header};

    use super::*;
    use crate::http::{
        Begin, FencingToken, Fingerprint, IdempotencyStore, Operation, RecordKey, StoredResponse,
    };

    /// The checks [`idempotency_store`] runs, by name:
    ///
    /// | check | what the store must do |
    /// |---|---|
    /// | `begin_starts_a_fresh_key` | `begin` on a key never used: [`Begin::Started`] |
    /// | `a_live_lease_is_in_progress` | `begin` again while the first holder's lease is live: [`Begin::InProgress`], with at most the lease left |
    /// | `another_fingerprint_is_a_mismatch` | `begin` with another fingerprint, while in progress and once complete: [`Begin::Mismatch`] |
    /// | `a_completed_record_replays_its_response` | after `complete`, `begin` returns the response byte for byte: status, headers in order (repeated names, non-UTF-8 values), binary, empty and 1 MiB bodies |
    /// | `a_completed_record_is_final` | once complete, the token's `complete`, `extend` and `release` are refused and the first response stays |
    /// | `release_frees_the_key` | `release` deletes the record (a second `release` is refused) and any request starts again, with a new token |
    /// | `a_foreign_token_is_fenced` | `complete`, `extend`, `release` with another record's token, or a made-up one, are refused and change nothing |
    /// | `an_expired_lease_is_taken_over` | once the lease ran out, `begin` with the same fingerprint takes over with a new token, and the old token is fenced |
    /// | `extend_renews_the_lease` | after `extend`, the record stays in progress past the first lease |
    /// | `an_expired_record_counts_as_absent` | past its TTL, a completed record, or an in-progress one whose lease and TTL ran out, is absent: any request starts |
    /// | `concurrent_begins_start_once` | of 16 concurrent `begin`s on one key (one fingerprint, or two), exactly one starts; the others are in progress, or a mismatch |
    /// | `records_are_kept_apart` | keys that differ in user (none, `""`), method, path or key, or that a separator would join alike, are distinct records |
    /// | `hostile_keys_round_trip` | keys, users and paths with quotes, backslashes, wildcards, hash tags, line breaks, non-ASCII text and 255 characters start, complete and replay |
    /// | `delete_expired_keeps_live_records` | `delete_expired` keeps the live records (in progress, complete) |
    pub const IDEMPOTENCY_STORE_CHECKS: &[&str] = &[
        "begin_starts_a_fresh_key",
        "a_live_lease_is_in_progress",
        "another_fingerprint_is_a_mismatch",
        "a_completed_record_replays_its_response",
        "a_completed_record_is_final",
        "release_frees_the_key",
        "a_foreign_token_is_fenced",
        "an_expired_lease_is_taken_over",
        "extend_renews_the_lease",
        "an_expired_record_counts_as_absent",
        "concurrent_begins_start_once",
        "records_are_kept_apart",
        "hostile_keys_round_trip",
        "delete_expired_keeps_live_records",
    ];

    /// Runs the [`IdempotencyStore`] contract checks
    /// ([`IDEMPOTENCY_STORE_CHECKS`]) against `store`, concurrently, on
    /// fresh keys of its own: see [the module](crate::testing::conformance) for how.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let store = idempo::http::MemoryStore::new();
    /// if let Err(e) = idempo::testing::conformance::idempotency_store(&store).await {
    ///     panic!("{e}"); // names the check, the step, what was expected and found
    /// }
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`ConformanceError`] naming the first check (in list order) that
    /// failed, whether the store answered against the contract
    /// ([`Failure::Unexpected`]) or returned an error ([`Failure::Store`]).
    pub async fn idempotency_store<S: IdempotencyStore>(
        store: &S,
    ) -> Result<Report, ConformanceError> {
        let ctx = Ctx {
            store,
            run: run_id(),
        };
        let ctx = &ctx;
        let checks = checks![
            ctx;
            begin_starts_a_fresh_key,
            a_live_lease_is_in_progress,
            another_fingerprint_is_a_mismatch,
            a_completed_record_replays_its_response,
            a_completed_record_is_final,
            release_frees_the_key,
            a_foreign_token_is_fenced,
            an_expired_lease_is_taken_over,
            extend_renews_the_lease,
            an_expired_record_counts_as_absent,
            concurrent_begins_start_once,
            records_are_kept_apart,
            hostile_keys_round_trip,
            delete_expired_keeps_live_records,
        ];
        run(checks).await
    }

    struct Ctx<'s, S> {
        store: &'s S,
        run: String,
    }

    impl<S: IdempotencyStore> Ctx<'_, S> {
        /// The record `name` of this run.
        fn key(&self, name: &str) -> RecordKey {
            RecordKey::new(Some(&self.user()), "POST", "/conformance", name)
        }

        fn user(&self) -> String {
            format!("idempo-conformance-{}", self.run)
        }

        async fn begin(
            &self,
            key: &RecordKey,
            fingerprint: &Fingerprint,
            lease: Duration,
            ttl: Duration,
            step: &str,
        ) -> Result<Begin, Failure> {
            self.store
                .begin(Operation {
                    key,
                    fingerprint,
                    lease,
                    ttl,
                })
                .await
                .during(step)
        }

        /// `begin` with a long lease and TTL.
        async fn begin_long(
            &self,
            key: &RecordKey,
            fingerprint: &Fingerprint,
            step: &str,
        ) -> Result<Begin, Failure> {
            self.begin(key, fingerprint, LONG, LONG, step).await
        }

        /// `begin`, which must start: the token.
        async fn start(
            &self,
            key: &RecordKey,
            fingerprint: &Fingerprint,
            lease: Duration,
            ttl: Duration,
            step: &str,
        ) -> Result<FencingToken, Failure> {
            match self.begin(key, fingerprint, lease, ttl, step).await? {
                Begin::Started(token) => Ok(token),
                other => Err(unexpected(step, "Started(_)", other)),
            }
        }

        async fn start_long(
            &self,
            key: &RecordKey,
            fingerprint: &Fingerprint,
            step: &str,
        ) -> Result<FencingToken, Failure> {
            self.start(key, fingerprint, LONG, LONG, step).await
        }

        /// `begin`, which must find the record in progress.
        async fn in_progress(
            &self,
            key: &RecordKey,
            fingerprint: &Fingerprint,
            step: &str,
        ) -> Result<(), Failure> {
            match self.begin_long(key, fingerprint, step).await? {
                Begin::InProgress { .. } => Ok(()),
                other => Err(unexpected(step, "InProgress { .. }", other)),
            }
        }

        /// `begin`, which must replay `response`.
        async fn replays(
            &self,
            key: &RecordKey,
            fingerprint: &Fingerprint,
            response: &StoredResponse,
            step: &str,
        ) -> Result<(), Failure> {
            match self.begin_long(key, fingerprint, step).await? {
                Begin::Completed(found) if found == *response => Ok(()),
                other => Err(unexpected(
                    step,
                    format!("Completed({response:?}), byte for byte"),
                    other,
                )),
            }
        }

        async fn complete(
            &self,
            key: &RecordKey,
            token: FencingToken,
            response: &StoredResponse,
            ttl: Duration,
            step: &str,
        ) -> Result<bool, Failure> {
            self.store
                .complete(key, token, response, ttl)
                .await
                .during(step)
        }
    }

    fn fingerprint(body: &str) -> Fingerprint {
        Fingerprint::of_request("POST", "/conformance", body.as_bytes())
    }

    fn response(body: &str) -> StoredResponse {
        StoredResponse::new(
            StatusCode::CREATED,
            vec![(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"))],
            Bytes::copy_from_slice(body.as_bytes()),
        )
    }

    /// A token no record of this check was given.
    fn other_token(token: FencingToken) -> FencingToken {
        FencingToken::new(token.get().wrapping_add(1_000_003))
    }

    async fn begin_starts_a_fresh_key<S: IdempotencyStore>(
        ctx: &Ctx<'_, S>,
    ) -> Result<(), Failure> {
        let key = ctx.key("fresh");
        ctx.start_long(&key, &fingerprint("a"), "begin on a key never used")
            .await?;
        Ok(())
    }

    async fn a_live_lease_is_in_progress<S: IdempotencyStore>(
        ctx: &Ctx<'_, S>,
    ) -> Result<(), Failure> {
        let (key, a) = (ctx.key("leased"), fingerprint("a"));
        ctx.start_long(&key, &a, "begin on a fresh key").await?;
        let step = "begin with the same fingerprint while the first holder's 30 s lease is live";
        match ctx.begin_long(&key, &a, step).await? {
            Begin::InProgress { lease_left } if lease_left.is_none_or(|left| left <= LONG) => {
                Ok(())
            }
            other => Err(unexpected(
                step,
                "InProgress { lease_left: None or at most 30 s }",
                other,
            )),
        }
    }

    async fn another_fingerprint_is_a_mismatch<S: IdempotencyStore>(
        ctx: &Ctx<'_, S>,
    ) -> Result<(), Failure> {
        let (key, a, b) = (ctx.key("mismatch"), fingerprint("a"), fingerprint("b"));
        let token = ctx.start_long(&key, &a, "begin on a fresh key").await?;
        let step = "begin with another fingerprint while the first request runs";
        expect_eq(step, ctx.begin_long(&key, &b, step).await?, Begin::Mismatch)?;
        let step = "complete with the holder's token";
        let done = ctx
            .complete(&key, token, &response("a"), LONG, step)
            .await?;
        expect_eq(step, done, true)?;
        let step = "begin with another fingerprint once the record is complete";
        expect_eq(step, ctx.begin_long(&key, &b, step).await?, Begin::Mismatch)?;
        let step = "begin with the first fingerprint after the mismatch";
        ctx.replays(&key, &a, &response("a"), step).await
    }

    async fn a_completed_record_replays_its_response<S: IdempotencyStore>(
        ctx: &Ctx<'_, S>,
    ) -> Result<(), Failure> {
        let headers = vec![
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                header::LOCATION,
                HeaderValue::from_bytes(b"/payments/\xff\x80 1").expect("a valid header value"),
            ),
            (header::SET_COOKIE, HeaderValue::from_static("a=1")),
            (
                HeaderName::from_static("x-conformance"),
                HeaderValue::from_static(""),
            ),
            (header::SET_COOKIE, HeaderValue::from_static("b=2")),
        ];
        let mut large = vec![0u8; 1 << 20];
        large
            .iter_mut()
            .enumerate()
            .for_each(|(i, byte)| *byte = (i % 251) as u8);
        let responses = [
            (
                "binary",
                StoredResponse::new(
                    StatusCode::CREATED,
                    headers,
                    Bytes::from_static(b"\x00\x01{\"id\":1}\xff\r\n\x00"),
                ),
            ),
            (
                "empty",
                StoredResponse::new(StatusCode::INTERNAL_SERVER_ERROR, Vec::new(), Bytes::new()),
            ),
            (
                "large",
                StoredResponse::new(StatusCode::PAYMENT_REQUIRED, Vec::new(), large.into()),
            ),
        ];
        for (name, response) in &responses {
            let key = ctx.key(&format!("replay-{name}"));
            let a = fingerprint(name);
            let token = ctx
                .start_long(&key, &a, &format!("begin on a fresh key ({name} response)"))
                .await?;
            let step = format!("complete with a {name} response");
            let done = ctx.complete(&key, token, response, LONG, &step).await?;
            expect_eq(&step, done, true)?;
            let step = format!("begin after completing with a {name} response");
            ctx.replays(&key, &a, response, &step).await?;
        }
        Ok(())
    }

    async fn a_completed_record_is_final<S: IdempotencyStore>(
        ctx: &Ctx<'_, S>,
    ) -> Result<(), Failure> {
        let (key, a) = (ctx.key("final"), fingerprint("a"));
        let token = ctx.start_long(&key, &a, "begin on a fresh key").await?;
        let step = "complete with the holder's token";
        let done = ctx
            .complete(&key, token, &response("first"), LONG, step)
            .await?;
        expect_eq(step, done, true)?;
        let step = "complete a second time with the same token";
        let again = ctx
            .complete(&key, token, &response("second"), LONG, step)
            .await?;
        expect_eq(step, again, false)?;
        let step = "extend a completed record";
        let extended = ctx.store.extend(&key, token, LONG).await.during(step)?;
        expect_eq(step, extended, false)?;
        let step = "release a completed record";
        let released = ctx.store.release(&key, token).await.during(step)?;
        expect_eq(step, released, false)?;
        let step = "begin after the refused complete, extend and release";
        ctx.replays(&key, &a, &response("first"), step).await
    }

    async fn release_frees_the_key<S: IdempotencyStore>(ctx: &Ctx<'_, S>) -> Result<(), Failure> {
        let key = ctx.key("release");
        let first = ctx
            .start_long(&key, &fingerprint("a"), "begin on a fresh key")
            .await?;
        let step = "release with the holder's token";
        expect_eq(
            step,
            ctx.store.release(&key, first).await.during(step)?,
            true,
        )?;
        let step = "release a second time";
        expect_eq(
            step,
            ctx.store.release(&key, first).await.during(step)?,
            false,
        )?;
        let step = "begin with another fingerprint after the release";
        let second = ctx.start_long(&key, &fingerprint("b"), step).await?;
        if second == first {
            return Err(unexpected(
                step,
                format!("a token other than the released {first:?}"),
                second,
            ));
        }
        let step = "complete with the released token";
        let stale = ctx
            .complete(&key, first, &response("a"), LONG, step)
            .await?;
        expect_eq(step, stale, false)
    }

    async fn a_foreign_token_is_fenced<S: IdempotencyStore>(
        ctx: &Ctx<'_, S>,
    ) -> Result<(), Failure> {
        let (key, other_key, a) = (ctx.key("fenced"), ctx.key("fenced-other"), fingerprint("a"));
        let token = ctx.start_long(&key, &a, "begin on a fresh key").await?;
        let theirs = ctx
            .start_long(&other_key, &a, "begin on a second fresh key")
            .await?;
        for (whose, foreign) in [
            ("another record's token", theirs),
            ("a made-up token", other_token(token)),
        ] {
            let step = format!("complete with {whose}");
            let done = ctx
                .complete(&key, foreign, &response("thief"), LONG, &step)
                .await?;
            expect_eq(&step, done, false)?;
            let step = format!("extend with {whose}");
            let extended = ctx.store.extend(&key, foreign, LONG).await.during(&step)?;
            expect_eq(&step, extended, false)?;
            let step = format!("release with {whose}");
            let released = ctx.store.release(&key, foreign).await.during(&step)?;
            expect_eq(&step, released, false)?;
        }
        ctx.in_progress(
            &key,
            &a,
            "begin after the refused calls with foreign tokens",
        )
        .await?;
        let step = "complete with the holder's own token after the foreign ones";
        let done = ctx
            .complete(&key, token, &response("a"), LONG, step)
            .await?;
        expect_eq(step, done, true)?;
        ctx.replays(&key, &a, &response("a"), "begin after completing")
            .await
    }

    async fn an_expired_lease_is_taken_over<S: IdempotencyStore>(
        ctx: &Ctx<'_, S>,
    ) -> Result<(), Failure> {
        let (key, a) = (ctx.key("takeover"), fingerprint("a"));
        let old = ctx
            .start(&key, &a, SHORT, LONG, "begin with a 200 ms lease")
            .await?;
        tokio::time::sleep(WAIT).await;
        let step = "begin with the same fingerprint once the 200 ms lease ran out";
        let new = ctx.start_long(&key, &a, step).await?;
        if new == old {
            return Err(unexpected(
                step,
                format!("a token other than the dead holder's {old:?}"),
                new,
            ));
        }
        let step = "complete with the dead holder's token";
        let stale = ctx
            .complete(&key, old, &response("old"), LONG, step)
            .await?;
        expect_eq(step, stale, false)?;
        let step = "extend with the dead holder's token";
        expect_eq(
            step,
            ctx.store.extend(&key, old, LONG).await.during(step)?,
            false,
        )?;
        let step = "release with the dead holder's token";
        expect_eq(
            step,
            ctx.store.release(&key, old).await.during(step)?,
            false,
        )?;
        let step = "complete with the new holder's token";
        let done = ctx
            .complete(&key, new, &response("new"), LONG, step)
            .await?;
        expect_eq(step, done, true)?;
        ctx.replays(
            &key,
            &a,
            &response("new"),
            "begin after the takeover completed",
        )
        .await
    }

    async fn extend_renews_the_lease<S: IdempotencyStore>(ctx: &Ctx<'_, S>) -> Result<(), Failure> {
        let (key, a) = (ctx.key("extend"), fingerprint("a"));
        let token = ctx
            .start(&key, &a, SHORT, LONG, "begin with a 200 ms lease")
            .await?;
        let step = "extend the 200 ms lease to 30 s right away";
        expect_eq(
            step,
            ctx.store.extend(&key, token, LONG).await.during(step)?,
            true,
        )?;
        tokio::time::sleep(WAIT).await;
        ctx.in_progress(
            &key,
            &a,
            "begin once the first 200 ms lease would have run out",
        )
        .await
    }

    async fn an_expired_record_counts_as_absent<S: IdempotencyStore>(
        ctx: &Ctx<'_, S>,
    ) -> Result<(), Failure> {
        let (completed, leased) = (ctx.key("expired-complete"), ctx.key("expired-in-progress"));
        let (a, b) = (fingerprint("a"), fingerprint("b"));
        let token = ctx
            .start(&completed, &a, SHORT, SHORT, "begin with a 200 ms TTL")
            .await?;
        let step = "complete with a 200 ms TTL";
        let done = ctx
            .complete(&completed, token, &response("a"), SHORT, step)
            .await?;
        expect_eq(step, done, true)?;
        ctx.start(
            &leased,
            &a,
            SHORT,
            SHORT,
            "begin with a 200 ms lease and TTL",
        )
        .await?;
        tokio::time::sleep(WAIT).await;
        let step = "begin with another fingerprint once the completed record's TTL ran out";
        ctx.start_long(&completed, &b, step).await?;
        let step =
            "begin with another fingerprint once the in-progress record's lease and TTL ran out";
        ctx.start_long(&leased, &b, step).await?;
        Ok(())
    }

    async fn concurrent_begins_start_once<S: IdempotencyStore>(
        ctx: &Ctx<'_, S>,
    ) -> Result<(), Failure> {
        // One fingerprint: one start, the others see it in progress.
        let key = ctx.key("race");
        let a = fingerprint("a");
        let begins = (0..RACERS).map(|_| ctx.begin_long(&key, &a, "concurrent begin"));
        let found = futures::future::try_join_all(begins).await?;
        let started = found
            .iter()
            .filter(|b| matches!(b, Begin::Started(_)))
            .count();
        let in_progress = found
            .iter()
            .filter(|b| matches!(b, Begin::InProgress { .. }))
            .count();
        if started != 1 || in_progress != RACERS - 1 {
            return Err(unexpected(
                "16 concurrent begins with one fingerprint on a fresh key",
                "one Started and 15 InProgress",
                found,
            ));
        }
        // Two fingerprints: one start; the winner's are in progress, the
        // others a mismatch.
        let key = ctx.key("race-two");
        let prints: Vec<Fingerprint> = (0..RACERS)
            .map(|i| fingerprint(if i % 2 == 0 { "a" } else { "b" }))
            .collect();
        let begins = prints
            .iter()
            .map(|print| ctx.begin_long(&key, print, "concurrent begin"));
        let found = futures::future::try_join_all(begins).await?;
        let winners: Vec<usize> = (0..RACERS)
            .filter(|&i| matches!(found[i], Begin::Started(_)))
            .collect();
        let consistent = |winner: usize| {
            (0..RACERS).filter(|&i| i != winner).all(|i| {
                if prints[i] == prints[winner] {
                    matches!(found[i], Begin::InProgress { .. })
                } else {
                    found[i] == Begin::Mismatch
                }
            })
        };
        match winners[..] {
            [winner] if consistent(winner) => Ok(()),
            _ => Err(unexpected(
                "16 concurrent begins with two fingerprints (even: a, odd: b) on a fresh key",
                "one Started; InProgress for the others with its fingerprint, Mismatch for the rest",
                found,
            )),
        }
    }

    async fn records_are_kept_apart<S: IdempotencyStore>(ctx: &Ctx<'_, S>) -> Result<(), Failure> {
        let user = ctx.user();
        let joined_a = format!("{user}|POST");
        let keys = [
            RecordKey::new(Some(&user), "POST", "/apart", "k"),
            RecordKey::new(None, "POST", "/apart", &format!("k-{user}")),
            RecordKey::new(Some(""), "POST", "/apart", &format!("k-{user}")),
            RecordKey::new(Some(&user), "PATCH", "/apart", "k"),
            RecordKey::new(Some(&user), "POST", "/apart/", "k"),
            RecordKey::new(Some(&user), "POST", "/apart", "K"),
            // Joined with a separator, these two would be one string.
            RecordKey::new(Some(&joined_a), "/apart", "x", "k"),
            RecordKey::new(Some(&user), "POST|/apart", "x", "k"),
        ];
        let a = fingerprint("a");
        let mut tokens = Vec::new();
        for key in &keys {
            let step = format!("begin on {key:?}, which differs from every key before it");
            tokens.push(ctx.start_long(key, &a, &step).await?);
        }
        let step = "complete the first of the distinct keys";
        let done = ctx
            .complete(&keys[0], tokens[0], &response("first"), LONG, step)
            .await?;
        expect_eq(step, done, true)?;
        for key in &keys[1..] {
            let step = format!("begin on {key:?} after another key completed");
            ctx.in_progress(key, &a, &step).await?;
        }
        Ok(())
    }

    async fn hostile_keys_round_trip<S: IdempotencyStore>(ctx: &Ctx<'_, S>) -> Result<(), Failure> {
        let user = ctx.user();
        let long = format!("{}'", "\\".repeat(254));
        let mut keys: Vec<RecordKey> = Vec::new();
        for text in HOSTILE.iter().copied().chain([long.as_str()]) {
            keys.push(RecordKey::new(Some(&user), "POST", "/hostile", text));
            keys.push(RecordKey::new(
                Some(&format!("{user}{text}")),
                "POST",
                "/hostile",
                "k",
            ));
            keys.push(RecordKey::new(
                Some(&user),
                "POST",
                &format!("/hostile/{text}"),
                "k",
            ));
        }
        let mut tokens = Vec::new();
        for key in &keys {
            let step = format!("begin on {key:?}");
            tokens.push(ctx.start_long(key, &fingerprint(key.key()), &step).await?);
        }
        for (key, token) in keys.iter().zip(tokens) {
            let body = format!("{}{}{}", key.key(), key.user().unwrap_or(""), key.path());
            let step = format!("complete {key:?}");
            let done = ctx
                .complete(key, token, &response(&body), LONG, &step)
                .await?;
            expect_eq(&step, done, true)?;
        }
        for key in &keys {
            let body = format!("{}{}{}", key.key(), key.user().unwrap_or(""), key.path());
            let step = format!("begin on {key:?} once complete");
            ctx.replays(key, &fingerprint(key.key()), &response(&body), &step)
                .await?;
        }
        Ok(())
    }

    async fn delete_expired_keeps_live_records<S: IdempotencyStore>(
        ctx: &Ctx<'_, S>,
    ) -> Result<(), Failure> {
        let a = fingerprint("a");
        let (leased, completed, expired) = (
            ctx.key("cleanup-in-progress"),
            ctx.key("cleanup-complete"),
            ctx.key("cleanup-expired"),
        );
        ctx.start_long(&leased, &a, "begin on a fresh key").await?;
        let token = ctx
            .start_long(&completed, &a, "begin on a fresh key")
            .await?;
        let step = "complete with a 30 s TTL";
        let done = ctx
            .complete(&completed, token, &response("a"), LONG, step)
            .await?;
        expect_eq(step, done, true)?;
        ctx.start(
            &expired,
            &a,
            SHORT,
            SHORT,
            "begin with a 200 ms lease and TTL",
        )
        .await?;
        tokio::time::sleep(WAIT).await;
        ctx.store
            .delete_expired(10_000)
            .await
            .during("delete_expired")?;
        ctx.in_progress(
            &leased,
            &a,
            "begin on a live in-progress record after delete_expired",
        )
        .await?;
        ctx.replays(
            &completed,
            &a,
            &response("a"),
            "begin on a live completed record after delete_expired",
        )
        .await?;
        ctx.start_long(
            &expired,
            &a,
            "begin on an expired record after delete_expired",
        )
        .await?;
        Ok(())
    }
}

#[cfg(feature = "window")]
mod window_checks {
    use super::*;
    use crate::Error;
    use crate::window::{Insertion, MAX_KEY_LEN, Reservation, WindowStore};

    /// The checks [`window_store`] runs, by name:
    ///
    /// | check | what the store must do |
    /// |---|---|
    /// | `insert_records_a_new_id` | `insert` of an absent key: [`Insertion::New`]; again: [`Insertion::Seen`] with the first value, which `reserve` returns too |
    /// | `an_empty_value_round_trips` | a seen entry recorded with `""` is returned as `Seen("")` |
    /// | `a_reservation_holds_the_id` | `reserve` of an absent key: [`Reservation::Reserved`]; then `reserve` and `insert` find it pending |
    /// | `record_turns_a_reservation_into_seen` | `record` with the token: `true`, and the id is seen with its value; a second `record` and a `release` are refused |
    /// | `release_frees_the_id` | `release` with the token: `true` (a second one `false`), and the id is new again |
    /// | `a_foreign_token_is_refused` | `record` and `release` with another key's token, or a made-up one, are refused and the reservation stays |
    /// | `a_seen_id_expires_after_its_window` | past its window, a seen id is new again |
    /// | `an_expired_reservation_is_free` | past its lease, a reservation is gone: its token is refused and `reserve` hands out a new one |
    /// | `concurrent_inserts_record_once` | of 16 concurrent `insert`s of one key, exactly one is new; the others see its value |
    /// | `concurrent_reserves_reserve_once` | of 16 concurrent `reserve`s of one key, exactly one reserves; the others find it pending |
    /// | `hostile_keys_are_kept_apart` | keys with quotes, backslashes, LIKE and glob wildcards, hash tags, separators, line breaks, non-ASCII text, prefixes of each other, and one of [`MAX_KEY_LEN`] bytes, are distinct entries and keep their values |
    /// | `overlong_keys_and_nul_bytes_are_refused` | a key longer than [`MAX_KEY_LEN`] bytes, a key or value with a NUL byte: [`Error::Config`], as idempo's stores do, so that switching stores cannot surface a new error (call [`check_key`](crate::window::check_key) and [`check_value`](crate::window::check_value)) |
    /// | `an_overlong_lease_is_cut` | a lease of `Duration::MAX` is cut to [`MAX_WINDOW`](crate::window::MAX_WINDOW): the reservation is held, not refused and not expired |
    /// | `delete_expired_keeps_live_entries` | `delete_expired` keeps the live entries (seen, reserved) |
    pub const WINDOW_STORE_CHECKS: &[&str] = &[
        "insert_records_a_new_id",
        "an_empty_value_round_trips",
        "a_reservation_holds_the_id",
        "record_turns_a_reservation_into_seen",
        "release_frees_the_id",
        "a_foreign_token_is_refused",
        "a_seen_id_expires_after_its_window",
        "an_expired_reservation_is_free",
        "concurrent_inserts_record_once",
        "concurrent_reserves_reserve_once",
        "hostile_keys_are_kept_apart",
        "overlong_keys_and_nul_bytes_are_refused",
        "an_overlong_lease_is_cut",
        "delete_expired_keeps_live_entries",
    ];

    /// Runs the [`WindowStore`] contract checks ([`WINDOW_STORE_CHECKS`])
    /// against `store`, concurrently, on fresh keys of its own: see
    /// [the module](crate::testing::conformance) for how.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let store = idempo::window::MemoryWindow::new(10_000);
    /// if let Err(e) = idempo::testing::conformance::window_store(&store).await {
    ///     panic!("{e}"); // names the check, the step, what was expected and found
    /// }
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`ConformanceError`] naming the first check (in list order) that
    /// failed, whether the store answered against the contract
    /// ([`Failure::Unexpected`]) or returned an error ([`Failure::Store`]).
    pub async fn window_store<W: WindowStore>(store: &W) -> Result<Report, ConformanceError> {
        let ctx = Ctx {
            store,
            run: run_id(),
        };
        let ctx = &ctx;
        let checks = checks![
            ctx;
            insert_records_a_new_id,
            an_empty_value_round_trips,
            a_reservation_holds_the_id,
            record_turns_a_reservation_into_seen,
            release_frees_the_id,
            a_foreign_token_is_refused,
            a_seen_id_expires_after_its_window,
            an_expired_reservation_is_free,
            concurrent_inserts_record_once,
            concurrent_reserves_reserve_once,
            hostile_keys_are_kept_apart,
            overlong_keys_and_nul_bytes_are_refused,
            an_overlong_lease_is_cut,
            delete_expired_keeps_live_entries,
        ];
        run(checks).await
    }

    struct Ctx<'s, W> {
        store: &'s W,
        run: String,
    }

    impl<W: WindowStore> Ctx<'_, W> {
        /// The key `name` of this run.
        fn key(&self, name: &str) -> String {
            format!("idempo-conformance:{}:{name}", self.run)
        }

        async fn insert(
            &self,
            key: &str,
            value: &str,
            window: Duration,
            step: &str,
        ) -> Result<Insertion, Failure> {
            self.store.insert(key, value, window).await.during(step)
        }

        /// `insert`, which must find `want`.
        async fn insert_is(
            &self,
            key: &str,
            value: &str,
            window: Duration,
            want: Insertion,
            step: &str,
        ) -> Result<(), Failure> {
            expect_eq(step, self.insert(key, value, window, step).await?, want)
        }

        async fn reserve(
            &self,
            key: &str,
            lease: Duration,
            step: &str,
        ) -> Result<Reservation, Failure> {
            self.store.reserve(key, lease).await.during(step)
        }

        /// `reserve`, which must reserve: the token.
        async fn reserved(&self, key: &str, lease: Duration, step: &str) -> Result<i64, Failure> {
            match self.reserve(key, lease, step).await? {
                Reservation::Reserved { token } => Ok(token),
                other => Err(unexpected(step, "Reserved { .. }", other)),
            }
        }

        async fn record(
            &self,
            key: &str,
            token: i64,
            value: &str,
            step: &str,
        ) -> Result<bool, Failure> {
            self.store
                .record(key, token, value, LONG)
                .await
                .during(step)
        }

        async fn release(&self, key: &str, token: i64, step: &str) -> Result<bool, Failure> {
            self.store.release(key, token).await.during(step)
        }
    }

    fn seen(value: &str) -> Insertion {
        Insertion::Seen(value.to_owned())
    }

    async fn insert_records_a_new_id<W: WindowStore>(ctx: &Ctx<'_, W>) -> Result<(), Failure> {
        let key = ctx.key("insert");
        ctx.insert_is(
            &key,
            "first",
            LONG,
            Insertion::New,
            "insert of an absent key",
        )
        .await?;
        ctx.insert_is(&key, "second", LONG, seen("first"), "insert again")
            .await?;
        let step = "reserve a seen key";
        expect_eq(
            step,
            ctx.reserve(&key, LONG, step).await?,
            Reservation::Seen("first".into()),
        )
    }

    async fn an_empty_value_round_trips<W: WindowStore>(ctx: &Ctx<'_, W>) -> Result<(), Failure> {
        let key = ctx.key("empty-value");
        ctx.insert_is(&key, "", LONG, Insertion::New, "insert with an empty value")
            .await?;
        ctx.insert_is(&key, "x", LONG, seen(""), "insert again")
            .await
    }

    async fn a_reservation_holds_the_id<W: WindowStore>(ctx: &Ctx<'_, W>) -> Result<(), Failure> {
        let key = ctx.key("reserve");
        ctx.reserved(&key, LONG, "reserve an absent key").await?;
        let step = "reserve a reserved key";
        expect_eq(
            step,
            ctx.reserve(&key, LONG, step).await?,
            Reservation::Pending,
        )?;
        ctx.insert_is(&key, "v", LONG, Insertion::Pending, "insert a reserved key")
            .await
    }

    async fn record_turns_a_reservation_into_seen<W: WindowStore>(
        ctx: &Ctx<'_, W>,
    ) -> Result<(), Failure> {
        let key = ctx.key("record");
        let token = ctx.reserved(&key, LONG, "reserve an absent key").await?;
        let step = "record with the reservation's token";
        expect_eq(step, ctx.record(&key, token, "msg-1", step).await?, true)?;
        let step = "record a second time with the same token";
        expect_eq(step, ctx.record(&key, token, "msg-2", step).await?, false)?;
        let step = "release a recorded id";
        expect_eq(step, ctx.release(&key, token, step).await?, false)?;
        let step = "reserve a recorded id";
        expect_eq(
            step,
            ctx.reserve(&key, LONG, step).await?,
            Reservation::Seen("msg-1".into()),
        )?;
        ctx.insert_is(&key, "v", LONG, seen("msg-1"), "insert a recorded id")
            .await
    }

    async fn release_frees_the_id<W: WindowStore>(ctx: &Ctx<'_, W>) -> Result<(), Failure> {
        let key = ctx.key("release");
        let token = ctx.reserved(&key, LONG, "reserve an absent key").await?;
        let step = "release with the reservation's token";
        expect_eq(step, ctx.release(&key, token, step).await?, true)?;
        let step = "release a second time";
        expect_eq(step, ctx.release(&key, token, step).await?, false)?;
        let step = "record with the released token";
        expect_eq(step, ctx.record(&key, token, "late", step).await?, false)?;
        ctx.insert_is(&key, "v", LONG, Insertion::New, "insert after the release")
            .await
    }

    async fn a_foreign_token_is_refused<W: WindowStore>(ctx: &Ctx<'_, W>) -> Result<(), Failure> {
        let (key, other) = (ctx.key("fenced"), ctx.key("fenced-other"));
        let token = ctx.reserved(&key, LONG, "reserve an absent key").await?;
        let theirs = ctx
            .reserved(&other, LONG, "reserve a second absent key")
            .await?;
        for (whose, foreign) in [
            ("another key's token", theirs),
            ("a made-up token", token.wrapping_add(1_000_003)),
        ] {
            let step = format!("record with {whose}");
            expect_eq(
                &step,
                ctx.record(&key, foreign, "thief", &step).await?,
                false,
            )?;
            let step = format!("release with {whose}");
            expect_eq(&step, ctx.release(&key, foreign, &step).await?, false)?;
        }
        let step = "reserve after the refused calls with foreign tokens";
        expect_eq(
            step,
            ctx.reserve(&key, LONG, step).await?,
            Reservation::Pending,
        )?;
        let step = "record with the reservation's own token after the foreign ones";
        expect_eq(step, ctx.record(&key, token, "mine", step).await?, true)?;
        ctx.insert_is(&key, "v", LONG, seen("mine"), "insert after recording")
            .await
    }

    async fn a_seen_id_expires_after_its_window<W: WindowStore>(
        ctx: &Ctx<'_, W>,
    ) -> Result<(), Failure> {
        let key = ctx.key("expires");
        ctx.insert_is(
            &key,
            "first",
            SHORT,
            Insertion::New,
            "insert for a 200 ms window",
        )
        .await?;
        tokio::time::sleep(WAIT).await;
        ctx.insert_is(
            &key,
            "second",
            LONG,
            Insertion::New,
            "insert once the 200 ms window ran out",
        )
        .await?;
        ctx.insert_is(&key, "third", LONG, seen("second"), "insert again")
            .await
    }

    async fn an_expired_reservation_is_free<W: WindowStore>(
        ctx: &Ctx<'_, W>,
    ) -> Result<(), Failure> {
        let key = ctx.key("lease");
        let old = ctx
            .reserved(&key, SHORT, "reserve an absent key for 200 ms")
            .await?;
        tokio::time::sleep(WAIT).await;
        let step = "record with the token of a reservation whose lease ran out";
        expect_eq(step, ctx.record(&key, old, "late", step).await?, false)?;
        let step = "reserve once the 200 ms lease ran out";
        let new = ctx.reserved(&key, LONG, step).await?;
        if new == old {
            return Err(unexpected(
                step,
                format!("a token other than the expired reservation's {old}"),
                new,
            ));
        }
        let step = "release with the expired reservation's token";
        expect_eq(step, ctx.release(&key, old, step).await?, false)?;
        let step = "record with the new reservation's token";
        expect_eq(step, ctx.record(&key, new, "v", step).await?, true)?;
        Ok(())
    }

    async fn concurrent_inserts_record_once<W: WindowStore>(
        ctx: &Ctx<'_, W>,
    ) -> Result<(), Failure> {
        let key = ctx.key("race-insert");
        let values: Vec<String> = (0..RACERS).map(|i| format!("v{i}")).collect();
        let inserts = values
            .iter()
            .map(|value| ctx.insert(&key, value, LONG, "concurrent insert"));
        let found = futures::future::try_join_all(inserts).await?;
        let winners: Vec<usize> = (0..RACERS).filter(|&i| found[i].is_new()).collect();
        match winners[..] {
            [w] if (0..RACERS).all(|i| i == w || found[i] == seen(&values[w])) => Ok(()),
            _ => Err(unexpected(
                "16 concurrent inserts of one absent key, with values v0 to v15",
                "one New, and Seen with the new one's value for the others",
                found,
            )),
        }
    }

    async fn concurrent_reserves_reserve_once<W: WindowStore>(
        ctx: &Ctx<'_, W>,
    ) -> Result<(), Failure> {
        let key = ctx.key("race-reserve");
        let reserves = (0..RACERS).map(|_| ctx.reserve(&key, LONG, "concurrent reserve"));
        let found = futures::future::try_join_all(reserves).await?;
        let reserved = found
            .iter()
            .filter(|r| matches!(r, Reservation::Reserved { .. }))
            .count();
        let pending = found.iter().filter(|r| **r == Reservation::Pending).count();
        if reserved == 1 && pending == RACERS - 1 {
            Ok(())
        } else {
            Err(unexpected(
                "16 concurrent reserves of one absent key",
                "one Reserved and 15 Pending",
                found,
            ))
        }
    }

    async fn hostile_keys_are_kept_apart<W: WindowStore>(ctx: &Ctx<'_, W>) -> Result<(), Failure> {
        let prefix = ctx.key("hostile:");
        let mut keys: Vec<String> = HOSTILE
            .iter()
            .map(|text| format!("{prefix}{text}"))
            .collect();
        keys.push(prefix.clone());
        keys.push(format!(
            "{prefix}{}",
            "é".repeat((MAX_KEY_LEN - prefix.len()) / 2)
        ));
        let longest = format!("{prefix}{}", "'".repeat(MAX_KEY_LEN - prefix.len()));
        keys.push(longest);
        for key in &keys {
            let step = format!("insert {key:?}, which differs from every key before it");
            ctx.insert_is(key, key, LONG, Insertion::New, &step).await?;
        }
        for key in &keys {
            let step = format!("insert {key:?} again");
            ctx.insert_is(key, "other", LONG, seen(key), &step).await?;
        }
        Ok(())
    }

    async fn overlong_keys_and_nul_bytes_are_refused<W: WindowStore>(
        ctx: &Ctx<'_, W>,
    ) -> Result<(), Failure> {
        let base = ctx.key("limits");
        let overlong = format!("{base}{}", "x".repeat(MAX_KEY_LEN + 1 - base.len()));
        let nul = format!("{base}\0nul");
        for (what, key) in [
            ("a key of MAX_KEY_LEN + 1 bytes", &overlong),
            ("a key with a NUL byte", &nul),
        ] {
            let step = format!("insert {what}");
            refused(&step, ctx.store.insert(key, "v", LONG).await)?;
            let step = format!("reserve {what}");
            refused(&step, ctx.store.reserve(key, LONG).await)?;
            let step = format!("record {what}");
            refused(&step, ctx.store.record(key, 1, "v", LONG).await)?;
            let step = format!("release {what}");
            refused(&step, ctx.store.release(key, 1).await)?;
        }
        let key = format!("{base}:value");
        let step = "insert a value with a NUL byte";
        refused(step, ctx.store.insert(&key, "a\0b", LONG).await)?;
        let token = ctx.reserved(&key, LONG, "reserve an absent key").await?;
        let step = "record a value with a NUL byte";
        refused(step, ctx.store.record(&key, token, "a\0b", LONG).await)?;
        Ok(())
    }

    /// The store must have refused the input with [`Error::Config`].
    fn refused<T: fmt::Debug>(step: &str, found: crate::Result<T>) -> Result<(), Failure> {
        match found {
            Err(Error::Config(_)) => Ok(()),
            other => Err(unexpected(step, "Err(Error::Config(_))", other)),
        }
    }

    async fn an_overlong_lease_is_cut<W: WindowStore>(ctx: &Ctx<'_, W>) -> Result<(), Failure> {
        let key = ctx.key("forever");
        let token = ctx
            .reserved(
                &key,
                Duration::MAX,
                "reserve an absent key for Duration::MAX",
            )
            .await?;
        let step = "reserve again";
        expect_eq(
            step,
            ctx.reserve(&key, LONG, step).await?,
            Reservation::Pending,
        )?;
        // Released, so that nothing is left for ten years.
        let step = "release the reservation of Duration::MAX";
        expect_eq(step, ctx.release(&key, token, step).await?, true)
    }

    async fn delete_expired_keeps_live_entries<W: WindowStore>(
        ctx: &Ctx<'_, W>,
    ) -> Result<(), Failure> {
        let (seen_key, reserved_key, expired_key) = (
            ctx.key("cleanup-seen"),
            ctx.key("cleanup-reserved"),
            ctx.key("cleanup-expired"),
        );
        ctx.insert_is(
            &seen_key,
            "live",
            LONG,
            Insertion::New,
            "insert an absent key",
        )
        .await?;
        ctx.reserved(&reserved_key, LONG, "reserve an absent key")
            .await?;
        ctx.insert_is(
            &expired_key,
            "gone",
            SHORT,
            Insertion::New,
            "insert an absent key for 200 ms",
        )
        .await?;
        tokio::time::sleep(WAIT).await;
        ctx.store
            .delete_expired(10_000)
            .await
            .during("delete_expired")?;
        ctx.insert_is(
            &seen_key,
            "v",
            LONG,
            seen("live"),
            "insert a live seen key after delete_expired",
        )
        .await?;
        let step = "reserve a live reserved key after delete_expired";
        expect_eq(
            step,
            ctx.reserve(&reserved_key, LONG, step).await?,
            Reservation::Pending,
        )?;
        ctx.insert_is(
            &expired_key,
            "v",
            LONG,
            Insertion::New,
            "insert an expired key after delete_expired",
        )
        .await
    }
}
