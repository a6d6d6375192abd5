//! [`IdempotencyLayer`]: the configuration, applied with `tower::Layer`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode, header};
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

use super::config::Config;
use super::service::Idempotency;
use super::store::IdempotencyStore;

/// The shortest [lease](IdempotencyLayer::lease): the heartbeat renews it
/// every third of it.
pub(crate) const MIN_LEASE: Duration = Duration::from_millis(100);

/// The longest [TTL](IdempotencyLayer::ttl): a year.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// Makes POST and PATCH requests that carry an `Idempotency-Key` safe to
/// retry: the first one runs, its response is stored, and every retry gets
/// that response back.
///
/// # Defaults
/// | setting | default |
/// |---|---|
/// | [`methods`](Self::methods) | POST, PATCH |
/// | [`require_key`](Self::require_key) | no: requests without a key pass through |
/// | [`user`](Self::user) | none: every request is "without a user" (a scope no user id can reach) |
/// | [`max_request_body`](Self::max_request_body) | 1 MiB (larger: 413) |
/// | [`max_response_body`](Self::max_response_body) | 1 MiB (larger: passed through, key released) |
/// | [`lease`](Self::lease) | 30 s, renewed while the request runs |
/// | [`ttl`](Self::ttl) | 24 h |
/// | [`stored_headers`](Self::stored_headers) | `Content-Type`, `Location` |
/// | [`stores_status`](Self::stores_status) | [`StoredResponse::stored_by_default`](super::StoredResponse::stored_by_default) |
/// | [`fail_open`](Self::fail_open) | no: a store error answers 503 |
/// | [`store_timeout`](Self::store_timeout) | 5 s per store call (then 503) |
/// | [`body_timeout`](Self::body_timeout) | 30 s to read the request body (then 408) |
/// | [`in_progress_retry_after`](Self::in_progress_retry_after) | 1 s while the first request's holder renews its lease; the lease's remainder once it stopped |
///
/// # Things to know
/// - A client that disconnects does not cancel the handler: it runs to the
///   end in its own task and completes (or releases) the key, so the retry
///   finds the answer. Those tasks outlive their connections, so a graceful
///   shutdown must wait for them after the server stopped:
///   [`in_flight`](Self::in_flight).
/// - Apply the layer with `route_layer` on a method router
///   (`post(handler).route_layer(layer)`): then a method the route does not
///   serve gets its 405 without the layer asking for a key.
/// - A handler that never returns holds its key (the lease is renewed) for
///   as long as the process lives: bound handlers with a timeout layer
///   *inside* this one.
/// - The scope uses the request's path as this layer sees it. Inside
///   `Router::nest`, axum strips the nest's prefix: put the layer outside the
///   nest, or fold the prefix's parameters (a tenant id) into
///   [`user`](Self::user).
/// - With [`PostgresStore`](super::PostgresStore) and the atomic phase, a
///   request in flight holds two connections of the pool at times (its
///   transaction, and the lease's renewal): size the pool for it.
///
/// # Example
/// ```no_run
/// # async fn doc(pool: sqlx::PgPool) {
/// use axum::{Router, routing::post};
/// use idempo::http::{IdempotencyLayer, PostgresStore};
///
/// async fn create_payment() -> &'static str { "created" }
///
/// let app: Router = Router::new().route(
///     "/payments",
///     post(create_payment).layer(IdempotencyLayer::new(PostgresStore::new(pool)).require_key()),
/// );
/// # }
/// ```
pub struct IdempotencyLayer<St> {
    store: Arc<St>,
    config: Config,
}

impl<St: IdempotencyStore> IdempotencyLayer<St> {
    /// A layer on `store`, with the [defaults](Self#defaults).
    pub fn new(store: St) -> Self {
        IdempotencyLayer {
            store: Arc::new(store),
            config: Config {
                methods: vec![Method::POST, Method::PATCH],
                require_key: false,
                user: Arc::new(|_| None),
                max_request_body: 1024 * 1024,
                max_response_body: 1024 * 1024,
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(24 * 60 * 60),
                stored_headers: vec![header::CONTENT_TYPE, header::LOCATION],
                stores_status: Arc::new(super::StoredResponse::stored_by_default),
                fail_open: false,
                retry_after: Duration::from_secs(1),
                store_timeout: Duration::from_secs(5),
                body_timeout: Duration::from_secs(30),
                tasks: TaskTracker::new(),
            },
        }
    }
}

impl<St> IdempotencyLayer<St> {
    /// The methods the layer applies to; others pass through untouched.
    #[must_use]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Answers requests without an `Idempotency-Key` with 400 instead of
    /// passing them through. Layer the routes that need it:
    /// `post(handler).layer(layer.require_key())`.
    #[must_use]
    pub fn require_key(mut self) -> Self {
        self.config.require_key = true;
        self
    }

    /// Who sent the request, e.g. from an extension your authentication
    /// middleware inserted. Keys are scoped by user: the same key from two
    /// users names two operations. `None` is a request without a user: its
    /// own scope, which no user id can reach (not `"anonymous"`, not `""`).
    /// Return `None` only for requests that may run without a user; reject
    /// an unreadable or unauthenticated one in your authentication layer or
    /// the handler (401/400: not stored).
    ///
    /// ```
    /// # use idempo::http::{IdempotencyLayer, MemoryStore};
    /// #[derive(Clone)]
    /// struct UserId(String);
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .user(|parts| parts.extensions.get::<UserId>().map(|u| u.0.clone()));
    /// ```
    #[must_use]
    pub fn user(mut self, user: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.config.user = Arc::new(user);
        self
    }

