//! The transport-agnostic inbox: `claim` inside the caller's transaction.

mod support;
// The counting proxy the throughput bench reads the wire with.
#[path = "support/pg_trips.rs"]
#[allow(dead_code)]
mod pg_trips;

use std::time::Duration;

use idempo::inbox::{self, Begun, Claim};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::Db;

/// Claims in a transaction of its own, then commits it or rolls it back.
async fn claim_then(db: &Db, consumer: &str, id: &str, body: &[u8], commit: bool) -> Claim {
    let mut tx = db.pool.begin().await.unwrap();
    let claim = inbox::Inbox::new(consumer)
        .claim(&mut tx, id, body)
        .await
        .unwrap();
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    claim
}

#[tokio::test]
async fn a_committed_claim_makes_the_next_one_a_duplicate() {
    let db = Db::new().await;
    assert_eq!(
        claim_then(&db, "c", "m-1", b"body", true).await,
        Claim::Fresh
    );
    assert_eq!(
        claim_then(&db, "c", "m-1", b"body", false).await,
        Claim::Duplicate
    );
    assert_eq!(db.claims().await, 1);
}

#[tokio::test]
async fn the_same_id_with_another_body_is_a_mismatch() {
    let db = Db::new().await;
    assert_eq!(
        claim_then(&db, "c", "m-1", b"first", true).await,
        Claim::Fresh
    );
    assert_eq!(
        claim_then(&db, "c", "m-1", b"second", false).await,
        Claim::Mismatch
    );
}

#[tokio::test]
async fn a_rolled_back_claim_leaves_the_id_free() {
    let db = Db::new().await;
    assert_eq!(claim_then(&db, "c", "m-1", b"x", false).await, Claim::Fresh);
    assert_eq!(claim_then(&db, "c", "m-1", b"x", false).await, Claim::Fresh);
    assert_eq!(db.claims().await, 0);
}

#[tokio::test]
async fn ids_are_scoped_by_consumer() {
    let db = Db::new().await;
    assert_eq!(
        claim_then(&db, "billing", "m-1", b"x", true).await,
        Claim::Fresh
    );
    assert_eq!(
        claim_then(&db, "ledger", "m-1", b"x", true).await,
        Claim::Fresh
    );
    assert_eq!(db.claims().await, 2);
}

/// Starts a second claim of `m-1` in its own transaction, waits until its
/// backend is blocked on a lock (the first claim's uncommitted row), and
/// returns the task, which commits and yields its claim.
async fn blocked_second_claim(db: &Db) -> tokio::task::JoinHandle<Claim> {
    let pool = db.pool.clone();
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        pid_tx.send(pid).unwrap();
        let claim = inbox::Inbox::new("c")
            .claim(&mut tx, "m-1", b"x")
            .await
            .unwrap();
        tx.commit().await.unwrap();
        claim
    });
    let pid = pid_rx.await.unwrap();
    support::eventually(
        "the second claim waits on the first one's row lock",
        Duration::from_secs(10),
        || async {
            let waiting: Option<String> =
                sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                    .bind(pid)
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
            waiting.as_deref() == Some("Lock")
        },
    )
    .await;
    assert!(!second.is_finished());
    second
}

#[tokio::test]
async fn a_concurrent_claim_waits_for_the_first_and_then_sees_a_duplicate() {
    let db = Db::new().await;
    let mut first = db.pool.begin().await.unwrap();
    assert_eq!(
        inbox::Inbox::new("c")
            .claim(&mut first, "m-1", b"x")
            .await
            .unwrap(),
        Claim::Fresh
    );
    let second = blocked_second_claim(&db).await;
    first.commit().await.unwrap();
    assert_eq!(second.await.unwrap(), Claim::Duplicate);
    assert_eq!(db.claims().await, 1);
}

#[tokio::test]
async fn a_concurrent_claim_proceeds_when_the_first_rolls_back() {
    let db = Db::new().await;
    let mut first = db.pool.begin().await.unwrap();
    assert_eq!(
        inbox::Inbox::new("c")
            .claim(&mut first, "m-1", b"x")
            .await
            .unwrap(),
        Claim::Fresh
    );
    let second = blocked_second_claim(&db).await;
    first.rollback().await.unwrap();
    assert_eq!(second.await.unwrap(), Claim::Fresh);
    assert_eq!(db.claims().await, 1);
}

