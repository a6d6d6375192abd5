//! The `payments` example as a real process: killed mid-load and restarted,
//! or stopped with SIGTERM under load. Every payment must be applied exactly
//! once (or still be waiting in the queue).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::{Broker, Db, eventually, unique};

const WAIT: Duration = Duration::from_secs(120);

struct Load {
    ids: BTreeSet<String>,
    expected: BTreeMap<String, i64>,
    published: usize,
}

/// Publishes `unique_payments` payments over 8 accounts; with `duplicates`,
/// every 5th one twice.
async fn publish_load(
    broker: &Broker,
    queue: &str,
    unique_payments: usize,
    duplicates: bool,
) -> Load {
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    let mut ids = BTreeSet::new();
    for i in 0..unique_payments {
        let id = format!("pay-{i}");
        let account = format!("acct-{}", i % 8);
        let cents = (i % 97 + 1) as i64;
        *expected.entry(account.clone()).or_default() += cents;
        let body = support::payment_body(&account, cents);
        messages.push((id.clone(), body.clone()));
        if duplicates && i % 5 == 0 {
            messages.push((id.clone(), body));
        }
        ids.insert(id);
    }
    broker.publish_many(queue, &messages).await;
    Load {
        ids,
        expected,
        published: messages.len(),
    }
}

fn spawn_example(db: &Db, queue: &str, fail_rate: f64) -> Child {
    Command::new(support::payments_example_binary())
        .env("DATABASE_URL", &db.url)
        .env("AMQP_URL", support::amqp_url())
        .env("PAYMENTS_QUEUE", queue)
        .env("PAYMENTS_FAIL_RATE", fail_rate.to_string())
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .expect("start the payments example")
}

fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
}

async fn wait_exit(mut child: Child) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the example did not exit"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn doubled_payments(db: &Db) -> i64 {
    db.count(
        "SELECT count(*) FROM (SELECT message_id FROM payments GROUP BY message_id HAVING count(*) > 1) d",
    )
    .await
}

#[tokio::test]
async fn sigkill_mid_load_then_restart_applies_every_payment_exactly_once() {
    let (db, broker, queue) = (Db::new().await, Broker::connect().await, unique("pay"));
    broker.declare(&queue).await;
    let load = publish_load(&broker, &queue, 4000, true).await;

    // First run, with transient failures after the writes, killed mid-load.
    let first = spawn_example(&db, &queue, 0.2);
    eventually("the first run applied some payments", WAIT, || async {
        db.claims().await >= 300
    })
    .await;
    signal(&first, "-KILL");
    let status = wait_exit(first).await;
    assert!(!status.success(), "SIGKILL is not a clean exit");
    let at_kill = db.claims().await as usize;
    assert!(
        at_kill < load.ids.len(),
        "the kill happened mid-load ({at_kill} applied)"
    );

    // The restart picks up the unacked and the unconsumed deliveries.
    let second = spawn_example(&db, &queue, 0.0);
    eventually(
        "every payment applied and the queue empty",
        WAIT,
        || async {
            db.claims().await as usize == load.ids.len() && broker.ready(&queue).await == 0
        },
    )
    .await;
    signal(&second, "-TERM");
    assert!(wait_exit(second).await.success(), "SIGTERM exits 0");

    assert_eq!(
        db.payments().await as usize,
        load.ids.len(),
        "one row per payment"
    );
    assert_eq!(doubled_payments(&db).await, 0, "no payment applied twice");
    assert_eq!(
        db.balances().await,
        load.expected,
        "balances add up exactly"
    );
    assert_eq!(broker.ready(&queue).await, 0);
    assert!(
        load.published > load.ids.len(),
        "the load carried duplicates"
    );
}

#[tokio::test]
async fn sigterm_under_load_exits_0_and_leaves_each_payment_applied_once_or_queued() {
    let (db, broker, queue) = (Db::new().await, Broker::connect().await, unique("pay"));
    broker.declare(&queue).await;
    // No duplicates: then a payment both applied and still queued would mean
    // committed work was handed back unacked instead of being acked.
    let load = publish_load(&broker, &queue, 4000, false).await;

    let child = spawn_example(&db, &queue, 0.0);
    eventually("the example applied some payments", WAIT, || async {
        db.claims().await >= 300
    })
    .await;
    signal(&child, "-TERM");
    let status = wait_exit(child).await;
    assert_eq!(status.code(), Some(0), "a graceful shutdown exits 0");

    let applied: BTreeSet<String> = sqlx::query_scalar("SELECT message_id FROM payments")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(doubled_payments(&db).await, 0, "nothing applied twice");
    assert_eq!(
        applied.len() as i64,
        db.claims().await,
        "claims match effects"
    );
    let queued: BTreeSet<String> = broker
        .drain(&queue)
        .await
        .into_iter()
        .map(|m| m.message_id.expect("published with an id"))
        .collect();
    assert!(!queued.is_empty(), "the shutdown happened under load");
    assert!(
        applied.is_disjoint(&queued),
        "work committed during the drain was acked, not handed back"
    );
    let accounted: BTreeSet<String> = applied.union(&queued).cloned().collect();
    assert_eq!(
        accounted, load.ids,
        "every payment is applied or still queued"
    );
}
