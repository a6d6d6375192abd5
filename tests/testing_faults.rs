//! The harness's own promises, tried as a user's test crate would from the
//! docs alone: a fault belongs to its delivery, a delivery says what it
//! staged, a batch can carry one faulty message, the database can be made
//! unavailable, and nothing hangs or misleads.

mod support;

use std::time::Duration;

use idempo::Tx;
use idempo::consumer::{DeadLetterReason, HandlerError, JsonBody, Message};
use idempo::testing::{Fault, Harness};
use sqlx::postgres::PgPoolOptions;
use support::payments::{self, Behaviour, Payment};

fn payment(account: &str, cents: i64) -> Payment {
    Payment {
        account: account.into(),
        amount_cents: cents,
    }
}

/// The payments handler, forwarding each payment to `forwarded` through
/// the outbox.
async fn harness(queue: &str) -> Harness {
    let behaviour = Behaviour {
        fail_rate: 0.0,
        forward_to: Some("forwarded".into()),
    };
    Harness::new(support::small_pool().await, queue)
        .setup(payments::TABLES)
        .configure(|c| c.handler_timeout(Duration::from_millis(300)))
        .hold_timeout(Duration::from_millis(800))
        .handler(move |tx: Tx, m: (JsonBody<Payment>, Message)| {
            payments::handle(tx, m, behaviour.clone())
        })
        .await
        .expect("harness")
}

#[tokio::test]
async fn a_fault_belongs_to_its_delivery_not_to_a_copy_beside_it() {
    let h = harness("faults").await;
    for i in 0..30 {
        let m = h.json(&format!("p-{i}"), &payment("a", 1));
        let (faulted, plain) = tokio::join!(
            h.deliver_with(m.clone(), Fault::Permanent),
            h.deliver(m.clone())
        );
        let (faulted, plain) = (faulted.unwrap(), plain.unwrap());
        assert!(
            plain.is_acked() || plain.is_duplicate(),
            "run {i}: the copy without a fault: {plain}"
        );
        assert!(
            faulted.is_dead_lettered() || faulted.is_duplicate(),
            "run {i}: the faulted copy: {faulted}"
        );
    }
    h.close().await;
}

#[tokio::test]
async fn a_delivery_says_what_its_transaction_staged() {
    let h = harness("staged").await;
    let one = h.deliver(h.json("s-1", &payment("a", 1))).await.unwrap();
    let two = h.deliver(h.json("s-2", &payment("b", 2))).await.unwrap();
    for (d, account) in [(&one, "a"), (&two, "b")] {
        assert_eq!(d.staged().len(), 1, "{d}");
        let body: serde_json::Value = d.staged()[0].body_json().unwrap();
        assert_eq!(body["account"], account, "{d}");
    }
    // The outbox holds both until drained; each delivery names its own.
    assert_eq!(h.outbox().await.unwrap().len(), 2);
    let again = h.deliver(h.json("s-1", &payment("a", 1))).await.unwrap();
    assert!(again.is_duplicate() && again.staged().is_empty(), "{again}");
    h.close().await;
}

#[tokio::test]
async fn one_faulty_message_in_a_batch_is_found_and_the_rest_apply() {
    let h = Harness::new(support::small_pool().await, "batch-faults")
        .setup(payments::TABLES)
        .batch_handler(|tx: Tx, batch: Vec<(JsonBody<Payment>, Message)>| {
            payments::handle_batch(tx, batch, 0.0)
        })
        .await
        .unwrap();
    let messages = (0..5).map(|i| {
        let m = h.json(&format!("b-{i}"), &payment("z", 1));
        (m, (i == 2).then_some(Fault::Permanent))
    });
    let delivered = h.deliver_all_with(messages).await.unwrap();
    for (i, d) in delivered.iter().enumerate() {
        if i == 2 {
            assert!(d.is_dead_lettered(), "b-2: {d}");
        } else {
            assert!(d.is_acked(), "b-{i}: {d}");
        }
    }
    let balance: i64 =
        sqlx::query_scalar("SELECT balance_cents FROM account_balances WHERE account = 'z'")
            .fetch_one(h.pool())
            .await
            .unwrap();
    assert_eq!(balance, 4);
    h.close().await;
}

#[tokio::test]
async fn an_unavailable_database_holds_the_delivery_with_nothing_written() {
    let h = harness("outage").await;
    let m = h.json("o-1", &payment("o", 5));
    let held = h
        .deliver_with(m.clone(), Fault::DatabaseUnavailable)
        .await
        .unwrap();
    assert!(held.is_held(), "{held}");
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(h.pool())
        .await
        .unwrap();
    assert_eq!(written, 0);
    // Back: the same message applies once.
    assert!(h.deliver(m).await.unwrap().is_acked());
    h.close().await;
}

#[tokio::test]
async fn a_timeout_fault_with_the_default_handler_timeout_is_refused() {
    let h = Harness::new(support::small_pool().await, "slow")
        .handler(|_tx: Tx, _m: Message| async { Ok::<(), HandlerError>(()) })
        .await
        .unwrap();
    let refused = h
        .deliver_with(h.message("t-1", b"x".to_vec()), Fault::Timeout)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("handler_timeout"), "{refused}");
    h.close().await;
}

#[tokio::test]
async fn a_mismatch_is_a_dead_letter_with_its_copy_and_ids_are_readable() {
    let h = harness("mismatch").await;
    let first = h.json("m-1", &payment("a", 1));
    assert_eq!(first.id(), "m-1", "a harness message has its id");
    assert!(h.deliver(first).await.unwrap().is_acked());
    let other = h.deliver(h.json("m-1", &payment("a", 99))).await.unwrap();
    assert!(other.is_mismatch() && other.is_dead_lettered(), "{other}");
    assert_eq!(
        other.dead_letter_reason(),
        Some(DeadLetterReason::PayloadMismatch)
    );
    let copy = other.dead_letter().expect("a mismatch has its dead letter");
    assert_eq!(
        copy.header_text("x-idempo-reason").as_deref(),
        Some(DeadLetterReason::PayloadMismatch.as_str())
    );
    assert_eq!(
        copy.id(),
        "m-1",
        "a copy's id is the id it was deduplicated on"
    );
    // Counters print as numbers.
    let stats = format!("{:?}", h.stats());
    assert!(stats.contains("processed: 1"), "{stats}");
    h.close().await;
}

#[tokio::test]
async fn an_unreachable_database_is_an_outage_not_a_configuration_error() {
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/nowhere")
        .unwrap();
    let error = Harness::new(pool, "q")
        .handler(|_tx: Tx, _m: Message| async { Ok::<(), HandlerError>(()) })
        .await
        .unwrap_err();
    assert!(error.is_unavailable(), "{error}");
    let text = error.to_string();
    assert!(!text.contains("invalid configuration"), "{text}");
    assert!(text.contains("127.0.0.1:1/nowhere"), "{text}");
}