#[tokio::test]
async fn invalid_ids_are_refused_before_touching_the_table() {
    let db = Db::new().await;
    let mut tx = db.pool.begin().await.unwrap();
    let empty = inbox::Inbox::new("c")
        .claim(&mut tx, "", b"x")
        .await
        .unwrap_err();
    assert_eq!(empty.to_string(), "empty message id");
    let long = inbox::Inbox::new("c")
        .claim(&mut tx, &"x".repeat(256), b"x")
        .await
        .unwrap_err();
    assert_eq!(
        long.to_string(),
        "message id is 256 bytes long, the limit is 255"
    );
    assert!(matches!(long, idempo::Error::InvalidMessageId(_)));
}

/// Inserts claims for `consumer` that were processed `days` ago.
async fn old_claims(db: &Db, consumer: &str, count: i64, days: i64) {
    sqlx::query(
        "INSERT INTO processed_messages (consumer, message_id, processed_at) \
         SELECT $1, $1 || '-' || $3::text || '-' || n, now() - make_interval(days => $3::int) \
         FROM generate_series(1, $2) n",
    )
    .bind(consumer)
    .bind(count)
    .bind(days)
    .execute(&db.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn retention_deletes_only_this_consumers_old_claims_in_batches() {
    let db = Db::new().await;
    old_claims(&db, "billing", 7, 8).await; // older than a week
    old_claims(&db, "billing", 3, 1).await; // recent
    old_claims(&db, "ledger", 4, 8).await; // another consumer's

    let week = Duration::from_secs(7 * 24 * 3600);
    let deleted = inbox::Inbox::new("billing")
        .delete_processed_before(&db.pool, week, 2)
        .await
        .unwrap();

    assert_eq!(deleted, 7, "four batches of at most 2");
    let left: Vec<(String, i64)> = sqlx::query_as(
        "SELECT consumer, count(*) FROM processed_messages GROUP BY consumer ORDER BY consumer",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(left, [("billing".into(), 3), ("ledger".into(), 4)]);
}

/// sqlx-core 0.9.0 connected without `TCP_NODELAY` (sqlx#4335), and then
/// every statement larger than one TCP segment (a batch's claims) waited up
/// to 40 ms for the server's delayed ACK. idempo requires 0.9.1, which sets
/// it again: this fails if a dependency change brings the old behaviour back.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn connections_to_postgres_over_tcp_send_without_delay() {
    use std::os::fd::BorrowedFd;

    let db = Db::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let (port, server_port): (Option<i32>, Option<i32>) =
        sqlx::query_as("SELECT inet_client_port(), inet_server_port()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    let (Some(port), Some(server_port)) = (port, server_port) else {
        panic!("DATABASE_URL must reach PostgreSQL over TCP for this test, not a Unix socket");
    };
    let (port, server_port) = (port as u16, server_port as u16);
    let mut nodelay = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let Ok(fd) = entry.unwrap().file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // SAFETY: the descriptor is only inspected with getsockname/getsockopt
        // while `conn` keeps the connection (and so its socket) open; a
        // descriptor that is not a socket, or closed meanwhile, makes them fail.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let socket = socket2::SockRef::from(&fd);
        let local = socket.local_addr().ok().and_then(|a| a.as_socket());
        let peer = socket.peer_addr().ok().and_then(|a| a.as_socket());
        if let (Some(local), Some(peer)) = (local, peer)
            && local.port() == port
            && peer.port() == server_port
        {
            nodelay.push(socket.tcp_nodelay().unwrap());
        }
    }
    assert_eq!(
        nodelay,
        [true],
        "the pool's connection (local port {port}) should have TCP_NODELAY set"
    );
}

// ------------------------------------------------ begin_claim and commit
//
// `Inbox::begin` and `Inbox::commit` (`inbox` module docs, "The wire
// shape"): BEGIN, then the claim; the claim check, then COMMIT.

/// What a `begin_claim` found, without its transaction.
fn found(begun: &Begun) -> Claim {
    match begun {
        Begun::Fresh(_) => Claim::Fresh,
        Begun::Duplicate => Claim::Duplicate,
        Begun::Mismatch => Claim::Mismatch,
    }
}

/// `begin_claim`, then `commit` when fresh; returns what the claim found.
async fn begin_claim_then_commit(pool: &PgPool, consumer: &str, id: &str, body: &[u8]) -> Claim {
    let begun = inbox::Inbox::new(consumer)
        .begin(pool, id, body)
        .await
        .unwrap_or_else(|e| panic!("begin_claim of {id:?}: {e}"));
    let claim = found(&begun);
    if let Begun::Fresh(tx) = begun {
        inbox::Inbox::new(consumer)
            .commit(tx, id)
            .await
            .unwrap_or_else(|e| panic!("commit of {id:?}: {e}"));
    }
    claim
}

/// A pool of one connection on PostgreSQL, outside the test's schema: for
/// looking at the test's connections from the side.
async fn observer() -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect(&support::database_url())
        .await
        .expect("connect the observer")
}

