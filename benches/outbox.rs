//! The transactional outbox against the local RabbitMQ and PostgreSQL, with
//! hand-written baselines measured in the same run.
//!
//! ```text
//! cargo bench --bench outbox
//! ```
//!
//! Environment: `BENCH_OUTBOX_ROWS` (default 100000: the backlog the relay
//! drains), `BENCH_MESSAGES` (default 50000: payments per consumer variant
//! and for the broker-only forwarder), `BENCH_ROUNDS` (default 3: how many
//! times each consumer variant runs, pairs back to back; the median run is
//! reported),
//! `BENCH_QUEUE_TYPE` (`quorum`, the default, or `classic`),
//! `BENCH_RELAY_BATCH` (the batch size of the bench's own relays, default
//! 500 as `Relay`'s; the payments consumer's relay keeps its default),
//! `AMQP_URL`, `DATABASE_URL`. Each variant runs in a child process of its
//! own, on a fresh schema and fresh queues. See BENCHMARKS.md ("Outbox") for
//! what each figure measures.
//!
//! `BENCH_DIAG` (comma-separated, for finding where time goes; the figures
//! are then not the outbox's): `no-notify` disables the `outbox_notify`
//! trigger in the variant's schema (the relay then wakes on its 5 s poll
//! only), `no-relay` runs the payments consumer without its relay (the
//! outbox is then not drained).

#[path = "../examples/common/payments.rs"]
#[allow(dead_code)]
mod payments;
#[path = "support/topology.rs"]
mod topology;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use idempo::amqp::Relay;
use idempo::amqp::{Consumer, QueueType};
use idempo::consumer::RedeliveryPolicy;
use idempo::outbox::{self, OutboxMessage};
use idempo::relay::RelayState;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection as _, PgPool};
use tokio::task::JoinHandle;
use tracing::subscriber::Interest;
use tracing_subscriber::layer::SubscriberExt as _;

const VARIANTS: &[&str] = &[
    "lapin-confirmed",
    "relay-drain",
    "latency",
    "payments-c16",
    "payments-c16-forward",
    "payments-batch500",
    "payments-batch500-forward",
    "lapin-forwarder",
];

/// Rows per `stage_all` transaction when building the backlog.
const STAGE_CHUNK: u64 = 1_000;
/// Publishes per confirm round of the hand-written publisher.
const BASELINE_BATCH: usize = 500;
/// The paced phase: one staging transaction per message, at this rate, this long.
const PACED_RATE: u64 = 1_000;
const PACED_FOR: Duration = Duration::from_secs(5);
/// No wait in this bench may take longer (a hang is a failure, not a figure).
const WAIT_AT_MOST: Duration = Duration::from_secs(600);

#[derive(Debug, Default, Serialize, Deserialize)]
struct Figures {
    variant: String,
    messages: u64,
    seconds: f64,
    /// Everything else the variant measured, by name.
    extra: BTreeMap<String, f64>,
}

impl Figures {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.seconds
    }

    fn get(&self, name: &str) -> f64 {
        self.extra.get(name).copied().unwrap_or(f64::NAN)
    }
}

/// The relay's non-empty batches in this process, and their rows, counted
/// from its `outbox_relay_batch` tracing span (the only span or event this
/// process enables).
static RELAY_BATCHES: AtomicU64 = AtomicU64::new(0);
static RELAY_BATCH_ROWS: AtomicU64 = AtomicU64::new(0);

const RELAY_BATCH_SPAN: &str = "outbox_relay_batch";

