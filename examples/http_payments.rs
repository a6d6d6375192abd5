//! An HTTP payments service whose `POST /payments` is safe to retry.
//!
//! ```text
//! cargo run --example http_payments --features http,redis
//! curl -i -X POST 127.0.0.1:3000/payments -H 'Idempotency-Key: order-1' \
//!      -H 'X-User-Id: alice' -H 'Content-Type: application/json' \
//!      -d '{"account": "acc-1", "amount_cents": 500}'
//! ```
//! Send the same request again: the same 201 and `payment_id` come back with
//! `Idempotent-Replayed: true`, and there is still one row in `http_payments`.
//!
//! Environment:
//! - `HTTP_ADDR` (default `127.0.0.1:3000`)
//! - `IDEMPOTENCY_STORE`: `postgres` (default), `redis` or `memory`
//! - `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`):
//!   the payments, and the keys with the `postgres` store
//! - `REDIS_URL` (default `redis://127.0.0.1:6379`) for the `redis` store
//!
//! With `postgres`, the insert and the stored response commit in one
//! transaction (the handler takes a `Tx`). Runs until SIGTERM or SIGINT,
//! then stops accepting, and waits (up to 30 s) for the handlers still
//! running, those of clients that disconnected included, to complete or
//! release their keys: none is cut off half-way.

#[path = "common/http_payments.rs"]
mod http_payments;

use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::routing::post;
use idempo::http::{
    IdempotencyLayer, IdempotencyStore, InFlight, MemoryStore, PostgresStore, RedisStore,
};
use sqlx::PgPool;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// `POST /payments` behind the idempotency layer on `store`; the key is
/// required and scoped by `X-User-Id`. `route_layer`: a method the route
/// does not serve gets 405 before the layer asks for a key. Also returns
/// the layer's handlers in flight, for the shutdown.
fn app<St: IdempotencyStore + Clone>(pool: PgPool, store: St) -> (Router, InFlight) {
    let layer = IdempotencyLayer::new(store.clone())
        .require_key()
        .user(http_payments::user_of);
    let in_flight = layer.in_flight();
    tokio::spawn(idempo::http::run_cleanup(store, Duration::from_secs(60)));
    let router = Router::new()
        .route("/payments", post(http_payments::create).route_layer(layer))
        .with_state(pool);
    (router, in_flight)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    let addr = env_or("HTTP_ADDR", "127.0.0.1:3000");
    let database_url = env_or(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    let pool = PgPool::connect(&database_url)
        .await
        .with_context(|| format!("connect to PostgreSQL at {database_url}"))?;
    idempo::migrate(&pool).await.context("idempo migrations")?;
    http_payments::create_table(&pool).await?;

    let kind = env_or("IDEMPOTENCY_STORE", "postgres");
    let (app, in_flight) = match kind.as_str() {
        "postgres" => app(pool.clone(), PostgresStore::new(pool)),
        "redis" => {
            let url = env_or("REDIS_URL", "redis://127.0.0.1:6379");
            let store = RedisStore::connect(&url)
                .await
                .with_context(|| format!("connect to Redis at {url}"))?;
            app(pool, store)
        }
        "memory" => app(pool, MemoryStore::new()),
        other => {
            anyhow::bail!("IDEMPOTENCY_STORE must be postgres, redis or memory, not {other:?}")
        }
    };

    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("bind {addr}"))?;
    tracing::info!(addr = %listener.local_addr()?, store = %kind, "http_payments listening");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("shutting down");
        })
        .await?;
    // Handlers of clients that disconnected are not tied to a connection:
    // let them finish and store (or release) their keys.
    let running = in_flight.len();
    if !in_flight.wait(Duration::from_secs(30)).await {
        tracing::warn!(
            running,
            "handlers still running after 30 s; their keys stay in progress until their leases run out"
        );
    }
    Ok(())
}
