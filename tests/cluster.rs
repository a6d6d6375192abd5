//! Failover on a real three-node RabbitMQ cluster (`scripts/rabbitmq-cluster.sh
//! start`; `.ci/run` starts it): three `payments` processes, each given all
//! three node addresses, on one quorum queue replicated on every node. While
//! payments, duplicates and poison flow, the node holding the queue's leader
//! is stopped, started again, then the new leader's node is stopped; consumers
//! are SIGKILLed in between. Every payment must be applied exactly once,
//! every poison message dead-lettered, every process still running, and
//! SIGTERM must still exit 0.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use support::example::{
    Example, Load, POISON_EACH, assert_poison_dead_lettered, doubled_payments, metric,
    publish_load, publish_poison, scrape, signal, spawn_example_to, wait_exit,
};
use support::{Broker, Db, cluster, eventually, eventually_showing, unique};

const WAIT: Duration = Duration::from_secs(180);

/// Payments the load must reach at least, all unique.
const MIN_PAYMENTS: usize = 5_000;

/// Restarts, when dropped (also when the test failed), every node it stopped:
/// the next run finds the cluster whole.
struct Nodes {
    stopped: Vec<usize>,
}

impl Nodes {
    fn running(&self) -> Vec<usize> {
        (1..=3).filter(|n| !self.stopped.contains(n)).collect()
    }

    fn stop(&mut self, n: usize) -> Duration {
        let started = Instant::now();
        cluster::stop_node(n);
        self.stopped.push(n);
        started.elapsed()
    }

    fn start(&mut self, n: usize) {
        cluster::start_node(n);
        self.stopped.retain(|&s| s != n);
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for n in std::mem::take(&mut self.stopped) {
            cluster::start_node(n);
        }
    }
}

/// Publishes payments in batches of 50 while the nodes come and go, through
/// the node in `node` (switched by the test before it stops a node); a batch
/// whose confirms are lost with its node is published again elsewhere (its
/// copies are duplicates, which the consumers must absorb).
struct Publisher {
    node: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<usize>,
}

impl Publisher {
    fn start(queue: String, load: Arc<Mutex<Load>>, first: usize, node: usize) -> Publisher {
        let current = Arc::new(AtomicUsize::new(node));
        let stop = Arc::new(AtomicBool::new(false));
        let (at, stopping) = (current.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut next = first;
            let mut republished = 0;
            let mut channel = None;
            let mut on = 0;
            while !stopping.load(Ordering::SeqCst) || next < MIN_PAYMENTS {
                let messages = load.lock().unwrap().add(next..next + 50, true);
                next += 50;
                loop {
                    let wanted = at.load(Ordering::SeqCst);
                    if channel.is_none() || on != wanted {
                        channel = open(wanted).await;
                        on = wanted;
                    }
                    match publish_batch(channel.as_ref(), &queue, &messages).await {
                        Ok(()) => break,
                        Err(e) => {
                            eprintln!("publisher: batch lost on node {on} ({e}); again");
                            republished += 1;
                            channel = None;
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            eprintln!("publisher: {next} payments, {republished} batch(es) published again");
            next
        });
        Publisher {
            node: current,
            stop,
            task,
        }
    }

    fn switch_to(&self, node: usize) {
        self.node.store(node, Ordering::SeqCst);
    }

    /// Stops after at least [`MIN_PAYMENTS`]; returns how many it published.
    async fn finish(self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the publisher finishes")
            .unwrap()
    }
}

async fn open(node: usize) -> Option<(Connection, lapin::Channel)> {
    let connection = Connection::connect(&cluster::node_url(node), ConnectionProperties::default())
        .await
        .ok()?;
    let channel = connection.create_channel().await.ok()?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .ok()?;
    Some((connection, channel))
}

async fn publish_batch(
    channel: Option<&(Connection, lapin::Channel)>,
    queue: &str,
    messages: &[(String, Vec<u8>)],
) -> Result<(), String> {
    let (_, channel) = channel.ok_or("no connection")?;
    let publish = async {
        for (id, body) in messages {
            let confirmation = channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    body,
                    BasicProperties::default()
                        .with_message_id(id.as_str().into())
                        .with_delivery_mode(2),
                )
                .await
                .map_err(|e| e.to_string())?
                .await
                .map_err(|e| e.to_string())?;
            // A quorum queue electing a leader nacks publishes; a nacked (or
            // returned) message is not in the queue: the batch goes again.
            match confirmation {
                lapin::Confirmation::Ack(None) => {}
                other => return Err(format!("{id} not taken by the broker: {other:?}")),
            }
        }
        Ok::<_, String>(())
    };
    match tokio::time::timeout(Duration::from_secs(10), publish).await {
        Ok(result) => result,
        Err(_) => Err("confirms did not come within 10 s".into()),
    }
}

/// A payments process given all three addresses, starting with node `first`
/// (so that the three spread over the cluster), serving metrics on a port of
/// its own.
fn spawn_consumer(db_url: &str, queue: &str, first: usize) -> (Example, String) {
    let addresses: Vec<String> = (0..3)
        .map(|i| cluster::node_url((first - 1 + i) % 3 + 1))
        .collect();
    let metrics = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().to_string()
    };
    // Each consumer's warnings go to a file of its own: when the test fails,
    // they say which node each one was on and what it retried.
    let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "cluster-{queue}-consumer-{first}-{}.log",
        unique("run")
    ));
    let example = spawn_example_to(
        db_url,
        queue,
        &[
            ("AMQP_URL", &addresses.join(",")),
            ("PAYMENTS_FAIL_RATE", "0.1"),
            ("PAYMENTS_CONCURRENCY", "3"),
            ("METRICS_ADDR", &metrics),
            ("RUST_LOG", "warn"),
        ],
        std::fs::File::create(&log).expect("create the consumer's log"),
    );
    (example, metrics)
}

