//! `idempo::testing` for the HTTP layer and the dedup window: the recipes
//! (a service behind `IdempotencyLayer` driven with `oneshot` on the memory
//! store; a memory window on a paused clock) as tests, and the store
//! conformance kit run against every store idempo ships (memory, PostgreSQL,
//! Redis) and against deliberately broken ones, which it must catch.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response, StatusCode, header};
use axum::routing::post;
use idempo::http::{
    Begin, FencingToken, Fingerprint, IdempotencyLayer, IdempotencyStore, MemoryStore, Operation,
    PostgresStore, RecordKey, RedisStore, StoredResponse,
};
use idempo::testing::conformance::{self, ConformanceError, Failure, Report};
use idempo::window::{
    DedupId, DedupWindow, Insertion, MemoryWindow, PostgresWindow, RedisWindow, Reservation, Scope,
    WindowStore,
};
use support::{Db, START_REDIS, redis_url, unique};
use tokio::sync::Notify;
use tower::ServiceExt;

/// The `type` of the layer's problems: its docs page (idempo::http).
const PROBLEM_BASE: &str = "https://docs.rs/idempo/latest/idempo/http/index.html";

async fn redis_store() -> RedisStore {
    let url = redis_url();
    RedisStore::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("Redis is not reachable at {url}: {e}\n{START_REDIS}"))
        .with_prefix(format!("{}:", unique("testing")))
}

async fn redis_window() -> RedisWindow {
    let url = redis_url();
    RedisWindow::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("Redis is not reachable at {url}: {e}\n{START_REDIS}"))
        .with_prefix(format!("{}:", unique("testing")))
}

/// A fresh schema with idempo's tables.
async fn migrated_db() -> Db {
    let db = Db::empty().await;
    idempo::migrate(&db.pool).await.expect("idempo::migrate");
    db
}

// ---------------------------------------------------------------------------
// A service behind `IdempotencyLayer`, driven with `oneshot` (no server).
// ---------------------------------------------------------------------------

/// `POST /payments` behind the layer on `store`: answers 201 with
/// `payment <n> for <body>`, counting its runs in `runs`. When `gate` is
/// given, the handler signals `entered` and waits for the gate first.
fn payments_app(
    store: MemoryStore,
    runs: Arc<AtomicUsize>,
    gate: Option<(Arc<Notify>, Arc<Notify>)>,
    delay: Duration,
) -> Router {
    let handler = move |body: String| {
        let (runs, gate) = (runs.clone(), gate.clone());
        async move {
            if let Some((entered, gate)) = gate {
                entered.notify_one();
                gate.notified().await;
            }
            tokio::time::sleep(delay).await;
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("payment {n} for {body}"))
        }
    };
    Router::new().route(
        "/payments",
        post(handler).route_layer(IdempotencyLayer::new(store).require_key()),
    )
}

fn payment(key: &str, body: &'static str) -> Request<Body> {
    Request::post("/payments")
        .header("idempotency-key", key)
        .body(Body::from(body))
        .unwrap()
}

