//! The `idempo` binary as a process, against real RabbitMQ and PostgreSQL:
//! the payments example fills its DLQ, the binary lists, replays (also after
//! a SIGKILL mid-way) and purges it, and every payment applies exactly once.

mod support;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::cli::{idempo, json_lines, payments_db as db, run};
use support::example::{Load, doubled_payments, publish_with_poison, spawn_example};
use support::{Broker, Db, eventually, eventually_ready, payment_body, unique};

/// One test at a time in this binary: each runs the example (a pool of 6)
/// beside its own pool, within the suite's connection budget.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Publishes `n` payments and `poison` negative ones; runs the example with
/// every attempt failing (2 attempts) until all are dead-lettered.
async fn fill_dlq(db: &Db, broker: &Broker, queue: &str, n: usize, poison: usize) -> Load {
    let load = publish_with_poison(broker, queue, n, poison).await;
    let failing = spawn_example(
        &db.url,
        queue,
        &[("PAYMENTS_FAIL_RATE", "1"), ("PAYMENTS_MAX_ATTEMPTS", "2")],
    );
    eventually_ready(broker, &format!("{queue}.dlq"), (n + poison) as u32).await;
    drop(failing);
    assert_eq!(db.payments().await, 0);
    load
}

async fn assert_applied_once(db: &Db, load: &Load) {
    eventually("every payment applied", Duration::from_secs(60), || async {
        db.payments().await == load.ids.len() as i64
    })
    .await;
    assert_eq!(doubled_payments(db).await, 0);
    assert_eq!(db.balances().await, load.expected);
}

#[tokio::test]
async fn migrate_check_fails_while_migrations_are_pending() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = Db::with_pool_size(2).await;
    let before = run(&db, &["migrate", "--check"]);
    assert_eq!(before.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&before.stdout).contains("pending"));
    assert!(run(&db, &["migrate"]).status.success());
    let after = run(&db, &["migrate", "--check", "--json"]);
    assert!(after.status.success());
    assert_eq!(json_lines(&after)[0]["pending"], serde_json::json!([]));
}

#[tokio::test]
async fn unreachable_services_and_unknown_queues_are_named() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = Db::with_pool_size(2).await;
    let out = idempo(&db)
        .env("AMQP_URL", "amqp://guest:secret@127.0.0.1:1/%2f")
        .args(["dlq", "list", "nope"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    // Each node tried is named (without its password) with why it failed.
    assert!(err.contains("cannot connect to RabbitMQ"), "{err}");
    assert!(err.contains("amqp://guest:***@127.0.0.1:1/"), "{err}");
    assert!(err.contains("Connection refused"), "{err}");
    assert!(!err.contains("secret"), "{err}");

    let missing = unique("missing");
    let out = run(&db, &["dlq", "list", &missing]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));

    // PostgreSQL's own words, without sqlx's "at line N" (a line of
    // PostgreSQL's source, not the operator's).
    let args = [
        "dlq",
        "list",
        &missing,
        "--store",
        "table",
        "--body-path",
        "$$",
    ];
    let out = run(&db, &args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("idempo: "), "{err}");
    assert!(!err.contains(" at line "), "{err}");
}

