//! Sustained, not burst: the `payments` workload published at a fixed rate
//! for tens of minutes while retention runs, against a PostgreSQL with
//! production settings (autovacuum on). Minutes long: not part of `cargo test`.
//!
//! ```text
//! cargo bench --bench sustained                               # per-message, 30 min
//! SUSTAINED_MODE=batch cargo bench --bench sustained          # batch mode
//! SUSTAINED_FORWARD=1 cargo bench --bench sustained           # + an outbox forward per payment
//! ```
//!
//! Environment:
//! - `SUSTAINED_MODE`: `per-message` (concurrency 16, the default) or `batch` (batches of 500).
//! - `SUSTAINED_MINUTES` (30), `SUSTAINED_RETENTION` (`5m`: several horizons pass).
//! - `SUSTAINED_RETENTION_MODE`: `partitioned` (the default: retention by
//!   DETACH/DROP PARTITION) or `plain` (the batched `DELETE` reaper).
//! - `SUSTAINED_RATE`: messages offered per second; by default the burst rate
//!   measured first in the same run (a prefilled queue drained into the fresh table).
//! - `SUSTAINED_BURST`: messages of that burst (default 60,000; 300,000 in batch mode).
//! - `SUSTAINED_FORWARD=1`: each payment also stages a forward through the
//!   outbox (the relay publishes it to a capped queue): the outbox table under
//!   sustained forwarding.
//! - `SUSTAINED_CONSUMER`: `idempo`, `hand` or `both` (the default): `hand`
//!   is the hand-written loop of `support/hand.rs` (per-message, concurrency
//!   16, claims in a table of its own trimmed by a `DELETE` reaper every 5 s).
//!   `both` runs idempo, then the hand loop on a queue of its own, at the
//!   same offered rate (the first burst's, or `SUSTAINED_RATE`) from the same
//!   publisher, and compares the two: sustained rates, and how flat each is
//!   after the first horizon (the last 5 minutes ÷ the first 5). The hand loop
//!   has no batch mode and no forward.
//! - `SUSTAINED_DATABASE_URL`: a PostgreSQL to use. Without it the bench
//!   starts a cluster of its own, `idempo_sustained` on port 5499
//!   (`pg_createcluster`, trust auth, autovacuum on, shared_buffers 1GB), because
//!   the shared test server runs with autovacuum off. A database
//!   `sustained` is created afresh in it for every run.
//! - `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`).
//!
//! Every minute it prints, and at the end writes to
//! `target/sustained-<mode>-<retention mode>[-forward].json` (the hand loop's
//! to `target/sustained-per-message-hand.json`): offered and achieved
//! rates, the backlog, claim latency p50/p99 (a probe claims a fresh id every
//! 20 ms beside the load: `begin_claim` + `commit`), the size of
//! `processed_messages` (heap and indexes, all partitions), its dead tuples,
//! WAL bytes per claim, the oldest claim against the horizon, and with
//! forwarding the outbox's size and oldest pending row.

#[path = "support/hand.rs"]
#[allow(dead_code)]
mod hand;
#[path = "../examples/common/payments.rs"]
#[allow(dead_code)]
mod payments;
#[path = "support/topology.rs"]
mod topology;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use idempo::amqp::{Consumer, QueueType};
use idempo::consumer::RedeliveryPolicy;
use idempo::inbox::partitioned::Partitioning;
use idempo::inbox::{self, Begun};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const OWN_PORT: u16 = 5499;
const OWN_CLUSTER: &str = "idempo_sustained";

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One minute of the run.
#[derive(Debug, Clone, Serialize)]
struct Minute {
    minute: u32,
    offered_per_sec: f64,
    achieved_per_sec: f64,
    backlog: u32,
    claim_p50_ms: f64,
    claim_p99_ms: f64,
    table_bytes: i64,
    dead_tuples: i64,
    wal_bytes_per_claim: f64,
    oldest_claim_secs: f64,
    oldest_over_horizon: f64,
    partitions: i64,
    outbox_bytes: Option<i64>,
    outbox_pending: Option<i64>,
    outbox_oldest_secs: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    mode: String,
    /// `idempo` or `hand`.
    consumer: String,
    retention_mode: String,
    retention_secs: f64,
    burst_per_sec: f64,
    offered_per_sec: f64,
    minutes: Vec<Minute>,
}

