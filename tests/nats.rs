//! The JetStream transport on the machine's NATS server: payments applied
//! once whatever JetStream redelivers, the redelivery delays honoured,
//! poison into the dead-letter table, long handlers keeping their messages.
//! (What is refused at start: `nats_startup.rs`; kills, restarts and the
//! relay: `nats_faults.rs`.)

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempo::Tx;
use idempo::consumer::Message;
use idempo::consumer::{MessageIdSource, RedeliveryPolicy};
use idempo::nats::Consumer;
use support::nats::{Nats, Running, WAIT, recording, stream_name};
use support::{Db, eventually, payment_body, payments};

#[tokio::test]
async fn payments_are_applied_once_and_a_republished_id_is_dropped_or_claimed_as_a_duplicate() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("pay");
    nats.track(&stream);
    let attempts = Arc::default();
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        .handler(recording(attempts, false))
        .build()
        .expect("valid configuration");
    let running = Running::start(consumer);
    // The stream is created by the consumer: wait until it is there.
    nats.wait_for_stream(&stream).await;
    for i in 0..50 {
        let id = format!("pay-{i}");
        let duplicate = nats
            .publish(&stream, Some(&id), &[], &payment_body("alice", 100))
            .await;
        assert!(!duplicate);
    }
    // JetStream's duplicate window drops a re-published Nats-Msg-Id...
    for i in 0..5 {
        let id = format!("pay-{i}");
        assert!(
            nats.publish(&stream, Some(&id), &[], &payment_body("alice", 100))
                .await,
            "JetStream took {id} again"
        );
    }
    running.settled(50).await;
    assert_eq!(db.payments().await, 50);
    assert_eq!(db.balances().await["alice"], 5000);
    assert_eq!(
        nats.unacknowledged(&stream, &stream).await,
        0,
        "every message acknowledged"
    );
    running.stop().await;
    nats.cleanup().await;
}

#[tokio::test]
async fn a_copy_outside_the_duplicate_window_is_claimed_as_a_duplicate() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("copy");
    nats.track(&stream);
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        // The business id in a header: two publishes JetStream cannot tell
        // apart (different Nats-Msg-Id) are one payment to idempo.
        .message_id(MessageIdSource::Header("payment-id".into()))
        .handler(recording(Arc::default(), false))
        .build()
        .unwrap();
    let running = Running::start(consumer);
    nats.wait_for_stream(&stream).await;
    for copy in ["a", "b"] {
        nats.publish(
            &stream,
            Some(&format!("publish-{copy}")),
            &[("payment-id", "pay-1")],
            &payment_body("bob", 700),
        )
        .await;
    }
    running.settled(2).await;
    let stats = running.stats.snapshot();
    assert_eq!((stats.processed, stats.duplicates), (1, 1));
    assert_eq!(db.payments_for("pay-1").await, 1);
    assert_eq!(db.balances().await["bob"], 700);
    running.stop().await;
    nats.cleanup().await;
}

#[tokio::test]
async fn a_transient_failure_waits_the_policys_delay_and_poison_goes_to_the_table() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("retry");
    nats.track(&stream);
    let attempts: Arc<Mutex<HashMap<String, Vec<Instant>>>> = Arc::default();
    let delay = Duration::from_millis(800);
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        .redelivery(RedeliveryPolicy::delayed([delay]).max_attempts(3))
        .handler(recording(attempts.clone(), true))
        .build()
        .unwrap();
    let running = Running::start(consumer);
    nats.wait_for_stream(&stream).await;
    nats.publish(&stream, Some("late-1"), &[], &payment_body("carol", 300))
        .await;
    nats.publish(
        &stream,
        Some("poison-1"),
        &[("x-tenant", "acme")],
        b"{not json",
    )
    .await;
    nats.publish(&stream, None, &[], &payment_body("carol", 1))
        .await;
    running.settled(3).await;
    eventually("late-1 applied after its retry", WAIT, || async {
        db.payments_for("late-1").await == 1
    })
    .await;
    let seen = attempts.lock().unwrap()["late-1"].clone();
    assert_eq!(seen.len(), 2, "one failure, one success");
    assert!(
        seen[1] - seen[0] >= delay,
        "the retry ran {:?} after the failure, before the delay of {delay:?}",
        seen[1] - seen[0]
    );
    let letters: Vec<(Option<String>, String, serde_json::Value, Vec<u8>)> = sqlx::query_as(
        "SELECT message_id, reason, headers, body FROM dead_letters WHERE queue = $1 ORDER BY id",
    )
    .bind(&stream)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(letters.len(), 2, "{letters:?}");
    let poison = letters
        .iter()
        .find(|l| l.0.as_deref() == Some("poison-1"))
        .expect("the poison's letter");
    assert_eq!(poison.1, "undecodable body");
    assert_eq!(poison.3, b"{not json", "the body kept byte for byte");
    assert_eq!(
        poison.2["x-tenant"], "acme",
        "its headers kept: {}",
        poison.2
    );
    assert_eq!(poison.2["Nats-Msg-Id"], "poison-1");
    assert!(
        letters.iter().any(|l| l.1 == "missing message id"),
        "{letters:?}"
    );
    assert_eq!(db.payments().await, 1, "poison applied nothing");
    eventually("every message acknowledged", WAIT, || async {
        nats.unacknowledged(&stream, &stream).await == 0
    })
    .await;
    running.stop().await;
    nats.cleanup().await;
}