struct BatchCounter;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for BatchCounter {
    fn register_callsite(&self, metadata: &'static tracing::Metadata<'static>) -> Interest {
        if metadata.name() == RELAY_BATCH_SPAN {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(
        &self,
        metadata: &tracing::Metadata<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        metadata.name() == RELAY_BATCH_SPAN
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _id: &tracing::span::Id,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct Rows(u64);
        impl tracing::field::Visit for Rows {
            fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
                if field.name() == "rows" {
                    self.0 = value;
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut rows = Rows(0);
        attrs.record(&mut rows);
        RELAY_BATCHES.fetch_add(1, Ordering::Relaxed);
        RELAY_BATCH_ROWS.fetch_add(rows.0, Ordering::Relaxed);
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--variant") {
        let variant = args.get(i + 1).context("--variant NAME")?.clone();
        // No `init()`: it would also route the `log` crate (sqlx) into tracing.
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(BatchCounter))?;
        let runtime = tokio::runtime::Runtime::new()?;
        let figures = runtime.block_on(run_variant(&variant))?;
        println!("FIGURES {}", serde_json::to_string(&figures)?);
        return Ok(());
    }
    // `cargo bench` passes `--bench`; any other word filters the variants.
    let filter: Vec<&String> = args[1..].iter().filter(|a| !a.starts_with("--")).collect();
    let exe = std::env::current_exe()?;
    let selected: Vec<&str> = VARIANTS
        .iter()
        .copied()
        .filter(|v| filter.is_empty() || filter.iter().any(|f| v.contains(f.as_str())))
        .collect();
    // The consumer variants run in rounds, each pair back to back, so that a
    // ratio compares runs made under the same machine state; the median run
    // of each variant is reported.
    let rounds = env_u64("BENCH_ROUNDS", 3).max(1);
    let mut schedule: Vec<&str> = selected
        .iter()
        .copied()
        .filter(|v| !v.starts_with("payments"))
        .collect();
    let consumers: Vec<&str> = selected
        .iter()
        .copied()
        .filter(|v| v.starts_with("payments"))
        .collect();
    for _ in 0..rounds {
        schedule.extend(&consumers);
    }
    let mut runs: BTreeMap<&str, Vec<Figures>> = BTreeMap::new();
    for variant in schedule {
        eprintln!("running {variant} ...");
        let out = Command::new(&exe).args(["--variant", variant]).output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix("FIGURES "))
            .with_context(|| {
                format!(
                    "{variant} failed: {}\n{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                )
            })?;
        let figures: Figures = serde_json::from_str(line)?;
        eprintln!("  {figures:?}");
        runs.entry(variant).or_default().push(figures);
    }
    let results: Vec<Figures> = selected
        .iter()
        .filter_map(|v| runs.remove(v))
        .map(median_run)
        .collect();
    report(&results);
    Ok(())
}

/// The run with the median rate (the lower middle of an even count), with
/// every run's rate added as `rate_round_N` when there were several.
fn median_run(mut runs: Vec<Figures>) -> Figures {
    let rates: Vec<f64> = runs.iter().map(Figures::rate).collect();
    runs.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
    let mut median = runs.swap_remove((runs.len() - 1) / 2);
    if rates.len() > 1 {
        for (round, rate) in rates.into_iter().enumerate() {
            median
                .extra
                .insert(format!("rate_round_{}", round + 1), rate);
        }
    }
    median
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn queue_type() -> QueueType {
    match std::env::var("BENCH_QUEUE_TYPE").as_deref() {
        Ok("classic") => QueueType::Classic,
        _ => QueueType::Quorum,
    }
}

/// Whether `BENCH_DIAG` holds `knob`.
fn diag(knob: &str) -> bool {
    std::env::var("BENCH_DIAG")
        .unwrap_or_default()
        .split(',')
        .any(|k| k.trim() == knob)
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

fn report(results: &[Figures]) {
    let find = |name: &str| results.iter().find(|r| r.variant == name);
    let yes = |ok: bool| if ok { "yes" } else { "**no**" };
    let queue_type = std::env::var("BENCH_QUEUE_TYPE").unwrap_or_else(|_| "quorum".into());
    println!(
        "\nqueue type: {queue_type}; relay batch size {}; backlog {} rows; {} payments per consumer variant, median of {} rounds\n",
        env_u64("BENCH_RELAY_BATCH", 500),
        env_u64("BENCH_OUTBOX_ROWS", 100_000),
        env_u64("BENCH_MESSAGES", 50_000),
        env_u64("BENCH_ROUNDS", 3).max(1),
    );
    if let Ok(knobs) = std::env::var("BENCH_DIAG") {
        println!("**DIAGNOSTIC RUN, BENCH_DIAG={knobs}: not the outbox's figures**\n");
    }
    println!("| figure | value | baseline | ratio | requirement | met |");
    println!("|---|---:|---:|---:|---|---|");
    if let (Some(relay), Some(base)) = (find("relay-drain"), find("lapin-confirmed")) {
        let ratio = relay.rate() / base.rate();
        println!(
            "| relay drains a backlog | {:.0} rows/s | {:.0} msg/s (lapin, confirms per 500) | {ratio:.2}× | ≥ 0.7× | {} |",
            relay.rate(),
            base.rate(),
            yes(ratio >= 0.7)
        );
        let rates: Vec<f64> = (2..=4)
            .map(|r| relay.messages as f64 / relay.get(&format!("drain_seconds_{r}")))
            .collect();
        let (lo, hi) = (
            rates.iter().copied().fold(f64::INFINITY, f64::min),
            rates.iter().copied().fold(0.0, f64::max),
        );
        println!(
            "| relay, three more backlogs (same table) | {lo:.0}–{hi:.0} rows/s | {:.0} msg/s | {:.2}–{:.2}× | (more samples) | |",
            base.rate(),
            lo / base.rate(),
            hi / base.rate()
        );
        let size = |name: &str| relay.get(name);
        let first = size("size_backlog_1");
        println!(
            "| `outbox` size right after the drain | {} | {} with the backlog pending ({} empty) | {:.2}× | (reported; DELETE frees nothing before VACUUM) | |",
            mib(size("size_drained_1")),
            mib(first),
            mib(size("size_empty")),
            size("size_drained_1") / first,
        );
        println!(
            "| `outbox` size, 2nd backlog pending, no VACUUM since the 1st (autovacuum {}) | {} | {} 1st backlog | {:.2}× | not growing with history (≤ 1.05× the previous backlog) | {} |",
            if relay.get("autovacuum_on") == 1.0 {
                "on"
            } else {
                "off"
            },
            mib(size("size_backlog_2")),
            mib(first),
            size("size_backlog_2") / first,
            yes(size("size_backlog_2") <= 1.05 * first)
        );
        println!(
            "| `outbox` size after the 2nd drain + plain VACUUM | {} | {} | {:.2}× | (reported) | |",
            mib(size("size_vacuumed_2")),
            mib(first),
            size("size_vacuumed_2") / first,
        );
        let third = size("size_backlog_3");
        println!(
            "| `outbox` size, 4th backlog pending, plain VACUUM after each drain | {} ({:.2}× the 1st) | {} 3rd backlog | {:.2}× | not growing with history (≤ 1.05× the previous backlog) | {} |",
            mib(size("size_backlog_4")),
            size("size_backlog_4") / first,
            mib(third),
            size("size_backlog_4") / third,
            yes(size("size_backlog_4") <= 1.05 * third)
        );
    }
    if let Some(l) = find("latency") {
        println!(
            "| commit → published, p50 | {:.2} ms | | | ≤ 5 ms | {} |",
            l.get("p50_ms"),
            yes(l.get("p50_ms") <= 5.0)
        );
        println!(
            "| commit → published, p99 | {:.2} ms | | | ≤ 50 ms | {} |",
            l.get("p99_ms"),
            yes(l.get("p99_ms") <= 50.0)
        );
    }
    for mode in ["c16", "batch500"] {
        let (Some(with), Some(without)) = (
            find(&format!("payments-{mode}-forward")),
            find(&format!("payments-{mode}")),
        ) else {
            continue;
        };
        let ratio = with.rate() / without.rate();
        println!(
            "| payments {mode}, forwarding each payment | {:.0} msg/s | {:.0} msg/s without | {ratio:.2}× | ≥ 0.8× | {} |",
            with.rate(),
            without.rate(),
            yes(ratio >= 0.8)
        );
        println!(
            "| payments {mode}, outbox empty after | {:.2} s ({:.0} msg/s end to end) | input drained after {:.2} s | | (reported) | |",
            with.get("outbox_empty_seconds"),
            with.messages as f64 / with.get("outbox_empty_seconds"),
            with.seconds,
        );
        if let Some(ceiling) = find("lapin-forwarder") {
            println!(
                "| payments {mode}: broker-only forwarding ceiling vs without | {:.0} msg/s (lapin, no database) | {:.0} msg/s without | {:.2}× | (the best any forwarding can do here) | |",
                ceiling.rate(),
                without.rate(),
                ceiling.rate() / without.rate(),
            );
        }
    }
    println!("\nper variant:\n");
    println!("| variant | messages | seconds | per second | other figures |");
    println!("|---|---:|---:|---:|---|");
    for r in results {
        let extra: Vec<String> = r
            .extra
            .iter()
            .map(|(k, v)| {
                format!(
                    "{k}={}",
                    if v.fract() == 0.0 {
                        format!("{v:.0}")
                    } else {
                        format!("{v:.3}")
                    }
                )
            })
            .collect();
        println!(
            "| {} | {} | {:.2} | {:.0} | {} |",
            r.variant,
            r.messages,
            r.seconds,
            r.rate(),
            extra.join(", ")
        );
    }
}

/// A fresh schema (the pool's `search_path`) and an AMQP connection.
struct Bench {
    pool: PgPool,
    options: PgConnectOptions,
    tag: String,
    amqp_url: String,
    queue_type: QueueType,
    channel: Channel,
    connection: Connection,
    queues: Mutex<Vec<String>>,
}

async fn setup(variant: &str, pool_size: u32) -> anyhow::Result<Bench> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let tag = format!(
        "bench_outbox_{}_{}",
        variant.replace('-', "_"),
        std::process::id()
    );
    let options: PgConnectOptions = database_url.parse()?;
    // One short-lived connection for the schema, so that the pools below are
    // all the connections the variant holds.
    let mut admin = sqlx::PgConnection::connect_with(&options)
        .await
        .with_context(|| format!("PostgreSQL at {database_url}"))?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {tag} CASCADE; CREATE SCHEMA {tag}"
    )))
    .execute(&mut admin)
    .await?;
    admin.close().await?;
    let options = options
        .options([("search_path", tag.as_str())])
        .application_name(&tag);
    let pool = PgPoolOptions::new()
        .max_connections(pool_size)
        .connect_with(options.clone())
        .await?;
    idempo::migrate(&pool).await?;
    payments::create_tables(&pool).await?;
    if diag("no-notify") {
        sqlx::query("ALTER TABLE outbox DISABLE TRIGGER outbox_notify")
            .execute(&pool)
            .await?;
    }
    let connection = Connection::connect(&amqp_url, ConnectionProperties::default())
        .await
        .with_context(|| format!("RabbitMQ at {amqp_url}"))?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(Bench {
        pool,
        options,
        tag,
        amqp_url,
        queue_type: queue_type(),
        channel,
        connection,
        queues: Mutex::default(),
    })
}

/// A payment body of about 50 bytes.
fn body(i: u64) -> Vec<u8> {
    format!(
        r#"{{"account":"acct-{:02}","amount_cents":{:>8}}}"#,
        i % 50,
        1 + i % 9_999
    )
    .into_bytes()
}

impl Bench {
    /// Declares a durable queue of the bench's type (deleted at cleanup).
    async fn declare(&self, queue: &str) -> anyhow::Result<()> {
        let mut args = FieldTable::default();
        let kind = match self.queue_type {
            QueueType::Quorum => "quorum",
            _ => "classic",
        };
        args.insert("x-queue-type".into(), AMQPValue::LongString(kind.into()));
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        self.channel
            .queue_declare(queue.into(), durable, args)
            .await?;
        self.forget_later(queue);
        Ok(())
    }

