//! The JetStream transport on the machine's NATS server: payments applied
//! once whatever JetStream redelivers, the redelivery delays honoured,
//! poison into the dead-letter table, long handlers keeping their messages,
//! and what is refused at start.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempo::Tx;
use idempo::amqp::{HandlerError, Message};
use idempo::nats::{Consumer, MessageIdSource, NatsError, RedeliveryPolicy};
use support::nats::{Nats, stream_name};
use support::{Db, eventually, payment_body, payments};
use tokio::task::JoinHandle;

const WAIT: Duration = Duration::from_secs(30);

/// A consumer running in the background.
struct Running {
    shutdown: idempo::amqp::ShutdownHandle,
    stats: idempo::amqp::Stats,
    task: JoinHandle<idempo::Result<()>>,
}

impl Running {
    fn start(consumer: Consumer) -> Running {
        Running {
            shutdown: consumer.shutdown_handle(),
            stats: consumer.stats(),
            task: tokio::spawn(consumer.run()),
        }
    }

    async fn settled(&self, n: u64) {
        eventually(&format!("{n} deliveries settled"), WAIT, || async {
            let s = self.stats.snapshot();
            s.processed + s.duplicates + s.dead_lettered >= n
        })
        .await;
    }

    async fn stop(self) {
        self.shutdown.shutdown();
        self.task
            .await
            .expect("consumer task")
            .expect("a graceful stop");
    }
}

/// The payments example's handler, recording when each id's attempts ran.
fn recording(
    attempts: Arc<Mutex<HashMap<String, Vec<Instant>>>>,
    fail_first: bool,
) -> impl Fn(Tx, Message) -> futures::future::BoxFuture<'static, Result<(), HandlerError>>
+ Clone
+ Send
+ Sync
+ 'static {
    move |tx: Tx, message: Message| {
        let attempts = attempts.clone();
        Box::pin(async move {
            let payment: payments::Payment = message.json()?;
            let n = {
                let mut seen = attempts.lock().unwrap();
                let list = seen.entry(message.id().to_owned()).or_default();
                list.push(Instant::now());
                list.len()
            };
            if fail_first && n == 1 {
                return Err(HandlerError::transient("downstream unavailable"));
            }
            payments::apply(tx, message.id(), &payment, 0.0).await?;
            Ok(())
        })
    }
}

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
    eventually("the stream exists", WAIT, || async {
        nats.js.get_stream(&stream).await.is_ok()
    })
    .await;
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
    eventually("the stream exists", WAIT, || async {
        nats.js.get_stream(&stream).await.is_ok()
    })
    .await;
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
    eventually("the stream exists", WAIT, || async {
        nats.js.get_stream(&stream).await.is_ok()
    })
    .await;
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
    eventually("the stream exists", WAIT, || async {
        nats.js.get_stream(&stream).await.is_ok()
    })
    .await;
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

async fn doubled(db: &Db) -> i64 {
    support::example::doubled_payments(db).await
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
    eventually("the example created the stream", WAIT, || async {
        nats.js.get_stream(&stream).await.is_ok()
    })
    .await;
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
struct OwnServer {
    port: u16,
    store: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl OwnServer {
    fn start() -> OwnServer {
        let store = std::env::temp_dir().join(support::unique("nats-store"));
        let mut server = OwnServer {
            port: support::free_port(),
            store,
            child: None,
        };
        server.restart();
        server
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn restart(&mut self) {
        self.child = Some(
            std::process::Command::new("nats-server")
                .args([
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-js",
                    "-sd",
                ])
                .arg(&self.store)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("nats-server (apt-get install nats-server)"),
        );
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

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
    eventually("the stream exists", WAIT, || async {
        nats.js.get_stream(&stream).await.is_ok()
    })
    .await;
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
            .message_id(format!("ship-{i}"));
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
