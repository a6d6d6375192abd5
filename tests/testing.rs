//! The test harness (`idempo::testing`) against the real PostgreSQL, with no
//! broker at all: the `payments` example's handlers through redeliveries,
//! lost acks, storms on one id, poison, faults of each class, batch mode,
//! and a two-service chain through the outbox.
//!
//! Each harness works in a schema of its own (4 connections) and drops it at
//! the end; a test holds at most two harnesses and a 2-connection admin pool.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use idempo::Tx;
use idempo::consumer::{DeadLetterReason, HandlerError, JsonBody, Message, RedeliveryPolicy};
use idempo::testing::{Delivered, Fault, Harness};
use sqlx::postgres::PgPoolOptions;
use support::payments::{self, Behaviour, Payment};

/// A per-message harness over the example's handler; `forward_to` forwards
/// each payment through the outbox.
async fn payments_harness(queue: &str, forward_to: Option<&str>) -> Harness {
    let behaviour = Behaviour {
        fail_rate: 0.0,
        forward_to: forward_to.map(Into::into),
    };
    Harness::new(support::small_pool().await, queue)
        .setup(payments::TABLES)
        .configure(|c| c.handler_timeout(Duration::from_millis(300)))
        .handler(move |tx: Tx, m: (JsonBody<Payment>, Message)| {
            payments::handle(tx, m, behaviour.clone())
        })
        .await
        .expect("harness")
}

fn payment(account: &str, cents: i64) -> Payment {
    Payment {
        account: account.into(),
        amount_cents: cents,
    }
}

async fn rows(h: &Harness, id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments WHERE message_id = $1")
        .bind(id)
        .fetch_one(h.pool())
        .await
        .unwrap()
}

async fn balances(h: &Harness) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT account, balance_cents FROM account_balances")
        .fetch_all(h.pool())
        .await
        .unwrap()
        .into_iter()
        .collect()
}

#[tokio::test]
async fn a_payment_applies_once_through_redeliveries_lost_acks_and_storms() {
    let h = payments_harness("payments", None).await;
    let m = h.json("p-1", &payment("alice", 500));
    let first = h.deliver(m.clone()).await.unwrap();
    assert!(first.is_acked(), "{first}");
    let again = h.deliver(m.clone()).await.unwrap();
    assert!(again.is_duplicate(), "{again}");

    let lost = h
        .deliver_after_lost_ack(h.json("p-2", &payment("alice", 70)))
        .await
        .unwrap();
    assert!(lost.is_duplicate(), "{lost}");

    let storm = h
        .deliver_concurrently(h.json("p-3", &payment("bob", 9)), 8)
        .await
        .unwrap();
    let acked = storm.iter().filter(|d| d.is_acked()).count();
    let duplicates = storm.iter().filter(|d| d.is_duplicate()).count();
    assert_eq!((acked, duplicates), (1, 7), "{storm:?}");

    for id in ["p-1", "p-2", "p-3"] {
        assert_eq!(rows(&h, id).await, 1, "{id} applied once");
    }
    assert_eq!(
        balances(&h).await,
        BTreeMap::from([("alice".into(), 570), ("bob".into(), 9)])
    );
    assert_eq!(h.stats().snapshot().processed, 3);
    h.close().await;
}

#[tokio::test]
async fn poison_reused_ids_and_refused_payments_are_dead_lettered_without_effects() {
    let h = payments_harness("payments", None).await;
    let poison = h.deliver(h.message("bad-1", "not json")).await.unwrap();
    assert_eq!(
        poison.dead_letter_reason(),
        Some(DeadLetterReason::UndecodableBody),
        "{poison}"
    );
    // The dead letter carries the runtime's headers.
    let Delivered::DeadLettered { copy, .. } = &poison else {
        panic!("{poison}")
    };
    assert!(copy.header_text("x-idempo-reason").is_some(), "{copy:?}");

    let no_id = h.message_without_id("{}");
    let missing = h.deliver(no_id).await.unwrap();
    assert_eq!(
        missing.dead_letter_reason(),
        Some(DeadLetterReason::MissingMessageId),
        "{missing}"
    );

    assert!(
        h.deliver(h.json("p-9", &payment("carol", 5)))
            .await
            .unwrap()
            .is_acked()
    );
    let reused = h
        .deliver(h.json("p-9", &payment("carol", 6)))
        .await
        .unwrap();
    assert!(reused.is_mismatch(), "{reused}");

    let refused = h
        .deliver(h.json("p-10", &payment("carol", -1)))
        .await
        .unwrap();
    assert_eq!(
        refused.dead_letter_reason(),
        Some(DeadLetterReason::PermanentError),
        "{refused}"
    );
    assert_eq!(rows(&h, "p-10").await, 0);
    assert_eq!(balances(&h).await, BTreeMap::from([("carol".into(), 5)]));
    h.close().await;
}