    fn forget_later(&self, queue: &str) {
        self.queues.lock().unwrap().push(queue.to_owned());
    }

    /// Publishes `messages` payments (ids `pay-0`, …) into `queue`, confirmed.
    async fn fill(&self, queue: &str, messages: u64) -> anyhow::Result<()> {
        for i in 0..messages {
            let properties = BasicProperties::default()
                .with_message_id(format!("pay-{i}").as_str().into())
                .with_delivery_mode(2);
            let confirm = self
                .channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    &body(i),
                    properties,
                )
                .await?;
            drop(confirm); // confirmed all at once below
        }
        self.channel.wait_for_confirms().await?;
        Ok(())
    }

    /// How many messages `queue` holds.
    async fn depth(&self, queue: &str) -> anyhow::Result<u32> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let q = self
            .channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await?;
        Ok(q.message_count())
    }

    /// `pg_total_relation_size('outbox')`, in bytes.
    async fn outbox_size(&self) -> anyhow::Result<f64> {
        let size: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('outbox')")
            .fetch_one(&self.pool)
            .await?;
        Ok(size as f64)
    }

    /// Samples, every 50 ms on a connection of its own (not counted), how
    /// many PostgreSQL connections the variant holds; the task returns the
    /// peak once `stop` fires.
    fn sample_connections(
        &self,
        stop: Arc<tokio::sync::Notify>,
    ) -> JoinHandle<anyhow::Result<i64>> {
        let options = self
            .options
            .clone()
            .application_name(&format!("{}_sampler", self.tag));
        let tag = self.tag.clone();
        tokio::spawn(async move {
            let mut conn = sqlx::PgConnection::connect_with(&options).await?;
            let mut peak = 0;
            let stopped = stop.notified();
            tokio::pin!(stopped);
            loop {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                )
                .bind(&tag)
                .fetch_one(&mut conn)
                .await?;
                peak = peak.max(n);
                tokio::select! {
                    () = &mut stopped => break,
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
            conn.close().await?;
            Ok(peak)
        })
    }

    async fn cleanup(&self) {
        let queues = self.queues.lock().unwrap().clone();
        for queue in queues {
            let _ = self
                .channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.tag
        )))
        .execute(&self.pool)
        .await;
        let _ = self.connection.close(200, "bench done".into()).await;
    }
}

