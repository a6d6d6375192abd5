//! The runtime's failure paths against the real RabbitMQ and PostgreSQL:
//! delayed retries, dead letters, broker loss, database loss.

mod support;

use std::time::Duration;

use idempo::amqp::Consumer;
use idempo::consumer::{RedeliveryPolicy, RuntimeState};
use support::consumer::{
    Running, WAIT, consumer_for, counting_payments, payments_consumer, payments_then,
};
use support::{Broker, Db, TcpProxy, eventually, payments, unique};

#[tokio::test]
async fn a_transient_failure_is_retried_through_a_delay_queue_counting_attempts() {
    let (db, broker, queue) = support::setup().await;
    broker.publish_payment(&queue, "pay-retry", "ann", 12).await;
    let (seen, handler) = counting_payments(2, None);
    let consumer = Running::start(consumer_for(&db, &queue).handler(handler));
    let stats = consumer.finish(1).await;

    let headers = seen.lock().unwrap().headers.clone();
    assert_eq!(
        headers,
        [None, Some(1), Some(2)],
        "the count travels in the message"
    );
    assert_eq!((stats.retried, stats.processed), (2, 1));
    assert_eq!(
        db.payments_for("pay-retry").await,
        1,
        "failed attempts rolled back"
    );
    assert_eq!(broker.ready(&queue).await, 0);
    assert_eq!(broker.ready(&format!("{queue}.retry.50ms")).await, 0);
}

#[tokio::test]
async fn after_max_attempts_the_delivery_is_dead_lettered_with_its_history() {
    let (db, broker, queue) = support::setup().await;
    let properties = lapin::BasicProperties::default()
        .with_message_id("pay-doomed".into())
        .with_expiration("600000".into());
    broker
        .publish_props(&queue, properties, &support::payment_body("bob", 5))
        .await;
    let (seen, handler) = counting_payments(usize::MAX, None);
    // An id derived from a property that copies drop (the expiration) must
    // stay the original's on every retry.
    let id_of = |m: &idempo::consumer::Message| {
        let expiration = m
            .amqp()?
            .properties()
            .expiration()
            .as_ref()
            .map(|e| e.to_string());
        Some(format!("{}/{}", m.amqp()?.message_id()?, expiration?))
    };
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .message_id(idempo::consumer::MessageIdSource::custom(id_of))
            .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]).max_attempts(3))
            .handler(handler),
    );
    let stats = consumer.finish(1).await;

    assert_eq!(seen.lock().unwrap().headers.len(), 3, "three attempts");
    assert_eq!(
        (stats.retried, stats.dead_lettered, stats.processed),
        (2, 1, 0)
    );
    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead.len(), 1);
    let h = &dead[0].headers;
    assert_eq!(dead[0].reason(), "max attempts exceeded");
    assert_eq!(h["x-idempo-attempts"], "3");
    assert!(
        h["x-idempo-error"].contains("3 attempts failed"),
        "{}",
        h["x-idempo-error"]
    );
    assert!(h["x-idempo-error"].contains("downstream unavailable"));
    assert_eq!(h["x-idempo-original-queue"], queue);
    assert_eq!(
        h["x-idempo-original-routing-key"], queue,
        "the original routing key, not the delay queue's"
    );
    assert!(h["x-idempo-first-failure"] <= h["x-idempo-last-failure"]);
    assert!(h["x-idempo-first-failure"].ends_with('Z'));
    assert_eq!(dead[0].message_id.as_deref(), Some("pay-doomed"));
    assert_eq!(h["x-idempo-message-id"], "pay-doomed/600000");
    assert_eq!(dead[0].expiration, None);
    assert_eq!(db.payments().await, 0);
}

#[tokio::test]
async fn a_handler_can_ask_for_a_longer_delay() {
    let (db, broker, queue) = support::setup().await;
    broker.track_one(&format!("{queue}.retry.1s"));
    broker.publish_payment(&queue, "pay-later", "cyd", 1).await;
    let (seen, handler) = counting_payments(1, Some(Duration::from_millis(800)));
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .redelivery(RedeliveryPolicy::delayed([
                support::RETRY_DELAY,
                Duration::from_secs(1),
            ]))
            .handler(handler),
    );
    consumer.finish(1).await;

    let at = seen.lock().unwrap().at.clone();
    let waited = at[1] - at[0];
    assert!(
        waited >= Duration::from_millis(900),
        "waited the 1 s tier, not 50 ms: {waited:?}"
    );
    assert_eq!(db.payments_for("pay-later").await, 1);
}

#[tokio::test]
async fn the_requeue_policy_retries_without_delay_queues() {
    let (db, broker, queue) = support::setup().await;
    broker
        .publish_payment(&queue, "pay-requeue", "dan", 3)
        .await;
    let (seen, handler) = counting_payments(1, None);
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .redelivery(RedeliveryPolicy::requeue(support::RETRY_DELAY))
            .handler(handler),
    );
    let stats = consumer.finish(1).await;

    assert_eq!(
        seen.lock().unwrap().headers,
        [None, None],
        "nack-requeue counts nothing"
    );
    assert_eq!((stats.retried, stats.processed), (1, 1));
    assert!(!broker.exists(&format!("{queue}.retry.50ms")).await);
    assert_eq!(db.payments_for("pay-requeue").await, 1);
}

