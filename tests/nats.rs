//! The JetStream transport on the machine's NATS server: payments applied
//! once whatever JetStream redelivers, the redelivery delays honoured,
//! poison into the dead-letter table, long handlers keeping their messages,
//! and what is refused at start. (Kills, restarts and the relay:
//! `nats_faults.rs`.)

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempo::Tx;
use idempo::consumer::Message;
use idempo::consumer::{MessageIdSource, RedeliveryPolicy};
use idempo::nats::{Consumer, NatsError};
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

fn nats_error(e: &idempo::Error) -> &NatsError {
    e.downcast_ref::<NatsError>()
        .unwrap_or_else(|| panic!("not a NatsError: {e}"))
}

#[tokio::test]
async fn what_nats_would_refuse_or_lose_is_refused_at_start() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let handler = recording(Arc::default(), false);
    // A name NATS refuses.
    let e = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream("pay ments")
        .handler(handler.clone())
        .build()
        .unwrap_err();
    assert!(
        matches!(
            nats_error(&e),
            NatsError::InvalidName { what: "stream", .. }
        ),
        "{e}"
    );
    let e = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream("payments")
        .subject("orders..paid")
        .handler(handler.clone())
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("empty token"), "{e}");

    // A stream whose subjects do not take the consumed subject.
    let stream = stream_name("other");
    nats.track(&stream);
    nats.js
        .create_stream(idempo::nats::async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{stream}.orders")],
            ..Default::default()
        })
        .await
        .unwrap();
    let run = |stream: String, subject: String| {
        let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(stream)
            .subject(subject)
            .handler(handler.clone())
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, consumer.run())
    };
    let e = run(stream.clone(), format!("{stream}.payments"))
        .await
        .expect("an error at start, not a wait")
        .unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::StreamConflict { .. }),
        "{e}"
    );
    // A durable consumer with a MaxDeliver that would drop messages.
    nats.js
        .get_stream(&stream)
        .await
        .unwrap()
        .create_consumer(
            idempo::nats::async_nats::jetstream::consumer::pull::Config {
                durable_name: Some(stream.clone()),
                max_deliver: 3,
                filter_subject: format!("{stream}.orders"),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let e = run(stream.clone(), format!("{stream}.orders"))
        .await
        .expect("an error at start")
        .unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::ConsumerConflict { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("MaxDeliver"), "{e}");
    // A missing stream when this consumer may not create it.
    let missing = stream_name("missing");
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&missing)
        .create_stream(false)
        .handler(handler.clone())
        .build()
        .unwrap();
    let e = consumer.run().await.unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
    assert!(
        nats.js.get_stream(&missing).await.is_err(),
        "nothing created"
    );
    nats.cleanup().await;
}

