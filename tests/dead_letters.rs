//! The PostgreSQL dead-letter store (`idempo::dead_letters`): every
//! dead-letter path writes a row (through the test harness, which runs the
//! consumer's real delivery path), the queries, and replays that publish
//! each letter exactly once, also when two run at once.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use idempo::Tx;
use idempo::consumer::DeadLetters;
use idempo::consumer::{HandlerError, JsonBody, Message, RedeliveryPolicy};
use idempo::ops::dead_letters::{
    DeadLetterStore, Filter, LetterRef, LetterState, ReplayOptions, Store,
};
use idempo::testing::{Fault, Harness};
use support::payments::{self, Payment};

/// The table store over `pool`.
fn store(pool: &sqlx::PgPool) -> DeadLetterStore {
    DeadLetterStore::table(pool.clone())
}

async fn harness(queue: &str, batch: bool) -> Harness {
    let builder = Harness::new(support::small_pool().await, queue)
        .setup(payments::TABLES)
        .hold_timeout(Duration::from_secs(20));
    if batch {
        builder
            .batch_handler(|tx: Tx, batch: Vec<(JsonBody<Payment>, Message)>| {
                payments::handle_batch(tx, batch, 0.0)
            })
            .configure(|c| {
                c.dead_letters(DeadLetters::Table)
                    .redelivery(RedeliveryPolicy::delayed([Duration::from_secs(1)]).max_attempts(2))
            })
            .await
            .unwrap()
    } else {
        builder
            .handler(|tx: Tx, m: (JsonBody<Payment>, Message)| payments::handle(tx, m, 0.0))
            .configure(|c| {
                c.dead_letters(DeadLetters::Table)
                    .redelivery(RedeliveryPolicy::delayed([Duration::from_secs(1)]).max_attempts(2))
            })
            .await
            .unwrap()
    }
}

fn payment(account: &str, cents: i64) -> Payment {
    Payment {
        account: account.into(),
        amount_cents: cents,
    }
}

/// Every way a delivery is dead-lettered lands one row with its reason and
/// a fingerprint.
async fn every_path_lands_a_row(batch: bool) {
    let h = harness("payments", batch).await;
    let deliver = |m: Message| async {
        if batch {
            h.deliver_all([m]).await.unwrap().remove(0)
        } else {
            h.deliver(m).await.unwrap()
        }
    };
    // Permanent error (a negative amount).
    deliver(h.json("perm-1", &payment("a", -1))).await;
    // Undecodable body.
    deliver(h.message("poison-1", "{not json")).await;
    // Missing id; an empty one.
    deliver(h.message_without_id("{}")).await;
    deliver(h.message("", "{}")).await;
    // Mismatch: the id processed with another body.
    assert!(deliver(h.json("p-1", &payment("a", 1))).await.is_acked());
    assert!(deliver(h.json("p-1", &payment("a", 2))).await.is_mismatch());
    // Retries exhausted (2 attempts).
    let first = h
        .deliver_with(h.json("ex-1", &payment("a", 3)), Fault::Transient)
        .await
        .unwrap();
    let last = h
        .deliver_with(first.redelivery().unwrap(), Fault::Transient)
        .await
        .unwrap();
    assert!(last.is_dead_lettered(), "{last}");

    let letters = store(h.pool())
        .list(&Filter::queue("payments"))
        .await
        .unwrap();
    let reasons: BTreeMap<String, usize> = letters.iter().fold(BTreeMap::new(), |mut m, l| {
        *m.entry(l.reason.clone()).or_default() += 1;
        m
    });
    assert_eq!(
        reasons,
        BTreeMap::from([
            ("invalid message id".to_string(), 1),
            ("max attempts exceeded".to_string(), 1),
            ("message id reused with a different payload".to_string(), 1),
            ("missing message id".to_string(), 1),
            ("permanent handler error".to_string(), 1),
            ("undecodable body".to_string(), 1),
        ]),
        "{letters:#?}"
    );
    for letter in &letters {
        assert_eq!(letter.fingerprint.len(), 16, "{letter:?}");
        assert_eq!(letter.consumer.as_deref(), Some("payments"));
        assert_eq!(letter.state, LetterState::Live);
    }
    let exhausted = letters
        .iter()
        .find(|l| l.reason == "max attempts exceeded")
        .unwrap();
    assert_eq!(exhausted.attempts, Some(2));
    assert_eq!(exhausted.message_id.as_deref(), Some("ex-1"));
    let missing = letters
        .iter()
        .find(|l| l.reason == "missing message id")
        .unwrap();
    assert_eq!(missing.message_id, None);
    // Delivered again (its ack lost, or a durable set up anew): a
    // duplicate of its letter, which stays one row.
    assert!(
        deliver(h.json("perm-1", &payment("a", -1)))
            .await
            .is_duplicate()
    );
    let again = store(h.pool())
        .list(&Filter {
            message_ids: vec!["perm-1".into()],
            ..Filter::queue("payments")
        })
        .await
        .unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].deliveries, 1);
    h.close().await;
}