#[tokio::test]
async fn a_failed_commit_is_not_acked_and_the_redelivery_applies_once() {
    let (db, broker, queue) = support::setup().await;
    // A deferred unique constraint is checked at COMMIT: the handler's
    // statements succeed, the commit itself fails.
    sqlx::query(
        "CREATE TABLE commit_guard (n int, CONSTRAINT commit_guard_n UNIQUE (n) DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    broker
        .publish_payment(&queue, "pay-commit", "pia", 40)
        .await;
    let (_, guarded) = payments_then(|attempt, tx| async move {
        // The first attempt breaks the deferred constraint; the next ones do not.
        let rows = if attempt == 0 { 2 } else { 1 };
        let mut tx = tx.try_lock()?;
        for _ in 0..rows {
            sqlx::query("INSERT INTO commit_guard VALUES (1)")
                .execute(&mut *tx)
                .await?;
        }
        Ok(())
    });
    let consumer = Running::start(consumer_for(&db, &queue).handler(guarded));
    let stats = consumer.finish(1).await;

    assert_eq!(
        (stats.commit_failures, stats.retried, stats.processed),
        (1, 1, 1)
    );
    assert_eq!(db.payments_for("pay-commit").await, 1);
    assert_eq!(db.balances().await["pia"], 40);
    assert_eq!(broker.ready(&queue).await, 0);
}

#[tokio::test]
async fn a_dead_letter_the_broker_cannot_route_keeps_the_original_in_the_queue() {
    let (db, broker, queue) = support::setup().await;
    broker.publish(&queue, Some("poison"), b"not json").await;
    let consumer = Running::start(
        payments_consumer(&db, &queue)
            .declare(false)
            .dead_letter_queue(unique("missing_dlq")),
    );
    eventually("the poison was handed back", WAIT, || async {
        consumer.stats().retried >= 1
    })
    .await;
    let stats = consumer.stats();
    consumer.stop().await.unwrap();

    assert_eq!(
        stats.dead_lettered, 0,
        "an unconfirmed dead letter is not counted"
    );
    support::eventually_ready(&broker, &queue, 1).await;
}

#[tokio::test]
async fn a_crash_between_commit_and_ack_is_redelivered_and_acked_as_a_duplicate() {
    let (db, broker, queue) = support::setup().await;
    broker
        .publish_payment(&queue, "pay-crash", "frank", 900)
        .await;
    // The handler cuts its own AMQP connection before returning: the runtime
    // then commits, and its ack can no longer reach the broker.
    let connection = unique("crashing");
    let name = connection.clone();
    let (_, cutting) = payments_then(move |attempt, _tx| {
        let name = name.clone();
        async move {
            if attempt == 0 {
                tokio::task::spawn_blocking(move || support::close_connections_named(&name))
                    .await
                    .unwrap();
            }
            Ok(())
        }
    });
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .connection_name(&connection)
            .handler(cutting),
    );
    // The runtime reconnects by itself and gets the redelivery.
    let stats = consumer.finish(2).await;

    assert_eq!((stats.processed, stats.duplicates), (1, 1));
    assert!(stats.reconnects >= 1);
    assert_eq!(db.payments_for("pay-crash").await, 1, "one effect");
    assert_eq!(db.balances().await["frank"], 900);
    assert_eq!(broker.ready(&queue).await, 0);
}

#[tokio::test]
async fn a_cut_connection_is_reestablished_and_consuming_resumes() {
    let (db, broker, queue) = support::setup().await;
    let connection = unique("cut");
    let consumer = Running::start(payments_consumer(&db, &queue).connection_name(&connection));
    consumer.health.wait_for(|h| h.is_consuming()).await;
    let name = connection.clone();
    tokio::task::spawn_blocking(move || support::close_connections_named(&name))
        .await
        .unwrap();
    let health = tokio::time::timeout(
        WAIT,
        consumer
            .health
            .wait_for(|h| h.reconnects >= 1 && h.state == RuntimeState::Consuming),
    )
    .await
    .expect("consuming again after the cut");
    assert!(health.last_error.is_some());
    assert!(
        !consumer.task.is_finished(),
        "the runtime never exits on a connection loss"
    );

    broker
        .publish_payment(&queue, "pay-after-cut", "gus", 4)
        .await;
    let stats = consumer.finish(1).await;
    assert_eq!(stats.processed, 1);
    assert!(stats.reconnects >= 1);
    assert_eq!(db.payments_for("pay-after-cut").await, 1);
}

#[tokio::test]
async fn a_deleted_queue_is_reported_then_declared_again() {
    let (db, broker, queue) = support::setup().await;
    let consumer = Running::start(payments_consumer(&db, &queue));
    consumer.health.wait_for(|h| h.is_consuming()).await;
    broker.delete(&queue).await;
    broker.track_one(&queue);
    let health = tokio::time::timeout(
        WAIT,
        consumer
            .health
            .wait_for(|h| h.reconnects >= 1 && h.state == RuntimeState::Consuming),
    )
    .await
    .expect("consuming again");
    let error = health.last_error.unwrap_or_default();
    assert!(
        error.contains("cancelled the consumer"),
        "reported: {error}"
    );

    broker
        .publish_payment(&queue, "pay-redeclared", "hal", 6)
        .await;
    let stats = consumer.finish(1).await;
    assert_eq!(stats.processed, 1);
    assert_eq!(db.payments_for("pay-redeclared").await, 1);
}

