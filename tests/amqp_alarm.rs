//! Shutdown while the broker is in a memory alarm. Its own test binary: the
//! alarm blocks every publishing connection on the broker, so nothing else
//! may run against it meanwhile (test binaries run one after the other).

mod support;

use std::time::{Duration, Instant};

use idempo::amqp::{HandlerError, Message, RedeliveryPolicy};
use support::consumer::{Running, consumer_for};

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
            .retry(RedeliveryPolicy::delayed([Duration::from_secs(60)]))
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
