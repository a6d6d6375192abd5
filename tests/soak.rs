//! The soak: on each transport, a continuous load of payments (about 10 %
//! published twice with the same id) into two competing `payments`
//! examples that fail 30 % of their attempts, while one of them is
//! SIGKILLed and restarted every 5–15 s, the broker is cut about every
//! 20 s and the examples' database backends are terminated about every
//! 15 s. Once the load and the chaos stop, every payment must be applied
//! exactly once or be in the dead-letter table (never both, never neither),
//! the queue or stream must hold nothing ready or unacknowledged, and the
//! outbox nothing pending or failed; the forward destination must hold each
//! applied payment, by id.
//!
//! `IDEMPO_SOAK_SECS` (default 30, what the suite runs) sets how long the
//! load and the chaos last; the issue's soak is half an hour per transport:
//!
//! ```text
//! IDEMPO_SOAK_SECS=1800 cargo test --release --all-features --test soak -- --test-threads=1 --nocapture
//! ```
//!
//! Each test prints a one-line summary and keeps it in
//! `$CARGO_TARGET_TMPDIR/soak-figures-<transport>.txt`; the examples' logs
//! stay in `target/tmp/soak-<queue>/` when a soak fails.

mod support;

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::soak::{self, Workers};
use support::{Broker, Db, eventually, unique};

/// The soak's own schema, with a pool of [`soak::TEST_POOL`]: with the two
/// examples' pools, within the suite's connection budget.
async fn soak_db() -> Db {
    let db = Db::with_pool_size(soak::TEST_POOL).await;
    idempo::migrate(&db.pool).await.expect("idempo::migrate");
    support::payments::create_tables(&db.pool)
        .await
        .expect("create the payments tables");
    db
}

/// Fails the test with the summary, every problem found, and where the
/// examples' logs are; removes the logs of a passing soak.
fn conclude(summary: &str, problems: &[String], workers: &Workers) {
    println!("{summary}");
    if problems.is_empty() {
        workers.remove_logs();
        return;
    }
    panic!(
        "{summary}\n\nthe soak found {} problem(s):\n- {}\n\nthe examples' logs: {}\ntheir last lines:\n{}",
        problems.len(),
        problems.join("\n- "),
        workers.logs.display(),
        workers.log_tail(40)
    );
}