/// The `pg_stat_activity` state of backend `pid` ("idle", "idle in
/// transaction", "idle in transaction (aborted)", ...).
async fn backend_state(observer: &PgPool, pid: i32) -> Option<String> {
    sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_one(observer)
        .await
        .unwrap()
}

/// The claims committed in `db`'s schema, seen from `observer`.
async fn committed_claims(observer: &PgPool, db: &Db) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}.processed_messages",
        db.schema
    )))
    .fetch_one(observer)
    .await
    .unwrap()
}

#[tokio::test]
async fn begin_claim_is_fresh_once_then_a_duplicate_or_a_mismatch_with_no_transaction_left_open() {
    // One connection, so that every claim goes through the same backend.
    let db = Db::with_pool_size(1).await;
    idempo::migrate(&db.pool).await.unwrap();
    let observer = observer().await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&db.pool)
        .await
        .unwrap();

    let Begun::Fresh(tx) = inbox::Inbox::new("c")
        .begin(&db.pool, "m-1", b"body")
        .await
        .unwrap()
    else {
        panic!("the first claim is fresh");
    };
    assert_eq!(
        backend_state(&observer, pid).await.as_deref(),
        Some("idle in transaction"),
        "the claim waits in an open transaction"
    );
    assert_eq!(
        committed_claims(&observer, &db).await,
        0,
        "not before COMMIT"
    );
    inbox::Inbox::new("c").commit(tx, "m-1").await.unwrap();
    assert_eq!(db.claims().await, 1);

    for (body, expected) in [
        (&b"body"[..], Claim::Duplicate),
        (&b"another body"[..], Claim::Mismatch),
    ] {
        let begun = inbox::Inbox::new("c")
            .begin(&db.pool, "m-1", body)
            .await
            .unwrap();
        assert_eq!(found(&begun), expected);
        // The empty transaction of a duplicate is dropped: its ROLLBACK goes
        // with the pool's check of the released connection, which is then
        // idle, not in a transaction.
        support::eventually(
            &format!("the connection idle after a {expected:?}"),
            Duration::from_secs(5),
            || async { backend_state(&observer, pid).await.as_deref() == Some("idle") },
        )
        .await;
        assert_eq!(
            inbox::Inbox::new("c")
                .lookup(&db.pool, "m-1", body)
                .await
                .unwrap(),
            expected
        );
    }
    let same: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(same, pid, "the same connection served every claim");
    assert_eq!(
        begin_claim_then_commit(&db.pool, "c", "m-2", b"body").await,
        Claim::Fresh,
        "the connection takes the next claim"
    );
    assert_eq!(db.claims().await, 2);
}