    /// The largest request body the layer buffers to fingerprint; a larger
    /// one is answered with 413 before the handler runs.
    #[must_use]
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// The largest response body stored for replay. A larger response is
    /// passed through and its key released, so a retry executes again. With
    /// the [atomic phase](crate::http#the-atomic-phase) the handler's writes
    /// are rolled back instead and the client gets 500: an effect whose
    /// answer cannot be replayed would otherwise be repeated by the retry.
    #[must_use]
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.config.max_response_body = bytes;
        self
    }

    /// How long an in-progress record is held. The layer renews it every
    /// third of the lease while the handler runs, so it runs out only when
    /// the process holding it died; then a retry may take it over. At least
    /// 100 ms (shorter values are raised to it).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease.max(MIN_LEASE);
        self
    }

    /// How long a completed record is replayed; after that the key is free.
    /// Between 1 ms and a year (values outside are clamped).
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl.clamp(Duration::from_millis(1), MAX_TTL);
        self
    }

    /// The response headers stored and replayed (others are dropped from
    /// replays).
    #[must_use]
    pub fn stored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.stored_headers = headers.into_iter().collect();
        self
    }

    /// Which statuses are stored; for the others the key is released so the
    /// client can retry. Default: [`StoredResponse::stored_by_default`](super::StoredResponse::stored_by_default).
    #[must_use]
    pub fn stores_status(mut self, f: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.config.stores_status = Arc::new(f);
        self
    }

    /// When the store fails, run the request anyway (without idempotency)
    /// instead of answering 503. Availability over safety: a retry during the
    /// outage can execute twice.
    #[must_use]
    pub fn fail_open(mut self) -> Self {
        self.config.fail_open = true;
        self
    }

    /// The `Retry-After` sent with 409 while the first request is running
    /// and its holder renews the lease (it will answer soon). Once a renewal
    /// is overdue (the holder probably died), the 409 says how long the lease
    /// has left instead, so that a client waits once, not every second.
    #[must_use]
    pub fn in_progress_retry_after(mut self, delay: Duration) -> Self {
        self.config.retry_after = delay;
        self
    }

    /// How long one store call may take before the request is answered 503
    /// (default 5 s): a pool waiting for a connection to a database that is
    /// down must not hold the client for the pool's whole acquire timeout.
    #[must_use]
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.config.store_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long the layer waits for the request body it buffers (default
    /// 30 s); a slower upload is answered 408 and nothing runs. Stalled
    /// uploads cannot hold memory longer than this.
    #[must_use]
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.config.body_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The handlers this layer (and its clones) started, for a graceful
    /// shutdown. A handler whose client disconnected keeps running in a task
    /// of its own, detached from any connection, so `axum::serve(..)
    /// .with_graceful_shutdown(..)` does not wait for it: wait for it after.
    ///
    /// ```no_run
    /// # async fn doc(app: axum::Router, layer: idempo::http::IdempotencyLayer<idempo::http::MemoryStore>) -> std::io::Result<()> {
    /// let in_flight = layer.in_flight();
    /// let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    /// axum::serve(listener, app)
    ///     .with_graceful_shutdown(async { let _ = tokio::signal::ctrl_c().await; })
    ///     .await?;
    /// in_flight.wait(std::time::Duration::from_secs(30)).await; // complete or release every key
    /// # Ok(()) }
    /// ```
    pub fn in_flight(&self) -> InFlight {
        InFlight {
            tasks: self.config.tasks.clone(),
        }
    }
}

/// The handlers of an [`IdempotencyLayer`] still running; see
/// [`IdempotencyLayer::in_flight`].
#[derive(Debug, Clone)]
pub struct InFlight {
    tasks: TaskTracker,
}

impl InFlight {
    /// How many handlers are running.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// `true` when none is.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Waits until every handler has finished and completed or released its
    /// key, for at most `timeout`; `true` if they all did.
    pub async fn wait(&self, timeout: Duration) -> bool {
        self.tasks.close();
        let done = tokio::time::timeout(timeout, self.tasks.wait())
            .await
            .is_ok();
        // New requests (a server that keeps serving) are tracked again.
        self.tasks.reopen();
        done
    }
}

impl<St> Clone for IdempotencyLayer<St> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            store: self.store.clone(),
            config: self.config.clone(),
        }
    }
}

impl<St> fmt::Debug for IdempotencyLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("methods", &self.config.methods)
            .field("require_key", &self.config.require_key)
            .field("max_request_body", &self.config.max_request_body)
            .field("max_response_body", &self.config.max_response_body)
            .field("lease", &self.config.lease)
            .field("ttl", &self.config.ttl)
            .field("stored_headers", &self.config.stored_headers)
            .field("fail_open", &self.config.fail_open)
            .finish_non_exhaustive()
    }
}

impl<S, St> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.store.clone(), Arc::new(self.config.clone()))
    }
}