#[tokio::test]
async fn every_dead_letter_path_lands_a_row_per_message() {
    every_path_lands_a_row(false).await;
}

#[tokio::test]
async fn every_dead_letter_path_lands_a_row_in_batch_mode() {
    every_path_lands_a_row(true).await;
}

#[tokio::test]
async fn letters_are_grouped_shown_and_filtered() {
    let h = harness("payments", false).await;
    for i in 0..5 {
        h.deliver(h.json(&format!("neg-{i}"), &payment(&format!("acct-{i}"), -i - 1)))
            .await
            .unwrap();
    }
    for i in 0..3 {
        h.deliver(h.message(&format!("bad-{i}"), format!("{{\"n\": {i}")))
            .await
            .unwrap();
    }
    let groups = store(h.pool())
        .groups(&Filter::queue("payments"))
        .await
        .unwrap();
    let counts: Vec<(u64, &str)> = groups
        .iter()
        .map(|g| (g.count, g.reason.as_str()))
        .collect();
    assert_eq!(
        counts,
        vec![(5, "permanent handler error"), (3, "undecodable body")],
        "{groups:#?}"
    );
    let by_account = store(h.pool())
        .list(&Filter {
            body_path: Some("$.account ? (@ == \"acct-3\")".into()),
            ..Filter::queue("payments")
        })
        .await
        .unwrap();
    assert_eq!(by_account.len(), 1);
    assert_eq!(by_account[0].message_id.as_deref(), Some("neg-3"));
    let one = store(h.pool())
        .show(&LetterRef::Row(by_account[0].id.unwrap()))
        .await
        .unwrap()
        .unwrap();
    let body: Payment = serde_json::from_slice(&one.body).unwrap();
    assert_eq!(body.amount_cents, -4);
    assert_eq!(one.headers["x-idempo-reason"], "permanent handler error");
    assert_eq!(one.properties["message_id"], "neg-3");
    let group = &groups[0];
    let grouped = store(h.pool())
        .list(&Filter {
            fingerprint: Some(group.fingerprint.clone()),
            ..Filter::queue("payments")
        })
        .await
        .unwrap();
    assert_eq!(grouped.len(), 5);
    let future = std::time::SystemTime::now() + Duration::from_secs(3600);
    let none = store(h.pool())
        .list(&Filter {
            since: Some(future),
            ..Filter::queue("payments")
        })
        .await
        .unwrap();
    assert!(none.is_empty());
    h.close().await;
}

