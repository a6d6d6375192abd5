//! The [`IdempotencyStore`] contract: its checks, one async fn each.

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
pub async fn idempotency_store<S: IdempotencyStore>(store: &S) -> Result<Report, ConformanceError> {
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

async fn a_foreign_token_is_fenced<S: IdempotencyStore>(ctx: &Ctx<'_, S>) -> Result<(), Failure> {
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
    let step = "begin with another fingerprint once the in-progress record's lease and TTL ran out";
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
