//! `idempo dlq` on the PostgreSQL dead-letter store, as a process: the
//! payments example with `PAYMENTS_DEAD_LETTERS=table` fills the table, the
//! binary lists and groups it, two replays race and each payment applies
//! once; an existing RabbitMQ DLQ is imported, with a SIGKILL mid-way.

mod support;

use std::process::Stdio;
use std::time::Duration;

use support::cli::{idempo, json_lines, payments_db as db, run};
use support::example::{doubled_payments, fill_dead_letter_table, live_letters, spawn_example};
use support::{Broker, Db, eventually, eventually_ready, payment_body, unique};

/// One test at a time in this binary: each runs the example (a pool of 6)
/// beside its own pool, within the suite's connection budget.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn the_table_store_is_listed_grouped_and_replayed_once_by_two_racing_replays() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    let load = fill_dead_letter_table(&db, &broker, &queue, 40, 3).await;
    assert_eq!(db.payments().await, 0);
    assert_eq!(
        broker.ready(&format!("{queue}.dlq")).await,
        0,
        "none in the queue DLQ"
    );

    let listed = json_lines(&run(
        &db,
        &["dlq", "list", "--queue", &queue, "--limit", "100", "--json"],
    ));
    assert_eq!(listed.len(), 43);
    for letter in &listed {
        for field in [
            "message_id",
            "reason",
            "fingerprint",
            "attempts",
            "last_failed_at",
        ] {
            assert!(letter.get(field).is_some(), "{field} in {letter}");
        }
    }
    let groups = json_lines(&run(
        &db,
        &["dlq", "list", "--queue", &queue, "--group", "--json"],
    ));
    let counts: Vec<(i64, &str)> = groups
        .iter()
        .map(|g| (g["count"].as_i64().unwrap(), g["reason"].as_str().unwrap()))
        .collect();
    assert_eq!(
        counts,
        vec![
            (40, "max attempts exceeded"),
            (3, "permanent handler error")
        ]
    );
    let exhausted = groups[0]["fingerprint"].as_str().unwrap().to_owned();

    // The cause is fixed: a working consumer, and two operators replaying
    // the group at once.
    let _working = spawn_example(&db.url, &queue, &[("PAYMENTS_DEAD_LETTERS", "table")]);
    let spawn_replay = || {
        idempo(&db)
            .args([
                "dlq",
                "replay",
                "--queue",
                &queue,
                "--fingerprint",
                &exhausted,
                "--json",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (one, two) = (spawn_replay(), spawn_replay());
    let (one, two) = (
        one.wait_with_output().unwrap(),
        two.wait_with_output().unwrap(),
    );
    assert!(
        one.status.success() && two.status.success(),
        "{one:?} {two:?}"
    );
    let replayed: i64 = [&one, &two]
        .iter()
        .map(|out| {
            json_lines(out)
                .last()
                .and_then(|summary| summary["replayed"].as_i64())
                .unwrap()
        })
        .sum();
    assert_eq!(replayed, 40, "each letter replayed by one of the two");
    eventually("every payment applied", Duration::from_secs(60), || async {
        db.payments().await == load.ids.len() as i64
    })
    .await;
    assert_eq!(doubled_payments(&db).await, 0);
    assert_eq!(db.balances().await, load.expected);
    // Run again: nothing live of that cause is left.
    let again = run(
        &db,
        &[
            "dlq",
            "replay",
            "--queue",
            &queue,
            "--fingerprint",
            &exhausted,
            "--json",
        ],
    );
    assert!(again.status.success());
    assert_eq!(json_lines(&again).last().unwrap()["replayed"], 0);
    // Table-only filters on a queue without letters in the table are refused.
    let refused = run(
        &db,
        &[
            "dlq",
            "list",
            "--queue",
            "nothing-here",
            "--fingerprint",
            "x",
        ],
    );
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("needs the table store"));
}

#[tokio::test]
async fn a_table_replay_killed_mid_way_and_run_again_applies_each_payment_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    let load = fill_dead_letter_table(&db, &broker, &queue, 30, 0).await;
    let _working = spawn_example(&db.url, &queue, &[("PAYMENTS_DEAD_LETTERS", "table")]);
    let mut replay = idempo(&db)
        .args([
            "dlq",
            "replay",
            "--queue",
            &queue,
            "--all",
            "--throttle",
            "100ms",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    eventually("some letters replayed", Duration::from_secs(30), || async {
        live_letters(&db).await <= 25
    })
    .await;
    replay.kill().unwrap(); // SIGKILL
    replay.wait().unwrap();
    let left = live_letters(&db).await;
    assert!(left > 0, "the replay finished before the kill");
    let again = run(&db, &["dlq", "replay", "--queue", &queue, "--all"]);
    assert!(again.status.success());
    assert_eq!(live_letters(&db).await, 0);
    eventually("every payment applied", Duration::from_secs(60), || async {
        db.payments().await == load.ids.len() as i64
    })
    .await;
    assert_eq!(doubled_payments(&db).await, 0);
    assert_eq!(db.balances().await, load.expected);
    let replayed = db
        .count("SELECT count(*) FROM dead_letters WHERE state = 'replayed' AND replay_count = 1")
        .await;
    assert_eq!(replayed, 30, "each letter replayed once");
}

#[tokio::test]
async fn a_queue_dlq_is_imported_once_even_after_a_kill() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    let dlq = format!("{queue}.dlq");
    broker.declare(&queue).await;
    let n = 1000;
    for k in 0..n {
        broker
            .publish(&queue, Some(&format!("neg-{k}")), &payment_body("neg", -1))
            .await;
    }
    let failing = spawn_example(&db.url, &queue, &[]);
    eventually_ready(&broker, &dlq, n).await;
    drop(failing);

    let mut import = idempo(&db)
        .args(["dlq", "import", &dlq])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    eventually("some letters imported", Duration::from_secs(60), || async {
        db.count("SELECT count(*) FROM dead_letters").await >= 20
    })
    .await;
    import.kill().unwrap(); // SIGKILL
    import.wait().unwrap();
    let again = run(&db, &["dlq", "import", &dlq, "--json"]);
    assert!(again.status.success());
    eventually_ready(&broker, &dlq, 0).await;
    let rows = db.count("SELECT count(*) FROM dead_letters").await;
    let ids = db
        .count("SELECT count(DISTINCT message_id) FROM dead_letters")
        .await;
    assert_eq!(
        (rows, ids),
        (i64::from(n), i64::from(n)),
        "every letter once"
    );
    let reasons = db
        .count("SELECT count(*) FROM dead_letters WHERE reason = 'permanent handler error'")
        .await;
    assert_eq!(reasons, i64::from(n));
}

/// The operator's commands around dead letters say what they did, and refuse
/// what cannot work.
#[tokio::test]
async fn failed_outbox_rows_are_listed_and_retried_and_mistakes_are_refused() {
    let db = Db::with_pool_size(2).await;
    idempo::migrate(&db.pool).await.unwrap();
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, state, attempts, last_error) \
         VALUES ('', 'nowhere', 'm-1', '\\x00', 'failed', 5, 'the message was unroutable: nothing is bound for \"queue nowhere\"') \
         RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let failed = json_lines(&run(&db, &["--json", "outbox", "failed"]));
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0]["id"], id);
    assert_eq!(failed[0]["message_id"], "m-1");
    let missing = run(&db, &["outbox", "retry", "--id", "987654321"]);
    assert!(
        !missing.status.success(),
        "a row that is not failed is an error"
    );
    let retried = run(&db, &["outbox", "retry", "--id", &id.to_string()]);
    assert!(retried.status.success());
    let state: String = sqlx::query_scalar("SELECT state FROM outbox WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(state, "pending");
    let nothing = run(&db, &["outbox", "retry"]);
    assert!(
        !nothing.status.success(),
        "retry without a selection is refused"
    );

    let zero = run(&db, &["reap", "--older-than", "1h", "--batch", "0"]);
    assert!(
        !zero.status.success(),
        "a zero batch deletes nothing: refused"
    );

    // The default policy's horizon: 9 retries at 10 min + the 30 min consumer timeout.
    let status = run(
        &db,
        &[
            "--json",
            "status",
            "--consumer",
            "nobody",
            "--retention",
            "1h",
        ],
    );
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("redelivery horizon 2h"), "{text}");
    assert_eq!(status.status.code(), Some(2), "retention 1h is too short");
}