#[tokio::test]
async fn a_backend_killed_mid_transaction_reruns_the_delivery_once() {
    let (db, broker, queue) = support::setup().await;
    broker.publish_payment(&queue, "pay-killed", "ida", 7).await;
    let (attempts, killing) = payments_then(|attempt, tx| async move {
        if attempt == 0 {
            let mut tx = tx.try_lock()?;
            sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
                .execute(&mut *tx)
                .await?;
        }
        Ok(())
    });
    let consumer = Running::start(consumer_for(&db, &queue).handler(killing));
    let stats = consumer.finish(1).await;

    assert_eq!(attempts.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(
        (stats.processed, stats.retried),
        (1, 0),
        "an outage uses up no attempt"
    );
    assert_eq!(db.payments_for("pay-killed").await, 1);
    assert_eq!(db.balances().await["ida"], 7);
}

#[tokio::test]
async fn a_database_outage_holds_deliveries_until_it_returns() {
    let (db, broker, queue) = support::setup().await;
    let proxy = TcpProxy::postgres().await;
    let pool = support::pool_through(&proxy, &db).await;
    let consumer = Running::start(
        Consumer::builder(support::amqp_url(), pool)
            .queue(&queue)
            .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]))
            .handler(|tx, message| payments::handle(tx, message, 0.0)),
    );
    consumer.health.wait_for(|h| h.is_consuming()).await;
    proxy.cut();
    for i in 0..3 {
        broker
            .publish_payment(&queue, &format!("pay-outage-{i}"), "jo", 1)
            .await;
    }
    let down = tokio::time::timeout(WAIT, consumer.health.wait_for(|h| !h.database_available))
        .await
        .expect("the outage is reported");
    assert!(!down.is_healthy());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let during = consumer.stats();
    assert_eq!(
        (during.processed, during.retried, during.dead_lettered),
        (0, 0, 0),
        "deliveries wait; nothing is retried or dead-lettered"
    );

    proxy.restore();
    let stats = consumer.finish(3).await;
    assert_eq!(stats.processed, 3);
    assert_eq!(db.payments().await, 3);
    assert_eq!(db.balances().await["jo"], 3);
}

#[tokio::test]
async fn poison_is_dead_lettered_even_while_the_database_is_unreachable() {
    let (broker, queue) = (Broker::connect().await, unique("q"));
    support::init_tracing();
    broker.declare(&queue).await;
    broker.publish_payment(&queue, "pay-nodb", "quinn", 1).await;
    broker
        .publish(&queue, Some("poison-nodb"), b"not json")
        .await;
    // Nothing listens on port 1: every BEGIN fails.
    let dead_pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("postgres://postgres@127.0.0.1:1/postgres")
        .unwrap();
    let consumer = Running::start(
        Consumer::builder(support::amqp_url(), dead_pool)
            .queue(&queue)
            .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]))
            .handler(|tx, message| payments::handle(tx, message, 0.0)),
    );
    consumer.settled(1).await;
    tokio::time::timeout(WAIT, consumer.health.wait_for(|h| !h.database_available))
        .await
        .expect("the outage is reported");
    let stats = consumer.stats();
    consumer.stop().await.unwrap();

    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (0, 0, 1)
    );
    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead[0].reason(), "undecodable body");
    support::eventually_ready(&broker, &queue, 1).await;
}