/// Payments dead-lettered by a handler that failed; then fixed: the replay
/// publishes each once, also with two replays racing.
#[tokio::test]
async fn two_replays_at_once_of_1000_letters_publish_each_once() {
    let h = harness("payments", false).await;
    let n = 1000;
    for i in 0..n {
        let d = h
            .deliver_with(
                h.json(&format!("r-{i}"), &payment("zoe", 1)),
                Fault::Permanent,
            )
            .await
            .unwrap();
        assert!(d.is_dead_lettered(), "{d}");
    }
    let filter = Filter::queue("payments");
    let dry = store(h.pool())
        .replay(
            &filter,
            &ReplayOptions {
                dry_run: true,
                all: true,
                ..ReplayOptions::by("test")
            },
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(dry.replayed, n);
    let options = ReplayOptions {
        // One letter per transaction: the two replays interleave.
        throttle: Some(Duration::from_millis(1)),
        all: true,
        ..ReplayOptions::by("test")
    };
    let (a, b) = (store(h.pool()), store(h.pool()));
    let (one, two) = tokio::join!(
        a.replay(&filter, &options, |_| {}),
        b.replay(&filter, &options, |_| {}),
    );
    let (one, two) = (one.unwrap(), two.unwrap());
    assert_eq!(one.replayed + two.replayed, n, "{one:?} {two:?}");
    // Nothing live is left; a third replay finds nothing.
    let third = store(h.pool())
        .replay(&filter, &options, |_| {})
        .await
        .unwrap();
    assert_eq!(third.replayed, 0);
    let replayed = store(h.pool())
        .list(&Filter {
            state: Some(LetterState::Replayed),
            limit: Some(1000),
            ..Filter::queue("payments")
        })
        .await
        .unwrap();
    assert_eq!(replayed.len() as u64, n);
    assert!(replayed.iter().all(|l| l.replay_count == 1));

    // The relay publishes each once, with its original id; the consumer
    // applies each once.
    let published = h.drain().await.unwrap();
    assert_eq!(published.len() as u64, n);
    let mut ids: Vec<&str> = published.iter().filter_map(|m| m.id()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len() as u64, n);
    assert_eq!(
        published[0].headers()["x-idempo-replay-count"],
        serde_json::json!(1)
    );
    for m in &published {
        let d = h.deliver(h.forwarded(m)).await.unwrap();
        assert!(d.is_acked(), "{d}");
    }
    let balance: i64 =
        sqlx::query_scalar("SELECT balance_cents FROM account_balances WHERE account = 'zoe'")
            .fetch_one(h.pool())
            .await
            .unwrap();
    assert_eq!(balance, n as i64);
    h.close().await;
}

/// The balance of `account`, 0 without a row.
async fn balance(pool: &sqlx::PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT balance_cents FROM account_balances WHERE account = $1")
        .bind(account)
        .fetch_optional(pool)
        .await
        .unwrap()
        .unwrap_or(0)
}

/// A dead-lettered message holds its claim: delivered again, also as a
/// first delivery (a JetStream durable set up anew does that), it is a
/// duplicate of its letter and never also applied; the replay releases the
/// claim and the replayed copy is applied once. (The half-hour JetStream
/// soak found 250 payments both applied and dead-lettered before.)
#[tokio::test]
async fn a_lettered_message_delivered_again_is_not_applied_until_replayed() {
    for batch in [false, true] {
        let h = harness("payments", batch).await;
        let m = h.json("held-1", &payment("held", 5));
        let d = h.deliver_with(m.clone(), Fault::Permanent).await.unwrap();
        assert!(d.is_dead_lettered(), "{d}");
        for _ in 0..2 {
            let d = h.deliver(m.clone()).await.unwrap();
            assert!(d.is_duplicate(), "a first delivery again: {d}");
        }
        assert_eq!(balance(h.pool(), "held").await, 0, "never applied");
        let letters = store(h.pool())
            .list(&Filter::queue("payments"))
            .await
            .unwrap();
        assert_eq!(letters.len(), 1, "one live letter: {letters:?}");
        let report = store(h.pool())
            .replay(
                &Filter::queue("payments"),
                &ReplayOptions {
                    all: true,
                    ..ReplayOptions::by("test")
                },
                |_| {},
            )
            .await
            .unwrap();
        assert_eq!(report.replayed, 1, "{report:?}");
        let published = h.drain().await.unwrap();
        assert_eq!(published.len(), 1);
        for _ in 0..2 {
            h.deliver(h.forwarded(&published[0])).await.unwrap();
        }
        assert_eq!(
            balance(h.pool(), "held").await,
            5,
            "applied once, batch {batch}"
        );
        h.close().await;
    }
}

#[tokio::test]
async fn processed_ids_are_skipped_and_letters_discarded_purged_and_reaped() {
    let h = harness("payments", false).await;
    // Processed, and a letter of the same message left by an import, say:
    // the replay would be a duplicate.
    assert!(
        h.deliver(h.json("s-1", &payment("y", 1)))
            .await
            .unwrap()
            .is_acked()
    );
    let body = serde_json::to_vec(&payment("y", 1)).unwrap();
    sqlx::query(
        "INSERT INTO dead_letters (consumer, queue, message_id, payload_sha256, body, reason, \
             error, fingerprint, attempts, first_failed_at, last_failed_at, transport) \
         VALUES ($1, 'payments', 's-1', $2, $3, 'permanent handler error', 'x', 'x', 1, \
             now(), now(), 'amqp')",
    )
    .bind(h.consumer())
    .bind(idempo::inbox::Inbox::payload_sha256(&body).to_vec())
    .bind(&body)
    .execute(h.pool())
    .await
    .unwrap();
    let report = store(h.pool())
        .replay(
            &Filter::queue("payments"),
            &ReplayOptions {
                all: true,
                ..ReplayOptions::by("test")
            },
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(report.replayed, 0);
    assert_eq!(report.skipped_total(), 1, "{report:?}");
    assert!(h.outbox().await.unwrap().is_empty());

    for i in 0..3 {
        h.deliver_with(
            h.json(&format!("d-{i}"), &payment("y", 1)),
            Fault::Permanent,
        )
        .await
        .unwrap();
    }
    let discarded = store(h.pool())
        .discard(
            &Filter {
                message_ids: vec!["d-0".into(), "d-1".into()],
                ..Filter::queue("payments")
            },
            "test",
            false,
        )
        .await
        .unwrap();
    assert_eq!(discarded, 2);
    // Reaped only once older than the period.
    assert_eq!(
        store(h.pool())
            .reap(None, Duration::from_secs(3600), 10)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        store(h.pool())
            .reap(Some("payments"), Duration::ZERO, 1)
            .await
            .unwrap(),
        2
    );
    assert!(
        store(h.pool()).reap(None, Duration::ZERO, 0).await.is_err(),
        "a zero batch is refused"
    );
    let purged = store(h.pool())
        .purge_now(&Filter {
            any_state: true,
            ..Filter::queue("payments")
        })
        .await
        .unwrap();
    assert_eq!(purged, 2, "s-1 and d-2");
    h.close().await;
}

#[tokio::test]
async fn a_handler_error_is_not_the_only_thing_the_table_keeps() {
    // The letter keeps the body whole and binary-safe.
    let h = Harness::new(support::small_pool().await, "raw")
        .handler(|_tx: Tx, m: Message| async move {
            // Errors that differ only in a quoted value and a number.
            let error = if m.id() == "bin-1" {
                "refused 'raw' body #7".to_owned()
            } else {
                format!("refused 'other' body #{}", m.body().len())
            };
            Err::<(), _>(HandlerError::permanent(error))
        })
        .configure(|c| c.dead_letters(DeadLetters::Table))
        .await
        .unwrap();
    let body: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let d = h.deliver(h.message("bin-1", body.clone())).await.unwrap();
    assert!(d.is_dead_lettered(), "{d}");
    let letters = store(h.pool()).list(&Filter::queue("raw")).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].body_bytes, 70_000);
    let detail = store(h.pool())
        .show(&LetterRef::Row(letters[0].id.unwrap()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(detail.body, body);
    // Another letter of the same cause (other quoted value, other number)
    // shares the fingerprint, and the two make one group.
    let d = h
        .deliver(h.message("bin-2", b"12 bytes....".to_vec()))
        .await
        .unwrap();
    assert!(d.is_dead_lettered(), "{d}");
    let letters = store(h.pool()).list(&Filter::queue("raw")).await.unwrap();
    assert_eq!(letters.len(), 2);
    assert_ne!(letters[0].error, letters[1].error);
    assert_eq!(letters[0].fingerprint, letters[1].fingerprint);
    let groups = store(h.pool()).groups(&Filter::queue("raw")).await.unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].count, 2);
    h.close().await;
}