/// The stored body hash of `consumer`'s claim of `id`.
async fn stored_hash(pool: &PgPool, consumer: &str, id: &str) -> Option<Vec<u8>> {
    sqlx::query_scalar(
        "SELECT payload_sha256 FROM processed_messages WHERE consumer = $1 AND message_id = $2",
    )
    .bind(consumer)
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn begin_claim_batch_claims_the_first_copy_of_a_repeated_id() {
    let db = Db::new().await;
    let batch: [(&str, &[u8]); 6] = [
        ("b", b"2"),
        ("a", b"1"),
        ("a", b"1"),     // the same message again
        ("a", b"other"), // the id reused
        ("c", b"3"),
        ("b", b"2"),
    ];
    let claimed = inbox::Inbox::new("c")
        .begin_batch(&db.pool, &batch)
        .await
        .unwrap();
    use Claim::{Duplicate, Fresh, Mismatch};
    assert_eq!(
        claimed.claims,
        [Fresh, Fresh, Duplicate, Mismatch, Fresh, Duplicate]
    );
    let tx = claimed
        .tx
        .expect("fresh claims come with their transaction");
    assert_eq!(db.claims().await, 0, "not before COMMIT");
    inbox::Inbox::new("c").commit(tx, "a").await.unwrap();
    assert_eq!(db.claims().await, 3, "one row per id");
    assert_eq!(
        stored_hash(&db.pool, "c", "a").await.as_deref(),
        Some(&inbox::Inbox::payload_sha256(b"1")[..]),
        "the first copy's body"
    );

    // Against committed claims, with repeats among the new ids too.
    let again: [(&str, &[u8]); 6] = [
        ("a", b"1"),
        ("a", b"other"),
        ("d", b"4"),
        ("d", b"4"),
        ("d", b"not 4"),
        ("b", b"zz"),
    ];
    let claimed = inbox::Inbox::new("c")
        .begin_batch(&db.pool, &again)
        .await
        .unwrap();
    assert_eq!(
        claimed.claims,
        [Duplicate, Mismatch, Fresh, Duplicate, Mismatch, Mismatch]
    );
    inbox::Inbox::new("c")
        .commit(claimed.tx.unwrap(), "d")
        .await
        .unwrap();
    assert_eq!(db.claims().await, 4);

    // Nothing fresh: no transaction.
    let claimed = inbox::Inbox::new("c")
        .begin_batch(&db.pool, &again[..2])
        .await
        .unwrap();
    assert_eq!(claimed.claims, [Duplicate, Mismatch]);
    assert!(claimed.tx.is_none());
}

/// Starts `begin_claim` of `m-1` for `consumer` in a task (committing it
/// when fresh), waits until its backend is blocked on a lock (the first
/// claim's uncommitted row; its query holds `consumer` as a literal), and
/// returns the task.
async fn blocked_second_begin_claim(
    db: &Db,
    consumer: &str,
    first: &mut sqlx::Transaction<'static, sqlx::Postgres>,
) -> tokio::task::JoinHandle<Claim> {
    let first_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **first)
        .await
        .unwrap();
    let (pool, name) = (db.pool.clone(), consumer.to_owned());
    let second =
        tokio::spawn(async move { begin_claim_then_commit(&pool, &name, "m-1", b"x").await });
    support::eventually(
        "the second claim waits on the first one's row lock",
        Duration::from_secs(10),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(first_pid)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            waiting == 1
        },
    )
    .await;
    assert!(!second.is_finished());
    second
}

#[tokio::test]
async fn a_concurrent_begin_claim_waits_for_the_first_and_then_sees_a_duplicate() {
    let db = Db::new().await;
    let consumer = support::unique("c");
    let Begun::Fresh(mut first) = inbox::Inbox::new(&consumer)
        .begin(&db.pool, "m-1", b"x")
        .await
        .unwrap()
    else {
        panic!("the first claim is fresh");
    };
    let second = blocked_second_begin_claim(&db, &consumer, &mut first).await;
    inbox::Inbox::new(&consumer)
        .commit(first, "m-1")
        .await
        .unwrap();
    assert_eq!(second.await.unwrap(), Claim::Duplicate);
    assert_eq!(db.claims().await, 1);
}

#[tokio::test]
async fn a_concurrent_begin_claim_proceeds_when_the_first_rolls_back() {
    let db = Db::new().await;
    let consumer = support::unique("c");
    let Begun::Fresh(mut first) = inbox::Inbox::new(&consumer)
        .begin(&db.pool, "m-1", b"x")
        .await
        .unwrap()
    else {
        panic!("the first claim is fresh");
    };
    let second = blocked_second_begin_claim(&db, &consumer, &mut first).await;
    first.rollback().await.unwrap();
    assert_eq!(second.await.unwrap(), Claim::Fresh, "and it committed");
    assert_eq!(db.claims().await, 1);
}

