//! The AMQP consumer runtime against the real RabbitMQ and PostgreSQL:
//! deduplication, poison, handlers, shutdown.

mod support;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use idempo::Tx;
use idempo::amqp::{Consumer, QueueType};
use idempo::consumer::{HandlerError, Message, MessageIdSource};
use lapin::options::ExchangeDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};
use support::consumer::{
    Running, WAIT, consumer_for, payments_consumer, payments_then, slow_payments,
};
use support::{Broker, Db, eventually, payments, unique};

#[tokio::test]
async fn a_message_published_twice_is_applied_once() {
    let (db, broker, queue) = support::setup().await;
    broker.publish_payment(&queue, "pay-1", "alice", 500).await;
    broker.publish_payment(&queue, "pay-1", "alice", 500).await;

    let consumer = Running::start(payments_consumer(&db, &queue).concurrency(1));
    let stats = consumer.finish(2).await;

    assert_eq!(db.payments_for("pay-1").await, 1);
    assert_eq!(db.balances().await["alice"], 500);
    assert_eq!(db.claims().await, 1);
    assert_eq!((stats.processed, stats.duplicates), (1, 1));
    assert_eq!(broker.ready(&queue).await, 0, "both copies were acked");
}

#[tokio::test]
async fn fan_out_to_two_consumers_applies_once_for_each() {
    support::init_tracing();
    let (db, broker) = (Db::new().await, Broker::connect().await);
    let exchange = unique("fanout");
    broker
        .channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Fanout,
            // Gone with its last binding, when the test's queues are deleted.
            ExchangeDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (billing, ledger) = (unique("billing"), unique("ledger"));
    broker.track(&billing);
    broker.track(&ledger);
    // Each queue gets its own consumer name (its queue name by default).
    let a = Running::start(payments_consumer(&db, &billing).bind(&exchange, ""));
    let b = Running::start(payments_consumer(&db, &ledger).bind(&exchange, ""));
    // The runtime binds before it subscribes: a consumer means a binding.
    eventually("both queues are bound and consumed", WAIT, || async {
        broker.consuming(&billing).await && broker.consuming(&ledger).await
    })
    .await;
    for _ in 0..2 {
        let properties = BasicProperties::default().with_message_id("pay-fan".into());
        let body = support::payment_body("carol", 70);
        broker.publish_to(&exchange, "", properties, &body).await;
    }
    a.settled(2).await;
    b.settled(2).await;
    let (sa, sb) = (a.stats(), b.stats());
    a.stop().await.unwrap();
    b.stop().await.unwrap();

    assert_eq!((sa.processed, sa.duplicates), (1, 1));
    assert_eq!((sb.processed, sb.duplicates), (1, 1));
    assert_eq!(
        db.payments_for("pay-fan").await,
        2,
        "one effect per consumer"
    );
    assert_eq!(db.balances().await["carol"], 140);
    assert_eq!(db.claims().await, 2);
}

#[tokio::test]
async fn a_handler_error_after_writing_rolls_back_and_the_retry_applies_once() {
    let (db, broker, queue) = support::setup().await;
    broker
        .publish_payment(&queue, "pay-flaky", "dave", 300)
        .await;

    // Fail the first two attempts after both writes were made.
    let (attempts, flaky) = payments_then(|attempt, _tx| async move {
        if attempt < 2 {
            return Err(HandlerError::transient("flaky downstream"));
        }
        Ok(())
    });
    let consumer = Running::start(consumer_for(&db, &queue).handler(flaky));
    let stats = consumer.finish(1).await;

    assert_eq!(attempts.load(Ordering::SeqCst), 3);
    assert_eq!((stats.retried, stats.processed), (2, 1));
    assert_eq!(
        db.payments_for("pay-flaky").await,
        1,
        "failed attempts left no rows"
    );
    assert_eq!(db.balances().await["dave"], 300);
    assert_eq!(broker.ready(&queue).await, 0);
}

#[tokio::test]
async fn a_panicking_handler_is_rolled_back_and_retried_and_the_runtime_keeps_running() {
    let (db, broker, queue) = support::setup().await;
    broker
        .publish_payment(&queue, "pay-panic", "erin", 10)
        .await;

    let (_, panicky) = payments_then(|attempt, _tx| async move {
        if attempt == 0 {
            panic!("bug in the handler");
        }
        Ok(())
    });
    let consumer = Running::start(consumer_for(&db, &queue).concurrency(1).handler(panicky));
    consumer.settled(1).await;
    broker.publish_payment(&queue, "pay-after", "erin", 5).await;
    let stats = consumer.finish(2).await;

    assert_eq!((stats.retried, stats.processed), (1, 2));
    assert_eq!(db.payments_for("pay-panic").await, 1);
    assert_eq!(db.balances().await["erin"], 15);
}

