//! `idempo dashboard` attacked as a hostile user would, over raw HTTP:
//! headers, DNS rebinding, cross-site posts, weak tokens, guessed tokens,
//! sessions, half-sent requests, confirmations that no longer hold,
//! concurrent replays, views of a RabbitMQ DLQ, thousands of causes.

mod support;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use support::cli::{dashboard, idempo, payments_db as db};
use support::{Broker, Db, unique};

/// One test at a time: each runs a dashboard beside a small pool.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const TOKEN: &str = "s3cret-token";

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// The value of the first `csrf` field of a page, however quoted.
fn csrf(page: &str) -> String {
    let at = page
        .find("name=\"csrf\"")
        .or_else(|| page.find("name=csrf"))
        .unwrap_or_else(|| panic!("a CSRF field: {page}"));
    let rest = &page[at..];
    let value = rest.find("value=").expect("a value") + "value=".len();
    rest[value..]
        .trim_start_matches('"')
        .split(['"', ' ', '>'])
        .next()
        .unwrap()
        .to_owned()
}

/// Inserts `n` live dead letters of one cause (`fingerprint`) of `queue`
/// straight into the table, with decodable (empty) properties.
async fn letters(db: &Db, queue: &str, fingerprint: &str, n: usize, first: usize) {
    for i in first..first + n {
        sqlx::query(
            "INSERT INTO dead_letters (consumer, queue, message_id, payload_sha256, exchange, \
                 routing_key, properties, headers, body, reason, error, fingerprint, attempts, \
                 first_failed_at, last_failed_at) \
             VALUES ($1, $1, $2, sha256($3), '', $1, '\\x0000', '{}', $3, 'permanent handler error', \
                 'refused', $4, 1, now(), now())",
        )
        .bind(queue)
        .bind(format!("m-{i}"))
        .bind(format!("{{\"n\":{i}}}").into_bytes())
        .bind(fingerprint)
        .execute(&db.pool)
        .await
        .unwrap();
    }
}

