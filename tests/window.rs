//! The dedup window per store against real Redis and PostgreSQL, the
//! deduplicating publisher against RabbitMQ, and message groups.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempo::Tx;
use idempo::amqp::Consumer;
use idempo::amqp::lapin::BasicProperties;
use idempo::amqp::window::{DedupPublisher, Outgoing};
use idempo::consumer::{Message, RedeliveryPolicy};
use idempo::window::{
    DedupId, DedupWindow, Insertion, InvalidDedupId, MemoryWindow, PostgresWindow, RedisWindow,
    Reservation, Scope, WindowStore,
};
use support::consumer::Running;
use support::{Broker, Db, START_REDIS, amqp_url, redis_url, unique};

/// The stores' limits (the window module's docs): the longest key, in bytes,
/// and the longest window or lease.
const MAX_KEY_LEN: usize = 2048;
const MAX_WINDOW: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);

/// The broker as idempo's publisher connects to it.
fn amqp_broker() -> idempo::amqp::Broker {
    idempo::amqp::Broker::new(&amqp_url()).unwrap()
}

trait TestStore: WindowStore + Sized {
    const DELETES_EXPIRED: bool;
    async fn make() -> Self;
}

impl TestStore for MemoryWindow {
    const DELETES_EXPIRED: bool = true;
    async fn make() -> Self {
        MemoryWindow::new(10_000)
    }
}

impl TestStore for PostgresWindow {
    const DELETES_EXPIRED: bool = true;
    async fn make() -> Self {
        let db = Db::new().await;
        PostgresWindow::new(db.pool.clone())
    }
}

impl TestStore for RedisWindow {
    const DELETES_EXPIRED: bool = false;
    async fn make() -> Self {
        redis_window(&format!("{}:", unique("window"))).await
    }
}

async fn redis_window(prefix: &str) -> RedisWindow {
    let url = redis_url();
    RedisWindow::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("Redis is not reachable at {url}: {e}\n{START_REDIS}"))
        .with_prefix(prefix)
}

const SHORT: Duration = Duration::from_millis(800);

async fn a_duplicate_inside_the_window_is_dropped_and_accepted_after_it<S: TestStore>() {
    let window = DedupWindow::new(S::make().await).window(SHORT);
    let scope = Scope::queue("orders");
    let id = DedupId::new("order-1").unwrap();
    assert!(window.insert(&scope, &id).await.unwrap(), "new");
    assert!(
        !window.insert(&scope, &id).await.unwrap(),
        "inside the window"
    );
    // Scopes are independent: another queue, or a group.
    assert!(window.insert(&Scope::queue("other"), &id).await.unwrap());
    assert!(
        window
            .insert(&Scope::group("orders", "g1"), &id)
            .await
            .unwrap()
    );
    assert!(
        !window
            .insert(&Scope::group("orders", "g1"), &id)
            .await
            .unwrap()
    );
    tokio::time::sleep(SHORT + Duration::from_millis(300)).await;
    assert!(
        window.insert(&scope, &id).await.unwrap(),
        "after the window"
    );
    assert!(!window.insert(&scope, &id).await.unwrap());
    tokio::time::sleep(SHORT + Duration::from_millis(300)).await;
    let deleted = window.store().delete_expired(100).await.unwrap();
    if S::DELETES_EXPIRED {
        assert_eq!(deleted, 3, "every entry expired (orders, other, the group)");
    }
}