#[tokio::test]
async fn poison_messages_are_dead_lettered_with_their_reason_and_write_nothing() {
    let (db, broker, queue) = support::setup().await;
    let dlq = format!("{queue}.dlq");
    broker.publish(&queue, Some("bad-json"), b"{not json").await;
    broker
        .publish(&queue, None, &support::payment_body("gina", 1))
        .await;
    broker
        .publish(&queue, Some(""), &support::payment_body("gina", 3))
        .await;
    broker.publish_payment(&queue, "negative", "gina", -4).await;
    broker.publish_payment(&queue, "reused", "gina", 5).await;
    broker.publish_payment(&queue, "reused", "gina", 6).await; // same id, other body

    // One at a time, so "reused" with 5 is the one that gets applied.
    let consumer = Running::start(payments_consumer(&db, &queue).concurrency(1));
    let stats = consumer.finish(6).await;

    let dead = broker.drain(&dlq).await;
    let reasons: Vec<&str> = dead.iter().map(|d| d.reason()).collect();
    assert_eq!(
        reasons,
        [
            "undecodable body",
            "missing message id",
            "invalid message id",
            "permanent handler error",
            "message id reused with a different payload",
        ]
    );
    assert_eq!(dead[0].body, b"{not json", "the original body is kept");
    assert_eq!(dead[2].headers["x-idempo-error"], "empty message id");
    assert!(dead[3].headers["x-idempo-error"].contains("negative amount"));
    for d in &dead {
        assert_eq!(d.headers["x-idempo-consumer"], queue);
        assert_eq!(d.headers["x-idempo-original-queue"], queue);
    }
    assert_eq!(dead[4].message_id.as_deref(), Some("reused"));
    assert_eq!(
        (
            stats.dead_lettered,
            stats.payload_mismatches,
            stats.processed
        ),
        (5, 1, 1)
    );
    assert_eq!(
        db.payments().await,
        1,
        "only the first 'reused' was applied"
    );
    assert_eq!(db.balances().await["gina"], 5);
    assert_eq!(db.claims().await, 1, "poison leaves no claim behind");
    assert_eq!(broker.ready(&queue).await, 0);
}

#[tokio::test]
async fn many_concurrent_copies_across_two_consumer_instances_apply_once() {
    let (db, broker, queue) = support::setup().await;
    let mut messages = Vec::new();
    for copy in 0..100 {
        messages.push(("pay-hot".to_owned(), support::payment_body("hank", 1)));
        if copy % 4 == 0 {
            for id in 0..25 {
                messages.push((format!("pay-{id}"), support::payment_body("ivy", 1)));
            }
        }
    }
    let total = messages.len() as u64;
    broker.publish_many(&queue, &messages).await;

    // Two instances of one consumer (same name): replicas on two hosts.
    let a = Running::start(payments_consumer(&db, &queue).concurrency(8));
    let b = Running::start(payments_consumer(&db, &queue).concurrency(8));
    eventually("every copy settled", WAIT, || async {
        let (x, y) = (a.stats(), b.stats());
        x.processed + x.duplicates + y.processed + y.duplicates >= total
    })
    .await;
    let (sa, sb) = (a.stats(), b.stats());
    a.stop().await.unwrap();
    b.stop().await.unwrap();

    assert!(
        sa.deliveries > 0 && sb.deliveries > 0,
        "both instances took part: {sa:?} {sb:?}"
    );
    assert_eq!(sa.processed + sb.processed, 26);
    assert_eq!(db.payments_for("pay-hot").await, 1);
    assert_eq!(db.payments().await, 26);
    assert_eq!(db.balances().await["hank"], 1);
    assert_eq!(db.balances().await["ivy"], 25);
    assert_eq!(broker.ready(&queue).await, 0);
}

#[tokio::test]
async fn shutdown_lets_the_handler_in_flight_commit_and_returns_the_rest_to_the_queue() {
    let (db, broker, queue) = support::setup().await;
    for i in 0..5 {
        broker
            .publish_payment(&queue, &format!("pay-{i}"), "jill", 1)
            .await;
    }
    let (started, slow) = slow_payments(Duration::from_millis(500));
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .concurrency(1)
            .prefetch(10)
            .handler(slow),
    );
    started.notified().await;
    let stats = consumer.stats.clone();
    consumer
        .stop()
        .await
        .expect("a graceful shutdown returns Ok");

    assert_eq!(
        stats.snapshot().processed,
        1,
        "the handler in flight finished"
    );
    assert_eq!(db.payments().await, 1);
    eventually(
        "the 4 unstarted deliveries are back in the queue",
        WAIT,
        || async { broker.ready(&queue).await == 4 },
    )
    .await;
}

