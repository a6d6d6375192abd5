//! The reference scenario: apply payments from RabbitMQ exactly once.
//!
//! ```text
//! cargo run --release --example payments
//! ```
//!
//! Environment:
//! - `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`): one URL, or
//!   several separated by commas, one per node of a cluster (tried in order;
//!   after a lost connection, the next); `amqps://` with the system's roots,
//!   or with `AMQP_CA_FILE` (a PEM file of CA certificates to trust instead),
//!   and a client certificate with `AMQP_CLIENT_CERT_FILE` and
//!   `AMQP_CLIENT_KEY_FILE` (PEM, the key unencrypted); `SSL_CERT_FILE`
//!   replaces the system's roots as for any rustls client
//! - `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`),
//!   with any `sslmode` (`require`, `verify-ca` and `verify-full` with
//!   `sslrootcert=...`; the files it names are checked at start)
//! - `PAYMENTS_QUEUE` (default `payments`; dead letters go to `$PAYMENTS_QUEUE.dlq`)
//! - `PAYMENTS_FAIL_RATE` (default 0): probability of a transient error after
//!   the handler wrote its rows, to watch the rollback and the retry
//! - `PAYMENTS_CONCURRENCY` (default 16, at most 65535), `PAYMENTS_PREFETCH`
//!   (default 100, or three times the batch size)
//! - `PAYMENTS_MIGRATE` (default 1): 1 applies idempo's migrations and creates
//!   the example's tables at start (DDL only when something is missing); 0
//!   only checks that they are there and refuses to start otherwise, for a
//!   role without `CREATE`
//! - `PAYMENTS_BATCH` (default 0): 0 processes one message per transaction;
//!   N > 0 turns on batch mode with batches of up to N and a batch handler
//!   that writes with one bulk insert and one grouped balance upsert
//! - `PAYMENTS_FORWARD_TO` (unset by default): a queue to which each applied
//!   payment is forwarded, staged in the outbox in the claim's transaction
//!   (same body, `application/json`, persistent, an id derived from the
//!   payment's) and published by the relay the consumer runs. The queue is
//!   declared like `PAYMENTS_QUEUE` (dead-lettering into
//!   `$PAYMENTS_FORWARD_TO.dlq`), so a second instance with
//!   `PAYMENTS_QUEUE=$PAYMENTS_FORWARD_TO` and its own `DATABASE_URL`
//!   consumes it: a chain whose second ledger equals the first
//! - `PAYMENTS_RETRY_DELAYS` (default `1s,5s,30s,2m,10m`): the delay tiers of
//!   the retry policy; `PAYMENTS_MAX_ATTEMPTS` (default 10)
//! - `PAYMENTS_DEAD_LETTERS` (default `queue`): `table` keeps dead letters
//!   in PostgreSQL's `dead_letters` table instead of `$PAYMENTS_QUEUE.dlq`
//!   (`idempo dlq list --queue $PAYMENTS_QUEUE` reads them, `idempo dlq
//!   replay --queue $PAYMENTS_QUEUE --all` replays them exactly once)
//! - `PAYMENTS_TRANSPORT` (default `amqp`): `nats` consumes the JetStream
//!   stream `$PAYMENTS_QUEUE` (subject `$PAYMENTS_QUEUE`, created when
//!   missing) on `NATS_URL` (default `nats://127.0.0.1:4222`) instead, with
//!   the same handler; dead letters then go to the `dead_letters` table (build
//!   with `--features nats`)
//! - `METRICS_ADDR` (unset by default): serve Prometheus metrics on this
//!   address, e.g. `127.0.0.1:9000` (then `curl 127.0.0.1:9000/metrics`)
//!
//! Runs until SIGTERM or SIGINT, then drains and exits 0.

#[path = "common/payments.rs"]
mod payments;
#[path = "common/services.rs"]
mod services;

use std::time::Duration;