/// `commit` of a savepoint checks the claim and releases the savepoint: the
/// outer transaction stays open, and nothing is visible until it commits.
/// A savepoint whose claim is gone or which is aborted is refused, and
/// rolling it back leaves the outer transaction able to commit.
#[tokio::test]
async fn commit_of_a_savepoint_releases_it_and_leaves_the_outer_transaction_open() {
    let db = Db::new().await;
    let Begun::Fresh(mut outer) = inbox::Inbox::new("c")
        .begin(&db.pool, "m-1", b"x")
        .await
        .unwrap()
    else {
        panic!("fresh");
    };
    let mut savepoint = sqlx::Acquire::begin(&mut outer).await.unwrap();
    sqlx::query("INSERT INTO payments (message_id, account, amount_cents) VALUES ('m-1', 'a', 1)")
        .execute(&mut *savepoint)
        .await
        .unwrap();
    inbox::Inbox::new("c")
        .commit(savepoint, "m-1")
        .await
        .unwrap();
    assert_eq!(
        (db.claims().await, db.payments().await),
        (0, 0),
        "the outer transaction is not committed"
    );
    let inside: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM processed_messages), (SELECT count(*) FROM payments)",
    )
    .fetch_one(&mut *outer)
    .await
    .unwrap();
    assert_eq!(inside, (1, 1), "the released savepoint's writes are in it");

    // A savepoint in which the claim was deleted: ClaimLost, nothing released.
    let mut savepoint = sqlx::Acquire::begin(&mut outer).await.unwrap();
    sqlx::query("DELETE FROM processed_messages")
        .execute(&mut *savepoint)
        .await
        .unwrap();
    let lost = inbox::Inbox::new("c")
        .commit(savepoint, "m-1")
        .await
        .unwrap_err();
    assert!(
        matches!(&lost, idempo::Error::ClaimLost { message_id } if message_id == "m-1"),
        "{lost}"
    );
    // A savepoint with a failed statement: refused as aborted.
    let mut savepoint = sqlx::Acquire::begin(&mut outer).await.unwrap();
    let _ = sqlx::query("SELECT 1 / 0").execute(&mut *savepoint).await;
    let aborted = inbox::Inbox::new("c")
        .commit(savepoint, "m-1")
        .await
        .unwrap_err();
    assert!(aborted.is_aborted_transaction(), "{aborted}");

    // Both rolled back to their savepoints: the outer transaction commits
    // with its claim and the first savepoint's write.
    inbox::Inbox::new("c").commit(outer, "m-1").await.unwrap();
    assert_eq!((db.claims().await, db.payments().await), (1, 1));
}

