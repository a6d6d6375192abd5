//! The transactional outbox against the real RabbitMQ and PostgreSQL:
//! staging commits and rolls back with the caller's writes, the relay
//! publishes each committed row at least once with its id through crashes,
//! cuts and refusals, ordering keys hold across two relays, and a downstream
//! idempo consumer applies every message exactly once.

mod support;

use std::collections::HashSet;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idempo::Tx;
use idempo::amqp::Consumer;
use idempo::amqp::Relay;
use idempo::consumer::{HandlerError, JsonBody, Message};
use idempo::http::{IdempotencyLayer, PostgresStore};
use idempo::outbox::{self, OutboxError, OutboxMessage};
use idempo::relay::RelayState;
use sqlx::PgPool;
use support::payments::{self, Payment};
use support::{Broker, Db, DeadLetter, TcpProxy, amqp_url, eventually, setup, unique};

const SOON: Duration = Duration::from_secs(30);

/// A relay tuned for tests: a short fallback poll and quick retries.
fn relay(pool: &PgPool) -> Relay {
    Relay::new(&amqp_url(), pool.clone())
        .unwrap()
        .poll_interval(Duration::from_millis(300))
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(200))
}

/// Runs `relay` in a task; the handle stops it gracefully.
struct Running {
    stop: idempo::consumer::ShutdownHandle,
    task: tokio::task::JoinHandle<idempo::Result<()>>,
}

impl Running {
    fn start(relay: Relay) -> Running {
        let stop = relay.shutdown_handle();
        Running {
            stop,
            task: tokio::spawn(relay.run()),
        }
    }

    async fn stop(self) {
        self.stop.shutdown();
        tokio::time::timeout(SOON, self.task)
            .await
            .expect("the relay stops")
            .expect("relay task")
            .expect("relay run");
    }

    /// As a crash: the task is dropped wherever it is.
    async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// Every message in `queue` now, in order (taken off the queue).
async fn take_all(broker: &Broker, queue: &str) -> Vec<DeadLetter> {
    broker.drain(queue).await
}

/// Takes messages from `queue` until `n` distinct ids arrived; returns every
/// copy in arrival order.
async fn collect_ids(broker: &Broker, queue: &str, n: usize) -> Vec<String> {
    let mut all = Vec::new();
    let mut distinct = HashSet::new();
    let start = std::time::Instant::now();
    while distinct.len() < n {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "only {} of {n} distinct messages arrived in {queue}",
            distinct.len()
        );
        let batch = take_all(broker, queue).await;
        if batch.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for m in batch {
            let id = m.message_id.expect("every outbox message has an id");
            distinct.insert(id.clone());
            all.push(id);
        }
    }
    all
}

/// The outbox rows a transaction sees.
async fn outbox_rows(conn: &mut sqlx::PgConnection) -> sqlx::Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(conn)
        .await
}

async fn pending(pool: &PgPool) -> i64 {
    outbox::OutboxStatus::read(pool).await.unwrap().pending
}

/// Stages `n` payment messages for `queue`, each in its own transaction;
/// returns their ids in staging order.
async fn stage_payments(pool: &PgPool, queue: &str, n: usize, key: Option<&str>) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let mut tx = pool.begin().await.unwrap();
        let mut message = OutboxMessage::json(
            "",
            queue,
            &Payment {
                account: format!("acct-{}", i % 7),
                amount_cents: i as i64 + 1,
            },
        )
        .unwrap();
        if let Some(key) = key {
            message = message.ordering_key(key);
        }
        ids.push(outbox::stage(&mut tx, message).await.unwrap());
        tx.commit().await.unwrap();
    }
    ids
}

#[tokio::test]
async fn a_handler_that_fails_emits_nothing_and_one_that_commits_emits_once_with_its_trace() {
    let (db, broker, queue) = setup().await;
    let receipts = unique("receipts");
    broker.declare(&receipts).await;
    let target = receipts.clone();
    let consumer = Consumer::builder(amqp_url(), db.pool.clone())
        .queue(&queue)
        .redelivery(
            idempo::consumer::RedeliveryPolicy::delayed([support::RETRY_DELAY]).max_attempts(1),
        )
        .handler(
            move |tx: Tx, (JsonBody(p), m): (JsonBody<Payment>, Message)| {
                let target = target.clone();
                async move {
                    let mut conn = tx.try_lock()?;
                    let receipt =
                        OutboxMessage::json("", &target, &p)?.derived_id(m.id(), "receipt");
                    outbox::stage(&mut conn, receipt).await?;
                    if p.account == "refused" {
                        return Err(HandlerError::permanent("refused after staging"));
                    }
                    Ok(())
                }
            },
        )
        .build()
        .unwrap();
    let health = consumer.health();
    let stop = consumer.shutdown_handle();
    let running = tokio::spawn(consumer.run());
    health.wait_for(|h| h.is_consuming()).await;
    // Dormant until its own handlers stage (or rows are pending in its
    // schema): other tests of this binary staging at the same time do not
    // wake it.
    assert_eq!(health.snapshot().relay, Some(RelayState::Dormant));

    broker
        .publish_payment(&queue, "refused-1", "refused", 5)
        .await;
    broker.publish_payment(&queue, "paid-1", "alice", 7).await;
    broker.publish_payment(&queue, "paid-2", "bob", 9).await;
    let ids = collect_ids(&broker, &receipts, 2).await;
    assert_eq!(ids.len(), 2, "each committed handler emitted once: {ids:?}");
    assert!(ids.contains(&support::derived_id("paid-1", "receipt")));
    assert!(ids.contains(&support::derived_id("paid-2", "receipt")));
    assert!(
        !ids.contains(&support::derived_id("refused-1", "receipt")),
        "the rolled-back handler emitted nothing"
    );
    assert_eq!(health.snapshot().relay, Some(RelayState::Running));
    eventually("the outbox is empty", SOON, || async {
        pending(&db.pool).await == 0
    })
    .await;
    stop.shutdown();
    running.await.unwrap().unwrap();
    assert_eq!(health.snapshot().relay, Some(RelayState::Stopped));
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead.len(), 1, "the refused payment is dead-lettered");
    assert!(
        take_all(&broker, &receipts).await.is_empty(),
        "nothing more arrived"
    );
}

