//! The partitioned inbox (`idempo::inbox::partitioned`): exactly-once across
//! partition boundaries, partitions retired while claims run, one maintainer
//! at a time, and the switch from the plain table keeping its claims.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idempo::inbox::partitioned::{self, PartitionError, Partitioning};
use idempo::inbox::{self, Begun, Claim};
use support::Db;

/// One-second partitions, two created ahead.
fn seconds() -> Partitioning {
    Partitioning::new().period(Duration::from_secs(1)).ahead(2)
}

/// A fresh schema whose `processed_messages` is partitioned.
async fn partitioned_db(retention: Duration) -> Db {
    let db = Db::new().await;
    let switched = seconds()
        .switch(&db.pool, Some(retention))
        .await
        .expect("switch");
    assert!(!switched.already);
    db
}

/// Runs `maintain` every 100 ms until the returned flag is set; returns
/// the names of the partitions it dropped.
fn maintainer(
    db: &Db,
    retention: Duration,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<Vec<String>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let pool = db.pool.clone();
    let flag = stop.clone();
    let task = tokio::spawn(async move {
        let mut dropped = Vec::new();
        while !flag.load(Ordering::Relaxed) {
            let done = idempo::inbox::Inbox::new("c")
                .maintain(&pool, Some(retention), &seconds())
                .await
                .expect("maintain");
            dropped.extend(done.dropped);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        dropped
    });
    (stop, task)
}

/// Sleeps until `before` ahead of the next whole second (a partition
/// boundary of one-second partitions).
async fn until_boundary(before: Duration) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let next = Duration::from_secs(now.as_secs() + 1);
    if let Some(wait) = (next - now).checked_sub(before) {
        tokio::time::sleep(wait).await;
    }
}

/// The partition that holds `id`'s claim.
async fn partition_of(db: &Db, id: &str) -> String {
    sqlx::query_scalar(
        "SELECT tableoid::regclass::text FROM processed_messages WHERE message_id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Claims with `begin_claim` and, when fresh, holds the transaction for
/// `hold` and commits.
async fn claim_and_commit(pool: &sqlx::PgPool, id: &str, body: &[u8], hold: Duration) -> Claim {
    match inbox::Inbox::new("c")
        .partitioned(true)
        .begin(pool, id, body)
        .await
        .expect("claim")
    {
        Begun::Fresh(tx) => {
            tokio::time::sleep(hold).await;
            inbox::Inbox::new("c").commit(tx, id).await.expect("commit");
            Claim::Fresh
        }
        Begun::Duplicate => Claim::Duplicate,
        Begun::Mismatch => Claim::Mismatch,
    }
}

#[tokio::test]
async fn sixteen_copies_racing_across_a_partition_rollover_make_exactly_one_fresh() {
    let db = partitioned_db(Duration::from_secs(60)).await;
    let (stop, maintaining) = maintainer(&db, Duration::from_secs(60));
    for round in 0..4 {
        let id = format!("race-{round}");
        // The copies start 40 ms before a boundary, 5 ms apart: the first
        // claims in partition N and holds it past the boundary, the later
        // ones begin in N+1 and wait for its lock.
        until_boundary(Duration::from_millis(40)).await;
        let copies: Vec<_> = (0..16u64)
            .map(|i| {
                let pool = db.pool.clone();
                let id = id.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(5 * i)).await;
                    claim_and_commit(&pool, &id, b"body", Duration::from_millis(60)).await
                })
            })
            .collect();
        let mut fresh = 0;
        for copy in copies {
            match copy.await.unwrap() {
                Claim::Fresh => fresh += 1,
                Claim::Duplicate => {}
                Claim::Mismatch => panic!("same body, yet a mismatch"),
            }
        }
        assert_eq!(fresh, 1, "round {round}: one copy is fresh");
    }
    // A copy that rolls back leaves the id to exactly one of the others.
    until_boundary(Duration::from_millis(20)).await;
    let Begun::Fresh(first) = inbox::Inbox::new("c")
        .partitioned(true)
        .begin(&db.pool, "rolled-back", b"x")
        .await
        .unwrap()
    else {
        panic!("the first copy is fresh");
    };
    let copies: Vec<_> = (0..6)
        .map(|_| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                claim_and_commit(&pool, "rolled-back", b"x", Duration::from_millis(10)).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    first.rollback().await.unwrap();
    let mut fresh = 0;
    for copy in copies {
        fresh += usize::from(copy.await.unwrap() == Claim::Fresh);
    }
    assert_eq!(fresh, 1, "after a rollback, one other copy is fresh");
    stop.store(true, Ordering::Relaxed);
    maintaining.await.unwrap();
    let claims: i64 = db.claims().await;
    assert_eq!(claims, 5, "one claim per id");
}

