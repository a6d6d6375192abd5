//! The JetStream transport under faults: competing processes SIGKILLed
//! while draining, the server killed and restarted, the relay dying between
//! publish and mark, and two chained examples keeping equal ledgers.

mod support;

use std::sync::Arc;
use std::time::Duration;

use idempo::nats::Consumer;
use support::nats::{Nats, OwnServer, Running, WAIT, recording, stream_name};
use support::{Db, eventually, payment_body};

async fn doubled(db: &Db) -> i64 {
    support::example::doubled_payments(db).await
}

#[tokio::test]
async fn competing_examples_sigkilled_while_draining_apply_every_payment_once() {
    use support::example::{doubled_payments, signal, spawn_example};

    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("kill");
    nats.track(&stream);
    const N: usize = 3000;
    let url = support::nats::nats_url();
    let env = [
        ("PAYMENTS_TRANSPORT", "nats"),
        ("NATS_URL", url.as_str()),
        ("PAYMENTS_FAIL_RATE", "0.05"),
    ];
    let mut workers = [
        spawn_example(&db.url, &stream, &env),
        spawn_example(&db.url, &stream, &env),
    ];
    nats.wait_for_stream(&stream).await;
    let mut expected: std::collections::BTreeMap<String, i64> = Default::default();
    let mut acks = Vec::with_capacity(N);
    for i in 0..N {
        let account = format!("acct-{}", i % 7);
        let cents = (i % 13) as i64 + 1;
        *expected.entry(account.clone()).or_default() += cents;
        let mut headers = idempo::nats::async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("pay-{i}").as_str());
        let ack = nats
            .js
            .publish_with_headers(
                stream.clone(),
                headers,
                payment_body(&account, cents).into(),
            )
            .await
            .expect("publish");
        acks.push(ack);
    }
    for ack in acks {
        ack.await.expect("PubAck");
    }
    // SIGKILL one worker or the other while they drain, and start it again.
    for round in 0..6 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let victim = round % 2;
        signal(&workers[victim], "-KILL");
        workers[victim] = spawn_example(&db.url, &stream, &env);
    }
    eventually(
        &format!("{N} payments applied"),
        Duration::from_secs(180),
        || async { db.payments().await as usize >= N },
    )
    .await;
    // Whatever was in flight at a kill comes back after the ack wait: give
    // it the time to be claimed (as a duplicate) before counting.
    eventually(
        "every message acknowledged",
        Duration::from_secs(120),
        || async { nats.unacknowledged(&stream, &stream).await == 0 },
    )
    .await;
    assert_eq!(db.payments().await as usize, N, "each payment applied once");
    assert_eq!(doubled_payments(&db).await, 0);
    assert_eq!(db.balances().await, expected, "the ledger adds up");
    drop(workers);
    nats.cleanup().await;
}