/// Which consumer a run measures.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Idempo,
    Hand,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Idempo => "idempo",
            Kind::Hand => "hand",
        }
    }
}

/// What every run shares.
struct Setup {
    mode: String,
    batch: Option<usize>,
    retention_mode: String,
    partitioned_mode: bool,
    partitioning: Partitioning,
    minutes: u32,
    retention: Duration,
    burst: u64,
    forward: bool,
    amqp_url: String,
    pool: PgPool,
    channel: lapin::Channel,
    /// Ids go on across runs: no run's message is another's duplicate.
    next_id: Arc<AtomicU64>,
}

/// A consumer at work: what it settled so far, and how to stop it.
struct Running {
    settled: Box<dyn Fn() -> u64 + Send + Sync>,
    task: tokio::task::JoinHandle<()>,
    stop: Box<dyn FnOnce() + Send>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // `cargo bench` passes --bench; a filter is not used here.
    let mode: String = env_or("SUSTAINED_MODE", "per-message".to_string());
    let batch = match mode.as_str() {
        "per-message" => None,
        "batch" => Some(500usize),
        other => bail!("SUSTAINED_MODE={other}: per-message or batch"),
    };
    let retention_mode: String = env_or("SUSTAINED_RETENTION_MODE", "partitioned".to_string());
    let partitioned_mode = match retention_mode.as_str() {
        "partitioned" => true,
        "plain" => false,
        other => bail!("SUSTAINED_RETENTION_MODE={other}: partitioned or plain"),
    };
    let forward = env_or("SUSTAINED_FORWARD", 0u8) == 1;
    let kinds = match env_or("SUSTAINED_CONSUMER", "both".to_string()).as_str() {
        "idempo" => vec![Kind::Idempo],
        "hand" => vec![Kind::Hand],
        "both" => vec![Kind::Idempo, Kind::Hand],
        other => bail!("SUSTAINED_CONSUMER={other}: idempo, hand or both"),
    };
    if kinds.contains(&Kind::Hand) && (batch.is_some() || forward) {
        bail!(
            "the hand-written loop is per-message without forwarding: \
             set SUSTAINED_CONSUMER=idempo with SUSTAINED_MODE=batch or SUSTAINED_FORWARD=1"
        );
    }
    let minutes: u32 = env_or("SUSTAINED_MINUTES", 30);
    let retention = humantime::parse_duration(&env_or("SUSTAINED_RETENTION", "5m".to_string()))
        .context("SUSTAINED_RETENTION")?;
    let burst: u64 = env_or(
        "SUSTAINED_BURST",
        if batch.is_some() { 300_000 } else { 60_000 },
    );
    let amqp_url: String = env_or(
        "AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f".to_string(),
    );
    let database_url = match std::env::var("SUSTAINED_DATABASE_URL") {
        Ok(url) => url,
        Err(_) => own_cluster()?,
    };
    let pool = PgPoolOptions::new()
        .max_connections(24)
        .connect(&database_url)
        .await
        .with_context(|| format!("cannot connect to {}", idempo::redact_url(&database_url)))?;
    idempo::migrate(&pool).await?;
    payments::create_tables(&pool).await?;
    sqlx::raw_sql(hand::OWN_CLAIMS_TABLE).execute(&pool).await?;
    // Partitions of a sixteenth of the horizon: a claim is retired at most
    // 1/16 of the horizon (plus one maintenance interval) after it expires.
    let partitioning = Partitioning::new().period(retention / 16);
    if partitioned_mode {
        partitioning.switch(&pool, Some(retention)).await?;
    }
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(&pool)
        .await?;
    println!(
        "sustained: mode {mode}, retention {} ({retention_mode}), {minutes} min, forward {forward}, \
         autovacuum {autovacuum}",
        humantime::format_duration(retention)
    );
    let connection = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let setup = Setup {
        mode,
        batch,
        retention_mode,
        partitioned_mode,
        partitioning,
        minutes,
        retention,
        burst,
        forward,
        amqp_url,
        pool,
        channel,
        next_id: Arc::new(AtomicU64::new(0)),
    };
    let mut rate: Option<f64> = std::env::var("SUSTAINED_RATE")
        .ok()
        .and_then(|v| v.parse().ok());
    let mut reports = Vec::new();
    for kind in kinds {
        reports.push(sustain(&setup, kind, &mut rate).await?);
    }
    if let [idempo, hand] = &reports[..] {
        compare(idempo, hand);
    }
    let _ = connection.close(200, "done".into()).await;
    Ok(())
}

