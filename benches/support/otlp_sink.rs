//! The collector the traced variant exports to: an OTLP/HTTP endpoint in
//! the parent process that takes each request whole and answers 200, and
//! counts what it took (so the figures say the export really happened).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;

pub struct Sink {
    pub endpoint: String,
    requests: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
    _runtime: tokio::runtime::Runtime,
}

impl Sink {
    pub fn start() -> anyhow::Result<Sink> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let (requests, bytes) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let counts = (requests.clone(), bytes.clone());
        let app = Router::new()
            .route("/v1/traces", post(take))
            .route("/v1/metrics", post(take))
            .with_state(counts);
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        runtime.spawn(async move { axum::serve(listener, app).await });
        Ok(Sink {
            endpoint,
            requests,
            bytes,
            _runtime: runtime,
        })
    }

    /// Requests and bytes taken so far.
    pub fn taken(&self) -> (u64, u64) {
        (
            self.requests.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }
}

async fn take(State((requests, bytes)): State<(Arc<AtomicU64>, Arc<AtomicU64>)>, body: Bytes) {
    requests.fetch_add(1, Ordering::Relaxed);
    bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
}

/// In the variant's process: the application's setup, as the examples do
/// it (spans at INFO through the OpenTelemetry layer, exported over OTLP to
/// the endpoint the parent gave). None for an untraced variant.
#[cfg(feature = "otel")]
pub fn install() -> anyhow::Result<Option<idempo::otel::Telemetry>> {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let Some(telemetry) = idempo::otel::Telemetry::from_env("bench")? else {
        return Ok(None);
    };
    tracing_subscriber::registry()
        .with(
            telemetry
                .layer()
                .with_filter(tracing_subscriber::filter::LevelFilter::INFO),
        )
        .init();
    Ok(Some(telemetry))
}
