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
//! - `HTTP_HEADER_TIMEOUT_MS` (default 10000): how long a client has to send
//!   a request's headers, and how long a kept-alive connection may sit idle
//!   before the next request; slower ones are closed (slowloris)
//! - `HTTP_MAX_CONNECTIONS` (default 512): connections served at once; past
//!   it, new ones wait in the listen backlog until one closes, so a flood of
//!   connections cannot use up the process's file descriptors
//! - `PAYMENTS_MIGRATE` (default 1): 0 only checks that the tables are there,
//!   for a role without `CREATE`
//!
//! Those connection limits are the server's job, not the idempotency layer's:
//! the layer bounds what it buffers per request (body size, body timeout) and
//! the store calls; a server in front of it must bound connections and header
//! reads (this example's `serve`, or your reverse proxy).
//! With `postgres`, the insert and the stored response commit in one
//! transaction (the handler takes a `Tx`). Runs until SIGTERM or SIGINT,
//! then stops accepting, and waits (up to 30 s) for the handlers still
//! running, those of clients that disconnected included, to complete or
//! release their keys: none is cut off half-way.

#[path = "common/http_payments.rs"]
mod http_payments;
#[path = "common/services.rs"]
mod services;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::routing::post;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use idempo::http::{
    IdempotencyLayer, IdempotencyStore, InFlight, MemoryStore, PostgresStore, RedisStore,
};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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
    tokio::spawn(store.run_cleanup(Duration::from_secs(60)));
    let router = Router::new()
        .route("/payments", post(http_payments::create).route_layer(layer))
        .with_state(pool);
    (router, in_flight)
}

/// What one client may hold of the server.
struct Limits {
    header_timeout: Duration,
    max_connections: usize,
}

/// `axum::serve` with the protections a public HTTP/1 server needs (axum's
/// own `serve` has no knob for them; this follows axum's
/// `serve-with-hyper` example): a bound on connections, and a timeout on
/// reading each request's headers that also closes kept-alive connections
/// idle that long. On `stop`, stops accepting and lets each connection
/// finish the request in flight.
async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: Limits,
    stop: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let connections = TaskTracker::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut full = false;
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                full = false;
                slot
            }
            Err(_) => {
                // Once per episode, not once per waiting connection.
                if !std::mem::replace(&mut full, true) {
                    tracing::warn!(
                        max = limits.max_connections,
                        "connection limit reached; new connections wait"
                    );
                }
                tokio::select! {
                    slot = slots.clone().acquire_owned() => slot.expect("never closed"),
                    () = stop.cancelled() => break,
                }
            }
        };
        let (socket, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, say: pause instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = stop.cancelled() => break,
        };
        let connection =
            http.serve_connection(TokioIo::new(socket), TowerToHyperService::new(app.clone()));
        let stop = stop.clone();
        connections.spawn(async move {
            let _slot = slot;
            let mut connection = std::pin::pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                () = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "connection closed");
            }
        });
    }
    connections.close();
    connections.wait().await;
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Logs, and traces over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set
    // (feature `otel`): each keyed request's span says its key's outcome.
    let observability = services::observe("http_payments")?;
    let addr = env_or("HTTP_ADDR", "127.0.0.1:3000");
    let database_url = env_or(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    // sqlx retries a refused connection until the acquire timeout (30 s by
    // default): a wrong address should fail a start sooner than that.
    let pool = services::connect_postgres(
        PgPoolOptions::new().acquire_timeout(Duration::from_secs(10)),
        &database_url,
    )
    .await?;
    // Least privilege: with PAYMENTS_MIGRATE=0 nothing here needs CREATE.
    match env_or("PAYMENTS_MIGRATE", "1").as_str() {
        "1" => {
            idempo::migrate(&pool).await.context("idempo migrations")?;
            http_payments::create_table(&pool).await?;
        }
        "0" => {
            idempo::Schema::Check.apply(&pool).await?;
            http_payments::check_table(&pool).await?;
        }
        other => anyhow::bail!(
            "PAYMENTS_MIGRATE={other:?} is invalid: 1 migrates at start, 0 only checks"
        ),
    }

    let kind = env_or("IDEMPOTENCY_STORE", "postgres");
    let (app, in_flight) = match kind.as_str() {
        "postgres" => app(pool.clone(), PostgresStore::new(pool)),
        "redis" => {
            let url = env_or("REDIS_URL", "redis://127.0.0.1:6379");
            let store = RedisStore::connect(&url).await.with_context(|| {
                format!(
                    "connect to Redis at {} ({})",
                    idempo::redact_url(&url),
                    services::how_to_start("Redis")
                )
            })?;
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
    let limits = Limits {
        header_timeout: Duration::from_millis(
            env_or("HTTP_HEADER_TIMEOUT_MS", "10000")
                .parse()
                .context("HTTP_HEADER_TIMEOUT_MS must be a number of milliseconds")?,
        ),
        max_connections: env_or("HTTP_MAX_CONNECTIONS", "512")
            .parse()
            .context("HTTP_MAX_CONNECTIONS must be a number")?,
    };
    let stop = CancellationToken::new();
    let signalled = stop.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
        signalled.cancel();
    });
    serve(listener, app, limits, stop).await;
    // Handlers of clients that disconnected are not tied to a connection:
    // let them finish and store (or release) their keys.
    let running = in_flight.len();
    if !in_flight.wait(Duration::from_secs(30)).await {
        tracing::warn!(
            running,
            "handlers still running after 30 s; their keys stay in progress until their leases run out"
        );
    }
    observability.flush().await;
    Ok(())
}
