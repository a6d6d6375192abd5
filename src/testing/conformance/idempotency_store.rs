//! The [`IdempotencyStore`] contract: its checks, one async fn each.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode, header};

use super::*;

mod lifecycle;
use crate::http::{
    Begin, FencingToken, Fingerprint, IdempotencyStore, Operation, RecordKey, StoredResponse,
};
use lifecycle::*;

impl Report {
    /// The checks [`Report::idempotency_store`] runs, by name:
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
    pub const IDEMPOTENCY_STORE_CHECKS: &'static [&'static str] = &[
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
}

impl Report {
    /// Runs the [`IdempotencyStore`] contract checks
    /// ([`Report::IDEMPOTENCY_STORE_CHECKS`]) against `store`, concurrently, on
    /// fresh keys of its own: see [the module](crate::testing::conformance) for how.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let store = idempo::http::MemoryStore::new();
    /// if let Err(e) = idempo::testing::conformance::Report::idempotency_store(&store).await {
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

async fn begin_starts_a_fresh_key<S: IdempotencyStore>(ctx: &Ctx<'_, S>) -> Result<(), Failure> {
    let key = ctx.key("fresh");
    ctx.start_long(&key, &fingerprint("a"), "begin on a key never used")
        .await?;
    Ok(())
}

async fn a_live_lease_is_in_progress<S: IdempotencyStore>(ctx: &Ctx<'_, S>) -> Result<(), Failure> {
    let (key, a) = (ctx.key("leased"), fingerprint("a"));
    ctx.start_long(&key, &a, "begin on a fresh key").await?;
    let step = "begin with the same fingerprint while the first holder's 30 s lease is live";
    match ctx.begin_long(&key, &a, step).await? {
        Begin::InProgress { lease_left } if lease_left.is_none_or(|left| left <= LONG) => Ok(()),
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

async fn a_completed_record_is_final<S: IdempotencyStore>(ctx: &Ctx<'_, S>) -> Result<(), Failure> {
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