#[tokio::test]
async fn each_handler_fault_rolls_back_and_takes_the_runtimes_path() {
    let h = payments_harness("payments", None).await;

    let transient = h
        .deliver_with(h.json("t-1", &payment("dave", 10)), Fault::Transient)
        .await
        .unwrap();
    assert_eq!(
        transient.retry_delay(),
        Some(Duration::from_secs(1)),
        "{transient}"
    );
    assert_eq!(transient.attempt(), Some(1));
    assert_eq!(rows(&h, "t-1").await, 0, "rolled back");
    // The retry copy carries the attempt and is deduplicated on the same id.
    let retried = h.deliver(transient.redelivery().unwrap()).await.unwrap();
    assert!(retried.is_acked(), "{retried}");
    assert!(
        h.deliver(h.json("t-1", &payment("dave", 10)))
            .await
            .unwrap()
            .is_duplicate()
    );

    let permanent = h
        .deliver_with(h.json("t-2", &payment("dave", 20)), Fault::Permanent)
        .await
        .unwrap();
    assert_eq!(
        permanent.dead_letter_reason(),
        Some(DeadLetterReason::PermanentError),
        "{permanent}"
    );

    let panicked = h
        .deliver_with(h.json("t-3", &payment("dave", 30)), Fault::Panic)
        .await
        .unwrap();
    assert!(panicked.is_retried(), "{panicked}");
    assert!(panicked.error().unwrap().contains("panicked"), "{panicked}");

    let timed_out = h
        .deliver_with(h.json("t-4", &payment("dave", 40)), Fault::Timeout)
        .await
        .unwrap();
    assert!(timed_out.is_retried(), "{timed_out}");
    assert!(
        timed_out.error().unwrap().contains("timed out"),
        "{timed_out}"
    );

    for id in ["t-2", "t-3", "t-4"] {
        assert_eq!(rows(&h, id).await, 0, "{id} rolled back");
    }

    // The backend dies in COMMIT: nothing committed, the consumer waits at
    // the gate, claims again, runs the handler again: one effect, acked.
    let cut = h
        .deliver_with(
            h.json("t-5", &payment("erin", 50)),
            Fault::CommitConnectionLost,
        )
        .await
        .unwrap();
    assert!(cut.is_acked(), "{cut}");
    assert_eq!(rows(&h, "t-5").await, 1);
    assert!(
        h.deliver(h.json("t-5", &payment("erin", 50)))
            .await
            .unwrap()
            .is_duplicate()
    );
    assert_eq!(
        balances(&h).await,
        BTreeMap::from([("dave".into(), 10), ("erin".into(), 50)])
    );
    h.close().await;
}

#[tokio::test]
async fn transient_failures_run_out_into_the_dead_letters() {
    let h = Harness::new(support::small_pool().await, "payments")
        .setup(payments::TABLES)
        .configure(|c| {
            c.redelivery(
                RedeliveryPolicy::delayed([Duration::from_secs(1), Duration::from_secs(5)])
                    .max_attempts(3),
            )
        })
        .handler(|tx: Tx, m: (JsonBody<Payment>, Message)| payments::handle(tx, m, 0.0))
        .await
        .unwrap();
    let mut next = h.json("r-1", &payment("frank", 1));
    let mut seen = Vec::new();
    let last = loop {
        let d = h.deliver_with(next, Fault::Transient).await.unwrap();
        match d.redelivery() {
            Some(copy) => {
                seen.push((d.attempt().unwrap(), d.retry_delay().unwrap()));
                next = copy;
            }
            None => break d,
        }
    };
    assert_eq!(
        seen,
        vec![(1, Duration::from_secs(1)), (2, Duration::from_secs(5))]
    );
    assert_eq!(
        last.dead_letter_reason(),
        Some(DeadLetterReason::AttemptsExhausted),
        "{last}"
    );
    assert_eq!(rows(&h, "r-1").await, 0);
    h.close().await;
}

#[tokio::test]
async fn broken_handlers_get_the_runtimes_outcome() {
    // Ends the transaction itself: the claim and the writes are gone.
    let h = Harness::new(support::small_pool().await, "broken")
        .setup("CREATE TABLE effects (id text)")
        .handler(|tx: Tx, m: Message| async move {
            let mut tx = tx.try_lock()?;
            sqlx::query("INSERT INTO effects VALUES ($1)")
                .bind(m.id())
                .execute(&mut *tx)
                .await?;
            if m.id() == "rollback" {
                sqlx::query("ROLLBACK").execute(&mut *tx).await?;
            } else {
                // A failed statement whose error is ignored.
                let _ = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
            }
            Ok::<(), HandlerError>(())
        })
        .await
        .unwrap();
    let rolled_back = h.deliver(h.message("rollback", "x")).await.unwrap();
    assert!(rolled_back.is_retried(), "{rolled_back}");
    assert!(
        rolled_back
            .error()
            .unwrap()
            .contains("ended the transaction itself"),
        "{rolled_back}"
    );
    let aborted = h.deliver(h.message("ignored", "x")).await.unwrap();
    assert!(aborted.is_retried(), "{aborted}");
    assert!(aborted.error().unwrap().contains("aborted"), "{aborted}");
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(h.pool())
        .await
        .unwrap();
    assert_eq!(effects, 0, "neither committed");
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_messages")
        .fetch_one(h.pool())
        .await
        .unwrap();
    assert_eq!(claims, 0, "neither claimed: both will run again");
    h.close().await;
}