/// The idempo consumer of this run's mode, on `queue`.
fn idempo_consumer(setup: &Setup, queue: &str, forward_queue: &str) -> idempo::Result<Consumer> {
    let mut builder = Consumer::builder(setup.amqp_url.clone(), setup.pool.clone())
        .queue(queue)
        .queue_type(QueueType::Quorum)
        .prefetch(if setup.batch.is_some() { 1_000 } else { 32 })
        .concurrency(16)
        .redelivery(RedeliveryPolicy::requeue(Duration::from_millis(100)))
        .retention(setup.retention)
        .retention_interval(Duration::from_secs(5));
    if setup.partitioned_mode {
        builder = builder.partitioned(setup.partitioning);
    }
    let behaviour = payments::Behaviour {
        fail_rate: 0.0,
        forward_to: setup.forward.then(|| forward_queue.into()),
    };
    match setup.batch {
        Some(size) => builder
            .batch_handler(move |tx, b| payments::handle_batch(tx, b, behaviour.clone()))
            .batch(size)
            .build(),
        None => builder
            .handler(move |tx, m| payments::handle(tx, m, behaviour.clone()))
            .build(),
    }
}

/// Starts the `kind` consumer on `queue` (declared already).
async fn start(
    setup: &Setup,
    kind: Kind,
    queue: &str,
    forward_queue: &str,
) -> anyhow::Result<Running> {
    match kind {
        Kind::Idempo => {
            let consumer = idempo_consumer(setup, queue, forward_queue)?;
            let stats = consumer.stats();
            let shutdown = consumer.shutdown_handle();
            let task = tokio::spawn(async move {
                if let Err(e) = consumer.run().await {
                    eprintln!("the consumer stopped: {e}");
                }
            });
            Ok(Running {
                settled: Box::new(move || {
                    let s = stats.snapshot();
                    s.processed + s.duplicates
                }),
                task,
                stop: Box::new(move || shutdown.shutdown()),
            })
        }
        Kind::Hand => {
            let connection =
                Connection::connect(&setup.amqp_url, ConnectionProperties::default()).await?;
            let channel = connection.create_channel().await?;
            channel.basic_qos(32, BasicQosOptions::default()).await?;
            let deliveries = channel
                .basic_consume(
                    queue.into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            let done = Arc::new(AtomicU64::new(0));
            let (pool, counted) = (setup.pool.clone(), done.clone());
            let task = tokio::spawn(async move {
                let consumed = hand::per_message(
                    deliveries,
                    pool,
                    hand::CLAIM_IN_OWN_TABLE,
                    counted,
                    |_| async {},
                );
                if let Err(e) = consumed.await {
                    eprintln!("the hand-written consumer stopped: {e}");
                }
                let _ = connection.close(200, "done".into()).await;
            });
            let reaper = tokio::spawn(hand::reap(
                setup.pool.clone(),
                setup.retention,
                Duration::from_secs(5),
            ));
            let abort = task.abort_handle();
            Ok(Running {
                settled: Box::new(move || done.load(Ordering::Relaxed)),
                task,
                stop: Box::new(move || {
                    reaper.abort();
                    abort.abort();
                }),
            })
        }
    }
}

/// A claim of the probe: one fresh id claimed and committed alone.
async fn probe_claim(pool: &PgPool, partitioned: bool, kind: Kind, id: &str) -> bool {
    let inbox = inbox::Inbox::new("sustained-probe").partitioned(partitioned);
    match kind {
        Kind::Idempo => match inbox.begin(pool, id, b"{}").await {
            Ok(Begun::Fresh(tx)) => inbox.commit(tx, id).await.is_ok(),
            _ => false,
        },
        Kind::Hand => {
            let claimed = async {
                let mut tx = pool.begin().await?;
                sqlx::query(hand::CLAIM_IN_OWN_TABLE)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await
            };
            claimed.await.is_ok()
        }
    }
}

/// One run: the burst, then `minutes` at the offered rate (`rate`, set by
/// the first burst unless given).
async fn sustain(setup: &Setup, kind: Kind, rate: &mut Option<f64>) -> anyhow::Result<Report> {
    let queue = format!(
        "sustained-{}-{}-{}",
        setup.mode,
        kind.name(),
        std::process::id()
    );
    let forward_queue = format!("{queue}.forwarded");
    let channel = &setup.channel;
    let (claims_table, retention_mode) = match kind {
        Kind::Idempo => ("processed_messages", setup.retention_mode.clone()),
        Kind::Hand => ("hand_claims", "delete-reaper".to_string()),
    };
    match kind {
        Kind::Idempo => {
            // The forwards land in a capped queue nobody reads.
            declare(
                channel,
                &forward_queue,
                &[("x-max-length", AMQPValue::LongLongInt(10_000))],
            )
            .await?;
            // The runtime declares its topology once, then the queue is filled.
            topology::declare_once(idempo_consumer(setup, &queue, &forward_queue)?).await?;
        }
        Kind::Hand => {
            declare(
                channel,
                &queue,
                &[("x-queue-type", AMQPValue::LongString("quorum".into()))],
            )
            .await?;
        }
    }

    // Burst: a prefilled queue drained into the fresh table.
    let published = Arc::new(AtomicU64::new(0));
    let next_id = setup.next_id.clone();
    publish_n(channel, &queue, &next_id, setup.burst).await?;
    published.fetch_add(setup.burst, Ordering::Relaxed);
    let running = start(setup, kind, &queue, &forward_queue).await?;
    let settled = &running.settled;
    let started = Instant::now();
    while settled() < setup.burst {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if running.task.is_finished() {
            bail!("the {} consumer stopped", kind.name());
        }
        if started.elapsed() > Duration::from_secs(1800) {
            bail!("the burst did not drain in 30 minutes");
        }
    }
    let burst_rate = setup.burst as f64 / started.elapsed().as_secs_f64();
    let rate = *rate.get_or_insert(burst_rate.round());
    println!(
        "{}: burst of {} messages in {:.1?}: {burst_rate:.0}/s; offering {rate:.0}/s",
        kind.name(),
        setup.burst,
        started.elapsed()
    );
    // Sustained: publish `rate` per second in ticks of 100 ms, 2 % of them twice.
    let publisher = {
        let (channel, queue, next_id, published) = (
            channel.clone(),
            queue.clone(),
            next_id.clone(),
            published.clone(),
        );
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            let start = Instant::now();
            let mut sent = 0u64;
            loop {
                tick.tick().await;
                let due = (start.elapsed().as_secs_f64() * rate) as u64;
                let n = due.saturating_sub(sent);
                if n > 0 {
                    if let Err(e) = publish_n(&channel, &queue, &next_id, n).await {
                        eprintln!("publish failed: {e}");
                        return;
                    }
                    sent += n;
                    published.fetch_add(n, Ordering::Relaxed);
                }
            }
        })
    };
    let latencies = Arc::new(std::sync::Mutex::new(Vec::<f64>::new()));
    let probe = {
        let (pool, partitioned, latencies) = (
            setup.pool.clone(),
            setup.partitioned_mode,
            latencies.clone(),
        );
        tokio::spawn(async move {
            let mut n = 0u64;
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            loop {
                tick.tick().await;
                n += 1;
                let id = format!("probe-{}-{}-{n}", kind.name(), std::process::id());
                let t = Instant::now();
                if probe_claim(&pool, partitioned, kind, &id).await {
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    latencies.lock().unwrap().push(ms);
                }
            }
        })
    };

    let mut report = Report {
        mode: setup.mode.clone(),
        consumer: kind.name().to_string(),
        retention_mode,
        retention_secs: setup.retention.as_secs_f64(),
        burst_per_sec: burst_rate,
        offered_per_sec: rate,
        minutes: Vec::new(),
    };
    println!("{}:", kind.name());
    println!(
        "{:>3} {:>9} {:>9} {:>8} {:>7} {:>7} {:>10} {:>9} {:>8} {:>8} {:>5} {:>10} {:>8}",
        "min",
        "offered/s",
        "achieved/s",
        "backlog",
        "p50 ms",
        "p99 ms",
        "table MB",
        "dead tup",
        "WAL B/cl",
        "oldest/h",
        "parts",
        "outbox MB",
        "outbox age"
    );
    let mut last = (
        Instant::now(),
        published.load(Ordering::Relaxed),
        settled(),
        wal(&setup.pool).await?,
    );
    for minute in 1..=setup.minutes {
        tokio::time::sleep(Duration::from_secs(60)).await;
        let now = (
            Instant::now(),
            published.load(Ordering::Relaxed),
            settled(),
            wal(&setup.pool).await?,
        );
        let secs = now.0.duration_since(last.0).as_secs_f64();
        let claims = now.2.saturating_sub(last.2);
        let mut lat = std::mem::take(&mut *latencies.lock().unwrap());
        lat.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
                .copied()
                .unwrap_or(f64::NAN)
        };
        let (table_bytes, dead_tuples, partitions) = table(&setup.pool, claims_table).await?;
        let oldest: f64 = match kind {
            Kind::Idempo => sqlx::query_scalar(
                "SELECT coalesce(extract(epoch FROM now() - min(processed_at)), 0)::float8 \
                 FROM processed_messages WHERE consumer = $1",
            )
            .bind(&queue),
            // The hand loop's table holds its claims (and the probe's) only.
            Kind::Hand => sqlx::query_scalar(
                "SELECT coalesce(extract(epoch FROM now() - min(processed_at)), 0)::float8 \
                 FROM hand_claims",
            ),
        }
        .fetch_one(&setup.pool)
        .await?;
        let (outbox_bytes, outbox_pending, outbox_oldest) = if setup.forward {
            let (bytes, _, _) = table(&setup.pool, "outbox").await?;
            let status = idempo::outbox::OutboxStatus::read(&setup.pool).await?;
            (
                Some(bytes),
                Some(status.pending),
                Some(status.oldest_pending_age.map_or(0.0, |d| d.as_secs_f64())),
            )
        } else {
            (None, None, None)
        };
        let row = Minute {
            minute,
            offered_per_sec: now.1.saturating_sub(last.1) as f64 / secs,
            achieved_per_sec: claims as f64 / secs,
            backlog: backlog(channel, &queue).await,
            claim_p50_ms: pct(0.50),
            claim_p99_ms: pct(0.99),
            table_bytes,
            dead_tuples,
            wal_bytes_per_claim: (now.3 - last.3) as f64 / claims.max(1) as f64,
            oldest_claim_secs: oldest,
            oldest_over_horizon: oldest / setup.retention.as_secs_f64(),
            partitions,
            outbox_bytes,
            outbox_pending,
            outbox_oldest_secs: outbox_oldest,
        };
        println!(
            "{:>3} {:>9.0} {:>9.0} {:>8} {:>7.2} {:>7.2} {:>10.1} {:>9} {:>8.0} {:>8.2} {:>5} {:>10} {:>8}",
            row.minute,
            row.offered_per_sec,
            row.achieved_per_sec,
            row.backlog,
            row.claim_p50_ms,
            row.claim_p99_ms,
            row.table_bytes as f64 / 1e6,
            row.dead_tuples,
            row.wal_bytes_per_claim,
            row.oldest_over_horizon,
            row.partitions,
            row.outbox_bytes
                .map_or("-".into(), |b| format!("{:.1}", b as f64 / 1e6)),
            row.outbox_oldest_secs
                .map_or("-".into(), |s| format!("{s:.1}s")),
        );
        report.minutes.push(row);
        last = now;
    }
    publisher.abort();
    probe.abort();
    (running.stop)();
    let _ = tokio::time::timeout(Duration::from_secs(60), running.task).await;
    // A backlog left in the queue would weigh on the next run's broker.
    let _ = channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    summarize(&report);
    let path = format!(
        "{}/target/sustained-{}-{}{}.json",
        env!("CARGO_MANIFEST_DIR"),
        setup.mode,
        report.retention_mode,
        match (kind, setup.forward) {
            (Kind::Hand, _) => "",
            (Kind::Idempo, true) => "-forward",
            (Kind::Idempo, false) => "",
        }
    );
    std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    println!("figures: {path}");
    Ok(report)
}

