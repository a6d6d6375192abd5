//! The dedup window's three stores, side by side in one run: inserts of new
//! ids and of duplicates, with 1 and 16 concurrent callers, against the local
//! PostgreSQL and Redis. Ratios are to the in-memory store measured in the
//! same run.
//!
//! ```text
//! cargo bench --bench window --features window,redis
//! ```
//!
//! Environment: `BENCH_IDS` (default 20000 per measurement), `DATABASE_URL`,
//! `REDIS_URL`.

use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::Context;
use idempo::window::{
    DedupId, DedupWindow, MemoryWindow, PostgresWindow, RedisWindow, Scope, WindowStore,
};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

struct Row {
    store: &'static str,
    callers: usize,
    new_per_s: f64,
    duplicate_per_s: f64,
}

/// Inserts `ids` ids with `callers` concurrent tasks; returns ops/s.
async fn measure<S: WindowStore>(
    window: &DedupWindow<S>,
    run: &str,
    ids: usize,
    callers: usize,
    expect_new: bool,
) -> anyhow::Result<f64> {
    let scope = Scope::queue(run);
    let started = Instant::now();
    let per_caller = ids / callers;
    let tasks = (0..callers).map(|c| {
        let (window, scope) = (window.clone(), scope.clone());
        async move {
            for n in 0..per_caller {
                let id = DedupId::new(format!("id-{c}-{n}")).expect("valid id");
                let new = window.insert(&scope, &id).await?;
                anyhow::ensure!(
                    new == expect_new,
                    "id {id} new={new}, expected {expect_new}"
                );
            }
            anyhow::Ok(())
        }
    });
    for result in futures::future::join_all(tasks).await {
        result?;
    }
    Ok((per_caller * callers) as f64 / started.elapsed().as_secs_f64())
}

async fn bench<S: WindowStore>(
    rows: &mut Vec<Row>,
    store: &'static str,
    window: DedupWindow<S>,
    ids: usize,
) -> anyhow::Result<()> {
    for callers in [1, 16] {
        let run = format!("bench-{store}-{callers}-{}", std::process::id());
        let n = if callers == 1 { ids / 4 } else { ids };
        let new_per_s = measure(&window, &run, n, callers, true).await?;
        let duplicate_per_s = measure(&window, &run, n, callers, false).await?;
        rows.push(Row {
            store,
            callers,
            new_per_s,
            duplicate_per_s,
        });
    }
    Ok(())
}

async fn bench_schema(url: &str) -> anyhow::Result<(PgPool, PgPool, String)> {
    let admin = PgPool::connect(url)
        .await
        .with_context(|| format!("PostgreSQL is not reachable at {url}"))?;
    let schema = format!("idempo_bench_window_{}", std::process::id());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await?;
    let options = PgConnectOptions::from_str(url)?.options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await?;
    idempo::migrate(&pool).await?;
    Ok((admin, pool, schema))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let ids: usize = std::env::var("BENCH_IDS")
        .ok()
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(20_000);
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    // Long enough to outlast the run, short enough that Redis forgets the keys soon.
    let length = Duration::from_secs(120);

    let mut rows = Vec::new();
    let memory = DedupWindow::new(MemoryWindow::new(4 * ids)).window(length);
    bench(&mut rows, "memory", memory, ids).await?;

    let (admin, pool, schema) = bench_schema(&database_url).await?;
    let postgres = DedupWindow::new(PostgresWindow::new(pool.clone())).window(length);
    let result = bench(&mut rows, "postgres", postgres, ids).await;
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await?;
    result?;

    let redis = RedisWindow::connect(&redis_url)
        .await
        .with_context(|| format!("Redis is not reachable at {redis_url}"))?
        .with_prefix(format!("idempo:bench:{}:", std::process::id()));
    bench(
        &mut rows,
        "redis",
        DedupWindow::new(redis).window(length),
        ids,
    )
    .await?;

    let baseline = |callers: usize| {
        let row = rows
            .iter()
            .find(|r| r.store == "memory" && r.callers == callers)
            .expect("memory measured first");
        (row.new_per_s, row.duplicate_per_s)
    };
    println!(
        "{:<10} {:>7} {:>14} {:>14} {:>12} {:>12}",
        "store", "callers", "new ids/s", "dup ids/s", "new/memory", "dup/memory"
    );
    for row in &rows {
        let (new_base, dup_base) = baseline(row.callers);
        println!(
            "{:<10} {:>7} {:>14.0} {:>14.0} {:>12.4} {:>12.4}",
            row.store,
            row.callers,
            row.new_per_s,
            row.duplicate_per_s,
            row.new_per_s / new_base,
            row.duplicate_per_s / dup_base
        );
    }
    Ok(())
}