/// Status, whether it is a replay, and the body.
async fn answer(response: Response<Body>) -> (StatusCode, bool, String) {
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, replayed, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test]
async fn a_replay_is_answered_from_the_record_and_runs_nothing() {
    let (store, runs) = (MemoryStore::new(), Arc::new(AtomicUsize::new(0)));
    let app = payments_app(store.clone(), runs.clone(), None, Duration::ZERO);

    let first = app.clone().oneshot(payment("k-1", "10 EUR")).await.unwrap();
    assert_eq!(
        answer(first).await,
        (StatusCode::CREATED, false, "payment 1 for 10 EUR".into())
    );
    let replay = app.clone().oneshot(payment("k-1", "10 EUR")).await.unwrap();
    assert_eq!(
        answer(replay).await,
        (StatusCode::CREATED, true, "payment 1 for 10 EUR".into()),
        "the stored answer, marked as a replay"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the replay ran nothing");
    assert_eq!(store.len(), 1, "one record");

    let other_key = app.oneshot(payment("k-2", "10 EUR")).await.unwrap();
    assert_eq!(
        answer(other_key).await,
        (StatusCode::CREATED, false, "payment 2 for 10 EUR".into())
    );
}

#[tokio::test]
async fn the_same_key_with_another_body_is_a_key_mismatch() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = payments_app(MemoryStore::new(), runs.clone(), None, Duration::ZERO);
    let first = app.clone().oneshot(payment("k-1", "10 EUR")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);

    let other = app.clone().oneshot(payment("k-1", "99 EUR")).await.unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        other.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let (_, replayed, body) = answer(other).await;
    assert!(!replayed);
    let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(problem["type"], format!("{PROBLEM_BASE}#key-mismatch"));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the other body ran nothing");

    // The key still answers its own request.
    let replay = app.oneshot(payment("k-1", "10 EUR")).await.unwrap();
    assert_eq!(
        answer(replay).await,
        (StatusCode::CREATED, true, "payment 1 for 10 EUR".into())
    );
}

