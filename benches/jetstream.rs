//! idempo on JetStream against a hand-written JetStream consume-claim-commit
//! loop, in the same run, against the local NATS server and PostgreSQL.
//!
//! ```text
//! cargo bench --bench jetstream --features nats
//! ```
//!
//! Environment: `BENCH_MESSAGES` (default 10000 per variant), `NATS_URL`,
//! `DATABASE_URL`. Each variant gets a fresh stream, pre-filled with the
//! payments (each with its `Nats-Msg-Id`), and a fresh schema; the clock
//! runs from the consumer's start until every payment is applied. Rounds
//! alternate the order of the variants (`BENCH_ROUNDS`, default 3) and the
//! medians are reported.
//!
//! Variants, both sides with a durable pull consumer, explicit acks
//! confirmed by the server (double ack), `max_ack_pending` 100 (300 in
//! batch mode):
//! - `hand-c16`: per message, 16 at once: `BEGIN`, the claim (`INSERT … ON
//!   CONFLICT DO NOTHING` in `processed_messages`), the payment's two
//!   writes, `COMMIT`, then the ack (`benches/support/hand.rs`'s `apply`);
//! - `idempo-c16`: `idempo::nats::Consumer` with the `payments` example's
//!   handler, concurrency 16;
//! - `hand-batch100`: up to 100 messages within 5 ms: `BEGIN`, the claims
//!   with one `unnest … RETURNING`, one bulk insert, one grouped balance
//!   upsert, `COMMIT`, then the acks;
//! - `idempo-batch100`: the example's batch handler, batches of 100.

#[path = "support/hand.rs"]
#[allow(dead_code)]
mod hand;
#[path = "../examples/common/payments.rs"]
#[allow(dead_code)]
mod payments;

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use idempo::nats::async_nats;
use idempo::nats::async_nats::jetstream::{self, consumer::pull};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::Semaphore;

const VARIANTS: &[&str] = &["hand-c16", "idempo-c16", "hand-batch100", "idempo-batch100"];

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let messages: usize = env_or("BENCH_MESSAGES", "10000").parse()?;
    let rounds: usize = env_or("BENCH_ROUNDS", "3").parse()?;
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let variants: Vec<&str> = VARIANTS
        .iter()
        .copied()
        .filter(|v| args.is_empty() || args.iter().any(|a| v.contains(a.as_str())))
        .collect();
    let client = async_nats::connect(env_or("NATS_URL", "nats://127.0.0.1:4222"))
        .await
        .context("NATS (start nats-server -js)")?;
    let js = jetstream::new(client);
    let mut rates: Vec<(&str, Vec<f64>)> = variants.iter().map(|v| (*v, Vec::new())).collect();
    for round in 0..rounds {
        let mut order = variants.clone();
        if round % 2 == 1 {
            order.reverse();
        }
        for variant in order {
            let seconds = run(&js, variant, messages).await?;
            let rate = messages as f64 / seconds;
            println!("round {round} {variant:>16}: {messages} in {seconds:.2} s = {rate:.0} msg/s");
            rates
                .iter_mut()
                .find(|(v, _)| *v == variant)
                .unwrap()
                .1
                .push(rate);
        }
    }
    println!();
    let median = |name: &str| {
        let mut r = rates
            .iter()
            .find(|(v, _)| *v == name)
            .map(|(_, r)| r.clone())?;
        r.sort_by(f64::total_cmp);
        r.get(r.len() / 2).copied()
    };
    for variant in &variants {
        println!(
            "{variant:>16}: median {:.0} msg/s",
            median(variant).unwrap_or(0.0)
        );
    }
    for (ours, hand) in [
        ("idempo-c16", "hand-c16"),
        ("idempo-batch100", "hand-batch100"),
    ] {
        if let (Some(a), Some(b)) = (median(ours), median(hand)) {
            println!("{ours} / {hand}: {:.2}x", a / b);
        }
    }
    Ok(())
}

