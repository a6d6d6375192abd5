//! Shared test support: real PostgreSQL and RabbitMQ, one schema and fresh
//! queue names per test, so tests run in parallel without seeing each other.
//! A service that cannot be reached fails the test with the command that
//! starts it.
#![allow(dead_code)]

#[path = "../../examples/common/payments.rs"]
pub mod payments;

pub mod cli;
pub mod cluster;
pub mod consumer;
pub mod example;
#[cfg(feature = "nats")]
pub mod nats;
pub mod otlp;
pub mod pika;
pub mod service_url;
pub mod soak;

pub use service_url::ServiceUrl;

use std::collections::BTreeMap;
use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Where the Redis of the tests is (`REDIS_URL`).
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// How to start the Redis of the tests, for a test that cannot reach it.
pub const START_REDIS: &str = "start it with `redis-server --daemonize yes --bind 127.0.0.1 --port 6379 \
     --save \"\" --appendonly no` (or `docker compose up -d redis`), or point REDIS_URL at a running server";

const START_PG: &str = "start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
     (or `docker compose up -d postgres`), or point DATABASE_URL at a running server";
const START_RABBIT: &str = "start it with `rabbitmq-server -detached` \
     (or `docker compose up -d rabbitmq`), or point AMQP_URL at a running broker";

/// A pool of two connections on the test server (for a test harness,
/// which makes a schema of its own with it).
pub async fn small_pool() -> PgPool {
    let url = database_url();
    PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL is not reachable at {url}: {e}\n{START_PG}"))
}

/// The prefix of every queue, exchange and schema the tests create; leftovers
/// of earlier runs are removed by it (see [`Db::with_pool_size`] and
/// [`Broker::connect`]).
pub const TEST_PREFIX: &str = "idempo_test_";

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A name no other test (or earlier run) uses: `idempo_test_<what>_<unix secs>_<pid>_<n>`.
pub fn unique(what: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{TEST_PREFIX}{what}_{}_{}_{}",
        unix_secs(),
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Connections one test's pool may open. With two tests at once per binary
/// (`RUST_TEST_THREADS=2`, set in `.cargo/config.toml`) and at most one
/// more pool or child process of about this size per test, the suite stays
/// within 40 PostgreSQL connections at once.
pub const POOL_SIZE: u32 = 8;

/// Fails the test with what went wrong: PostgreSQL out of connection slots
/// is not PostgreSQL being down.
fn unreachable_postgres(url: &str, e: sqlx::Error) -> ! {
    let error = idempo::Error::from(e);
    if error.is_too_many_clients() {
        panic!(
            "PostgreSQL at {url} is up but refused the connection: {error}. Its max_connections \
             is used up; this suite needs at most 40 connections at once (see README): \
             stop what else holds connections (`SELECT * FROM pg_stat_activity`)"
        )
    }
    panic!("PostgreSQL is not reachable at {url}: {error}\n{START_PG}")
}

/// Drops test schemas created more than an hour ago (by runs that failed or
/// were killed); the creation time is part of the name.
async fn drop_stale_schemas(admin: &PgPool) {
    let schemas: Vec<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)")
            .bind(format!("{TEST_PREFIX}db_"))
            .fetch_all(admin)
            .await
            .expect("list test schemas");
    let cutoff = unix_secs().saturating_sub(3600);
    for schema in schemas {
        let created = schema
            .trim_start_matches(TEST_PREFIX)
            .trim_start_matches("db_")
            .split('_')
            .next()
            .and_then(|t| t.parse::<u64>().ok());
        if created.is_some_and(|t| t < cutoff) {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE"
            )))
            .execute(admin)
            .await;
        }
    }
}

/// One test's private database schema.
pub struct Db {
    pub pool: PgPool,
    pub schema: String,
    /// A URL whose connections use this schema (for child processes).
    pub url: String,
}

impl Db {
    /// Creates a fresh schema, with idempo's migrations and the payments tables.
    pub async fn new() -> Db {
        let db = Db::empty().await;
        idempo::migrate(&db.pool).await.expect("idempo::migrate");
        payments::create_tables(&db.pool)
            .await
            .expect("create payments tables");
        db
    }