/// At COMMIT, a deferred trigger on `payments` terminates the committing
/// backend once: the client sees the connection die and cannot know the
/// outcome (here: rolled back).
async fn kill_at_first_commit(db: &Db) {
    sqlx::raw_sql(
        // A sequence, because nextval survives the rollback that the kill causes.
        "CREATE SEQUENCE kills;
         CREATE FUNCTION kill_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('kills') = 1 THEN
                 PERFORM pg_terminate_backend(pg_backend_pid());
             END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER kill_at_commit AFTER INSERT ON payments
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION kill_at_commit();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_commit_whose_connection_dies_is_resolved_through_the_claim() {
    let (db, broker, queue) = support::setup().await;
    kill_at_first_commit(&db).await;
    broker
        .publish_payment(&queue, "pay-unknown", "kim", 9)
        .await;
    let consumer = Running::start(payments_consumer(&db, &queue));
    let stats = consumer.finish(1).await;

    assert_eq!(stats.commit_failures, 1, "the commit's outcome was unknown");
    assert!(
        stats.database_outages >= 1,
        "it went through the database gate"
    );
    assert_eq!((stats.processed, stats.retried), (1, 0));
    assert_eq!(db.payments_for("pay-unknown").await, 1, "one effect");
    assert_eq!(db.balances().await["kim"], 9);
}

/// The batch twin of the test above: the backend dies in the combined claim
/// check and COMMIT of a whole batch. The batch waits at the gate and is
/// claimed again (fresh: nothing committed), each payment applied once,
/// nothing retried.
#[tokio::test]
async fn a_batch_commit_whose_connection_dies_is_resolved_through_the_claims() {
    let (db, broker, queue) = support::setup().await;
    kill_at_first_commit(&db).await;
    let messages: Vec<(String, Vec<u8>)> = (1..=20)
        .map(|i| (format!("pay-{i}"), support::payment_body("kim", i)))
        .collect();
    broker.publish_many(&queue, &messages).await;
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .prefetch(30)
            .batch_handler(|tx, batch| payments::handle_batch(tx, batch, 0.0))
            .batch(10),
    );
    let stats = consumer.finish(20).await;

    assert_eq!(stats.commit_failures, 1, "the commit's outcome was unknown");
    assert!(
        stats.database_outages >= 1,
        "it went through the database gate"
    );
    assert_eq!(
        (
            stats.processed,
            stats.duplicates,
            stats.retried,
            stats.dead_lettered
        ),
        (20, 0, 0, 0),
        "{stats:?}"
    );
    for (id, _) in &messages {
        assert_eq!(db.payments_for(id).await, 1, "one effect for {id}");
    }
    assert_eq!(db.balances().await["kim"], (1..=20).sum::<i64>());
    assert_eq!(db.claims().await, 20);
    assert_eq!(broker.ready(&queue).await, 0);
}

/// Backends sleeping in [`sleep_at_first_commit`]'s trigger, in a unit's
/// commit.
async fn sleeping_commits(db: &Db) -> i64 {
    sqlx::query_scalar(
        // A unit commits with `SELECT; COMMIT AND CHAIN` (per message and
        // batch alike); only this test's trigger sleeps.
        "SELECT count(*) FROM pg_stat_activity \
         WHERE wait_event = 'PgSleep' AND query LIKE '%COMMIT AND CHAIN'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// At COMMIT, a deferred trigger on `payments` sleeps 1.5 s once, after
/// recording the payment's id in `slept` (which commits only if the
/// transaction does).
async fn sleep_at_first_commit(db: &Db) {
    sqlx::raw_sql(
        "CREATE TABLE slept (message_id text NOT NULL);
         CREATE SEQUENCE sleeps;
         CREATE FUNCTION sleep_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('sleeps') = 1 THEN
                 INSERT INTO slept VALUES (NEW.message_id);
                 PERFORM pg_sleep(1.5);
             END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER sleep_at_commit AFTER INSERT ON payments
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION sleep_at_commit();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
}

/// The ids recorded by [`sleep_at_first_commit`]'s trigger whose claim by
/// `queue`'s consumer is committed.
async fn slept_and_claimed(db: &Db, queue: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT s.message_id FROM slept s JOIN processed_messages p \
         ON p.message_id = s.message_id AND p.consumer = $1",
    )
    .bind(queue)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// The COMMIT succeeds on the server but its answer never reaches the
/// client: the network is cut while the COMMIT runs (a deferred trigger
/// holds it for 1.5 s), and restored once the transaction is durable. The
/// runtime cannot know the outcome, never acks, and the next pass claims
/// the unit again: a duplicate, acked. One effect per payment, in
/// per-message and in batch mode.
#[tokio::test]
async fn a_commit_whose_answer_is_lost_is_claimed_again_as_a_duplicate() {
    for batch in [None, Some(10)] {
        let (db, broker, queue) = support::setup().await;
        sleep_at_first_commit(&db).await;
        let proxy = TcpProxy::postgres().await;
        let pool = support::pool_through(&proxy, &db).await;
        let messages: Vec<(String, Vec<u8>)> = (1..=10)
            .map(|i| (format!("pay-{i}"), support::payment_body("lu", i)))
            .collect();
        broker.publish_many(&queue, &messages).await;
        let base = Consumer::builder(support::amqp_url(), pool)
            .queue(&queue)
            .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]));
        let consumer = match batch {
            None => Running::start(base.handler(|tx, m| payments::handle(tx, m, 0.0))),
            Some(size) => Running::start(
                base.prefetch(30)
                    .batch_handler(|tx, b| payments::handle_batch(tx, b, 0.0))
                    .batch(size),
            ),
        };
        eventually("a COMMIT held by the trigger", WAIT, || async {
            sleeping_commits(&db).await == 1
        })
        .await;
        proxy.cut();
        // The server finishes the COMMIT without its client: `slept`
        // commits with it.
        eventually("the COMMIT completed on the server", WAIT, || async {
            !slept_and_claimed(&db, &queue).await.is_empty()
        })
        .await;
        let slept = slept_and_claimed(&db, &queue).await;
        assert_eq!(slept.len(), 1, "{batch:?}");
        assert_eq!(
            db.payments_for(&slept[0]).await,
            1,
            "{batch:?}: the effect is durable while the client knows nothing"
        );
        assert_eq!(sleeping_commits(&db).await, 0);
        proxy.restore();
        let stats = consumer.finish(messages.len() as u64).await;

        assert!(
            stats.commit_failures >= 1,
            "{batch:?}: the outcome was unknown: {stats:?}"
        );
        assert!(
            stats.duplicates >= 1,
            "{batch:?}: the unit whose answer was lost was claimed again as a duplicate: {stats:?}"
        );
        assert_eq!(
            stats.processed + stats.duplicates,
            messages.len() as u64,
            "{batch:?}: {stats:?}"
        );
        assert_eq!(
            (stats.dead_lettered, stats.retried),
            (0, 0),
            "{batch:?}: {stats:?}"
        );
        for (id, _) in &messages {
            assert_eq!(
                db.payments_for(id).await,
                1,
                "{batch:?}: one effect for {id}"
            );
        }
        assert_eq!(db.balances().await["lu"], (1..=10).sum::<i64>());
        assert_eq!(db.claims().await, 10);
        assert_eq!(broker.ready(&queue).await, 0);
    }
}

/// The payments consumer on an isolated database, per message (`batch`
/// `None`) or in batches, allowed `max_attempts`.
fn payments_on_isolated(
    iso: &support::IsolatedDb,
    queue: &str,
    batch: Option<usize>,
    max_attempts: u32,
) -> Running {
    let base = Consumer::builder(support::amqp_url(), iso.db.pool.clone())
        .queue(queue)
        .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]).max_attempts(max_attempts));
    match batch {
        None => Running::start(base.handler(|tx, m| payments::handle(tx, m, 0.0))),
        Some(size) => Running::start(
            base.handler(|tx, m| payments::handle(tx, m, 0.0))
                .prefetch(30)
                .batch(size),
        ),
    }
}