#[tokio::test]
async fn a_handler_longer_than_the_ack_wait_keeps_its_message() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("long");
    nats.track(&stream);
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        .ack_wait(Duration::from_secs(1))
        .handler(move |tx: Tx, message: Message| {
            let runs = counted.clone();
            async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let payment: payments::Payment = message.json()?;
                tokio::time::sleep(Duration::from_secs(4)).await;
                payments::apply(tx, message.id(), &payment, 0.0).await?;
                Ok(())
            }
        })
        .build()
        .unwrap();
    let running = Running::start(consumer);
    nats.wait_for_stream(&stream).await;
    nats.publish(&stream, Some("slow-1"), &[], &payment_body("dan", 5))
        .await;
    running.settled(1).await;
    assert_eq!(db.payments_for("slow-1").await, 1);
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "JetStream redelivered a message still at work"
    );
    let stats = running.stats.snapshot();
    assert_eq!(stats.duplicates, 0);
    running.stop().await;
    nats.cleanup().await;
}

#[tokio::test]
async fn batch_mode_applies_a_stream_in_batches_and_letters_the_poison_alone() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("batch");
    nats.track(&stream);
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        .prefetch(300)
        .batch_handler(|tx, batch| {
            payments::handle_batch(tx, batch, payments::Behaviour::default())
        })
        .batch(50)
        .build()
        .unwrap();
    let running = Running::start(consumer);
    nats.wait_for_stream(&stream).await;
    for i in 0..300 {
        nats.publish(
            &stream,
            Some(&format!("b-{i}")),
            &[],
            &payment_body("ivy", 1),
        )
        .await;
    }
    // A payment the example refuses for good (a negative amount... or an
    // empty account): the batch falls back to one at a time.
    nats.publish(
        &stream,
        Some("b-poison"),
        &[],
        &serde_json::to_vec(&serde_json::json!({"account": "", "amount_cents": 5})).unwrap(),
    )
    .await;
    running.settled(301).await;
    assert_eq!(db.payments().await, 300);
    assert_eq!(db.balances().await["ivy"], 300);
    let reason: String = sqlx::query_scalar(
        "SELECT reason FROM dead_letters WHERE queue = $1 AND message_id = 'b-poison'",
    )
    .bind(&stream)
    .fetch_one(&db.pool)
    .await
    .expect("the poison's letter");
    assert_eq!(reason, "permanent handler error");
    running.stop().await;
    nats.cleanup().await;
}

#[tokio::test]
async fn a_graceful_shutdown_finishes_and_acknowledges_the_handlers_in_flight() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("drain");
    nats.track(&stream);
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = started.clone();
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        .handler(move |tx: Tx, message: Message| {
            let started = counted.clone();
            async move {
                started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let payment: payments::Payment = message.json()?;
                tokio::time::sleep(Duration::from_millis(1500)).await;
                payments::apply(tx, message.id(), &payment, 0.0).await?;
                Ok(())
            }
        })
        .build()
        .unwrap();
    let running = Running::start(consumer);
    nats.wait_for_stream(&stream).await;
    for i in 0..4 {
        nats.publish(
            &stream,
            Some(&format!("d-{i}")),
            &[],
            &payment_body("jo", 1),
        )
        .await;
    }
    eventually("four handlers running", WAIT, || async {
        started.load(std::sync::atomic::Ordering::SeqCst) == 4
    })
    .await;
    // Stop while all four sleep: the stop waits for them.
    running.stop().await;
    assert_eq!(db.payments().await, 4, "the handlers in flight finished");
    assert_eq!(
        nats.unacknowledged(&stream, &stream).await,
        0,
        "and their messages were acknowledged before run returned"
    );
    nats.cleanup().await;
}