#[tokio::test]
async fn a_header_can_carry_the_message_id() {
    let (db, broker, queue) = support::setup().await;
    for id in ["h-1", "h-1", "h-2"] {
        let body = support::payment_body("kim", 2);
        broker
            .publish_with_headers(&queue, &[("x-payment-id", id)], &body)
            .await;
    }
    let consumer = Running::start(
        payments_consumer(&db, &queue)
            .concurrency(1)
            .message_id(MessageIdSource::Header("x-payment-id".into())),
    );
    let stats = consumer.finish(3).await;

    assert_eq!((stats.processed, stats.duplicates), (2, 1));
    assert_eq!(db.payments_for("h-1").await, 1);
    assert_eq!(db.payments_for("h-2").await, 1);
}

#[tokio::test]
async fn an_oversized_message_id_is_dead_lettered() {
    // The AMQP message_id property cannot exceed 255 bytes, but a header can.
    let (db, broker, queue) = support::setup().await;
    let (id, body) = ("x".repeat(256), support::payment_body("kim", 2));
    broker
        .publish_with_headers(&queue, &[("x-payment-id", &id)], &body)
        .await;
    let consumer = Running::start(
        payments_consumer(&db, &queue).message_id(MessageIdSource::Header("x-payment-id".into())),
    );
    consumer.finish(1).await;

    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason(), "invalid message id");
    assert_eq!(
        dead[0].headers["x-idempo-error"],
        "message id is 256 bytes long, the limit is 255"
    );
    assert_eq!(db.payments().await, 0);
}

#[tokio::test]
async fn a_message_id_with_a_nul_is_dead_lettered_at_once() {
    // PostgreSQL text cannot hold NUL: such an id must never reach the claim
    // (where it would fail, be retried, and end as "max attempts exceeded").
    let (db, broker, queue) = support::setup().await;
    let properties = lapin::BasicProperties::default().with_message_id("pay\0-1".into());
    broker
        .publish_props(&queue, properties, &support::payment_body("kim", 2))
        .await;
    let consumer = Running::start(payments_consumer(&db, &queue));
    let stats = consumer.finish(1).await;

    assert_eq!((stats.retried, stats.dead_lettered), (0, 1));
    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead[0].reason(), "invalid message id");
    assert_eq!(
        dead[0].headers["x-idempo-error"],
        "message id contains a NUL character"
    );
    assert_eq!(db.claims().await, 0);
}

/// Message ids that would break SQL text built carelessly (quotes,
/// backslashes, dollar quotes, an injection, NUL look-alikes, control
/// characters, unicode, 255 bytes) travel as literals in the claim and its
/// check: each is processed once, its copy is a duplicate, its reuse with
/// another body is dead-lettered, and the claim stores it byte for byte,
/// in per-message and in batch mode, also from sessions with
/// `standard_conforming_strings` off.
#[tokio::test]
async fn hostile_message_ids_are_processed_once_and_stored_as_they_came() {
    let modes = [None, Some(10)];
    for (batch, settings) in modes
        .into_iter()
        .flat_map(|b| support::SESSION_SETTINGS.map(|s| (b, s)))
    {
        let (db, broker, queue) = support::setup().await;
        let pool = support::pool_with_settings(&db, 4, settings).await;
        let consumer = Consumer::builder(support::amqp_url(), pool)
            .queue(&queue)
            .redelivery(idempo::consumer::RedeliveryPolicy::delayed([
                support::RETRY_DELAY,
            ]));
        let ids = support::hostile_ids();
        let n = ids.len() as u64;
        let bodies = |cents: fn(usize) -> i64| -> Vec<(String, Vec<u8>)> {
            ids.iter()
                .enumerate()
                .map(|(i, id)| (id.clone(), support::payment_body("ho", cents(i))))
                .collect()
        };
        let originals = bodies(|i| i as i64 + 1);
        let consumer = match batch {
            None => Running::start(consumer.handler(|tx, m| payments::handle(tx, m, 0.0))),
            Some(size) => Running::start(
                consumer
                    .prefetch(30)
                    .batch_handler(|tx, batch| payments::handle_batch(tx, batch, 0.0))
                    .batch(size),
            ),
        };
        // One phase at a time, so that every copy meets a committed claim.
        broker.publish_many(&queue, &originals).await;
        consumer.settled(n).await;
        broker.publish_many(&queue, &originals).await;
        consumer.settled(2 * n).await;
        broker.publish_many(&queue, &bodies(|_| 1_000_000)).await;
        let stats = consumer.finish(3 * n).await;

        assert_eq!(
            (
                stats.processed,
                stats.duplicates,
                stats.dead_lettered,
                stats.retried
            ),
            (n, n, n, 0),
            "{batch:?} {settings:?}: {stats:?}"
        );
        for id in &ids {
            assert_eq!(
                db.payments_for(id).await,
                1,
                "{batch:?} {settings:?}: one effect for {id:?}"
            );
        }
        assert_eq!(db.balances().await["ho"], (1..=n as i64).sum::<i64>());
        let mut stored: Vec<String> =
            sqlx::query_scalar("SELECT message_id FROM processed_messages WHERE consumer = $1")
                .bind(&queue)
                .fetch_all(&db.pool)
                .await
                .unwrap();
        stored.sort();
        let mut expected = ids.clone();
        expected.sort();
        assert_eq!(
            stored, expected,
            "{batch:?} {settings:?}: claims stored byte for byte"
        );
        let dead = broker.drain(&format!("{queue}.dlq")).await;
        assert!(
            dead.iter()
                .all(|d| d.reason() == "message id reused with a different payload"),
            "{batch:?} {settings:?}: {dead:?}"
        );
        let mut dead_ids: Vec<String> = dead.into_iter().filter_map(|d| d.message_id).collect();
        dead_ids.sort();
        assert_eq!(
            dead_ids, expected,
            "{batch:?} {settings:?}: every reuse dead-lettered"
        );
        assert_eq!(broker.ready(&queue).await, 0);
    }
}