/// Both consumers side by side: the sustained rates (minutes after the
/// first), and each one's last 5 minutes ÷ its first 5 after the first horizon.
fn compare(idempo: &Report, hand: &Report) {
    let (a, b) = (steady_rate(idempo), steady_rate(hand));
    println!(
        "sustained at {:.0}/s offered: idempo {a:.0}/s, hand-written {b:.0}/s: {:.2}x [target >= 1.0]",
        idempo.offered_per_sec,
        a / b
    );
    for r in [idempo, hand] {
        match flatness(r) {
            Some((first, last)) => println!(
                "{}: after the first horizon, the first 5 minutes {first:.0}/s, the last 5 {last:.0}/s: {:.2}x [target >= 0.95]",
                r.consumer,
                last / first
            ),
            None => println!(
                "{}: too short for flatness (the first horizon and 10 minutes after it)",
                r.consumer
            ),
        }
    }
}

/// The mean achieved rate, the first minute left out.
fn steady_rate(r: &Report) -> f64 {
    let steady: Vec<f64> = r
        .minutes
        .iter()
        .skip(1)
        .map(|m| m.achieved_per_sec)
        .collect();
    steady.iter().sum::<f64>() / steady.len().max(1) as f64
}

/// The mean achieved rate of the first 5 and of the last 5 minutes after the
/// first horizon.
fn flatness(r: &Report) -> Option<(f64, f64)> {
    let horizon_min = (r.retention_secs / 60.0).ceil().max(1.0) as usize;
    let after: Vec<f64> = r
        .minutes
        .iter()
        .skip(horizon_min)
        .map(|m| m.achieved_per_sec)
        .collect();
    if after.len() < 10 {
        return None;
    }
    let mean = |m: &[f64]| m.iter().sum::<f64>() / m.len() as f64;
    Some((mean(&after[..5]), mean(&after[after.len() - 5..])))
}

