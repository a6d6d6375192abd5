//! Throughput of exactly-once consumption, against the local RabbitMQ and
//! PostgreSQL, with hand-written baselines measured in the same run.
//!
//! ```text
//! cargo bench --bench throughput
//! ```
//!
//! Environment: `BENCH_MESSAGES` (default 20000 per variant),
//! `BENCH_QUEUE_TYPE` (`quorum`, the default, or `classic`), `AMQP_URL`,
//! `DATABASE_URL`. Each variant runs in a child process of its own, so that
//! its peak RSS is its own. See BENCHMARKS.md for what each variant does.
//!
//! Round trips: each variant's pool reaches PostgreSQL through a counting
//! proxy of its own (`tests/support/pg_trips.rs`, TLS off, TCP `DATABASE_URL` only)
//! that reads the server's messages during the pre-filled drain (phase 1),
//! after the connections' start-up. Per message settled in that window
//! (per duplicate for g; empty for a, which has no database):
//! - `trips/msg`: round trips on the delivery's path: what the client sent
//!   between two answers of the server, however many messages it pipelined
//!   in one flight (BEGIN with the claim counts once), minus the pings
//!   below. It includes sqlx's preparation of each new statement, once per
//!   statement per connection, a round trip of its own: small over thousands
//!   of messages (`prepares_per_msg` in the JSON figures).
//! - `stmts/msg`: statements executed (CommandComplete), BEGIN and COMMIT included.
//! - `pings/msg`: round trips with a Sync and no Execute, sqlx's pool's
//!   health check: one when it takes a connection back (with the ROLLBACK
//!   of a dropped transaction queued before it), one when it hands out an
//!   idle one (`test_before_acquire`). The pool's, not the caller's.
//!
//! `BENCH_PG_RTT_MS=N` makes the proxy hold each answer of PostgreSQL back N
//! ms: a database on another host (a round trip of N ms), where round trips
//! rather than CPU decide how fast a consumer goes.
//!
//! `BENCH_COUNT_TRIPS=0` connects directly instead (no proxy hop, to compare
//! throughput with and without it) and leaves those columns empty.

#[path = "support/cpu.rs"]
mod cpu;
#[path = "support/hand.rs"]
#[allow(dead_code)]
mod hand;
#[path = "support/otlp_sink.rs"]
mod otlp_sink;
#[path = "../examples/common/payments.rs"]
#[allow(dead_code)]
mod payments;
#[path = "../tests/support/pg_trips.rs"]
mod pg_trips;
#[path = "support/topology.rs"]
mod topology;

use std::process::Command;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use idempo::amqp::{Consumer, QueueType};
use idempo::consumer::RedeliveryPolicy;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use tokio::sync::Mutex;

const VARIANTS: &[&str] = &[
    "a:raw-consume",
    "b:hand-tx-loop-c16",
    "c:hand-article-c16",
    "d:hand-batch-loop",
    "e:idempo-c1",
    "e:idempo-c16",
    "e:idempo-c64",
    "f:idempo-batch100",
    "f:idempo-batch500",
    "g:idempo-duplicates-c16",
    // Feature `otel`: e:idempo-c16 with its spans exported over OTLP.
    "h:idempo-traced-c16",
];

/// Paced phase for latency: this many messages per second, for this long.
const PACED_RATE: u64 = 500;
const PACED_FOR: Duration = Duration::from_secs(2);

#[derive(Debug, Serialize, Deserialize)]
struct Figures {
    variant: String,
    messages: u64,
    seconds: f64,
    p50_ms: f64,
    p99_ms: f64,
    peak_rss_mib: f64,
    /// Phase 1's wire, per message (see the top of the file); `None` for a
    /// or with `BENCH_COUNT_TRIPS=0`.
    trips_per_msg: Option<f64>,
    stmts_per_msg: Option<f64>,
    pings_per_msg: Option<f64>,
    prepares_per_msg: Option<f64>,
    db_errors: Option<u64>,
    /// Phase 1's CPU per message, by process (`support/cpu.rs`).
    #[serde(default)]
    cpu: cpu::PerMessage,
}