async fn content_ids_match_equal_bodies_only<S: TestStore>() {
    let window = DedupWindow::new(S::make().await);
    let scope = Scope::queue("orders");
    let body = br#"{"order": 1}"#;
    assert!(
        window
            .insert(&scope, &DedupId::content(body))
            .await
            .unwrap()
    );
    assert!(
        !window
            .insert(&scope, &DedupId::content(body))
            .await
            .unwrap()
    );
    assert!(
        window
            .insert(&scope, &DedupId::content(br#"{"order": 2}"#))
            .await
            .unwrap()
    );
}

async fn concurrent_inserts_of_one_id_admit_one<S: TestStore>() {
    let window = DedupWindow::new(S::make().await);
    let id = DedupId::new("same").unwrap();
    let inserts = (0..32).map(|_| {
        let (window, id) = (window.clone(), id.clone());
        tokio::spawn(async move { window.insert(&Scope::queue("q"), &id).await.unwrap() })
    });
    let admitted = futures::future::join_all(inserts)
        .await
        .into_iter()
        .filter(|r| *r.as_ref().unwrap())
        .count();
    assert_eq!(admitted, 1);
}

async fn reservations_record_or_release<S: TestStore>() {
    let window = DedupWindow::new(S::make().await);
    let scope = Scope::queue("q");
    let id = DedupId::new("job").unwrap();
    let lease = Duration::from_secs(5);
    let Reservation::Reserved { token } = window.reserve(&scope, &id, lease).await.unwrap() else {
        panic!("free")
    };
    assert_eq!(
        window.reserve(&scope, &id, lease).await.unwrap(),
        Reservation::Pending
    );
    assert!(
        !window.insert(&scope, &id).await.unwrap(),
        "a reserved id is not new"
    );
    assert!(
        !window.record(&scope, &id, token + 1, "x").await.unwrap(),
        "not ours"
    );
    assert!(window.release(&scope, &id, token).await.unwrap());
    let Reservation::Reserved { token } = window.reserve(&scope, &id, lease).await.unwrap() else {
        panic!("released")
    };
    assert!(
        window
            .record(&scope, &id, token, "first-message")
            .await
            .unwrap()
    );
    assert_eq!(
        window.reserve(&scope, &id, lease).await.unwrap(),
        Reservation::Seen("first-message".into())
    );
    assert!(
        !window.release(&scope, &id, token).await.unwrap(),
        "recorded: nothing to release"
    );
}

async fn an_insert_returns_what_the_duplicate_was_recorded_with<S: TestStore>() {
    let window = DedupWindow::new(S::make().await);
    let scope = Scope::queue("orders");
    let id = DedupId::new("order-1").unwrap();
    assert_eq!(
        window.insert_value(&scope, &id, "msg-1").await.unwrap(),
        Insertion::New
    );
    assert_eq!(
        window.insert_value(&scope, &id, "msg-2").await.unwrap(),
        Insertion::Seen("msg-1".into()),
        "the first value, as reserve returns it"
    );
    let held = DedupId::new("order-2").unwrap();
    let Reservation::Reserved { token } = window
        .reserve(&scope, &held, Duration::from_secs(5))
        .await
        .unwrap()
    else {
        panic!("free")
    };
    assert_eq!(
        window.insert_value(&scope, &held, "x").await.unwrap(),
        Insertion::Pending
    );
    assert!(window.release(&scope, &held, token).await.unwrap());
}

async fn keys_no_store_can_hold_are_refused_up_front<S: TestStore>() {
    let window = DedupWindow::new(S::make().await);
    let id = DedupId::new("1").unwrap();
    let lease = Duration::from_secs(5);
    let cases = [
        (Scope::queue("orders\0evil"), "NUL"),
        (Scope::group("orders", &"g".repeat(10_000)), "at most 2048"),
    ];
    for (scope, why) in cases {
        let inserted = window.insert(&scope, &id).await.map(|_| ());
        let reserved = window.reserve(&scope, &id, lease).await.map(|_| ());
        for result in [inserted, reserved] {
            let error = result.unwrap_err();
            assert!(
                matches!(error, idempo::Error::Config(_)) && error.to_string().contains(why),
                "a clear error naming {why:?}: {error}"
            );
        }
    }
    // The longest key that is allowed works.
    let longest = Scope::queue(&"q".repeat(MAX_KEY_LEN - 16));
    assert!(window.insert(&longest, &id).await.unwrap());
    let value = window
        .insert_value(&Scope::queue("orders"), &id, "nul\0value")
        .await;
    assert!(matches!(value, Err(idempo::Error::Config(_))), "{value:?}");
}

/// Windows and leases of `u64::MAX` seconds, given straight to the store (a
/// `DedupWindow` cuts its own length to `MAX_WINDOW` already). Returns the
/// keys it used.
async fn huge_durations_are_cut_instead_of_failing<S: WindowStore>(store: S) -> Vec<String> {
    let forever = Duration::from_secs(u64::MAX);
    let window = DedupWindow::new(store).window(forever);
    assert_eq!(window.length(), MAX_WINDOW);
    let scope = Scope::queue("forever");
    let (seen, leased) = (
        DedupId::new("seen").unwrap(),
        DedupId::new("leased").unwrap(),
    );
    assert!(window.insert(&scope, &seen).await.unwrap(), "new");
    assert!(!window.insert(&scope, &seen).await.unwrap(), "seen");
    let store = window.store();
    let raw = scope.key(&DedupId::new("raw").unwrap());
    assert!(store.insert(&raw, "v", forever).await.unwrap().is_new());
    assert_eq!(
        store.insert(&raw, "w", forever).await.unwrap(),
        Insertion::Seen("v".into())
    );
    let Reservation::Reserved { token } = window.reserve(&scope, &leased, forever).await.unwrap()
    else {
        panic!("free")
    };
    assert!(
        store
            .record(&scope.key(&leased), token, "m", forever)
            .await
            .unwrap()
    );
    vec![scope.key(&seen), raw, scope.key(&leased)]
}

macro_rules! store_tests {
    ($module:ident, $store:ty) => {
        mod $module {
            use super::*;

            #[tokio::test]
            async fn a_duplicate_inside_the_window_is_dropped_and_accepted_after_it() {
                super::a_duplicate_inside_the_window_is_dropped_and_accepted_after_it::<$store>()
                    .await
            }
            #[tokio::test]
            async fn content_ids_match_equal_bodies_only() {
                super::content_ids_match_equal_bodies_only::<$store>().await
            }
            #[tokio::test]
            async fn concurrent_inserts_of_one_id_admit_one() {
                super::concurrent_inserts_of_one_id_admit_one::<$store>().await
            }
            #[tokio::test]
            async fn reservations_record_or_release() {
                super::reservations_record_or_release::<$store>().await
            }
            #[tokio::test]
            async fn an_insert_returns_what_the_duplicate_was_recorded_with() {
                super::an_insert_returns_what_the_duplicate_was_recorded_with::<$store>().await
            }
            #[tokio::test]
            async fn keys_no_store_can_hold_are_refused_up_front() {
                super::keys_no_store_can_hold_are_refused_up_front::<$store>().await
            }
        }
    };
}

store_tests!(memory, MemoryWindow);
store_tests!(postgres, PostgresWindow);
store_tests!(redis, RedisWindow);

#[tokio::test]
async fn a_memory_window_of_u64_max_seconds_does_not_panic() {
    huge_durations_are_cut_instead_of_failing(MemoryWindow::make().await).await;
}

#[tokio::test]
async fn a_postgres_window_of_u64_max_seconds_works() {
    huge_durations_are_cut_instead_of_failing(PostgresWindow::make().await).await;
}

#[tokio::test]
async fn a_redis_window_of_u64_max_seconds_works() {
    let prefix = format!("{}:", unique("forever"));
    let keys = huge_durations_are_cut_instead_of_failing(redis_window(&prefix).await).await;
    // Ten-year keys must not outlive the test.
    let client = ::redis::Client::open(redis_url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let ttl: i64 = ::redis::cmd("PTTL")
        .arg(format!("{prefix}{}", keys[0]))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        ttl > 9 * 365 * 24 * 3600 * 1000,
        "the window was cut to ten years, not dropped: {ttl} ms"
    );
    let full: Vec<String> = keys.iter().map(|k| format!("{prefix}{k}")).collect();
    let deleted: i64 = ::redis::cmd("DEL")
        .arg(&full)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(deleted, 3);
}

#[tokio::test(start_paused = true)]
async fn the_memory_window_counts_live_entries_only() {
    let window = DedupWindow::new(MemoryWindow::new(10)).window(Duration::from_millis(300));
    let scope = Scope::queue("q");
    for n in 0..3 {
        let id = DedupId::new(format!("id-{n}")).unwrap();
        assert!(window.insert(&scope, &id).await.unwrap());
    }
    assert_eq!(window.store().len(), 3);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(window.store().len(), 0, "expired entries are not counted");
    assert!(window.store().is_empty());
}

/// A PostgreSQL window whose pool points at `port` on localhost, connecting lazily.
fn postgres_window_at(port: u16, timeout: Duration) -> DedupWindow<PostgresWindow> {
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(&support::database_url())
        .unwrap()
        .host("127.0.0.1")
        .port(port);
    let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy_with(options);
    DedupWindow::new(PostgresWindow::new(pool).timeout(timeout))
}

#[tokio::test]
async fn a_blackholed_postgres_window_times_out_instead_of_hanging() {
    // Accepts connections and never answers: a network that drops packets.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hole = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let window = postgres_window_at(port, Duration::from_millis(500));
    let started = Instant::now();
    let result = window
        .insert(&Scope::queue("q"), &DedupId::new("1").unwrap())
        .await;
    assert!(
        matches!(&result, Err(e) if matches!(idempo::StoreError::of(e), Some(idempo::StoreError::Timeout(t)) if *t == Duration::from_millis(500))),
        "{result:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "bounded: {:?}",
        started.elapsed()
    );
    hole.abort();
}

#[tokio::test]
async fn a_postgres_window_on_a_wrong_port_says_why() {
    let port = {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        closed.local_addr().unwrap().port()
    };
    let window = postgres_window_at(port, Duration::from_secs(1));
    let started = Instant::now();
    let error = window
        .insert(&Scope::queue("q"), &DedupId::new("1").unwrap())
        .await
        .unwrap_err();
    assert!(error.is_connection_error(), "{error:?}");
    assert!(
        error.to_string().to_lowercase().contains("refused"),
        "names the cause, not just \"pool timed out\": {error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "bounded: {:?}",
        started.elapsed()
    );
}

#[test]
fn invalid_ids_are_rejected_with_a_clear_error() {
    assert_eq!(DedupId::new(""), Err(InvalidDedupId::Empty));
    assert_eq!(
        DedupId::new("x".repeat(129)),
        Err(InvalidDedupId::TooLong { len: 129 })
    );
    let error = DedupId::new("no spaces").unwrap_err();
    assert!(error.to_string().contains("' '"), "{error}");
    assert!(DedupId::new("tab\t").is_err());
}

#[tokio::test(start_paused = true)]
async fn a_full_memory_window_refuses_rather_than_forgets() {
    let window = DedupWindow::new(MemoryWindow::new(2)).window(Duration::from_millis(300));
    let scope = Scope::queue("q");
    let id = |n: u32| DedupId::new(format!("id-{n}")).unwrap();
    assert!(window.insert(&scope, &id(1)).await.unwrap());
    assert!(window.insert(&scope, &id(2)).await.unwrap());
    let full = window.insert(&scope, &id(3)).await;
    assert!(
        matches!(&full, Err(e) if matches!(idempo::StoreError::of(e), Some(idempo::StoreError::WindowFull { capacity: 2 }))),
        "{full:?}"
    );
    assert!(
        !window.insert(&scope, &id(1)).await.unwrap(),
        "live ids are kept"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        window.insert(&scope, &id(3)).await.unwrap(),
        "expired entries are evicted"
    );
    assert_eq!(window.store().len(), 1);
}

async fn publisher_test<S: TestStore + 'static>() {
    let broker = Broker::connect().await;
    let queue = unique("pub");
    broker.declare(&queue).await;
    let window = DedupWindow::new(S::make().await);
    // Two publishers (two channels), eight tasks each, one dedup id.
    let publishers = [
        Arc::new(
            DedupPublisher::connect(&amqp_broker(), window.clone())
                .await
                .unwrap(),
        ),
        Arc::new(
            DedupPublisher::connect(&amqp_broker(), window.clone())
                .await
                .unwrap(),
        ),
    ];
    let sends = (0..16).map(|n| {
        let (publisher, queue) = (publishers[n % 2].clone(), queue.clone());
        tokio::spawn(async move {
            let message =
                Outgoing::new(format!("payload {n}")).dedup_id(DedupId::new("order-9").unwrap());
            publisher.publish("", &queue, message).await.unwrap()
        })
    });
    let results: Vec<_> = futures::future::join_all(sends)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        results.iter().filter(|p| !p.duplicate).count(),
        1,
        "{results:?}"
    );
    assert!(
        results
            .iter()
            .all(|p| p.message_id == results[0].message_id)
    );
    // Content-based: equal bodies are one message.
    let a = publishers[0]
        .publish("", &queue, Outgoing::new("same body"))
        .await
        .unwrap();
    let b = publishers[1]
        .publish("", &queue, Outgoing::new("same body"))
        .await
        .unwrap();
    assert!(!a.duplicate && b.duplicate);
    assert_eq!(a.message_id, b.message_id);
    support::eventually_ready(&broker, &queue, 2).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        broker.ready(&queue).await,
        2,
        "exactly one message per id reached the queue"
    );

    // A publish that is not confirmed does not poison its id.
    let nowhere = unique("missing");
    let id = DedupId::new("retry-me").unwrap();
    let failed = publishers[0]
        .publish("", &nowhere, Outgoing::new("x").dedup_id(id.clone()))
        .await;
    assert!(
        matches!(&failed, Err(e) if matches!(idempo::amqp::AmqpError::of(e), Some(idempo::amqp::AmqpError::PublishNotConfirmed(_)))),
        "{failed:?}"
    );
    broker.declare(&nowhere).await;
    let sent = publishers[0]
        .publish("", &nowhere, Outgoing::new("x").dedup_id(id))
        .await
        .unwrap();
    assert!(!sent.duplicate, "the failed publish did not record the id");
    support::eventually_ready(&broker, &nowhere, 1).await;
    for publisher in &publishers {
        publisher.close().await;
    }
}