/// The real runtime on RabbitMQ: poison goes to the table, not to the
/// queue's DLQ, and is acked only after its row committed.
#[tokio::test]
async fn the_consumer_writes_dead_letters_to_the_table_instead_of_the_dlq() {
    let (db, broker, queue) = support::setup().await;
    broker.publish(&queue, Some("bad-json"), b"{not json").await;
    broker.publish_payment(&queue, "negative", "ina", -4).await;
    broker.publish_payment(&queue, "fine", "ina", 4).await;
    let consumer = support::consumer::Running::start(
        support::consumer::payments_consumer(&db, &queue).dead_letters(DeadLetters::Table),
    );
    let stats = consumer.finish(3).await;
    assert_eq!((stats.processed, stats.dead_lettered), (1, 2), "{stats:?}");
    let letters = store(&db.pool)
        .list(&Filter::queue(queue.as_str()))
        .await
        .unwrap();
    let mut reasons: Vec<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
    reasons.sort_unstable();
    assert_eq!(reasons, ["permanent handler error", "undecodable body"]);
    assert_eq!(
        broker.ready(&format!("{queue}.dlq")).await,
        0,
        "nothing in the queue DLQ"
    );
    assert_eq!(broker.ready(&queue).await, 0, "all acked");
}

/// PostgreSQL unreachable while a poison message arrives: the delivery is
/// held (unacked), then stored once the database is back. Nothing lost.
#[tokio::test]
async fn a_dead_letter_waits_for_the_database_and_is_stored_once() {
    let (db, broker, queue) = support::setup().await;
    let proxy = support::TcpProxy::postgres().await;
    let pool = support::pool_through(&proxy, &db).await;
    let consumer = support::consumer::Running::start(
        idempo::amqp::Consumer::builder(support::amqp_url(), pool)
            .queue(queue.as_str())
            .redelivery(RedeliveryPolicy::delayed([Duration::from_millis(200)]))
            .dead_letters(DeadLetters::Table)
            .handler(|tx: Tx, m: (JsonBody<Payment>, Message)| payments::handle(tx, m, 0.0)),
    );
    // The consumer is up (its key loaded); now the database goes away.
    consumer.health.wait_for(|h| h.is_consuming()).await;
    proxy.cut();
    broker.publish(&queue, Some("poison"), b"{not json").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        consumer.stats().dead_lettered,
        0,
        "not stored while the database is away"
    );
    let stored = store(&db.pool)
        .list(&Filter::queue(queue.as_str()))
        .await
        .unwrap();
    assert!(stored.is_empty());
    proxy.restore();
    let stats = consumer.finish(1).await;
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
    let letters = store(&db.pool)
        .list(&Filter::queue(queue.as_str()))
        .await
        .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].message_id.as_deref(), Some("poison"));
    assert_eq!(broker.ready(&queue).await, 0);
    assert_eq!(broker.ready(&format!("{queue}.dlq")).await, 0);
}