#[tokio::test]
async fn a_forged_copy_header_does_not_make_a_new_payment_a_duplicate() {
    use lapin::types::{AMQPValue, FieldTable};
    let (db, broker, queue) = support::setup().await;
    let body = support::payment_body("wes", 10);
    broker.publish_payment(&queue, "pay-A", "wes", 10).await;
    // Another publisher claims that pay-B is an idempo copy of pay-A, with a
    // made-up seal; and a message claims an empty carried id.
    let mut forged = FieldTable::default();
    forged.insert(
        "x-idempo-message-id".into(),
        AMQPValue::LongString("pay-A".into()),
    );
    forged.insert(
        "x-idempo-message-id-seal".into(),
        AMQPValue::LongString("00".repeat(32).into()),
    );
    let properties = lapin::BasicProperties::default()
        .with_message_id("pay-B".into())
        .with_headers(forged);
    broker.publish_props(&queue, properties, &body).await;
    let mut empty = FieldTable::default();
    empty.insert(
        "x-idempo-message-id".into(),
        AMQPValue::LongString("".into()),
    );
    let properties = lapin::BasicProperties::default()
        .with_message_id("pay-C".into())
        .with_headers(empty);
    broker.publish_props(&queue, properties, &body).await;
    let consumer = Running::start(payments_consumer(&db, &queue).concurrency(1));
    let stats = consumer.finish(3).await;

    assert_eq!((stats.processed, stats.duplicates), (3, 0), "{stats:?}");
    for id in ["pay-A", "pay-B", "pay-C"] {
        assert_eq!(db.payments_for(id).await, 1, "{id}");
    }
}

#[tokio::test]
async fn a_dead_letter_carries_its_sealed_id_and_one_without_an_id_carries_none() {
    let (db, broker, queue) = support::setup().await;
    broker
        .publish_props(
            &queue,
            lapin::BasicProperties::default(),
            &support::payment_body("xia", 1),
        )
        .await;
    broker.publish_payment(&queue, "pay-neg", "xia", -5).await;
    let consumer = Running::start(payments_consumer(&db, &queue));
    consumer.finish(2).await;
    let dead = broker.drain(&format!("{queue}.dlq")).await;
    let idless = dead
        .iter()
        .find(|d| d.reason() == "missing message id")
        .unwrap();
    assert!(
        !idless.headers.contains_key("x-idempo-message-id"),
        "{idless:?}"
    );
    let negative = dead
        .iter()
        .find(|d| d.reason() == "permanent handler error")
        .unwrap();
    assert_eq!(negative.headers["x-idempo-message-id"], "pay-neg");
    assert!(negative.headers.contains_key("x-idempo-message-id-seal"));
    // An operator replays both, giving the id-less one an id of its own.
    broker
        .publish_props(
            &queue,
            lapin::BasicProperties::default().with_message_id("pay-fixed".into()),
            &idless.body,
        )
        .await;
    let consumer = Running::start(payments_consumer(&db, &queue));
    consumer.finish(1).await;
    assert_eq!(db.payments_for("pay-fixed").await, 1);
}

