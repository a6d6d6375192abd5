//! `idempo::ops` as a library, against real RabbitMQ and PostgreSQL: a
//! second front end (a dashboard) gets from it what the `idempo` command
//! prints, and the dead letters the runtime writes read back through
//! `amqp::DeadLetter`.

mod support;

use std::time::{Duration, SystemTime};

use idempo::amqp::lapin::options::{BasicGetOptions, BasicNackOptions};
use idempo::amqp::{DeadLetter, DeadLetterReason, RedeliveryPolicy, dead_letter_queue};
use idempo::ops::dlq::{self, ReplayEvent, ReplayOptions, Selection};
use idempo::ops::{self, Services, StatusOptions, Warning, maintenance};
use support::consumer::{Running, consumer_for, counting_payments, payments_consumer};
use support::{Db, RETRY_DELAY, eventually, eventually_ready};

#[tokio::test]
async fn an_empty_database_is_reported_without_asking_the_broker_then_migrated() {
    let db = Db::with_pool_size(2).await;
    // Nothing listens there: status must not need the broker when no queue is inspected.
    let services = Services::with_pool("amqp://guest:guest@127.0.0.1:1/%2f", db.pool.clone());

    let status = ops::status(&services, &StatusOptions::default())
        .await
        .unwrap();
    assert_eq!(status.warnings, [Warning::NotMigrated]);
    assert!(status.consumers.is_empty() && status.queues.is_empty());
    assert_eq!(
        (status.outbox, status.http_keys, status.window),
        (None, None, None),
        "tables that do not exist are absent, not errors"
    );

    let before = maintenance::migrate_status(&services).await.unwrap();
    assert!(before.applied.is_empty());
    assert!(!before.is_up_to_date());
    let applied = maintenance::migrate(&services).await.unwrap();
    assert_eq!(applied, before.pending);
    let after = maintenance::migrate_status(&services).await.unwrap();
    assert!(after.is_up_to_date());
    assert_eq!(after.applied.len(), applied.len());

    let status = ops::status(&services, &StatusOptions::default())
        .await
        .unwrap();
    assert!(!status.needs_attention(), "{:?}", status.warnings);
    assert!(status.outbox.is_some() && status.http_keys == Some(Vec::new()));
}

#[tokio::test]
async fn a_dead_letter_the_runtime_wrote_reads_back_and_replays_once() {
    let (db, broker, queue) = support::setup().await;
    let dlq_name = dead_letter_queue(&queue);
    broker.publish_payment(&queue, "pay-1", "ann", 5).await;
    let (_, failing) = counting_payments(usize::MAX, None);
    let retry = RedeliveryPolicy::delayed([RETRY_DELAY]).max_attempts(2);
    Running::start(consumer_for(&db, &queue).retry(retry).handler(failing))
        .finish(1)
        .await;
    let services = Services::with_pool(support::amqp_url(), db.pool.clone());

    // The summary: every header the runtime wrote.
    let listing = dlq::list(&services, &queue, &Selection::default(), 10)
        .await
        .unwrap();
    assert_eq!(
        (listing.dlq.as_str(), listing.ready),
        (dlq_name.as_str(), 1)
    );
    let dead = &listing.dead_letters[0];
    assert_eq!(dead.message_id.as_deref(), Some("pay-1"));
    assert_eq!(dead.reason, DeadLetterReason::AttemptsExhausted.as_str());
    assert_eq!(dead.attempts, Some(2));
    assert_eq!(dead.consumer.as_deref(), Some(queue.as_str()));
    assert_eq!(dead.original_queue.as_deref(), Some(queue.as_str()));
    assert_eq!(dead.routing_key, queue);
    assert!(!dead.foreign && dead.error.is_some());

    // The view parses the failure times the runtime wrote.
    let got = broker
        .channel
        .basic_get(dlq_name.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("the dead letter is back in the DLQ after the listing");
    let view = DeadLetter::from_delivery(&got.delivery);
    let (first, last) = (view.first_failure().unwrap(), view.last_failure().unwrap());
    assert!(first <= last, "{first:?} {last:?}");
    assert!(SystemTime::now().duration_since(last).unwrap() < Duration::from_secs(120));
    assert!(view.replay_history().is_empty());
    got.delivery
        .acker
        .nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        })
        .await
        .unwrap();

    // Status: the DLQ's depth, and its warning when asked for.
    let options = StatusOptions {
        queues: vec![queue.clone()],
        retry_delays: vec![RETRY_DELAY],
        fail_on_dlq: true,
        ..StatusOptions::default()
    };
    let status = ops::status(&services, &options).await.unwrap();
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
    let selection = Selection {
        ids: vec!["pay-1".into()],
        ..Selection::default()
    };
    let summary = dlq::replay(
        &services,
        &queue,
        &selection,
        &ReplayOptions::default(),
        |event| {
            events.push(match event {
                ReplayEvent::Started { total, .. } => format!("started {total}"),
                ReplayEvent::Replayed { message_id, queue } => {
                    format!("replayed {} to {}", message_id.unwrap(), queue)
                }
                other => format!("{other:?}"),
            })
        },
    )
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
    assert!(
        dlq::list(&services, &queue, &Selection::default(), 10)
            .await
            .unwrap()
            .dead_letters
            .is_empty()
    );
}