#[tokio::test]
async fn staging_through_the_handlers_guard_is_written_by_the_commits_claim_check() {
    let (db, broker, queue) = setup().await;
    let out = unique("forwarded");
    broker.declare(&out).await;
    let target = out.clone();
    let counted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = counted.clone();
    let consumer = Consumer::builder(amqp_url(), db.pool.clone())
        .queue(&queue)
        .redelivery(
            idempo::consumer::RedeliveryPolicy::delayed([support::RETRY_DELAY]).max_attempts(1),
        )
        .handler(
            move |tx: Tx, (JsonBody(p), m): (JsonBody<Payment>, Message)| {
                let (target, seen) = (target.clone(), seen.clone());
                async move {
                    let mut guard = tx.try_lock()?;
                    let deferred =
                        OutboxMessage::json("", &target, &p)?.derived_id(m.id(), "deferred");
                    outbox::stage(&mut guard, deferred).await?;
                    let after_guard = outbox_rows(&mut guard).await?;
                    // On the bare connection: written at once.
                    let direct = OutboxMessage::json("", &target, &p)?.derived_id(m.id(), "direct");
                    outbox::stage(&mut *guard, direct).await?;
                    let after_direct = outbox_rows(&mut guard).await?;
                    seen.lock().unwrap().push((after_guard, after_direct));
                    if p.account == "ends-it-itself" {
                        // The claim goes with the ROLLBACK: the deferred
                        // message must not be written by the commit.
                        sqlx::query("ROLLBACK").execute(&mut *guard).await?;
                    }
                    Ok(())
                }
            },
        )
        .build()
        .unwrap();
    let health = consumer.health();
    let stop = consumer.shutdown_handle();
    let running = tokio::spawn(consumer.run());
    health.wait_for(|h| h.is_consuming()).await;
    broker.publish_payment(&queue, "fwd-1", "alice", 7).await;
    let ids = collect_ids(&broker, &out, 2).await;
    assert_eq!(ids.len(), 2, "each staged message went out once: {ids:?}");
    assert!(ids.contains(&support::derived_id("fwd-1", "deferred")));
    assert!(ids.contains(&support::derived_id("fwd-1", "direct")));
    assert_eq!(
        counted.lock().unwrap().as_slice(),
        &[(0, 1)],
        "the guard's message waited for the commit; the bare connection's was written at once"
    );
    // The commit woke the consumer's own relay.
    assert_eq!(health.snapshot().relay, Some(RelayState::Running));

    broker
        .publish_payment(&queue, "fwd-2", "ends-it-itself", 9)
        .await;
    let dead = loop {
        let dead = broker.drain(&format!("{queue}.dlq")).await;
        if !dead.is_empty() {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        dead.len(),
        1,
        "the handler that ended its transaction failed"
    );
    stop.shutdown();
    running.await.unwrap().unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        0,
        "nothing of the rolled-back unit was written, and the rest went out"
    );
    assert!(
        take_all(&broker, &out).await.is_empty(),
        "the unit that ended its transaction emitted nothing"
    );
}

#[tokio::test]
async fn the_trace_context_of_the_incoming_message_goes_out_with_what_it_stages() {
    let (db, broker, queue) = setup().await;
    let out = unique("traced");
    broker.declare(&out).await;
    let target = out.clone();
    let consumer = Consumer::builder(amqp_url(), db.pool.clone())
        .queue(&queue)
        .handler(move |tx: Tx, JsonBody(p): JsonBody<Payment>| {
            let target = target.clone();
            async move {
                let mut conn = tx.try_lock()?;
                outbox::stage(&mut conn, OutboxMessage::json("", &target, &p)?).await?;
                Ok(())
            }
        })
        .build()
        .unwrap();
    let stop = consumer.shutdown_handle();
    let running = tokio::spawn(consumer.run());
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let props = lapin::BasicProperties::default()
        .with_message_id("t-1".into())
        .with_headers({
            let mut h = lapin::types::FieldTable::default();
            h.insert(
                "traceparent".into(),
                lapin::types::AMQPValue::LongString(traceparent.into()),
            );
            h
        });
    broker
        .publish_props(&queue, props, &support::payment_body("alice", 1))
        .await;
    let mut got = Vec::new();
    let start = std::time::Instant::now();
    while got.is_empty() {
        assert!(start.elapsed() < SOON, "the staged message did not arrive");
        tokio::time::sleep(Duration::from_millis(50)).await;
        got = take_all(&broker, &out).await;
    }
    assert_eq!(
        got[0].headers.get("traceparent").map(String::as_str),
        Some(traceparent)
    );
    stop.shutdown();
    running.await.unwrap().unwrap();
}

#[tokio::test]
async fn staging_from_a_plain_transaction_commits_and_rolls_back_with_it() {
    let (db, broker, queue) = setup().await;
    let relay = Running::start(relay(&db.pool));

    let mut tx = db.pool.begin().await.unwrap();
    outbox::stage(
        &mut tx,
        OutboxMessage::new("", &queue, b"phantom".to_vec()).message_id("rolled-back"),
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let ids = outbox::stage_all(
        &mut tx,
        (0..3).map(|i| {
            OutboxMessage::new("", &queue, format!("m{i}").into_bytes()).correlation_id("c-1")
        }),
    )
    .await
    .unwrap();
    // Not before the commit: the relay sees only committed rows.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        broker.ready(&queue).await,
        0,
        "nothing is published before commit"
    );
    tx.commit().await.unwrap();
    let arrived = collect_ids(&broker, &queue, 3).await;
    assert_eq!(arrived, ids, "published once each, in staging order");
    relay.stop().await;
    assert_eq!(broker.ready(&queue).await, 0);
}