/// Waits until `condition` holds, polling every `every`.
async fn poll_until<F, Fut>(every: Duration, mut condition: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + WAIT_AT_MOST;
    while !condition().await? {
        anyhow::ensure!(Instant::now() < deadline, "gave up after {WAIT_AT_MOST:?}");
        tokio::time::sleep(every).await;
    }
    Ok(())
}

async fn pending(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(outbox::OutboxStatus::read(pool).await?.pending)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn run_variant(variant: &str) -> anyhow::Result<Figures> {
    let pool_size = match variant {
        // Staging transactions in flight at 1,000/s (the relay has its own pool).
        "latency" => 8,
        // As the payments example: concurrency + 2.
        v if v.starts_with("payments") => 18,
        _ => 4,
    };
    let bench = setup(variant, pool_size).await?;
    let stop_sampling = Arc::new(tokio::sync::Notify::new());
    let sampler = bench.sample_connections(stop_sampling.clone());
    let result = match variant {
        "lapin-confirmed" => lapin_confirmed(&bench).await,
        "relay-drain" => relay_drain(&bench).await,
        "latency" => latency(&bench).await,
        "lapin-forwarder" => lapin_forwarder(&bench).await,
        v if v.starts_with("payments") => payments_consumer(&bench, v).await,
        other => Err(anyhow::anyhow!("no variant {other}")),
    };
    let result = match result {
        Ok(mut figures) => {
            figures.variant = variant.to_owned();
            stop_sampling.notify_one();
            let peak = sampler.await??;
            figures
                .extra
                .insert("pg_connections_peak".into(), peak as f64);
            let batches = RELAY_BATCHES.load(Ordering::Relaxed);
            if batches > 0 {
                figures.extra.insert("relay_batches".into(), batches as f64);
                figures.extra.insert(
                    "relay_rows_per_batch".into(),
                    RELAY_BATCH_ROWS.load(Ordering::Relaxed) as f64 / batches as f64,
                );
            }
            Ok(figures)
        }
        Err(e) => Err(e),
    };
    bench.cleanup().await;
    result
}

/// Awaits publisher confirms; anything but a plain ack is an error.
async fn all_acked(confirms: Vec<lapin::PublisherConfirm>) -> anyhow::Result<()> {
    for confirm in confirms {
        match confirm.await? {
            Confirmation::Ack(None) => {}
            other => anyhow::bail!("not confirmed: {other:?}"),
        }
    }
    Ok(())
}

fn backlog_rows() -> u64 {
    env_u64("BENCH_OUTBOX_ROWS", 100_000)
}

/// Part 1, baseline: a hand-written confirmed publisher, one channel, batches
/// of 500 published back to back and then their confirms awaited together.
async fn lapin_confirmed(bench: &Bench) -> anyhow::Result<Figures> {
    let rows = backlog_rows();
    let queue = format!("{}_target", bench.tag);
    bench.declare(&queue).await?;
    let bodies: Vec<(String, Vec<u8>)> = (0..rows).map(|i| (format!("b-{i}"), body(i))).collect();
    let channel = bench.connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let started = Instant::now();
    for chunk in bodies.chunks(BASELINE_BATCH) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for (id, body) in chunk {
            let properties = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2);
            confirms.push(
                channel
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        mandatory,
                        body,
                        properties,
                    )
                    .await?,
            );
        }
        all_acked(confirms).await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let depth = bench.depth(&queue).await?;
    anyhow::ensure!(
        u64::from(depth) == rows,
        "the queue holds {depth} of {rows}"
    );
    Ok(Figures {
        messages: rows,
        seconds,
        ..Figures::default()
    })
}