    /// Creates a fresh, empty schema, with a pool of [`POOL_SIZE`].
    pub async fn empty() -> Db {
        Db::with_pool_size(POOL_SIZE).await
    }

    pub async fn with_pool_size(size: u32) -> Db {
        let base = database_url();
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&base)
            .await
            .unwrap_or_else(|e| unreachable_postgres(&base, e));
        drop_stale_schemas(&admin).await;
        let schema = unique("db");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .expect("create schema");
        admin.close().await;
        let options = PgConnectOptions::from_str(&base)
            .unwrap()
            .options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .connect_with(options)
            .await
            .unwrap_or_else(|e| unreachable_postgres(&base, e));
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options[search_path]={schema}");
        Db { pool, schema, url }
    }

    pub async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .expect(sql)
    }

    pub async fn payments(&self) -> i64 {
        self.count("SELECT count(*) FROM payments").await
    }

    pub async fn payments_for(&self, id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE message_id = $1")
            .bind(id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn balances(&self) -> BTreeMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>("SELECT account, balance_cents FROM account_balances")
            .fetch_all(&self.pool)
            .await
            .unwrap()
            .into_iter()
            .collect()
    }

    pub async fn claims(&self) -> i64 {
        self.count("SELECT count(*) FROM processed_messages").await
    }
}

/// A broker connection with a confirm-mode channel for publishing and inspecting.
/// Deletes, when dropped (also when the test panicked), every queue it
/// declared or was told about, so runs do not pile up quorum queues.
pub struct Broker {
    pub connection: Connection,
    pub channel: Channel,
    created: std::sync::Mutex<Vec<String>>,
    /// Where the queues it created are deleted from.
    url: String,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let queues = std::mem::take(&mut *self.created.lock().unwrap());
        if queues.is_empty() {
            return;
        }
        let url = self.url.clone();
        // Drop cannot await: delete on a fresh connection in a thread of its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let Ok(connection) =
                    Connection::connect(&url, ConnectionProperties::default()).await
                else {
                    return;
                };
                for queue in queues {
                    // A failed delete closes the channel: one channel per queue.
                    if let Ok(channel) = connection.create_channel().await {
                        let _ = channel
                            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                            .await;
                    }
                }
                let _ = connection.close(200, "test cleanup".into()).await;
            });
        })
        .join();
    }
}

