//! The `payments` example as a child process, and the load the process
//! tests publish to it: shared by the chaos tests on one broker and on the
//! cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{Broker, Db, DeadLetter};

pub struct Load {
    pub ids: BTreeSet<String>,
    pub expected: BTreeMap<String, i64>,
    pub published: usize,
}

/// Publishes `unique_payments` payments over 8 accounts; with `duplicates`,
/// every 5th one twice.
pub async fn publish_load(
    broker: &Broker,
    queue: &str,
    unique_payments: usize,
    duplicates: bool,
) -> Load {
    // The example must be built before a load waits in its queue: a build
    // that outlasts the test queues' idle expiry (a 5-minute broker policy)
    // would delete the queue, load and all, before the example consumes it.
    // Callers build it before they declare; this catches one that did not.
    super::payments_example_binary();
    let mut load = Load {
        ids: BTreeSet::new(),
        expected: BTreeMap::new(),
        published: 0,
    };
    load.publish(broker, queue, 0..unique_payments, duplicates)
        .await;
    load
}

impl Load {
    /// Publishes the payments numbered `range` and adds them to the load.
    pub async fn publish(
        &mut self,
        broker: &Broker,
        queue: &str,
        range: std::ops::Range<usize>,
        duplicates: bool,
    ) {
        let messages = self.add(range, duplicates);
        broker.publish_many(queue, &messages).await;
    }

    /// Adds the payments numbered `range` to the load (every 5th twice with
    /// `duplicates`) and returns the messages to publish.
    pub fn add(
        &mut self,
        range: std::ops::Range<usize>,
        duplicates: bool,
    ) -> Vec<(String, Vec<u8>)> {
        let mut messages = Vec::new();
        for i in range {
            let id = format!("pay-{i}");
            let account = format!("acct-{}", i % 8);
            let cents = (i % 97 + 1) as i64;
            *self.expected.entry(account.clone()).or_default() += cents;
            let body = super::payment_body(&account, cents);
            messages.push((id.clone(), body.clone()));
            if duplicates && i % 5 == 0 {
                messages.push((id.clone(), body));
            }
            self.ids.insert(id);
        }
        self.published += messages.len();
        messages
    }
}

/// Starts the example on `queue` and `database_url`, retrying after
/// 50 ms (the tests' delay queue), with `env` on top (`AMQP_URL` among them
/// replaces the standard broker's).
pub fn spawn_example(database_url: &str, queue: &str, env: &[(&str, &str)]) -> Example {
    spawn_example_to(database_url, queue, env, Stdio::null())
}

/// [`spawn_example`], with its log (stdout) going to `log`.
pub fn spawn_example_to(
    database_url: &str,
    queue: &str,
    env: &[(&str, &str)],
    log: impl Into<Stdio>,
) -> Example {
    let mut command = Command::new(super::payments_example_binary());
    command
        .env("DATABASE_URL", database_url)
        .env("AMQP_URL", super::amqp_url())
        .env("PAYMENTS_QUEUE", queue)
        .env(
            "PAYMENTS_RETRY_DELAYS",
            format!("{}ms", super::RETRY_DELAY.as_millis()),
        )
        .env("RUST_LOG", "error")
        // Within the suite's connection budget: a pool of 6.
        .env("PAYMENTS_CONCURRENCY", "4")
        .stdout(log.into());
    for (name, value) in env {
        command.env(name, value);
    }
    Example(command.spawn().expect("start the payments example"))
}

/// The example process; killed if the test ends (or fails) while it runs.
pub struct Example(Child);