#[tokio::test]
async fn content_hash_mode_treats_equal_bodies_as_one_message() {
    let (db, broker, queue) = support::setup().await;
    broker
        .publish(&queue, None, &support::payment_body("lee", 3))
        .await;
    broker
        .publish(&queue, None, &support::payment_body("lee", 3))
        .await;
    broker
        .publish(&queue, None, &support::payment_body("lee", 4))
        .await;
    let consumer = Running::start(
        payments_consumer(&db, &queue)
            .concurrency(1)
            .message_id(MessageIdSource::ContentHash),
    );
    let stats = consumer.finish(3).await;

    assert_eq!((stats.processed, stats.duplicates), (2, 1));
    assert_eq!(db.balances().await["lee"], 7);
    let ids: Vec<String> = sqlx::query_scalar("SELECT message_id FROM processed_messages")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert!(
        ids.iter().all(|id| id.len() == 64),
        "ids are SHA-256 hex: {ids:?}"
    );
}

#[tokio::test]
async fn a_classic_queue_is_declared_on_request() {
    support::init_tracing();
    let (db, broker, queue) = (Db::new().await, Broker::connect().await, unique("q"));
    broker.track(&queue);
    let consumer = Running::start(payments_consumer(&db, &queue).queue_type(QueueType::Classic));
    eventually("the consumer declared its queue", WAIT, || {
        broker.consuming(&queue)
    })
    .await;
    broker.publish_payment(&queue, "pay-c", "max", 1).await;
    consumer.finish(1).await;

    // Re-declaring with other arguments would fail: the queue is classic.
    broker
        .declare_as(&queue, "classic")
        .await
        .expect("the queue is a classic queue with the DLQ arguments");
    assert_eq!(db.payments_for("pay-c").await, 1);
    broker.delete(&queue).await;
}

#[tokio::test]
async fn an_impossible_configuration_is_refused_with_a_clear_error() {
    let db = Db::empty().await;
    let no_queue = Consumer::builder(support::amqp_url(), db.pool.clone())
        .handler(|_tx: Tx, _m: Message| async { Ok(()) })
        .build()
        .unwrap_err();
    assert!(
        no_queue.to_string().contains("a queue is required"),
        "{no_queue}"
    );

    // Without a handler there is no `build` at all: see the compile_fail
    // examples in `idempo::consumer::mode`.

    let prefetch = payments_consumer(&db, "q")
        .prefetch(4)
        .concurrency(8)
        .build()
        .unwrap_err();
    assert!(
        prefetch
            .to_string()
            .contains("prefetch (4) must be at least concurrency (8)")
    );
}

#[tokio::test]
async fn a_tx_handle_kept_past_its_handler_refuses_to_run_statements() {
    let (db, broker, queue) = support::setup().await;
    broker.publish_payment(&queue, "pay-leak", "olga", 1).await;
    let kept: Arc<std::sync::Mutex<Option<Tx>>> = Arc::default();
    let slot = kept.clone();
    let consumer = Running::start(consumer_for(&db, &queue).handler(move |tx: Tx, message| {
        *slot.lock().unwrap() = Some(tx.clone());
        payments::handle(tx, message, 0.0)
    }));
    consumer.finish(1).await;

    let tx = kept.lock().unwrap().take().expect("the handler ran");
    let err = tx.try_lock().unwrap_err();
    assert!(matches!(err, idempo::Error::TransactionFinished), "{err}");
    assert_eq!(
        db.payments_for("pay-leak").await,
        1,
        "the handler's writes committed"
    );
}

#[tokio::test]
async fn a_handler_that_ignores_a_failed_statement_is_not_acked() {
    let (db, broker, queue) = support::setup().await;
    broker
        .publish_payment(&queue, "pay-swallow", "rita", 25)
        .await;
    // First attempt: a failed statement aborts the transaction, the handler
    // ignores the error and returns Ok. COMMIT would then silently roll back.
    let (_, swallowing) = payments_then(|attempt, tx| async move {
        if attempt == 0 {
            let mut tx = tx.try_lock()?;
            let failed = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
            assert!(failed.is_err());
        }
        Ok(())
    });
    let consumer = Running::start(consumer_for(&db, &queue).handler(swallowing));
    let stats = consumer.finish(1).await;

    assert_eq!((stats.retried, stats.processed), (1, 1));
    assert_eq!(
        db.payments_for("pay-swallow").await,
        1,
        "applied once, not lost"
    );
    assert_eq!(db.balances().await["rita"], 25);
}

#[tokio::test]
async fn a_handler_that_rolls_back_by_itself_is_not_acked() {
    let (db, broker, queue) = support::setup().await;
    broker
        .publish_payment(&queue, "pay-self-rollback", "sam", 8)
        .await;
    let (_, rolling_back) = payments_then(|attempt, tx| async move {
        if attempt == 0 {
            let mut tx = tx.try_lock()?;
            sqlx::query("ROLLBACK").execute(&mut *tx).await?;
        }
        Ok(())
    });
    let consumer = Running::start(consumer_for(&db, &queue).handler(rolling_back));
    let stats = consumer.finish(1).await;

    assert_eq!((stats.retried, stats.processed), (1, 1));
    assert_eq!(db.payments_for("pay-self-rollback").await, 1);
}