#[tokio::test]
async fn dead_letters_are_listed_selected_replayed_once_and_purged() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    let dlq = format!("{queue}.dlq");
    let load = fill_dlq(&db, &broker, &queue, 12, 3).await;

    // list: every one with its reason, and nothing leaves the DLQ.
    let listed = json_lines(&run(&db, &["--json", "dlq", "list", &queue]));
    assert_eq!(listed.len(), 15);
    for d in &listed {
        let id = d["message_id"].as_str().unwrap();
        let reason = if id.starts_with("neg-") {
            "permanent handler error"
        } else {
            "max attempts exceeded"
        };
        assert_eq!(d["reason"], reason, "{d}");
        assert!(d["error"].is_string(), "{d}");
        assert!(d["attempts"].is_number(), "{d}");
    }
    let poison = json_lines(&run(
        &db,
        &[
            "--json",
            "dlq",
            "list",
            &queue,
            "--reason",
            "permanent handler error",
        ],
    ));
    assert_eq!(poison.len(), 3);
    eventually_ready(&broker, &dlq, 15).await;
    let shown = run(&db, &["dlq", "show", &queue, "pay-1"]);
    assert!(shown.status.success());
    assert!(String::from_utf8_lossy(&shown.stdout).contains("\"amount_cents\""));

    // status: the queue's DLQ figure.
    let status = run(
        &db,
        &["--json", "status", "--queue", &queue, "--fail-on-dlq"],
    );
    assert_eq!(status.status.code(), Some(2));
    let status = &json_lines(&status)[0];
    assert_eq!(status["queues"][0]["dlq_ready"], 15, "{status}");

    // replay refuses without a selection; a dry run moves nothing.
    assert_eq!(run(&db, &["dlq", "replay", &queue]).status.code(), Some(1));
    let dry = run(
        &db,
        &["--json", "dlq", "replay", &queue, "--all", "--dry-run"],
    );
    assert!(dry.status.success());
    eventually_ready(&broker, &dlq, 15).await;

    let _working = spawn_example(&db.url, &queue, &[]);
    // --id: exactly those.
    let out = run(
        &db,
        &["dlq", "replay", &queue, "--id", "pay-3", "--id", "pay-5"],
    );
    assert!(out.status.success());
    eventually(
        "pay-3 and pay-5 applied",
        Duration::from_secs(30),
        || async { db.payments().await == 2 },
    )
    .await;
    assert_eq!(db.payments_for("pay-3").await, 1);
    assert_eq!(db.payments_for("pay-5").await, 1);
    eventually_ready(&broker, &dlq, 13).await;

    // --reason: exactly those; the poison stays.
    let out = run(
        &db,
        &["dlq", "replay", &queue, "--reason", "max attempts exceeded"],
    );
    assert!(out.status.success());
    assert_applied_once(&db, &load).await;
    let left = json_lines(&run(&db, &["--json", "dlq", "list", &queue]));
    assert_eq!(left.len(), 3);
    assert!(
        left.iter()
            .all(|d| d["reason"] == "permanent handler error")
    );

    // purge asks: "n" keeps them, "y" deletes them.
    let purge = |answer: &'static str| {
        let mut child = idempo(&db)
            .args(["dlq", "purge", &queue])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(answer.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let kept = purge("n\n");
    assert_eq!(kept.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&kept.stderr).contains("delete 3 dead letter(s)"));
    eventually_ready(&broker, &dlq, 3).await;
    assert!(purge("y\n").status.success());
    eventually_ready(&broker, &dlq, 0).await;
    assert_eq!(db.balances().await, load.expected);
}

