//! What a newcomer is told when a service the example needs is not there:
//! which service, at which address, and how to start it.

use anyhow::Context;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// How to start each service: the repository's compose file, or Debian's
/// commands (PostgreSQL's is said by [`idempo::probe::why_unreachable`]).
pub fn how_to_start(service: &str) -> &'static str {
    match service {
        "RabbitMQ" => {
            "start it with `docker compose up -d` (the repository's docker-compose.yml), or on \
             Debian `rabbitmq-server -detached`; or point AMQP_URL at yours"
        }
        _ => {
            "start it with `docker compose up -d` (the repository's docker-compose.yml), or \
             `redis-server --daemonize yes`; or point REDIS_URL at yours"
        }
    }
}

/// Connects a pool to PostgreSQL at `url`. sqlx's pool retries a refused
/// connection until its acquire timeout and then says only "pool timed
/// out": [`idempo::probe::why_unreachable`] finds the reason, said with the
/// address (never the password) and how to start the server.
pub async fn connect_postgres(options: PgPoolOptions, url: &str) -> anyhow::Result<PgPool> {
    let error = match options.connect(url).await {
        Ok(pool) => return Ok(pool),
        Err(error) => error,
    };
    if let sqlx::Error::PoolTimedOut = error
        && let Some(why) = idempo::probe::why_unreachable(url).await
    {
        anyhow::bail!(why);
    }
    // It answers now (it was starting, or the pool was too small), or the
    // error says why itself.
    Err(error).with_context(|| {
        format!(
            "cannot connect to PostgreSQL at {}",
            idempo::redact_url(url)
        )
    })
}

/// Once the consumer's first attempt to reach RabbitMQ fails (before it
/// ever consumed), says how to start it, once; the consumer keeps trying.
#[allow(dead_code)]
pub fn hint_while_broker_unreachable(health: idempo::consumer::Health, amqp_url: &str) {
    let at = idempo::redact_url(amqp_url);
    tokio::spawn(async move {
        let first = health
            .wait_for(|h| h.is_consuming() || h.last_error.is_some())
            .await;
        if !first.is_consuming()
            && first
                .last_error
                .as_deref()
                .is_some_and(|e| e.starts_with("cannot connect to RabbitMQ"))
        {
            tracing::warn!(
                "RabbitMQ does not answer at {at}: {}; the consumer keeps trying",
                how_to_start("RabbitMQ")
            );
        }
    });
}

/// What the example reports: log lines on stdout (filtered by `RUST_LOG`)
/// and, with feature `otel` and `OTEL_EXPORTER_OTLP_ENDPOINT` set, traces
/// and metrics over OTLP (every INFO span, whatever `RUST_LOG` says).
pub struct Observability {
    #[cfg(feature = "otel")]
    telemetry: Option<idempo::otel::Telemetry>,
}

/// Installs the process's subscriber: call once, first thing in `main`.
///
/// Without the `log` bridge (`SubscriberInitExt::init` would install
/// tracing-log's `LogTracer`): sqlx reports through `tracing` anyway, and
/// through the bridge each `log::log_enabled!` it asks (for every
/// PostgreSQL notice) reaches the per-layer filter below without an event.
/// When the filter says no (`sqlx=warn` and a NOTICE such as "relation
/// already exists, skipping"), tracing-subscriber keeps that "disabled" for
/// the thread and drops the thread's next event whose callsite is always
/// enabled (tokio-rs/tracing#2519): the consumer's `consuming` line.
pub fn observe(service: &str) -> anyhow::Result<Observability> {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,sqlx=warn".into());
    let logs =
        tracing_subscriber::registry().with(tracing_subscriber::fmt::layer().with_filter(filter));
    #[cfg(feature = "otel")]
    {
        let telemetry = idempo::otel::Telemetry::from_env(service)?;
        tracing::subscriber::set_global_default(logs.with(telemetry.as_ref().map(|t| {
            t.layer()
                .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
        })))?;
        Ok(Observability { telemetry })
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = service;
        tracing::subscriber::set_global_default(logs)?;
        Ok(Observability {})
    }
}

impl Observability {
    /// Exports what is still buffered: after the drain, before exiting.
    pub async fn flush(self) {
        #[cfg(feature = "otel")]
        if let Some(telemetry) = self.telemetry {
            let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
        }
    }
}
