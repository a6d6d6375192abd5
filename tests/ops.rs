//! `idempo::ops` as a library, against real RabbitMQ and PostgreSQL: a
//! second front end (a dashboard) gets from it what the `idempo` command
//! prints, and the dead letters the runtime writes read back through
//! `amqp::DeadLetter`.

mod support;

use std::time::{Duration, SystemTime};

use idempo::amqp::Amqp;
use idempo::amqp::lapin::options::BasicGetOptions;
use idempo::amqp::lapin::types::AMQPValue;
use idempo::consumer::{DeadLetterReason, RedeliveryPolicy};
use idempo::ops::dead_letters::{
    DeadLetterStore, Filter, LetterRef, ReplayEvent, ReplayOptions, Store,
};
use idempo::ops::{self, Services, StatusOptions, Warning};
use support::consumer::{Running, consumer_for, counting_payments, payments_consumer};
use support::{Db, RETRY_DELAY, eventually, eventually_ready};

#[tokio::test]
async fn an_empty_database_is_reported_without_asking_the_broker_then_migrated() {
    let db = Db::with_pool_size(2).await;
    // Nothing listens there: status must not need the broker when no queue is inspected.
    let services = Services::with_pool("amqp://guest:guest@127.0.0.1:1/%2f", db.pool.clone());

    let status = services.status(&StatusOptions::default()).await.unwrap();
    assert_eq!(status.warnings, [Warning::NotMigrated]);
    assert!(status.consumers.is_empty() && status.queues.is_empty());
    assert_eq!(
        (status.outbox, status.http_keys, status.window),
        (None, None, None),
        "tables that do not exist are absent, not errors"
    );

    let before = services.migrate_status().await.unwrap();
    assert!(before.applied.is_empty());
    assert!(!before.is_up_to_date());
    let applied = services.migrate().await.unwrap();
    assert_eq!(applied, before.pending);
    let after = services.migrate_status().await.unwrap();
    assert!(after.is_up_to_date());
    assert_eq!(after.applied.len(), applied.len());

    let status = services.status(&StatusOptions::default()).await.unwrap();
    assert!(!status.needs_attention(), "{:?}", status.warnings);
    assert!(status.outbox.is_some() && status.http_keys == Some(Vec::new()));
}

#[tokio::test]
async fn a_dead_letter_the_runtime_wrote_reads_back_and_replays_once() {
    let (db, broker, queue) = support::setup().await;
    let dlq_name = Amqp::dead_letter_queue(&queue);
    broker.publish_payment(&queue, "pay-1", "ann", 5).await;
    let (_, failing) = counting_payments(usize::MAX, None);
    let retry = RedeliveryPolicy::delayed([RETRY_DELAY]).max_attempts(2);
    Running::start(consumer_for(&db, &queue).redelivery(retry).handler(failing))
        .finish(1)
        .await;
    let services = Services::with_pool(support::amqp_url(), db.pool.clone());

    // The summary: every header the runtime wrote.
    let store = DeadLetterStore::open(&services, &queue, Store::Auto)
        .await
        .unwrap();
    let listing = store.list(&Filter::default()).await.unwrap();
    assert_eq!((store.location(), listing.len()), (dlq_name.clone(), 1));
    let dead = &listing[0];
    assert_eq!(dead.message_id.as_deref(), Some("pay-1"));
    assert_eq!(dead.reason, DeadLetterReason::AttemptsExhausted.as_str());
    assert_eq!(dead.attempts, Some(2));
    assert_eq!(dead.consumer.as_deref(), Some(queue.as_str()));
    assert_eq!(dead.queue.as_deref(), Some(queue.as_str()));
    assert_eq!(dead.routing_key, queue);
    assert!(!dead.foreign && dead.error.is_some());

    // The failure times the runtime wrote, read back typed.
    let (first, last) = (dead.first_failed_at.unwrap(), dead.last_failed_at.unwrap());
    assert!(first <= last, "{first:?} {last:?}");
    assert!(SystemTime::now().duration_since(last).unwrap() < Duration::from_secs(120));
    assert_eq!(dead.replay_count, 0);
    assert!(dead.replayed_at.is_none());

    // Status: the DLQ's depth, and its warning when asked for.
    let options = StatusOptions {
        queues: vec![queue.clone()],
        retry_delays: vec![RETRY_DELAY],
        fail_on_dlq: true,
        ..StatusOptions::default()
    };
    let status = services.status(&options).await.unwrap();
    assert_eq!(status.queues[0].dlq_ready, Some(1));
    assert_eq!(
        status.warnings,
        [Warning::DeadLetters {
            dlq: dlq_name.clone(),
            ready: 1
        }]
    );

    // Replay to a working consumer: one event per step, one payment.
    let _working = Running::start(payments_consumer(&db, &queue));
    let mut events = Vec::new();
    let selection = Filter {
        message_ids: vec!["pay-1".into()],
        ..Filter::default()
    };
    let summary = store
        .replay(&selection, &ReplayOptions::by("test"), |event| {
            events.push(match event {
                ReplayEvent::Started { total, .. } => format!("started {total}"),
                ReplayEvent::Replayed { message_id, queue } => {
                    format!("replayed {} to {}", message_id.unwrap(), queue)
                }
                other => format!("{other:?}"),
            })
        })
        .await
        .unwrap();
    assert_eq!(
        events,
        ["started 1".into(), format!("replayed pay-1 to {queue}")]
    );
    assert_eq!((summary.replayed, summary.skipped_total()), (1, 0));
    eventually("pay-1 applied", Duration::from_secs(30), || async {
        db.payments_for("pay-1").await == 1
    })
    .await;
    eventually_ready(&broker, &dlq_name, 0).await;
    assert!(store.list(&Filter::default()).await.unwrap().is_empty());
}