/// Issue 51 (4): topologies that lose or mis-file messages are refused at
/// start, with what to do.
#[tokio::test]
async fn a_topology_that_loses_or_misfiles_messages_is_refused_at_start() {
    use idempo::nats::async_nats::jetstream::consumer::{DeliverPolicy, pull};
    use idempo::nats::async_nats::jetstream::stream;

    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let handler = recording(Arc::default(), false);
    let start = |stream: &str| {
        let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(stream)
            .handler(handler.clone())
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, consumer.run())
    };
    let new_stream = |name: &str| stream::Config {
        name: name.to_owned(),
        subjects: vec![name.to_owned()],
        ..Default::default()
    };

    // A stream that deletes the oldest messages past 100, acknowledged or not.
    let limited = stream_name("limited");
    nats.track(&limited);
    nats.js
        .create_stream(stream::Config {
            max_messages: 100,
            ..new_stream(&limited)
        })
        .await
        .unwrap();
    let e = start(&limited)
        .await
        .expect("an error at start")
        .unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::StreamConflict { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("max_msgs limit (100)"), "{e}");
    // The same limit refusing publishes when full loses nothing: accepted.
    let refusing = stream_name("refusing");
    nats.track(&refusing);
    nats.js
        .create_stream(stream::Config {
            max_messages: 100,
            discard: stream::DiscardPolicy::New,
            ..new_stream(&refusing)
        })
        .await
        .unwrap();
    nats.publish(&refusing, Some("r-1"), &[], &payment_body("ann", 1))
        .await;
    let running = Running::start(
        Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(&refusing)
            .handler(handler.clone())
            .build()
            .unwrap(),
    );
    running.settled(1).await;
    running.stop().await;

    // A durable that waits less than the consumer before redelivering.
    let hasty = stream_name("hasty");
    nats.track(&hasty);
    let created = nats.js.create_stream(new_stream(&hasty)).await.unwrap();
    created
        .create_consumer(pull::Config {
            durable_name: Some(hasty.clone()),
            ack_wait: Duration::from_secs(2),
            ..Default::default()
        })
        .await
        .unwrap();
    let e = start(&hasty).await.expect("an error at start").unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::ConsumerConflict { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("ack wait (2s)"), "{e}");

    // A durable that skips what the stream held when it was created.
    let late = stream_name("late");
    nats.track(&late);
    let created = nats.js.create_stream(new_stream(&late)).await.unwrap();
    nats.publish(&late, Some("l-1"), &[], &payment_body("bo", 1))
        .await;
    created
        .create_consumer(pull::Config {
            durable_name: Some(late.clone()),
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await
        .unwrap();
    let e = start(&late).await.expect("an error at start").unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::ConsumerConflict { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("deliver policy New"), "{e}");
    assert_eq!(db.payments().await, 1, "only the accepted stream's payment");
    nats.cleanup().await;
}

/// Issue 51 (3): a durable set up anew would send the whole stream again;
/// messages older than the claims kept would run twice. Refused, with what
/// to do; a durable the operator creates is then used.
#[tokio::test]
async fn a_new_durable_is_refused_while_the_stream_holds_messages_older_than_the_claims() {
    use idempo::nats::async_nats::jetstream::consumer::pull;

    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("horizon");
    nats.track(&stream);
    let created = nats
        .js
        .create_stream(idempo::nats::async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![stream.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    for i in 0..3 {
        nats.publish(
            &stream,
            Some(&format!("h-{i}")),
            &[],
            &payment_body("al", 1),
        )
        .await;
    }
    // Claims kept one second: the stream's messages are older after two.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let handler = recording(Arc::default(), false);
    let build = || {
        Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(&stream)
            .retention(Duration::from_secs(1))
            .handler(handler.clone())
            .build()
            .unwrap()
    };
    let e = tokio::time::timeout(WAIT, build().run())
        .await
        .expect("an error at start")
        .unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::ConsumerConflict { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("older than the claims kept"), "{e}");
    assert!(e.to_string().contains("--deliver all"), "{e}");
    assert_eq!(db.payments().await, 0, "nothing applied");
    // The operator decides they were never processed.
    created
        .create_consumer(pull::Config {
            durable_name: Some(stream.clone()),
            ack_policy: idempo::nats::async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    let running = Running::start(build());
    running.settled(3).await;
    assert_eq!(db.payments().await, 3);
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

#[tokio::test]
async fn a_server_without_jetstream_is_refused_at_start() {
    support::init_tracing();
    let db = Db::new().await;
    let port = support::free_port();
    let mut server = std::process::Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("nats-server (apt-get install nats-server)");
    let _kill = support::KillOnDrop(&mut server);
    let url = format!("nats://127.0.0.1:{port}");
    eventually("the server listens", WAIT, || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let consumer = Consumer::builder(url, db.pool.clone())
        .stream("payments")
        .handler(recording(Arc::default(), false))
        .build()
        .unwrap();
    let e = tokio::time::timeout(WAIT, consumer.run())
        .await
        .expect("an error at start, not a wait")
        .unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::NoJetStream { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("-js"), "the error says how: {e}");
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
