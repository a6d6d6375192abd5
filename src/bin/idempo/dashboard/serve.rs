//! The dashboard's server: `axum::serve` has no bound on connections nor a
//! timeout on reading a request's headers, so a client could hold
//! thousands of half-sent requests open before any sign-in check runs.
//! Here each connection takes a slot (at most [`MAX_CONNECTIONS`]) and must
//! send its headers within [`HEADER_TIMEOUT`], which also closes a
//! kept-alive connection idle that long (axum's `serve-with-hyper` example).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;

/// Connections served at once; more wait in the listen backlog.
pub(crate) const MAX_CONNECTIONS: usize = 256;

/// How long a connection may take to send a request's headers, or stay
/// idle between requests.
pub(crate) const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `stop` resolves, then lets the
/// requests in flight finish.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    stop: impl std::future::Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    let (stopping, _) = tokio::sync::watch::channel(false);
    tokio::pin!(stop);
    let mut full = false;
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                full = false;
                slot
            }
            Err(_) => {
                if !std::mem::replace(&mut full, true) {
                    tracing::warn!(
                        max = MAX_CONNECTIONS,
                        "dashboard: connection limit reached; new connections wait"
                    );
                }
                tokio::select! {
                    slot = slots.clone().acquire_owned() => slot.expect("never closed"),
                    () = &mut stop => break,
                }
            }
        };
        let (socket, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, say: pause instead of spinning.
                    tracing::warn!(error = %e, "dashboard: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        // What `into_make_service_with_connect_info` would give a handler.
        let service = app
            .clone()
            .layer(axum::Extension(ConnectInfo::<SocketAddr>(peer)));
        let connection =
            http.serve_connection(TokioIo::new(socket), TowerToHyperService::new(service));
        let mut stopped = stopping.subscribe();
        tokio::spawn(async move {
            let _slot = slot;
            let mut connection = std::pin::pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                _ = stopped.changed() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "dashboard: connection closed");
            }
        });
    }
    let _ = stopping.send(true);
    // Every slot back: every connection finished.
    let _ = slots.acquire_many(MAX_CONNECTIONS as u32).await;
}