#[tokio::test]
async fn a_request_while_the_first_runs_is_in_progress_and_the_handler_runs_once() {
    let runs = Arc::new(AtomicUsize::new(0));
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let app = payments_app(
        MemoryStore::new(),
        runs.clone(),
        Some((entered.clone(), gate.clone())),
        Duration::ZERO,
    );

    let first = tokio::spawn(app.clone().oneshot(payment("k-1", "10 EUR")));
    entered.notified().await; // the first request's handler is running
    let second = app.clone().oneshot(payment("k-1", "10 EUR")).await.unwrap();
    assert_eq!(second.status(), StatusCode::CONFLICT);
    assert!(second.headers().contains_key(header::RETRY_AFTER));
    let (_, _, body) = answer(second).await;
    let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(problem["type"], format!("{PROBLEM_BASE}#in-progress"));

    gate.notify_one();
    let first = first.await.unwrap().unwrap();
    assert_eq!(
        answer(first).await,
        (StatusCode::CREATED, false, "payment 1 for 10 EUR".into())
    );
    let retry = app.oneshot(payment("k-1", "10 EUR")).await.unwrap();
    assert_eq!(
        answer(retry).await,
        (StatusCode::CREATED, true, "payment 1 for 10 EUR".into()),
        "the retry of the 409 is a replay"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_requests_with_one_key_run_the_handler_once() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = payments_app(
        MemoryStore::new(),
        runs.clone(),
        None,
        Duration::from_millis(100),
    );
    let requests = (0..16).map(|_| tokio::spawn(app.clone().oneshot(payment("k-1", "10 EUR"))));
    let mut answers = Vec::new();
    for request in requests {
        answers.push(answer(request.await.unwrap().unwrap()).await);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one run: {answers:?}");
    let ran = answers
        .iter()
        .filter(|(status, replayed, _)| *status == StatusCode::CREATED && !replayed)
        .count();
    assert_eq!(ran, 1, "{answers:?}");
    for (status, replayed, body) in &answers {
        match *status {
            StatusCode::CREATED => assert_eq!(body, "payment 1 for 10 EUR", "replayed: {replayed}"),
            StatusCode::CONFLICT => assert!(body.contains("#in-progress"), "{body}"),
            other => panic!("unexpected {other}: {answers:?}"),
        }
    }
}

// ---------------------------------------------------------------------------
// The memory stores on a paused clock: expiry without sleeping.
// ---------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_memory_window_expires_when_the_paused_clock_is_advanced() {
    let wall = std::time::Instant::now();
    let window = DedupWindow::new(MemoryWindow::new(1_000)).window(Duration::from_secs(300));
    let (scope, id) = (Scope::queue("orders"), DedupId::new("order-17").unwrap());
    assert!(window.insert(&scope, &id).await.unwrap(), "new");
    tokio::time::advance(Duration::from_secs(299)).await;
    assert!(
        !window.insert(&scope, &id).await.unwrap(),
        "a duplicate at 299 s"
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(
        window.insert(&scope, &id).await.unwrap(),
        "new again at 300 s"
    );
    assert_eq!(window.store().len(), 1);
    assert!(
        wall.elapsed() < Duration::from_secs(5),
        "five minutes of window took {:?} of real time",
        wall.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_memory_window_reservation_lapses_when_the_paused_clock_is_advanced() {
    let window = DedupWindow::new(MemoryWindow::new(1_000));
    let (scope, id) = (Scope::queue("orders"), DedupId::new("order-17").unwrap());
    let lease = Duration::from_secs(30);
    let Reservation::Reserved { token } = window.reserve(&scope, &id, lease).await.unwrap() else {
        panic!("a fresh id is reserved")
    };
    assert_eq!(
        window.insert_value(&scope, &id, "x").await.unwrap(),
        Insertion::Pending
    );
    tokio::time::advance(lease).await;
    assert!(
        !window.record(&scope, &id, token, "late").await.unwrap(),
        "the lapsed reservation's token is refused"
    );
    assert!(matches!(
        window.reserve(&scope, &id, lease).await.unwrap(),
        Reservation::Reserved { token: new } if new != token
    ));
}

#[tokio::test(start_paused = true)]
async fn a_memory_store_lease_and_record_expire_when_the_paused_clock_is_advanced() {
    let store = MemoryStore::new();
    let key = RecordKey::new(None, "POST", "/payments", "k-1");
    let fingerprint = Fingerprint::of_request("POST", "/payments", b"10 EUR");
    let operation = Operation {
        key: &key,
        fingerprint: &fingerprint,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(24 * 60 * 60),
    };
    let Begin::Started(old) = store.begin(operation).await.unwrap() else {
        panic!("a fresh key starts")
    };
    tokio::time::advance(Duration::from_secs(30)).await;
    let Begin::Started(new) = store.begin(operation).await.unwrap() else {
        panic!("a lapsed lease is taken over")
    };
    assert_ne!(new, old);
    let response = StoredResponse::new(StatusCode::CREATED, Vec::new(), "done".into());
    assert!(
        !store
            .complete(&key, old, &response, operation.ttl)
            .await
            .unwrap()
    );
    assert!(
        store
            .complete(&key, new, &response, operation.ttl)
            .await
            .unwrap()
    );
    tokio::time::advance(Duration::from_secs(24 * 60 * 60 - 1)).await;
    assert_eq!(
        store.begin(operation).await.unwrap(),
        Begin::Completed(response)
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(matches!(
        store.begin(operation).await.unwrap(),
        Begin::Started(_)
    ));
}

// ---------------------------------------------------------------------------
// The conformance kit against idempo's own stores.
// ---------------------------------------------------------------------------

async fn idempotency_store_conforms<S: IdempotencyStore>(store: &S) {
    let report = conformance::Report::idempotency_store(store)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.passed, Report::IDEMPOTENCY_STORE_CHECKS);
    assert!(
        report.elapsed < Duration::from_secs(10),
        "the kit stays fast: {report}"
    );
}

async fn window_store_conforms<W: WindowStore>(store: &W) {
    let report = conformance::Report::window_store(store)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.passed, Report::WINDOW_STORE_CHECKS);
    assert!(
        report.elapsed < Duration::from_secs(10),
        "the kit stays fast: {report}"
    );
}

#[tokio::test]
async fn the_memory_store_conforms() {
    idempotency_store_conforms(&MemoryStore::new()).await;
}

#[tokio::test]
async fn the_postgres_store_conforms() {
    let db = migrated_db().await;
    idempotency_store_conforms(&PostgresStore::new(db.pool.clone())).await;
}

#[tokio::test]
async fn the_redis_store_conforms() {
    idempotency_store_conforms(&redis_store().await).await;
}

#[tokio::test]
async fn the_memory_window_conforms() {
    window_store_conforms(&MemoryWindow::new(10_000)).await;
}

#[tokio::test]
async fn the_postgres_window_conforms() {
    let db = migrated_db().await;
    window_store_conforms(&PostgresWindow::new(db.pool.clone())).await;
}

#[tokio::test]
async fn the_redis_window_conforms() {
    window_store_conforms(&redis_window().await).await;
}

#[tokio::test]
async fn runs_of_the_kit_on_one_shared_store_do_not_disturb_each_other() {
    let db = migrated_db().await;
    let (store, window) = (
        PostgresStore::new(db.pool.clone()),
        PostgresWindow::new(db.pool.clone()),
    );
    let (a, b, c, d) = tokio::join!(
        conformance::Report::idempotency_store(&store),
        conformance::Report::idempotency_store(&store),
        conformance::Report::window_store(&window),
        conformance::Report::window_store(&window),
    );
    for outcome in [a, b, c, d] {
        outcome.unwrap_or_else(|e| panic!("{e}"));
    }
}

// ---------------------------------------------------------------------------
// The kit catches broken stores, naming the check.
// ---------------------------------------------------------------------------

/// Forwards to a memory store, except as `broken` says.
#[derive(Clone, Default)]
struct Broken {
    inner: MemoryStore,
    /// Every request has the same fingerprint.
    forgets_fingerprints: bool,
    /// `begin` always starts, whatever is there.
    always_fresh: bool,
    /// `complete` does not check the token: it completes with the last
    /// token `begin` handed out for the key, whoever calls.
    ignores_tokens: bool,
    last_tokens: Arc<std::sync::Mutex<HashMap<[u8; 32], FencingToken>>>,
    /// `delete_expired` fails.
    fails_cleanup: bool,
}

impl IdempotencyStore for Broken {
    async fn begin(&self, operation: Operation<'_>) -> idempo::Result<Begin> {
        let same = Fingerprint::of_request("POST", "/", b"");
        let operation = Operation {
            fingerprint: if self.forgets_fingerprints {
                &same
            } else {
                operation.fingerprint
            },
            ..operation
        };
        match self.inner.begin(operation).await? {
            Begin::Started(token) => {
                let mut last = self.last_tokens.lock().unwrap();
                last.insert(*operation.key.digest(), token);
                Ok(Begin::Started(token))
            }
            _ if self.always_fresh => Ok(Begin::Started(FencingToken::new(7))),
            found => Ok(found),
        }
    }

    async fn extend(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> idempo::Result<bool> {
        self.inner.extend(key, token, lease).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> idempo::Result<bool> {
        let token = match self.ignores_tokens {
            true => self.last_tokens.lock().unwrap()[key.digest()],
            false => token,
        };
        self.inner.complete(key, token, response, ttl).await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> idempo::Result<bool> {
        self.inner.release(key, token).await
    }

    async fn delete_expired(&self, limit: usize) -> idempo::Result<u64> {
        if self.fails_cleanup {
            return Err(idempo::StoreError::Timeout(Duration::from_secs(5)).into());
        }
        self.inner.delete_expired(limit).await
    }
}

async fn caught(store: Broken) -> ConformanceError {
    match conformance::Report::idempotency_store(&store).await {
        Ok(report) => panic!("the kit passed a broken store: {report}"),
        Err(e) => e,
    }
}

#[tokio::test]
async fn a_store_that_forgets_fingerprints_fails_the_mismatch_check() {
    let e = caught(Broken {
        forgets_fingerprints: true,
        ..Broken::default()
    })
    .await;
    assert_eq!(e.check, "another_fingerprint_is_a_mismatch", "{e}");
    assert!(
        matches!(&e.failure, Failure::Unexpected { expected, found, .. }
            if expected == "Mismatch" && found.starts_with("InProgress")),
        "{e}"
    );
    assert!(
        e.also_failed.contains(&"concurrent_begins_start_once"),
        "{e}"
    );
    let message = e.to_string();
    assert!(
        message.contains("`another_fingerprint_is_a_mismatch`")
            && message.contains("expected Mismatch, found InProgress"),
        "{message}"
    );
}

#[tokio::test]
async fn a_store_that_always_says_fresh_fails_the_in_progress_check() {
    let e = caught(Broken {
        always_fresh: true,
        ..Broken::default()
    })
    .await;
    assert_eq!(e.check, "a_live_lease_is_in_progress", "{e}");
    assert!(
        matches!(&e.failure, Failure::Unexpected { found, .. } if found.starts_with("Started")),
        "{e}"
    );
    for other in [
        "another_fingerprint_is_a_mismatch",
        "concurrent_begins_start_once",
    ] {
        assert!(e.also_failed.contains(&other), "{other}: {e}");
    }
}

#[tokio::test]
async fn a_store_that_ignores_tokens_fails_the_fencing_checks() {
    let e = caught(Broken {
        ignores_tokens: true,
        ..Broken::default()
    })
    .await;
    assert_eq!(e.check, "release_frees_the_key", "{e}");
    assert!(
        matches!(&e.failure, Failure::Unexpected { step, expected, found }
            if step == "complete with the released token" && expected == "false" && found == "true"),
        "{e}"
    );
    for other in [
        "a_foreign_token_is_fenced",
        "an_expired_lease_is_taken_over",
    ] {
        assert!(e.also_failed.contains(&other), "{other}: {e}");
    }
}

#[tokio::test]
async fn a_store_error_is_reported_with_the_check_and_step() {
    let e = caught(Broken {
        fails_cleanup: true,
        ..Broken::default()
    })
    .await;
    assert_eq!(e.check, "delete_expired_keeps_live_records", "{e}");
    assert!(e.also_failed.is_empty(), "{e}");
    assert!(
        matches!(&e.failure, Failure::Store { step, source }
            if step == "delete_expired"
                && matches!(idempo::StoreError::of(source), Some(idempo::StoreError::Timeout(_)))),
        "{e}"
    );
}

/// A memory window that keeps every entry an hour, whatever it is told.
struct NeverForgets(MemoryWindow);

const HOUR: Duration = Duration::from_secs(3600);

impl WindowStore for NeverForgets {
    async fn insert(&self, key: &str, value: &str, _: Duration) -> idempo::Result<Insertion> {
        self.0.insert(key, value, HOUR).await
    }

    async fn reserve(&self, key: &str, _: Duration) -> idempo::Result<Reservation> {
        self.0.reserve(key, HOUR).await
    }

    async fn record(
        &self,
        key: &str,
        token: i64,
        value: &str,
        _: Duration,
    ) -> idempo::Result<bool> {
        self.0.record(key, token, value, HOUR).await
    }

    async fn release(&self, key: &str, token: i64) -> idempo::Result<bool> {
        self.0.release(key, token).await
    }

    async fn delete_expired(&self, limit: usize) -> idempo::Result<u64> {
        self.0.delete_expired(limit).await
    }
}

#[tokio::test]
async fn a_window_that_never_forgets_fails_the_expiry_checks() {
    let e = conformance::Report::window_store(&NeverForgets(MemoryWindow::new(10_000)))
        .await
        .unwrap_err();
    assert_eq!(e.check, "a_seen_id_expires_after_its_window", "{e}");
    assert!(
        matches!(&e.failure, Failure::Unexpected { expected, found, .. }
            if expected == "New" && found.starts_with("Seen")),
        "{e}"
    );
    assert_eq!(
        e.also_failed,
        [
            "an_expired_reservation_is_free",
            "delete_expired_keeps_live_entries"
        ],
        "{e}"
    );
}