/// A JetStream server of the test's own (its port, its store directory),
/// so that it can be killed and started again.
#[tokio::test]
async fn the_consumer_carries_on_after_its_server_restarts() {
    support::init_tracing();
    let db = Db::new().await;
    let mut server = OwnServer::start();
    let url = server.url();
    eventually("the server listens", WAIT, || async {
        tokio::net::TcpStream::connect(("127.0.0.1", server.port))
            .await
            .is_ok()
    })
    .await;
    let stream = stream_name("restart");
    let consumer = Consumer::builder(url.clone(), db.pool.clone())
        .stream(&stream)
        .handler(recording(Arc::default(), false))
        .build()
        .unwrap();
    let health = consumer.health();
    let running = Running::start(consumer);
    let nats = Nats::connect_to(&url).await;
    nats.wait_for_stream(&stream).await;
    for i in 0..20 {
        nats.publish(
            &stream,
            Some(&format!("before-{i}")),
            &[],
            &payment_body("eve", 1),
        )
        .await;
    }
    running.settled(20).await;
    drop(nats);
    server.kill();
    eventually("the consumer saw the loss", WAIT, || async {
        health.snapshot().reconnects > 0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.restart();
    eventually("the server listens again", WAIT, || async {
        tokio::net::TcpStream::connect(("127.0.0.1", server.port))
            .await
            .is_ok()
    })
    .await;
    let nats = Nats::connect_to(&url).await;
    for i in 0..20 {
        nats.publish(
            &stream,
            Some(&format!("after-{i}")),
            &[],
            &payment_body("eve", 1),
        )
        .await;
    }
    // Acks the server had not written when it died come back as
    // duplicates: wait for the payments, not for a count of settlements.
    eventually("40 payments applied", WAIT, || async {
        db.payments().await >= 40
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(db.payments().await, 40, "each payment applied once");
    assert_eq!(doubled(&db).await, 0);
    assert_eq!(db.balances().await["eve"], 40);
    running.stop().await;
}

#[tokio::test]
async fn a_relay_that_dies_between_publish_and_mark_is_deduplicated_by_jetstream() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("relay");
    nats.track(&stream);
    const N: usize = 20;
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..N {
        let message = idempo::outbox::OutboxMessage::new("", &stream, format!("ship-{i}"))
            .message_id(format!("ship-{i}"))
            .transport("nats");
        idempo::outbox::stage(&mut *tx, message).await.unwrap();
    }
    tx.commit().await.unwrap();
    // The relay's first mark fails after the publish, as a relay killed
    // between the two: its batch rolls back, the rows stay pending.
    sqlx::raw_sql(
        // A sequence: the exception does not roll its count back.
        "CREATE SEQUENCE marks; \
         CREATE FUNCTION fail_first_mark() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
           IF nextval('marks') = 1 THEN \
             RAISE EXCEPTION 'the relay died before its mark'; \
           END IF; \
           RETURN OLD; \
         END $$; \
         CREATE TRIGGER fail_first_mark BEFORE DELETE ON outbox \
           FOR EACH STATEMENT EXECUTE FUNCTION fail_first_mark();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let relay =
        idempo::nats::Relay::new(support::nats::nats_url(), db.pool.clone()).create_stream(&stream);
    let stop = relay.shutdown_handle();
    let running = tokio::spawn(relay.run());
    eventually("the outbox emptied", WAIT, || async {
        db.count("SELECT count(*) FROM outbox").await == 0
    })
    .await;
    let marks: i64 = sqlx::query_scalar("SELECT last_value FROM marks")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(marks >= 2, "the first mark failed, a later one succeeded");
    let mut js_stream = nats.js.get_stream(&stream).await.unwrap();
    let info = js_stream.info().await.unwrap();
    assert_eq!(
        info.state.messages, N as u64,
        "JetStream holds each message once although the relay published the batch twice"
    );
    stop.shutdown();
    running.await.unwrap().unwrap();
    nats.cleanup().await;
}

#[tokio::test]
async fn two_chained_examples_on_jetstream_keep_equal_ledgers() {
    use support::example::{doubled_payments, spawn_example};

    support::init_tracing();
    let (a_db, b_db) = (Db::new().await, Db::new().await);
    let mut nats = Nats::connect().await;
    let (a, b) = (stream_name("chain_a"), stream_name("chain_b"));
    nats.track(&a);
    nats.track(&b);
    let url = support::nats::nats_url();
    let mut a_env = vec![
        ("PAYMENTS_TRANSPORT", "nats"),
        ("NATS_URL", url.as_str()),
        ("PAYMENTS_FAIL_RATE", "0.1"),
    ];
    let b_env = a_env.clone();
    a_env.push(("PAYMENTS_FORWARD_TO", b.as_str()));
    let _a = spawn_example(&a_db.url, &a, &a_env);
    let _b = spawn_example(&b_db.url, &b, &b_env);
    eventually("both streams exist", WAIT, || async {
        nats.js.get_stream(&a).await.is_ok() && nats.js.get_stream(&b).await.is_ok()
    })
    .await;
    const N: usize = 200;
    for i in 0..N {
        nats.publish(
            &a,
            Some(&format!("chain-{i}")),
            &[],
            &payment_body(&format!("acct-{}", i % 5), 10 + i as i64),
        )
        .await;
    }
    eventually(
        &format!("{N} payments in B's ledger"),
        Duration::from_secs(120),
        || async { b_db.payments().await as usize >= N },
    )
    .await;
    assert_eq!(a_db.payments().await as usize, N);
    assert_eq!(b_db.payments().await as usize, N);
    assert_eq!(doubled_payments(&b_db).await, 0);
    assert_eq!(a_db.balances().await, b_db.balances().await);
    nats.cleanup().await;
}

#[tokio::test]
async fn a_dead_letter_replayed_from_the_table_is_applied_once_with_its_headers_and_body() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use idempo::Tx;
    use idempo::consumer::{HandlerError, Message};

    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("replay");
    nats.track(&stream);
    let open = Arc::new(AtomicBool::new(false));
    // What each replayed delivery carried: its x-tenant header and body.
    type Seen = Vec<(Option<String>, Vec<u8>)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let (gate, record) = (open.clone(), seen.clone());
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        .handler(move |tx: Tx, message: Message| {
            let (gate, record) = (gate.clone(), record.clone());
            async move {
                if !gate.load(Ordering::SeqCst) {
                    return Err(HandlerError::permanent("the account is frozen"));
                }
                let tenant = message.header_text("x-tenant");
                record
                    .lock()
                    .unwrap()
                    .push((tenant, message.body().to_vec()));
                let payment: support::payments::Payment = message.json()?;
                support::payments::apply(tx, message.id(), &payment, 0.0).await?;
                Ok(())
            }
        })
        .build()
        .unwrap();
    let running = Running::start(consumer);
    nats.wait_for_stream(&stream).await;
    let bodies: Vec<Vec<u8>> = (0..3).map(|i| payment_body("frida", 100 + i)).collect();
    for (i, body) in bodies.iter().enumerate() {
        nats.publish(
            &stream,
            Some(&format!("r-{i}")),
            &[("x-tenant", "acme")],
            body,
        )
        .await;
    }
    running.settled(3).await;
    let live = || async {
        db.count("SELECT count(*) FROM dead_letters WHERE state = 'live'")
            .await
    };
    assert_eq!(live().await, 3, "three dead letters in the table");
    open.store(true, Ordering::SeqCst);
    // Within JetStream's duplicate window of the originals' Nats-Msg-Id.
    let out = support::cli::run(&db, &["dlq", "replay", "--queue", &stream, "--all"]);
    assert!(out.status.success(), "the replay ran");
    eventually("the replayed payments applied", WAIT, || async {
        db.payments().await == 3
    })
    .await;
    assert_eq!(live().await, 0);
    let again = support::cli::run(&db, &["dlq", "replay", "--queue", &stream, "--all"]);
    assert!(again.status.success());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(db.payments().await, 3, "each letter applied once");
    let mut seen = seen.lock().unwrap().clone();
    seen.sort_by(|a, b| a.1.cmp(&b.1));
    let expected: Vec<(Option<String>, Vec<u8>)> = bodies
        .iter()
        .map(|b| (Some("acme".to_owned()), b.clone()))
        .collect();
    assert_eq!(seen, expected, "each replay kept its header and its body");
    running.stop().await;
    nats.cleanup().await;
}

#[tokio::test]
async fn a_message_delivered_far_past_its_attempts_is_dead_lettered_before_its_handler_runs() {
    use idempo::consumer::RedeliveryPolicy;

    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("crashing");
    nats.track(&stream);
    let js_stream = nats
        .js
        .create_stream(idempo::nats::async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![stream.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    nats.publish(&stream, Some("crash-1"), &[], &payment_body("kay", 1))
        .await;
    // Six deliveries that ended without an outcome, as if the process
    // handling it had died each time.
    deliver_without_outcome(&js_stream, &stream, 6).await;
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        .redelivery(RedeliveryPolicy::delayed([Duration::from_millis(100)]).max_attempts(3))
        .handler(
            move |_tx: idempo::Tx, _message: idempo::consumer::Message| {
                let runs = counted.clone();
                async move {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Ok(())
                }
            },
        )
        .build()
        .unwrap();
    let running = Running::start(consumer);
    running.settled(1).await;
    let (reason, error): (String, String) = sqlx::query_as(
        "SELECT reason, error FROM dead_letters WHERE queue = $1 AND message_id = 'crash-1'",
    )
    .bind(&stream)
    .fetch_one(&db.pool)
    .await
    .expect("its dead letter");
    assert_eq!(reason, "max attempts exceeded");
    assert!(error.contains("without an outcome"), "{error}");
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the handler did not run again"
    );
    running.stop().await;
    nats.cleanup().await;
}

/// A hand-made client on the durable consumer idempo uses (created here
/// when missing) takes `times` deliveries of the stream's first message and
/// hands each back at once, as a process that died handling it would.
async fn deliver_without_outcome(
    js_stream: &idempo::nats::async_nats::jetstream::stream::Stream,
    durable_name: &str,
    times: i64,
) {
    use futures::StreamExt;
    use idempo::nats::async_nats::jetstream::{AckKind, consumer::pull};

    let durable: idempo::nats::async_nats::jetstream::consumer::PullConsumer = js_stream
        .get_or_create_consumer(
            durable_name,
            pull::Config {
                durable_name: Some(durable_name.to_owned()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let mut delivered = 0;
    while delivered < times {
        let mut batch = durable
            .fetch()
            .max_messages(1)
            .expires(Duration::from_secs(2))
            .messages()
            .await
            .unwrap();
        if let Some(Ok(message)) = batch.next().await {
            delivered = message.info().unwrap().delivered;
            message.ack_with(AckKind::Nak(None)).await.unwrap();
        }
    }
}

/// Issue 51 (5): a copy delivered too often (as when an outage held its
/// first delivery past the ack wait) of a message that was applied is a
/// duplicate, never also a dead letter.
#[tokio::test]
async fn a_message_applied_then_delivered_far_past_its_attempts_is_a_duplicate_not_a_letter() {
    use idempo::consumer::RedeliveryPolicy;

    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("applied_crashing");
    nats.track(&stream);
    let js_stream = nats
        .js
        .create_stream(idempo::nats::async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![stream.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    nats.publish(&stream, Some("applied-1"), &[], &payment_body("kay", 1))
        .await;
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let build = |runs: Arc<std::sync::atomic::AtomicUsize>| {
        Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(&stream)
            .redelivery(RedeliveryPolicy::delayed([Duration::from_millis(100)]).max_attempts(1))
            .handler(
                move |_tx: idempo::Tx, _message: idempo::consumer::Message| {
                    let runs = runs.clone();
                    async move {
                        runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        Ok(())
                    }
                },
            )
            .build()
            .unwrap()
    };
    let running = Running::start(build(runs.clone()));
    running.settled(1).await;
    assert_eq!(running.stats.snapshot().processed, 1);
    running.stop().await;
    // The durable lost (deleted, or its acks never reached the server):
    // the applied message comes again, and is handed back three times.
    js_stream.delete_consumer(&stream).await.unwrap();
    deliver_without_outcome(&js_stream, &stream, 3).await;

    let running = Running::start(build(runs.clone()));
    running.settled(1).await;
    let stats = running.stats.snapshot();
    assert_eq!((stats.duplicates, stats.dead_lettered), (1, 0), "{stats:?}");
    let letters: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE queue = $1")
        .bind(&stream)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(letters, 0, "an applied message is no dead letter");
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "applied once"
    );
    eventually("the copy acknowledged", WAIT, || async {
        nats.unacknowledged(&stream, &stream).await == 0
    })
    .await;
    running.stop().await;
    nats.cleanup().await;
}

#[tokio::test]
async fn a_row_no_stream_takes_is_failed_with_the_servers_reason_while_other_keys_flow() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("flow");
    nats.track(&stream);
    let nowhere = stream_name("nowhere");
    let mut tx = db.pool.begin().await.unwrap();
    let bad = [
        idempo::outbox::OutboxMessage::new("", &nowhere, "lost?")
            .message_id("unstreamed")
            .ordering_key("bad")
            .transport("nats"),
        // Same key, behind the refused row: goes out once it is given up.
        idempo::outbox::OutboxMessage::new("", &stream, "behind")
            .message_id("behind-bad")
            .ordering_key("bad")
            .transport("nats"),
    ];
    idempo::outbox::stage_all(&mut *tx, bad).await.unwrap();
    for i in 0..10 {
        let message = idempo::outbox::OutboxMessage::new("", &stream, format!("good-{i}"))
            .message_id(format!("good-{i}"))
            .ordering_key("good")
            .transport("nats");
        idempo::outbox::stage(&mut *tx, message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let relay = idempo::nats::Relay::new(support::nats::nats_url(), db.pool.clone())
        .create_stream(&stream)
        .max_attempts(3)
        // Seconds between attempts: the row behind the refused one must wait
        // for it, also within the first batch, which picks both.
        .retry_backoff(Duration::from_secs(1), Duration::from_secs(2));
    let health = relay.health();
    let stop = relay.shutdown_handle();
    let running = tokio::spawn(relay.run());
    eventually("the other key's ten rows are published", WAIT, || {
        let (js, stream) = (nats.js.clone(), stream.clone());
        async move {
            match js.get_stream(&stream).await {
                Ok(mut s) => s.info().await.is_ok_and(|i| i.state.messages >= 10),
                Err(_) => false,
            }
        }
    })
    .await;
    let mut js_stream = nats.js.get_stream(&stream).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let attempts: i32 = sqlx::query_scalar(
        "SELECT attempts FROM outbox WHERE message_id = 'unstreamed' AND state = 'pending'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the refused row is still pending, waiting for its next attempt");
    assert!(attempts >= 1, "the refused row was tried: {attempts}");
    assert_eq!(
        js_stream.info().await.unwrap().state.messages,
        10,
        "the row behind the refused one, on the same ordering key, is held (not published in the same batch)"
    );
    eventually("the refused row is failed", WAIT, || async {
        idempo::outbox::OutboxStatus::read(&db.pool)
            .await
            .unwrap()
            .failed
            == 1
    })
    .await;
    let failed = idempo::outbox::FailedMessage::list(&db.pool, 10)
        .await
        .unwrap();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(
        (failed[0].message_id.as_str(), failed[0].attempts),
        ("unstreamed", 3)
    );
    let reason = failed[0].last_error.as_deref().unwrap_or("");
    assert!(
        reason.contains(&nowhere),
        "the reason names the subject: {reason}"
    );
    eventually("the rest is published", WAIT, || async {
        db.count("SELECT count(*) FROM outbox WHERE state = 'pending'")
            .await
            == 0
    })
    .await;
    let info = js_stream.info().await.unwrap();
    assert_eq!(
        info.state.messages, 11,
        "ten good rows and the one behind the refused"
    );
    assert!(
        health.snapshot().failed >= 1,
        "the relay's health counts what it gave up: {:?}",
        health.snapshot()
    );
    stop.shutdown();
    running.await.unwrap().unwrap();
    nats.cleanup().await;
}