/// Stages `rows` messages for `queue`, one row each (`stage` per message:
/// `stage_all` would pack a chunk into one row), 1,000 per transaction.
async fn stage_backlog(bench: &Bench, queue: &str, prefix: &str, rows: u64) -> anyhow::Result<f64> {
    let started = Instant::now();
    for start in (0..rows).step_by(STAGE_CHUNK as usize) {
        let mut tx = bench.pool.begin().await?;
        for i in start..(start + STAGE_CHUNK).min(rows) {
            let message = OutboxMessage::new("", queue, body(i))
                .message_id(format!("{prefix}-{i}"))
                .content_type("application/json");
            outbox::stage(&mut tx, message).await?;
        }
        tx.commit().await?;
    }
    Ok(started.elapsed().as_secs_f64())
}

fn relay_batch() -> usize {
    env_u64("BENCH_RELAY_BATCH", 500) as usize
}

/// Starts a relay, waits until it published `rows` more and the outbox has
/// nothing pending, stops it; returns the seconds from its start.
async fn drain_with_relay(bench: &Bench, rows: u64) -> anyhow::Result<f64> {
    let relay = Relay::new(&bench.amqp_url, bench.pool.clone())?.batch_size(relay_batch());
    let (stop, health) = (relay.shutdown_handle(), relay.health());
    let started = Instant::now();
    let task = tokio::spawn(relay.run());
    tokio::time::timeout(
        WAIT_AT_MOST,
        health.wait_for(|s| s.published + s.failed >= rows),
    )
    .await
    .context("the relay did not publish the backlog")?;
    // The instant the outbox itself says so (the relay's counter comes first,
    // so this polls once or twice).
    poll_until(Duration::from_millis(2), || async {
        Ok(pending(&bench.pool).await? == 0)
    })
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    stop.shutdown();
    task.await??;
    let snapshot = health.snapshot();
    anyhow::ensure!(snapshot.failed == 0, "the relay failed rows: {snapshot:?}");
    Ok(seconds)
}