/// A dead letter is stored, then its delivery settled: a crash in between
/// (a SIGKILL, a cut) brings the delivery back with no claim, its failed
/// attempts rolled back. It is settled as the letter it already is, its
/// handler not run again (the half-hour soak found payments both applied and
/// dead-lettered so); the letter counts the delivery.
#[tokio::test]
async fn a_redelivered_dead_letter_is_settled_again_not_handled() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("lettered");
    nats.track(&stream);
    let body = payment_body("dave", 500);
    // What the crashed process left behind: its letter, committed.
    sqlx::query(
        "INSERT INTO dead_letters (consumer, queue, message_id, payload_sha256, body, reason, \
             error, fingerprint, attempts, first_failed_at, last_failed_at, transport) \
         VALUES ($1, $1, 'lettered-1', $2, $3, 'max attempts exceeded', '3 attempts failed', \
             'max attempts exceeded', 3, now(), now(), 'nats')",
    )
    .bind(&stream)
    .bind(idempo::inbox::Inbox::payload_sha256(&body).to_vec())
    .bind(&body)
    .execute(&db.pool)
    .await
    .unwrap();
    let attempts: Arc<Mutex<HashMap<String, Vec<Instant>>>> = Arc::default();
    // The first delivery fails (transient); the second is a redelivery.
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        .redelivery(RedeliveryPolicy::delayed([Duration::from_millis(100)]).max_attempts(5))
        .handler(recording(attempts.clone(), true))
        .build()
        .unwrap();
    let running = Running::start(consumer);
    nats.wait_for_stream(&stream).await;
    nats.publish(&stream, Some("lettered-1"), &[], &body).await;
    running.settled(1).await;
    eventually("the redelivery acknowledged", WAIT, || async {
        nats.unacknowledged(&stream, &stream).await == 0
    })
    .await;
    let letters: Vec<(i32, String, String)> = sqlx::query_as(
        "SELECT deliveries, state, reason FROM dead_letters WHERE message_id = 'lettered-1'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        letters,
        [(2, "live".to_owned(), "max attempts exceeded".to_owned())],
        "one letter, which counts the redelivery and keeps its reason"
    );
    assert_eq!(
        attempts.lock().unwrap()["lettered-1"].len(),
        1,
        "the handler ran on the first delivery only"
    );
    assert_eq!(db.payments_for("lettered-1").await, 0, "never applied");
    running.stop().await;
    nats.cleanup().await;
}

/// Issue 51 (2): an id and a header name longer than AMQP's 255 bytes are
/// kept by the letter (they panicked the letter's property copy), and the
/// consumer goes on.
#[tokio::test]
async fn a_letter_keeps_an_id_and_a_header_name_longer_than_255_bytes() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("long_names");
    nats.track(&stream);
    let long_id = "i".repeat(300);
    let long_name = format!("X-{}", "n".repeat(300));
    let running = Running::start(
        Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(&stream)
            .message_id(MessageIdSource::Header("X-Id".into()))
            .handler(recording(Arc::default(), false))
            .build()
            .unwrap(),
    );
    nats.wait_for_stream(&stream).await;
    nats.publish(
        &stream,
        None,
        &[("X-Id", &long_id), (&long_name, "kept")],
        &payment_body("al", 1),
    )
    .await;
    nats.publish(&stream, None, &[("X-Id", "after")], &payment_body("al", 2))
        .await;
    running.settled(2).await;
    let (message_id, headers, error): (Option<String>, serde_json::Value, String) =
        sqlx::query_as("SELECT message_id, headers, error FROM dead_letters WHERE queue = $1")
            .bind(&stream)
            .fetch_one(&db.pool)
            .await
            .expect("one letter");
    // Too long to deduplicate on: no id of the letter's, the header kept.
    assert_eq!(message_id, None);
    assert!(error.contains("300 bytes long"), "{error}");
    let header = |name: &str| {
        headers
            .as_object()
            .and_then(|h| h.get(name))
            .unwrap_or_else(|| panic!("{name:.20}… is kept: {headers}"))
            .to_string()
    };
    assert!(header("X-Id").contains(&long_id));
    assert!(header(&long_name).contains("kept"));
    assert_eq!(db.payments_for("after").await, 1, "the consumer went on");
    running.stop().await;
    nats.cleanup().await;
}

/// Issue 51 (5): deliveries waiting their turn in the client (the handlers
/// busy, or held at the database gate in an outage) are kept too: JetStream
/// does not redeliver them, so the wait is no attempt. With one attempt
/// allowed, a redelivery each second would have dead-lettered them unrun.
#[tokio::test]
async fn deliveries_waiting_their_turn_are_not_redelivered_nor_counted_as_attempts() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("waiting");
    nats.track(&stream);
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        .ack_wait(Duration::from_secs(1))
        .concurrency(1)
        .prefetch(10)
        .redelivery(RedeliveryPolicy::delayed([Duration::from_millis(100)]).max_attempts(1))
        .handler(move |tx: Tx, message: Message| {
            let runs = counted.clone();
            async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let payment: payments::Payment = message.json()?;
                tokio::time::sleep(Duration::from_millis(1500)).await;
                payments::apply(tx, message.id(), &payment, 0.0).await?;
                Ok(())
            }
        })
        .build()
        .unwrap();
    let running = Running::start(consumer);
    nats.wait_for_stream(&stream).await;
    for i in 0..4 {
        nats.publish(
            &stream,
            Some(&format!("wait-{i}")),
            &[],
            &payment_body("eve", 1),
        )
        .await;
    }
    eventually("4 payments applied", Duration::from_secs(60), || async {
        db.payments().await == 4
    })
    .await;
    // A redelivery of a waiting one would be settled (as a duplicate or a
    // letter) after the last payment: give it the time to show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stats = running.stats.snapshot();
    assert_eq!(
        (stats.processed, stats.duplicates, stats.dead_lettered),
        (4, 0, 0),
        "{stats:?}"
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 4);
    running.stop().await;
    nats.cleanup().await;
}