/// The highest resident memory seen of a running `idempo` command, in MiB,
/// and how it ended.
fn peak_rss(mut child: std::process::Child) -> (f64, std::process::ExitStatus) {
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0u64;
    loop {
        if let Ok(text) = std::fs::read_to_string(&status_file) {
            for line in text.lines() {
                if let Some(v) = line.strip_prefix("VmHWM:") {
                    let kib: u64 = v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
                    peak_kib = peak_kib.max(kib);
                }
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            return (peak_kib as f64 / 1024.0, status);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Listing and purging a RabbitMQ DLQ of large letters holds one letter at
/// a time, not all of them.
#[tokio::test]
async fn browsing_and_purging_a_queue_dlq_of_large_letters_holds_one_at_a_time() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    broker.declare(&queue).await;
    let dlq = format!("{queue}.dlq");
    let body = vec![b'x'; 4 * 1024 * 1024];
    let letters = 40;
    for k in 0..letters {
        broker
            .publish_to(
                "",
                &dlq,
                lapin::BasicProperties::default().with_message_id(format!("big-{k}").into()),
                &body,
            )
            .await;
    }
    eventually_ready(&broker, &dlq, letters).await;
    let list = idempo(&db)
        .args([
            "dlq", "list", &queue, "--limit", "1000", "--store", "queue", "--json",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (listing, listed) = peak_rss(list);
    assert!(listed.success());
    eventually_ready(&broker, &dlq, letters).await;
    let purge = idempo(&db)
        .args(["dlq", "purge", &queue, "--yes", "--store", "queue"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (purging, purged) = peak_rss(purge);
    assert!(purged.success());
    eventually_ready(&broker, &dlq, 0).await;
    eprintln!("peak RSS: list {listing:.0} MiB, purge {purging:.0} MiB");
    // 40 letters of 4 MiB are 160 MiB: holding them all shows.
    assert!(listing < 100.0, "dlq list peaked at {listing:.0} MiB");
    assert!(
        purging < 100.0,
        "dlq purge --yes peaked at {purging:.0} MiB"
    );
}