/// A delivery lapin cannot parse (a property that is not UTF-8) goes
/// through the quarantine into the table, its properties mended.
#[tokio::test]
async fn a_delivery_the_client_cannot_parse_lands_in_the_table() {
    use support::pika::RawMessage;
    let (db, broker, queue) = support::setup().await;
    let body = support::payment_body("olga", 1);
    let mut messages = vec![RawMessage {
        body: body.clone(),
        message_id: Some(b"bad-\xff\xfe".to_vec()),
        ..Default::default()
    }];
    for i in 0..5 {
        messages.push(RawMessage {
            body: body.clone(),
            message_id: Some(format!("good-{i}").into_bytes()),
            ..Default::default()
        });
    }
    support::pika::publish(&queue, &messages);
    let consumer = support::consumer::Running::start(
        support::consumer::payments_consumer(&db, &queue).dead_letters(DeadLetters::Table),
    );
    support::eventually(
        "the good payments applied",
        Duration::from_secs(60),
        || async { db.payments().await == 5 },
    )
    .await;
    support::eventually("the poison stored", Duration::from_secs(30), || async {
        !store(&db.pool)
            .list(&Filter::queue(queue.as_str()))
            .await
            .unwrap()
            .is_empty()
    })
    .await;
    consumer.stop().await.unwrap();
    let letters = store(&db.pool)
        .list(&Filter::queue(queue.as_str()))
        .await
        .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].reason, "undecodable properties");
    assert!(
        letters[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("hex 6261642dfffe")),
        "{:?}",
        letters[0].error
    );
    assert_eq!(
        letters[0].message_id.as_deref(),
        Some("bad-\u{fffd}\u{fffd}")
    );
    assert_eq!(broker.ready(&format!("{queue}.dlq")).await, 0);
    assert_eq!(broker.ready(&queue).await, 0);
}