#[tokio::test]
async fn a_hung_handler_times_out_rolls_back_and_is_retried() {
    let (db, broker, queue) = support::setup().await;
    broker.publish_payment(&queue, "pay-hung", "tom", 3).await;
    let (attempts, hanging) = payments_then(|attempt, _tx| async move {
        if attempt == 0 {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        Ok(())
    });
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .handler_timeout(Duration::from_millis(300))
            .handler(hanging),
    );
    let stats = consumer.finish(1).await;

    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    assert_eq!((stats.retried, stats.processed), (1, 1));
    assert_eq!(db.payments_for("pay-hung").await, 1);
}

#[tokio::test]
async fn locking_the_transaction_twice_is_an_error_not_a_deadlock() {
    let (db, broker, queue) = support::setup().await;
    broker.publish_payment(&queue, "pay-twice", "uma", 1).await;
    let second_lock: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let slot = second_lock.clone();
    let (_, double) = payments_then(move |_, tx| {
        let slot = slot.clone();
        async move {
            let _first = tx.try_lock()?;
            let second = tx.try_lock().map(|_| ()).map_err(|e| e.to_string());
            *slot.lock().unwrap() = second.err();
            Ok(())
        }
    });
    let consumer = Running::start(consumer_for(&db, &queue).handler(double));
    consumer.finish(1).await;

    assert_eq!(
        second_lock.lock().unwrap().as_deref(),
        Some("the transaction is already locked: hold one guard at a time")
    );
    assert_eq!(db.payments_for("pay-twice").await, 1);
}

#[tokio::test]
async fn the_shutdown_timeout_drops_a_slow_handler_and_its_delivery_returns() {
    let (db, broker, queue) = support::setup().await;
    broker.publish_payment(&queue, "pay-slow", "vic", 2).await;
    let (started, slow) = slow_payments(Duration::from_secs(3600));
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .shutdown_timeout(Duration::from_millis(200))
            .handler(slow),
    );
    started.notified().await;
    consumer
        .stop()
        .await
        .expect("a timed-out drain still returns Ok");

    assert_eq!(
        db.payments().await,
        0,
        "the dropped handler's writes rolled back"
    );
    support::eventually_ready(&broker, &queue, 1).await;
}

#[tokio::test]
async fn shutdown_now_does_not_wait_for_handlers_in_flight() {
    let (db, broker, queue) = support::setup().await;
    broker.publish_payment(&queue, "pay-now", "wes", 2).await;
    let (started, slow) = slow_payments(Duration::from_secs(3600));
    let consumer = Running::start(consumer_for(&db, &queue).handler(slow));
    started.notified().await;
    consumer.shutdown.shutdown_now();
    let result = tokio::time::timeout(Duration::from_secs(10), consumer.task)
        .await
        .expect("shutdown_now returns well before the 30 s shutdown timeout");
    result.unwrap().unwrap();

    assert_eq!(db.payments().await, 0);
    support::eventually_ready(&broker, &queue, 1).await;
}

#[tokio::test]
async fn a_custom_function_can_derive_the_message_id() {
    let (db, broker, queue) = support::setup().await;
    for (order, line) in [("o-1", "1"), ("o-1", "1"), ("o-1", "2")] {
        let body = support::payment_body("xena", 1);
        broker
            .publish_with_headers(&queue, &[("order", order), ("line", line)], &body)
            .await;
    }
    let header = |m: &Message, name: &str| match m.amqp()?.header(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        _ => None,
    };
    let consumer = Running::start(payments_consumer(&db, &queue).concurrency(1).message_id(
        MessageIdSource::custom(move |m| {
            Some(format!("{}#{}", header(m, "order")?, header(m, "line")?))
        }),
    ));
    let stats = consumer.finish(3).await;

    assert_eq!((stats.processed, stats.duplicates), (2, 1));
    assert_eq!(db.payments_for("o-1#1").await, 1);
    assert_eq!(db.payments_for("o-1#2").await, 1);
}

#[tokio::test]
async fn a_dead_letter_does_not_inherit_the_original_expiration() {
    let (db, broker, queue) = support::setup().await;
    broker
        .publish_props(
            &queue,
            BasicProperties::default()
                .with_message_id("ttl-poison".into())
                .with_expiration("600000".into()),
            b"not json",
        )
        .await;
    let consumer = Running::start(payments_consumer(&db, &queue));
    consumer.finish(1).await;

    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].expiration, None,
        "a dead letter must not expire out of the DLQ"
    );
    assert_eq!(dead[0].headers["x-idempo-original-expiration"], "600000");
    assert_eq!(dead[0].message_id.as_deref(), Some("ttl-poison"));
}