impl Broker {
    pub async fn connect() -> Broker {
        let url = amqp_url();
        // No heartbeats on the test's own connection: a test that builds the
        // example (a blocking `cargo build`, minutes when the cargo lock is
        // busy) would otherwise lose it to missed heartbeats.
        let sep = if url.contains('?') { '&' } else { '?' };
        let quiet = format!("{url}{sep}heartbeat=0");
        let connection = Connection::connect(&quiet, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ is not reachable at {url}: {e}\n{START_RABBIT}"));
        expire_idle_test_queues();
        Broker::with(connection, &url).await
    }

    /// A `Broker` on node `n` of the local cluster (see [`cluster`]).
    pub async fn on_cluster_node(n: usize) -> Broker {
        Broker::with(cluster::connect(n).await, &cluster::node_url(n)).await
    }

    /// A `Broker` on `connection`, deleting its queues through `url`.
    pub async fn with(connection: Connection, url: &str) -> Broker {
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        Broker {
            connection,
            channel,
            created: Default::default(),
            url: url.to_owned(),
        }
    }

    /// Declares `queue` and `queue.dlq` exactly as the consumer does (quorum,
    /// dead-lettering into the DLQ), so that messages can be published before
    /// the consumer starts.
    pub async fn declare(&self, queue: &str) {
        self.declare_as(queue, "quorum")
            .await
            .expect("declare the test queues");
    }

    /// Deletes `queue`, `queue.dlq` and the delay queue of [`RETRY_DELAY`]
    /// when this `Broker` is dropped (for queues that a consumer declared).
    pub fn track(&self, queue: &str) {
        let mut created = self.created.lock().unwrap();
        created.push(queue.to_owned());
        created.push(format!("{queue}.dlq"));
        created.push(format!("{queue}.retry.{}ms", RETRY_DELAY.as_millis()));
    }

    /// Deletes `queue` when this `Broker` is dropped.
    pub fn track_one(&self, queue: &str) {
        self.created.lock().unwrap().push(queue.to_owned());
    }

    /// Declares `queue` (of `queue_type`) and its DLQ with the consumer's
    /// arguments; fails if either exists with other arguments.
    pub async fn declare_as(&self, queue: &str, queue_type: &str) -> lapin::Result<()> {
        self.track(queue);
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let dlq = format!("{queue}.dlq");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(queue_type.into()),
        );
        self.channel
            .queue_declare(dlq.as_str().into(), durable, args.clone())
            .await?;
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(dlq.as_str().into()),
        );
        if queue_type == "quorum" {
            args.insert(
                "x-dead-letter-strategy".into(),
                AMQPValue::LongString("at-least-once".into()),
            );
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString("reject-publish".into()),
            );
        }
        self.channel
            .queue_declare(queue.into(), durable, args)
            .await?;
        Ok(())
    }

    /// Publishes through the default exchange and waits for the confirm.
    pub async fn publish_props(&self, queue: &str, properties: BasicProperties, body: &[u8]) {
        self.publish_to("", queue, properties, body).await;
    }

    /// Publishes `mandatory` and persistent, and asserts the broker confirmed
    /// and routed it.
    pub async fn publish_to(
        &self,
        exchange: &str,
        routing_key: &str,
        properties: BasicProperties,
        body: &[u8],
    ) {
        let confirm = self
            .channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body,
                properties.with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(
            matches!(confirm, lapin::Confirmation::Ack(None)),
            "publish to {exchange:?}/{routing_key:?} not confirmed: {confirm:?}"
        );
    }

    /// Publishes `body` with string application headers and no message id.
    pub async fn publish_with_headers(&self, queue: &str, headers: &[(&str, &str)], body: &[u8]) {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert((*name).into(), AMQPValue::LongString((*value).into()));
        }
        self.publish_props(queue, BasicProperties::default().with_headers(table), body)
            .await;
    }

    /// Publishes `body` with AMQP `message_id` = `id` (or none).
    pub async fn publish(&self, queue: &str, id: Option<&str>, body: &[u8]) {
        let mut properties = BasicProperties::default();
        if let Some(id) = id {
            properties = properties.with_message_id(id.into());
        }
        self.publish_props(queue, properties, body).await;
    }

    /// Publishes a payment message.
    pub async fn publish_payment(&self, queue: &str, id: &str, account: &str, cents: i64) {
        let body = payment_body(account, cents);
        self.publish(queue, Some(id), &body).await;
    }

    /// Publishes without waiting for each confirm (bulk loads), then waits for all.
    pub async fn publish_many(&self, queue: &str, messages: &[(String, Vec<u8>)]) {
        for (id, body) in messages {
            let _confirm = self
                .channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    body,
                    BasicProperties::default()
                        .with_message_id(id.as_str().into())
                        .with_delivery_mode(2),
                )
                .await
                .unwrap();
        }
        let returned = self.channel.wait_for_confirms().await.unwrap();
        assert!(returned.is_empty(), "some publishes were returned");
    }

    /// Messages ready in `queue` (not counting unacked ones).
    ///
    /// A quorum queue may not answer for a few seconds while a cluster node
    /// stops (its leader moves): asked again for up to 15 s.
    pub async fn ready(&self, queue: &str) -> u32 {
        let mut last = None;
        for _ in 0..30 {
            match self.declare_passive(queue).await {
                Ok(declared) => return declared.message_count(),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!("queue {queue} should exist: {}", last.unwrap())
    }

    /// Whether `queue` exists.
    pub async fn exists(&self, queue: &str) -> bool {
        self.inspect(queue).await.is_some()
    }

    /// Whether `queue` exists and has a consumer.
    pub async fn consuming(&self, queue: &str) -> bool {
        self.inspect(queue)
            .await
            .is_some_and(|q| q.consumer_count() > 0)
    }

    async fn inspect(&self, queue: &str) -> Option<lapin::Queue> {
        self.declare_passive(queue).await.ok()
    }

    async fn declare_passive(&self, queue: &str) -> lapin::Result<lapin::Queue> {
        // A passive declare of a missing queue closes its channel: use a throwaway one.
        let channel = self.connection.create_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await;
        let _ = channel.close(200, "".into()).await;
        declared
    }

    /// Takes every message from `queue` (acking them) and returns them.
    pub async fn drain(&self, queue: &str) -> Vec<DeadLetter> {
        let mut out = Vec::new();
        while let Some(m) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let headers = m
                .delivery
                .properties
                .headers()
                .clone()
                .unwrap_or_default()
                .inner()
                .iter()
                .filter_map(|(k, v)| match v {
                    AMQPValue::LongString(s) => Some((
                        k.to_string(),
                        String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    )),
                    AMQPValue::LongLongInt(n) => Some((k.to_string(), n.to_string())),
                    _ => None,
                })
                .collect();
            let properties = &m.delivery.properties;
            out.push(DeadLetter {
                message_id: properties.message_id().as_ref().map(|s| s.to_string()),
                expiration: properties.expiration().as_ref().map(|s| s.to_string()),
                headers,
                body: m.delivery.data.clone(),
            });
        }
        out
    }

    pub async fn delete(&self, queue: &str) {
        self.created.lock().unwrap().retain(|q| q != queue);
        let _ = self
            .channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await;
    }
}

