//! Stopping a consumer or a relay: [`ShutdownHandle`] (the signal) and the
//! process signals that fire it.

use std::future::Future;

use tokio_util::sync::CancellationToken;

/// Stops a running [`Consumer`](crate::amqp::Consumer) or
/// [`Relay`](crate::relay::Relay) from another task. Cheap to clone.
///
/// A graceful shutdown lets the work in flight finish; `shutdown_now` drops
/// it (transactions roll back, deliveries are redelivered: nothing is lost).
#[derive(Debug, Clone, Default)]
pub struct ShutdownHandle {
    graceful: CancellationToken,
    now: CancellationToken,
}

impl ShutdownHandle {
    /// Asks to stop after the work in flight: see
    /// [Shutdown](crate::amqp::Consumer#shutdown).
    pub fn shutdown(&self) {
        self.graceful.cancel();
    }

    /// Stops without waiting for the handlers in flight: their transactions
    /// roll back and their deliveries are redelivered. Nothing is lost.
    pub fn shutdown_now(&self) {
        self.graceful.cancel();
        self.now.cancel();
    }

    /// Whether shutdown was requested.
    pub fn is_shutdown(&self) -> bool {
        self.graceful.is_cancelled()
    }

    /// Fired when a graceful shutdown begins.
    pub(crate) fn graceful_token(&self) -> &CancellationToken {
        &self.graceful
    }

    /// Fired when the shutdown must not wait any longer.
    pub(crate) fn now_token(&self) -> &CancellationToken {
        &self.now
    }
}

/// SIGTERM and SIGINT, installed once so that a second signal is seen too.
pub(crate) struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    pub(crate) fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Signals {
                term: signal(SignalKind::terminate()).expect("cannot install a SIGTERM handler"),
                int: signal(SignalKind::interrupt()).expect("cannot install a SIGINT handler"),
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    pub(crate) async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Runs `run` (a consumer's) while SIGTERM or SIGINT fires `handle`: the
/// first signal drains, a second stops at once.
pub(crate) async fn until_signal<F: Future>(handle: &ShutdownHandle, run: F) -> F::Output {
    let handle = handle.clone();
    let signals = tokio::spawn(async move {
        let mut signals = Signals::new();
        signals.recv().await;
        tracing::info!("shutdown signal received; draining (a second signal stops at once)");
        handle.shutdown();
        signals.recv().await;
        tracing::warn!("second signal: stopping without waiting for handlers in flight");
        handle.shutdown_now();
    });
    let result = run.await;
    signals.abort();
    result
}

/// Runs `run` (a consumer's) until `stop` completes, which fires `handle`.
pub(crate) async fn until<F: Future>(
    handle: &ShutdownHandle,
    stop: impl Future<Output = ()> + Send + 'static,
    run: F,
) -> F::Output {
    let handle = handle.clone();
    let waiting = tokio::spawn(async move {
        stop.await;
        handle.shutdown();
    });
    let result = run.await;
    waiting.abort();
    result
}