/// One variant on a fresh stream and schema; the seconds until every
/// payment is applied.
async fn run(js: &jetstream::Context, variant: &str, n: usize) -> anyhow::Result<f64> {
    let stream = format!("bench_{}_{}", variant.replace('-', "_"), std::process::id());
    let _ = js.delete_stream(&stream).await;
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![stream.clone()],
        ..Default::default()
    })
    .await?;
    let mut acks = Vec::with_capacity(n);
    for i in 0..n {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("pay-{i}").as_str());
        let body = serde_json::to_vec(&serde_json::json!({
            "account": format!("acct-{}", i % 100),
            "amount_cents": (i % 1000) as i64 + 1,
        }))?;
        acks.push(
            js.publish_with_headers(stream.clone(), headers, body.into())
                .await?,
        );
        if acks.len() == 1000 {
            for ack in acks.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in acks {
        ack.await?;
    }
    let (pool, schema) = fresh_schema().await?;
    let started = Instant::now();
    let done = Arc::new(AtomicU64::new(0));
    let worker = match variant {
        "idempo-c16" | "idempo-batch100" => {
            let builder = idempo::nats::Consumer::builder(
                env_or("NATS_URL", "nats://127.0.0.1:4222"),
                pool.clone(),
            )
            .stream(&stream)
            .relay(false);
            let consumer = if variant == "idempo-c16" {
                builder
                    .prefetch(100)
                    .concurrency(16)
                    .handler(|tx, m| payments::handle(tx, m, payments::Behaviour::default()))
                    .build()?
            } else {
                builder
                    .prefetch(300)
                    .batch_handler(|tx, b| {
                        payments::handle_batch(tx, b, payments::Behaviour::default())
                    })
                    .batch(100)
                    .build()?
            };
            let stop = consumer.shutdown_handle();
            let task = tokio::spawn(consumer.run());
            Worker::Idempo(stop, task)
        }
        _ => {
            let consumer = js
                .get_stream(&stream)
                .await?
                .get_or_create_consumer(
                    "hand",
                    pull::Config {
                        durable_name: Some("hand".into()),
                        max_ack_pending: if variant == "hand-c16" { 100 } else { 300 },
                        ..Default::default()
                    },
                )
                .await?;
            let (pool, done) = (pool.clone(), done.clone());
            let batch = variant == "hand-batch100";
            Worker::Hand(tokio::spawn(async move {
                let messages = consumer.messages().await?;
                if batch {
                    hand_batches(messages, pool, done).await
                } else {
                    hand_each(messages, pool, done).await
                }
            }))
        }
    };
    loop {
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
            .fetch_one(&pool)
            .await?;
        if applied as usize >= n {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "{variant} stalled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    match worker {
        Worker::Idempo(stop, task) => {
            stop.shutdown();
            task.await??;
        }
        Worker::Hand(task) => task.abort(),
    }
    js.delete_stream(&stream).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await?;
    pool.close().await;
    Ok(seconds)
}

enum Worker {
    Idempo(
        idempo::consumer::ShutdownHandle,
        tokio::task::JoinHandle<idempo::Result<()>>,
    ),
    Hand(tokio::task::JoinHandle<anyhow::Result<()>>),
}

/// A schema of its own with idempo's tables and the payments tables, and a
/// pool of 20 on it.
async fn fresh_schema() -> anyhow::Result<(PgPool, String)> {
    let url = env_or(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    let schema = format!("bench_js_{}_{}", std::process::id(), fastrand::u32(..));
    let admin = PgPool::connect(&url).await.context("PostgreSQL")?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await?;
    admin.close().await;
    let options = PgConnectOptions::from_str(&url)?.options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(20)
        .connect_with(options)
        .await?;
    idempo::migrate(&pool).await?;
    payments::create_tables(&pool).await?;
    Ok((pool, schema))
}

/// The hand-written per-message loop: 16 at once, each `hand::apply`, then
/// a confirmed ack.
async fn hand_each(
    mut messages: pull::Stream,
    pool: PgPool,
    done: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let permits = Arc::new(Semaphore::new(16));
    while let Some(message) = messages.next().await {
        let message = message?;
        let permit = permits.clone().acquire_owned().await?;
        let (pool, done) = (pool.clone(), done.clone());
        tokio::spawn(async move {
            let work = async {
                let id = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Msg-Id"))
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                let payment: payments::Payment = serde_json::from_slice(&message.payload)?;
                hand::apply(
                    &pool,
                    hand::CLAIM_IN_PROCESSED_MESSAGES,
                    &id,
                    &payment,
                    async {},
                )
                .await?;
                message
                    .double_ack()
                    .await
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                done.fetch_add(1, Ordering::Relaxed);
                anyhow::Ok(())
            };
            if let Err(e) = work.await {
                eprintln!("hand-written consumer: {e}");
            }
            drop(permit);
        });
    }
    Ok(())
}

/// The hand-written batch loop: up to 100 within 5 ms, one transaction,
/// then the confirmed acks.
async fn hand_batches(
    mut messages: pull::Stream,
    pool: PgPool,
    done: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    loop {
        let Some(first) = messages.next().await else {
            return Ok(());
        };
        let mut batch = vec![first?];
        let deadline = tokio::time::Instant::now() + Duration::from_millis(5);
        while batch.len() < 100 {
            match tokio::time::timeout_at(deadline, messages.next()).await {
                Ok(Some(m)) => batch.push(m?),
                _ => break,
            }
        }
        let ids: Vec<String> = batch
            .iter()
            .map(|m| {
                m.headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Msg-Id"))
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default()
            })
            .collect();
        let decode = |i: usize| Ok(serde_json::from_slice(&batch[i].payload)?);
        hand::apply_batch(&pool, &ids, decode, async {}).await?;
        let acks = batch.iter().map(|m| m.double_ack());
        for ack in futures::future::join_all(acks).await {
            ack.map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        done.fetch_add(batch.len() as u64, Ordering::Relaxed);
    }
}