/// The database refuses connections in each way a maintenance window does:
/// not accepting connections (55000), the role may not log in (28000), no
/// connection slot for the role (53300). Each is the database being down: the
/// deliveries wait at the gate, none uses an attempt, none is dead-lettered.
#[tokio::test]
async fn a_database_in_maintenance_dead_letters_nothing() {
    for batch in [None, Some(10)] {
        let iso = support::IsolatedDb::new().await;
        let broker = Broker::connect().await;
        let queue = unique("maint");
        broker.declare(&queue).await;
        // Few attempts: a refusal taken for the message's failure would
        // dead-letter it within a second.
        let consumer = payments_on_isolated(&iso, &queue, batch, 2);
        let mut published = 0;
        for (close, reopen) in [
            (
                "ALTER DATABASE {name} ALLOW_CONNECTIONS false",
                "ALTER DATABASE {name} ALLOW_CONNECTIONS true",
            ),
            ("ALTER ROLE {name} NOLOGIN", "ALTER ROLE {name} LOGIN"),
            (
                "ALTER ROLE {name} CONNECTION LIMIT 0",
                "ALTER ROLE {name} CONNECTION LIMIT -1",
            ),
        ] {
            iso.admin(close).await;
            iso.kick().await;
            for _ in 0..10 {
                published += 1;
                broker
                    .publish_payment(&queue, &format!("pay-{published}"), "mo", 1)
                    .await;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            iso.admin(reopen).await;
        }
        let stats = consumer.finish(published).await;
        assert_eq!(
            (stats.processed, stats.dead_lettered),
            (published, 0),
            "{batch:?}: {stats:?}"
        );
        assert!(stats.database_outages >= 1, "{stats:?}");
        assert_eq!(broker.ready(&format!("{queue}.dlq")).await, 0);
        assert_eq!(iso.db.balances().await["mo"], published as i64);
        iso.drop().await;
    }
}

/// A read-only database (a demoted primary, a replica behind a failover
/// address) is an outage, not the messages' fault: the deliveries wait at the
/// gate, spend no attempt, and are applied once the database takes writes
/// again. The connections opened while it was read-only stay read-only: the
/// gate's probe replaces them (no kick after the reopening).
#[tokio::test]
async fn a_read_only_database_holds_deliveries_and_dead_letters_nothing() {
    for batch in [None, Some(10)] {
        let iso = support::IsolatedDb::new().await;
        let broker = Broker::connect().await;
        let queue = unique("readonly");
        broker.declare(&queue).await;
        // One attempt: a refusal taken for the message's failure would
        // dead-letter it at once.
        let consumer = payments_on_isolated(&iso, &queue, batch, 1);
        broker.publish_payment(&queue, "pay-before", "ro", 1).await;
        consumer.settled(1).await;
        iso.admin("ALTER ROLE {name} SET default_transaction_read_only = on")
            .await;
        iso.kick().await;
        for n in 0..10 {
            broker
                .publish_payment(&queue, &format!("pay-{n}"), "ro", 1)
                .await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(consumer.stats().dead_lettered, 0, "{batch:?}");
        assert!(
            consumer.stats().database_outages >= 1,
            "{batch:?}: the gate closed: {:?}",
            consumer.stats()
        );
        iso.admin("ALTER ROLE {name} RESET default_transaction_read_only")
            .await;
        let stats = consumer.finish(11).await;
        assert_eq!(
            (stats.processed, stats.dead_lettered, stats.retried),
            (11, 0, 0),
            "{batch:?}: {stats:?}"
        );
        assert!(stats.database_outages >= 1, "{stats:?}");
        assert_eq!(broker.ready(&format!("{queue}.dlq")).await, 0);
        assert_eq!(iso.db.balances().await["ro"], 11);
        iso.drop().await;
    }
}

/// Each line of `idempo::Error::is_unavailable`'s SQLSTATE table, raised by
/// the server in the handler's transaction (the first two passes of each
/// message): the delivery waits at the gate and is applied once, spending no
/// attempt; with one attempt allowed, anything else would dead-letter it.
#[tokio::test]
async fn every_state_of_a_database_that_cannot_write_now_waits_at_the_gate() {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    const STATES: [&str; 15] = [
        "08006", "25006", "53000", "53100", "53200", "53300", "53400", "57P01", "57P02", "57P03",
        "57P04", "57P05", "58000", "58030", "58P01",
    ];
    for batch in [None, Some(5)] {
        let (db, broker, queue) = support::setup().await;
        for state in STATES {
            broker
                .publish_payment(&queue, &format!("state-{state}"), "st", 1)
                .await;
        }
        let seen = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
        let handler = move |tx: idempo::Tx, message: idempo::consumer::Message| {
            let seen = seen.clone();
            async move {
                let passes = {
                    let mut seen = seen.lock().unwrap();
                    let passes = seen.entry(message.id().to_owned()).or_default();
                    *passes += 1;
                    *passes
                };
                if passes <= 2 {
                    let state = message.id().trim_start_matches("state-");
                    let raise = format!(
                        "DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '{state}'; END $$"
                    );
                    sqlx::query(sqlx::AssertSqlSafe(raise))
                        .execute(&mut *tx.try_lock()?)
                        .await?;
                }
                let payment: payments::Payment = message.json()?;
                payments::apply(tx, message.id(), &payment, 0.0).await?;
                Ok(())
            }
        };
        let base = consumer_for(&db, &queue)
            .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]).max_attempts(1));
        let consumer = match batch {
            None => Running::start(base.handler(handler)),
            Some(size) => Running::start(base.handler(handler).prefetch(20).batch(size)),
        };
        let stats = consumer.finish(STATES.len() as u64).await;
        assert_eq!(
            (stats.processed, stats.dead_lettered, stats.retried),
            (STATES.len() as u64, 0, 0),
            "{batch:?}: {stats:?}"
        );
        assert!(stats.database_outages >= 1, "{stats:?}");
        assert_eq!(broker.ready(&format!("{queue}.dlq")).await, 0);
        assert_eq!(db.balances().await["st"], STATES.len() as i64);
    }
}