#[tokio::test]
async fn a_replay_killed_mid_way_and_run_again_applies_each_payment_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    let dlq = format!("{queue}.dlq");
    let load = fill_dlq(&db, &broker, &queue, 30, 0).await;
    let _working = spawn_example(&db.url, &queue, &[]);

    let mut replay = idempo(&db)
        .args(["dlq", "replay", &queue, "--all", "--throttle", "100ms"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    eventually(
        "some payments replayed",
        Duration::from_secs(30),
        || async { db.payments().await >= 5 },
    )
    .await;
    replay.kill().unwrap(); // SIGKILL
    replay.wait().unwrap();
    let applied = db.payments().await;
    assert!(applied < 30, "the replay finished before the kill");

    let again = run(&db, &["dlq", "replay", &queue, "--all"]);
    assert!(again.status.success());
    assert_applied_once(&db, &load).await;
    eventually_ready(&broker, &dlq, 0).await;
    eventually_ready(&broker, &queue, 0).await;
    assert_eq!(db.claims().await, 30);
}

#[tokio::test]
async fn reused_ids_are_refused_unless_forced_and_foreign_messages_need_a_target() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    let dlq = format!("{queue}.dlq");
    broker.declare(&queue).await;
    let _working = spawn_example(&db.url, &queue, &[]);
    broker.publish_payment(&queue, "pay-0", "acct-a", 5).await;
    eventually("pay-0 applied", Duration::from_secs(30), || async {
        db.payments().await == 1
    })
    .await;
    broker.publish_payment(&queue, "pay-0", "acct-b", 7).await;
    eventually_ready(&broker, &dlq, 1).await;
    // A message without idempo's headers, put there by hand.
    broker
        .publish(&dlq, Some("foreign-1"), &payment_body("acct-f", 3))
        .await;

    let listed = json_lines(&run(&db, &["--json", "dlq", "list", &queue]));
    assert_eq!(listed.len(), 2);
    assert!(
        listed
            .iter()
            .any(|d| d["message_id"] == "foreign-1" && d["reason"] == "foreign")
    );

    let refused = run(&db, &["--json", "dlq", "replay", &queue, "--all"]);
    assert_eq!(refused.status.code(), Some(2));
    let lines = json_lines(&refused);
    let summary = &lines.last().unwrap()["summary"];
    assert_eq!(summary["replayed"], 0, "{summary}");
    let skipped = summary["skipped"].as_object().unwrap();
    assert!(
        skipped.keys().any(|k| k.contains("different payload")),
        "{summary}"
    );
    assert!(skipped.keys().any(|k| k.contains("--to")), "{summary}");
    eventually_ready(&broker, &dlq, 2).await;

    let to = run(
        &db,
        &["dlq", "replay", &queue, "--id", "foreign-1", "--to", &queue],
    );
    assert!(to.status.success());
    eventually("foreign-1 applied", Duration::from_secs(30), || async {
        db.payments_for("foreign-1").await == 1
    })
    .await;
    eventually_ready(&broker, &dlq, 1).await;

    // Forced: back to the consumer, which dead-letters it again; one effect.
    let forced = run(&db, &["dlq", "replay", &queue, "--id", "pay-0", "--force"]);
    assert!(forced.status.success());
    eventually_ready(&broker, &dlq, 1).await;
    let again = json_lines(&run(&db, &["--json", "dlq", "list", &queue]));
    assert_eq!(
        again[0]["reason"],
        "message id reused with a different payload"
    );
    assert_eq!(db.payments_for("pay-0").await, 1);

    // status: the consumer's claims.
    let status = json_lines(&run(&db, &["--json", "status", "--consumer", &queue]));
    assert_eq!(status[0]["consumers"][0]["claims"], 2, "{}", status[0]);
}

#[tokio::test]
async fn reap_and_cleanup_delete_only_what_is_old_or_expired() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = Db::with_pool_size(2).await;
    idempo::migrate(&db.pool).await.unwrap();
    for (id, age) in [
        ("old-1", "2 days"),
        ("old-2", "3 days"),
        ("new-1", "1 minute"),
    ] {
        sqlx::query(
            "INSERT INTO processed_messages (consumer, message_id, processed_at) \
             VALUES ('c1', $1, now() - $2::interval)",
        )
        .bind(id)
        .bind(age)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    for (key, expires) in [("k-expired", "-1 hour"), ("k-live", "1 hour")] {
        sqlx::query(
            "INSERT INTO idempotency_keys (record_key, idempotency_key, user_id, method, path, \
             request_hash, state, fencing_token, expires_at) \
             VALUES (convert_to($1, 'UTF8'), $1, 'u', 'POST', '/', '\\x00', 'complete', 1, now() + $2::interval)",
        )
        .bind(key)
        .bind(expires)
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO dedup_window (key, state, expires_at) VALUES ($1, 'seen', now() + $2::interval)",
        )
        .bind(key)
        .bind(expires)
        .execute(&db.pool)
        .await
        .unwrap();
    }

    let status = json_lines(&run(
        &db,
        &["--json", "status", "--consumer", "c1", "--queue", "x"],
    ));
    assert!(
        status.is_empty(),
        "an unknown queue is an error, not a report"
    );
    let status = run(
        &db,
        &["--json", "status", "--consumer", "c1", "--retention", "1m"],
    );
    // c1 has no queue on the broker; the short retention is warned about.
    assert_eq!(status.status.code(), Some(2));
    let status = &json_lines(&status)[0];
    assert_eq!(status["consumers"][0]["claims"], 3, "{status}");
    assert_eq!(status["http_keys"][0]["expired"], 1, "{status}");
    assert_eq!(status["window"][0]["live"], 1, "{status}");

    assert!(
        run(&db, &["reap", "--consumer", "c1", "--older-than", "1d"])
            .status
            .success()
    );
    assert_eq!(db.claims().await, 1);
    assert!(run(&db, &["cleanup"]).status.success());
    assert_eq!(db.count("SELECT count(*) FROM idempotency_keys").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM dedup_window").await, 1);
}

