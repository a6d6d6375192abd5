//! `idempo dashboard` as a process on real RabbitMQ and PostgreSQL: the
//! payments example fills the dead-letter table, the dashboard shows the
//! group, a replay of the group (with the token and the CSRF token, after a
//! confirmation) applies every payment exactly once; what lacks the token
//! or the CSRF token is refused, `--read-only` shows and takes no action,
//! and a public address without a token is refused at start.

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use support::cli::{dashboard, payments_db as db};
use support::example::{
    doubled_payments, fill_dead_letter_table, live_letters, publish_load, spawn_example,
};
use support::{Broker, eventually, unique};

/// One test at a time in this binary: each runs the example beside its pool.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The value of the first `name="csrf"` input of a page.
fn csrf(page: &str) -> String {
    let field = "name=\"csrf\" value=\"";
    let at = page.find(field).expect("a CSRF field") + field.len();
    page[at..].split('"').next().unwrap().to_owned()
}

/// What a confirmation page sends back when confirmed: `confirm` and the
/// hidden fields that bind it to what it counted (none from `""`).
fn confirmed(page: &str) -> Vec<(&'static str, String)> {
    let mut fields = vec![("confirm", "1".to_owned())];
    for name in ["count", "upto"] {
        let key = format!("name=\"{name}\" value=\"");
        if let Some(at) = page.find(&key) {
            let value = page[at + key.len()..].split('"').next().unwrap();
            fields.push((name, value.to_owned()));
        }
    }
    fields
}