#[tokio::test]
async fn staging_from_an_axum_handler_behind_the_idempotency_layer() {
    let (db, broker, queue) = setup().await;
    let relay = Running::start(relay(&db.pool));
    let target = queue.clone();
    let handler = move |tx: Tx, body: String| {
        let target = target.clone();
        async move {
            let mut conn = tx.try_lock()?;
            outbox::stage(
                &mut conn,
                OutboxMessage::new("", &target, body.into_bytes()),
            )
            .await?;
            Ok::<_, idempo::Error>(StatusCode::CREATED)
        }
    };
    let layer = IdempotencyLayer::new(PostgresStore::new(db.pool.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = Router::new().route("/receipts", post(handler).layer(layer));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = reqwest::Client::new();
    for _ in 0..3 {
        // The client retries with the same key: the handler runs once.
        let status = client
            .post(format!("{base}/receipts"))
            .header("idempotency-key", "order-1")
            .body("receipt for order 1")
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 201);
    }
    let arrived = collect_ids(&broker, &queue, 1).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let later = take_all(&broker, &queue).await;
    assert_eq!(arrived.len() + later.len(), 1, "one request, one message");
    relay.stop().await;
    drop(db);
}

#[tokio::test]
async fn bad_messages_are_refused_at_staging_with_a_clear_error() {
    let db = Db::new().await;
    let mut tx = db.pool.begin().await.unwrap();
    let big = OutboxMessage::new("", "q", vec![0u8; 2048]).max_body_size(1024);
    let e = outbox::stage(&mut tx, big).await.unwrap_err();
    assert!(
        matches!(
            e,
            OutboxError::TooLarge {
                size: 2048,
                limit: 1024
            }
        ),
        "{e}"
    );
    assert!(e.is_permanent());
    let e = outbox::stage(
        &mut tx,
        OutboxMessage::new("", "q", b"x".to_vec()).message_id("x".repeat(300)),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("255"), "{e}");
    let default_limit = OutboxMessage::new(
        "",
        "q",
        vec![0u8; 16 * 1024 * 1024 + 1], /* the default limit, 16 MiB */
    );
    assert!(matches!(
        outbox::stage(&mut tx, default_limit).await,
        Err(OutboxError::TooLarge { .. })
    ));
    tx.rollback().await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
}

#[tokio::test]
async fn headers_over_an_amqp_frame_are_refused_at_staging_with_a_typed_error() {
    let db = Db::new().await;
    let mut tx = db.pool.begin().await.unwrap();
    // Each header is fine; together they do not fit in one frame.
    let fat = (0..40).fold(OutboxMessage::new("", "q", b"x".to_vec()), |m, i| {
        m.header(format!("x-part-{i}"), "h".repeat(4_000))
    });
    let e = outbox::stage(&mut tx, fat).await.unwrap_err();
    assert!(
        matches!(
            e,
            OutboxError::HeadersTooLarge { size, limit: 131_072 } if size > 160_000
        ),
        "{e}"
    );
    assert!(e.is_permanent());
    // Just under the frame, with the generated id and a trace context: staged.
    let fits = OutboxMessage::new("", "q", b"x".to_vec()).header("x-big", "h".repeat(130_000));
    outbox::with_traceparent(
        Some(format!("00-{}-{}-01", "a".repeat(32), "b".repeat(16))),
        async {
            outbox::stage(&mut tx, fits).await.unwrap();
        },
    )
    .await;
    tx.rollback().await.unwrap();
}

/// A downstream idempo consumer of `queue` that applies payments.
fn downstream(
    db: &Db,
    queue: &str,
) -> (
    idempo::consumer::ShutdownHandle,
    tokio::task::JoinHandle<idempo::Result<()>>,
) {
    let consumer = Consumer::builder(amqp_url(), db.pool.clone())
        .queue(queue)
        .relay(false)
        .handler(|tx, m| payments::handle(tx, m, 0.0))
        .build()
        .unwrap();
    let stop = consumer.shutdown_handle();
    (stop, tokio::spawn(consumer.run()))
}

#[tokio::test]
async fn relay_crash_points_resend_with_the_same_ids_and_downstream_applies_each_once() {
    let (db, broker, queue) = setup().await;
    let downstream_db = Db::new().await;
    let n = 300;
    let ids = stage_payments(&db.pool, &queue, n, None).await;
    let expected: i64 = (1..=n as i64).sum();

    // Before publish: the batch query is blocked; the relay dies there.
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let first = Running::start(relay(&db.pool).batch_size(100));
    tokio::time::sleep(Duration::from_millis(500)).await;
    first.kill().await;
    blocker.rollback().await.unwrap();
    assert_eq!(
        broker.ready(&queue).await,
        0,
        "killed before publishing: nothing sent"
    );
    assert_eq!(pending(&db.pool).await, n as i64, "and nothing lost");

    // After publish, before marking: the DELETE waits for a lock; the relay
    // dies with its batch published but not marked.
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox IN SHARE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let second = Running::start(relay(&db.pool).batch_size(100));
    support::eventually_ready(&broker, &queue, 100).await;
    second.kill().await;
    blocker.rollback().await.unwrap();
    assert_eq!(
        pending(&db.pool).await,
        n as i64,
        "published but unmarked rows stay"
    );

    // During marking: the relay's connection is terminated while its DELETE
    // waits; the relay survives the database error and publishes again.
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox IN SHARE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let name = unique("relay");
    let third = Running::start(relay(&db.pool).batch_size(100).connection_name(&name));
    support::eventually_ready(&broker, &queue, 200).await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE wait_event_type = 'Lock' AND query LIKE 'DELETE FROM outbox%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(killed >= 1, "the relay's marking statement was waiting");
    blocker.rollback().await.unwrap();

    // The broker connection dropped mid-run: reconnect, publish the rest.
    support::close_connections_named(&name);
    eventually("the outbox drains", Duration::from_secs(60), || async {
        pending(&db.pool).await == 0
    })
    .await;
    third.stop().await;

    let copies = take_all(&broker, &queue).await;
    let arrived: HashSet<String> = copies.iter().filter_map(|m| m.message_id.clone()).collect();
    assert_eq!(
        arrived,
        ids.iter().cloned().collect(),
        "every row published, with its staged id"
    );
    assert!(
        copies.len() > n,
        "the crashes made resends: {} copies",
        copies.len()
    );
    // Put every copy (resends included) back for the downstream consumer.
    for m in &copies {
        broker
            .publish(&queue, m.message_id.as_deref(), &m.body)
            .await;
    }
    let (stop, consumer) = downstream(&downstream_db, &queue);
    eventually("downstream applies every payment", SOON, || async {
        downstream_db.payments().await == n as i64
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.shutdown();
    consumer.await.unwrap().unwrap();
    assert_eq!(downstream_db.payments().await, n as i64, "exactly once");
    assert_eq!(
        downstream_db.balances().await.values().sum::<i64>(),
        expected
    );
}

#[tokio::test]
async fn one_ordering_key_stays_in_staging_order_across_two_relays_and_a_kill() {
    let (db, broker, queue) = setup().await;
    let n = 2000;
    let a = Running::start(relay(&db.pool).batch_size(100));
    let b = Running::start(relay(&db.pool).batch_size(100));
    // Four stagers at once: the key's lock makes id order the commit order.
    let mut stagers = Vec::new();
    for _ in 0..4 {
        let pool = db.pool.clone();
        let queue = queue.clone();
        stagers.push(tokio::spawn(async move {
            let mut staged = Vec::new();
            for _ in 0..n / 4 {
                let mut tx = pool.begin().await.unwrap();
                let id = outbox::stage(
                    &mut tx,
                    OutboxMessage::new("", &queue, b"x".to_vec()).ordering_key("the-key"),
                )
                .await
                .unwrap();
                let row: i64 = sqlx::query_scalar("SELECT id FROM outbox WHERE message_id = $1")
                    .bind(&id)
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                staged.push((row, id));
            }
            staged
        }));
    }
    // Kill one relay while messages flow.
    eventually("a few hundred messages published", SOON, || async {
        broker.ready(&queue).await >= 300
    })
    .await;
    a.kill().await;
    let mut staged = Vec::new();
    for s in stagers {
        staged.extend(s.await.unwrap());
    }
    staged.sort();
    let expected: Vec<String> = staged.into_iter().map(|(_, id)| id).collect();
    let arrived = collect_ids(&broker, &queue, n).await;
    b.stop().await;
    let mut seen = HashSet::new();
    let first_copies: Vec<String> = arrived
        .into_iter()
        .filter(|id| seen.insert(id.clone()))
        .collect();
    assert_eq!(first_copies.len(), n);
    let out_of_order = first_copies.iter().zip(&expected).position(|(a, b)| a != b);
    assert_eq!(
        out_of_order, None,
        "the key's messages arrive in commit order"
    );
}

#[tokio::test]
async fn refused_messages_are_retried_then_failed_with_their_reason_while_other_keys_flow() {
    let (db, broker, queue) = setup().await;
    let nowhere = unique("nowhere");
    let behind = unique("behind");
    broker.declare(&behind).await;
    // A queue that refuses (nacks) what does not fit.
    let full = unique("full");
    {
        let mut args = lapin::types::FieldTable::default();
        args.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(1));
        args.insert(
            "x-overflow".into(),
            lapin::types::AMQPValue::LongString("reject-publish".into()),
        );
        broker
            .channel
            .queue_declare(
                full.as_str().into(),
                lapin::options::QueueDeclareOptions::default(),
                args,
            )
            .await
            .unwrap();
        broker.track(&full);
    }
    let mut tx = db.pool.begin().await.unwrap();
    outbox::stage_all(
        &mut tx,
        [
            OutboxMessage::new("", &nowhere, b"lost?".to_vec())
                .message_id("unroutable")
                .ordering_key("bad"),
            OutboxMessage::new("", &behind, b"behind".to_vec())
                .message_id("behind-bad")
                .ordering_key("bad"),
            OutboxMessage::new("", &full, b"fits".to_vec()).message_id("fits"),
            OutboxMessage::new("", &full, b"refused".to_vec()).message_id("nacked"),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let good = stage_payments(&db.pool, &queue, 20, Some("good")).await;
    let relay = Running::start(relay(&db.pool).max_attempts(3));
    // The good key is not held back by the bad one.
    let arrived = collect_ids(&broker, &queue, 20).await;
    assert_eq!(arrived, good);
    eventually("both refused messages are failed", SOON, || async {
        outbox::OutboxStatus::read(&db.pool).await.unwrap().failed == 2
    })
    .await;
    let failed = outbox::FailedMessage::list(&db.pool, 10).await.unwrap();
    let reasons: Vec<(&str, i32, &str)> = failed
        .iter()
        .map(|f| {
            (
                f.message_id.as_str(),
                f.attempts,
                f.last_error.as_deref().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert_eq!((reasons[0].0, reasons[0].1), ("unroutable", 3));
    assert!(reasons[0].2.contains("unroutable"), "{reasons:?}");
    assert_eq!((reasons[1].0, reasons[1].1), ("nacked", 3));
    assert!(reasons[1].2.contains("nack"), "{reasons:?}");
    // The key's next message went out once its predecessor was given up.
    assert_eq!(collect_ids(&broker, &behind, 1).await, ["behind-bad"]);
    // Fixed by an operator: declared, then re-tried.
    broker.declare(&nowhere).await;
    let unroutable_id = failed[0].id;
    assert_eq!(
        outbox::FailedMessage::retry(&db.pool, Some(&[unroutable_id]))
            .await
            .unwrap(),
        1
    );
    assert_eq!(collect_ids(&broker, &nowhere, 1).await, ["unroutable"]);
    relay.stop().await;
    assert_eq!(
        outbox::OutboxStatus::read(&db.pool).await.unwrap().failed,
        1,
        "the nacked one stays visible"
    );
}

#[tokio::test]
async fn a_broker_outage_holds_the_rows_until_it_returns() {
    let (db, broker, queue) = setup().await;
    let proxy = TcpProxy::amqp().await;
    let url = support::ServiceUrl::amqp().through(proxy.addr).to_string();
    let relay = Relay::new(&url, db.pool.clone())
        .unwrap()
        .poll_interval(Duration::from_millis(300));
    let health = relay.health();
    let running = Running::start(relay);
    let before = stage_payments(&db.pool, &queue, 50, None).await;
    collect_ids(&broker, &queue, 50).await;
    proxy.cut();
    let during = stage_payments(&db.pool, &queue, 50, None).await;
    health
        .wait_for(|h| matches!(h.state, RelayState::Reconnecting | RelayState::Connecting))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        pending(&db.pool).await,
        50,
        "the rows wait while the broker is away"
    );
    proxy.restore();
    let arrived = collect_ids(&broker, &queue, 50).await;
    assert_eq!(
        arrived.iter().collect::<HashSet<_>>(),
        during.iter().collect::<HashSet<_>>()
    );
    assert!(before.iter().all(|id| !arrived.contains(id)));
    eventually("the outbox drains", SOON, || async {
        pending(&db.pool).await == 0
    })
    .await;
    assert!(health.snapshot().published >= 100);
    running.stop().await;
}

#[tokio::test]
async fn kept_published_rows_are_deleted_after_their_audit_period() {
    let (db, broker, queue) = setup().await;
    let relay = Running::start(relay(&db.pool).keep_published(Duration::from_secs(1)));
    stage_payments(&db.pool, &queue, 10, None).await;
    collect_ids(&broker, &queue, 10).await;
    eventually("published rows are kept as done", SOON, || async {
        db.count("SELECT count(*) FROM outbox WHERE state = 'done' AND published_at IS NOT NULL")
            .await
            == 10
    })
    .await;
    // The cleanup runs at the relay's idle moments, once per audit period.
    eventually("and removed after the period", SOON, || async {
        db.count("SELECT count(*) FROM outbox").await == 0
    })
    .await;
    relay.stop().await;
}

/// A database for an example process: a small pool for the test's reads.
async fn example_db() -> Db {
    let db = Db::with_pool_size(2).await;
    idempo::migrate(&db.pool).await.unwrap();
    payments::create_tables(&db.pool).await.unwrap();
    db
}

#[tokio::test]
async fn a_chain_of_two_payments_examples_killed_repeatedly_keeps_both_ledgers_equal() {
    use support::example::{doubled_payments, publish_load, signal, spawn_example, wait_exit};
    support::init_tracing();
    let (a_db, b_db, broker) = (
        example_db().await,
        example_db().await,
        Broker::connect().await,
    );
    let (a_queue, b_queue) = (unique("chain_a"), unique("chain_b"));
    broker.declare(&a_queue).await;
    broker.track(&b_queue);
    broker.track(&format!("{b_queue}.dlq"));
    let load = publish_load(&broker, &a_queue, 3000, true).await;
    let a_env = |batch: &'static str| {
        vec![
            ("PAYMENTS_FORWARD_TO", b_queue.clone()),
            ("PAYMENTS_BATCH", batch.to_owned()),
        ]
    };
    let spawn_a = |batch: &'static str| {
        let env = a_env(batch);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        spawn_example(&a_db.url, &a_queue, &env)
    };
    let mut a = spawn_a("0");
    eventually("A declared B's queue", SOON, || async {
        broker.exists(&b_queue).await
    })
    .await;
    let mut b = spawn_example(&b_db.url, &b_queue, &[]);
    // Kill both, alternately, while payments flow through the chain; A
    // switches between per-message and batch mode.
    for round in 0..4 {
        let target = 300 * (round + 1);
        eventually(
            "the chain makes progress",
            Duration::from_secs(120),
            || async { b_db.claims().await >= target as i64 },
        )
        .await;
        signal(&a, "-KILL");
        wait_exit(a).await;
        a = spawn_a(if round % 2 == 0 { "50" } else { "0" });
        tokio::time::sleep(Duration::from_millis(300)).await;
        signal(&b, "-KILL");
        wait_exit(b).await;
        b = spawn_example(&b_db.url, &b_queue, &[]);
    }
    let n = load.ids.len() as i64;
    eventually(
        "every payment through both",
        Duration::from_secs(180),
        || async {
            a_db.claims().await == n
                && b_db.claims().await == n
                && pending(&a_db.pool).await == 0
                && broker.ready(&b_queue).await == 0
        },
    )
    .await;
    signal(&a, "-TERM");
    signal(&b, "-TERM");
    assert!(wait_exit(a).await.success());
    assert!(wait_exit(b).await.success());
    assert_eq!(a_db.balances().await, load.expected, "A's ledger is exact");
    assert_eq!(
        b_db.balances().await,
        a_db.balances().await,
        "B's ledger equals A's"
    );
    assert_eq!(b_db.payments().await, n, "one row per payment in B");
    assert_eq!(doubled_payments(&b_db).await, 0);
    let forwarded_ids: HashSet<String> =
        sqlx::query_scalar::<_, String>("SELECT message_id FROM payments")
            .fetch_all(&b_db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let expected_ids: HashSet<String> = load
        .ids
        .iter()
        .map(|id| support::derived_id(id, "forward"))
        .collect();
    assert_eq!(
        forwarded_ids, expected_ids,
        "B applied what A forwarded, by derived id"
    );
    assert_eq!(
        broker.ready(&format!("{b_queue}.dlq")).await,
        0,
        "nothing dead-lettered in B"
    );
}

/// Sets the broker's `max_message_size` for new channels; back to the
/// default when dropped.
struct BrokerMessageLimit;

impl BrokerMessageLimit {
    fn set(bytes: u64) -> BrokerMessageLimit {
        let status = support::rabbitmqctl()
            .args([
                "eval",
                &format!("application:set_env(rabbit, max_message_size, {bytes})."),
            ])
            .output()
            .expect("rabbitmqctl eval");
        assert!(status.status.success(), "{status:?}");
        BrokerMessageLimit
    }
}

impl Drop for BrokerMessageLimit {
    fn drop(&mut self) {
        let _ = support::rabbitmqctl()
            .args([
                "eval",
                "application:set_env(rabbit, max_message_size, 134217728).",
            ])
            .output();
    }
}

#[tokio::test]
async fn a_body_over_the_brokers_limit_is_failed_with_the_brokers_reason() {
    let (db, broker, queue) = setup().await;
    let limit = BrokerMessageLimit::set(1024 * 1024);
    let mut tx = db.pool.begin().await.unwrap();
    outbox::stage_all(
        &mut tx,
        [
            OutboxMessage::new("", &queue, vec![7u8; 2 * 1024 * 1024])
                .max_body_size(4 * 1024 * 1024)
                .message_id("too-big"),
            OutboxMessage::new("", &queue, b"small".to_vec()).message_id("small"),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let relay = Running::start(relay(&db.pool));
    assert_eq!(
        collect_ids(&broker, &queue, 1).await,
        ["small"],
        "the rest flows"
    );
    eventually("the oversized row is failed", SOON, || async {
        outbox::OutboxStatus::read(&db.pool).await.unwrap().failed == 1
    })
    .await;
    drop(limit);
    let failed = outbox::FailedMessage::list(&db.pool, 10).await.unwrap();
    assert_eq!(failed[0].message_id, "too-big");
    let reason = failed[0].last_error.as_deref().unwrap_or("");
    assert!(
        reason.contains("larger than configured max size"),
        "{reason}"
    );
    relay.stop().await;
}

#[tokio::test]
async fn a_graceful_shutdown_publishes_what_is_pending_and_never_half_marks() {
    let (db, broker, queue) = setup().await;
    let ids = stage_payments(&db.pool, &queue, 1500, None).await;
    let relay = relay(&db.pool).batch_size(100);
    let health = relay.health();
    let running = Running::start(relay);
    health.wait_for(|h| h.published > 0).await;
    // Asked to stop in the middle of the backlog: it drains, then returns.
    running.stop().await;
    assert_eq!(pending(&db.pool).await, 0, "nothing left behind");
    let arrived = collect_ids(&broker, &queue, ids.len()).await;
    assert_eq!(arrived, ids, "each once, in order, none lost");
    assert_eq!(health.snapshot().state, RelayState::Stopped);
    assert_eq!(health.snapshot().published, ids.len() as u64);
}

#[tokio::test]
async fn a_packed_batch_with_a_refused_message_delivers_the_rest_and_keeps_the_refused_one() {
    let (db, broker, queue) = setup().await;
    let nowhere = unique("nowhere");
    let mut tx = db.pool.begin().await.unwrap();
    // One stage_all without ordering keys: one packed row.
    outbox::stage_all(
        &mut tx,
        (0..10).map(|i| {
            let to = if i == 4 { &nowhere } else { &queue };
            OutboxMessage::new("", to, format!("m{i}").into_bytes())
                .message_id(format!("m{i}"))
                .header("n", i)
        }),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 1, "packed");
    assert_eq!(pending(&db.pool).await, 10, "counted per message");
    let relay = Running::start(relay(&db.pool).max_attempts(2));
    let arrived = collect_ids(&broker, &queue, 9).await;
    let expected: Vec<String> = (0..10)
        .filter(|i| *i != 4)
        .map(|i| format!("m{i}"))
        .collect();
    assert_eq!(arrived, expected);
    eventually("the refused one is failed on its own row", SOON, || async {
        outbox::OutboxStatus::read(&db.pool).await.unwrap().failed == 1
    })
    .await;
    let failed = outbox::FailedMessage::list(&db.pool, 10).await.unwrap();
    assert_eq!(
        (failed[0].message_id.as_str(), failed[0].attempts),
        ("m4", 2)
    );
    assert!(
        failed[0]
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("unroutable")
    );
    relay.stop().await;
    assert!(
        take_all(&broker, &queue).await.is_empty(),
        "the rest went out once"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        1,
        "only the failed row is left"
    );
}

#[tokio::test]
async fn a_backlog_of_packed_rows_drains_without_waiting_for_the_poll() {
    let (db, broker, queue) = setup().await;
    for chunk in 0..5 {
        let mut tx = db.pool.begin().await.unwrap();
        outbox::stage_all(
            &mut tx,
            (0..300).map(|i| {
                OutboxMessage::new("", &queue, b"x".to_vec()).message_id(format!("{chunk}-{i}"))
            }),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        5,
        "five packed rows"
    );
    // Batches of 100 messages, and a poll too slow to be what moves it.
    let started = std::time::Instant::now();
    let relay = Running::start(
        relay(&db.pool)
            .batch_size(100)
            .poll_interval(Duration::from_secs(60)),
    );
    let arrived = collect_ids(&broker, &queue, 1500).await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "drained back to back, not one row per poll: {:?}",
        started.elapsed()
    );
    assert_eq!(arrived.len(), 1500, "each once");
    relay.stop().await;
}

/// A row as an older staging (or another writer) could leave it: headers
/// larger than the broker's frame (128 KiB by default), which the broker
/// answers by closing the whole connection (`FRAME_ERROR`).
async fn insert_row_with_oversize_headers(pool: &PgPool, queue: &str, message_id: &str) {
    sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, headers) \
         VALUES ('', $1, $2, 'fat', jsonb_build_object('x-big', repeat('h', 200000)))",
    )
    .bind(queue)
    .bind(message_id)
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_row_for_a_missing_exchange_or_with_oversize_headers_does_not_hold_back_the_rest() {
    let (db, broker, queue) = setup().await;
    // A typo in an exchange name: the broker closes the channel (NOT_FOUND).
    let mut tx = db.pool.begin().await.unwrap();
    outbox::stage(
        &mut tx,
        OutboxMessage::new(unique("no-such-exchange"), "rk", b"typo".to_vec()).message_id("typo"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    insert_row_with_oversize_headers(&db.pool, &queue, "fat").await;
    // Behind them, in id order.
    let good = stage_payments(&db.pool, &queue, 500, None).await;
    let relay = relay(&db.pool).max_attempts(3);
    let health = relay.health();
    let started = std::time::Instant::now();
    let running = Running::start(relay);
    let arrived = collect_ids(&broker, &queue, 500).await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the good rows waited {:?} behind the bad ones",
        started.elapsed()
    );
    assert_eq!(
        arrived.iter().collect::<HashSet<_>>(),
        good.iter().collect::<HashSet<_>>(),
        "every good row, and nothing else"
    );
    eventually("both bad rows are failed", SOON, || async {
        outbox::OutboxStatus::read(&db.pool).await.unwrap().failed == 2
    })
    .await;
    let failed = outbox::FailedMessage::list(&db.pool, 10).await.unwrap();
    let typo = failed.iter().find(|f| f.message_id == "typo").unwrap();
    let reason = typo.last_error.as_deref().unwrap_or("");
    assert_eq!(typo.attempts, 3, "an attempt per refusal: {reason}");
    assert!(reason.contains("NOT_FOUND"), "{reason}");
    let fat = failed.iter().find(|f| f.message_id == "fat").unwrap();
    let reason = fat.last_error.as_deref().unwrap_or("");
    assert!(fat.attempts >= 1, "{reason}");
    assert!(reason.contains("frame"), "{reason}");
    assert_eq!(pending(&db.pool).await, 0);
    assert_eq!(health.snapshot().failed, 2);
    #[cfg(feature = "ops")]
    {
        use idempo::ops::{Services, StatusOptions, Warning};
        let services = Services::with_pool(amqp_url(), db.pool.clone());
        let status = services.status(&StatusOptions::default()).await.unwrap();
        assert!(status.needs_attention(), "`idempo status` exits 2");
        assert!(
            status
                .warnings
                .contains(&Warning::OutboxFailed { failed: 2 }),
            "{:?}",
            status.warnings
        );
    }
    running.stop().await;
}

/// A queue name for the hostile-fields test: the routing key the forwarded
/// messages carry, with quotes, backslashes, dollar quotes and unicode.
fn hostile_queue() -> String {
    format!("{}_rk'\\''$$;--\"é🦀\u{202E}x", unique("hostile"))
}

/// The headers of [`hostile_message`]: hostile names and values, nested.
fn hostile_headers() -> serde_json::Map<String, serde_json::Value> {
    let serde_json::Value::Object(headers) = serde_json::json!({
        "x-quote'": "it's '' the end'",
        "x-back\\slash": "C:\\path\\'to'\\file\\",
        "x-$$": "$$; DROP TABLE outbox; --$$",
        "x-$tag$": "$tag$ x $tag$",
        "x-é🦀\u{202E}": "שלום e\u{301}\u{302} 💸",
        "x-json\"}": "\"}{\\\"\\u0000\\x00",
        "x-E'": "E'\\x41' U&'\\0041'",
        "x-lines": "a\nb\r\n\tc",
        "x-number": 42,
        "x-bool": true,
        "x-nested'\\": {"k'\\$$": ["a'\\b", -7, false, null, {"\\\\": "''"}]},
    }) else {
        unreachable!()
    };
    headers
}

/// The body of every forwarded message: all 256 byte values.
fn every_byte() -> Vec<u8> {
    (0..=255u8).collect()
}

const HOSTILE_CORRELATION_ID: &str = "corr'\\''$$;--é🦀\u{202E}\\x00\n";
const HOSTILE_CONTENT_TYPE: &str = "text/x-'\\$$; charset=\"é\"";

/// A message with hostile fields for `queue`, with a hostile id made from
/// the incoming message's id and `n`.
fn hostile_message(queue: &str, incoming: &str, n: usize) -> OutboxMessage {
    let mut message = OutboxMessage::new("", queue, every_byte())
        .message_id(format!("{incoming} '\\''$$ #{n}"))
        .correlation_id(HOSTILE_CORRELATION_ID)
        .content_type(HOSTILE_CONTENT_TYPE);
    for (name, value) in hostile_headers() {
        message = message.header(name, value);
    }
    message
}

/// An AMQP header value as the JSON it was staged as.
fn as_json(value: &lapin::types::AMQPValue) -> serde_json::Value {
    use lapin::types::AMQPValue;
    match value {
        AMQPValue::Void => serde_json::Value::Null,
        AMQPValue::Boolean(b) => (*b).into(),
        AMQPValue::LongLongInt(n) => (*n).into(),
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec())
            .expect("UTF-8")
            .into(),
        AMQPValue::FieldArray(items) => items.as_slice().iter().map(as_json).collect(),
        AMQPValue::FieldTable(table) => table_as_json(table).into(),
        other => panic!("a header value the relay does not send: {other:?}"),
    }
}

fn table_as_json(table: &lapin::types::FieldTable) -> serde_json::Map<String, serde_json::Value> {
    table
        .inner()
        .iter()
        .map(|(name, value)| (name.to_string(), as_json(value)))
        .collect()
}

/// Forwarded messages with hostile fields, staged through the handler's
/// guard: written by the unit's commit as SQL literals, one row
/// (one message per unit) or a packed row (several). The relay publishes
/// exactly the values staged, each message once, in per-message and in
/// batch mode, also from sessions with `standard_conforming_strings` off.
#[tokio::test]
async fn hostile_fields_of_forwarded_messages_are_published_exactly_as_staged() {
    use lapin::options::BasicGetOptions;
    let modes = [None, Some(10)];
    for (batch, settings) in modes
        .into_iter()
        .flat_map(|b| support::SESSION_SETTINGS.map(|s| (b, s)))
    {
        let (db, broker, queue) = setup().await;
        let pool = support::pool_with_settings(&db, 4, settings).await;
        let out = hostile_queue();
        broker.declare(&out).await;
        let target = out.clone();
        let rows_at_staging = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = rows_at_staging.clone();
        // "one-*" forwards one message, "many-*" three.
        let handler = move |tx: Tx, m: Message| {
            let (target, seen) = (target.clone(), seen.clone());
            async move {
                let count = if m.id().starts_with("many") { 3 } else { 1 };
                let messages: Vec<OutboxMessage> = (0..count)
                    .map(|n| hostile_message(&target, m.id(), n))
                    .collect();
                let mut guard = tx.try_lock()?;
                outbox::stage_all(&mut guard, messages).await?;
                // Rows of this unit (other units' may wait for the relay).
                let rows: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM outbox WHERE starts_with(message_id, $1)",
                )
                .bind(format!("{} ", m.id()))
                .fetch_one(&mut *guard)
                .await?;
                seen.lock().unwrap().push(rows);
                Ok::<_, HandlerError>(())
            }
        };
        let incoming = ["one-1", "many-1", "one-2", "many-2"];
        for id in incoming {
            broker.publish(&queue, Some(id), b"{}").await;
        }
        let base = Consumer::builder(amqp_url(), pool.clone())
            .queue(&queue)
            .redelivery(
                idempo::consumer::RedeliveryPolicy::delayed([support::RETRY_DELAY]).max_attempts(1),
            );
        let consumer = match batch {
            None => base.handler(handler).build(),
            Some(size) => base.prefetch(30).handler(handler).batch(size).build(),
        }
        .unwrap();
        let stats = consumer.stats();
        let stop = consumer.shutdown_handle();
        let running = tokio::spawn(consumer.run());

        let mut expected: Vec<String> = Vec::new();
        for id in incoming {
            let count = if id.starts_with("many") { 3 } else { 1 };
            expected
                .extend((0..count).map(|n| hostile_message(&out, id, n).id().unwrap().to_owned()));
        }
        expected.sort();
        let mut got = Vec::new();
        let start = std::time::Instant::now();
        while got.len() < expected.len() {
            assert!(
                start.elapsed() < SOON,
                "{batch:?} {settings:?}: {} of {} forwarded messages arrived",
                got.len(),
                expected.len()
            );
            match broker
                .channel
                .basic_get(out.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                Some(m) => got.push(m.delivery),
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        eventually("the outbox is empty", SOON, || async {
            pending(&db.pool).await == 0
        })
        .await;
        stop.shutdown();
        running.await.unwrap().unwrap();

        let snapshot = stats.snapshot();
        assert_eq!(
            (snapshot.processed, snapshot.retried, snapshot.dead_lettered),
            (4, 0, 0),
            "{batch:?} {settings:?}: {snapshot:?}"
        );
        let rows_at_staging = rows_at_staging.lock().unwrap().clone();
        assert_eq!(
            rows_at_staging.len(),
            4,
            "{batch:?} {settings:?}: one call per message"
        );
        assert!(
            rows_at_staging.iter().all(|&rows| rows == 0),
            "{batch:?} {settings:?}: staged through the guard, written by the commit"
        );
        let mut ids: Vec<String> = got
            .iter()
            .map(|d| d.properties.message_id().as_ref().unwrap().to_string())
            .collect();
        ids.sort();
        assert_eq!(
            ids, expected,
            "{batch:?} {settings:?}: each forwarded message once"
        );
        for delivery in &got {
            let p = &delivery.properties;
            let id = p.message_id().as_ref().unwrap().to_string();
            assert_eq!(
                delivery.routing_key.as_str(),
                out,
                "{batch:?} {settings:?} {id:?}"
            );
            assert_eq!(
                delivery.exchange.as_str(),
                "",
                "{batch:?} {settings:?} {id:?}"
            );
            assert_eq!(
                p.correlation_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .as_deref(),
                Some(HOSTILE_CORRELATION_ID),
                "{batch:?} {settings:?} {id:?}"
            );
            assert_eq!(
                p.content_type().as_ref().map(|s| s.to_string()).as_deref(),
                Some(HOSTILE_CONTENT_TYPE),
                "{batch:?} {settings:?} {id:?}"
            );
            let mut headers = table_as_json(p.headers().as_ref().expect("headers"));
            // Added by the quorum queue on delivery.
            headers.remove("x-delivery-count");
            assert_eq!(headers, hostile_headers(), "{batch:?} {settings:?} {id:?}");
            assert_eq!(delivery.data, every_byte(), "{batch:?} {settings:?} {id:?}");
            assert_eq!(*p.delivery_mode(), Some(2), "{batch:?} {settings:?} {id:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            broker.ready(&out).await,
            0,
            "{batch:?} {settings:?}: nothing more arrived"
        );
        assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
    }
}