/// A header of every AMQP field type (a byte array with NUL, decimals at
/// the top and in an array, a nested table) and every basic property.
fn every_property(message_id: &str) -> lapin::BasicProperties {
    use lapin::types::{AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString};
    let mut nested = FieldTable::default();
    nested.insert("deep".into(), AMQPValue::ShortShortInt(-1));
    nested.insert("when".into(), AMQPValue::Timestamp(1_600_000_000));
    let mut headers = FieldTable::default();
    for (name, value) in [
        ("bool", AMQPValue::Boolean(true)),
        ("i8", AMQPValue::ShortShortInt(-8)),
        ("u8", AMQPValue::ShortShortUInt(8)),
        ("i16", AMQPValue::ShortInt(-16)),
        ("u16", AMQPValue::ShortUInt(16)),
        ("i32", AMQPValue::LongInt(-32)),
        ("u32", AMQPValue::LongUInt(32)),
        ("i64", AMQPValue::LongLongInt(-64)),
        ("f32", AMQPValue::Float(1.5)),
        ("f64", AMQPValue::Double(2.25)),
        (
            "decimal",
            AMQPValue::DecimalValue(DecimalValue {
                scale: 2,
                value: 1234,
            }),
        ),
        ("text", AMQPValue::LongString(LongString::from("text"))),
        (
            "raw",
            AMQPValue::ByteArray(ByteArray::from(vec![0u8, 0xff, 0x00, b'x'])),
        ),
        ("time", AMQPValue::Timestamp(1_700_000_000)),
        ("void", AMQPValue::Void),
        ("table", AMQPValue::FieldTable(nested)),
        (
            "array",
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::DecimalValue(DecimalValue {
                    scale: 1,
                    value: 25,
                }),
                AMQPValue::LongString(LongString::from("two")),
            ])),
        ),
    ] {
        headers.insert(name.into(), value);
    }
    lapin::BasicProperties::default()
        .with_content_type("application/x-payment".into())
        .with_content_encoding("identity".into())
        .with_headers(headers)
        .with_delivery_mode(2)
        .with_priority(7)
        .with_correlation_id("corr-1".into())
        .with_reply_to("replies".into())
        .with_message_id(message_id.into())
        .with_timestamp(1_700_000_001)
        .with_type("payment".into())
        .with_app_id("shop".into())
        .with_cluster_id("c1".into())
}