/// A message read back from a queue, typically the DLQ.
#[derive(Debug)]
pub struct DeadLetter {
    pub message_id: Option<String>,
    pub expiration: Option<String>,
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

impl DeadLetter {
    pub fn reason(&self) -> &str {
        self.headers
            .get("x-idempo-reason")
            .map(String::as_str)
            .unwrap_or("<no reason header>")
    }
}

/// The retry delay the tests configure: short, so retries happen at once.
pub const RETRY_DELAY: Duration = Duration::from_millis(50);

pub fn payment_body(account: &str, cents: i64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"account": account, "amount_cents": cents})).unwrap()
}

/// Waits until `queue` holds exactly `n` ready messages (unacked ones return
/// when their consumer's channel closes, so this may take a moment).
pub async fn eventually_ready(broker: &Broker, queue: &str, n: u32) {
    eventually(
        &format!("{n} message(s) ready in {queue}"),
        Duration::from_secs(30),
        || async { broker.ready(queue).await == n },
    )
    .await;
}

/// [`eventually`] for a condition that also describes what it saw: the last
/// description is in the failure message.
pub async fn eventually_showing<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = (bool, String)>,
{
    let start = Instant::now();
    loop {
        let (holds, seen) = condition().await;
        if holds {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for: {what}; last seen: {seen}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `condition` every 50 ms until it holds or `timeout` passes.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if condition().await {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The usual start of a consumer test: tracing, a fresh schema with the
/// payments tables, a broker connection, and a declared fresh queue.
pub async fn setup() -> (Db, Broker, String) {
    init_tracing();
    let (db, broker, queue) = (Db::new().await, Broker::connect().await, unique("q"));
    broker.declare(&queue).await;
    (db, broker, queue)
}

/// Logs from the library while tests run (`RUST_LOG=idempo=debug` for more).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "idempo=warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// `rabbitmqctl`, or the command in `RABBITMQCTL` (e.g.
/// `docker compose exec -T rabbitmq rabbitmqctl` when the broker runs in compose).
pub fn rabbitmqctl() -> std::process::Command {
    let line = std::env::var("RABBITMQCTL").unwrap_or_else(|_| "rabbitmqctl".into());
    let mut words = line.split_whitespace();
    let mut command = std::process::Command::new(words.next().expect("RABBITMQCTL is empty"));
    command.args(words);
    command
}

/// Sets (once per process) a broker policy that deletes test queues after 5
/// idle minutes: the backstop for runs killed before `Broker` was dropped.
fn expire_idle_test_queues() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        let definition = r#"{"expires":300000}"#;
        let result = rabbitmqctl()
            .args([
                "set_policy",
                "idempo-test-expiry",
                &format!("^{TEST_PREFIX}"),
                definition,
            ])
            .args(["--apply-to", "queues"])
            .output();
        match result {
            Ok(out) if out.status.success() => {}
            // Not a skip: the tests still run; only old test queues stay until deleted by hand.
            other => eprintln!("warning: cannot set the test-queue expiry policy: {other:?}"),
        }
    });
}

/// Closes, from the broker's side, the AMQP connections whose name contains
/// `connection_name` (as a crash or a network cut would look to the client),
/// and returns how many it closed (at least one, or it panics).
pub fn close_connections_named(connection_name: &str) -> usize {
    let out = rabbitmqctl()
        .args([
            "list_connections",
            "pid",
            "client_properties",
            "-q",
            "--no-table-headers",
        ])
        .output()
        .unwrap_or_else(|e| panic!("cannot run rabbitmqctl (needed to cut a connection; set RABBITMQCTL to e.g. `docker compose exec -T rabbitmq rabbitmqctl`): {e}"));
    assert!(
        out.status.success(),
        "rabbitmqctl list_connections failed: {out:?}"
    );
    let listing = String::from_utf8_lossy(&out.stdout);
    let pids: Vec<&str> = listing
        .lines()
        .filter(|line| line.contains(connection_name))
        .filter_map(|line| line.split('\t').next())
        .collect();
    assert!(
        !pids.is_empty(),
        "expected a connection named {connection_name}:\n{listing}"
    );
    for pid in &pids {
        let closed = rabbitmqctl()
            .args(["close_connection", pid, "test: simulated crash"])
            .output()
            .expect("rabbitmqctl close_connection");
        assert!(
            closed.status.success(),
            "rabbitmqctl close_connection failed: {closed:?}"
        );
    }
    pids.len()
}

/// The compiled `payments` example, built on first use.
pub fn payments_example_binary() -> std::path::PathBuf {
    example_binary("payments")
}

/// Builds an example (with every feature, as the tests are built, so that
/// the library is not compiled a second time) and returns its executable.
pub fn example_binary(name: &str) -> std::path::PathBuf {
    static BINARIES: std::sync::Mutex<BTreeMap<String, std::path::PathBuf>> =
        std::sync::Mutex::new(BTreeMap::new());
    let mut binaries = BINARIES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(path) = binaries.get(name) {
        return path.clone();
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = std::process::Command::new(cargo);
    // The variables cargo sets for a test process are not the shell's:
    // `ring`'s build script reruns when CARGO_MANIFEST_DIR changes, which
    // rebuilt the whole TLS stack (minutes) on the first example of a run.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key == "CARGO_MANIFEST_DIR"
            || key == "CARGO_MANIFEST_PATH"
            || key == "CARGO_CRATE_NAME"
            || key == "CARGO_PRIMARY_PACKAGE"
            || key == "CARGO_TARGET_TMPDIR"
            || key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_BIN_")
        {
            command.env_remove(&*key);
        }
    }
    let out = command
        .args([
            "build",
            "--all-features",
            "--example",
            name,
            "--message-format=json",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run cargo build --example {name}: {e}"));
    assert!(out.status.success(), "cargo build --example {name} failed");
    let path = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["target"]["name"] == name)
        .find_map(|m| m["executable"].as_str().map(std::path::PathBuf::from))
        .unwrap_or_else(|| panic!("cargo reported no {name} executable"));
    binaries.insert(name.to_owned(), path.clone());
    path
}

/// Kills a child process when dropped (a failing test leaves none behind).
pub struct KillOnDrop<'a>(pub &'a mut std::process::Child);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A TCP proxy in front of a service that a test can cut (all connections
/// dropped, new ones refused) and restore: an outage of PostgreSQL or
/// RabbitMQ that only this test sees.
pub struct TcpProxy {
    pub addr: std::net::SocketAddr,
    up: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cut: tokio::sync::watch::Sender<u64>,
}

impl TcpProxy {
    /// A proxy in front of the PostgreSQL of `DATABASE_URL`.
    pub async fn postgres() -> TcpProxy {
        TcpProxy::start(&ServiceUrl::database().addr()).await
    }

    /// A proxy in front of the (first) RabbitMQ node of `AMQP_URL`.
    pub async fn amqp() -> TcpProxy {
        TcpProxy::start(&ServiceUrl::amqp().addr()).await
    }

    /// A proxy in front of `target` (`host:port`).
    pub async fn start(target: &str) -> TcpProxy {
        use std::sync::atomic::AtomicBool;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let up = std::sync::Arc::new(AtomicBool::new(true));
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let (target, flag, cuts) = (target.to_owned(), up.clone(), cut.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                if !flag.load(Ordering::SeqCst) {
                    continue; // dropped: the connection is refused in effect
                }
                let target = target.clone();
                let mut cut_rx = cuts.subscribe();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut_rx.changed() => {}
                    }
                });
            }
        });
        TcpProxy { addr, up, cut }
    }

    /// Drops every proxied connection and refuses new ones.
    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.cut.send_modify(|n| *n += 1);
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// A pool on the schema of `db`, but through `proxy`.
pub async fn pool_through(proxy: &TcpProxy, db: &Db) -> PgPool {
    let options = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .host("127.0.0.1")
        .port(proxy.addr.port())
        .options([("search_path", db.schema.as_str())]);
    PgPoolOptions::new()
        .max_connections(POOL_SIZE / 2)
        .acquire_timeout(Duration::from_millis(500))
        .connect_with(options)
        .await
        .expect("connect through the proxy")
}