/// The issue's three targets, read off the minutes.
fn summarize(r: &Report) {
    let horizon_min = (r.retention_secs / 60.0).ceil().max(1.0) as usize;
    let at = |m: usize| r.minutes.get(m.saturating_sub(1));
    let (Some(first_horizon), Some(end), Some(two)) = (at(horizon_min), r.minutes.last(), at(2))
    else {
        println!("too short for the targets");
        return;
    };
    let steady: Vec<&Minute> = r.minutes.iter().skip(1).collect();
    let achieved =
        steady.iter().map(|m| m.achieved_per_sec).sum::<f64>() / steady.len().max(1) as f64;
    let worst_oldest = r
        .minutes
        .iter()
        .skip(horizon_min)
        .map(|m| m.oldest_over_horizon)
        .fold(0.0, f64::max);
    println!(
        "sustained rate {achieved:.0}/s = {:.2}x the burst ({:.0}/s) [target >= 0.9]",
        achieved / r.burst_per_sec,
        r.burst_per_sec
    );
    println!("oldest claim at most {worst_oldest:.2}x the horizon after the first [target <= 1.1]");
    println!(
        "processed_messages {:.1} MB at minute {} vs {:.1} MB at the end of the first horizon: {:.2}x [target <= 1.2]",
        end.table_bytes as f64 / 1e6,
        end.minute,
        first_horizon.table_bytes as f64 / 1e6,
        end.table_bytes as f64 / first_horizon.table_bytes.max(1) as f64
    );
    println!(
        "claim p99 {:.2} ms at minute {} vs {:.2} ms at minute 2: {:.2}x [target <= 1.5]",
        end.claim_p99_ms,
        end.minute,
        two.claim_p99_ms,
        end.claim_p99_ms / two.claim_p99_ms
    );
    if let (Some(a), Some(b)) = (first_horizon.outbox_bytes, end.outbox_bytes) {
        println!(
            "outbox {:.1} MB at minute {} vs {:.1} MB at the end of the first horizon: {:.2}x; oldest pending {:.1} s",
            b as f64 / 1e6,
            end.minute,
            a as f64 / 1e6,
            b as f64 / a.max(1) as f64,
            end.outbox_oldest_secs.unwrap_or(0.0)
        );
    }
}