use anyhow::Context;
use idempo::ClientTls;
use idempo::Schema;
use idempo::amqp::{Broker, Consumer};
use idempo::consumer::DeadLetters;
use idempo::consumer::RedeliveryPolicy;
use sqlx::postgres::PgPoolOptions;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn env_parse<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|e| anyhow::anyhow!("{name}={v:?} is invalid: {e}")),
        Err(_) => Ok(default),
    }
}

/// `250ms`, `5s`, `2m`, `1h`.
fn parse_delay(text: &str) -> anyhow::Result<Duration> {
    humantime::parse_duration(text.trim()).with_context(|| {
        format!("PAYMENTS_RETRY_DELAYS: {text:?} is not a delay such as 250ms, 5s, 2m")
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Logs, and traces over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set
    // (feature `otel`).
    let observability = services::observe("payments")?;

    let amqp_url = env_or("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let database_url = env_or(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    let queue = env_or("PAYMENTS_QUEUE", "payments");
    let fail_rate: f64 = env_parse("PAYMENTS_FAIL_RATE", 0.0)?;
    anyhow::ensure!(
        (0.0..=1.0).contains(&fail_rate),
        "PAYMENTS_FAIL_RATE must be between 0 and 1, got {fail_rate}"
    );
    let forward_to = std::env::var("PAYMENTS_FORWARD_TO")
        .ok()
        .filter(|q| !q.is_empty());
    let behaviour = payments::Behaviour {
        fail_rate,
        forward_to: forward_to.as_deref().map(Into::into),
    };
    // The broker's prefetch is 16 bits, and it bounds the handlers at work.
    let concurrency: u16 = env_parse("PAYMENTS_CONCURRENCY", 16)?;
    anyhow::ensure!(concurrency > 0, "PAYMENTS_CONCURRENCY must be at least 1");
    let migrate = match env_or("PAYMENTS_MIGRATE", "1").as_str() {
        "1" => true,
        "0" => false,
        other => anyhow::bail!(
            "PAYMENTS_MIGRATE={other:?} is invalid: 1 migrates at start, 0 only checks the schema"
        ),
    };
    let batch: usize = env_parse("PAYMENTS_BATCH", 0)?;
    let prefetch: u16 = env_parse("PAYMENTS_PREFETCH", (batch * 3).clamp(100, 65_535) as u16)?;
    let retry = match std::env::var("PAYMENTS_RETRY_DELAYS") {
        Ok(list) => RedeliveryPolicy::delayed(
            list.split(',')
                .map(parse_delay)
                .collect::<anyhow::Result<Vec<_>>>()?,
        ),
        Err(_) => RedeliveryPolicy::default(),
    }
    .max_attempts(env_parse("PAYMENTS_MAX_ATTEMPTS", 10)?);
    let transport = env_or("PAYMENTS_TRANSPORT", "amqp");
    anyhow::ensure!(
        matches!(transport.as_str(), "amqp" | "nats"),
        "PAYMENTS_TRANSPORT={transport:?} is invalid: amqp (RabbitMQ) or nats (JetStream)"
    );
    let dead_letters = match env_or("PAYMENTS_DEAD_LETTERS", "queue").as_str() {
        "queue" => DeadLetters::Queue,
        "table" => DeadLetters::Table,
        other => anyhow::bail!(
            "PAYMENTS_DEAD_LETTERS={other:?} is invalid: queue (the RabbitMQ DLQ) or table (PostgreSQL)"
        ),
    };

    if let Ok(addr) = std::env::var("METRICS_ADDR") {
        let addr: std::net::SocketAddr = addr
            .parse()
            .with_context(|| format!("METRICS_ADDR={addr:?} is not an address"))?;
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .context("cannot start the Prometheus exporter")?;
        tracing::info!("Prometheus metrics on http://{addr}/metrics");
    }

    // Named and explained before a client meets them: a bad certificate
    // file would show as a TLS failure, or as a file error without its path.
    idempo::certificate::check_database_url(&database_url)?;
    let broker = Broker::new(&amqp_url)?.tls(&ClientTls::from_env("AMQP")?)?;

    let pool = services::connect_postgres(
        PgPoolOptions::new()
            .max_connections(u32::from(concurrency) + 2)
            .acquire_timeout(Duration::from_secs(10)),
        &database_url,
    )
    .await?;
    // Least privilege: with PAYMENTS_MIGRATE=0 nothing here needs CREATE.
    let schema = if migrate {
        payments::create_tables(&pool).await?;
        Schema::Migrate
    } else {
        payments::check_tables(&pool).await?;
        Schema::Check
    };

    if transport == "nats" {
        anyhow::ensure!(
            std::env::var("PAYMENTS_DEAD_LETTERS").map_or(true, |d| d == "table"),
            "PAYMENTS_DEAD_LETTERS=queue is not possible on NATS: JetStream has no dead-letter \
             queue; dead letters go to the dead_letters table"
        );
        let options = NatsOptions {
            queue,
            forward_to,
            concurrency,
            prefetch,
            batch,
            schema,
            retry,
        };
        run_nats(pool, options, behaviour).await?;
        tracing::info!("drained; bye");
        observability.flush().await;
        return Ok(());
    }

    let mut consumer = Consumer::builder(amqp_url.clone(), pool)
        .broker(broker)
        .queue(queue)
        .prefetch(prefetch.max(concurrency))
        .concurrency(usize::from(concurrency))
        .schema(schema)
        .redelivery(retry)
        .dead_letters(dead_letters);
    if let Some(to) = &forward_to {
        tracing::info!(queue = %to, "forwarding applied payments through the outbox");
        consumer = consumer.declare_like_own(to);
    }
    let consumer = if batch > 0 {
        consumer
            .batch_handler(move |tx, batch| payments::handle_batch(tx, batch, behaviour.clone()))
            .batch(batch)
            .build()?
    } else {
        consumer
            .handler(move |tx, message| payments::handle(tx, message, behaviour.clone()))
            .build()?
    };
    services::hint_while_broker_unreachable(consumer.health(), &amqp_url);
    consumer.run_until_signal().await?;
    tracing::info!("drained; bye");
    // What the exporter still holds leaves before the process does.
    observability.flush().await;
    Ok(())
}

/// What the NATS variant takes from the environment.
#[cfg_attr(not(feature = "nats"), allow(dead_code))]
struct NatsOptions {
    queue: String,
    forward_to: Option<String>,
    concurrency: u16,
    prefetch: u16,
    batch: usize,
    schema: Schema,
    retry: RedeliveryPolicy,
}

/// The same handler on the JetStream stream `$PAYMENTS_QUEUE`.
#[cfg(feature = "nats")]
async fn run_nats(
    pool: sqlx::PgPool,
    options: NatsOptions,
    behaviour: payments::Behaviour,
) -> anyhow::Result<()> {
    let url = env_or("NATS_URL", "nats://127.0.0.1:4222");
    let mut consumer = idempo::nats::Consumer::builder(url, pool)
        .stream(options.queue)
        .prefetch(options.prefetch.max(options.concurrency))
        .concurrency(usize::from(options.concurrency))
        .schema(options.schema)
        .redelivery(options.retry);
    // Forwarded payments are staged in the outbox by the handler and
    // published to the stream $PAYMENTS_FORWARD_TO by the consumer's relay.
    if let Some(to) = &options.forward_to {
        tracing::info!(stream = %to, "forwarding applied payments through the outbox");
        consumer = consumer.relay_stream(to);
    }
    let consumer = if options.batch > 0 {
        consumer
            .batch_handler(move |tx, batch| payments::handle_batch(tx, batch, behaviour.clone()))
            .batch(options.batch)
            .build()?
    } else {
        consumer
            .handler(move |tx, message| payments::handle(tx, message, behaviour.clone()))
            .build()?
    };
    consumer.run_until_signal().await?;
    Ok(())
}

#[cfg(not(feature = "nats"))]
async fn run_nats(
    _pool: sqlx::PgPool,
    _options: NatsOptions,
    _behaviour: payments::Behaviour,
) -> anyhow::Result<()> {
    anyhow::bail!(
        "PAYMENTS_TRANSPORT=nats needs the feature: cargo run --release --features nats --example payments"
    )
}