/// A pool of `size` on the schema of `db` whose sessions run with
/// `settings` (e.g. `standard_conforming_strings = off`); checks with
/// `SHOW` that each took.
pub async fn pool_with_settings(db: &Db, size: u32, settings: &[(&str, &str)]) -> PgPool {
    let mut options = vec![("search_path", db.schema.as_str())];
    options.extend_from_slice(settings);
    let connect = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .options(options);
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .connect_with(connect)
        .await
        .unwrap_or_else(|e| unreachable_postgres(&database_url(), e));
    for (name, value) in settings {
        let shown: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {name}")))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(shown, *value, "the session setting {name} took");
    }
    pool
}

/// The session settings a test runs the library under: none, or
/// `standard_conforming_strings = off`, where a backslash in an ordinary
/// literal escapes the next character.
pub const SESSION_SETTINGS: [&[(&str, &str)]; 2] = [&[], &[("standard_conforming_strings", "off")]];

/// A database and a login role of their own, for tests that take "the"
/// database offline (`ALLOW_CONNECTIONS false`, `NOLOGIN`, `CONNECTION LIMIT
/// 0`) without touching what other tests use. Dropped by [`IsolatedDb::drop`]
/// (and, if a run died, by the next one: names carry their creation time).
pub struct IsolatedDb {
    pub db: Db,
    pub name: String,
    admin: PgPool,
}