/// Heap and indexes of `table` and of all its partitions, their dead tuples,
/// and how many partitions.
async fn table(pool: &PgPool, table: &str) -> anyhow::Result<(i64, i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT coalesce(sum(pg_total_relation_size(t.relid)), 0)::int8, \
                coalesce(sum(s.n_dead_tup), 0)::int8, \
                (count(*) FILTER (WHERE t.isleaf AND t.level > 0))::int8 \
         FROM (SELECT relid, isleaf, level FROM pg_partition_tree($1::regclass) \
               UNION SELECT $1::regclass, true, 0) t \
         LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid",
    )
    .bind(table)
    .fetch_one(pool)
    .await?)
}

async fn wal(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8")
            .fetch_one(pool)
            .await?,
    )
}

async fn backlog(channel: &lapin::Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_or(0, |q| q.message_count())
}

async fn declare(
    channel: &lapin::Channel,
    queue: &str,
    args: &[(&str, AMQPValue)],
) -> anyhow::Result<()> {
    let mut table = FieldTable::default();
    for (k, v) in args {
        table.insert((*k).into(), v.clone());
    }
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            table,
        )
        .await?;
    Ok(())
}

/// Publishes `n` payments (ids from `next_id`; every 50th published twice),
/// then waits for the broker's confirms.
async fn publish_n(
    channel: &lapin::Channel,
    queue: &str,
    next_id: &AtomicU64,
    n: u64,
) -> anyhow::Result<()> {
    let mut confirms = Vec::with_capacity(n as usize);
    let mut left = n;
    while left > 0 {
        let i = next_id.fetch_add(1, Ordering::Relaxed);
        let body = format!("{{\"account\":\"acc-{}\",\"amount_cents\":1}}", i % 1_000);
        let copies = if i.is_multiple_of(50) && left > 1 {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let properties = BasicProperties::default()
                .with_message_id(format!("s-{i}").into())
                .with_delivery_mode(2);
            confirms.push(
                channel
                    .basic_publish(
                        "".into(),
                        queue.into(),
                        BasicPublishOptions::default(),
                        body.as_bytes(),
                        properties,
                    )
                    .await?,
            );
            left -= 1;
        }
    }
    for confirm in confirms {
        confirm.await?;
    }
    Ok(())
}