/// Publishes a dead letter into `queue`'s DLQ as the runtime writes one.
async fn dead_letter(broker: &support::Broker, queue: &str, id: &str, body: &[u8]) {
    use idempo::amqp::lapin::BasicProperties;
    use idempo::amqp::lapin::types::FieldTable;
    let mut headers = FieldTable::default();
    let text = |s: &str| AMQPValue::LongString(s.into());
    headers.insert("x-idempo-original-queue".into(), text(queue));
    headers.insert("x-idempo-consumer".into(), text(queue));
    headers.insert("x-idempo-reason".into(), text("max attempts exceeded"));
    let properties = BasicProperties::default()
        .with_message_id(id.into())
        .with_headers(headers);
    broker
        .publish_props(&Amqp::dead_letter_queue(queue), properties, body)
        .await;
}

/// A broker policy set for one test and removed when it ends.
struct Policy(String);

impl Policy {
    fn set(name: &str, pattern: &str, definition: &str) -> Policy {
        let out = support::rabbitmqctl()
            .args(["set_policy", name, pattern, definition])
            .args(["--apply-to", "queues", "--priority", "10"])
            .output()
            .expect("run rabbitmqctl");
        assert!(out.status.success(), "{out:?}");
        Policy(name.to_owned())
    }
}

impl Drop for Policy {
    fn drop(&mut self) {
        let _ = support::rabbitmqctl()
            .args(["clear_policy", &self.0])
            .output();
    }
}

