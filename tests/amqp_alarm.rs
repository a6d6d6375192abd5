//! Shutdown while the broker is in a memory alarm. Its own test binary: the
//! alarm blocks every publishing connection on the broker, so nothing else
//! may run against it meanwhile (test binaries run one after the other).

mod support;

use std::time::{Duration, Instant};

use idempo::amqp::Relay;
use idempo::consumer::{HandlerError, Message, RedeliveryPolicy};
use idempo::outbox::{self, OutboxMessage};
use idempo::relay::RelayState;
use support::consumer::{Running, consumer_for};

/// The tests here raise and clear the one alarm: one at a time.
static ALARM: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Raises a memory alarm on the broker; clears it when dropped, also when
/// the test fails.
struct MemoryAlarm;

impl MemoryAlarm {
    fn raise() -> MemoryAlarm {
        watermark("0.0000001");
        MemoryAlarm
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        watermark("0.4");
    }
}

fn watermark(fraction: &str) {
    let out = support::rabbitmqctl()
        .args(["set_vm_memory_high_watermark", fraction])
        .output()
        .unwrap_or_else(|e| panic!("cannot run rabbitmqctl (set RABBITMQCTL): {e}"));
    assert!(
        out.status.success(),
        "rabbitmqctl set_vm_memory_high_watermark: {out:?}"
    );
}

#[tokio::test]
async fn shutdown_during_a_memory_alarm_ends_within_the_shutdown_timeout() {
    let _alone = ALARM.lock().await;
    let (db, broker, queue) = support::setup().await;
    broker.publish_payment(&queue, "pay-alarm", "yul", 1).await;
    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    let signal = started.clone();
    // Fails once the alarm is up, so that the runtime publishes its retry on
    // the consumer's connection: the broker then stops reading it.
    let handler = move |_tx: idempo::Tx, _m: Message| {
        let signal = signal.clone();
        async move {
            signal.notify_one();
            tokio::time::sleep(Duration::from_millis(500)).await;
            Err::<(), _>(HandlerError::transient("downstream down"))
        }
    };
    let shutdown_timeout = Duration::from_secs(3);
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .redelivery(RedeliveryPolicy::delayed([Duration::from_secs(60)]))
            .shutdown_timeout(shutdown_timeout)
            .handler(handler),
    );
    tokio::time::timeout(Duration::from_secs(30), started.notified())
        .await
        .expect("the handler ran");
    let alarm = MemoryAlarm::raise();
    tokio::time::sleep(Duration::from_secs(2)).await; // the retry publish is blocked now

    let asked = Instant::now();
    consumer.shutdown.shutdown();
    let stopped = tokio::time::timeout(Duration::from_secs(30), consumer.task).await;
    let took = asked.elapsed();
    drop(alarm);
    stopped
        .expect("the consumer stopped while the alarm lasted")
        .expect("no panic")
        .expect("a graceful stop returns Ok");
    assert!(
        took <= shutdown_timeout + Duration::from_secs(7),
        "shutdown took {took:?} (shutdown_timeout {shutdown_timeout:?})"
    );
    // Nothing was lost: the delivery was never acked, so it is back.
    support::eventually_ready(&broker, &queue, 1).await;
}

/// The process's metrics as Prometheus renders them.
fn metrics() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("the only recorder of this test binary")
    })
}

/// The value of the gauge `name` (without labels).
fn gauge(name: &str) -> Option<f64> {
    metrics()
        .render()
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Stages `rows` rows of `per_row` messages each for `queue`.
async fn stage(pool: &sqlx::PgPool, queue: &str, rows: usize, per_row: usize) {
    for _ in 0..rows {
        let mut tx = pool.begin().await.unwrap();
        outbox::stage_all(
            &mut tx,
            (0..per_row).map(|_| OutboxMessage::new("", queue, b"x".to_vec())),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
}

#[tokio::test]
async fn a_relay_blocked_by_a_memory_alarm_says_so_and_its_gauges_stay_true() {
    let _alone = ALARM.lock().await;
    metrics();
    let (db, broker, queue) = support::setup().await;
    let relay = Relay::new(&support::amqp_url(), db.pool.clone())
        .unwrap()
        .poll_interval(Duration::from_millis(300))
        .confirm_timeout(Duration::from_secs(3));
    let health = relay.health();
    let stop = relay.shutdown_handle();
    let task = tokio::spawn(relay.run());
    stage(&db.pool, &queue, 1, 10).await;
    support::eventually_ready(&broker, &queue, 10).await;

    let alarm = MemoryAlarm::raise();
    stage(&db.pool, &queue, 20, 100).await;
    // The relay's first publish meets the alarm: the broker blocks it.
    let blocked = tokio::time::timeout(
        Duration::from_secs(30),
        health.wait_for(|h| h.broker_blocked.is_some()),
    )
    .await
    .expect("the relay reports the blocked broker");
    assert_eq!(blocked.state, RelayState::Blocked);
    assert!(
        blocked
            .broker_blocked
            .as_deref()
            .unwrap()
            .contains("memory"),
        "{blocked:?}"
    );
    // Long enough for the confirm timeout, the idle-in-transaction bound
    // (15 s) and a few gauge refreshes.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let during = health.snapshot();
    assert_eq!(during.outbox.pending, 2000, "{during:?}");
    assert!(
        during
            .outbox
            .oldest_pending_age
            .is_some_and(|age| age >= Duration::from_secs(15)),
        "{during:?}"
    );
    assert_eq!(gauge("idempo_outbox_pending"), Some(2000.0));
    assert!(
        gauge("idempo_outbox_oldest_pending_seconds").is_some_and(|s| s >= 15.0),
        "{}",
        metrics().render()
    );
    let error = during.last_error.clone().unwrap_or_default();
    assert!(!error.contains("database"), "{error}");
    assert_eq!(during.state, RelayState::Blocked, "{during:?}");
    assert_eq!(gauge("idempo_broker_blocked"), Some(1.0));

    drop(alarm);
    support::eventually("the backlog goes out", Duration::from_secs(60), || async {
        outbox::OutboxStatus::read(&db.pool).await.unwrap().pending == 0
    })
    .await;
    assert!(broker.ready(&queue).await >= 2010);
    support::eventually(
        "the gauge counts again",
        Duration::from_secs(10),
        || async { gauge("idempo_outbox_pending") == Some(0.0) },
    )
    .await;
    let after = health.snapshot();
    assert_eq!(after.broker_blocked, None, "{after:?}");
    assert_eq!(after.state, RelayState::Running, "{after:?}");
    assert_eq!(gauge("idempo_broker_blocked"), Some(0.0));
    let error = health.snapshot().last_error.unwrap_or_default();
    assert!(!error.contains("idle"), "blamed on the database: {error}");
    stop.shutdown();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the relay stops")
        .expect("no panic")
        .expect("Ok");
}
