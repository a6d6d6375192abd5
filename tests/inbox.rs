//! The transport-agnostic inbox: `claim` inside the caller's transaction.

mod support;

use std::time::Duration;

use idempo::inbox::{self, Claim};
use support::Db;

/// Claims in a transaction of its own, then commits it or rolls it back.
async fn claim_then(db: &Db, consumer: &str, id: &str, body: &[u8], commit: bool) -> Claim {
    let mut tx = db.pool.begin().await.unwrap();
    let claim = inbox::claim(&mut tx, consumer, id, body).await.unwrap();
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
        let claim = inbox::claim(&mut tx, "c", "m-1", b"x").await.unwrap();
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
        inbox::claim(&mut first, "c", "m-1", b"x").await.unwrap(),
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
        inbox::claim(&mut first, "c", "m-1", b"x").await.unwrap(),
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
    let empty = inbox::claim(&mut tx, "c", "", b"x").await.unwrap_err();
    assert_eq!(empty.to_string(), "empty message id");
    let long = inbox::claim(&mut tx, "c", &"x".repeat(256), b"x")
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
    let deleted = inbox::delete_processed_before(&db.pool, "billing", week, 2)
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

/// sqlx 0.9.0 connects without `TCP_NODELAY` (sqlx#4335), and then every
/// statement larger than one TCP segment (a batch's claims) waits up to 40 ms
/// for the server's delayed ACK. This repository builds against sqlx-core
/// with it restored (vendor/README.md): this fails if that patch is lost.
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
