//! [`IdempotencyLayer`]: the configuration, applied with `tower::Layer`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode, header};
use tower_layer::Layer;

use super::service::Idempotency;
use super::store::IdempotencyStore;

type UserFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;
type StatusFn = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// The shortest [lease](IdempotencyLayer::lease): the heartbeat renews it
/// every third of it.
pub const MIN_LEASE: Duration = Duration::from_millis(100);

/// The longest [TTL](IdempotencyLayer::ttl): a year.
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// The user of a request when the [`user`](IdempotencyLayer::user) function
/// names none.
pub const ANONYMOUS: &str = "anonymous";

/// Makes POST and PATCH requests that carry an `Idempotency-Key` safe to
/// retry: the first one runs, its response is stored, and every retry gets
/// that response back.
///
/// # Defaults
/// | setting | default |
/// |---|---|
/// | [`methods`](Self::methods) | POST, PATCH |
/// | [`require_key`](Self::require_key) | no: requests without a key pass through |
/// | [`user`](Self::user) | every request is [`ANONYMOUS`] |
/// | [`max_request_body`](Self::max_request_body) | 1 MiB (larger: 413) |
/// | [`max_response_body`](Self::max_response_body) | 1 MiB (larger: passed through, key released) |
/// | [`lease`](Self::lease) | 30 s, renewed while the request runs |
/// | [`ttl`](Self::ttl) | 24 h |
/// | [`stored_headers`](Self::stored_headers) | `Content-Type`, `Location` |
/// | [`stores_status`](Self::stores_status) | [`stores_status_by_default`] |
/// | [`fail_open`](Self::fail_open) | no: a store error answers 503 |
/// | [`in_progress_retry_after`](Self::in_progress_retry_after) | 1 s |
///
/// # Things to know
/// - A client that disconnects does not cancel the handler: it runs to the
///   end in its own task and completes (or releases) the key, so the retry
///   finds the answer.
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

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) user: UserFn,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) lease: Duration,
    pub(crate) ttl: Duration,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) stores_status: StatusFn,
    pub(crate) fail_open: bool,
    pub(crate) retry_after: Duration,
}

/// The default of [`IdempotencyLayer::stores_status`]: 2xx, 4xx except 408,
/// 409 and 429 (the client is told to retry), and 5xx. A stored 500 is
/// replayed as it is, an indeterminate result the client must not repeat
/// blindly, as Stripe does. 1xx and 3xx are not stored.
pub fn stores_status_by_default(status: StatusCode) -> bool {
    match status.as_u16() {
        408 | 409 | 429 => false,
        _ => status.is_success() || status.is_client_error() || status.is_server_error(),
    }
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
                stores_status: Arc::new(stores_status_by_default),
                fail_open: false,
                retry_after: Duration::from_secs(1),
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
    /// users names two operations. `None` is [`ANONYMOUS`].
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
    /// [`MIN_LEASE`] (shorter values are raised to it).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease.max(MIN_LEASE);
        self
    }

    /// How long a completed record is replayed; after that the key is free.
    /// Between 1 ms and [`MAX_TTL`] (values outside are clamped).
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
    /// client can retry. Default: [`stores_status_by_default`].
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

    /// The `Retry-After` sent with 409 while the first request is running.
    #[must_use]
    pub fn in_progress_retry_after(mut self, delay: Duration) -> Self {
        self.config.retry_after = delay;
        self
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