/// `?` on a database error that the same data will raise again (here a
/// division by zero, 22012) dead-letters at once; a statement timeout
/// (57014) is retried; the handler's explicit kind overrides the default.
#[tokio::test]
async fn deterministic_database_errors_are_dead_lettered_at_once_and_timeouts_retried() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (db, broker, queue) = support::setup().await;
    for id in ["pay-zero", "pay-timeout", "pay-forced"] {
        broker.publish_payment(&queue, id, "una", 1).await;
    }
    let timeouts = std::sync::Arc::new(AtomicUsize::new(0));
    let handler = move |tx: idempo::Tx, message: idempo::consumer::Message| {
        let timeouts = timeouts.clone();
        async move {
            let mut conn = tx.try_lock()?;
            match message.id() {
                "pay-zero" => {
                    sqlx::query("SELECT 1 / 0").execute(&mut *conn).await?;
                }
                "pay-timeout" if timeouts.fetch_add(1, Ordering::SeqCst) == 0 => {
                    sqlx::query("SET LOCAL statement_timeout = 1")
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query("SELECT pg_sleep(1)")
                        .execute(&mut *conn)
                        .await?;
                }
                "pay-forced" => {
                    // Permanent by default; this handler says otherwise.
                    sqlx::query("SELECT 1 / 0")
                        .execute(&mut *conn)
                        .await
                        .map_err(idempo::consumer::HandlerError::transient)?;
                }
                _ => {}
            }
            Ok(())
        }
    };
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]).max_attempts(3))
            .handler(handler),
    );
    let stats = consumer.finish(3).await;

    let dead = broker.drain(&format!("{queue}.dlq")).await;
    let find = |id: &str| {
        dead.iter()
            .find(|d| d.message_id.as_deref() == Some(id))
            .unwrap_or_else(|| panic!("{id} is not in the DLQ: {dead:?}"))
    };
    let zero = find("pay-zero");
    assert_eq!(zero.reason(), "permanent handler error");
    assert!(
        zero.headers["x-idempo-error"].contains("division by zero"),
        "{zero:?}"
    );
    assert_eq!(zero.headers["x-idempo-attempts"], "1", "no retry");
    assert_eq!(find("pay-forced").reason(), "max attempts exceeded");
    assert_eq!(dead.len(), 2, "pay-timeout was retried, then applied");
    assert_eq!(stats.processed, 1, "{stats:?}");
    assert_eq!(stats.retried, 1 + 2, "one timeout, two forced retries");
}

#[tokio::test]
async fn payments_that_can_never_apply_are_dead_lettered_and_the_account_keeps_working() {
    let (db, broker, queue) = support::setup().await;
    let cases = [
        ("pay-huge", support::payment_body("vic", i64::MAX)),
        ("pay-long", support::payment_body(&"v".repeat(3000), 1)),
        ("pay-nul", support::payment_body("v\0ic", 1)),
        ("pay-ok", support::payment_body("vic", 7)),
    ];
    let messages: Vec<(String, Vec<u8>)> = cases
        .iter()
        .map(|(id, body)| (id.to_string(), body.clone()))
        .collect();
    broker.publish_many(&queue, &messages).await;
    let consumer = Running::start(payments_consumer(&db, &queue).concurrency(1));
    let stats = consumer.finish(4).await;

    assert_eq!(
        (stats.processed, stats.dead_lettered, stats.retried),
        (1, 3, 0)
    );
    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert!(
        dead.iter().all(|d| d.reason() == "permanent handler error"),
        "{dead:?}"
    );
    assert_eq!(db.balances().await["vic"], 7);
}

#[tokio::test]
async fn a_deleted_delay_queue_or_dead_letter_queue_is_declared_again() {
    let (db, broker, queue) = support::setup().await;
    let (_, handler) = counting_payments(1, None);
    let consumer = Running::start(consumer_for(&db, &queue).handler(handler));
    tokio::time::timeout(WAIT, consumer.health.wait_for(|h| h.is_consuming()))
        .await
        .expect("consuming");
    // An operator deletes the delay queue and the DLQ.
    let (delay, dlq) = (format!("{queue}.retry.50ms"), format!("{queue}.dlq"));
    broker.delete(&delay).await;
    broker.delete(&dlq).await;
    broker.publish_payment(&queue, "pay-back", "zed", 3).await;
    broker
        .publish(&queue, Some("poison-back"), b"not json")
        .await;
    eventually("the payment applied after its retry", WAIT, || async {
        db.payments_for("pay-back").await == 1
    })
    .await;
    broker.track(&dlq);
    eventually("the poison in the DLQ declared again", WAIT, || async {
        broker.ready(&dlq).await == 1
    })
    .await;
    let stats = consumer.stats();
    consumer.stop().await.unwrap();
    assert!(
        stats.reconnects >= 1,
        "a new session declared them: {stats:?}"
    );
    assert_eq!(broker.drain(&dlq).await[0].reason(), "undecodable body");
}