/// A quorum DLQ under a `delivery-limit` policy (RabbitMQ 4's default for
/// every quorum queue is 20) dropped its dead letters once they had been
/// browsed that many times: handing a message back counts as a failed
/// delivery. Browsing now spends no delivery attempt: 25 listings (and a
/// show and a purge that is not confirmed in between) lose nothing.
#[tokio::test]
async fn browsing_a_dlq_under_a_delivery_limit_loses_nothing() {
    let (db, broker, queue) = support::setup().await;
    let dlq_name = Amqp::dead_letter_queue(&queue);
    let _limit = Policy::set(
        &format!("{queue}-limit"),
        &format!("^{dlq_name}$"),
        r#"{"delivery-limit":20,"expires":300000}"#,
    );
    for i in 0..11 {
        dead_letter(
            &broker,
            &queue,
            &format!("pay-{i}"),
            &support::payment_body("ann", 1),
        )
        .await;
    }
    let services = Services::with_pool(support::amqp_url(), db.pool.clone());
    let store = DeadLetterStore::open(&services, &queue, Store::Queue)
        .await
        .unwrap();
    let ids = |listing: &[idempo::ops::dead_letters::Letter]| -> Vec<String> {
        listing
            .iter()
            .map(|d| d.message_id.clone().unwrap())
            .collect()
    };
    let expected: Vec<String> = (0..11).map(|i| format!("pay-{i}")).collect();
    for pass in 0..25 {
        let listing = store.list(&Filter::default()).await.unwrap();
        let mut got = ids(&listing);
        if pass <= 10 {
            assert_eq!(got, expected, "pass {pass}: all there, in order");
        }
        // `show` stopped at pay-3: what it read moved behind the rest.
        got.sort_by_key(|id| id[4..].parse::<u32>().unwrap());
        assert_eq!(got, expected, "pass {pass}: all there");
        if pass == 10 {
            let shown = store
                .show(&LetterRef::MessageId("pay-3".into()))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(shown.letter.message_id.as_deref(), Some("pay-3"));
            let plan = store.purge(&Filter::default()).await.unwrap();
            assert_eq!(plan.len(), 11);
            plan.keep().await;
        }
    }
    eventually_ready(&broker, &dlq_name, 11).await;
    // Not one delivery attempt spent.
    let got = broker
        .channel
        .basic_get(dlq_name.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    let headers = got
        .delivery
        .properties
        .headers()
        .clone()
        .unwrap_or_default();
    let count = headers.inner().get("x-delivery-count");
    assert!(
        matches!(count, None | Some(AMQPValue::LongLongInt(0))),
        "{count:?}"
    );
}

/// `replay --all` used to replay whatever came back during the run: two
/// runs at once replayed the poison round and round. A run now works on the
/// dead letters present when it started, and two runs at once replay each
/// one once between them; the replay history stays bounded however often a
/// dead letter is replayed.
#[tokio::test]
async fn a_replay_sends_each_dead_letter_once_and_its_history_stays_bounded() {
    let (db, broker, queue) = support::setup().await;
    let dlq_name = Amqp::dead_letter_queue(&queue);
    for i in 0..20 {
        dead_letter(
            &broker,
            &queue,
            &format!("pay-{i}"),
            &support::payment_body("ann", 1),
        )
        .await;
    }
    for i in 0..5 {
        dead_letter(
            &broker,
            &queue,
            &format!("neg-{i}"),
            &support::payment_body("neg", -1),
        )
        .await;
    }
    let working = Running::start(payments_consumer(&db, &queue));
    let services = Services::with_pool(support::amqp_url(), db.pool.clone());
    let options = ReplayOptions {
        all: true,
        throttle: Some(Duration::from_millis(20)),
        ..ReplayOptions::by("test")
    };
    let all = Filter::default();
    let store = DeadLetterStore::open(&services, &queue, Store::Queue)
        .await
        .unwrap();
    let (a, b) = tokio::join!(
        store.replay(&all, &options, |_| {}),
        store.replay(&all, &options, |_| {}),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.replayed + b.replayed, 25, "{a:?} {b:?}");
    eventually(
        "the 20 payments applied",
        Duration::from_secs(30),
        || async { db.payments().await == 20 },
    )
    .await;
    eventually_ready(&broker, &dlq_name, 5).await;

    // Replayed again and again: the poison comes back each time.
    for pass in 2..=8u64 {
        let summary = store.replay(&all, &options, |_| {}).await.unwrap();
        assert_eq!(summary.replayed, 5, "pass {pass}");
        eventually("the poison back", Duration::from_secs(30), || async {
            working.stats().dead_lettered >= 5 * pass
        })
        .await;
        eventually_ready(&broker, &dlq_name, 5).await;
    }
    let stats = working.stats();
    assert_eq!(stats.dead_lettered, 40, "{stats:?}");
    working.stop().await.unwrap();
    let dead = broker.drain(&dlq_name).await;
    assert_eq!(dead.len(), 5);
    for d in &dead {
        let history = &d.headers["x-idempo-replay-history"];
        let records: Vec<serde_json::Value> = serde_json::from_str(history).unwrap();
        assert_eq!(records.len(), 5, "{history}");
        assert_eq!(d.headers["x-idempo-replay-count"], "8");
        assert!(history.len() < 4_000, "{}", history.len());
    }
    assert_eq!(db.payments().await, 20);
}

/// A relay of its own writes heartbeats: `idempo status` (and the
/// dashboard) list it beside the consumers, healthy while it publishes,
/// stopped once it ends.
#[tokio::test]
async fn a_standalone_relay_is_listed_with_its_state() {
    let db = Db::new().await;
    idempo::migrate(&db.pool).await.unwrap();
    let relay = idempo::amqp::Relay::new(&support::amqp_url(), db.pool.clone())
        .unwrap()
        .poll_interval(Duration::from_millis(300));
    let stop = relay.shutdown_handle();
    let running = tokio::spawn(relay.run());
    let services = Services::with_pool(support::amqp_url(), db.pool.clone());
    let relay_instance = || async {
        services
            .status(&StatusOptions::default())
            .await
            .unwrap()
            .instances
            .unwrap_or_default()
            .into_iter()
            .find(|i| i.consumer == "relay")
    };
    eventually(
        "the relay says it runs",
        Duration::from_secs(20),
        || async {
            relay_instance()
                .await
                .is_some_and(|i| i.state == "running" && i.queue.is_empty())
        },
    )
    .await;
    let alive = relay_instance().await.unwrap();
    assert_eq!(
        ops::Condition::of_instance(&alive),
        ops::Condition::Healthy,
        "{alive:?}"
    );
    stop.shutdown();
    running.await.unwrap().unwrap();
    let stopped = relay_instance().await.unwrap();
    assert_eq!(stopped.state, "stopped");
    assert_eq!(
        ops::Condition::of_instance(&stopped),
        ops::Condition::Stopped
    );
}