/// The bench's own PostgreSQL (autovacuum on), created and started if needed.
fn own_cluster() -> anyhow::Result<String> {
    let url = format!("postgres://postgres@127.0.0.1:{OWN_PORT}/sustained");
    let version = std::fs::read_dir("/etc/postgresql")
        .context("no /etc/postgresql: set SUSTAINED_DATABASE_URL")?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .max()
        .context("no PostgreSQL version in /etc/postgresql")?;
    let exists = std::path::Path::new(&format!("/etc/postgresql/{version}/{OWN_CLUSTER}")).exists();
    if !exists {
        run(Command::new("pg_createcluster").args([
            &version,
            OWN_CLUSTER,
            "--port",
            &OWN_PORT.to_string(),
            "-o",
            "autovacuum=on",
            "-o",
            "shared_buffers=1GB",
            "-o",
            "max_wal_size=4GB",
            "-o",
            "max_connections=200",
            "--",
            "--auth=trust",
        ]))?;
    }
    let _ = Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, OWN_CLUSTER, "start"])
        .status();
    for _ in 0..30 {
        if std::net::TcpStream::connect(("127.0.0.1", OWN_PORT)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let psql = |sql: &str| {
        run(Command::new("psql").args([
            "-h",
            "127.0.0.1",
            "-p",
            &OWN_PORT.to_string(),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-qc",
            sql,
        ]))
    };
    psql("DROP DATABASE IF EXISTS sustained WITH (FORCE)")?;
    psql("CREATE DATABASE sustained")?;
    Ok(url)
}

fn run(command: &mut Command) -> anyhow::Result<()> {
    let status = command.status().with_context(|| format!("{command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok(())
}