impl Figures {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.seconds
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--variant") {
        let variant = args.get(i + 1).context("--variant NAME")?.clone();
        #[cfg(feature = "otel")]
        let telemetry = otlp_sink::install()?;
        let runtime = tokio::runtime::Runtime::new()?;
        let figures = runtime.block_on(run_variant(&variant))?;
        #[cfg(feature = "otel")]
        if let Some(telemetry) = telemetry {
            telemetry.shutdown();
        }
        println!("FIGURES {}", serde_json::to_string(&figures)?);
        return Ok(());
    }
    // `cargo bench` passes `--bench`; any other word filters the variants.
    let filter: Vec<&String> = args[1..].iter().filter(|a| !a.starts_with("--")).collect();
    let exe = std::env::current_exe()?;
    let mut results = Vec::new();
    let mut sink = None;
    for variant in VARIANTS {
        if !filter.is_empty() && !filter.iter().any(|f| variant.contains(f.as_str())) {
            continue;
        }
        let traced = variant.contains("traced");
        if traced && !cfg!(feature = "otel") {
            eprintln!("skipping {variant}: built without feature otel (--features otel)");
            continue;
        }
        eprintln!("running {variant} ...");
        let mut command = Command::new(&exe);
        command.args(["--variant", variant]);
        for name in [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        ] {
            command.env_remove(name);
        }
        if traced {
            let sink = match &mut sink {
                Some(sink) => sink,
                None => sink.insert(otlp_sink::Sink::start()?),
            };
            command.env("OTEL_EXPORTER_OTLP_ENDPOINT", &sink.endpoint);
        }
        let out = command.output()?;
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
        results.push(serde_json::from_str::<Figures>(line)?);
    }
    report(&results);
    if let Some(sink) = &sink {
        let (requests, bytes) = sink.taken();
        let rate = |prefix: &str| {
            results
                .iter()
                .find(|r| r.variant.starts_with(prefix))
                .map(Figures::rate)
        };
        if let (Some(traced), Some(plain)) = (rate("h:"), rate("e:idempo-c16")) {
            println!(
                "\ntraced / untraced (h / e:idempo-c16): {:.3}× ({:+.1}%); the collector took {requests} requests, {:.1} MiB",
                traced / plain,
                (traced / plain - 1.0) * 100.0,
                bytes as f64 / 1048576.0
            );
        }
    }
    Ok(())
}

fn report(results: &[Figures]) {
    let queue_type = std::env::var("BENCH_QUEUE_TYPE").unwrap_or_else(|_| "quorum".into());
    println!(
        "\nqueue type: {queue_type}; latency = delivery received -> business writes done, under a paced load of {PACED_RATE} msg/s{}\n",
        match std::env::var("BENCH_PG_RTT_MS") {
            Ok(ms) => format!("; PostgreSQL round trip time + {ms} ms (BENCH_PG_RTT_MS)"),
            Err(_) => String::new(),
        }
    );
    println!(
        "| variant | msg/s | p50 ms | p99 ms | peak RSS MiB | vs a | vs b | vs c | vs d | trips/msg | stmts/msg | pings/msg |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let baseline = |prefix: &str| {
        results
            .iter()
            .find(|r| r.variant.starts_with(prefix))
            .map(Figures::rate)
    };
    let bases = ["a:", "b:", "c:", "d:"].map(baseline);
    for r in results {
        let ratios: Vec<String> = bases
            .iter()
            .map(|b| match b {
                Some(b) if r.variant.contains("idempo") => format!("{:.2}×", r.rate() / b),
                _ => String::new(),
            })
            .collect();
        let wire: Vec<String> = [r.trips_per_msg, r.stmts_per_msg, r.pings_per_msg]
            .iter()
            .map(|f| f.map_or_else(String::new, |f| format!("{f:.2}")))
            .collect();
        println!(
            "| {} | {:.0} | {:.1} | {:.1} | {:.0} | {} | {} |",
            r.variant,
            r.rate(),
            r.p50_ms,
            r.p99_ms,
            r.peak_rss_mib,
            ratios.join(" | "),
            wire.join(" | ")
        );
        if let Some(errors) = r.db_errors.filter(|e| *e > 0) {
            eprintln!("{}: {errors} database errors in phase 1", r.variant);
        }
    }
    println!(
        "\nCPU µs per message in phase 1 (consumer: this process{}; PG backends: the pool's; PG all: every postgres process; broker: the node on the AMQP port)\n",
        if std::env::var("BENCH_COUNT_TRIPS").as_deref() == Ok("0") {
            ""
        } else {
            ", the counting proxy included"
        }
    );
    println!("| variant | consumer | PG backends | PG all | broker | total |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in results {
        let c = r.cpu;
        let cell = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v:.0}"));
        let total = [c.consumer_us, c.postgres_us, c.broker_us]
            .iter()
            .map(|v| v.unwrap_or(0.0))
            .sum::<f64>();
        println!(
            "| {} | {} | {} | {} | {} | {:.0} |",
            r.variant,
            cell(c.consumer_us),
            cell(c.backends_us),
            cell(c.postgres_us),
            cell(c.broker_us),
            total
        );
    }
}

