//! Batches through the state machine: one claim, splits on failure, copies
//! and reused ids, letters met again.

use super::*;

/// A batch handler: writes an effect per message, then, when an id of
/// the batch starts with `swallow`, ignores a failed statement (the
/// transaction is aborted), and when one starts with `rollback`, ends the
/// transaction itself (after every write, so none escapes it); records
/// the ids of each call.
fn whole_batch(calls: Arc<std::sync::Mutex<Vec<Vec<String>>>>) -> Arc<dyn Prepare> {
    let handler = move |tx: Tx, batch: Vec<Message>| {
        let ids: Vec<String> = batch.iter().map(|m| m.id().to_owned()).collect();
        calls.lock().unwrap().push(ids.clone());
        async move {
            let mut conn = tx.try_lock()?;
            for id in &ids {
                sqlx::query("INSERT INTO effects (id) VALUES ($1)")
                    .bind(id)
                    .execute(&mut *conn)
                    .await?;
            }
            if ids.iter().any(|id| id.starts_with("swallow")) {
                let _ = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
            }
            if ids.iter().any(|id| id.starts_with("rollback")) {
                sqlx::query("ROLLBACK").execute(&mut *conn).await?;
            }
            Ok(())
        }
    };
    Arc::new(WholeBatch::new(handler))
}

#[tokio::test]
async fn a_batch_handler_that_aborts_or_ends_its_transaction_commits_nothing() {
    let db = TestDb::new().await;
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let steps = steps(&db.pool, whole_batch(calls.clone()));
    for prefix in ["swallow", "rollback"] {
        let batch: Vec<Message> = (1..=3)
            .map(|n| Message::for_test(&format!("{prefix}-{n}"), b"{}"))
            .collect();
        assert_eq!(
            decide(&steps, &batch).await,
            ["retry", "retry", "retry"],
            "{prefix}"
        );
        assert!(db.effects().await.is_empty(), "{prefix}: no effect commits");
        assert_eq!(db.claims().await, 0, "{prefix}: and no claim");
    }
    let sizes: Vec<usize> = calls.lock().unwrap().iter().map(Vec::len).collect();
    assert_eq!(
        sizes,
        [3, 1, 1, 1, 3, 1, 1, 1],
        "each batch failed whole, then each delivery alone"
    );
    db.drop().await;
}

#[tokio::test]
async fn a_batch_whose_handler_aborts_for_one_delivery_commits_the_others_once() {
    let db = TestDb::new().await;
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let steps = steps(&db.pool, whole_batch(calls.clone()));
    let batch = [
        Message::for_test("ok-1", b"1"),
        Message::for_test("swallow-1", b"2"),
        Message::for_test("ok-2", b"3"),
        Message::for_test("rollback-1", b"4"),
    ];
    assert_eq!(
        decide(&steps, &batch).await,
        ["processed", "retry", "processed", "retry"]
    );
    assert_eq!(db.effects().await, ["ok-1", "ok-2"]);
    assert_eq!(db.claims().await, 2);
    // The redelivery of the whole batch: the committed ones are duplicates.
    assert_eq!(
        decide(&steps, &batch).await,
        ["duplicate", "retry", "duplicate", "retry"]
    );
    assert_eq!(db.effects().await, ["ok-1", "ok-2"], "effects once");
    db.drop().await;
}