#[tokio::test]
async fn an_id_claimed_in_one_partition_is_a_duplicate_after_the_next_opened() {
    let db = partitioned_db(Duration::from_secs(60)).await;
    assert_eq!(
        claim_and_commit(&db.pool, "m-1", b"body", Duration::ZERO).await,
        Claim::Fresh
    );
    let first = partition_of(&db, "m-1").await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let done = idempo::inbox::Inbox::new("c")
        .maintain(&db.pool, Some(Duration::from_secs(60)), &seconds())
        .await
        .unwrap();
    assert!(!done.skipped);
    // A new partition took the claims: m-2 lands elsewhere than m-1.
    assert_eq!(
        claim_and_commit(&db.pool, "m-2", b"body", Duration::ZERO).await,
        Claim::Fresh
    );
    assert_ne!(partition_of(&db, "m-2").await, first);
    assert_eq!(
        claim_and_commit(&db.pool, "m-1", b"body", Duration::ZERO).await,
        Claim::Duplicate
    );
    assert_eq!(
        claim_and_commit(&db.pool, "m-1", b"other", Duration::ZERO).await,
        Claim::Mismatch
    );
    // Inside a transaction of the caller's, and in a batch with a repeat.
    let mut tx = db.pool.begin().await.unwrap();
    let claims = inbox::Inbox::new("c")
        .partitioned(true)
        .claim_batch(
            &mut tx,
            &[
                ("m-1", b"body"),
                ("m-3", b"x"),
                ("m-3", b"x"),
                ("m-3", b"y"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(
        claims,
        [
            Claim::Duplicate,
            Claim::Fresh,
            Claim::Duplicate,
            Claim::Mismatch
        ]
    );
    tx.commit().await.unwrap();
    assert_eq!(db.claims().await, 3);
}

#[tokio::test]
async fn a_claim_at_repeatable_read_is_refused() {
    let db = partitioned_db(Duration::from_secs(60)).await;
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    let error = inbox::Inbox::new("c")
        .partitioned(true)
        .claim(&mut tx, "m-1", b"x")
        .await
        .expect_err("refused");
    assert!(
        matches!(
            error.downcast_ref::<PartitionError>(),
            Some(PartitionError::NotReadCommitted { level }) if level.contains("repeatable")
        ),
        "{error}"
    );
}

#[tokio::test]
async fn partitions_beyond_the_horizon_go_while_claims_run() {
    let retention = Duration::from_secs(2);
    let db = partitioned_db(retention).await;
    let (stop, maintaining) = maintainer(&db, retention);
    let start = Instant::now();
    let mut claimed: Vec<(String, Instant)> = Vec::new();
    let mut n = 0;
    // For five seconds: fresh ids, and redeliveries of ids claimed less than
    // the retention ago, which must all be duplicates.
    while start.elapsed() < Duration::from_secs(5) {
        let batch: Vec<String> = (0..4).map(|i| format!("id-{n}-{i}")).collect();
        n += 1;
        let messages: Vec<(&str, &[u8])> =
            batch.iter().map(|id| (id.as_str(), &b"b"[..])).collect();
        let begun = inbox::Inbox::new("c")
            .partitioned(true)
            .begin_batch(&db.pool, &messages)
            .await
            .expect("claims run while partitions go");
        assert!(begun.claims.iter().all(|c| *c == Claim::Fresh));
        let tx = begun.tx.expect("fresh");
        inbox::Inbox::new("c")
            .commit(tx, &batch[0])
            .await
            .expect("commit");
        let at = Instant::now();
        claimed.extend(batch.into_iter().map(|id| (id, at)));
        for (id, at) in claimed.iter().rev().step_by(7).take(5) {
            if at.elapsed() < retention - Duration::from_millis(300) {
                let again = claim_and_commit(&db.pool, id, b"b", Duration::ZERO).await;
                assert_eq!(
                    again,
                    Claim::Duplicate,
                    "{id}, claimed {:?} ago",
                    at.elapsed()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let dropped = maintaining.await.unwrap();
    assert!(dropped.len() >= 2, "partitions went: {dropped:?}");
    // The partition of the claims before the switch went first.
    assert!(dropped[0].starts_with("processed_messages_before_"));
    // What is left is the horizon and the partitions ahead, not the history.
    let left = partitioned::Partition::list(&db.pool).await.unwrap();
    assert!(left.len() <= 2 + 1 + 3 + 1, "{left:?}");
    let oldest: f64 = sqlx::query_scalar(
        "SELECT coalesce(extract(epoch FROM now() - min(processed_at)), 0)::float8 FROM processed_messages",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(oldest < 4.0, "the oldest claim is {oldest}s old");
}

#[tokio::test]
async fn a_second_maintainer_skips_while_the_first_holds_the_lock() {
    let db = partitioned_db(Duration::from_secs(60)).await;
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query(
        "SELECT pg_advisory_lock(hashtextextended('idempo processed_messages partitions ' || current_schema(), 28))",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let done = idempo::inbox::Inbox::new("c")
        .maintain(&db.pool, Some(Duration::from_secs(60)), &seconds())
        .await
        .unwrap();
    assert!(done.skipped);
    // Claims do not wait for maintainers.
    assert_eq!(
        claim_and_commit(&db.pool, "m-1", b"x", Duration::ZERO).await,
        Claim::Fresh
    );
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut *holder)
        .await
        .unwrap();
    drop(holder);
    let done = idempo::inbox::Inbox::new("c")
        .maintain(&db.pool, Some(Duration::from_secs(60)), &seconds())
        .await
        .unwrap();
    assert!(!done.skipped);
}

#[tokio::test]
async fn claims_made_before_the_switch_still_deduplicate_after_it() {
    let db = Db::new().await;
    for i in 0..50 {
        let id = format!("before-{i}");
        let Begun::Fresh(tx) = inbox::Inbox::new("c")
            .begin(&db.pool, &id, b"body")
            .await
            .unwrap()
        else {
            panic!("fresh");
        };
        inbox::Inbox::new("c").commit(tx, &id).await.unwrap();
    }
    assert!(
        !partitioned::Partitioning::table_is_partitioned(&db.pool)
            .await
            .unwrap()
    );
    // The partitioned claim refuses the plain table.
    assert!(
        inbox::Inbox::new("c")
            .partitioned(true)
            .begin(&db.pool, "x", b"x")
            .await
            .is_err()
    );
    let retention = Duration::from_secs(3600);
    let switched = seconds().switch(&db.pool, Some(retention)).await.unwrap();
    let before = switched.before.expect("the plain table became a partition");
    assert!(
        partitioned::Partitioning::table_is_partitioned(&db.pool)
            .await
            .unwrap()
    );
    assert_eq!(db.claims().await, 50, "no claim lost");
    for i in 0..50 {
        let id = format!("before-{i}");
        assert_eq!(
            claim_and_commit(&db.pool, &id, b"body", Duration::ZERO).await,
            Claim::Duplicate,
            "{id}"
        );
        assert_eq!(partition_of(&db, &id).await, before);
    }
    assert_eq!(
        claim_and_commit(&db.pool, "before-0", b"other", Duration::ZERO).await,
        Claim::Mismatch
    );
    assert_eq!(
        claim_and_commit(&db.pool, "after-0", b"body", Duration::ZERO).await,
        Claim::Fresh
    );
    // A consumer left in the plain mode fails loudly instead of claiming
    // where the partitioned probe would not look... or where it would, but
    // without the lock.
    let plain = inbox::Inbox::new("c")
        .begin(&db.pool, "plain-0", b"body")
        .await;
    assert!(
        plain.is_err(),
        "a plain claim on the partitioned table fails"
    );
    // The plain reaper deletes nothing it cannot name.
    assert_eq!(
        inbox::Inbox::new("c")
            .delete_processed_before(&db.pool, Duration::ZERO, 100)
            .await
            .unwrap(),
        0
    );
    // The switch is idempotent, and the read-only views still work.
    let again = seconds().switch(&db.pool, Some(retention)).await.unwrap();
    assert!(again.already);
    assert_eq!(
        inbox::Inbox::new("c")
            .lookup(&db.pool, "before-7", b"body")
            .await
            .unwrap(),
        Claim::Duplicate
    );
    let per_consumer = inbox::ConsumerClaims::list(&db.pool, &[]).await.unwrap();
    assert_eq!(per_consumer[0].claims, 51);
}

/// The AMQP consumer in the partitioned mode (`ConsumerBuilder::partitioned`),
/// through the test harness: racing copies and a redelivery after the
/// partition rolled over apply the payment once.
#[cfg(feature = "testing")]
#[tokio::test]
async fn the_consumer_in_partitioned_mode_applies_each_payment_once() {
    use idempo::Tx;
    use idempo::consumer::{JsonBody, Message};
    use idempo::testing::Harness;
    use support::payments::{self, Behaviour, Payment};

    let h = Harness::new(support::small_pool().await, "partitioned")
        .setup(payments::TABLES)
        .configure(|c| c.partitioned(seconds()))
        .handler(move |tx: Tx, m: (JsonBody<Payment>, Message)| {
            payments::handle(tx, m, Behaviour::default())
        })
        .await
        .expect("harness");
    seconds()
        .switch(h.pool(), Some(Duration::from_secs(60)))
        .await
        .unwrap();
    let payment = Payment {
        account: "a".into(),
        amount_cents: 5,
    };
    let message = h.json("pay-1", &payment);
    let copies = h.deliver_concurrently(message.clone(), 6).await.unwrap();
    assert_eq!(copies.iter().filter(|d| d.is_acked()).count(), 1);
    assert_eq!(copies.iter().filter(|d| d.is_duplicate()).count(), 5);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    idempo::inbox::Inbox::new(h.consumer())
        .maintain(h.pool(), Some(Duration::from_secs(60)), &seconds())
        .await
        .unwrap();
    let again = h.deliver(message).await.unwrap();
    assert!(again.is_duplicate(), "{again:?}");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE message_id = 'pay-1'")
        .fetch_one(h.pool())
        .await
        .unwrap();
    assert_eq!(rows, 1);
}

/// A one-off timing, not a proof (`cargo test --all-features --test retention
/// -- --ignored --nocapture`): sequential fresh claims with `BEGIN` and commit
/// and duplicate claims, plain table vs partitioned (`partitions` partitions
/// attached), per claim.
#[tokio::test]
#[ignore = "a timing: run it by hand"]
async fn claim_cost_plain_vs_partitioned() {
    const N: usize = 1_000;
    async fn time(db: &Db, partitioned: bool, prefix: &str) -> (Duration, Duration) {
        let begin = |id: String| {
            let pool = db.pool.clone();
            async move {
                if partitioned {
                    inbox::Inbox::new("c")
                        .partitioned(true)
                        .begin(&pool, &id, b"body")
                        .await
                } else {
                    inbox::Inbox::new("c").begin(&pool, &id, b"body").await
                }
                .unwrap()
            }
        };
        let start = Instant::now();
        for i in 0..N {
            let id = format!("{prefix}-{i}");
            let Begun::Fresh(tx) = begin(id.clone()).await else {
                panic!("fresh")
            };
            inbox::Inbox::new("c").commit(tx, &id).await.unwrap();
        }
        let fresh = start.elapsed() / N as u32;
        let start = Instant::now();
        for i in 0..N {
            assert!(matches!(
                begin(format!("{prefix}-{i}")).await,
                Begun::Duplicate
            ));
        }
        (fresh, start.elapsed() / N as u32)
    }
    let plain = Db::new().await;
    time(&plain, false, "warm").await;
    let (fresh, duplicate) = time(&plain, false, "m").await;
    println!("plain:        fresh claim + commit {fresh:?}, duplicate {duplicate:?}");
    for period in [3600u64, 450, 150] {
        // A one-hour retention cut into periods: 1 + 3600/period partitions
        // live, 2 ahead.
        let db = Db::new().await;
        let cut = Partitioning::new()
            .period(Duration::from_secs(period))
            .ahead(2);
        cut.switch(&db.pool, None).await.unwrap();
        let mut conn = db.pool.acquire().await.unwrap();
        // Partitions of the past: attached as the retention would keep them.
        for k in 1..(3600 / period) as i64 {
            let (from, to) = (4_000_000_000 + k * 1000, 4_000_000_000 + k * 1000 + 1000);
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE old_{k} (LIKE processed_messages INCLUDING DEFAULTS); \
                 ALTER TABLE old_{k} ADD PRIMARY KEY (consumer, message_id); \
                 ALTER TABLE processed_messages ATTACH PARTITION old_{k} \
                 FOR VALUES FROM (to_timestamp({from})) TO (to_timestamp({to}))"
            )))
            .execute(&mut *conn)
            .await
            .unwrap();
        }
        drop(conn);
        let n = partitioned::Partition::list(&db.pool).await.unwrap().len();
        time(&db, true, "warm").await;
        let (fresh, duplicate) = time(&db, true, "m").await;
        println!(
            "partitioned ({n} partitions): fresh claim + commit {fresh:?}, duplicate {duplicate:?}"
        );
    }
}

/// A consumer not seen for longer than its own retention stops holding
/// partitions for the others: its registration is forgotten at the next
/// pass. One kept forever is never forgotten, and a recent one stays.
#[tokio::test]
async fn consumers_gone_longer_than_their_retention_are_forgotten() {
    let db = partitioned_db(Duration::from_secs(60)).await;
    let maintain = |consumer: &'static str, retention: Option<Duration>| {
        let pool = db.pool.clone();
        async move {
            idempo::inbox::Inbox::new(consumer)
                .maintain(&pool, retention, &seconds())
                .await
                .unwrap()
        }
    };
    maintain("gone", Some(Duration::from_secs(3600))).await;
    maintain("forever", None).await;
    maintain("recent", Some(Duration::from_secs(3600))).await;
    // Not seen for two hours: longer than "gone"'s hour, and "forever"'s too.
    sqlx::query(
        "UPDATE processed_messages_retention SET seen_at = now() - interval '2 hours' \
         WHERE consumer IN ('gone', 'forever')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let done = maintain("c", Some(Duration::from_secs(60))).await;
    assert!(!done.skipped);
    assert_eq!(done.forgotten, ["gone"]);
    let left: Vec<String> =
        sqlx::query_scalar("SELECT consumer FROM processed_messages_retention ORDER BY consumer")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(left, ["c", "forever", "recent"]);
}

/// A maintenance pass borrows a pooled connection and gives it back as it
/// found it: the same backend (not closed and replaced every interval), no
/// advisory lock left, the session's lock timeout restored.
#[tokio::test]
async fn a_pass_returns_its_connection_unlocked_and_as_it_was() {
    let db = partitioned_db(Duration::from_secs(60)).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .expect("a one-connection pool");
    let pid = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = pid(pool.clone()).await;
    for _ in 0..2 {
        let done = idempo::inbox::Inbox::new("c")
            .maintain(&pool, Some(Duration::from_secs(60)), &seconds())
            .await
            .unwrap();
        assert!(!done.skipped);
    }
    assert_eq!(pid(pool.clone()).await, before, "the same connection");
    let (advisory, timeout): (i64, String) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                 AND pid = pg_backend_pid()), current_setting('lock_timeout')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((advisory, timeout.as_str()), (0, "0"));
    pool.close().await;
}