#[tokio::test]
async fn a_batch_is_one_unit_and_poison_leaves_it_alone() {
    let h = Harness::new(support::small_pool().await, "payments-batch")
        .setup(payments::TABLES)
        .batch_handler(|tx: Tx, batch: Vec<(JsonBody<Payment>, Message)>| {
            payments::handle_batch(tx, batch, 0.0)
        })
        .await
        .unwrap();
    let mut batch: Vec<Message> = (0..10)
        .map(|i| h.json(&format!("b-{i}"), &payment("gina", 1)))
        .collect();
    batch.insert(4, h.message("b-poison", "{\"account\":"));
    batch.insert(7, h.json("b-refused", &payment("gina", -5)));
    let delivered = h.deliver_all(batch.clone()).await.unwrap();
    assert_eq!(delivered.len(), 12);
    assert_eq!(
        delivered[4].dead_letter_reason(),
        Some(DeadLetterReason::UndecodableBody),
        "{}",
        delivered[4]
    );
    assert_eq!(
        delivered[7].dead_letter_reason(),
        Some(DeadLetterReason::PermanentError),
        "{}",
        delivered[7]
    );
    let acked = delivered.iter().filter(|d| d.is_acked()).count();
    assert_eq!(acked, 10, "{delivered:?}");
    assert_eq!(balances(&h).await, BTreeMap::from([("gina".into(), 10)]));

    let again = h.deliver_all(batch).await.unwrap();
    let duplicates = again.iter().filter(|d| d.is_duplicate()).count();
    assert_eq!(duplicates, 10, "{again:?}");
    assert_eq!(balances(&h).await, BTreeMap::from([("gina".into(), 10)]));
    h.close().await;
}

#[tokio::test]
async fn two_services_chained_through_the_outbox_keep_equal_ledgers() {
    let a = payments_harness("payments", Some("ledger")).await;
    let b = payments_harness("ledger", None).await;
    let sent = [
        ("c-1", "hana", 100),
        ("c-2", "ivan", 20),
        ("c-3", "hana", 3),
    ];
    for (id, account, cents) in sent {
        let m = a.json(id, &payment(account, cents));
        assert!(a.deliver(m.clone()).await.unwrap().is_acked());
        // A redelivery stages nothing more.
        assert!(a.deliver(m).await.unwrap().is_duplicate());
    }
    let staged = a.outbox().await.unwrap();
    assert_eq!(staged.len(), 3);
    let first: Payment = staged[0].body_json().unwrap();
    assert_eq!((first.account.as_str(), first.amount_cents), ("hana", 100));
    assert_eq!(staged[0].routing_key(), "ledger");
    assert_eq!(
        staged[0].id(),
        Some(crate::support::derived_id("c-1", "forward").as_str())
    );

    let published = a.drain().await.unwrap();
    assert_eq!(published, staged, "published in staging order");
    assert!(
        a.outbox().await.unwrap().is_empty(),
        "the relay deleted them"
    );
    assert!(a.drain().await.unwrap().is_empty());

    for m in &published {
        assert!(b.deliver(b.forwarded(m)).await.unwrap().is_acked());
        // The relay resent it (a lost confirm): deduplicated downstream.
        assert!(b.deliver(b.forwarded(m)).await.unwrap().is_duplicate());
    }
    assert_eq!(balances(&a).await, balances(&b).await);
    assert_eq!(
        balances(&b).await,
        BTreeMap::from([("hana".into(), 103), ("ivan".into(), 20)])
    );
    a.close().await;
    b.close().await;
}

#[tokio::test]
async fn an_unreachable_database_is_named_in_the_error() {
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/nowhere")
        .unwrap();
    let error = Harness::new(pool, "q")
        .handler(|_tx: Tx, _m: Message| async { Ok::<(), HandlerError>(()) })
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("127.0.0.1:1/nowhere"), "{error}");
}

#[tokio::test]
async fn harnesses_do_not_share_claims() {
    let one = payments_harness("payments", None).await;
    let two = payments_harness("payments", None).await;
    let m = one.json("same", &payment("jo", 1));
    assert!(one.deliver(m.clone()).await.unwrap().is_acked());
    assert!(
        two.deliver(two.json("same", &payment("jo", 1)))
            .await
            .unwrap()
            .is_acked()
    );
    assert_ne!(one.schema(), two.schema());
    let schema = one.schema().to_owned();
    let admin = support::small_pool().await;
    one.close().await;
    two.close().await;
    let left: Option<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname = $1")
            .bind(&schema)
            .fetch_optional(&admin)
            .await
            .unwrap();
    assert_eq!(left, None, "close drops the schema");
}