#[tokio::test]
async fn a_group_is_shown_and_replayed_once_with_the_token_and_the_csrf_token() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    let load = fill_dead_letter_table(&db, &broker, &queue, 20, 0).await;
    let board = dashboard(&db, &["--token", "s3cret-token", "--sample-every", "200ms"]);
    let http = reqwest::Client::new();
    let get = |path: &str, token: Option<&str>| {
        let mut request = http.get(format!("{}{path}", board.url));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };

    // Without the token, or with another: 401, and no data.
    let anonymous = get("/", None).await.unwrap();
    assert_eq!(anonymous.status(), 401);
    assert!(!anonymous.text().await.unwrap().contains(&queue));
    assert_eq!(get("/", Some("wrong")).await.unwrap().status(), 401);

    let overview = get("/", Some("s3cret-token")).await.unwrap();
    assert_eq!(overview.status(), 200);
    let overview = overview.text().await.unwrap();
    assert!(overview.contains(&queue), "{overview}");
    assert!(
        !overview.contains("postgres://"),
        "no service URL on a page"
    );
    // The charts, once two samples were taken (every 200 ms here).
    eventually("the overview's charts", Duration::from_secs(20), || async {
        let page = get("/", Some("s3cret-token"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        page.contains("<svg class=\"chart\"")
            && page.contains("claims/s")
            && page.contains(&format!("{queue}: dead letters"))
    })
    .await;

    let groups = get(
        &format!("/dead-letters?queue={queue}"),
        Some("s3cret-token"),
    )
    .await
    .unwrap()
    .text()
    .await
    .unwrap();
    assert!(groups.contains("max attempts exceeded"), "{groups}");
    let fingerprint: String = sqlx::query_scalar("SELECT min(fingerprint) FROM dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let page = get(
        &format!("/dead-letters/group?queue={queue}&fingerprint={fingerprint}"),
        Some("s3cret-token"),
    )
    .await
    .unwrap()
    .text()
    .await
    .unwrap();
    let token = csrf(&page);
    let form = |csrf: Option<&str>, confirmation: Option<&str>| {
        let mut fields = vec![
            ("queue", queue.clone()),
            ("fingerprint", fingerprint.clone()),
        ];
        if let Some(csrf) = csrf {
            fields.push(("csrf", csrf.to_owned()));
        }
        if let Some(page) = confirmation {
            fields.extend(confirmed(page));
        }
        http.post(format!("{}/dead-letters/replay", board.url))
            .bearer_auth("s3cret-token")
            .form(&fields)
            .send()
    };
    // Without the CSRF token, or with a wrong one: refused, nothing replayed.
    assert_eq!(form(None, Some("")).await.unwrap().status(), 403);
    assert_eq!(form(Some("forged"), Some("")).await.unwrap().status(), 403);
    // Without the token: refused.
    let no_token = http
        .post(format!("{}/dead-letters/replay", board.url))
        .form(&[
            ("queue", queue.as_str()),
            ("fingerprint", &fingerprint),
            ("csrf", &token),
            ("confirm", "1"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(no_token.status(), 401);
    assert_eq!(live_letters(&db).await, 20);

    // The dry run first, then the confirmed replay.
    let confirm = form(Some(&token), None)
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(confirm.contains("Replay 20"), "{confirm}");
    assert_eq!(live_letters(&db).await, 20, "the dry run replays nothing");
    let _working = spawn_example(&db.url, &queue, &[("PAYMENTS_DEAD_LETTERS", "table")]);
    let done = form(Some(&token), Some(&confirm))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(done.contains("20 replayed"), "{done}");
    assert_eq!(live_letters(&db).await, 0);
    eventually("every payment applied", Duration::from_secs(60), || async {
        db.payments().await == load.ids.len() as i64
    })
    .await;
    assert_eq!(doubled_payments(&db).await, 0);
    assert_eq!(db.balances().await, load.expected);
}

#[tokio::test]
async fn read_only_shows_no_action_and_refuses_every_one() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    fill_dead_letter_table(&db, &broker, &queue, 3, 0).await;
    let board = dashboard(&db, &["--read-only"]);
    let http = reqwest::Client::new();
    let fingerprint: String = sqlx::query_scalar("SELECT min(fingerprint) FROM dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let page = http
        .get(format!(
            "{}/dead-letters/group?queue={queue}&fingerprint={fingerprint}",
            board.url
        ))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("max attempts exceeded") || page.contains(&fingerprint),
        "{page}"
    );
    assert!(
        !page.contains("<form"),
        "no action on a read-only page: {page}"
    );
    let refused = http
        .post(format!("{}/dead-letters/replay", board.url))
        .form(&[
            ("queue", queue.as_str()),
            ("fingerprint", &fingerprint),
            ("confirm", "1"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    assert_eq!(live_letters(&db).await, 3);
}

#[tokio::test]
async fn a_public_address_without_a_token_is_refused_at_start() {
    let out = Command::new(env!("CARGO_BIN_EXE_idempo"))
        .args(["dashboard", "--listen", "0.0.0.0:0"])
        .env_remove("IDEMPO_DASHBOARD_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("without a token"), "{stderr}");
}

#[tokio::test]
async fn failed_outbox_messages_are_retried_and_a_group_deleted_after_confirmation() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    fill_dead_letter_table(&db, &broker, &queue, 3, 0).await;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, state, attempts, last_error) \
         VALUES ('', 'nowhere', 'm-1', '\\x00', 'failed', 5, 'unroutable') RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let board = dashboard(&db, &[]);
    let http = reqwest::Client::new();
    let page = http
        .get(format!("{}/outbox", board.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("unroutable") && page.contains("m-1"),
        "{page}"
    );
    let token = csrf(&page);
    let retried = http
        .post(format!("{}/outbox/retry", board.url))
        .form(&[("csrf", token.as_str()), ("id", &id.to_string())])
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        retried.contains("1 failed row(s) back to pending"),
        "{retried}"
    );
    let state: String = sqlx::query_scalar("SELECT state FROM outbox WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(state, "pending");

    // Discarding asks first, then deletes the failed row (only that one).
    let doomed: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, state, attempts, last_error) \
         VALUES ('', 'nowhere', 'm-2', '\\x00', 'failed', 5, 'unroutable') RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let discard = |confirmation: Option<&str>| {
        let mut fields = vec![("csrf", token.clone()), ("id", doomed.to_string())];
        if let Some(page) = confirmation {
            fields.extend(confirmed(page));
        }
        http.post(format!("{}/outbox/discard", board.url))
            .form(&fields)
            .send()
    };
    let asked = discard(None).await.unwrap().text().await.unwrap();
    assert!(asked.contains("Discard 1"), "{asked}");
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        2,
        "asking deletes nothing"
    );
    let done = discard(Some(&asked)).await.unwrap().text().await.unwrap();
    assert!(done.contains("1 failed row(s) discarded"), "{done}");
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE message_id = 'm-2'")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE message_id = 'm-1'")
            .await,
        1
    );

    let fingerprint: String = sqlx::query_scalar("SELECT min(fingerprint) FROM dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let delete = |confirmation: Option<&str>| {
        let mut fields = vec![
            ("csrf", token.clone()),
            ("queue", queue.clone()),
            ("fingerprint", fingerprint.clone()),
        ];
        if let Some(page) = confirmation {
            fields.extend(confirmed(page));
        }
        http.post(format!("{}/dead-letters/purge", board.url))
            .form(&fields)
            .send()
    };
    let asked = delete(None).await.unwrap().text().await.unwrap();
    assert!(asked.contains("Delete 3"), "{asked}");
    assert_eq!(live_letters(&db).await, 3, "asking deletes nothing");
    let done = delete(Some(&asked)).await.unwrap().text().await.unwrap();
    assert!(done.contains("3 deleted"), "{done}");
    assert_eq!(db.count("SELECT count(*) FROM dead_letters").await, 0);
}

#[tokio::test]
async fn a_queue_dlq_is_shown_read_only_when_the_table_is_not_used() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    broker.declare(&queue).await;
    broker
        .publish(&format!("{queue}.dlq"), Some("in-the-queue"), b"{}")
        .await;
    let board = dashboard(&db, &[]);
    let page = reqwest::get(format!("{}/dead-letters?queue={queue}", board.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("in-the-queue"), "{page}");
    assert!(page.contains("read-only here"), "{page}");
    assert!(!page.contains("<form"), "no action on a queue DLQ: {page}");
    support::eventually_ready(&broker, &format!("{queue}.dlq"), 1).await;
}

#[tokio::test]
async fn the_overview_shows_each_consumer_process_with_its_counts_and_the_queue_unacked() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    broker.declare(&queue).await;
    // 50 payments, every 5th published twice: 60 deliveries, 10 duplicates.
    let load = publish_load(&broker, &queue, 50, true).await;
    assert_eq!(load.published, 60);
    let example = spawn_example(&db.url, &queue, &[]);
    eventually("50 payments applied", Duration::from_secs(60), || async {
        db.payments().await == 50
    })
    .await;
    let board = dashboard(&db, &["--sample-every", "300ms"]);
    let page = || async {
        reqwest::get(format!("{}/", board.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    // The process, from its heartbeat: alive, consuming, and its counters.
    eventually(
        "the consumer process on the overview",
        Duration::from_secs(30),
        || async {
            let page = page().await;
            page.contains(&format!(
                "<td><bdi>{queue}</bdi></td><td><bdi>{queue}</bdi></td>"
            )) && page.contains("<td><bdi>consuming</bdi></td>")
                && page.contains("<td>60</td><td>50</td><td>10</td>")
                && page.contains("1 of 1")
                && page.contains(&format!("{queue}: duplicates/s"))
        },
    )
    .await;
    drop(example);

    // Deliveries held by a client that does not ack: the queue's unacked,
    // from RabbitMQ's management API.
    broker.publish_many(&queue, &load_more(5)).await;
    let channel = broker.connection.create_channel().await.unwrap();
    channel
        .basic_qos(5, lapin::options::BasicQosOptions::default())
        .await
        .unwrap();
    let _holding = channel
        .basic_consume(
            queue.as_str().into(),
            "holder".into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    eventually(
        "5 unacked on the overview (is the management plugin enabled? \
         rabbitmq-plugins enable rabbitmq_management)",
        Duration::from_secs(40),
        || async {
            page()
                .await
                .contains(&format!("<td><bdi>{queue}</bdi></td><td>0</td><td>5</td>"))
        },
    )
    .await;
}

/// `n` messages that are not payments the example knows (never consumed here).
fn load_more(n: usize) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| (format!("held-{i}"), b"{}".to_vec()))
        .collect()
}

#[tokio::test]
async fn a_dead_letter_shows_its_trace_id_linked_by_the_trace_url_template() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, broker, queue) = (db().await, Broker::connect().await, unique("q"));
    broker.declare(&queue).await;
    broker.track(&format!("{queue}.dlq"));
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{trace}-00f067aa0ba902b7-01");
    // No message id: dead-lettered at once, into the table.
    broker
        .publish_with_headers(&queue, &[("traceparent", &traceparent)], b"{not json")
        .await;
    let example = spawn_example(&db.url, &queue, &[("PAYMENTS_DEAD_LETTERS", "table")]);
    eventually(
        "the letter in the table",
        Duration::from_secs(60),
        || async { live_letters(&db).await == 1 },
    )
    .await;
    drop(example);
    let id: i64 = sqlx::query_scalar("SELECT id FROM dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let template = "http://jaeger.example:16686/trace/{trace_id}";
    let board = dashboard(&db, &["--read-only", "--trace-url", template]);
    let page = reqwest::get(format!("{}/dead-letters/{id}", board.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(&format!(
            "<a href=\"http://jaeger.example:16686/trace/{trace}\">{trace}</a>"
        )),
        "{page}"
    );
    drop(board);
    // Without a template, the id as text; a template without {trace_id} is
    // refused at start.
    let board = dashboard(&db, &["--read-only"]);
    let page = reqwest::get(format!("{}/dead-letters/{id}", board.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains(&format!("<dd>{trace}</dd>")), "{page}");
    let out = support::cli::idempo(&db)
        .args(["dashboard", "--listen", "127.0.0.1:0"])
        .env("IDEMPO_TRACE_URL", "http://jaeger/trace/")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("{trace_id}"), "{stderr}");
}