/// Fresh ids, one processed before, one repeated in the batch with the
/// same body and with another: a batch handler sees the fresh ones once,
/// and the outcomes are those of the same deliveries one by one.
#[tokio::test]
async fn a_batch_handler_decides_copies_and_reused_ids_as_per_message_mode_does() {
    let batch = [
        Message::for_test("n-1", b"1"),
        Message::for_test("p-0", b"0"), // processed before: duplicate
        Message::for_test("n-1", b"1"), // repeated, same body: duplicate
        Message::for_test("n-1", b"other"), // repeated, other body: mismatch
        Message::for_test("n-2", b"2"),
        Message::for_test("p-0", b"zzz"), // processed before, other body
    ];
    let expected = [
        "processed",
        "duplicate",
        "duplicate",
        "dead letter: message id reused with a different payload",
        "processed",
        "dead letter: message id reused with a different payload",
    ];

    let db = TestDb::new().await;
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let batched = steps(&db.pool, whole_batch(calls.clone()));
    assert_eq!(
        decide(&batched, &[Message::for_test("p-0", b"0")]).await,
        ["processed"]
    );
    assert_eq!(decide(&batched, &batch).await, expected);
    assert_eq!(db.effects().await, ["n-1", "n-2", "p-0"], "effects once");
    assert_eq!(db.claims().await, 3);
    assert_eq!(
        *calls.lock().unwrap(),
        [
            vec!["p-0".to_owned()],
            vec!["n-1".to_owned(), "n-2".to_owned()]
        ],
        "one call for the batch, with its fresh messages only"
    );
    // Again: everything is a copy now, and the handler is not called.
    let again = decide(&batched, &batch).await;
    assert_eq!(
        again,
        [
            "duplicate",
            "duplicate",
            "duplicate",
            "dead letter: message id reused with a different payload",
            "duplicate",
            "dead letter: message id reused with a different payload",
        ]
    );
    assert_eq!(calls.lock().unwrap().len(), 2);
    db.drop().await;

    // The same deliveries one by one, per-message mode.
    let db = TestDb::new().await;
    let single = steps(&db.pool, each());
    assert_eq!(
        decide(&single, &[Message::for_test("p-0", b"0")]).await,
        ["processed"]
    );
    let mut one_by_one = Vec::new();
    for message in &batch {
        one_by_one.extend(decide(&single, std::slice::from_ref(message)).await);
    }
    assert_eq!(one_by_one, expected);
    assert_eq!(db.effects().await, ["n-1", "n-2", "p-0"]);
    db.drop().await;
}

#[tokio::test]
async fn an_undecodable_body_is_dead_lettered_before_any_database_work() {
    let db = TestDb::new().await;
    let typed = |_tx: Tx, JsonBody(_n): JsonBody<i64>| async { Ok(()) };
    let steps = steps(&db.pool, Arc::new(EachMessage::new(typed)));
    let outcome = decide(&steps, &[Message::for_test("pay-x", b"not json")]).await;
    assert_eq!(outcome, ["dead letter: undecodable body"]);
    assert_eq!(db.claims().await, 0);
    db.drop().await;
}

#[tokio::test]
async fn a_batch_claims_once_and_a_failure_splits_it_into_single_deliveries() {
    let db = TestDb::new().await;
    let steps = steps(&db.pool, each());
    assert_eq!(
        decide(&steps, &[Message::for_test("b-0", b"0")]).await,
        ["processed"]
    );
    let batch = [
        Message::for_test("b-1", b"1"),
        Message::for_test("b-0", b"0"), // processed before: duplicate
        Message::for_test("b-0", b"zzz"), // reused with another body
        Message::for_test("b-2", b"2"),
        Message::for_test("b-1", b"1"), // twice in the batch: the first wins
        Message::for_test("fail-b", b"3"), // fails the batch: split
    ];
    assert_eq!(
        decide(&steps, &batch).await,
        [
            "processed",
            "duplicate",
            "dead letter: message id reused with a different payload",
            "processed",
            "duplicate",
            "retry",
        ]
    );
    assert_eq!(db.effects().await, ["b-0", "b-1", "b-2"]);
    db.drop().await;
}

#[tokio::test]
async fn a_batch_handler_gets_the_fresh_messages_of_a_batch_at_once() {
    let db = TestDb::new().await;
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = calls.clone();
    let batch_handler = move |tx: Tx, batch: Vec<Message>| {
        seen.lock().unwrap().push(batch.len());
        async move {
            for message in batch {
                effect(tx.clone(), message).await?;
            }
            Ok(())
        }
    };
    let steps = steps(&db.pool, Arc::new(WholeBatch::new(batch_handler)));
    let first = [
        Message::for_test("w-1", b"1"),
        Message::for_test("w-2", b"2"),
    ];
    assert_eq!(decide(&steps, &first).await, ["processed", "processed"]);
    let again = [
        Message::for_test("w-1", b"1"),
        Message::for_test("w-3", b"3"),
        Message::for_test("w-4", b"4"),
    ];
    assert_eq!(
        decide(&steps, &again).await,
        ["duplicate", "processed", "processed"]
    );
    assert_eq!(
        *calls.lock().unwrap(),
        [2, 2],
        "one call per batch, fresh only"
    );
    db.drop().await;
}

