//! The [`IdempotencyStore`] contract's checks of a record's life after it
//! began: release, fencing, leases, expiry, concurrency, keys, cleanup.

use super::*;

pub(super) async fn release_frees_the_key<S: IdempotencyStore>(
    ctx: &Ctx<'_, S>,
) -> Result<(), Failure> {
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

pub(super) async fn a_foreign_token_is_fenced<S: IdempotencyStore>(
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

pub(super) async fn an_expired_lease_is_taken_over<S: IdempotencyStore>(
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

pub(super) async fn extend_renews_the_lease<S: IdempotencyStore>(
    ctx: &Ctx<'_, S>,
) -> Result<(), Failure> {
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

pub(super) async fn an_expired_record_counts_as_absent<S: IdempotencyStore>(
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

pub(super) async fn concurrent_begins_start_once<S: IdempotencyStore>(
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

pub(super) async fn records_are_kept_apart<S: IdempotencyStore>(
    ctx: &Ctx<'_, S>,
) -> Result<(), Failure> {
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

pub(super) async fn hostile_keys_round_trip<S: IdempotencyStore>(
    ctx: &Ctx<'_, S>,
) -> Result<(), Failure> {
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

pub(super) async fn delete_expired_keeps_live_records<S: IdempotencyStore>(
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
