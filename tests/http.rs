//! The `Idempotency-Key` layer against a real axum server on an ephemeral
//! port, for each store: PostgreSQL (with the atomic phase), Redis and memory.
//! Effects are rows in `http_payments`, counted in PostgreSQL.

mod support;

#[path = "../examples/common/http_payments.rs"]
mod http_payments;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use idempo::Tx;
use idempo::http::{
    Begin, Fingerprint, IdempotencyLayer, IdempotencyStore, MemoryStore, Operation, PostgresStore,
    RecordKey, RedisStore, StoredResponse,
};
use support::{Db, START_REDIS, TcpProxy, pool_through, redis_url, unique};

/// A store under test: made fresh for each test, and, where it can be, made
/// through a proxy that the test can cut.
trait TestStore: IdempotencyStore + Clone + Sized {
    /// Whether `delete_expired` deletes (Redis expires keys by itself).
    const DELETES_EXPIRED: bool;
    async fn make(db: &Db) -> Self;
    async fn through(proxy: &TcpProxy, db: &Db) -> Option<Self>;
}

impl TestStore for PostgresStore {
    const DELETES_EXPIRED: bool = true;
    async fn make(db: &Db) -> Self {
        PostgresStore::new(db.pool.clone())
    }
    async fn through(proxy: &TcpProxy, db: &Db) -> Option<Self> {
        Some(PostgresStore::new(pool_through(proxy, db).await))
    }
}

impl TestStore for RedisStore {
    const DELETES_EXPIRED: bool = false;
    async fn make(_: &Db) -> Self {
        let url = redis_url();
        RedisStore::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("Redis is not reachable at {url}: {e}\n{START_REDIS}"))
            .with_prefix(format!("{}:", unique("http")))
    }
    async fn through(proxy: &TcpProxy, _: &Db) -> Option<Self> {
        let url = format!("redis://{}", proxy.addr);
        let store = RedisStore::connect(&url)
            .await
            .expect("redis through the proxy");
        Some(store.with_prefix(format!("{}:", unique("http"))))
    }
}

impl TestStore for Arc<MemoryStore> {
    const DELETES_EXPIRED: bool = true;
    async fn make(_: &Db) -> Self {
        Arc::new(MemoryStore::new())
    }
    async fn through(_: &TcpProxy, _: &Db) -> Option<Self> {
        None // in-process: it cannot be down
    }
}

/// `POST /payments` as in the example, with test controls in headers (which
/// are not part of the fingerprint): `x-delay-ms` sleeps first; after the
/// insert, `x-fail` answers that status instead, `x-panic` panics, `x-pad`
/// replaces the 201's body with that many bytes; `x-abort-then` runs a failing
/// statement in the handler's transaction (ignoring the error) and answers
/// that status; `x-steal` moves the key to another owner (as a takeover would)
/// before answering; `x-kill-backend` terminates the handler's database
/// connection before it writes (a real database error: the answer is 503).
async fn payments(
    tx: Option<Tx>,
    state: State<sqlx::PgPool>,
    headers: HeaderMap,
    body: axum::Json<http_payments::NewPayment>,
) -> Result<Response, http_payments::Failure> {
    let number = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u16>().ok())
    };
    if let Some(ms) = number("x-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms.into())).await;
    }
    let pool = state.0.clone();
    let (fail, pad, abort) = (number("x-fail"), number("x-pad"), number("x-abort-then"));
    let (panics, steals) = (
        headers.contains_key("x-panic"),
        headers.contains_key("x-steal"),
    );
    if headers.contains_key("x-kill-backend") {
        // A real database error before any write: the handler's backend is
        // terminated under it.
        let kill = "SELECT pg_terminate_backend(pg_backend_pid())";
        match &tx {
            Some(tx) => sqlx::query(kill).execute(&mut *tx.try_lock()?).await?,
            None => {
                sqlx::query(kill)
                    .execute(&mut *pool.acquire().await?)
                    .await?
            }
        };
    }
    let response = http_payments::create(tx.clone(), state, headers, body).await?;
    if panics {
        panic!("the handler panicked on purpose");
    }
    if let Some(status) = fail {
        return Ok(StatusCode::from_u16(status).unwrap().into_response());
    }
    if let Some(status) = abort {
        let tx = tx.expect("x-abort-then needs the atomic phase");
        let failed = sqlx::query("SELECT 1 / 0")
            .execute(&mut *tx.try_lock()?)
            .await;
        assert!(failed.is_err());
        return Ok(StatusCode::from_u16(status).unwrap().into_response());
    }
    if steals {
        sqlx::query("UPDATE idempotency_keys SET fencing_token = fencing_token + 1000000")
            .execute(&pool)
            .await?;
    }
    Ok(match pad {
        Some(n) => (response.status(), vec![b'x'; n.into()]).into_response(),
        None => response,
    })
}

struct App {
    db: Db,
    base: String,
    client: reqwest::Client,
}

/// What the client got.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Bytes,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes())
            == Some(b"true")
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    /// The problem `type` fragment of a problem+json answer.
    fn problem(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "{self:?}"
        );
        let kind = self.json()["type"].as_str().unwrap().to_owned();
        kind.rsplit('#').next().unwrap().to_owned()
    }

    fn payment_id(&self) -> String {
        self.json()["payment_id"].as_str().unwrap().to_owned()
    }
}

fn payment(account: &str, cents: i64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "account": account, "amount_cents": cents })).unwrap()
}