/// Part 1: the relay drains a backlog staged before it starts (the timed
/// figure); then the table's size over three more backlogs through the same
/// table: one with no VACUUM since the first drain, two with a plain VACUUM
/// after each drain (standing in for autovacuum).
async fn relay_drain(bench: &Bench) -> anyhow::Result<Figures> {
    let rows = backlog_rows();
    let queue = format!("{}_target", bench.tag);
    bench.declare(&queue).await?;
    let mut extra = BTreeMap::new();
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(&bench.pool)
        .await?;
    extra.insert(
        "autovacuum_on".into(),
        f64::from(u8::from(autovacuum == "on")),
    );
    extra.insert("size_empty".into(), bench.outbox_size().await?);
    let mut seconds = 0.0;
    for round in 1..=4 {
        let staged = stage_backlog(bench, &queue, &format!("r{round}"), rows).await?;
        extra.insert(format!("stage_rows_per_s_{round}"), rows as f64 / staged);
        extra.insert(format!("size_backlog_{round}"), bench.outbox_size().await?);
        let drained = drain_with_relay(bench, rows).await?;
        extra.insert(format!("drain_seconds_{round}"), drained);
        extra.insert(format!("size_drained_{round}"), bench.outbox_size().await?);
        if round == 1 {
            seconds = drained;
        }
        if round >= 2 {
            sqlx::raw_sql("VACUUM outbox").execute(&bench.pool).await?;
            extra.insert(format!("size_vacuumed_{round}"), bench.outbox_size().await?);
        }
    }
    let depth = bench.depth(&queue).await?;
    anyhow::ensure!(
        u64::from(depth) == 4 * rows,
        "the queue holds {depth} of {}",
        4 * rows
    );
    Ok(Figures {
        messages: rows,
        seconds,
        extra,
        ..Figures::default()
    })
}