/// A UTC timestamp as idempo's failure headers write it, `ago` in the past
/// (GNU `date`, to keep the test free of a calendar crate).
fn failure_time(ago: &str) -> String {
    let out = Command::new("date")
        .args(["-u", "-d", ago, "+%Y-%m-%dT%H:%M:%S.000Z"])
        .output()
        .expect("run date");
    assert!(out.status.success(), "date -d {ago:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[tokio::test]
async fn purge_older_than_deletes_only_dead_letters_that_failed_before_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    // No example runs here: a migrated schema is all the binary needs.
    let db = Db::with_pool_size(2).await;
    idempo::migrate(&db.pool).await.unwrap();
    let (broker, queue) = (Broker::connect().await, unique("q"));
    let dlq = format!("{queue}.dlq");
    broker.declare(&queue).await; // and its DLQ
    let dead_letter = |id: &str, failed: Option<String>| {
        let mut headers = lapin::types::FieldTable::default();
        if let Some(at) = failed {
            headers.insert(
                "x-idempo-last-failure".into(),
                lapin::types::AMQPValue::LongString(at.into()),
            );
        }
        lapin::BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(headers)
    };
    let body = payment_body("acct-a", 5);
    let old = dead_letter("old-1", Some(failure_time("2 hours ago")));
    broker.publish_props(&dlq, old, &body).await;
    let recent = dead_letter("recent-1", Some(failure_time("1 minute ago")));
    broker.publish_props(&dlq, recent, &body).await;
    // No failure time: its age is unknown, so it is never old enough.
    broker
        .publish_props(&dlq, dead_letter("foreign-1", None), &body)
        .await;
    eventually_ready(&broker, &dlq, 3).await;

    let out = run(
        &db,
        &[
            "--json",
            "dlq",
            "purge",
            &queue,
            "--older-than",
            "1h",
            "--yes",
        ],
    );
    assert!(out.status.success());
    assert_eq!(json_lines(&out)[0]["deleted"], 1);
    eventually_ready(&broker, &dlq, 2).await;
    let left = json_lines(&run(&db, &["--json", "dlq", "list", &queue]));
    let mut ids: Vec<&str> = left
        .iter()
        .map(|d| d["message_id"].as_str().unwrap())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["foreign-1", "recent-1"]);
}

/// A mistyped command is answered with the one meant, and nothing the
/// command prints to a pipe carries a terminal escape code.
#[test]
fn a_typo_is_answered_with_the_command_meant_and_no_colour_reaches_a_pipe() {
    let binary = env!("CARGO_BIN_EXE_idempo");
    let typo = Command::new(binary).arg("stauts").output().unwrap();
    let err = String::from_utf8_lossy(&typo.stderr);
    assert_eq!(typo.status.code(), Some(2), "{err}");
    assert!(err.contains("'status'"), "a suggestion: {err}");
    let help = Command::new(binary).arg("--help").output().unwrap();
    assert!(help.status.success());
    for (what, out) in [
        ("the typo's stdout", &typo.stdout),
        ("the typo's stderr", &typo.stderr),
        ("--help", &help.stdout),
        ("--help's stderr", &help.stderr),
    ] {
        let text = String::from_utf8_lossy(out);
        assert!(
            !text.contains("\x1b["),
            "{what} has an escape code: {text:?}"
        );
    }
}