impl App {
    /// Serves `/payments` behind `layer` (key required, user from
    /// `X-User-Id`, as in the example) on an ephemeral port.
    async fn start<St: IdempotencyStore>(db: Db, layer: IdempotencyLayer<St>) -> App {
        http_payments::create_table(&db.pool).await.unwrap();
        let layer = layer.require_key().user(http_payments::user_of);
        let router = Router::new()
            .route("/payments", post(payments).layer(layer))
            .with_state(db.pool.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        App {
            db,
            base,
            client: reqwest::Client::new(),
        }
    }

    async fn post(
        &self,
        key: Option<&[u8]>,
        user: &str,
        body: Vec<u8>,
        extra: &[(&str, &str)],
    ) -> Answer {
        self.try_post(key, user, body, extra)
            .await
            .expect("the request failed")
    }

    async fn try_post(
        &self,
        key: Option<&[u8]>,
        user: &str,
        body: Vec<u8>,
        extra: &[(&str, &str)],
    ) -> reqwest::Result<Answer> {
        let mut request = self
            .client
            .post(format!("{}/payments", self.base))
            .header("content-type", "application/json")
            .header("x-user-id", user)
            .body(body);
        if let Some(key) = key {
            request = request.header("idempotency-key", HeaderValue::from_bytes(key).unwrap());
        }
        for (name, value) in extra {
            request = request.header(*name, *value);
        }
        let response = request.send().await?;
        Ok(Answer {
            status: response.status().as_u16(),
            headers: response.headers().clone(),
            body: response.bytes().await?,
        })
    }

    async fn effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM http_payments")
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }
}

async fn app<St: TestStore>(
    configure: impl FnOnce(IdempotencyLayer<St>) -> IdempotencyLayer<St>,
) -> (App, St) {
    let db = Db::new().await;
    let store = St::make(&db).await;
    let layer = configure(IdempotencyLayer::new(store.clone()).ttl(Duration::from_secs(120)));
    (App::start(db, layer).await, store)
}

async fn replay_returns_the_stored_response<St: TestStore>() {
    let (app, _) = app::<St>(|l| l).await;
    let first = app
        .post(Some(b"order-1"), "alice", payment("acc-1", 500), &[])
        .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    let again = app
        .post(Some(b"order-1"), "alice", payment("acc-1", 500), &[])
        .await;
    assert_eq!(again.status, 201);
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body, "byte for byte");
    assert_eq!(again.headers["content-type"], first.headers["content-type"]);
    assert_eq!(again.headers["location"], first.headers["location"]);
    // The quoted form of the same key is the same key.
    let quoted = app
        .post(Some(b"\"order-1\""), "alice", payment("acc-1", 500), &[])
        .await;
    assert!(quoted.replayed());
    assert_eq!(quoted.body, first.body);
    assert_eq!(app.effects().await, 1);
}

