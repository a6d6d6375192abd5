//! The [`WindowStore`] contract: its checks, one async fn each.

use super::*;
use crate::Error;
use crate::window::store::MAX_KEY_LEN;
use crate::window::{Insertion, Reservation, WindowStore};

impl Report {
    /// The checks [`Report::window_store`] runs, by name:
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
    /// | `hostile_keys_are_kept_apart` | keys with quotes, backslashes, LIKE and glob wildcards, hash tags, separators, line breaks, non-ASCII text, prefixes of each other, and one of 2,048 bytes (the longest), are distinct entries and keep their values |
    /// | `overlong_keys_and_nul_bytes_are_refused` | a key longer than 2,048 bytes, a key or value with a NUL byte: [`Error::Config`], as idempo's stores do, so that switching stores cannot surface a new error (refuse them before any work, with the reason in the message) |
    /// | `an_overlong_lease_is_cut` | a lease of `Duration::MAX` is cut to ten years: the reservation is held, not refused and not expired |
    /// | `delete_expired_keeps_live_entries` | `delete_expired` keeps the live entries (seen, reserved) |
    pub const WINDOW_STORE_CHECKS: &'static [&'static str] = &[
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
}

impl Report {
    /// Runs the [`WindowStore`] contract checks ([`Report::WINDOW_STORE_CHECKS`])
    /// against `store`, concurrently, on fresh keys of its own: see
    /// [the module](crate::testing::conformance) for how.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let store = idempo::window::MemoryWindow::new(10_000);
    /// if let Err(e) = idempo::testing::conformance::Report::window_store(&store).await {
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

async fn an_expired_reservation_is_free<W: WindowStore>(ctx: &Ctx<'_, W>) -> Result<(), Failure> {
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

async fn concurrent_inserts_record_once<W: WindowStore>(ctx: &Ctx<'_, W>) -> Result<(), Failure> {
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

async fn concurrent_reserves_reserve_once<W: WindowStore>(ctx: &Ctx<'_, W>) -> Result<(), Failure> {
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