#[tokio::test]
async fn without_declaring_a_missing_delay_queue_still_runs_out_of_attempts() {
    let (db, broker, queue) = support::setup().await; // the work queue and the DLQ only
    let (seen, handler) = counting_payments(usize::MAX, None);
    let consumer = Running::start(
        consumer_for(&db, &queue)
            .declare(false)
            .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]).max_attempts(3))
            .handler(handler),
    );
    broker
        .publish_payment(&queue, "pay-nodelay", "zoe", 3)
        .await;
    consumer.settled(1).await;
    let health = consumer.health.snapshot();
    consumer.stop().await.unwrap();

    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason(), "max attempts exceeded");
    assert_eq!(dead[0].headers["x-idempo-attempts"], "3");
    assert_eq!(
        seen.lock().unwrap().headers.len(),
        3,
        "three attempts, counted"
    );
    let error = health.last_error.unwrap_or_default();
    assert!(error.contains("does not exist"), "{error}");
}

#[tokio::test]
async fn a_queue_declared_with_other_arguments_is_a_configuration_error() {
    let (db, broker) = (Db::new().await, Broker::connect().await);
    let queue = unique("conflict");
    broker
        .declare_as(&queue, "classic")
        .await
        .expect("a classic queue");
    // The runtime declares quorum queues by default: run returns the error.
    let consumer = Running::start(payments_consumer(&db, &queue));
    let ended = tokio::time::timeout(WAIT, consumer.task)
        .await
        .expect("run returns instead of retrying forever")
        .expect("no panic");
    let error = ended.expect_err("a topology conflict");
    assert!(
        matches!(idempo::amqp::AmqpError::of(&error), Some(idempo::amqp::AmqpError::TopologyConflict { queue: q, .. }) if *q == queue),
        "{error}"
    );
    assert!(error.to_string().contains("x-queue-type"), "{error}");
    assert_eq!(consumer.stats.snapshot().session_failures, 1);

    // Asked to wait, it keeps trying (and counts the failures) until stopped.
    let waiting = Running::start(payments_consumer(&db, &queue).wait_for_topology(true));
    eventually("two failed sessions", WAIT, || async {
        waiting.stats().session_failures >= 2
    })
    .await;
    let error = waiting.health.snapshot().last_error.unwrap_or_default();
    assert!(error.contains("exist with other arguments"), "{error}");
    waiting.stop().await.unwrap();
}

#[tokio::test]
async fn the_example_exits_non_zero_on_a_topology_conflict() {
    let (db, broker) = (Db::new().await, Broker::connect().await);
    let queue = unique("conflict");
    broker.declare_as(&queue, "classic").await.unwrap();
    let out = tokio::time::timeout(
        WAIT,
        tokio::process::Command::new(support::payments_example_binary())
            .env("DATABASE_URL", &db.url)
            .env("AMQP_URL", support::amqp_url())
            .env("PAYMENTS_QUEUE", &queue)
            .env("PAYMENTS_CONCURRENCY", "4")
            .output(),
    )
    .await
    .expect("the example exits")
    .expect("run the example");
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("exist with other arguments"), "{stderr}");
}

/// Messages whose short strings are not UTF-8 (published by a foreign
/// client: lapin cannot even express them) used to kill every session: the
/// queue stood still behind the first one. Now each reaches the DLQ and the
/// good payments behind it apply, in per-message and in batch mode.
#[tokio::test]
async fn a_delivery_the_client_cannot_parse_is_dead_lettered_and_the_queue_moves_on() {
    use support::pika::RawMessage;
    for batch in [None, Some(10)] {
        let (db, broker, queue) = support::setup().await;
        let body = support::payment_body("ana", 1);
        let mut messages = vec![
            RawMessage {
                body: body.clone(),
                message_id: Some(b"bad-\xff\xfe".to_vec()),
                ..Default::default()
            },
            RawMessage {
                body: body.clone(),
                message_id: Some(b"bad-content-type".to_vec()),
                content_type: Some(b"text/\xc3\x28".to_vec()),
                ..Default::default()
            },
            RawMessage {
                body: body.clone(),
                message_id: Some(b"bad-header".to_vec()),
                headers: vec![(b"x-\xe2\x82".to_vec(), "v".into())],
                ..Default::default()
            },
        ];
        for i in 0..20 {
            messages.push(RawMessage {
                body: body.clone(),
                message_id: Some(format!("good-{i}").into_bytes()),
                ..Default::default()
            });
        }
        support::pika::publish(&queue, &messages);
        let consumer = match batch {
            None => Running::start(payments_consumer(&db, &queue)),
            Some(size) => Running::start(
                consumer_for(&db, &queue)
                    .prefetch(30)
                    .handler(|tx, m| payments::handle(tx, m, 0.0))
                    .batch(size),
            ),
        };
        eventually("the good payments applied", WAIT, || async {
            db.payments().await == 20
        })
        .await;
        let stats = consumer.stats();
        consumer.stop().await.unwrap();

        assert_eq!(stats.poison_frames, 3, "{batch:?}: {stats:?}");
        let dead = broker.drain(&format!("{queue}.dlq")).await;
        assert_eq!(dead.len(), 3, "{dead:?}");
        assert!(dead.iter().all(|d| d.reason() == "undecodable properties"));
        let errors: Vec<&str> = dead
            .iter()
            .map(|d| d.headers["x-idempo-error"].as_str())
            .collect();
        assert!(
            errors
                .iter()
                .any(|e| e.contains("message_id is not valid UTF-8 (hex 6261642dfffe)")),
            "{errors:?}"
        );
        assert!(
            errors.iter().any(|e| e.contains("content_type")),
            "{errors:?}"
        );
        assert!(
            errors.iter().any(|e| e.contains("header name")),
            "{errors:?}"
        );
        assert_eq!(db.balances().await["ana"], 20);
        assert_eq!(broker.ready(&queue).await, 0);
    }
}