impl IsolatedDb {
    pub async fn new() -> IsolatedDb {
        let base = database_url();
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&base)
            .await
            .unwrap_or_else(|e| unreachable_postgres(&base, e));
        let stale: Vec<String> = sqlx::query_scalar(
            "SELECT datname::text FROM pg_database WHERE starts_with(datname, $1)",
        )
        .bind(format!("{TEST_PREFIX}iso_"))
        .fetch_all(&admin)
        .await
        .unwrap();
        let cutoff = unix_secs().saturating_sub(3600);
        for name in stale {
            let created = name
                .trim_start_matches(TEST_PREFIX)
                .trim_start_matches("iso_")
                .split('_')
                .next()
                .and_then(|t| t.parse::<u64>().ok());
            if created.is_some_and(|t| t < cutoff) {
                Self::remove(&admin, &name).await;
            }
        }
        let name = unique("iso");
        // The role logs in as DATABASE_URL's user does: with its password,
        // if it has one (a server that asks for passwords lets it in too).
        let base_url = ServiceUrl::database();
        let password = base_url.password();
        let login = match &password {
            Some(p) => format!("LOGIN PASSWORD '{}'", p.replace('\'', "''")),
            None => "LOGIN".to_owned(),
        };
        for sql in [
            format!("CREATE ROLE {name} {login}"),
            format!("CREATE DATABASE {name} OWNER {name}"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&admin)
                .await
                .expect("create the isolated database");
        }
        let url = base_url
            .with_user(&name, password.as_deref())
            .with_path(&name)
            .to_string();
        let options = PgConnectOptions::from_str(&url).unwrap();
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(Duration::from_secs(2))
            .connect_with(options)
            .await
            .unwrap_or_else(|e| unreachable_postgres(&base, e));
        idempo::migrate(&pool).await.expect("idempo::migrate");
        payments::create_tables(&pool)
            .await
            .expect("payments tables");
        IsolatedDb {
            db: Db {
                pool,
                schema: "public".into(),
                url,
            },
            name,
            admin,
        }
    }

    /// Runs `sql` as the administrator (`{name}` stands for the database and role).
    pub async fn admin(&self, sql: &str) {
        let sql = sql.replace("{name}", &self.name);
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&self.admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Terminates every backend connected to the database.
    pub async fn kick(&self) {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(&self.name)
        .execute(&self.admin)
        .await
        .unwrap();
    }

    async fn remove(admin: &PgPool, name: &str) {
        for sql in [
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            format!("DROP ROLE IF EXISTS {name}"),
        ] {
            let _ = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(admin).await;
        }
    }

    pub async fn drop(self) {
        self.db.pool.close().await;
        Self::remove(&self.admin, &self.name).await;
    }
}

