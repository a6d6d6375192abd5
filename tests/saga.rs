//! Saga steps and the saga runner against the real PostgreSQL.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempo::Tx;
use idempo::saga::{Saga, SagaOutcome, StepContext, StepError, compensate, execute};
use support::Db;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn db_with_log() -> Db {
    let db = Db::new().await;
    sqlx::query("CREATE TABLE log (n bigserial PRIMARY KEY, entry text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

/// Appends `entry` to the log through the step's transaction.
async fn log(tx: &Tx, entry: String) -> Result<(), BoxError> {
    let mut conn = tx.try_lock()?;
    sqlx::query("INSERT INTO log (entry) VALUES ($1)")
        .bind(entry)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn entries(db: &Db) -> Vec<String> {
    sqlx::query_scalar("SELECT entry FROM log ORDER BY n")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// A step that logs `do:<name>` (and fails when `fails` says so), compensated
/// by logging `undo:<name>` (failing while `undo_fails` is set).
fn logged_step(
    saga: Saga,
    name: &'static str,
    fails: Arc<AtomicUsize>,
    undo_fails: Arc<AtomicUsize>,
) -> Saga {
    saga.step(
        name,
        move |tx: Tx, _ctx: StepContext| {
            let fails = fails.clone();
            async move {
                log(&tx, format!("do:{name}")).await?;
                if fails.load(Ordering::SeqCst) > 0 {
                    fails.fetch_sub(1, Ordering::SeqCst);
                    return Err(format!("{name} failed").into());
                }
                Ok(format!("result of {name}"))
            }
        },
        move |tx: Tx, result: String| {
            let undo_fails = undo_fails.clone();
            async move {
                assert_eq!(
                    result,
                    format!("result of {name}"),
                    "the stored result comes back"
                );
                if undo_fails.load(Ordering::SeqCst) > 0 {
                    undo_fails.fetch_sub(1, Ordering::SeqCst);
                    return Err(format!("undo {name} failed").into());
                }
                log(&tx, format!("undo:{name}")).await
            }
        },
    )
}

fn counter(n: usize) -> Arc<AtomicUsize> {
    Arc::new(AtomicUsize::new(n))
}

#[tokio::test]
async fn a_failing_third_step_compensates_two_then_one_once_each() {
    let db = db_with_log().await;
    let saga = Saga::new(db.pool.clone());
    let saga = logged_step(saga, "one", counter(0), counter(0));
    let saga = logged_step(saga, "two", counter(0), counter(0));
    let saga = logged_step(saga, "three", counter(usize::MAX), counter(0));
    let outcome = saga.run("order-1").await.unwrap();
    assert!(
        matches!(&outcome, SagaOutcome::Compensated { failed_step, error } if failed_step == "three" && error.contains("three failed")),
        "{outcome:?}"
    );
    // do:three rolled back with its failure; compensation in reverse order.
    assert_eq!(
        entries(&db).await,
        ["do:one", "do:two", "undo:two", "undo:one"]
    );
    // Running it again changes nothing and reports the same failure.
    let again = saga.run("order-1").await.unwrap();
    assert_eq!(again, outcome);
    assert_eq!(
        entries(&db).await,
        ["do:one", "do:two", "undo:two", "undo:one"]
    );
    let failed: (String, String, i32) = sqlx::query_as(
        "SELECT state, coalesce(error, ''), attempts FROM saga_steps WHERE saga_id = 'order-1' AND step = 'three'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        failed,
        ("compensated".to_owned(), "three failed".to_owned(), 1)
    );
}

#[tokio::test]
async fn a_failure_is_recorded_in_its_own_transaction_and_the_step_may_run_again() {
    let db = db_with_log().await;
    let attempt = Arc::new(AtomicUsize::new(0));
    let run = |attempt: Arc<AtomicUsize>| {
        execute(&db.pool, "s", "charge", move |tx: Tx| async move {
            log(&tx, "charge".into()).await?;
            if attempt.fetch_add(1, Ordering::SeqCst) < 2 {
                return Err::<i64, BoxError>("card declined".into());
            }
            Ok(7)
        })
    };
    for expected in 1..=2 {
        let Err(StepError::Failed {
            attempts, source, ..
        }) = run(attempt.clone()).await
        else {
            panic!("the action failed")
        };
        assert_eq!(attempts, expected);
        assert_eq!(source.to_string(), "card declined");
        let (state, error): (String, String) = sqlx::query_as(
            "SELECT state, error FROM saga_steps WHERE saga_id = 's' AND step = 'charge'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            (state.as_str(), error.as_str()),
            ("failed", "card declined")
        );
    }
    assert!(
        entries(&db).await.is_empty(),
        "failed attempts left no writes"
    );
    assert_eq!(run(attempt.clone()).await.unwrap(), 7);
    // Completed: the stored result comes back, the action does not run.
    assert_eq!(run(attempt.clone()).await.unwrap(), 7);
    assert_eq!(entries(&db).await, ["charge"]);
    assert_eq!(attempt.load(Ordering::SeqCst), 3);
    // Compensated once, then never again; a compensated step cannot run.
    let undo = |tx: Tx, charged: i64| async move { log(&tx, format!("refund {charged}")).await };
    assert!(compensate(&db.pool, "s", "charge", undo).await.unwrap());
    assert!(!compensate(&db.pool, "s", "charge", undo).await.unwrap());
    assert!(matches!(
        run(attempt.clone()).await,
        Err(StepError::Compensated { .. })
    ));
    assert_eq!(entries(&db).await, ["charge", "refund 7"]);
    // A step that never ran has nothing to undo, and cannot run afterwards.
    assert!(!compensate(&db.pool, "s", "never", undo).await.unwrap());
    let late = execute(&db.pool, "s", "never", |_tx| async { Ok::<_, BoxError>(1) }).await;
    assert!(
        matches!(late, Err(StepError::Compensated { .. })),
        "{late:?}"
    );
}

#[tokio::test]
async fn concurrent_executions_of_one_step_produce_one_effect() {
    let db = db_with_log().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let calls = (0..8).map(|_| {
        let (pool, runs) = (db.pool.clone(), runs.clone());
        tokio::spawn(async move {
            execute(&pool, "s", "ship", move |tx: Tx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                log(&tx, "shipped".into()).await?;
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<_, BoxError>(format!("parcel-{}", fastrand::u32(..)))
            })
            .await
            .unwrap()
        })
    });
    let results: Vec<String> = futures::future::join_all(calls)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(
        results.iter().all(|r| *r == results[0]),
        "one result for all: {results:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the action ran once");
    assert_eq!(entries(&db).await, ["shipped"]);
}

#[tokio::test]
async fn an_interrupted_saga_resumes_without_repeating_a_completed_step() {
    let db = db_with_log().await;
    let stall = Arc::new(tokio::sync::Notify::new());
    let build = |stalls: bool| {
        let stall = stall.clone();
        Saga::new(db.pool.clone())
            .step(
                "one",
                |tx: Tx, _ctx: StepContext| async move {
                    log(&tx, "do:one".into()).await?;
                    Ok(1)
                },
                |_tx: Tx, _: i64| async { Ok(()) },
            )
            .step(
                "two",
                move |tx: Tx, ctx: StepContext| {
                    let stall = stall.clone();
                    async move {
                        assert_eq!(ctx.result::<i64>("one"), Some(1));
                        log(&tx, "do:two".into()).await?;
                        if stalls {
                            stall.notify_one();
                            std::future::pending::<()>().await; // the process dies here
                        }
                        Ok(ctx.idempotency_key())
                    }
                },
                |_tx: Tx, _: String| async { Ok(()) },
            )
    };
    // The first run is cut off inside step two, its transaction open: like
    // a process that dies, its connection goes and the transaction rolls back.
    let first = build(true);
    let task = tokio::spawn(async move { first.run("trip-9").await });
    stall.notified().await;
    task.abort();
    let _ = task.await;
    // The second run resumes: step one is not repeated.
    let outcome = build(false).run("trip-9").await.unwrap();
    let SagaOutcome::Completed(results) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(results["two"], "trip-9:two", "the derived key");
    support::eventually(
        "the aborted transaction rolled back",
        Duration::from_secs(10),
        || async { entries(&db).await == ["do:one", "do:two"] },
    )
    .await;
}

#[tokio::test]
async fn an_interrupted_compensation_continues_on_the_next_run() {
    let db = db_with_log().await;
    let undo_one_fails = counter(1);
    let build = || {
        let saga = Saga::new(db.pool.clone());
        let saga = logged_step(saga, "one", counter(0), undo_one_fails.clone());
        let saga = logged_step(saga, "two", counter(0), counter(0));
        logged_step(saga, "three", counter(usize::MAX), counter(0))
    };
    // Compensating step one fails: the run stops with an error, step two is
    // already compensated.
    let stopped = build().run("order-2").await;
    assert!(
        matches!(stopped, Err(StepError::CompensationFailed { .. })),
        "{stopped:?}"
    );
    let error: Option<String> = sqlx::query_scalar(
        "SELECT error FROM saga_steps WHERE saga_id = 'order-2' AND step = 'one'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(error.as_deref(), Some("compensation: undo one failed"));
    assert_eq!(entries(&db).await, ["do:one", "do:two", "undo:two"]);
    // The next run continues the compensation: one is undone, two not again,
    // and no step runs forward.
    let outcome = build().run("order-2").await.unwrap();
    assert!(
        matches!(&outcome, SagaOutcome::Compensated { failed_step, .. } if failed_step == "three"),
        "{outcome:?}"
    );
    assert_eq!(
        entries(&db).await,
        ["do:one", "do:two", "undo:two", "undo:one"]
    );
}

#[tokio::test]
async fn concurrent_runs_of_one_saga_act_once() {
    let db = db_with_log().await;
    let build = || {
        let saga = Saga::new(db.pool.clone());
        let saga = logged_step(saga, "one", counter(0), counter(0));
        let saga = logged_step(saga, "two", counter(0), counter(0));
        logged_step(saga, "three", counter(usize::MAX), counter(0))
    };
    let (a, b) = (build(), build());
    let (a, b) = tokio::join!(a.run("order-3"), b.run("order-3"));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a, b, "both report the one outcome");
    assert_eq!(
        entries(&db).await,
        ["do:one", "do:two", "undo:two", "undo:one"]
    );
}

#[tokio::test]
async fn a_run_that_died_after_a_failure_is_compensated_without_retrying_the_step() {
    let db = db_with_log().await;
    // The dead run: steps one and two done, three failed, then the process died
    // before it began compensating.
    for step in ["one", "two"] {
        execute(&db.pool, "order-4", step, |tx: Tx| async move {
            log(&tx, format!("do:{step}")).await?;
            Ok::<_, BoxError>(format!("result of {step}"))
        })
        .await
        .unwrap();
    }
    let failed = execute(&db.pool, "order-4", "three", |_tx: Tx| async {
        Err::<String, BoxError>("three failed".into())
    })
    .await;
    assert!(matches!(failed, Err(StepError::Failed { attempts: 1, .. })));
    // The rerun: step three used its one attempt, so it is not run again.
    let three_runs = counter(0);
    let saga = Saga::new(db.pool.clone());
    let saga = logged_step(saga, "one", counter(0), counter(0));
    let saga = logged_step(saga, "two", counter(0), counter(0));
    let runs = three_runs.clone();
    let saga = saga.step(
        "three",
        move |_tx: Tx, _ctx: StepContext| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, BoxError>(String::new())
            }
        },
        |_tx: Tx, _: String| async { Ok(()) },
    );
    let outcome = saga.run("order-4").await.unwrap();
    assert_eq!(
        outcome,
        SagaOutcome::Compensated {
            failed_step: "three".into(),
            error: "three failed".into()
        }
    );
    assert_eq!(three_runs.load(Ordering::SeqCst), 0);
    assert_eq!(
        entries(&db).await,
        ["do:one", "do:two", "undo:two", "undo:one"]
    );
}