#[tokio::test]
async fn concurrent_publishers_of_one_id_send_it_once_memory() {
    publisher_test::<MemoryWindow>().await
}

#[tokio::test]
async fn concurrent_publishers_of_one_id_send_it_once_postgres() {
    publisher_test::<PostgresWindow>().await
}

#[tokio::test]
async fn concurrent_publishers_of_one_id_send_it_once_redis() {
    publisher_test::<RedisWindow>().await
}

/// Publishes `groups` x `per_group` messages, interleaved, with header
/// `x-group-id` and a body `group:seq`; a consumer with concurrency 16 and
/// random handler delays records the order it processed them in.
async fn processing_order(groups: bool) -> (Vec<(String, i64)>, usize) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (db, broker, queue) = support::setup().await;
    sqlx::query("CREATE TABLE handled (n bigserial PRIMARY KEY, grp text, seq bigint)")
        .execute(&db.pool)
        .await
        .unwrap();
    let (group_count, per_group) = (6, 40);
    for seq in 0..per_group {
        for group in 0..group_count {
            let body = format!("g{group}:{seq}");
            broker
                .publish_with_headers(
                    &queue,
                    &[("x-group-id", &format!("g{group}"))],
                    body.as_bytes(),
                )
                .await;
        }
    }
    let (running_now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (now, peak) = (running_now.clone(), most.clone());
    let mut builder = Consumer::builder(amqp_url(), db.pool.clone())
        .queue(&queue)
        .message_id(idempo::consumer::MessageIdSource::ContentHash)
        .concurrency(16)
        .prefetch(100)
        .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]))
        .handler(move |tx: Tx, message: Message| {
            let (now, peak) = (now.clone(), peak.clone());
            async move {
                let text = String::from_utf8(message.body().to_vec()).unwrap();
                let (group, seq) = text.split_once(':').unwrap();
                peak.fetch_max(now.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..8))).await;
                now.fetch_sub(1, Ordering::SeqCst);
                let mut tx = tx.try_lock()?;
                sqlx::query("INSERT INTO handled (grp, seq) VALUES ($1, $2)")
                    .bind(group)
                    .bind(seq.parse::<i64>().unwrap())
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }
        });
    if groups {
        builder = builder.message_groups();
    }
    let running = Running::start(builder);
    running.finish((group_count * per_group) as u64).await;
    let handled = sqlx::query_as("SELECT grp, seq FROM handled ORDER BY n")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    (handled, most.load(Ordering::SeqCst))
}