/// Replayed from the table, a letter comes back with every byte: its body,
/// every basic property, every header with its AMQP type. (Through the
/// outbox's JSON it lost decimals, timestamps, byte arrays and six
/// properties, and a NUL in one letter stopped the whole replay.)
#[tokio::test]
async fn a_table_replay_gives_back_every_property_and_header_type() {
    let (db, broker, queue) = support::setup().await;
    let capture = support::unique("capture");
    broker.declare(&capture).await;
    let body = b"not a payment \x00\xff".to_vec();
    broker
        .publish_props(&queue, every_property("exact-1"), &body)
        .await;
    // A second letter whose copy the outbox refuses (a routing key AMQP
    // cannot carry): it stays, the first is replayed.
    broker
        .publish_props(&queue, every_property("exact-2"), &body)
        .await;
    let consumer = support::consumer::Running::start(
        support::consumer::payments_consumer(&db, &queue).dead_letters(DeadLetters::Table),
    );
    consumer.settled(2).await;
    let store = store(&db.pool);
    let letters = store.list(&Filter::queue(queue.as_str())).await.unwrap();
    assert_eq!(letters.len(), 2, "{letters:?}");

    let report = store
        .replay(
            &Filter {
                message_ids: vec!["exact-1".into()],
                ..Filter::queue(queue.as_str())
            },
            &ReplayOptions {
                to: Some(capture.clone()),
                ..ReplayOptions::by("test")
            },
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!((report.replayed, report.skipped_total()), (1, 0));
    let refused = store
        .replay(
            &Filter {
                message_ids: vec!["exact-2".into()],
                ..Filter::queue(queue.as_str())
            },
            &ReplayOptions {
                to: Some("x".repeat(300)),
                ..ReplayOptions::by("test")
            },
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(
        (refused.replayed, refused.skipped_total()),
        (0, 1),
        "{refused:?}"
    );
    assert_eq!(
        store
            .list(&Filter::queue(queue.as_str()))
            .await
            .unwrap()
            .len(),
        1,
        "the refused letter stays live"
    );

    // The consumer's relay publishes the replay.
    support::eventually_ready(&broker, &capture, 1).await;
    let got = broker
        .channel
        .basic_get(
            capture.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the replay is in the capture queue");
    assert_gives_back(&every_property("exact-1"), &body, &got.delivery);
    consumer.stop().await.unwrap();
}

/// `delivery` is the message published with `sent` and `body`, replayed:
/// every property and header as sent, the failure headers in its history.
fn assert_gives_back(
    sent: &lapin::BasicProperties,
    body: &[u8],
    delivery: &lapin::message::Delivery,
) {
    let back = &delivery.properties;
    assert_eq!(delivery.data, body);
    assert_eq!(back.content_type(), sent.content_type());
    assert_eq!(back.content_encoding(), sent.content_encoding());
    assert_eq!(back.delivery_mode(), sent.delivery_mode());
    assert_eq!(back.priority(), sent.priority());
    assert_eq!(back.correlation_id(), sent.correlation_id());
    assert_eq!(back.reply_to(), sent.reply_to());
    assert_eq!(back.message_id(), sent.message_id());
    assert_eq!(back.timestamp(), sent.timestamp());
    assert_eq!(back.kind(), sent.kind());
    assert_eq!(back.app_id(), sent.app_id());
    assert_eq!(back.cluster_id(), sent.cluster_id());
    let back_headers = back.headers().as_ref().unwrap().inner();
    for (name, value) in sent.headers().as_ref().unwrap().inner() {
        assert_eq!(back_headers.get(name), Some(value), "header {name}");
    }
    assert!(back_headers.contains_key("x-idempo-replay-history"));
    assert!(!back_headers.contains_key("x-idempo-reason"));
}

/// The same from a RabbitMQ DLQ, replayed from it, and imported into the
/// table and replayed from there.
#[tokio::test]
async fn a_queue_replay_and_an_imported_letter_give_back_every_byte() {
    let (db, broker, queue) = support::setup().await;
    let capture = support::unique("capture");
    broker.declare(&capture).await;
    let body = b"not a payment \x00\xff".to_vec();
    broker
        .publish_props(&queue, every_property("dlq-1"), &body)
        .await;
    let consumer =
        support::consumer::Running::start(support::consumer::payments_consumer(&db, &queue));
    consumer.finish(1).await;
    let dlq = format!("{queue}.dlq");
    support::eventually_ready(&broker, &dlq, 1).await;
    let services = idempo::ops::Services::with_pool(support::amqp_url(), db.pool.clone());

    // Replayed from the DLQ to its work queue (nobody consumes it now).
    let from_queue = DeadLetterStore::open(&services, &queue, Store::Queue)
        .await
        .unwrap();
    let report = from_queue
        .replay(
            &Filter::default(),
            &ReplayOptions {
                all: true,
                ..ReplayOptions::by("test")
            },
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(report.replayed, 1, "{report:?}");
    let got = broker
        .channel
        .basic_get(
            queue.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the replay is in the work queue");
    assert_gives_back(&every_property("dlq-1"), &body, &got.delivery);

    // Dead-lettered again, imported into the table, replayed from there.
    broker
        .publish_props(&queue, every_property("dlq-2"), &body)
        .await;
    let consumer =
        support::consumer::Running::start(support::consumer::payments_consumer(&db, &queue));
    consumer.finish(1).await;
    support::eventually_ready(&broker, &dlq, 1).await;
    let imported = services.import_dead_letters(&queue, |_| {}).await.unwrap();
    assert_eq!(imported.imported, 1);
    let report = store(&db.pool)
        .replay(
            &Filter {
                message_ids: vec!["dlq-2".into()],
                ..Filter::queue(queue.as_str())
            },
            &ReplayOptions {
                to: Some(capture.clone()),
                ..ReplayOptions::by("test")
            },
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(report.replayed, 1, "{report:?}");
    // A relay publishes what the replay staged.
    let relay = idempo::amqp::Relay::new(&support::amqp_url(), db.pool.clone())
        .unwrap()
        .poll_interval(Duration::from_millis(300));
    let stop = relay.shutdown_handle();
    let running = tokio::spawn(relay.run());
    support::eventually_ready(&broker, &capture, 1).await;
    stop.shutdown();
    running.await.unwrap().unwrap();
    let got = broker
        .channel
        .basic_get(
            capture.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the replay is in the capture queue");
    assert_gives_back(&every_property("dlq-2"), &body, &got.delivery);
}

/// A foreign client's message (pika writes and reads it) through both
/// stores: every property and header type comes back as it went.
#[tokio::test]
async fn a_foreign_clients_message_comes_back_whole_from_both_stores() {
    let (db, broker, queue) = support::setup().await;
    let capture = support::unique("capture");
    broker.declare(&capture).await;
    let services = idempo::ops::Services::with_pool(support::amqp_url(), db.pool.clone());

    // The table: dead-lettered there, replayed to the capture queue.
    let table_sent = support::pika::publish_every_type(&queue, "pika-table");
    let consumer = support::consumer::Running::start(
        support::consumer::payments_consumer(&db, &queue).dead_letters(DeadLetters::Table),
    );
    consumer.settled(1).await;
    let report = store(&db.pool)
        .replay(
            &Filter::queue(queue.as_str()),
            &ReplayOptions {
                all: true,
                to: Some(capture.clone()),
                ..ReplayOptions::by("test")
            },
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(report.replayed, 1, "{report:?}");
    support::eventually_ready(&broker, &capture, 1).await;
    consumer.stop().await.unwrap();
    support::pika::assert_same(&table_sent, &support::pika::read_one(&capture));

    // The RabbitMQ DLQ: replayed to the work queue, read from there.
    let queue_sent = support::pika::publish_every_type(&queue, "pika-queue");
    support::consumer::Running::start(support::consumer::payments_consumer(&db, &queue))
        .finish(1)
        .await;
    support::eventually_ready(&broker, &format!("{queue}.dlq"), 1).await;
    let from_queue = DeadLetterStore::open(&services, &queue, Store::Queue)
        .await
        .unwrap();
    let report = from_queue
        .replay(
            &Filter::default(),
            &ReplayOptions {
                all: true,
                ..ReplayOptions::by("test")
            },
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(report.replayed, 1, "{report:?}");
    support::pika::assert_same(&queue_sent, &support::pika::read_one(&queue));
}

/// A letter whose queue is gone stays, with its reason, and the others
/// are replayed: from the table and from a RabbitMQ DLQ.
#[tokio::test]
async fn a_letter_bound_for_a_missing_queue_stays_and_the_others_go() {
    let (db, broker, queue) = support::setup().await;
    let services = idempo::ops::Services::with_pool(support::amqp_url(), db.pool.clone());
    broker.publish(&queue, Some("poison-1"), b"{not json").await;
    broker.publish(&queue, Some("poison-2"), b"{not json").await;
    support::consumer::Running::start(
        support::consumer::payments_consumer(&db, &queue).dead_letters(DeadLetters::Table),
    )
    .finish(2)
    .await;
    let table = DeadLetterStore::open(&services, &queue, Store::Table)
        .await
        .unwrap();
    let nowhere = ReplayOptions {
        all: true,
        to: Some(support::unique("gone")),
        ..ReplayOptions::by("test")
    };
    let report = table
        .replay(&Filter::queue(queue.as_str()), &nowhere, |_| {})
        .await
        .unwrap();
    assert_eq!(
        (report.replayed, report.skipped_total()),
        (0, 2),
        "{report:?}"
    );
    assert_eq!(
        table
            .list(&Filter::queue(queue.as_str()))
            .await
            .unwrap()
            .len(),
        2,
        "both stay live"
    );
    let report = table
        .replay(
            &Filter::queue(queue.as_str()),
            &ReplayOptions {
                all: true,
                ..ReplayOptions::by("test")
            },
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(report.replayed, 2, "to their own queue: {report:?}");

    // A DLQ: one letter's original queue is gone, the other's is there.
    let gone = support::unique("gone");
    broker.declare(&gone).await;
    // Declared with its DLQ.
    let dlq = format!("{gone}.dlq");
    for (id, original) in [("to-gone", gone.as_str()), ("to-here", queue.as_str())] {
        let mut headers = lapin::types::FieldTable::default();
        for (name, value) in [
            ("x-idempo-original-queue", original),
            ("x-idempo-consumer", original),
            ("x-idempo-reason", "permanent handler error"),
        ] {
            headers.insert(
                name.into(),
                lapin::types::AMQPValue::LongString(value.into()),
            );
        }
        let properties = lapin::BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(headers);
        broker.publish_props(&dlq, properties, b"{}").await;
    }
    broker.delete(&gone).await;
    let from_queue = DeadLetterStore::open(&services, &gone, Store::Queue)
        .await
        .unwrap();
    let report = from_queue
        .replay(
            &Filter::default(),
            &ReplayOptions {
                all: true,
                ..ReplayOptions::by("test")
            },
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(
        (report.replayed, report.skipped_total()),
        (1, 1),
        "{report:?}"
    );
    let left = from_queue.list(&Filter::default()).await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].message_id.as_deref(), Some("to-gone"));
}