#[tokio::test]
async fn the_consumer_reaps_its_claims_older_than_the_retention() {
    let (db, _broker, queue) = support::setup().await;
    sqlx::query(
        "INSERT INTO processed_messages (consumer, message_id, processed_at) VALUES \
         ($1, 'old', now() - interval '2 days'), ($1, 'new', now()), ('other', 'old', now() - interval '2 days')",
    )
    .bind(&queue)
    .execute(&db.pool)
    .await
    .unwrap();
    let consumer = Running::start(
        payments_consumer(&db, &queue)
            .retention(Duration::from_secs(24 * 3600))
            .retention_interval(Duration::from_millis(100)),
    );
    eventually("the old claim is reaped", WAIT, || async {
        db.count("SELECT count(*) FROM processed_messages WHERE message_id = 'old'")
            .await
            == 1
    })
    .await;
    consumer.stop().await.unwrap();
    assert_eq!(
        db.claims().await,
        2,
        "the recent claim and the other consumer's stay"
    );
}

#[tokio::test]
async fn batch_mode_applies_each_payment_once_and_dead_letters_poison() {
    let (db, broker, queue) = support::setup().await;
    let mut messages = Vec::new();
    for i in 0..300 {
        let body = support::payment_body(&format!("acct-{}", i % 7), 1 + i % 5);
        messages.push((format!("pay-{i}"), body.clone()));
        if i % 5 == 0 {
            // Sometimes in the same batch, sometimes in a later one.
            messages.push((format!("pay-{i}"), body));
        }
    }
    messages.push(("bad".into(), b"{not json".to_vec()));
    messages.push(("negative".into(), support::payment_body("neg", -3)));
    messages.push(("pay-1".into(), support::payment_body("acct-1", 999)));
    broker.publish_many(&queue, &messages).await;
    let total = messages.len() as u64;

    let consumer = Running::start(
        consumer_for(&db, &queue)
            .prefetch(400)
            .batch_handler(|tx, batch| payments::handle_batch(tx, batch, 0.0))
            .batch(100),
    );
    let stats = consumer.finish(total).await;

    assert_eq!(stats.processed, 300);
    assert_eq!(stats.duplicates, 60);
    assert_eq!(stats.dead_lettered, 3);
    assert_eq!(db.payments().await, 300);
    let expected: i64 = (0..300).map(|i| 1 + i % 5).sum();
    assert_eq!(db.balances().await.values().sum::<i64>(), expected);
    let mut reasons: Vec<String> = broker
        .drain(&format!("{queue}.dlq"))
        .await
        .iter()
        .map(|d| d.reason().to_owned())
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            "message id reused with a different payload",
            "permanent handler error",
            "undecodable body"
        ]
    );
}

#[tokio::test]
async fn a_failing_batch_falls_back_to_one_message_at_a_time() {
    let (db, broker, queue) = support::setup().await;
    let messages: Vec<(String, Vec<u8>)> = (0..50)
        .map(|i| (format!("pay-{i}"), support::payment_body("lou", 1)))
        .collect();
    broker.publish_many(&queue, &messages).await;
    // The handler fails transiently the first two times it sees pay-7: in
    // the batch, then alone in the fallback; the retry then succeeds.
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = seen.clone();
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .batch_handler(
                move |tx, batch: Vec<(idempo::consumer::JsonBody<payments::Payment>, Message)>| {
                    let count = count.clone();
                    async move {
                        let has_flaky = batch.iter().any(|(_, m)| m.id() == "pay-7");
                        if has_flaky && count.fetch_add(1, Ordering::SeqCst) < 2 {
                            return Err(HandlerError::transient("pay-7 is flaky"));
                        }
                        payments::handle_batch(tx, batch, 0.0).await
                    }
                },
            )
            .batch(50),
    );
    let stats = consumer.finish(50).await;

    assert_eq!(stats.processed, 50);
    assert_eq!(stats.retried, 1, "only pay-7 took the retry path");
    assert_eq!(seen.load(Ordering::SeqCst), 3, "batch, alone, retry");
    assert_eq!(db.payments().await, 50);
    assert_eq!(db.balances().await["lou"], 50);
}

#[tokio::test]
async fn a_per_message_handler_runs_over_each_message_of_a_batch() {
    let (db, broker, queue) = support::setup().await;
    let messages: Vec<(String, Vec<u8>)> = (0..120)
        .map(|i| (format!("pay-{}", i % 100), support::payment_body("mia", 2)))
        .collect();
    broker.publish_many(&queue, &messages).await;
    let consumer = Running::start(payments_consumer(&db, &queue).batch(40));
    let stats = consumer.finish(120).await;

    assert_eq!((stats.processed, stats.duplicates), (100, 20));
    assert_eq!(db.payments().await, 100);
    assert_eq!(db.balances().await["mia"], 200);
}