async fn changed_body_is_422<St: TestStore>() {
    let (app, _) = app::<St>(|l| l).await;
    let first = app
        .post(Some(b"k"), "alice", payment("acc-1", 500), &[])
        .await;
    assert_eq!(first.status, 201);
    let changed = app
        .post(Some(b"k"), "alice", payment("acc-1", 501), &[])
        .await;
    assert_eq!(changed.status, 422, "{changed:?}");
    assert_eq!(changed.problem(), "key-mismatch");
    // Also while the first request is still running.
    let slow = {
        let app_base = app.base.clone();
        let client = app.client.clone();
        tokio::spawn(async move {
            client
                .post(format!("{app_base}/payments"))
                .header("content-type", "application/json")
                .header("x-user-id", "bob")
                .header("idempotency-key", "k2")
                .header("x-delay-ms", "1500")
                .body(payment("acc-2", 1))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = app.post(Some(b"k2"), "bob", payment("acc-2", 2), &[]).await;
    assert_eq!(during.status, 422, "{during:?}");
    assert_eq!(slow.await.unwrap(), 201);
    assert_eq!(app.effects().await, 2);
}

async fn concurrent_requests_make_one_effect<St: TestStore>() {
    let (app, _) = app::<St>(|l| l).await;
    let app = Arc::new(app);
    let requests = (0..64).map(|_| {
        let app = app.clone();
        tokio::spawn(async move {
            app.post(
                Some(b"same-key"),
                "alice",
                payment("acc-1", 700),
                &[("x-delay-ms", "200")],
            )
            .await
        })
    });
    let answers: Vec<Answer> = futures::future::join_all(requests)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let fresh: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.status == 201 && !a.replayed())
        .collect();
    assert_eq!(fresh.len(), 1, "exactly one request executed: {answers:?}");
    let id = fresh[0].payment_id();
    for answer in &answers {
        match answer.status {
            201 => assert_eq!(answer.payment_id(), id),
            409 => {
                assert_eq!(answer.problem(), "in-progress");
                assert!(answer.headers.contains_key("retry-after"));
            }
            other => panic!("unexpected status {other}: {answer:?}"),
        }
    }
    assert_eq!(app.effects().await, 1);
}

async fn two_users_with_one_key_make_two_effects<St: TestStore>() {
    let (app, _) = app::<St>(|l| l).await;
    let alice = app
        .post(Some(b"shared"), "alice", payment("acc-1", 5), &[])
        .await;
    let bob = app
        .post(Some(b"shared"), "bob", payment("acc-1", 5), &[])
        .await;
    assert_eq!((alice.status, bob.status), (201, 201));
    assert!(!bob.replayed(), "bob must not get alice's answer");
    assert_ne!(alice.payment_id(), bob.payment_id());
    assert_eq!(app.effects().await, 2);
}

async fn separators_in_user_ids_cannot_reach_another_users_record<St: TestStore>() {
    let (app, _) = app::<St>(|l| l).await;
    let victim = app
        .post(Some(b"b:c"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(victim.status, 201);
    // Each pair joins to the same string with a naive separator
    // (`alice:b:c`, `alice|b:c`, `alice:POST:/payments:b:c`).
    for (user, key) in [
        ("alice:b", "c"),
        ("alice|b", ":c"),
        ("alice:POST:/payments:b", "c"),
    ] {
        let attacker = app
            .post(Some(key.as_bytes()), user, payment("acc-1", 5), &[])
            .await;
        assert_eq!(attacker.status, 201, "{user:?} {attacker:?}");
        assert!(!attacker.replayed(), "{user:?} replayed alice's response");
        assert_ne!(attacker.payment_id(), victim.payment_id());
    }
    assert_eq!(app.effects().await, 4);
}

async fn body_over_the_limit_is_413<St: TestStore>() {
    let (app, _) = app::<St>(|l| l.max_request_body(1024)).await;
    let big = payment(&"a".repeat(2048), 5);
    let answer = app.post(Some(b"big"), "alice", big, &[]).await;
    assert_eq!(answer.status, 413, "{answer:?}");
    assert_eq!(answer.problem(), "body-too-large");
    let small = app
        .post(Some(b"big"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(small.status, 201, "a rejected body leaves the key unused");
    assert_eq!(app.effects().await, 1);
}

async fn malformed_and_missing_keys_are_400<St: TestStore>() {
    let (app, _) = app::<St>(|l| l).await;
    let long = vec![b'k'; 256];
    let cases: [(&[u8], &str); 6] = [
        (b"", "empty"),
        (&long, "256 characters"),
        (b"has space", "a space"),
        (b"caf\xe9", "non-ASCII"),
        (b"\"open", "an unterminated quote"),
        (b"\"a\"b\"", "a bare quote inside"),
    ];
    for (key, what) in cases {
        let answer = app.post(Some(key), "alice", payment("acc-1", 5), &[]).await;
        assert_eq!(answer.status, 400, "{what}: {answer:?}");
        assert_eq!(answer.problem(), "invalid-key", "{what}");
    }
    let max = app
        .post(Some(&long[..255]), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(max.status, 201, "255 characters are allowed");
    // A quoted key may hold spaces (an RFC 8941 string), not control
    // characters; its copy with the same spaces is the same key.
    let spaced = app
        .post(Some(b"\"order 42\""), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(spaced.status, 201, "{spaced:?}");
    let again = app
        .post(Some(b"\"order 42\""), "alice", payment("acc-1", 5), &[])
        .await;
    assert!(again.replayed(), "{again:?}");
    let tab = app
        .post(Some(b"\"order\t42\""), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(tab.status, 400, "a tab in a quoted key: {tab:?}");
    let missing = app.post(None, "alice", payment("acc-1", 5), &[]).await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.problem(), "missing-key");
    let twice = app
        .client
        .post(format!("{}/payments", app.base))
        .header("content-type", "application/json")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(payment("acc-1", 5))
        .send()
        .await
        .unwrap();
    assert_eq!(twice.status(), 400);
    assert_eq!(app.effects().await, 2);
}

async fn an_expired_record_counts_as_absent<St: TestStore>() {
    let (app, store) = app::<St>(|l| l.ttl(Duration::from_millis(1500))).await;
    let first = app
        .post(Some(b"ttl"), "alice", payment("acc-1", 5), &[])
        .await;
    let soon = app
        .post(Some(b"ttl"), "alice", payment("acc-1", 5), &[])
        .await;
    assert!(soon.replayed());
    tokio::time::sleep(Duration::from_millis(1800)).await;
    // A different body is no mismatch any more: the key is free.
    let later = app
        .post(Some(b"ttl"), "alice", payment("acc-1", 6), &[])
        .await;
    assert_eq!(later.status, 201);
    assert!(!later.replayed());
    assert_ne!(later.payment_id(), first.payment_id());
    assert_eq!(app.effects().await, 2);
    let other = app
        .post(Some(b"ttl-2"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(other.status, 201);
    tokio::time::sleep(Duration::from_millis(1800)).await;
    let deleted = store.delete_expired(100).await.unwrap();
    if St::DELETES_EXPIRED {
        assert_eq!(deleted, 2, "both expired records are deleted");
        assert_eq!(store.delete_expired(100).await.unwrap(), 0);
    }
}

async fn an_expired_lease_is_taken_over_and_the_stale_token_is_fenced<St: TestStore>() {
    let lease = Duration::from_millis(1000);
    let ttl = Duration::from_secs(60);
    let (app, store) = app::<St>(|l| l.lease(lease)).await;
    let body = payment("acc-1", 5);
    let fingerprint = Fingerprint::of_request("POST", "/payments", &body);
    let attempt = |record| Operation {
        key: record,
        fingerprint: &fingerprint,
        lease,
        ttl,
    };

    // Through HTTP: a worker took the key and died before finishing.
    let record = RecordKey::new(Some("alice"), "POST", "/payments", "crash");
    let Begin::Started(_dead) = store.begin(attempt(&record)).await.unwrap() else {
        panic!("the key was free")
    };
    let busy = app.post(Some(b"crash"), "alice", body.clone(), &[]).await;
    assert_eq!(
        busy.status, 409,
        "the dead worker's lease is still live: {busy:?}"
    );
    assert_eq!(busy.problem(), "in-progress");
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    let retry = app.post(Some(b"crash"), "alice", body.clone(), &[]).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    let replay = app.post(Some(b"crash"), "alice", body.clone(), &[]).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
    assert_eq!(app.effects().await, 1);

    // At the store: while the new owner is still working, the old token can
    // neither renew, complete nor release.
    let record = RecordKey::new(Some("alice"), "POST", "/payments", "fence");
    let Begin::Started(old) = store.begin(attempt(&record)).await.unwrap() else {
        panic!("the key was free")
    };
    assert!(matches!(
        store.begin(attempt(&record)).await.unwrap(),
        Begin::InProgress { lease_left: Some(left) } if left <= lease
    ));
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    let Begin::Started(new) = store.begin(attempt(&record)).await.unwrap() else {
        panic!("an expired lease is taken over")
    };
    assert_ne!(new, old);
    let late = StoredResponse::new(StatusCode::OK, vec![], Bytes::from_static(b"stale"));
    assert!(!store.extend(&record, old, lease).await.unwrap());
    assert!(!store.complete(&record, old, &late, ttl).await.unwrap());
    assert!(!store.release(&record, old).await.unwrap());
    assert!(matches!(
        store.begin(attempt(&record)).await.unwrap(),
        Begin::InProgress { lease_left: Some(left) } if left <= lease
    ));
    let fresh = StoredResponse::new(StatusCode::CREATED, vec![], Bytes::from_static(b"new"));
    assert!(store.extend(&record, new, lease).await.unwrap());
    assert!(store.complete(&record, new, &fresh, ttl).await.unwrap());
    assert_eq!(
        store.begin(attempt(&record)).await.unwrap(),
        Begin::Completed(fresh)
    );
}

async fn the_lease_is_renewed_while_the_handler_runs<St: TestStore>() {
    let lease = Duration::from_millis(300);
    let (app, _) = app::<St>(|l| l.lease(lease)).await;
    let app = Arc::new(app);
    let slow = {
        let app = app.clone();
        tokio::spawn(async move {
            app.post(
                Some(b"slow"),
                "alice",
                payment("acc-1", 5),
                &[("x-delay-ms", "1200")],
            )
            .await
        })
    };
    for _ in 0..3 {
        tokio::time::sleep(lease).await;
        let during = app
            .post(Some(b"slow"), "alice", payment("acc-1", 5), &[])
            .await;
        assert_eq!(
            during.status, 409,
            "a live handler's lease must not be taken over: {during:?}"
        );
    }
    let first = slow.await.unwrap();
    assert_eq!(first.status, 201);
    let after = app
        .post(Some(b"slow"), "alice", payment("acc-1", 5), &[])
        .await;
    assert!(after.replayed());
    assert_eq!(app.effects().await, 1);
}

async fn an_oversize_response_is_not_stored<St: TestStore>() {
    let (app, store) = app::<St>(|l| l.max_response_body(1024)).await;
    let pad = [("x-pad", "4096")];
    let first = app
        .post(Some(b"big-answer"), "alice", payment("acc-1", 5), &pad)
        .await;
    if store.atomic().is_some() {
        // Atomic phase: an effect whose answer cannot be replayed is rolled back.
        assert_eq!(first.status, 500, "{first:?}");
        assert_eq!(first.problem(), "response-too-large");
        assert_eq!(app.effects().await, 0);
    } else {
        // Passed through whole, and the key released: a retry executes again.
        assert_eq!(first.status, 201);
        assert_eq!(first.body.len(), 4096);
        let again = app
            .post(Some(b"big-answer"), "alice", payment("acc-1", 5), &pad)
            .await;
        assert_eq!(again.body.len(), 4096);
        assert!(!again.replayed());
        assert_eq!(app.effects().await, 2);
    }
    // A small answer with the same key is stored as usual.
    let small = app
        .post(Some(b"big-answer"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(small.status, 201);
    assert!(!small.replayed());
    let replay = app
        .post(Some(b"big-answer"), "alice", payment("acc-1", 5), &[])
        .await;
    assert!(replay.replayed());
}

async fn a_store_that_is_down_fails_closed<St: TestStore>() {
    let db = Db::new().await;
    let target = if std::any::type_name::<St>().contains("Redis") {
        redis_url().trim_start_matches("redis://").to_owned()
    } else {
        support::ServiceUrl::database().addr()
    };
    let proxy = TcpProxy::start(&target).await;
    let Some(store) = St::through(&proxy, &db).await else {
        return; // the memory store lives in the process: it cannot be down
    };
    let open_store = St::through(&proxy, &db).await.unwrap();
    let closed = App::start(db, IdempotencyLayer::new(store)).await;
    let open = App::start(
        Db::new().await,
        IdempotencyLayer::new(open_store).fail_open(),
    )
    .await;
    assert_eq!(
        closed
            .post(Some(b"up"), "alice", payment("acc-1", 5), &[])
            .await
            .status,
        201
    );
    proxy.cut();
    let answer = closed
        .post(Some(b"down"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(answer.status, 503, "{answer:?}");
    assert_eq!(answer.problem(), "store-unavailable");
    assert_eq!(closed.effects().await, 1, "nothing was executed");
    let answer = open
        .post(Some(b"down"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(answer.status, 201, "fail-open runs the request: {answer:?}");
    assert_eq!(open.effects().await, 1);
}

async fn unstored_statuses_errors_and_panics_release_the_key<St: TestStore>() {
    let (app, store) = app::<St>(|l| l).await;
    let atomic = store.atomic().is_some();
    let body = || payment("acc-1", 5);
    // Both fail after the handler inserted its row.
    let busy = app
        .post(Some(b"r"), "alice", body(), &[("x-fail", "429")])
        .await;
    assert_eq!(busy.status, 429);
    let panicked = app
        .try_post(Some(b"r"), "alice", body(), &[("x-panic", "1")])
        .await;
    assert!(
        panicked.is_err(),
        "a panicking handler drops the connection: {panicked:?}"
    );
    // With the atomic phase both inserts were rolled back; without it they stay.
    assert_eq!(app.effects().await, if atomic { 0 } else { 2 });
    let ok = app.post(Some(b"r"), "alice", body(), &[]).await;
    assert_eq!(ok.status, 201, "the key was released each time: {ok:?}");
    assert!(!ok.replayed());
    // A 5xx is stored and replayed (an indeterminate result), its writes kept.
    let failed = app
        .post(Some(b"s"), "alice", body(), &[("x-fail", "500")])
        .await;
    assert_eq!(failed.status, 500);
    let replay = app.post(Some(b"s"), "alice", body(), &[]).await;
    assert_eq!(replay.status, 500);
    assert!(replay.replayed());
    assert_eq!(app.effects().await, if atomic { 2 } else { 4 });
}

async fn a_client_that_disconnects_does_not_leave_the_key_stuck<St: TestStore>() {
    let (app, _) = app::<St>(|l| l).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let gone = impatient
        .post(format!("{}/payments", app.base))
        .header("content-type", "application/json")
        .header("x-user-id", "alice")
        .header("idempotency-key", "hang-up")
        .header("x-delay-ms", "1000")
        .body(payment("acc-1", 5))
        .send()
        .await;
    assert!(gone.is_err(), "the client gave up: {gone:?}");
    // The handler finishes anyway and stores its answer for the retry.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retry = app
        .post(Some(b"hang-up"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed(), "the abandoned request completed the key");
    assert_eq!(app.effects().await, 1);
}

async fn statuses_that_say_not_done_are_not_stored<St: TestStore>() {
    let (app, _) = app::<St>(|l| l).await;
    for status in [503, 502, 504, 429, 408, 401, 403, 404, 405, 409, 415, 422] {
        let key = format!("not-done-{status}");
        let status_text = status.to_string();
        let first = app
            .post(
                Some(key.as_bytes()),
                "alice",
                payment("acc-1", 5),
                &[("x-fail", &status_text)],
            )
            .await;
        assert_eq!(first.status, status);
        let retry = app
            .post(Some(key.as_bytes()), "alice", payment("acc-1", 5), &[])
            .await;
        assert_eq!(
            (retry.status, retry.replayed()),
            (201, false),
            "{status}: {retry:?}"
        );
    }
    for status in [402, 500] {
        let key = format!("done-{status}");
        let status_text = status.to_string();
        app.post(
            Some(key.as_bytes()),
            "alice",
            payment("acc-1", 5),
            &[("x-fail", &status_text)],
        )
        .await;
        let retry = app
            .post(Some(key.as_bytes()), "alice", payment("acc-1", 5), &[])
            .await;
        assert_eq!(
            (retry.status, retry.replayed()),
            (status, true),
            "{status}: {retry:?}"
        );
    }
}

async fn a_database_error_in_the_handler_does_not_block_the_key<St: TestStore>() {
    let (app, _) = app::<St>(|l| l).await;
    let failed = app
        .post(
            Some(b"db"),
            "alice",
            payment("acc-1", 5),
            &[("x-kill-backend", "1")],
        )
        .await;
    assert_eq!(failed.status, 503, "{failed:?}");
    let text = String::from_utf8_lossy(&failed.body).to_lowercase();
    assert!(
        !text.contains("terminat") && !text.contains("sqlx"),
        "no internal detail: {text}"
    );
    let retry = app
        .post(Some(b"db"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
    assert_eq!(app.effects().await, 1);
}

async fn requests_without_a_user_cannot_reach_a_users_records<St: TestStore>() {
    let (app, _) = app::<St>(|l| l).await;
    let theirs = app
        .post(Some(b"k"), "anonymous", payment("acc-1", 5), &[])
        .await;
    assert_eq!(theirs.status, 201);
    // No X-User-Id, and one that is not visible ASCII: the handler refuses
    // them (401), and neither gets the stored 201 of the user "anonymous".
    for user in [None, Some(HeaderValue::from_bytes(b"caf\xe9").unwrap())] {
        let mut request = app
            .client
            .post(format!("{}/payments", app.base))
            .header("content-type", "application/json")
            .header("idempotency-key", "k")
            .body(payment("acc-1", 5));
        if let Some(user) = user {
            request = request.header("x-user-id", user);
        }
        let answer = request.send().await.unwrap();
        assert_eq!(answer.status(), 401);
        assert!(answer.headers().get("idempotent-replayed").is_none());
    }
    let replay = app
        .post(Some(b"k"), "anonymous", payment("acc-1", 5), &[])
        .await;
    assert_eq!(
        (replay.status, replay.replayed()),
        (201, true),
        "{replay:?}"
    );
    assert_eq!(app.effects().await, 1);
}

async fn retry_after_follows_the_lease_once_its_holder_stopped_renewing<St: TestStore>() {
    let lease = Duration::from_secs(3);
    let (app, store) = app::<St>(|l| l.lease(lease)).await;
    // A holder that died: its record was begun and never renewed.
    let body = payment("acc-1", 5);
    let record = RecordKey::new(Some("alice"), "POST", "/payments", "dead");
    let fingerprint = Fingerprint::of_request("POST", "/payments", &body);
    let operation = Operation {
        key: &record,
        fingerprint: &fingerprint,
        lease,
        ttl: Duration::from_secs(60),
    };
    assert!(matches!(
        store.begin(operation).await.unwrap(),
        Begin::Started(_)
    ));
    tokio::time::sleep(Duration::from_millis(1600)).await; // a renewal is overdue
    let waiting = app.post(Some(b"dead"), "alice", body.clone(), &[]).await;
    assert_eq!(waiting.status, 409);
    assert_eq!(
        waiting.headers["retry-after"], "2",
        "the lease's remainder, rounded up"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let taken = app.post(Some(b"dead"), "alice", body, &[]).await;
    assert_eq!(taken.status, 201, "one wait was enough: {taken:?}");

    // A live holder (renewing): its answer is near, so a short wait.
    let slow = {
        let client = app.client.clone();
        let url = format!("{}/payments", app.base);
        tokio::spawn(async move {
            client
                .post(url)
                .header("content-type", "application/json")
                .header("x-user-id", "alice")
                .header("idempotency-key", "live")
                .header("x-delay-ms", "1500")
                .body(payment("acc-1", 5))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let busy = app
        .post(Some(b"live"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(busy.status, 409);
    assert_eq!(busy.headers["retry-after"], "1");
    assert_eq!(slow.await.unwrap(), 201);
}

macro_rules! store_tests {
    ($module:ident, $store:ty) => {
        mod $module {
            use super::*;

            #[tokio::test]
            async fn replay_returns_the_stored_response() {
                super::replay_returns_the_stored_response::<$store>().await
            }
            #[tokio::test]
            async fn changed_body_is_422() {
                super::changed_body_is_422::<$store>().await
            }
            #[tokio::test]
            async fn concurrent_requests_make_one_effect() {
                super::concurrent_requests_make_one_effect::<$store>().await
            }
            #[tokio::test]
            async fn two_users_with_one_key_make_two_effects() {
                super::two_users_with_one_key_make_two_effects::<$store>().await
            }
            #[tokio::test]
            async fn separators_in_user_ids_cannot_reach_another_users_record() {
                super::separators_in_user_ids_cannot_reach_another_users_record::<$store>().await
            }
            #[tokio::test]
            async fn body_over_the_limit_is_413() {
                super::body_over_the_limit_is_413::<$store>().await
            }
            #[tokio::test]
            async fn malformed_and_missing_keys_are_400() {
                super::malformed_and_missing_keys_are_400::<$store>().await
            }
            #[tokio::test]
            async fn an_expired_record_counts_as_absent() {
                super::an_expired_record_counts_as_absent::<$store>().await
            }
            #[tokio::test]
            async fn an_expired_lease_is_taken_over_and_the_stale_token_is_fenced() {
                super::an_expired_lease_is_taken_over_and_the_stale_token_is_fenced::<$store>()
                    .await
            }
            #[tokio::test]
            async fn the_lease_is_renewed_while_the_handler_runs() {
                super::the_lease_is_renewed_while_the_handler_runs::<$store>().await
            }
            #[tokio::test]
            async fn an_oversize_response_is_not_stored() {
                super::an_oversize_response_is_not_stored::<$store>().await
            }
            #[tokio::test]
            async fn a_client_that_disconnects_does_not_leave_the_key_stuck() {
                super::a_client_that_disconnects_does_not_leave_the_key_stuck::<$store>().await
            }
            #[tokio::test]
            async fn unstored_statuses_errors_and_panics_release_the_key() {
                super::unstored_statuses_errors_and_panics_release_the_key::<$store>().await
            }
            #[tokio::test]
            async fn statuses_that_say_not_done_are_not_stored() {
                super::statuses_that_say_not_done_are_not_stored::<$store>().await
            }
            #[tokio::test]
            async fn a_database_error_in_the_handler_does_not_block_the_key() {
                super::a_database_error_in_the_handler_does_not_block_the_key::<$store>().await
            }
            #[tokio::test]
            async fn requests_without_a_user_cannot_reach_a_users_records() {
                super::requests_without_a_user_cannot_reach_a_users_records::<$store>().await
            }
            #[tokio::test]
            async fn retry_after_follows_the_lease_once_its_holder_stopped_renewing() {
                super::retry_after_follows_the_lease_once_its_holder_stopped_renewing::<$store>()
                    .await
            }
        }
    };
}

store_tests!(postgres, PostgresStore);
store_tests!(redis, RedisStore);
store_tests!(memory, Arc<MemoryStore>);

#[tokio::test]
async fn postgres_store_down_fails_closed() {
    a_store_that_is_down_fails_closed::<PostgresStore>().await
}

#[tokio::test]
async fn redis_store_down_fails_closed() {
    a_store_that_is_down_fails_closed::<RedisStore>().await
}

#[tokio::test]
async fn atomic_phase_a_fenced_out_handler_has_its_writes_rolled_back() {
    let (app, _) = app::<PostgresStore>(|l| l).await;
    let stolen = app
        .post(
            Some(b"x"),
            "alice",
            payment("acc-1", 5),
            &[("x-steal", "1")],
        )
        .await;
    assert_eq!(stolen.status, 409, "{stolen:?}");
    assert_eq!(stolen.problem(), "lease-lost");
    assert_eq!(app.effects().await, 0, "the insert was rolled back");
}

#[tokio::test]
async fn atomic_phase_a_handler_answering_from_an_aborted_transaction() {
    let (app, _) = app::<PostgresStore>(|l| l).await;
    // A stored error answer (500) is stored on its own: the writes are gone anyway.
    let failed = app
        .post(
            Some(b"a"),
            "alice",
            payment("acc-1", 5),
            &[("x-abort-then", "500")],
        )
        .await;
    assert_eq!(failed.status, 500, "{failed:?}");
    let replay = app
        .post(Some(b"a"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(replay.status, 500);
    assert!(replay.replayed());
    // An answer that is not stored (422) releases the key: the retry runs.
    let refused = app
        .post(
            Some(b"c"),
            "alice",
            payment("acc-1", 5),
            &[("x-abort-then", "422")],
        )
        .await;
    assert_eq!(refused.status, 422, "{refused:?}");
    let rerun = app
        .post(Some(b"c"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!((rerun.status, rerun.replayed()), (201, false));
    // A success would be a lie: 503, and the key is free for the retry.
    let lie = app
        .post(
            Some(b"b"),
            "alice",
            payment("acc-1", 5),
            &[("x-abort-then", "201")],
        )
        .await;
    assert_eq!(lie.status, 503, "{lie:?}");
    assert_eq!(lie.problem(), "commit-failed");
    assert_eq!(app.effects().await, 1, "only c's rerun");
    let retry = app
        .post(Some(b"b"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(app.effects().await, 2, "c and b, once each");
}

/// A server with the given routes on an ephemeral port; returns its base URL.
async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    base
}

#[tokio::test]
async fn a_handler_taking_tx_answers_400_to_a_request_without_a_key() {
    let db = Db::new().await;
    let handler = |tx: Tx| async move {
        sqlx::query("SELECT 1")
            .execute(&mut *tx.try_lock()?)
            .await?;
        Ok::<_, idempo::Error>(StatusCode::CREATED)
    };
    // The key is optional on this route: a keyless request reaches the handler.
    let layer = IdempotencyLayer::new(PostgresStore::new(db.pool.clone()));
    let base = serve(
        Router::new()
            .route("/optional", post(handler).layer(layer))
            .route("/bare", post(handler)),
    )
    .await;
    let client = reqwest::Client::new();
    let send = |path: &str, key: Option<&str>| {
        let mut request = client.post(format!("{base}{path}"));
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let body: serde_json::Value = response.json().await.unwrap_or_default();
            (status, body["type"].as_str().unwrap_or("").to_owned())
        }
    };
    let (status, kind) = send("/optional", None).await;
    assert_eq!(status, 400, "the client left the key out");
    assert!(kind.ends_with("#missing-key"), "{kind}");
    assert_eq!(send("/optional", Some("k-1")).await.0, 201);
    let (status, kind) = send("/bare", Some("k-1")).await;
    assert_eq!(status, 500, "no layer on the route: the server's mistake");
    assert!(kind.ends_with("#no-transaction"), "{kind}");
}

#[tokio::test]
async fn an_idempo_error_from_a_handler_is_a_problem_that_releases_the_key() {
    let db = Db::new().await;
    http_payments::create_table(&db.pool).await.unwrap();
    // `?` on sqlx's and idempo's errors: the first attempt fails in the
    // database, the retry with the same key succeeds.
    let handler = |tx: Tx, headers: HeaderMap| async move {
        let mut conn = tx.try_lock()?;
        if headers.contains_key("x-fail") {
            sqlx::query("SELECT 1 / 0").execute(&mut *conn).await?;
        }
        sqlx::query(
            "INSERT INTO http_payments (user_id, account, amount_cents) VALUES ('u', 'a', 1)",
        )
        .execute(&mut *conn)
        .await?;
        Ok::<_, idempo::Error>(StatusCode::CREATED)
    };
    let layer = IdempotencyLayer::new(PostgresStore::new(db.pool.clone())).require_key();
    let base = serve(Router::new().route("/pay", post(handler).layer(layer))).await;
    let client = reqwest::Client::new();
    let failed = client
        .post(format!("{base}/pay"))
        .header("idempotency-key", "same")
        .header("x-fail", "1")
        .send()
        .await
        .unwrap();
    assert_eq!(failed.status(), 500);
    assert_eq!(failed.headers()["content-type"], "application/problem+json");
    let problem: serde_json::Value = failed.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("#handler-failed")
    );
    let retried = client
        .post(format!("{base}/pay"))
        .header("idempotency-key", "same")
        .send()
        .await
        .unwrap();
    assert_eq!(retried.status(), 201, "the failure was not stored");
    assert!(retried.headers().get("idempotent-replayed").is_none());
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM http_payments")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 1, "one effect");
}

#[tokio::test]
async fn routing_and_media_type_refusals_are_not_stored() {
    let db = Db::new().await;
    http_payments::create_table(&db.pool).await.unwrap();
    let store = MemoryStore::new();
    let layer = || {
        IdempotencyLayer::new(store.clone())
            .require_key()
            .user(http_payments::user_of)
    };
    let router = Router::new()
        .route("/layer", post(payments).layer(layer()))
        .route("/route-layer", post(payments).route_layer(layer()))
        .with_state(db.pool.clone());
    let base = serve(router).await;
    let client = reqwest::Client::new();
    let send = |method: reqwest::Method, path: &str, key: Option<&str>, json: bool| {
        let mut request = client
            .request(method, format!("{base}{path}"))
            .header("x-user-id", "alice")
            .body(payment("acc-1", 5));
        if json {
            request = request.header("content-type", "application/json");
        }
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        async move {
            let answer = request.send().await.unwrap();
            let replayed = answer.headers().contains_key("idempotent-replayed");
            (answer.status().as_u16(), replayed)
        }
    };
    // A PATCH with a key on a POST route: 405, every time, never replayed.
    for _ in 0..2 {
        assert_eq!(
            send(reqwest::Method::PATCH, "/layer", Some("p"), true).await,
            (405, false)
        );
    }
    // With route_layer, a PATCH without a key is a 405 too, not a 400.
    assert_eq!(
        send(reqwest::Method::PATCH, "/route-layer", None, true).await,
        (405, false)
    );
    // A missing Content-Type is 415; the corrected retry (same key, same body) runs.
    assert_eq!(
        send(reqwest::Method::POST, "/layer", Some("m"), false).await,
        (415, false)
    );
    assert_eq!(
        send(reqwest::Method::POST, "/layer", Some("m"), true).await,
        (201, false)
    );
    assert_eq!(
        send(reqwest::Method::POST, "/layer", Some("m"), true).await,
        (201, true)
    );
}

#[tokio::test]
async fn a_full_memory_store_refuses_new_keys_and_never_forgets_a_live_one() {
    let (app, _) = app::<Arc<MemoryStore>>(|l| l).await;
    let small = App::start(
        Db::new().await,
        IdempotencyLayer::new(MemoryStore::with_capacity(2)).ttl(Duration::from_secs(2)),
    )
    .await;
    drop(app);
    for key in [b"one".as_slice(), b"two"] {
        assert_eq!(
            small
                .post(Some(key), "alice", payment("acc-1", 5), &[])
                .await
                .status,
            201
        );
    }
    let full = small
        .post(Some(b"three"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(full.status, 503, "{full:?}");
    assert_eq!(full.problem(), "store-unavailable");
    assert!(full.headers.contains_key("retry-after"));
    // The live records are still there: their retries replay.
    let replay = small
        .post(Some(b"one"), "alice", payment("acc-1", 5), &[])
        .await;
    assert!(replay.replayed());
    // Once they expire, there is room again.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let later = small
        .post(Some(b"three"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(later.status, 201);
    assert_eq!(small.effects().await, 3);
}

#[tokio::test]
async fn a_store_that_hangs_answers_503_within_the_store_timeout() {
    let db = Db::new().await;
    let proxy = TcpProxy::postgres().await;
    // A pool as users configure it: a long acquire timeout.
    let options = sqlx::postgres::PgConnectOptions::from_str(&support::database_url())
        .unwrap()
        .host(&proxy.addr.ip().to_string())
        .port(proxy.addr.port())
        .options([("search_path", db.schema.as_str())]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .unwrap();
    let app = App::start(
        db,
        IdempotencyLayer::new(PostgresStore::new(pool)).store_timeout(Duration::from_secs(1)),
    )
    .await;
    proxy.cut();
    let started = std::time::Instant::now();
    let answer = app
        .post(Some(b"slow"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(answer.status, 503, "{answer:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered after {:?}",
        started.elapsed()
    );
    assert_eq!(app.effects().await, 0);
}

#[tokio::test]
async fn a_stalled_upload_is_answered_408_and_runs_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = App::start(
        Db::new().await,
        IdempotencyLayer::new(MemoryStore::new()).body_timeout(Duration::from_millis(500)),
    )
    .await;
    let addr = app.base.trim_start_matches("http://").to_owned();
    let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
    // Headers announce 100 bytes; 10 arrive, then nothing.
    socket
        .write_all(
            b"POST /payments HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              X-User-Id: alice\r\nIdempotency-Key: stall\r\nContent-Length: 100\r\n\r\n{\"account\"",
        )
        .await
        .unwrap();
    let mut answer = vec![0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(5), socket.read(&mut answer))
        .await
        .expect("an answer before the client gives up")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body-timeout"), "{answer}");
    assert_eq!(app.effects().await, 0);
}

#[tokio::test]
async fn a_redis_outage_while_storing_the_answer_is_ridden_out_within_the_lease() {
    support::init_tracing();
    let db = Db::new().await;
    let target = redis_url().trim_start_matches("redis://").to_owned();
    let proxy = TcpProxy::start(&target).await;
    let store = RedisStore::through(&proxy, &db).await.unwrap();
    let app = App::start(db, IdempotencyLayer::new(store)).await;
    let slow = {
        let client = app.client.clone();
        let url = format!("{}/payments", app.base);
        tokio::spawn(async move {
            client
                .post(url)
                .header("content-type", "application/json")
                .header("x-user-id", "alice")
                .header("idempotency-key", "outage")
                .header("x-delay-ms", "600")
                .body(payment("acc-1", 5))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    // Redis goes away while the handler runs, so storing its answer fails,
    // and comes back a second later.
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    proxy.restore();
    // The answer goes out once it is stored, well within the lease.
    let status = tokio::time::timeout(Duration::from_secs(10), slow)
        .await
        .expect("stored within seconds of Redis coming back")
        .unwrap();
    assert_eq!(status, 201);
    let retry = app
        .post(Some(b"outage"), "alice", payment("acc-1", 5), &[])
        .await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (201, true),
        "the answer was stored once Redis was back (not 409 until the lease ran out): {retry:?}"
    );
    assert_eq!(app.effects().await, 1);
}

/// The `http_payments` example as a process: SIGTERM while the handler of a
/// client that disconnected is still running. The process waits for it, its
/// answer is stored, and the retry after a restart is a replay: one payment.
async fn a_graceful_shutdown_waits_for_a_disconnected_clients_handler(store: &str) {
    use std::process::Command;
    let db = Db::new().await;
    http_payments::create_table(&db.pool).await.unwrap();
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    // A key of its own: the Redis store keeps records across runs.
    let key = unique("graceful");
    let start = || {
        Command::new(support::example_binary("http_payments"))
            .env("HTTP_ADDR", &addr)
            .env("DATABASE_URL", &db.url)
            .env("IDEMPOTENCY_STORE", store)
            .env("REDIS_URL", redis_url())
            .env("RUST_LOG", "warn")
            .spawn()
            .expect("start the http_payments example")
    };
    let client = reqwest::Client::new();
    let listening = || async {
        support::eventually("the example listens", Duration::from_secs(30), || {
            let (client, url) = (client.clone(), format!("http://{addr}/payments"));
            async move { client.get(url).send().await.is_ok() }
        })
        .await
    };
    let post = |timeout: Duration| {
        client
            .post(format!("http://{addr}/payments"))
            .timeout(timeout)
            .header("content-type", "application/json")
            .header("x-user-id", "alice")
            .header("idempotency-key", key.as_str())
            .body(payment("acc-1", 5))
            .send()
    };
    let mut server = start();
    listening().await;
    // Inserts into http_payments wait behind this lock.
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE http_payments IN EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    assert!(
        post(Duration::from_millis(500)).await.is_err(),
        "the client gave up"
    );
    let kill = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        server.try_wait().unwrap().is_none(),
        "the process waits for the handler in flight"
    );
    lock.commit().await.unwrap(); // the handler's insert proceeds
    let status = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Some(status) = server.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the example exits once its handler is done");
    assert!(status.success(), "{status:?}");

    let mut again = start();
    listening().await;
    let retry = post(Duration::from_secs(10)).await.unwrap();
    let replayed = retry.headers().contains_key("idempotent-replayed");
    let retry_status = retry.status().as_u16();
    let _ = again.kill();
    let _ = again.wait();
    assert_eq!(
        (retry_status, replayed),
        (201, true),
        "the answer was stored before the exit"
    );
    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM http_payments")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(payments, 1, "one payment");
}

#[tokio::test]
async fn a_graceful_shutdown_waits_for_a_disconnected_clients_handler_postgres() {
    a_graceful_shutdown_waits_for_a_disconnected_clients_handler("postgres").await
}

#[tokio::test]
async fn a_graceful_shutdown_waits_for_a_disconnected_clients_handler_redis() {
    a_graceful_shutdown_waits_for_a_disconnected_clients_handler("redis").await
}

/// Slow clients against the `http_payments` example as a real process
/// (issue: slowloris). A client that trickles its headers one line at a time,
/// or sends nothing, is closed after `HTTP_HEADER_TIMEOUT_MS`; past
/// `HTTP_MAX_CONNECTIONS` new connections wait instead of using up file
/// descriptors; a real request made while 40 of them hang is answered.
#[tokio::test]
async fn the_example_server_closes_slow_clients_and_answers_real_requests() {
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    let db = Db::new().await;
    let addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let mut server = std::process::Command::new(support::example_binary("http_payments"))
        .env("DATABASE_URL", &db.url)
        .env("IDEMPOTENCY_STORE", "memory")
        .env("HTTP_ADDR", addr.to_string())
        .env("HTTP_HEADER_TIMEOUT_MS", "500")
        .env("HTTP_MAX_CONNECTIONS", "8")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start the http_payments example");
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _server = Kill(&mut server);
    support::eventually("the example listens", Duration::from_secs(60), || async {
        TcpStream::connect(addr).await.is_ok()
    })
    .await;

    // Twenty that send nothing, twenty that trickle a header every 200 ms.
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut trickling = Vec::new();
    for n in 0..20 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        trickling.push(tokio::spawn(async move {
            let started = Instant::now();
            if stream
                .write_all(b"POST /payments HTTP/1.1\r\n")
                .await
                .is_err()
            {
                return started.elapsed();
            }
            let mut buf = [0u8; 1024];
            for line in 0.. {
                let header = format!("X-Slow-{n}-{line}: a\r\n");
                if stream.write_all(header.as_bytes()).await.is_err() {
                    break;
                }
                let read = tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buf));
                if let Ok(Ok(0) | Err(_)) = read.await {
                    break;
                }
                if started.elapsed() > Duration::from_secs(30) {
                    break;
                }
            }
            started.elapsed()
        }));
    }

    // A real request while they hang: answered once slots free up.
    let body = r#"{"account":"acc-slow","amount_cents":5}"#;
    let request = format!(
        "POST /payments HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: slow-1\r\n\
         X-User-Id: alice\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let answered = tokio::time::timeout(Duration::from_secs(10), async {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer
    })
    .await
    .expect("a real request is answered while slow clients hang");
    assert!(answer_status(&answered) == 201, "{answered}");

    for (n, trickle) in trickling.into_iter().enumerate() {
        let held = trickle.await.unwrap();
        assert!(
            held < Duration::from_secs(10),
            "trickling client {n} was held {held:?}: the header-read timeout is 500 ms"
        );
    }
    for (n, mut stream) in silent.into_iter().enumerate() {
        let mut buf = [0u8; 64];
        let closed = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await;
        assert!(closed.is_ok(), "silent client {n} is still open after 10 s");
    }
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM http_payments")
            .fetch_one(&db.pool)
            .await
            .unwrap(),
        1
    );
}

fn answer_status(answer: &str) -> u16 {
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}