async fn live(db: &Db, queue: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE queue = $1 AND state = 'live'")
        .bind(queue)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// A page's text, fetched with the token.
async fn get(url: &str) -> String {
    client()
        .get(url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn every_response_carries_the_security_headers() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = db().await;
    let board = dashboard(&db, &["--token", TOKEN]);
    for path in ["/login", "/"] {
        let response = client()
            .get(format!("{}{path}", board.url))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        let headers = response.headers();
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("default-src 'self'") && csp.contains("frame-ancestors 'none'"),
            "{csp}"
        );
        assert!(!csp.contains("unsafe-inline"), "{csp}");
        assert_eq!(headers["x-content-type-options"], "nosniff");
        assert_eq!(headers["referrer-policy"], "same-origin");
        assert_eq!(headers["cache-control"], "no-store", "{path}");
        let page = response.text().await.unwrap();
        assert!(
            !page.contains("<script>") && !page.contains("style=\""),
            "{page}"
        );
    }
}

#[tokio::test]
async fn without_a_token_only_localhost_is_answered_and_no_cross_site_post() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = db().await;
    let board = dashboard(&db, &[]);
    let rebound = client()
        .get(format!("{}/", board.url))
        .header("host", "rebind.attacker.example")
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), 421);
    assert!(!rebound.text().await.unwrap().contains("csrf"));
    sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, state, attempts, last_error) \
         VALUES ('', 'nowhere', 'f-1', '\\x00', 'failed', 5, 'unroutable')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let page = client()
        .get(format!("{}/outbox", board.url))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let token = csrf(&page.text().await.unwrap());
    let forged = client()
        .post(format!("{}/outbox/retry", board.url))
        .header("origin", "http://evil.example")
        .form(&[("csrf", token.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 403);
    let same_origin = client()
        .post(format!("{}/outbox/retry", board.url))
        .header("origin", &board.url)
        .form(&[("csrf", token.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(same_origin.status(), 200);
}

#[tokio::test]
async fn a_weak_token_is_refused_at_start() {
    let db = db().await;
    let out = idempo(&db)
        .args(["dashboard", "--listen", "127.0.0.1:0", "--token", "a"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 12 characters"));
}

#[tokio::test]
async fn guessing_the_token_is_slowed_down_and_each_sign_in_has_its_own_session() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = db().await;
    let board = dashboard(&db, &["--token", TOKEN]);
    let login = |token: &'static str| {
        client()
            .post(format!("{}/login", board.url))
            .form(&[("token", token)])
            .send()
    };
    // Two sessions, two cookies, each with an expiry.
    let cookie = |r: &reqwest::Response| -> String {
        let set = r.headers()["set-cookie"].to_str().unwrap().to_owned();
        assert!(
            set.contains("Max-Age=") && set.contains("HttpOnly"),
            "{set}"
        );
        set.split(';').next().unwrap().to_owned()
    };
    let (one, two) = (login(TOKEN).await.unwrap(), login(TOKEN).await.unwrap());
    let (one, two) = (cookie(&one), cookie(&two));
    assert_ne!(one, two);
    let page = |cookie: String| {
        client()
            .get(format!("{}/logout", board.url))
            .header("cookie", cookie)
            .send()
    };
    let sign_out = page(one.clone()).await.unwrap();
    assert_eq!(sign_out.status(), 200);
    let token = csrf(&sign_out.text().await.unwrap());
    // Signing out ends that session only.
    let out = client()
        .post(format!("{}/logout", board.url))
        .header("cookie", one.clone())
        .form(&[("csrf", token.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(out.status(), 303);
    assert_eq!(page(one).await.unwrap().status(), 401);
    assert_eq!(page(two).await.unwrap().status(), 200);
    // Wrong guesses: the third locks the address out.
    for _ in 0..3 {
        assert_eq!(login("wrong-token-xx").await.unwrap().status(), 401);
    }
    let started = Instant::now();
    let locked = login(TOKEN).await.unwrap();
    assert_eq!(locked.status(), 429, "even the right token waits");
    assert!(locked.headers().contains_key("retry-after"));
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn a_half_sent_request_is_closed_after_the_header_timeout() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = db().await;
    let board = dashboard(&db, &["--token", TOKEN]);
    let addr = board.url.trim_start_matches("http://").to_owned();
    let started = Instant::now();
    let closed = tokio::task::spawn_blocking(move || {
        let mut socket = std::net::TcpStream::connect(addr).unwrap();
        socket
            .write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            .unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut buffer = Vec::new();
        // Returns once the server closes the connection.
        socket.read_to_end(&mut buffer).map(|_| buffer)
    })
    .await
    .unwrap();
    let waited = started.elapsed();
    assert!(closed.is_ok(), "{closed:?}");
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(20),
        "closed after {waited:?}"
    );
}

#[tokio::test]
async fn a_confirmation_binds_what_it_counted() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = db().await;
    let queue = unique("bound");
    letters(&db, &queue, "cause-1", 3, 0).await;
    let board = dashboard(&db, &["--token", TOKEN]);
    let post = |fields: Vec<(&'static str, String)>| {
        client()
            .post(format!("{}/dead-letters/purge", board.url))
            .bearer_auth(TOKEN)
            .form(&fields)
            .send()
    };
    let group = get(&format!(
        "{}/dead-letters/group?queue={queue}&fingerprint=cause-1",
        board.url
    ))
    .await;
    let token = csrf(&group);
    let base = vec![
        ("csrf", token.clone()),
        ("queue", queue.clone()),
        ("fingerprint", "cause-1".to_owned()),
    ];
    let asked = post(base.clone()).await.unwrap().text().await.unwrap();
    assert!(asked.contains("Delete 3"), "{asked}");
    let field = |name: &str| -> String {
        let key = format!("name=\"{name}\" value=\"");
        let at = asked
            .find(&key)
            .unwrap_or_else(|| panic!("{name}: {asked}"))
            + key.len();
        asked[at..].split('"').next().unwrap().to_owned()
    };
    let (count, upto) = (field("count"), field("upto"));
    // 500 more arrive before the operator confirms.
    letters(&db, &queue, "cause-1", 500, 3).await;
    let mut confirmed = base.clone();
    confirmed.extend([
        ("confirm", "1".to_owned()),
        ("count", count),
        ("upto", upto),
    ]);
    let done = post(confirmed.clone()).await.unwrap();
    assert_eq!(done.status(), 200, "the 3 counted are still there");
    assert!(done.text().await.unwrap().contains("3 deleted"));
    assert_eq!(live(&db, &queue).await, 500, "only what was counted went");
    // Confirmed again, the same form no longer holds: nothing done.
    let stale = post(confirmed).await.unwrap();
    assert_eq!(stale.status(), 409);
    assert_eq!(live(&db, &queue).await, 500);
}

#[tokio::test]
async fn concurrent_replays_neither_deadlock_nor_replay_twice() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = db().await;
    let queue = unique("twice");
    letters(&db, &queue, "cause-2", 300, 0).await;
    let board = dashboard(&db, &["--token", TOKEN]);
    let group = get(&format!(
        "{}/dead-letters/group?queue={queue}&fingerprint=cause-2",
        board.url
    ))
    .await;
    let fields = vec![
        ("csrf", csrf(&group)),
        ("queue", queue.clone()),
        ("fingerprint", "cause-2".to_owned()),
        ("confirm", "1".to_owned()),
        ("count", "300".to_owned()),
        ("upto", i64::MAX.to_string()),
    ];
    let replay = || {
        client()
            .post(format!("{}/dead-letters/replay", board.url))
            .bearer_auth(TOKEN)
            .timeout(Duration::from_secs(30))
            .form(&fields)
            .send()
    };
    let started = Instant::now();
    let (a, b) = tokio::join!(replay(), replay());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    let statuses = (a.status().as_u16(), b.status().as_u16());
    let texts = (a.text().await.unwrap(), b.text().await.unwrap());
    assert!(
        statuses.0 != 503 && statuses.1 != 503,
        "{statuses:?} {texts:?}"
    );
    // Rows of one message, or packed rows of several.
    let staged: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(greatest(messages, 1)), 0)::int8 FROM outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(staged, 300, "each letter staged once: {texts:?}");
    assert_eq!(live(&db, &queue).await, 0);
}

#[tokio::test]
async fn viewing_a_queue_dlq_does_not_change_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = db().await;
    let broker = Broker::connect().await;
    let queue = unique("viewed");
    let dlq = format!("{queue}.dlq");
    broker.declare(&dlq).await;
    for i in 0..100 {
        broker
            .publish(&dlq, Some(&format!("letter-{i}")), b"{}")
            .await;
    }
    // Read-only: not browsed at all.
    let read_only = dashboard(&db, &["--read-only"]);
    let page = client()
        .get(format!("{}/dead-letters?queue={queue}", read_only.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !page.contains("letter-0") && page.contains("idempo dlq list"),
        "{page}"
    );
    drop(read_only);
    // Eight views at once, one cut off: one walk at a time, nothing doubled.
    let board = dashboard(&db, &[]);
    let view = || {
        client()
            .get(format!("{}/dead-letters?queue={queue}", board.url))
            .timeout(Duration::from_secs(20))
            .send()
    };
    let cut = client()
        .get(format!("{}/dead-letters?queue={queue}", board.url))
        .timeout(Duration::from_millis(5))
        .send()
        .await;
    assert!(cut.is_err(), "cut off");
    let views = futures::future::join_all((0..8).map(|_| view())).await;
    for v in views {
        let page = v.unwrap().text().await.unwrap();
        assert!(
            page.contains("letter-0") && page.contains("letter-99"),
            "every view lists them: {page}"
        );
        assert!(
            !page.contains("data-refresh"),
            "a DLQ listing does not refresh itself"
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut ids: Vec<Option<String>> = broker
        .drain(&dlq)
        .await
        .into_iter()
        .map(|d| d.message_id)
        .collect();
    assert_eq!(ids.len(), 100, "nothing doubled, nothing lost");
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 100);
}

#[tokio::test]
async fn thousands_of_causes_are_paged() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = db().await;
    let queue = unique("causes");
    for i in 0..150 {
        letters(&db, &queue, &format!("cause-{i:03}"), 1, i).await;
    }
    let board = dashboard(&db, &["--sample-every", "200ms"]);
    let page = client()
        .get(format!("{}/dead-letters", board.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let shown = page.matches("fingerprint=cause-").count();
    assert_eq!(shown, 100, "{page}");
    assert!(page.contains("largest causes are shown"));
    // The overview lists the 50 largest, and says how many more there are.
    support::eventually("the overview's sample", Duration::from_secs(20), || async {
        let overview = client()
            .get(format!("{}/", board.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        overview.matches("fingerprint=cause-").count() == 50 && overview.contains("100 more causes")
    })
    .await;
}