impl Drop for Example {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl Example {
    pub fn id(&self) -> u32 {
        self.0.id()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

pub fn signal(child: &Example, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
}

pub async fn wait_exit(mut child: Example) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the example did not exit"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn doubled_payments(db: &Db) -> i64 {
    db.count(
        "SELECT count(*) FROM (SELECT message_id FROM payments GROUP BY message_id HAVING count(*) > 1) d",
    )
    .await
}

/// What the chaos test publishes besides the payments: poison of every kind.
pub const POISON_EACH: usize = 15;

/// Reads `http://addr/metrics` with a bare HTTP/1.0 request.
pub async fn scrape(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("metrics endpoint");
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
}

pub fn metric(scraped: &str, name: &str) -> f64 {
    scraped
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Publishes poison of every kind, [`POISON_EACH`] of each: undecodable JSON,
/// a negative amount (a permanent handler error), an id reused with another
/// payload, no id. Adds the reused ids' effects to `load` (whichever copy
/// comes first is applied) and returns how many messages it published; the
/// load's ids then apply `POISON_EACH` more.
pub async fn publish_poison(broker: &Broker, queue: &str, load: &mut Load) -> usize {
    let mut poison = Vec::new();
    for k in 0..POISON_EACH {
        poison.push((format!("poison-json-{k}"), b"{not json".to_vec()));
        poison.push((
            format!("poison-negative-{k}"),
            super::payment_body("neg", -1),
        ));
        // Same id twice with different bodies but the same effect.
        for note in ["a", "b"] {
            let body = serde_json::json!({"account": "reuse", "amount_cents": 1, "note": note});
            poison.push((
                format!("poison-reuse-{k}"),
                serde_json::to_vec(&body).unwrap(),
            ));
        }
    }
    broker.publish_many(queue, &poison).await;
    for k in 0..POISON_EACH {
        let body = super::payment_body(&format!("noid-{k}"), 1);
        broker.publish(queue, None, &body).await;
    }
    *load.expected.entry("reuse".into()).or_default() += POISON_EACH as i64;
    poison.len() + POISON_EACH
}

/// Asserts every poison message of [`publish_poison`] is in `dead` with its
/// reason; returns how many extra copies there are (kills between the
/// dead-letter publish and the ack leave some).
pub fn assert_poison_dead_lettered(dead: &[DeadLetter]) -> usize {
    let mut by_reason: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for d in dead {
        let key = d
            .message_id
            .clone()
            .unwrap_or_else(|| String::from_utf8_lossy(&d.body).into_owned());
        by_reason.entry(d.reason()).or_default().insert(key);
    }
    let count = |reason: &str| by_reason.get(reason).map_or(0, BTreeSet::len);
    assert_eq!(count("undecodable body"), POISON_EACH, "{by_reason:?}");
    assert_eq!(
        count("permanent handler error"),
        POISON_EACH,
        "{by_reason:?}"
    );
    assert_eq!(
        count("message id reused with a different payload"),
        POISON_EACH
    );
    assert_eq!(count("missing message id"), POISON_EACH);
    let distinct: usize = by_reason.values().map(BTreeSet::len).sum();
    dead.len() - distinct
}

/// Declares `queue` and publishes `n` payments and `poison` negative ones
/// (`neg-0`, …), which no retry can apply.
pub async fn publish_with_poison(broker: &Broker, queue: &str, n: usize, poison: usize) -> Load {
    broker.declare(queue).await;
    let mut load = Load {
        ids: Default::default(),
        expected: Default::default(),
        published: 0,
    };
    load.publish(broker, queue, 0..n, false).await;
    for k in 0..poison {
        broker
            .publish(
                queue,
                Some(&format!("neg-{k}")),
                &super::payment_body("neg", -1),
            )
            .await;
    }
    load
}

/// The live dead letters in the table store of `db`.
pub async fn live_letters(db: &Db) -> i64 {
    db.count("SELECT count(*) FROM dead_letters WHERE state = 'live'")
        .await
}

/// Declares `queue`, publishes `n` payments and `poison` negative ones, and
/// runs the example with every attempt failing (2 attempts) and its dead
/// letters kept in the table, until the table holds them all.
pub async fn fill_dead_letter_table(
    db: &Db,
    broker: &Broker,
    queue: &str,
    n: usize,
    poison: usize,
) -> Load {
    let load = publish_with_poison(broker, queue, n, poison).await;
    let failing = spawn_example(
        &db.url,
        queue,
        &[
            ("PAYMENTS_FAIL_RATE", "1"),
            ("PAYMENTS_MAX_ATTEMPTS", "2"),
            ("PAYMENTS_DEAD_LETTERS", "table"),
        ],
    );
    let all = (n + poison) as i64;
    super::eventually(
        &format!("{all} dead letters in the table"),
        Duration::from_secs(90),
        || async { live_letters(db).await == all },
    )
    .await;
    drop(failing);
    load
}