/// Message ids that would break SQL text built carelessly: quotes,
/// backslashes (`\'` and `E'..'` forms), dollar quotes, parameters,
/// statement separators and comments, an injection, escape sequences that
/// look like a NUL (a real NUL is refused before any SQL), control
/// characters, unicode (emoji, right-to-left, combining marks), and ids of
/// 254 and 255 bytes. All distinct, all valid.
pub fn hostile_ids() -> Vec<String> {
    let mut ids: Vec<String> = [
        "'",
        "''",
        "\\",
        "\\'",
        "'\\",
        "\\\\",
        "E'x'",
        "e'\\x41'",
        "$$",
        "$1",
        "$tag$x$tag$",
        ";",
        "--",
        "/*",
        "*/",
        "'); DROP TABLE processed_messages; --",
        "x'; SELECT pg_sleep(10); --",
        "\\x00",
        "\\\\x00",
        "\\000",
        "\\u0000",
        "U&'\\0000'",
        "\"",
        "`",
        "%",
        "_",
        " leading space",
        "trailing space ",
        "line\nbreak",
        "crlf\r\n",
        "\ttab",
        "\u{1}\u{7f}",
        "💸🦀",
        "\u{202E}evil",
        "שלום",
        "e\u{301}\u{302}\u{303}",
        "\u{feff}bom",
        "\u{200b}",
    ]
    .map(String::from)
    .into();
    ids.push("é".repeat(127)); // 254 bytes
    ids.push(format!("{}'", "'\\".repeat(127))); // 255 bytes
    ids.push(format!("{}\\", "é".repeat(127))); // 255 bytes
    let distinct: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "hostile ids are distinct");
    assert_eq!(ids[ids.len() - 3].len(), 254);
    assert!(ids[ids.len() - 2..].iter().all(|id| id.len() == 255));
    ids
}

/// A TCP port nothing listens on right now (for a server of a test's own).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The id an outbox message staged with `.derived_id(incoming_id, purpose)`
/// carries.
pub fn derived_id(incoming_id: &str, purpose: &str) -> String {
    idempo::outbox::OutboxMessage::new("", "q", Vec::new())
        .derived_id(incoming_id, purpose)
        .id()
        .expect("a derived id")
        .to_owned()
}
