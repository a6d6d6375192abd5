//! JetStream failover: a three-node cluster of the test's own
//! (`scripts/nats-cluster.sh`), a stream with three replicas, two competing
//! consumers draining thousands of payments; the stream leader's node is
//! stopped mid-way. Progress resumes within 10 s, and every payment is
//! applied once.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempo::nats::Consumer;
use idempo::nats::async_nats::jetstream::stream;
use support::nats::{Nats, Running, recording, stream_name};
use support::{Db, eventually, payment_body};

/// The tests here share one cluster and stop its nodes: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn cluster(args: &[&str]) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/nats-cluster.sh");
    let out = std::process::Command::new(script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    assert!(
        out.status.success(),
        "scripts/nats-cluster.sh {args:?} failed (it needs nats-server: apt-get install \
         nats-server): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Starts the stopped node again when the test ends, passed or not.
struct Restart(Option<String>);

impl Drop for Restart {
    fn drop(&mut self) {
        if let Some(node) = self.0.take() {
            cluster(&["start-node", &node]);
        }
    }
}

#[tokio::test]
async fn stopping_the_stream_leaders_node_stalls_the_drain_for_under_10_s_and_loses_nothing() {
    support::init_tracing();
    let _one = ONE_AT_A_TIME.lock().await;
    cluster(&["start"]);
    let urls = cluster(&["urls"]);
    let db = Db::new().await;
    let mut nats = Nats::connect_to(&urls).await;
    let name = stream_name("failover");
    nats.track(&name);
    // Three replicas: the stream survives the loss of any one node.
    let mut created = None;
    for _ in 0..50 {
        match nats
            .js
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![name.clone()],
                num_replicas: 3,
                ..Default::default()
            })
            .await
        {
            Ok(s) => {
                created = Some(s);
                break;
            }
            // The cluster may still be electing its meta leader.
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    let mut js_stream = created.expect("the replicated stream");
    let consumers: Vec<Running> = (0..2)
        .map(|_| {
            Running::start(
                Consumer::builder(urls.clone(), db.pool.clone())
                    .stream(&name)
                    .prefetch(50)
                    .concurrency(4)
                    .ack_wait(Duration::from_secs(5))
                    .handler(recording(Arc::default(), false))
                    .build()
                    .unwrap(),
            )
        })
        .collect();
    const N: usize = 2000;
    let mut acks = Vec::with_capacity(N);
    for i in 0..N {
        let mut headers = idempo::nats::async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("fo-{i}").as_str());
        let ack = nats
            .js
            .publish_with_headers(name.clone(), headers, payment_body("hal", 1).into())
            .await
            .expect("publish");
        acks.push(ack);
    }
    for ack in acks {
        ack.await.expect("PubAck");
    }
    eventually("a quarter applied", Duration::from_secs(60), || async {
        db.payments().await as usize >= N / 4
    })
    .await;
    let info = js_stream.info().await.expect("stream info");
    let leader = info
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone())
        .expect("the stream has a leader");
    let node = leader.trim_start_matches('n').to_owned();
    cluster(&["stop-node", &node]);
    let _restart = Restart(Some(node));
    let stopped = Instant::now();
    let at_stop = db.payments().await;
    // Progress: more payments applied than the consumers held when the node
    // stopped (2 × max_ack_pending 50), so new pulls were answered.
    eventually(
        "the drain resumes after the leader's node stopped",
        Duration::from_secs(60),
        || async { db.payments().await > at_stop + 150 },
    )
    .await;
    let stalled = stopped.elapsed();
    eventually(
        &format!("{N} payments applied"),
        Duration::from_secs(180),
        || async { db.payments().await as usize >= N },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(db.payments().await as usize, N, "each payment applied once");
    assert_eq!(support::example::doubled_payments(&db).await, 0);
    assert!(
        stalled < Duration::from_secs(10),
        "the drain resumed {stalled:?} after the stream leader's node stopped (target: 10 s)"
    );
    eprintln!("failover: the drain resumed {stalled:?} after the leader's node {leader} stopped");
    for consumer in consumers {
        consumer.stop().await;
    }
    nats.cleanup().await;
}

/// Starts every node again when the test ends, passed or not.
struct RestartAll(Vec<String>);

impl Drop for RestartAll {
    fn drop(&mut self) {
        for node in self.0.drain(..) {
            cluster(&["start-node", &node]);
        }
    }
}

/// A JetStream that does not answer (two of three nodes down: no quorum,
/// no leaders) is waited for at start, not taken for a conflict: the
/// consumer keeps running, says why, and consumes once the cluster is back.
/// (A timeout while a leader was elected used to end the consumer with
/// `ConsumerConflict { reason: "timed out" }`.)
#[tokio::test]
async fn a_consumer_started_while_jetstream_has_no_quorum_waits_for_it() {
    support::init_tracing();
    let _one = ONE_AT_A_TIME.lock().await;
    cluster(&["start"]);
    let urls = cluster(&["urls"]);
    let db = Db::new().await;
    let mut nats = Nats::connect_to(&urls).await;
    let name = stream_name("quorum");
    nats.track(&name);
    let mut created = false;
    for _ in 0..50 {
        let config = stream::Config {
            name: name.clone(),
            subjects: vec![name.clone()],
            num_replicas: 3,
            ..Default::default()
        };
        if nats.js.create_stream(config).await.is_ok() {
            created = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(created, "the replicated stream");
    cluster(&["stop-node", "2"]);
    cluster(&["stop-node", "3"]);
    let restart = RestartAll(vec!["2".into(), "3".into()]);
    let running = Running::start(
        Consumer::builder("nats://127.0.0.1:14221", db.pool.clone())
            .stream(&name)
            .handler(recording(Arc::default(), false))
            .build()
            .unwrap(),
    );
    // Waited for, not a conflict: the consumer goes on and says why.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let error = running.health.snapshot().last_error;
        if error
            .as_deref()
            .is_some_and(|e| e.contains("JetStream did not answer"))
        {
            break;
        }
        assert!(
            !running.task.is_finished(),
            "the consumer ended without a quorum (its last error: {error:?})"
        );
        assert!(
            Instant::now() < deadline,
            "no 'JetStream did not answer' in the health report after 60 s: {error:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(restart);
    let mut headers = idempo::nats::async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "quorum-1");
    let mut published = false;
    for _ in 0..100 {
        if let Ok(ack) = nats
            .js
            .publish_with_headers(name.clone(), headers.clone(), payment_body("quo", 1).into())
            .await
            && ack.await.is_ok()
        {
            published = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(published, "published once the cluster is back");
    eventually("the payment applied", Duration::from_secs(60), || async {
        db.payments().await == 1
    })
    .await;
    running.stop().await;
    nats.cleanup().await;
}