/// The claim check refuses what a plain `COMMIT` would have turned into a
/// silent rollback (an aborted transaction) or found nothing to commit in
/// (the caller's own `ROLLBACK`).
#[tokio::test]
async fn commit_refuses_an_aborted_transaction_and_one_the_caller_ended() {
    let db = Db::new().await;
    let Begun::Fresh(mut tx) = inbox::Inbox::new("c")
        .begin(&db.pool, "m-1", b"x")
        .await
        .unwrap()
    else {
        panic!("fresh");
    };
    let _ = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
    let aborted = inbox::Inbox::new("c").commit(tx, "m-1").await.unwrap_err();
    assert!(aborted.is_aborted_transaction(), "{aborted}");
    assert!(!aborted.is_connection_error());

    let Begun::Fresh(mut tx) = inbox::Inbox::new("c")
        .begin(&db.pool, "m-1", b"x")
        .await
        .unwrap()
    else {
        panic!("fresh again: nothing was committed");
    };
    sqlx::query("INSERT INTO payments (message_id, account, amount_cents) VALUES ('m-1', 'a', 1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("ROLLBACK").execute(&mut *tx).await.unwrap();
    let lost = inbox::Inbox::new("c").commit(tx, "m-1").await.unwrap_err();
    assert!(matches!(lost, idempo::Error::ClaimLost { .. }), "{lost}");
    assert_eq!((db.claims().await, db.payments().await), (0, 0));
    assert_eq!(
        begin_claim_then_commit(&db.pool, "c", "m-1", b"x").await,
        Claim::Fresh,
        "the id is still free"
    );
}

// ------------------------------------------------ hostile message ids
//
// Ids travel in the SQL text as literals (`src/literal.rs`): every one must
// be claimed once, found again, and stored as it came, byte for byte,
// whatever `standard_conforming_strings` says.

/// A consumer name with quotes and backslashes: it travels as a literal too.
const HOSTILE_CONSUMER: &str = "c'o\\n''s\\'u$$m;er--";

/// The body each hostile id is claimed with.
fn body_of(id: &str) -> Vec<u8> {
    format!("body of {id}").into_bytes()
}

#[tokio::test]
async fn hostile_message_ids_are_claimed_once_and_stored_byte_for_byte() {
    let db = Db::new().await;
    let transcript = hostile_ids_round_trip(&db.pool).await;
    assert_eq!(transcript.len(), 2 * support::hostile_ids().len());
}

#[tokio::test]
async fn hostile_message_ids_behave_the_same_without_standard_conforming_strings() {
    let db = Db::new().await;
    let off = support::pool_with_settings(&db, 2, &[("standard_conforming_strings", "off")]).await;
    // In such a session '\'' is a quote, not a backslash and an end.
    let quote: String = sqlx::query_scalar(r"SELECT '\''")
        .fetch_one(&off)
        .await
        .unwrap();
    assert_eq!(quote, "'");
    let transcript = hostile_ids_round_trip(&off).await;

    // The same checks on an ordinary pool, in a schema of its own: the
    // same answers.
    let on = Db::new().await;
    assert_eq!(hostile_ids_round_trip(&on.pool).await, transcript);
    off.close().await;
}

/// Claims every hostile id with `begin_claim` and with `begin_claim_batch`
/// (each id twice in the batch, and once with another body), commits, and
/// claims them again; checks every answer and what is stored, and returns
/// the stored rows of both consumers (id, body hash) for comparison.
async fn hostile_ids_round_trip(pool: &PgPool) -> Vec<(String, String, Vec<u8>)> {
    let ids = support::hostile_ids();
    let one = format!("{HOSTILE_CONSUMER} per message");
    for id in &ids {
        assert_eq!(
            begin_claim_then_commit(pool, &one, id, &body_of(id)).await,
            Claim::Fresh,
            "{id:?}"
        );
    }
    for id in &ids {
        assert_eq!(
            begin_claim_then_commit(pool, &one, id, &body_of(id)).await,
            Claim::Duplicate,
            "redelivery of {id:?}"
        );
        assert_eq!(
            begin_claim_then_commit(pool, &one, id, b"another body").await,
            Claim::Mismatch,
            "{id:?} reused"
        );
        assert_eq!(
            inbox::Inbox::new(&one)
                .lookup(pool, id, &body_of(id))
                .await
                .unwrap(),
            Claim::Duplicate,
            "{id:?} found by a bound parameter"
        );
    }

    let batch = format!("{HOSTILE_CONSUMER} batch");
    let bodies: Vec<Vec<u8>> = ids.iter().map(|id| body_of(id)).collect();
    let mut messages: Vec<(&str, &[u8])> = Vec::new();
    for (id, body) in ids.iter().zip(&bodies) {
        messages.push((id, body));
    }
    for (id, body) in ids.iter().zip(&bodies) {
        messages.push((id, body));
        messages.push((id, b"another body"));
    }
    let claimed = inbox::Inbox::new(&batch)
        .begin_batch(pool, &messages)
        .await
        .unwrap();
    let n = ids.len();
    let mut expected = vec![Claim::Fresh; n];
    expected.extend([Claim::Duplicate, Claim::Mismatch].repeat(n));
    assert_eq!(claimed.claims, expected);
    // The check of the commit names a hostile id too.
    inbox::Inbox::new(&batch)
        .commit(claimed.tx.unwrap(), &ids[9])
        .await
        .unwrap();
    let again = inbox::Inbox::new(&batch)
        .begin_batch(pool, &messages)
        .await
        .unwrap();
    let mut expected = vec![Claim::Duplicate; n];
    expected.extend([Claim::Duplicate, Claim::Mismatch].repeat(n));
    assert_eq!(again.claims, expected, "the redelivered batch");
    assert!(again.tx.is_none());

    let mut stored = Vec::new();
    for consumer in [&one, &batch] {
        let mut rows: Vec<(String, String, Vec<u8>)> = sqlx::query_as(
            "SELECT consumer, message_id, payload_sha256 FROM processed_messages \
             WHERE consumer = $1",
        )
        .bind(consumer)
        .fetch_all(pool)
        .await
        .unwrap();
        rows.sort();
        let mut wanted: Vec<(String, String, Vec<u8>)> = ids
            .iter()
            .map(|id| {
                let hash = inbox::Inbox::payload_sha256(&body_of(id)).to_vec();
                (consumer.clone(), id.clone(), hash)
            })
            .collect();
        wanted.sort();
        assert_eq!(rows, wanted, "{consumer}: stored as they came");
        stored.extend(rows);
    }
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_messages")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(
        total,
        2 * n as i64,
        "no other row, and the table is still there"
    );
    stored
}

