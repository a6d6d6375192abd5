//! Saga steps and the saga runner against the real PostgreSQL.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempo::Tx;
use idempo::saga::{Saga, SagaOutcome, StepContext, StepError};
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
        move |tx: Tx, result: String, _ctx: StepContext| {
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
async fn a_failure_rolls_back_the_writes_is_recorded_and_the_step_may_run_again() {
    let db = db_with_log().await;
    let attempt = Arc::new(AtomicUsize::new(0));
    let run = |attempt: Arc<AtomicUsize>| {
        Saga::execute(&db.pool, "s", "charge", move |tx: Tx| async move {
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
    assert!(
        Saga::compensate(&db.pool, "s", "charge", undo)
            .await
            .unwrap()
    );
    assert!(
        !Saga::compensate(&db.pool, "s", "charge", undo)
            .await
            .unwrap()
    );
    assert!(matches!(
        run(attempt.clone()).await,
        Err(StepError::Compensated { .. })
    ));
    assert_eq!(entries(&db).await, ["charge", "refund 7"]);
    // A step that never ran has nothing to undo, and cannot run afterwards.
    assert!(
        !Saga::compensate(&db.pool, "s", "never", undo)
            .await
            .unwrap()
    );
    let late = Saga::execute(&db.pool, "s", "never", |_tx| async { Ok::<_, BoxError>(1) }).await;
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
            Saga::execute(&pool, "s", "ship", move |tx: Tx| async move {
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
                |_tx: Tx, _: i64, _ctx: StepContext| async { Ok(()) },
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
                |_tx: Tx, _: String, _ctx: StepContext| async { Ok(()) },
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
        Saga::execute(&db.pool, "order-4", step, |tx: Tx| async move {
            log(&tx, format!("do:{step}")).await?;
            Ok::<_, BoxError>(format!("result of {step}"))
        })
        .await
        .unwrap();
    }
    let failed = Saga::execute(&db.pool, "order-4", "three", |_tx: Tx| async {
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
        |_tx: Tx, _: String, _ctx: StepContext| async { Ok(()) },
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

/// A fresh schema with a pool of `size` connections, migrated, with the log.
async fn small_db_with_log(size: u32) -> Db {
    let db = Db::with_pool_size(size).await;
    idempo::migrate(&db.pool).await.unwrap();
    sqlx::query("CREATE TABLE log (n bigserial PRIMARY KEY, entry text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

/// Steps `one` and `two` log `do:<saga>:<step>` and take 20 ms, so that runs
/// overlap; a third step, `three`, fails every time when `failing`.
fn slow_saga(pool: sqlx::PgPool, failing: Option<Arc<AtomicUsize>>) -> Saga {
    let saga = ["one", "two"]
        .into_iter()
        .fold(Saga::new(pool), |saga, name| {
            saga.step(
                name,
                move |tx: Tx, ctx: StepContext| async move {
                    log(&tx, format!("do:{}:{name}", ctx.saga_id())).await?;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Ok(name.to_owned())
                },
                move |tx: Tx, _: String, ctx: StepContext| async move {
                    log(&tx, format!("undo:{}:{name}", ctx.saga_id())).await
                },
            )
        });
    let Some(runs) = failing else { return saga };
    saga.step(
        "three",
        move |tx: Tx, _ctx: StepContext| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                log(&tx, "do:three".into()).await?;
                tokio::time::sleep(Duration::from_millis(20)).await;
                Err::<String, BoxError>("three failed".into())
            }
        },
        |_tx: Tx, _: String, _ctx: StepContext| async { Ok(()) },
    )
}

// Before: each waiting run sat in `pg_advisory_lock` on a pooled connection,
// and the running one needed more: PoolTimedOut after 30 s.
#[tokio::test]
async fn twenty_concurrent_runs_of_one_saga_on_a_pool_of_five_act_once_per_step() {
    let db = small_db_with_log(5).await;
    let three_runs = counter(0);
    let runs = (0..20).map(|_| {
        let saga = slow_saga(db.pool.clone(), Some(three_runs.clone())).attempts(2);
        tokio::spawn(async move { saga.run("crowded").await })
    });
    let outcomes = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(runs))
        .await
        .expect("20 runs on a pool of 5 finish");
    for outcome in outcomes {
        assert_eq!(
            outcome.unwrap().unwrap(),
            SagaOutcome::Compensated {
                failed_step: "three".into(),
                error: "three failed".into()
            }
        );
    }
    assert_eq!(
        entries(&db).await,
        [
            "do:crowded:one",
            "do:crowded:two",
            "undo:crowded:two",
            "undo:crowded:one"
        ]
    );
    // The budget of two attempts holds across the overlapping runs.
    assert_eq!(three_runs.load(Ordering::SeqCst), 2);
    let attempts: i32 = sqlx::query_scalar(
        "SELECT attempts FROM saga_steps WHERE saga_id = 'crowded' AND step = 'three'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 2);
}

// Before: five runs of different ids took the five connections for their
// locks, and none could open a step's transaction.
#[tokio::test]
async fn twenty_concurrent_sagas_on_a_pool_of_five_complete_with_one_effect_per_step() {
    let db = small_db_with_log(5).await;
    let runs = (0..20).map(|i| {
        let saga = slow_saga(db.pool.clone(), None);
        tokio::spawn(async move { saga.run(&format!("saga-{i}")).await })
    });
    let outcomes = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(runs))
        .await
        .expect("20 sagas on a pool of 5 finish");
    for outcome in outcomes {
        let outcome = outcome.unwrap().unwrap();
        assert!(matches!(outcome, SagaOutcome::Completed(_)), "{outcome:?}");
    }
    let mut entries = entries(&db).await;
    entries.sort();
    let mut expected: Vec<String> = (0..20)
        .flat_map(|i| ["one", "two"].map(|s| format!("do:saga-{i}:{s}")))
        .collect();
    expected.sort();
    assert_eq!(entries, expected);
}

#[tokio::test]
async fn a_saga_runs_and_compensates_on_a_pool_of_one_connection() {
    let db = small_db_with_log(1).await;
    let saga = slow_saga(db.pool.clone(), Some(counter(0)));
    let outcome = tokio::time::timeout(Duration::from_secs(30), saga.run("single"))
        .await
        .expect("one connection at a time is enough")
        .unwrap();
    assert!(
        matches!(&outcome, SagaOutcome::Compensated { failed_step, .. } if failed_step == "three"),
        "{outcome:?}"
    );
    assert_eq!(
        entries(&db).await,
        [
            "do:single:one",
            "do:single:two",
            "undo:single:two",
            "undo:single:one"
        ]
    );
}

#[tokio::test]
async fn runs_waiting_for_a_step_leave_the_pools_connections_to_others() {
    // Three connections: before, the first run held two (its lock and its
    // step) and a waiting run sat in `pg_advisory_lock` on the third.
    let db = small_db_with_log(3).await;
    let (entered, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Semaphore::new(0)),
    );
    let build = || {
        let (entered, release) = (entered.clone(), release.clone());
        Saga::new(db.pool.clone()).step(
            "hold",
            move |tx: Tx, _ctx: StepContext| {
                let (entered, release) = (entered.clone(), release.clone());
                async move {
                    log(&tx, "do:hold".into()).await?;
                    entered.notify_one();
                    let _ = release.acquire().await?;
                    Ok(())
                }
            },
            |_tx: Tx, (), _ctx: StepContext| async { Ok(()) },
        )
    };
    let first = build();
    let first = tokio::spawn(async move { first.run("held").await });
    entered.notified().await;
    // Five more runs wait for the step the first one holds (on one
    // connection).
    let waiting: Vec<_> = (0..5)
        .map(|_| {
            let saga = build();
            tokio::spawn(async move { saga.run("held").await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..10 {
        let one: i32 = tokio::time::timeout(
            Duration::from_secs(5),
            sqlx::query_scalar("SELECT 1").fetch_one(&db.pool),
        )
        .await
        .expect("a connection while five runs wait")
        .unwrap();
        assert_eq!(one, 1);
    }
    release.add_permits(100);
    for run in std::iter::once(first).chain(waiting) {
        let outcome = run.await.unwrap().unwrap();
        assert!(matches!(outcome, SagaOutcome::Completed(_)), "{outcome:?}");
    }
    assert_eq!(entries(&db).await, ["do:hold"]);
}

#[tokio::test]
async fn a_result_that_json_cannot_hold_fails_the_step_before_its_writes_commit() {
    let db = db_with_log().await;
    // NaN would be stored as null: the first execution returned Ok(NaN), a
    // re-execution failed to read it back.
    let nan = Saga::execute(&db.pool, "s", "price", |tx: Tx| async move {
        log(&tx, "priced".into()).await?;
        Ok::<f64, BoxError>(f64::NAN)
    })
    .await;
    let Err(error @ StepError::ResultNotStorable { attempts: 1, .. }) = nan else {
        panic!("{nan:?}")
    };
    let message = error.to_string();
    assert!(
        message.contains("\"price\" returned a result that cannot be stored")
            && message.contains("no JSON form")
            && !message.contains("stored result"),
        "{message}"
    );
    assert!(entries(&db).await.is_empty(), "the writes rolled back");
    let (state, stored): (String, String) = sqlx::query_as(
        "SELECT state, error FROM saga_steps WHERE saga_id = 's' AND step = 'price'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(state, "failed");
    assert!(
        stored.starts_with("the result cannot be stored"),
        "{stored}"
    );
    // Hidden in an Option it would have come back as None.
    let hidden = Saga::execute(&db.pool, "s", "price", |_tx: Tx| async {
        Ok::<_, BoxError>(Some(f64::INFINITY))
    })
    .await;
    assert!(
        matches!(
            hidden,
            Err(StepError::ResultNotStorable { attempts: 2, .. })
        ),
        "{hidden:?}"
    );
    // A finite price completes, and comes back the same.
    let priced = |price: f64| {
        Saga::execute(&db.pool, "s", "price", move |tx: Tx| async move {
            log(&tx, "priced".into()).await?;
            Ok::<_, BoxError>(price)
        })
    };
    assert_eq!(priced(9.5).await.unwrap(), 9.5);
    assert_eq!(priced(1.0).await.unwrap(), 9.5);
    assert_eq!(entries(&db).await, ["priced"]);
    // A price with tax whose decimal text serde_json's default parser reads
    // one ulp off (474.287): the first execution returned the computed
    // value, a re-execution the other one. Now both return what PostgreSQL
    // gives back.
    let taxed = |price: f64| {
        Saga::execute(&db.pool, "s", "taxed", move |_tx: Tx| async move {
            Ok::<_, BoxError>(price)
        })
    };
    let first = taxed(474.28700000000003).await.unwrap();
    let again = taxed(0.0).await.unwrap();
    assert_eq!(first.to_bits(), again.to_bits(), "{first} then {again}");

    // In a saga: the step fails once, clearly, and the saga compensates.
    let saga = logged_step(Saga::new(db.pool.clone()), "one", counter(0), counter(0)).step(
        "two",
        |tx: Tx, _ctx: StepContext| async move {
            log(&tx, "do:two".into()).await?;
            Ok::<f64, BoxError>(f64::NAN)
        },
        |_tx: Tx, _: f64, _ctx: StepContext| async { Ok(()) },
    );
    let outcome = saga.run("order-nan").await.unwrap();
    assert!(
        matches!(&outcome, SagaOutcome::Compensated { failed_step, error }
            if failed_step == "two" && error.starts_with("the result cannot be stored")),
        "{outcome:?}"
    );
    assert_eq!(saga.run("order-nan").await.unwrap(), outcome, "final");
    assert_eq!(
        entries(&db).await,
        ["priced", "do:one", "undo:one"],
        "do:two rolled back"
    );
}

#[tokio::test]
async fn two_steps_with_one_name_are_refused_before_any_step_runs() {
    let db = db_with_log().await;
    let saga = Saga::new(db.pool.clone());
    let saga = logged_step(saga, "a", counter(0), counter(0));
    let saga = logged_step(saga, "b", counter(0), counter(0));
    let saga = logged_step(saga, "a", counter(0), counter(0));
    let refused = saga.run("order-5").await;
    assert!(
        matches!(&refused, Err(StepError::DuplicateStep { step }) if step == "a"),
        "{refused:?}"
    );
    assert!(entries(&db).await.is_empty());
    assert_eq!(db.count("SELECT count(*) FROM sagas").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM saga_steps").await, 0);
}

fn three_logged_steps(db: &Db) -> Saga {
    let saga = Saga::new(db.pool.clone());
    let saga = logged_step(saga, "s1", counter(0), counter(0));
    let saga = logged_step(saga, "s2", counter(0), counter(0));
    logged_step(saga, "s3", counter(0), counter(0))
}

#[tokio::test]
async fn a_completed_saga_is_final() {
    let db = db_with_log().await;
    let done = three_logged_steps(&db).run("order-6").await.unwrap();
    assert!(matches!(done, SagaOutcome::Completed(_)), "{done:?}");
    // Before: this compensated s2, and the next run undid s3 and s1.
    let undo = |tx: Tx, _: String| async move { log(&tx, "undo:s2".into()).await };
    let refused = Saga::compensate(&db.pool, "order-6", "s2", undo).await;
    assert!(
        matches!(&refused, Err(StepError::SagaCompleted { saga_id, step })
            if saga_id == "order-6" && step == "s2"),
        "{refused:?}"
    );
    // Nor may a step that never ran start now.
    let late = Saga::execute(&db.pool, "order-6", "s4", |_tx: Tx| async {
        Ok::<_, BoxError>(1)
    })
    .await;
    assert!(
        matches!(late, Err(StepError::SagaCompleted { .. })),
        "{late:?}"
    );
    assert_eq!(three_logged_steps(&db).run("order-6").await.unwrap(), done);
    assert_eq!(entries(&db).await, ["do:s1", "do:s2", "do:s3"]);
}

#[tokio::test]
async fn a_step_compensated_from_outside_while_the_saga_runs_undoes_the_rest() {
    let db = db_with_log().await;
    let (entered, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let saga = logged_step(Saga::new(db.pool.clone()), "s1", counter(0), counter(0));
    let (e, r) = (entered.clone(), release.clone());
    let saga = saga.step(
        "s2",
        move |tx: Tx, _ctx: StepContext| {
            let (entered, release) = (e.clone(), r.clone());
            async move {
                log(&tx, "do:s2".into()).await?;
                entered.notify_one();
                release.notified().await;
                Ok("result of s2".to_owned())
            }
        },
        |tx: Tx, _: String, _ctx: StepContext| async move { log(&tx, "undo:s2".into()).await },
    );
    let saga = logged_step(saga, "s3", counter(0), counter(0));
    let run = tokio::spawn(async move { saga.run("order-7").await });
    entered.notified().await;
    // The saga is running: compensating s1 is allowed (an abort).
    let undo = |tx: Tx, _: String| async move { log(&tx, "undo:s1".into()).await };
    assert!(
        Saga::compensate(&db.pool, "order-7", "s1", undo)
            .await
            .unwrap()
    );
    release.notify_one();
    let outcome = run.await.unwrap().unwrap();
    assert_eq!(
        outcome,
        SagaOutcome::Compensated {
            failed_step: "s1".into(),
            error: "the step was compensated".into()
        }
    );
    // do:s2 took its place in the log before undo:s1, and committed after.
    assert_eq!(
        entries(&db).await,
        ["do:s1", "do:s2", "undo:s1", "do:s3", "undo:s3", "undo:s2"]
    );
}

#[tokio::test]
async fn compensations_get_the_saga_id_the_step_and_the_earlier_results() {
    let db = db_with_log().await;
    let saga = ["one", "two"]
        .into_iter()
        .fold(Saga::new(db.pool.clone()), |saga, name| {
            saga.step(
                name,
                move |_tx: Tx, _ctx: StepContext| async move { Ok(format!("r-{name}")) },
                move |tx: Tx, result: String, ctx: StepContext| async move {
                    let earlier = ctx.result::<String>("one");
                    let entry = format!(
                        "undo {} ({result}) after {earlier:?}",
                        ctx.idempotency_key()
                    );
                    log(&tx, entry).await
                },
            )
        });
    let saga = logged_step(saga, "three", counter(usize::MAX), counter(0));
    let outcome = saga.run("order-8").await.unwrap();
    assert!(
        matches!(outcome, SagaOutcome::Compensated { .. }),
        "{outcome:?}"
    );
    assert_eq!(
        entries(&db).await,
        [
            "undo order-8:two (r-two) after Some(\"r-one\")",
            "undo order-8:one (r-one) after None"
        ]
    );
}

#[tokio::test]
async fn bad_saga_ids_and_step_names_are_refused_before_the_database() {
    let db = db_with_log().await;
    // A closed pool answers any statement with PoolClosed: a typed refusal
    // proves that nothing was sent.
    let closed = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy(&support::database_url())
        .unwrap();
    closed.close().await;
    let long = "x".repeat(10_000);
    for (saga_id, step) in [
        (long.as_str(), "one"),
        ("order\0-9", "one"),
        ("", "one"),
        ("order 9", "one"),
        ("order-9", "a:b"),
        ("order-9", ""),
    ] {
        let action = |_tx: Tx| async { Ok::<_, BoxError>(1) };
        for result in [
            Saga::execute(&closed, saga_id, step, action)
                .await
                .map(drop),
            Saga::compensate(&closed, saga_id, step, |_tx: Tx, _: i64| async { Ok(()) })
                .await
                .map(drop),
            logged_step(Saga::new(closed.clone()), "one", counter(0), counter(0))
                .step(
                    step,
                    |_tx: Tx, _ctx: StepContext| async { Ok(()) },
                    |_tx: Tx, (), _ctx: StepContext| async { Ok(()) },
                )
                .run(saga_id)
                .await
                .map(drop),
        ] {
            let error = result.unwrap_err();
            assert!(
                matches!(
                    error,
                    StepError::InvalidSagaId(_) | StepError::InvalidStepName { .. }
                ),
                "{saga_id:.20?}/{step}: {error:?}"
            );
            assert!(error.to_string().len() < 200, "{error}");
        }
    }
    // Valid names go through to PostgreSQL as before.
    assert_eq!(
        Saga::execute(&db.pool, "order-9:eu", "one", |_tx: Tx| async {
            Ok::<_, BoxError>(1)
        })
        .await
        .unwrap(),
        1
    );
}