#[tokio::test]
async fn in_one_batch_the_first_copy_of_a_reused_id_wins() {
    let (db, broker, queue) = support::setup().await;
    let first =
        serde_json::to_vec(&serde_json::json!({"account": "nia", "amount_cents": 1})).unwrap();
    let second =
        serde_json::to_vec(&serde_json::json!({"account": "nia", "amount_cents": 2})).unwrap();
    let mut messages = vec![
        ("reused".to_owned(), first),
        ("reused".to_owned(), second.clone()),
    ];
    for i in 0..20 {
        messages.push((format!("filler-{i}"), support::payment_body("oz", 1)));
    }
    broker.publish_many(&queue, &messages).await;
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .prefetch(100)
            .batch_handler(|tx, batch| payments::handle_batch(tx, batch, 0.0))
            .batch(50)
            .batch_linger(Duration::from_millis(200)),
    );
    let stats = consumer.finish(22).await;

    assert_eq!((stats.processed, stats.dead_lettered), (21, 1));
    assert_eq!(
        db.balances().await["nia"],
        1,
        "the first delivery was applied"
    );
    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead[0].body, second, "the later copy was dead-lettered");
}

#[tokio::test]
async fn a_panicking_message_id_function_dead_letters_the_message() {
    let (db, broker, queue) = support::setup().await;
    broker.publish_payment(&queue, "boom", "pat", 1).await;
    broker.publish_payment(&queue, "fine", "pat", 2).await;
    let consumer = Running::start(payments_consumer(&db, &queue).concurrency(1).message_id(
        MessageIdSource::custom(|m| {
            let id = m.amqp()?.message_id()?;
            assert_ne!(id, "boom", "a bug in the id function");
            Some(id.to_owned())
        }),
    ));
    let stats = consumer.finish(2).await;

    assert_eq!(
        (stats.processed, stats.dead_lettered, stats.reconnects),
        (1, 1, 0)
    );
    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead[0].reason(), "invalid message id");
    assert_eq!(
        dead[0].headers["x-idempo-error"],
        "the message-id function panicked"
    );
    assert_eq!(db.payments_for("fine").await, 1);
}

/// `?` on anyhow errors inside a handler: a plain one is retried, a database
/// error that the same data raises again stays permanent under `.context`,
/// and an undecodable body stays undecodable.
#[cfg(feature = "anyhow")]
#[tokio::test]
async fn anyhow_errors_in_a_handler_are_classified_by_the_error_they_carry() {
    use anyhow::Context;
    use std::sync::atomic::AtomicUsize;

    // The application's own code, written with anyhow.
    fn parse(message: &Message) -> anyhow::Result<serde_json::Value> {
        Ok(message.json()?)
    }
    async fn share(conn: &mut sqlx::PgConnection) -> anyhow::Result<i32> {
        sqlx::query_scalar("SELECT 1 / 0") // SQLSTATE 22012: the same every time
            .fetch_one(conn)
            .await
            .context("computing the share")
    }

    let (db, broker, queue) = support::setup().await;
    broker.publish(&queue, Some("not-json"), b"{not json").await;
    broker.publish(&queue, Some("division"), b"{}").await;
    broker.publish(&queue, Some("flaky"), b"{}").await;
    let flaky_attempts = Arc::new(AtomicUsize::new(0));
    let attempts = flaky_attempts.clone();
    let handler = move |tx: Tx, message: Message| {
        let attempts = attempts.clone();
        async move {
            parse(&message)?;
            match message.id() {
                "division" => {
                    let mut tx = tx.try_lock()?;
                    share(&mut tx).await?;
                }
                "flaky" if attempts.fetch_add(1, Ordering::SeqCst) == 0 => {
                    Err(anyhow::anyhow!("the downstream timed out"))?;
                }
                _ => {}
            }
            Ok(())
        }
    };
    let consumer = Running::start(consumer_for(&db, &queue).concurrency(1).handler(handler));
    let stats = consumer.finish(3).await;

    let dead = broker.drain(&format!("{queue}.dlq")).await;
    let reasons: Vec<&str> = dead.iter().map(|d| d.reason()).collect();
    assert_eq!(reasons, ["undecodable body", "permanent handler error"]);
    assert_eq!(dead[0].message_id.as_deref(), Some("not-json"));
    assert_eq!(dead[1].message_id.as_deref(), Some("division"));
    assert_eq!(dead[1].headers["x-idempo-error"], "computing the share");
    assert_eq!(flaky_attempts.load(Ordering::SeqCst), 2, "retried once");
    assert_eq!(
        (stats.dead_lettered, stats.retried, stats.processed),
        (2, 1, 1)
    );
}