/// A duplicate and a mismatch are normal events: they reach the client
/// without an ErrorResponse, so PostgreSQL writes no ERROR line to its log
/// (which operators alert on) and aborts no transaction. Counted on the wire,
/// through a proxy, for the single claim, the batch, and a claim inside the
/// caller's transaction.
#[tokio::test]
async fn duplicates_and_mismatches_raise_no_error_in_postgresql() {
    use std::str::FromStr;
    let db = Db::new().await;
    let base = sqlx::postgres::PgConnectOptions::from_str(&support::database_url()).unwrap();
    let proxy = pg_trips::Proxy::start(
        format!("{}:{}", base.get_host(), base.get_port()),
        Duration::ZERO,
    )
    .await
    .expect("the counting proxy");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            base.host(&proxy.addr.ip().to_string())
                .port(proxy.addr.port())
                .ssl_mode(sqlx::postgres::PgSslMode::Disable)
                .options([("search_path", db.schema.as_str())]),
        )
        .await
        .expect("PostgreSQL through the proxy");
    let inbox = inbox::Inbox::new("c");
    let Begun::Fresh(tx) = inbox.begin(&pool, "m-1", b"body").await.unwrap() else {
        panic!("the first claim is fresh");
    };
    inbox.commit(tx, "m-1").await.unwrap();
    let before = proxy.counts();
    for _ in 0..3 {
        assert!(matches!(
            inbox.begin(&pool, "m-1", b"body").await.unwrap(),
            Begun::Duplicate
        ));
        assert!(matches!(
            inbox.begin(&pool, "m-1", b"other").await.unwrap(),
            Begun::Mismatch
        ));
    }
    let batch = inbox
        .begin_batch(
            &pool,
            &[("m-1", b"body"), ("m-2", b"new"), ("m-1", b"other")],
        )
        .await
        .unwrap();
    assert_eq!(
        batch.claims,
        [Claim::Duplicate, Claim::Fresh, Claim::Mismatch]
    );
    drop(batch.tx);
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        inbox.claim(&mut tx, "m-1", b"body").await.unwrap(),
        Claim::Duplicate
    );
    tx.rollback().await.unwrap();
    let seen = proxy.counts() - before;
    assert_eq!(seen.errors, 0, "no ErrorResponse on the wire: {seen:?}");
    assert!(seen.complete > 0, "the proxy saw the claims: {seen:?}");
}

/// `commit` checks that the claim was made in *this* transaction: a
/// transaction whose claim of the id found it processed already (the
/// caller ignored the `Duplicate`) commits nothing and says so.
#[tokio::test]
async fn commit_refuses_a_transaction_whose_claim_was_a_duplicate() {
    let db = Db::new().await;
    let inbox = inbox::Inbox::new("c");
    let Begun::Fresh(tx) = inbox.begin(&db.pool, "m-1", b"body").await.unwrap() else {
        panic!("the first claim is fresh");
    };
    inbox.commit(tx, "m-1").await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    assert_eq!(
        inbox.claim(&mut tx, "m-1", b"body").await.unwrap(),
        Claim::Duplicate
    );
    sqlx::query("INSERT INTO payments (message_id, account, amount_cents) VALUES ('m-1', 'a', 1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let refused = inbox.commit(tx, "m-1").await.unwrap_err();
    assert!(
        matches!(refused, idempo::Error::ClaimLost { .. }),
        "{refused:?}"
    );
    assert_eq!(db.payments().await, 0, "nothing committed");
}