/// The suite's backstop policy deletes test queues idle for 5 minutes, and
/// a queue that is only published to (the forward queue, once the chaos no
/// longer restarts the examples that declare it) counts as idle: a half-hour
/// soak lost its forwards so. The soak's queues get a policy of their own
/// (a higher priority wins), expiring after two idle hours.
fn keep_soak_queues() {
    let out = support::rabbitmqctl()
        .args([
            "set_policy",
            "idempo-soak-expiry",
            &format!("^{}soak", support::TEST_PREFIX),
            r#"{"expires":7200000}"#,
            "--priority",
            "1",
            "--apply-to",
            "queues",
        ])
        .output()
        .expect("run rabbitmqctl set_policy");
    assert!(
        out.status.success(),
        "rabbitmqctl set_policy failed: {out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soak_on_rabbitmq_applies_every_payment_once_or_letters_it() {
    use soak::amqp::{CloseConnections, Management, Publisher, drain};

    support::init_tracing();
    let soaked = soak::duration();
    let (mut rng, seed) = soak::rng();
    // Built before anything waits on it (a first build takes minutes).
    support::payments_example_binary();
    let db = soak_db().await;
    let broker = Broker::connect().await;
    let management = Management::connect().await;
    keep_soak_queues();
    let queue = unique("soak");
    let forward = format!("{queue}.fwd");
    let delay_queues = ["200ms", "1s", "2s"].map(|d| format!("{queue}.retry.{d}"));
    let dlq = format!("{queue}.dlq");
    // Deleted when `broker` is dropped, also when the soak fails.
    for name in [&queue, &dlq, &forward, &format!("{forward}.dlq")]
        .into_iter()
        .chain(&delay_queues)
    {
        broker.track_one(name);
    }
    // The examples' backends carry this name, so the chaos can terminate them.
    let app = unique("app");
    let url = format!("{}&application_name={app}", db.url);
    let mut workers = Workers::start(&url, &queue, &[("PAYMENTS_FORWARD_TO", &forward)]);
    eventually(
        "both examples consume the queue",
        Duration::from_secs(60),
        || async {
            management
                .queue(&queue)
                .await
                .is_some_and(|q| q.consumers >= 2)
                && broker.exists(&forward).await
        },
    )
    .await;

    let stop = AtomicBool::new(false);
    let mut publisher = Publisher::new(&queue);
    let mut publish_rng = StdRng::seed_from_u64(rng.random());
    let mut cut = CloseConnections {
        management: &management,
        queue: &queue,
    };
    let until = Instant::now() + soaked;
    // Half the duplicates right behind the original, half 0.5–5 s later.
    let duplicate_delay = |rng: &mut StdRng| {
        if rng.random_bool(0.5) {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(rng.random_range(0.5..5.0))
        }
    };
    let (ledger, chaos) = tokio::join!(
        soak::publish_until(&mut publisher, &stop, &mut publish_rng, duplicate_delay),
        soak::chaos(until, &stop, &mut workers, &mut cut, &db, &app, &mut rng),
    );
    drop(publisher);

    // Settled: every payment applied or lettered, nothing pending in the
    // outbox, and nothing in the work, delay or dead-letter queues.
    let watched: Vec<&String> = [&queue, &dlq].into_iter().chain(&delay_queues).collect();
    let queues_state = || async {
        let mut empty = broker.ready(&queue).await == 0;
        let mut seen = Vec::new();
        for name in &watched {
            let counts = management.queue(name).await;
            if let Some(c) = counts {
                empty &= c.messages == 0 && c.unacked == 0;
            } else if *name == &queue {
                empty = false;
            }
            seen.push(format!("{name}: {counts:?}"));
        }
        (empty, seen.join(", "))
    };
    let settled = soak::settle(
        &db,
        &queue,
        &ledger,
        soak::settle_bound(Duration::ZERO),
        queues_state,
    )
    .await;
    // One more sample of the management API's counts (refreshed every 5 s).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (queues_empty, queues_seen) = queues_state().await;
    workers.check().await;
    let mut problems: Vec<String> = workers.crashes.clone();
    problems.extend(workers.stop().await);
    if let Err(e) = &settled {
        problems.push(e.clone());
    }
    if !queues_empty {
        problems.push(format!(
            "the queues are not empty (ready or unacked) after the settling: {queues_seen}"
        ));
    }
    let in_forward = broker.ready(&forward).await;
    let forwarded = drain(&broker, &forward, in_forward).await;
    let (outcome, found) = soak::verdict(&db, &queue, &ledger, Some(&forwarded)).await;
    problems.extend(found);
    let summary = soak::summary(
        "rabbitmq",
        soaked,
        seed,
        &ledger,
        &outcome,
        Some(&forwarded),
        &chaos,
        settled.ok(),
    );
    // Whatever else the examples declared under the queue's name.
    for name in management.queues(&queue).await {
        broker.track_one(&name);
    }
    conclude(&summary, &problems, &workers);
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soak_on_jetstream_applies_every_payment_once_or_letters_it() {
    use idempo::nats::async_nats::jetstream::stream;
    use soak::nats::{Publisher, Restart, consumer_counts, listening, read_all};
    use support::nats::{Nats, OwnServer, stream_name};

    support::init_tracing();
    let soaked = soak::duration();
    let (mut rng, seed) = soak::rng();
    support::payments_example_binary();
    let db = soak_db().await;
    // A server of the soak's own, so that it can be killed and restarted.
    let mut server = OwnServer::start();
    listening(&server).await;
    let nats_url = server.url();
    let nats = Nats::connect_to(&nats_url).await;
    let name = stream_name("soak");
    let forward = stream_name("soak_fwd");
    // A duplicate window of 2 s (JetStream's default is 2 min): a second
    // copy published later is not dropped by JetStream, so it reaches the
    // examples, which must claim it as a duplicate.
    const WINDOW: Duration = Duration::from_secs(2);
    nats.js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![name.clone()],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            duplicate_window: WINDOW,
            ..Default::default()
        })
        .await
        .expect("create the soak's stream");
    let app = unique("app");
    let url = format!("{}&application_name={app}", db.url);
    let mut workers = Workers::start(
        &url,
        &name,
        &[
            ("PAYMENTS_TRANSPORT", "nats"),
            ("NATS_URL", &nats_url),
            ("PAYMENTS_FORWARD_TO", &forward),
        ],
    );
    // The examples' durable consumer is named after the stream (their
    // relays create the forward stream with the first forward).
    eventually(
        "the examples' durable consumer exists",
        Duration::from_secs(60),
        || async { consumer_counts(&nats.js, &name, &name).await.is_ok() },
    )
    .await;

    let stop = AtomicBool::new(false);
    let mut publisher = Publisher {
        js: nats.js.clone(),
        subject: name.clone(),
    };
    let mut publish_rng = StdRng::seed_from_u64(rng.random());
    let mut cut = Restart {
        server: &mut server,
        rng: StdRng::seed_from_u64(rng.random()),
    };
    let until = Instant::now() + soaked;
    // Every second copy after the window: JetStream passes it on.
    let duplicate_delay =
        |rng: &mut StdRng| WINDOW + Duration::from_secs_f64(rng.random_range(0.5..3.0));
    let (ledger, chaos) = tokio::join!(
        soak::publish_until(&mut publisher, &stop, &mut publish_rng, duplicate_delay),
        soak::chaos(until, &stop, &mut workers, &mut cut, &db, &app, &mut rng),
    );

    let consumer_state = || async {
        match consumer_counts(&nats.js, &name, &name).await {
            Ok((pending, ack_pending, redelivered)) => (
                pending == 0 && ack_pending == 0,
                format!(
                    "consumer {name}: {pending} pending, {ack_pending} unacknowledged, \
                     {redelivered} redelivered"
                ),
            ),
            Err(e) => (false, format!("consumer {name} unreadable: {e}")),
        }
    };
    // What a last kill left in flight comes back after the ack wait (30 s).
    let settled = soak::settle(
        &db,
        &name,
        &ledger,
        soak::settle_bound(Duration::from_secs(30)),
        consumer_state,
    )
    .await;
    let (consumer_empty, consumer_seen) = consumer_state().await;
    workers.check().await;
    let mut problems: Vec<String> = workers.crashes.clone();
    problems.extend(workers.stop().await);
    if let Err(e) = &settled {
        problems.push(e.clone());
    }
    if !consumer_empty {
        problems.push(format!(
            "the stream's consumer is not drained after the settling: {consumer_seen}"
        ));
    }
    let forwarded = read_all(&nats.js, &forward).await;
    let (outcome, found) = soak::verdict(&db, &name, &ledger, Some(&forwarded)).await;
    problems.extend(found);
    // The relay publishes with the row's id as Nats-Msg-Id: a resend after a
    // kill falls within the stream's 2-minute window and is dropped.
    let extra = soak::extra_copies(&forwarded);
    if extra > 0 {
        problems.push(format!(
            "the forward stream holds {extra} extra copies (JetStream's window should drop a resend)"
        ));
    }
    let summary = soak::summary(
        "jetstream",
        soaked,
        seed,
        &ledger,
        &outcome,
        Some(&forwarded),
        &chaos,
        settled.ok(),
    );
    conclude(&summary, &problems, &workers);
}