/// What every variant shares: a schema, a queue, and a way to publish.
struct Bench {
    pool: PgPool,
    queue: String,
    amqp_url: String,
    queue_type: QueueType,
    publisher: Channel,
    _connection: Connection,
    latencies: Arc<Mutex<Vec<f64>>>,
    /// The proxy `pool` goes through (not the setup's `admin` pool).
    proxy: Option<pg_trips::Proxy>,
    /// A pool outside the measured one, for reading `pg_stat_activity`.
    admin: PgPool,
    /// The measured pool's `application_name`: it names its backends.
    tag: String,
    /// The RabbitMQ node's pid, for its CPU.
    broker_pid: Option<String>,
}

/// Phase 1, the pre-filled drain: how long it took, how many messages
/// settled in it, and what the server sent meanwhile.
struct Drain {
    seconds: f64,
    messages: u64,
    wire: Option<pg_trips::Counts>,
    cpu: cpu::PerMessage,
}

async fn setup(variant: &str, pool_size: u32) -> anyhow::Result<Bench> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let tag = format!(
        "bench_{}_{}",
        variant.replace([':', '-'], "_"),
        std::process::id()
    );
    let admin = PgPool::connect(&database_url)
        .await
        .with_context(|| format!("PostgreSQL at {database_url}"))?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {tag} CASCADE; "
    )))
    .execute(&admin)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {tag}")))
        .execute(&admin)
        .await?;
    let mut options: PgConnectOptions = database_url.parse()?;
    let mut proxy = None;
    if std::env::var("BENCH_COUNT_TRIPS").as_deref() != Ok("0") {
        let upstream = format!("{}:{}", options.get_host(), options.get_port());
        let rtt: u64 = std::env::var("BENCH_PG_RTT_MS")
            .ok()
            .map(|ms| ms.parse())
            .transpose()
            .context("BENCH_PG_RTT_MS must be a whole number of milliseconds")?
            .unwrap_or(0);
        let started = pg_trips::Proxy::start(upstream, Duration::from_millis(rtt)).await?;
        options = options
            .host(&started.addr.ip().to_string())
            .port(started.addr.port())
            .ssl_mode(PgSslMode::Disable);
        proxy = Some(started);
    }
    let pool = PgPoolOptions::new()
        .max_connections(pool_size)
        .connect_with(
            options
                .options([("search_path", tag.as_str())])
                .application_name(&tag),
        )
        .await?;
    idempo::migrate(&pool).await?;
    payments::create_tables(&pool).await?;
    sqlx::query(
        "CREATE TABLE article_processed (message_id text PRIMARY KEY, status text NOT NULL, \
         updated_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&pool)
    .await?;
    let connection = Connection::connect(&amqp_url, ConnectionProperties::default())
        .await
        .with_context(|| format!("RabbitMQ at {amqp_url}"))?;
    let publisher = connection.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let queue_type = match std::env::var("BENCH_QUEUE_TYPE").as_deref() {
        Ok("classic") => QueueType::Classic,
        _ => QueueType::Quorum,
    };
    let broker_pid = lapin::uri::AMQPUri::from_str(&amqp_url)
        .ok()
        .and_then(|uri| cpu::listener_pid(uri.authority.port));
    Ok(Bench {
        pool,
        queue: tag.clone(),
        admin,
        tag,
        broker_pid,
        amqp_url,
        queue_type,
        publisher,
        _connection: connection,
        latencies: Arc::default(),
        proxy,
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
    fn wire(&self) -> Option<pg_trips::Counts> {
        self.proxy.as_ref().map(pg_trips::Proxy::counts)
    }

    fn wire_since(&self, before: Option<pg_trips::Counts>) -> Option<pg_trips::Counts> {
        Some(self.wire()? - before?)
    }

    async fn cpu(&self) -> cpu::Ticks {
        cpu::sample(&self.admin, &self.tag, self.broker_pid.as_deref()).await
    }

    /// Declares the queue as idempo would (so both kinds of consumer use the same type).
    async fn declare(&self) -> anyhow::Result<()> {
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
        self.publisher
            .queue_declare(self.queue.as_str().into(), durable, args)
            .await?;
        Ok(())
    }

    /// Publishes `count` payments with ids `prefix-n`, confirmed.
    async fn publish(&self, prefix: &str, count: u64, paced: bool) -> anyhow::Result<()> {
        let start = Instant::now();
        for i in 0..count {
            if paced {
                let due = start + Duration::from_secs_f64(i as f64 / PACED_RATE as f64);
                tokio::time::sleep_until(due.into()).await;
            }
            let properties = BasicProperties::default()
                .with_message_id(format!("{prefix}-{i}").as_str().into())
                .with_delivery_mode(2);
            let confirm = self
                .publisher
                .basic_publish(
                    "".into(),
                    self.queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &body(i),
                    properties,
                )
                .await?;
            drop(confirm); // confirmed all at once below
        }
        self.publisher.wait_for_confirms().await?;
        Ok(())
    }

    /// Records received → now (the business writes are done).
    async fn record_latency(latencies: &Mutex<Vec<f64>>, received: Instant) {
        latencies
            .lock()
            .await
            .push(received.elapsed().as_secs_f64() * 1e3);
    }

    async fn cleanup(&self) {
        let _ = self
            .publisher
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        for suffix in [
            ".dlq",
            ".retry.1s",
            ".retry.5s",
            ".retry.30s",
            ".retry.2m",
            ".retry.10m",
        ] {
            let _ = self
                .publisher
                .queue_delete(
                    format!("{}{suffix}", self.queue).as_str().into(),
                    QueueDeleteOptions::default(),
                )
                .await;
        }
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.queue
        )))
        .execute(&self.pool)
        .await;
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

async fn run_variant(variant: &str) -> anyhow::Result<Figures> {
    let messages: u64 = std::env::var("BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let messages = if variant.ends_with("-c1") {
        messages / 4
    } else {
        messages
    };
    let bench = setup(variant, 70).await?;
    let paced = PACED_RATE * PACED_FOR.as_secs();

    // Phase 1: a pre-filled queue, consumed as fast as the variant can.
    // Phase 2: a paced load, for latency.
    let duplicates = variant.contains("duplicates");
    let drain = if variant.contains("idempo") {
        run_idempo(&bench, variant, messages, paced, duplicates).await?
    } else {
        bench.declare().await?;
        run_hand_written(&bench, variant, messages, paced).await?
    };
    let mut latencies = bench.latencies.lock().await.clone();
    latencies.sort_by(|a, b| a.partial_cmp(b).unwrap());
    bench.cleanup().await;
    let wire = drain.wire.filter(|_| !variant.starts_with("a:"));
    let per_message = |count: fn(&pg_trips::Counts) -> u64| {
        wire.map(|w| count(&w) as f64 / drain.messages.max(1) as f64)
    };
    Ok(Figures {
        variant: variant.to_owned(),
        messages,
        seconds: drain.seconds,
        p50_ms: percentile(&latencies, 0.5),
        p99_ms: percentile(&latencies, 0.99),
        peak_rss_mib: peak_rss_mib(),
        trips_per_msg: per_message(|w| w.flights - w.ping_flights),
        stmts_per_msg: per_message(|w| w.complete),
        pings_per_msg: per_message(|w| w.ping_flights),
        prepares_per_msg: per_message(|w| w.parsed),
        db_errors: wire.map(|w| w.errors),
        cpu: drain.cpu,
    })
}

/// Runs an idempo consumer over a pre-filled queue, then a paced load;
/// returns what the pre-filled part took.
async fn run_idempo(
    bench: &Bench,
    variant: &str,
    messages: u64,
    paced: u64,
    duplicates: bool,
) -> anyhow::Result<Drain> {
    let concurrency = if variant.ends_with("-c1") {
        1
    } else if variant.ends_with("-c64") {
        64
    } else {
        16
    };
    let batch = variant
        .split("batch")
        .nth(1)
        .and_then(|n| n.parse::<usize>().ok());
    let build = || {
        let latencies = bench.latencies.clone();
        let builder = Consumer::builder(bench.amqp_url.clone(), bench.pool.clone())
            .queue(bench.queue.clone())
            .queue_type(bench.queue_type)
            .redelivery(RedeliveryPolicy::default())
            .prefetch(
                (concurrency as u16 * 2)
                    .max(100)
                    .max(batch.unwrap_or(0) as u16 * 3),
            )
            .concurrency(concurrency);
        match batch {
            Some(size) => builder
                .batch_handler(
                    move |tx,
                          batch: Vec<(
                        idempo::consumer::JsonBody<payments::Payment>,
                        idempo::consumer::Message,
                    )>| {
                        let latencies = latencies.clone();
                        async move {
                            let received: Vec<Instant> =
                                batch.iter().map(|(_, m)| m.received_at()).collect();
                            payments::handle_batch(tx, batch, 0.0).await?;
                            for r in received {
                                Bench::record_latency(&latencies, r).await;
                            }
                            Ok(())
                        }
                    },
                )
                .batch(size)
                .build(),
            None => builder
                .handler(
                    move |tx,
                          (payment, message): (
                        idempo::consumer::JsonBody<payments::Payment>,
                        idempo::consumer::Message,
                    )| {
                        let latencies = latencies.clone();
                        async move {
                            payments::apply(tx, message.id(), &payment.0, 0.0).await?;
                            Bench::record_latency(&latencies, message.received_at()).await;
                            Ok(())
                        }
                    },
                )
                .build(),
        }
    };

    // Let the runtime declare its topology once, then fill the queue.
    topology::declare_once(build()?).await?;
    let prefix = if duplicates { "dup" } else { "t" };
    if duplicates {
        let ids: Vec<String> = (0..messages).map(|i| format!("dup-{i}")).collect();
        let hashes: Vec<Vec<u8>> = (0..messages)
            .map(|i| idempo::inbox::Inbox::payload_sha256(&body(i)).to_vec())
            .collect();
        sqlx::query(
            "INSERT INTO processed_messages (consumer, message_id, payload_sha256) \
             SELECT $1, * FROM unnest($2::text[], $3::bytea[])",
        )
        .bind(&bench.queue)
        .bind(&ids)
        .bind(&hashes)
        .execute(&bench.pool)
        .await?;
    }
    bench.publish(prefix, messages, false).await?;

    let consumer = build()?;
    let (stop, health, stats) = (
        consumer.shutdown_handle(),
        consumer.health(),
        consumer.stats(),
    );
    let task = tokio::spawn(consumer.run());
    health.wait_for(|h| h.is_consuming()).await;
    let settled = || {
        let s = stats.snapshot();
        s.processed + s.duplicates
    };
    let (wire_before, settled_before, cpu_before) = (bench.wire(), settled(), bench.cpu().await);
    let started = Instant::now();
    while settled() < messages {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let settled_now = settled() - settled_before;
    let drain = Drain {
        seconds,
        messages: settled_now,
        wire: bench.wire_since(wire_before),
        cpu: cpu::per_message(cpu_before, bench.cpu().await, settled_now),
    };
    if !duplicates {
        bench.publish("p", paced, true).await?;
        while settled() < messages + paced {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    stop.shutdown();
    task.await??;
    Ok(drain)
}

/// Runs a hand-written consumer over a pre-filled queue, then a paced load.
async fn run_hand_written(
    bench: &Bench,
    variant: &str,
    messages: u64,
    paced: u64,
) -> anyhow::Result<Drain> {
    bench.publish("t", messages, false).await?;
    let connection = Connection::connect(&bench.amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let prefetch = if variant.starts_with("d:") || variant.starts_with("a:") {
        1000
    } else {
        100
    };
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            bench.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let done = Arc::new(AtomicU64::new(0));
    let wire_before = bench.wire();
    let cpu_before = bench.cpu().await;
    let started = Instant::now();
    let worker = {
        let (pool, latencies, done, variant) = (
            bench.pool.clone(),
            bench.latencies.clone(),
            done.clone(),
            variant.to_owned(),
        );
        tokio::spawn(async move {
            match &variant[..2] {
                "a:" => raw(consumer, latencies, done).await,
                "b:" => {
                    let written = move |received| {
                        let latencies = latencies.clone();
                        async move { Bench::record_latency(&latencies, received).await }
                    };
                    hand::per_message(
                        consumer,
                        pool,
                        hand::CLAIM_IN_PROCESSED_MESSAGES,
                        done,
                        written,
                    )
                    .await
                }
                "c:" => article(consumer, pool, latencies, done).await,
                _ => batch_loop(consumer, pool, latencies, done).await,
            }
        })
    };
    while done.load(Ordering::Relaxed) < messages {
        anyhow::ensure!(!worker.is_finished(), "the {variant} consumer stopped");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let settled = done.load(Ordering::Relaxed);
    let drain = Drain {
        seconds,
        messages: settled,
        wire: bench.wire_since(wire_before),
        cpu: cpu::per_message(cpu_before, bench.cpu().await, settled),
    };
    bench.publish("p", paced, true).await?;
    while done.load(Ordering::Relaxed) < messages + paced {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    worker.abort();
    let _ = connection.close(200, "bench done".into()).await;
    Ok(drain)
}

/// (a) The ceiling: consume and acknowledge in groups of 100, no database.
async fn raw(
    mut consumer: lapin::Consumer,
    latencies: Arc<Mutex<Vec<f64>>>,
    done: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let mut n = 0u64;
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery?;
        let received = Instant::now();
        Bench::record_latency(&latencies, received).await;
        n += 1;
        if n.is_multiple_of(100) {
            delivery
                .acker
                .ack(BasicAckOptions { multiple: true })
                .await?;
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// (c, `article`) The article's algorithm at concurrency 16: SELECT
/// completed?, BEGIN, INSERT processing, work, UPDATE completed, COMMIT, ack.
/// (b, the careful loop, is `hand::per_message`.)
async fn article(
    consumer: lapin::Consumer,
    pool: PgPool,
    latencies: Arc<Mutex<Vec<f64>>>,
    done: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    hand::each_delivery(consumer, move |delivery, received| {
        let (pool, latencies, done) = (pool.clone(), latencies.clone(), done.clone());
        async move {
            let id = hand::message_id(&delivery);
            let p: payments::Payment = serde_json::from_slice(&delivery.data)?;
            let status: Option<String> = sqlx::query_scalar("SELECT status FROM article_processed WHERE message_id = $1")
                .bind(&id)
                .fetch_optional(&pool)
                .await?;
            if status.as_deref() != Some("completed") {
                let mut tx = pool.begin().await?;
                sqlx::query("INSERT INTO article_processed (message_id, status) VALUES ($1, 'processing') ON CONFLICT DO NOTHING")
                    .bind(&id)
                    .execute(&mut *tx)
                    .await?;
                hand::write_payment(&mut tx, &id, &p).await?;
                Bench::record_latency(&latencies, received).await;
                sqlx::query("UPDATE article_processed SET status = 'completed', updated_at = now() WHERE message_id = $1")
                    .bind(&id)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
            }
            delivery.acker.ack(BasicAckOptions::default()).await?;
            done.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    })
    .await
}

/// (d) The hand-written single-loop batch consumer: collect up to 500 or
/// 5 ms, BEGIN, claim all with unnest RETURNING, ONE bulk insert, ONE grouped
/// balance upsert, COMMIT, one multiple-ack.
async fn batch_loop(
    mut consumer: lapin::Consumer,
    pool: PgPool,
    latencies: Arc<Mutex<Vec<f64>>>,
    done: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    loop {
        let Some(first) = consumer.next().await else {
            return Ok(());
        };
        let mut batch = vec![first?];
        let mut received = vec![Instant::now()];
        let deadline = tokio::time::Instant::now() + Duration::from_millis(5);
        while batch.len() < 500 {
            match tokio::time::timeout_at(deadline, consumer.next()).await {
                Ok(Some(d)) => {
                    batch.push(d?);
                    received.push(Instant::now());
                }
                _ => break,
            }
        }
        let ids: Vec<String> = batch.iter().map(hand::message_id).collect();
        let decode = |i: usize| Ok(serde_json::from_slice(&batch[i].data)?);
        let written = async {
            for r in &received {
                Bench::record_latency(&latencies, *r).await;
            }
        };
        hand::apply_batch(&pool, &ids, decode, written).await?;
        let last = batch.last().expect("a batch has a first delivery");
        last.acker.ack(BasicAckOptions { multiple: true }).await?;
        done.fetch_add(batch.len() as u64, Ordering::Relaxed);
    }
}