/// When the poison cannot be moved (here the DLQ is gone and the consumer
/// does not declare queues), Health says the queue is stuck.
#[tokio::test]
async fn a_delivery_that_keeps_killing_the_connection_is_reported_in_health() {
    use support::pika::RawMessage;
    let (db, broker, queue) = support::setup().await;
    broker.delete(&format!("{queue}.dlq")).await;
    support::pika::publish(
        &queue,
        &[RawMessage {
            body: support::payment_body("bo", 1),
            message_id: Some(b"bad-\xff".to_vec()),
            ..Default::default()
        }],
    );
    let consumer = Running::start(payments_consumer(&db, &queue).declare(false));
    tokio::time::timeout(WAIT, consumer.health.wait_for(|h| h.wedged_sessions >= 3))
        .await
        .expect("three wedged sessions are reported");
    let health = consumer.health.snapshot();
    consumer.stop().await.unwrap();
    assert!(!health.is_healthy());
    let error = health.last_error.unwrap_or_default();
    assert!(error.contains("stuck behind it"), "{error}");
    // Nothing lost: the message is still there for a human.
    support::eventually_ready(&broker, &queue, 1).await;
}

/// A message whose headers nearly fill RabbitMQ's frame (131,072 bytes): its
/// dead letter, with idempo's headers added, would not fit, and RabbitMQ
/// would close the whole connection (`FRAME_ERROR`), again on every
/// redelivery. The copy is trimmed to fit instead (the trimming recorded),
/// and the payments behind it apply without a single reconnect, in
/// per-message and in batch mode.
#[tokio::test]
async fn a_dead_letter_too_large_for_a_frame_is_trimmed_and_the_connection_survives() {
    use lapin::types::{AMQPValue, FieldTable};
    for batch in [None, Some(10)] {
        let (db, broker, queue) = support::setup().await;
        let mut headers = FieldTable::default();
        headers.insert(
            "x-pad".into(),
            AMQPValue::LongString("p".repeat(130_800).into()),
        );
        let big = lapin::BasicProperties::default()
            .with_message_id("big".into())
            .with_headers(headers);
        broker.publish_props(&queue, big, b"not json").await;
        let payments: Vec<(String, Vec<u8>)> = (0..50)
            .map(|i| (format!("pay-{i}"), support::payment_body("ann", 1)))
            .collect();
        broker.publish_many(&queue, &payments).await;

        let consumer = match batch {
            None => Running::start(payments_consumer(&db, &queue)),
            Some(size) => Running::start(
                consumer_for(&db, &queue)
                    .prefetch(60)
                    .handler(|tx, m| payments::handle(tx, m, 0.0))
                    .batch(size),
            ),
        };
        eventually("the 50 payments applied", WAIT, || async {
            db.payments().await == 50
        })
        .await;
        let stats = consumer.finish(51).await;

        assert_eq!(
            (stats.processed, stats.dead_lettered, stats.reconnects),
            (50, 1, 0),
            "{batch:?}: {stats:?}"
        );
        let dead = broker.drain(&format!("{queue}.dlq")).await;
        assert_eq!(dead.len(), 1, "{batch:?}");
        let h = &dead[0].headers;
        assert_eq!(h["x-idempo-reason"], "undecodable body");
        assert_eq!(dead[0].message_id.as_deref(), Some("big"));
        assert_eq!(dead[0].body, b"not json");
        assert!(
            !h.contains_key("x-pad"),
            "{batch:?}: the padding was trimmed"
        );
        assert!(
            h["x-idempo-trimmed-headers"].starts_with("x-pad="),
            "{}",
            h["x-idempo-trimmed-headers"]
        );
        assert!(h.contains_key("x-idempo-error") && h.contains_key("x-idempo-original-queue"));
        assert_eq!(db.balances().await["ann"], 50);
        assert_eq!(broker.ready(&queue).await, 0);
    }
}

/// A retry copy that would not fit the frame cannot be retried at all: it is
/// dead-lettered (trimmed) with reason `headers too large to retry`.
#[tokio::test]
async fn a_retry_too_large_for_a_frame_is_dead_lettered_instead() {
    use lapin::types::{AMQPValue, FieldTable};
    let (db, broker, queue) = support::setup().await;
    let mut headers = FieldTable::default();
    headers.insert(
        "x-pad".into(),
        AMQPValue::LongString("p".repeat(130_800).into()),
    );
    let big = lapin::BasicProperties::default()
        .with_message_id("big".into())
        .with_headers(headers);
    broker
        .publish_props(&queue, big, &support::payment_body("ann", 1))
        .await;
    let (seen, handler) = counting_payments(usize::MAX, None);
    let consumer = Running::start(consumer_for(&db, &queue).handler(handler));
    let stats = consumer.finish(1).await;

    assert_eq!(seen.lock().unwrap().headers.len(), 1, "one attempt");
    assert_eq!(
        (stats.retried, stats.dead_lettered, stats.reconnects),
        (0, 1, 0),
        "{stats:?}"
    );
    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason(), "headers too large to retry");
    assert!(dead[0].headers["x-idempo-error"].contains("downstream unavailable"));
    assert!(dead[0].headers["x-idempo-trimmed-headers"].starts_with("x-pad="));
    assert_eq!(db.payments().await, 0);
}