/// Part 2: one message per staging transaction at a steady 1,000/s; per
/// message, commit returned → delivered to a consumer of the target queue.
async fn latency(bench: &Bench) -> anyhow::Result<Figures> {
    let count = PACED_RATE * PACED_FOR.as_secs();
    let queue = format!("{}_target", bench.tag);
    bench.declare(&queue).await?;

    // The relay on a pool of its own, so that staging cannot starve it.
    let relay_pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(bench.options.clone())
        .await?;
    let relay = Relay::new(&bench.amqp_url, relay_pool)?.batch_size(relay_batch());
    let (stop, health) = (relay.shutdown_handle(), relay.health());
    let relay_task = tokio::spawn(relay.run());
    tokio::time::timeout(
        Duration::from_secs(30),
        health.wait_for(|s| s.state == RelayState::Running),
    )
    .await
    .context("the relay did not start")?;
    // Idle: its first (empty) batch done and LISTEN in place.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let arrivals: Arc<Mutex<Vec<Option<Instant>>>> =
        Arc::new(Mutex::new(vec![None; count as usize]));
    let commits: Arc<Mutex<Vec<Option<Instant>>>> =
        Arc::new(Mutex::new(vec![None; count as usize]));
    let consume = bench.connection.create_channel().await?;
    let mut deliveries = consume
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let consumer = {
        let arrivals = arrivals.clone();
        tokio::spawn(async move {
            let mut seen = 0;
            while seen < count {
                let Some(delivery) = deliveries.next().await else {
                    anyhow::bail!("the consumer stopped");
                };
                let delivery = delivery?;
                let at = Instant::now();
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|id| id.as_str().strip_prefix("l-")?.parse::<usize>().ok())
                    .context("a message without a bench id")?;
                let mut arrivals = arrivals.lock().unwrap();
                if arrivals[id].is_none() {
                    arrivals[id] = Some(at);
                    seen += 1;
                }
            }
            Ok(())
        })
    };

    let start = tokio::time::Instant::now();
    let mut stagers = tokio::task::JoinSet::new();
    for i in 0..count {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / PACED_RATE as f64))
            .await;
        let (pool, commits, queue) = (bench.pool.clone(), commits.clone(), queue.clone());
        stagers.spawn(async move {
            let message = OutboxMessage::new("", queue, body(i))
                .message_id(format!("l-{i}"))
                .content_type("application/json");
            let mut tx = pool.begin().await?;
            outbox::stage(&mut tx, message).await?;
            tx.commit().await?;
            commits.lock().unwrap()[i as usize] = Some(Instant::now());
            anyhow::Ok(())
        });
    }
    while let Some(staged) = stagers.join_next().await {
        staged??;
    }
    let staging_seconds = start.elapsed().as_secs_f64();
    tokio::time::timeout(Duration::from_secs(60), consumer)
        .await
        .context("not every message arrived")???;
    stop.shutdown();
    relay_task.await??;

    let commits = commits.lock().unwrap().clone();
    let arrivals = arrivals.lock().unwrap().clone();
    let mut latencies: Vec<f64> = commits
        .iter()
        .zip(&arrivals)
        .map(|(c, a)| {
            let (c, a) = (c.expect("committed"), a.expect("arrived"));
            // Signed: a delivery may beat the commit's reply to its stager.
            match a.checked_duration_since(c) {
                Some(d) => d.as_secs_f64() * 1e3,
                None => -(c.duration_since(a).as_secs_f64() * 1e3),
            }
        })
        .collect();
    latencies.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mut extra = BTreeMap::new();
    extra.insert("p50_ms".into(), percentile(&latencies, 0.5));
    extra.insert("p90_ms".into(), percentile(&latencies, 0.9));
    extra.insert("p99_ms".into(), percentile(&latencies, 0.99));
    extra.insert("max_ms".into(), percentile(&latencies, 1.0));
    extra.insert("min_ms".into(), percentile(&latencies, 0.0));
    extra.insert("staged_per_s".into(), count as f64 / staging_seconds);
    Ok(Figures {
        messages: count,
        seconds: staging_seconds,
        extra,
        ..Figures::default()
    })
}