fn out_of_order(handled: &[(String, i64)]) -> usize {
    let mut last = std::collections::HashMap::new();
    handled
        .iter()
        .filter(|(group, seq)| {
            let previous = last.insert(group.clone(), *seq);
            previous.is_some_and(|p| p > *seq)
        })
        .count()
}

#[tokio::test]
async fn message_groups_keep_their_order_under_concurrency_16() {
    let (handled, most_at_once) = processing_order(true).await;
    assert_eq!(handled.len(), 240);
    assert_eq!(out_of_order(&handled), 0, "each group in arrival order");
    // And the six groups ran side by side, never more than one handler each.
    assert!(
        most_at_once > 1,
        "groups run in parallel: at most {most_at_once} at once"
    );
    assert!(
        most_at_once <= 6,
        "one at a time per group: {most_at_once} at once"
    );
}

#[tokio::test]
async fn without_groups_the_same_load_is_reordered() {
    // The control for the test above: it can fail.
    let (handled, _) = processing_order(false).await;
    assert_eq!(handled.len(), 240);
    assert!(
        out_of_order(&handled) > 0,
        "concurrency 16 reorders without groups"
    );
}

#[tokio::test]
async fn a_consumer_with_a_window_runs_each_id_once_within_the_window() {
    use std::collections::HashMap;
    use std::sync::Mutex;
    let (db, broker, queue) = support::setup().await;
    let window = DedupWindow::new(RedisWindow::make().await).window(Duration::from_secs(4));
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let seen = runs.clone();
    let builder = Consumer::builder(amqp_url(), db.pool.clone())
        .queue(&queue)
        .concurrency(8)
        .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]))
        .dedup_window(window)
        .window_handler(move |message: Message| {
            let seen = seen.clone();
            async move {
                let id = message.id().to_owned();
                let attempt = {
                    let mut seen = seen.lock().unwrap();
                    let n = seen.entry(id.clone()).or_default();
                    *n += 1;
                    *n
                };
                // "flaky" fails its first attempt: the failure must not hide the retry.
                if id == "flaky" && attempt == 1 {
                    return Err(idempo::consumer::HandlerError::transient(
                        "first attempt fails",
                    ));
                }
                Ok(())
            }
        });
    let running = Running::start(builder);
    for id in ["a", "b", "a", "flaky", "a", "b"] {
        broker.publish(&queue, Some(id), b"{}").await;
    }
    support::eventually("every id handled", Duration::from_secs(20), || async {
        let runs = runs.lock().unwrap();
        runs.get("a") == Some(&1) && runs.get("b") == Some(&1) && runs.get("flaky") == Some(&2)
    })
    .await;
    // The same id with another body is a reused id: dead-lettered, not run.
    broker.publish(&queue, Some("a"), br#"{"other": 1}"#).await;
    support::eventually(
        "the reused id dead-lettered",
        Duration::from_secs(20),
        || async { running.stats().dead_lettered == 1 },
    )
    .await;
    assert_eq!(
        runs.lock().unwrap().get("a"),
        Some(&1),
        "duplicates within the window were dropped"
    );
    // After the window, the same id is new again (the weaker guarantee).
    tokio::time::sleep(Duration::from_secs(4)).await;
    broker.publish(&queue, Some("a"), b"{}").await;
    support::eventually("a after the window", Duration::from_secs(20), || async {
        runs.lock().unwrap().get("a") == Some(&2)
    })
    .await;
    // 4 processed + 3 duplicates + 1 dead letter (the failed attempt was retried)
    let stats = running.finish(8).await;
    assert_eq!(stats.duplicates, 3, "{stats:?}");
    assert_eq!(broker.drain(&format!("{queue}.dlq")).await.len(), 1);
}

