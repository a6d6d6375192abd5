use super::*;
use crate::Tx;
use crate::amqp::Consumer;
use crate::consumer::{HandlerError, Message};

async fn noop(_tx: Tx, _m: Message) -> std::result::Result<(), HandlerError> {
    Ok(())
}

async fn noop_batch(_tx: Tx, _m: Vec<Message>) -> std::result::Result<(), HandlerError> {
    Ok(())
}

fn builder() -> ConsumerBuilder<NoHandler> {
    let pool = PgPool::connect_lazy("postgres://postgres@127.0.0.1:5432/postgres").unwrap();
    Consumer::builder("amqp://127.0.0.1", pool).queue("payments")
}

fn refused(result: Result<Consumer>) -> String {
    match result {
        Err(Error::Config(why)) => why,
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[tokio::test]
async fn defaults_build_and_the_consumer_is_named_after_the_queue() {
    let consumer = builder().handler(noop).build().unwrap();
    assert_eq!(consumer.name(), "payments");
    assert_eq!(consumer.config.topology.dead_letter_queue, "payments.dlq");
    assert_eq!(
        (consumer.config.prefetch, consumer.config.concurrency),
        (100, 16)
    );
    assert!(consumer.dispatch.batch.is_none());
    let batched = builder()
        .batch_handler(noop_batch)
        .prefetch(300)
        .build()
        .unwrap();
    assert_eq!(batched.dispatch.batch.map(|(size, _)| size), Some(100));
}

#[tokio::test]
async fn impossible_settings_are_refused_with_the_reason() {
    let pool = PgPool::connect_lazy("postgres://127.0.0.1/x").unwrap();
    let no_queue = Consumer::builder("amqp://127.0.0.1", pool).handler(noop);
    assert!(refused(no_queue.build()).contains("a queue is required"));
    let why = refused(builder().prefetch(4).concurrency(8).handler(noop).build());
    assert!(
        why.contains("prefetch (4) must be at least concurrency (8)"),
        "{why}"
    );
    assert!(refused(builder().concurrency(0).handler(noop).build()).contains("at least 1"));
    assert!(refused(builder().consumer_name("").handler(noop).build()).contains("empty"));
    let zero = builder().retention(Duration::ZERO).handler(noop);
    assert!(refused(zero.build()).contains("retention"));
    let no_delays = builder()
        .redelivery(RedeliveryPolicy::delayed([]))
        .handler(noop);
    assert!(refused(no_delays.build()).contains("at least one delay"));
}

#[tokio::test]
async fn batch_sizes_are_checked_against_the_prefetch() {
    let zero = builder().handler(noop).batch(0);
    assert!(refused(zero.build()).contains("at least 1"));
    let why = refused(builder().handler(noop).batch(500).build());
    assert!(
        why.contains("prefetch (100) must be at least the batch size (500)"),
        "{why}"
    );
    let fine = builder()
        .prefetch(1500)
        .handler(noop)
        .batch(500)
        .build()
        .unwrap();
    assert_eq!(fine.dispatch.batch.map(|(size, _)| size), Some(500));
}