/// Part 3: the payments consumer over a pre-filled input queue, with or
/// without one forwarded (staged) message per payment.
async fn payments_consumer(bench: &Bench, variant: &str) -> anyhow::Result<Figures> {
    let messages = env_u64("BENCH_MESSAGES", 50_000);
    let forward = variant.ends_with("-forward");
    let batch = variant.contains("batch500").then_some(500usize);
    let input = bench.tag.clone();
    let forward_queue = format!("{}_forward", bench.tag);
    for q in [&input, &forward_queue] {
        bench.forget_later(q);
        bench.forget_later(&format!("{q}.dlq"));
        for delay in ["1s", "5s", "30s", "2m", "10m"] {
            bench.forget_later(&format!("{q}.retry.{delay}"));
        }
    }
    let behaviour = payments::Behaviour {
        fail_rate: 0.0,
        forward_to: forward.then(|| forward_queue.as_str().into()),
    };
    let build = || {
        let mut builder = Consumer::builder(bench.amqp_url.clone(), bench.pool.clone())
            .queue(input.clone())
            .queue_type(bench.queue_type)
            .redelivery(RedeliveryPolicy::default())
            .prefetch(if batch.is_some() { 1500 } else { 100 })
            .concurrency(16)
            .relay(!diag("no-relay"));
        if forward {
            builder = builder.declare_like_own(forward_queue.clone());
        }
        let behaviour = behaviour.clone();
        match batch {
            Some(size) => builder
                .batch_handler(move |tx, batch| {
                    payments::handle_batch(tx, batch, behaviour.clone())
                })
                .batch(size)
                .build(),
            None => builder
                .handler(move |tx, message| payments::handle(tx, message, behaviour.clone()))
                .build(),
        }
    };

    // Let the runtime declare its topology once, then fill the input queue.
    topology::declare_once(build()?).await?;
    bench.fill(&input, messages).await?;

    // Every run starts its timed phase right after a checkpoint, so that none
    // of them pays for one (full-page images) that another does not.
    if let Err(e) = sqlx::query("CHECKPOINT").execute(&bench.pool).await {
        eprintln!("CHECKPOINT refused ({e}): runs may differ by a checkpoint");
    }
    let consumer = build()?;
    let (stop, health, stats) = (
        consumer.shutdown_handle(),
        consumer.health(),
        consumer.stats(),
    );
    let task = tokio::spawn(consumer.run());
    health.wait_for(|h| h.is_consuming()).await;
    let started = Instant::now();
    poll_until(Duration::from_millis(2), || async {
        Ok(stats.snapshot().processed >= messages)
    })
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    let mut extra = BTreeMap::new();
    if forward && !diag("no-relay") {
        poll_until(Duration::from_millis(2), || async {
            Ok(pending(&bench.pool).await? == 0)
        })
        .await?;
        extra.insert(
            "outbox_empty_seconds".into(),
            started.elapsed().as_secs_f64(),
        );
    }
    stop.shutdown();
    task.await??;
    let s = stats.snapshot();
    anyhow::ensure!(
        s.processed == messages && s.retried == 0 && s.dead_lettered == 0,
        "unexpected outcome: {s:?}"
    );
    if forward && !diag("no-relay") {
        let depth = bench.depth(&forward_queue).await?;
        anyhow::ensure!(
            u64::from(depth) == messages,
            "the forward queue holds {depth} of {messages}"
        );
        extra.insert("forwarded".into(), f64::from(depth));
    }
    Ok(Figures {
        messages,
        seconds,
        extra,
        ..Figures::default()
    })
}

/// Part 3's ceiling: what the broker alone allows for consuming and
/// forwarding one message per delivery, with no database at all. A lapin
/// consumer (prefetch 1500, as the batch consumer) takes 500 deliveries,
/// publishes a copy of each (`mandatory`, persistent, its message id) to a
/// forward queue of the same type, awaits the 500 confirms, then acks the
/// 500 at once. No implementation of forwarding can beat this on the same
/// broker: it is the bound for `payments-*-forward`.
async fn lapin_forwarder(bench: &Bench) -> anyhow::Result<Figures> {
    let messages = env_u64("BENCH_MESSAGES", 50_000);
    let input = format!("{}_in", bench.tag);
    let forward = format!("{}_forward", bench.tag);
    bench.declare(&input).await?;
    bench.declare(&forward).await?;
    bench.fill(&input, messages).await?;
    let consuming = bench.connection.create_channel().await?;
    consuming
        .basic_qos(1500, BasicQosOptions::default())
        .await?;
    let publishing = bench.connection.create_channel().await?;
    publishing
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let mut deliveries = consuming
        .basic_consume(
            input.as_str().into(),
            "forwarder".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let started = Instant::now();
    let mut forwarded = 0;
    while forwarded < messages {
        let want = (messages - forwarded).min(BASELINE_BATCH as u64);
        let mut confirms = Vec::with_capacity(want as usize);
        let mut last = None;
        for _ in 0..want {
            let delivery = deliveries.next().await.context("consumer ended")??;
            let properties = BasicProperties::default()
                .with_message_id(
                    delivery
                        .properties
                        .message_id()
                        .clone()
                        .context("no message id")?,
                )
                .with_content_type("application/json".into())
                .with_delivery_mode(2);
            confirms.push(
                publishing
                    .basic_publish(
                        "".into(),
                        forward.as_str().into(),
                        mandatory,
                        &delivery.data,
                        properties,
                    )
                    .await?,
            );
            last = Some(delivery);
        }
        all_acked(confirms).await?;
        let last = last.expect("at least one delivery");
        last.acker.ack(BasicAckOptions { multiple: true }).await?;
        forwarded += want;
    }
    let seconds = started.elapsed().as_secs_f64();
    let depth = bench.depth(&forward).await?;
    anyhow::ensure!(
        u64::from(depth) == messages,
        "the forward queue holds {depth} of {messages}"
    );
    Ok(Figures {
        messages,
        seconds,
        ..Figures::default()
    })
}