/// The reconnects a process has made so far (0 if it cannot be scraped yet).
async fn reconnects(metrics: &str) -> f64 {
    match tokio::net::TcpStream::connect(metrics).await {
        Ok(_) => metric(&scrape(metrics).await, "idempo_reconnects_total"),
        Err(_) => 0.0,
    }
}

/// Waits until `n` more payments are applied than now; returns how long it took.
async fn progress(db: &Db, n: i64, what: &str) -> Duration {
    let started = Instant::now();
    let from = db.claims().await;
    eventually(what, WAIT, || async { db.claims().await >= from + n }).await;
    started.elapsed()
}

#[tokio::test]
async fn cluster_node_stops_and_kills_leave_every_payment_applied_exactly_once() {
    support::init_tracing();
    cluster::require().await;
    // Build the example first: a build that outlasts the test queues' idle
    // expiry (5 minutes, a policy of the test broker) would delete the
    // queue with the load published into it before the consumers start.
    support::payments_example_binary();
    let started = Instant::now();
    let db = Db::new().await;
    let queue = unique("cluster");
    let mut nodes = Nodes { stopped: vec![] };
    let setup = Broker::on_cluster_node(1).await;
    setup.declare(&queue).await;
    let leader = cluster::leader_of(&queue, &[1, 2, 3]);

    // A first load and the poison, published before the consumers start.
    let mut load = publish_load(&setup, &queue, 1000, true).await;
    let poison = publish_poison(&setup, &queue, &mut load).await;
    let load = Arc::new(Mutex::new(load));
    let publisher = Publisher::start(queue.clone(), load.clone(), 1000, leader % 3 + 1);

    let mut consumers: Vec<(Example, String)> = (1..=3)
        .map(|n| spawn_consumer(&db.url, &queue, n))
        .collect();
    let mut reconnects_of_killed = 0.0;
    progress(&db, 500, "progress before the first node stop").await;

    // 1. The node with the queue's leader stops; the others carry on.
    let stop_took = nodes.stop(leader);
    let first_resume = progress(&db, 100, "progress after the leader's node stopped").await;
    let new_leader = cluster::leader_of(&queue, &nodes.running());
    assert_ne!(new_leader, leader, "a new leader was elected");

    // 2. The consumer that started on that node is killed and restarted: its
    // first address is down, it must connect to the next.
    let victim = leader - 1;
    reconnects_of_killed += reconnects(&consumers[victim].1).await;
    signal(&consumers[victim].0, "-KILL");
    let (killed, _) = std::mem::replace(
        &mut consumers[victim],
        spawn_consumer(&db.url, &queue, leader),
    );
    assert!(!wait_exit(killed).await.success());
    progress(&db, 200, "progress after the first kill").await;

    // 3. The stopped node comes back; then the new leader's node stops.
    nodes.start(leader);
    cluster::wait_member_online(&queue, leader, &nodes.running()).await;
    progress(&db, 200, "progress after the node came back").await;
    publisher.switch_to((1..=3).find(|&n| n != new_leader && n != leader).unwrap());
    let second_stop_took = nodes.stop(new_leader);
    let second_resume = progress(&db, 100, "progress after the second node stopped").await;

    // 4. Another kill, of the consumer that started on the second stopped node.
    let victim = new_leader - 1;
    reconnects_of_killed += reconnects(&consumers[victim].1).await;
    signal(&consumers[victim].0, "-KILL");
    let (killed, _) = std::mem::replace(
        &mut consumers[victim],
        spawn_consumer(&db.url, &queue, new_leader),
    );
    assert!(!wait_exit(killed).await.success());

    let published = publisher.finish().await;
    assert!(
        published >= MIN_PAYMENTS,
        "only {published} payments published"
    );
    let (expected, ids, total) = {
        let load = load.lock().unwrap();
        (load.expected.clone(), load.ids.len(), load.published)
    };
    let applied_ids = ids + POISON_EACH;

    let inspect = Broker::on_cluster_node(nodes.running()[0]).await;
    eventually_showing("every payment applied, every queue empty", WAIT, || async {
        let claims = db.claims().await as usize;
        let ready = inspect.ready(&queue).await;
        let retrying = inspect.ready(&format!("{queue}.retry.50ms")).await;
        let done = claims == applied_ids && ready == 0 && retrying == 0;
        let state = format!(
            "{claims} of {applied_ids} claimed, {ready} ready, {retrying} in the delay queue; \
             consumer logs in {}",
            env!("CARGO_TARGET_TMPDIR")
        );
        (done, state)
    })
    .await;
    let dlq = format!("{queue}.dlq");
    let mut each_node = Vec::new();
    for n in nodes.running() {
        each_node.push((n, Broker::on_cluster_node(n).await));
    }
    eventually_showing("every poison message dead-lettered", WAIT, || async {
        let dead = inspect.ready(&dlq).await as usize;
        // What each running node says, in case one member lags.
        let mut per_node = Vec::new();
        for (n, node) in &each_node {
            per_node.push(format!("node {n}: {}", node.ready(&dlq).await));
        }
        let seen = format!(
            "{dead} of {} in {dlq} ({}); consumer logs in {}",
            4 * POISON_EACH,
            per_node.join(", "),
            env!("CARGO_TARGET_TMPDIR")
        );
        (dead >= 4 * POISON_EACH, seen)
    })
    .await;

    let mut reconnects_total = reconnects_of_killed;
    for (consumer, metrics) in &mut consumers {
        assert!(consumer.is_running(), "every consumer is still running");
        reconnects_total += reconnects(metrics).await;
    }
    // Each stop closed the connections of at least one consumer.
    assert!(
        reconnects_total >= 2.0,
        "the node stops show as reconnects ({reconnects_total})"
    );
    for (consumer, _) in &consumers {
        signal(consumer, "-TERM");
    }
    for (consumer, _) in consumers {
        assert_eq!(wait_exit(consumer).await.code(), Some(0), "SIGTERM exits 0");
    }

    // Exactly once: one row per payment id, balances to the cent.
    assert_eq!(doubled_payments(&db).await, 0, "no payment applied twice");
    assert_eq!(db.payments().await as usize, applied_ids);
    assert_eq!(db.balances().await, expected);
    let dead = inspect.drain(&dlq).await;
    let extra_copies = assert_poison_dead_lettered(&dead);

    let figures = format!(
        "cluster: {total} payment messages ({ids} distinct) + {poison} poison on 3 nodes, 3 consumers; \
         node stops: {leader} (the leader's, stop took {stop_took:.1?}, processing resumed {first_resume:.1?} \
         after it) and {new_leader} (the new leader's, {second_stop_took:.1?}, resumed {second_resume:.1?}); \
         2 SIGKILLs; {reconnects_total} reconnect(s); {applied_ids} applied once each; DLQ {} messages \
         ({extra_copies} extra copies); {:.1?}",
        dead.len(),
        started.elapsed()
    );
    println!("{figures}");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("chaos-figures-cluster.txt");
    std::fs::write(&path, format!("{figures}\n")).expect("write the cluster figures");
    drop(nodes);
}