/// A publisher on a memory window, with a connection name the test can cut.
async fn named_publisher(name: &str) -> DedupPublisher<MemoryWindow> {
    DedupPublisher::builder(amqp_broker(), DedupWindow::new(MemoryWindow::new(1_000)))
        .connection_name(name)
        .build()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_missing_exchange_neither_kills_the_publisher_nor_blocks_the_id() {
    use idempo::amqp::lapin::options::{
        ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    };
    use idempo::amqp::lapin::types::FieldTable;
    let broker = Broker::connect().await;
    let queue = unique("after_404");
    broker.declare(&queue).await;
    let publisher = named_publisher(&unique("pub404")).await;
    let exchange = unique("missing_exchange");
    let id = DedupId::new("order-404").unwrap();
    // Twice: the first failure must have released the id (NOT_FOUND means
    // not routed), so the second fails as fast instead of waiting on it.
    for attempt in 1..=2 {
        let started = Instant::now();
        let failed = tokio::time::timeout(
            Duration::from_secs(10),
            publisher.publish(&exchange, "rk", Outgoing::new("x").dedup_id(id.clone())),
        )
        .await
        .unwrap_or_else(|_| panic!("attempt {attempt} waited on a reservation it should not see"));
        let error = failed.unwrap_err();
        assert!(
            error.to_string().contains("NOT_FOUND"),
            "attempt {attempt}: {error}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    // The same publisher still publishes: its channel was reopened.
    let sent = publisher
        .publish("", &queue, Outgoing::new("good"))
        .await
        .unwrap();
    assert!(!sent.duplicate);
    support::eventually_ready(&broker, &queue, 1).await;
    // Once the exchange exists, the id that failed twice goes out.
    broker
        .channel
        .exchange_declare(
            exchange.as_str().into(),
            idempo::amqp::lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    broker
        .channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "rk".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let sent = publisher
        .publish(&exchange, "rk", Outgoing::new("x").dedup_id(id))
        .await
        .unwrap();
    assert!(
        !sent.duplicate,
        "the failed publishes did not record the id"
    );
    support::eventually_ready(&broker, &queue, 2).await;
    publisher.close().await;
    broker
        .channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_cut_connection_is_reconnected_by_the_next_publish() {
    let broker = Broker::connect().await;
    let queue = unique("after_cut");
    broker.declare(&queue).await;
    let name = unique("pubcut");
    let publisher = named_publisher(&name).await;
    publisher
        .publish("", &queue, Outgoing::new("before"))
        .await
        .unwrap();
    assert!(publisher.is_connected().await);
    let cut = name.clone();
    let closed = tokio::task::spawn_blocking(move || support::close_connections_named(&cut))
        .await
        .unwrap();
    assert_eq!(closed, 1);
    support::eventually(
        "the publisher sees its connection closed",
        Duration::from_secs(10),
        || async { !publisher.is_connected().await },
    )
    .await;
    let sent = publisher
        .publish("", &queue, Outgoing::new("after"))
        .await
        .unwrap();
    assert!(!sent.duplicate);
    assert!(publisher.is_connected().await, "reconnected");
    support::eventually_ready(&broker, &queue, 2).await;
    publisher.close().await;
}

#[tokio::test]
async fn messages_with_their_own_properties_stay_persistent() {
    use idempo::amqp::lapin::options::BasicGetOptions;
    let broker = Broker::connect().await;
    let queue = unique("persistent");
    broker.declare(&queue).await;
    let publisher = named_publisher(&unique("pubprops")).await;
    let own = BasicProperties::default().with_content_type("application/json".into());
    publisher
        .publish("", &queue, Outgoing::new("a").properties(own))
        .await
        .unwrap();
    let transient = BasicProperties::default().with_delivery_mode(1);
    publisher
        .publish("", &queue, Outgoing::new("b").properties(transient))
        .await
        .unwrap();
    support::eventually_ready(&broker, &queue, 2).await;
    let mut modes = Vec::new();
    for _ in 0..2 {
        let message = broker
            .channel
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("a message");
        let properties = &message.delivery.properties;
        if message.delivery.data == b"a" {
            assert_eq!(
                properties.content_type().as_ref().map(|c| c.as_str()),
                Some("application/json"),
                "the user's properties are kept"
            );
        }
        modes.push((
            String::from_utf8(message.delivery.data.clone()).unwrap(),
            *properties.delivery_mode(),
        ));
    }
    modes.sort();
    assert_eq!(
        modes,
        [("a".to_owned(), Some(2)), ("b".to_owned(), Some(1))],
        "unset stays persistent; an explicit mode is kept"
    );
    publisher.close().await;
}

#[tokio::test]
async fn a_lease_that_does_not_outlast_the_confirm_timeout_is_refused() {
    let refused = DedupPublisher::builder(amqp_broker(), DedupWindow::new(MemoryWindow::new(10)))
        .lease(Duration::from_secs(5))
        .confirm_timeout(Duration::from_secs(5))
        .build()
        .await;
    assert!(
        matches!(&refused, Err(idempo::Error::Config(why)) if why.contains("lease")),
        "{refused:?}"
    );
    // A shorter confirm timeout than the lease is fine.
    let publisher = DedupPublisher::builder(amqp_broker(), DedupWindow::new(MemoryWindow::new(10)))
        .lease(Duration::from_secs(5))
        .confirm_timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    publisher.close().await;
}

/// `window_handler` takes a `WindowHandler`: a type with its own state, or an
/// async fn, as well as a closure; `?` on anyhow works in it as in `handler`.
#[tokio::test]
async fn a_window_handler_can_be_a_type_of_its_own_or_an_async_fn() {
    use idempo::consumer::WindowHandler;
    use idempo::consumer::{HandlerError, JsonBody};
    use std::sync::Mutex;

    #[derive(serde::Deserialize)]
    struct Ping {
        from: String,
    }

    /// Records who pinged; refuses a ping from nobody.
    struct RecordPings {
        from: Arc<Mutex<Vec<String>>>,
    }

    impl WindowHandler<JsonBody<Ping>> for RecordPings {
        fn call(
            &self,
            JsonBody(ping): JsonBody<Ping>,
        ) -> impl Future<Output = Result<(), HandlerError>> + Send + 'static {
            let from = self.from.clone();
            async move {
                if ping.from.is_empty() {
                    return Err(HandlerError::permanent("a ping from nobody"));
                }
                from.lock().unwrap().push(ping.from);
                Ok(())
            }
        }
    }

    let (db, broker, queue) = support::setup().await;
    let from = Arc::new(Mutex::new(Vec::new()));
    let handler = RecordPings { from: from.clone() };
    let running = Running::start(
        Consumer::builder(amqp_url(), db.pool.clone())
            .queue(&queue)
            .concurrency(1)
            .dedup_window(DedupWindow::new(MemoryWindow::new(100)))
            .window_handler(handler),
    );
    broker
        .publish(&queue, Some("p1"), br#"{"from": "ann"}"#)
        .await;
    broker
        .publish(&queue, Some("p1"), br#"{"from": "ann"}"#)
        .await;
    broker.publish(&queue, Some("p2"), br#"{"from": ""}"#).await;
    broker
        .publish(&queue, Some("p3"), br#"{"from": "bob"}"#)
        .await;
    let stats = running.finish(4).await;
    assert_eq!(*from.lock().unwrap(), ["ann", "bob"]);
    assert_eq!(
        (stats.processed, stats.duplicates, stats.dead_lettered),
        (2, 1, 1)
    );
    let dead = broker.drain(&format!("{queue}.dlq")).await;
    assert_eq!(dead[0].reason(), "permanent handler error");

    // An async fn, with `?` on an anyhow error (retried: transient).
    async fn flaky(message: Message) -> Result<(), HandlerError> {
        fn downstream(retry: bool) -> anyhow::Result<()> {
            anyhow::ensure!(retry, "the downstream timed out");
            Ok(())
        }
        // A retry through the delay queue carries its attempt count.
        downstream(message.header_text("x-idempo-attempts").is_some())?;
        Ok(())
    }
    let queue = unique("window-fn");
    broker.track(&queue);
    let running = Running::start(
        Consumer::builder(amqp_url(), db.pool.clone())
            .queue(&queue)
            .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]))
            .dedup_window(DedupWindow::new(MemoryWindow::new(100)))
            .window_handler(flaky),
    );
    support::eventually("the queue is consumed", Duration::from_secs(20), || async {
        broker.consuming(&queue).await
    })
    .await;
    broker.publish(&queue, Some("f1"), b"{}").await;
    let stats = running.finish(1).await;
    assert_eq!((stats.retried, stats.processed), (1, 1), "{stats:?}");
}