#[tokio::test]
async fn a_delivery_waiting_for_the_database_is_abandoned_at_shutdown() {
    // A pool on a port where nothing listens: every BEGIN fails to connect.
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(200))
        .connect_lazy("postgres://postgres@127.0.0.1:9/none")
        .unwrap();
    let steps = steps(&pool, each());
    let abandon = nobody_leaves();
    abandon.shutdown.cancel();
    let outcomes = steps
        .run(&[Message::for_test("pay-1", b"1")], &abandon)
        .await;
    assert_eq!(kinds(&outcomes), ["abandoned"], "left unacked, not retried");
    assert!(!steps.gate_is_open(), "the gate knows the database is down");
}

#[tokio::test]
async fn a_redelivered_message_already_lettered_is_settled_as_its_letter_and_its_batch_goes_on() {
    let db = TestDb::new().await;
    // A letter stored before a crash that lost its delivery's settlement.
    sqlx::query(
        "INSERT INTO dead_letters (consumer, queue, message_id, payload_sha256, body, reason, \
             error, fingerprint, first_failed_at, last_failed_at) \
         VALUES ('unit', 'q', 'l-1', $1, $2, 'max attempts exceeded', '3 attempts failed', \
             'max attempts exceeded', now(), now())",
    )
    .bind(crate::inbox::payload_sha256(b"1").to_vec())
    .bind(&b"1"[..])
    .execute(&db.pool)
    .await
    .unwrap();
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let steps = steps(&db.pool, whole_batch(calls.clone()));
    let batch = [
        Message::for_test_redelivered("l-1", b"1"),
        // Redelivered too, but lettered with another body: handled.
        Message::for_test_redelivered("l-2", b"2"),
        Message::for_test("l-3", b"3"),
    ];
    assert_eq!(
        decide(&steps, &batch).await,
        [
            "dead letter: max attempts exceeded",
            "processed",
            "processed"
        ]
    );
    assert_eq!(
        db.effects().await,
        ["l-2", "l-3"],
        "the letter's handler did not run"
    );
    assert_eq!(db.claims().await, 2, "the letter is not claimed");
    assert_eq!(
        *calls.lock().unwrap(),
        [vec!["l-2".to_owned(), "l-3".to_owned()]],
        "one call, with the others"
    );
    db.drop().await;
}

#[tokio::test]
async fn a_letter_holds_its_claim_and_a_redelivered_copy_is_settled_as_the_letter() {
    let db = TestDb::new().await;
    // Two letters stored with their claims, as the runtime stores them.
    for (id, body) in [("h-1", &b"1"[..]), ("h-2", &b"2"[..])] {
        let row = letter_table::Row {
            transport: "amqp",
            consumer: "unit",
            queue: "q",
            message_id: id,
            exchange: "",
            routing_key: "q",
            properties: &crate::properties::Properties::default(),
            body,
            reason: "max attempts exceeded",
            error: "3 attempts failed",
            attempts: 3,
            first_failed_at: "",
            last_failed_at: "",
        };
        letter_table::insert(&db.pool, &row).await.unwrap();
    }
    assert_eq!(db.claims().await, 2, "each letter holds its claim");
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let steps = steps(&db.pool, whole_batch(calls.clone()));
    let batch = [
        // Its settlement lost: settled as its letter again.
        Message::for_test_redelivered("h-1", b"1"),
        // A first delivery again (a durable set up anew): a duplicate.
        Message::for_test("h-2", b"2"),
        Message::for_test("h-3", b"3"),
    ];
    assert_eq!(
        decide(&steps, &batch).await,
        [
            "dead letter: max attempts exceeded",
            "duplicate",
            "processed"
        ]
    );
    assert_eq!(db.effects().await, ["h-3"], "no letter's handler ran");
    assert_eq!(*calls.lock().unwrap(), [vec!["h-3".to_owned()]]);
    // Letters only: no claim was fresh, the check reads on a connection of its own.
    assert_eq!(
        decide(&steps, &batch[..2]).await,
        ["dead letter: max attempts exceeded", "duplicate"]
    );
    db.drop().await;
}
