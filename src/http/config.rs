//! [`Config`]: what an [`IdempotencyLayer`](super::IdempotencyLayer) was
//! configured with, read by each request's [`Idempotency`](super::Idempotency)
//! service.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};
use tokio_util::task::TaskTracker;

/// Who the request is from (the key's scope).
pub(crate) type UserFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;
/// Whether a response status is stored.
pub(crate) type StatusFn = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// The layer's settings; see [`IdempotencyLayer`](super::IdempotencyLayer)
/// for each one's meaning and default.
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
    pub(crate) store_timeout: Duration,
    pub(crate) body_timeout: Duration,
    /// The handler tasks, for a graceful shutdown to wait for.
    pub(crate) tasks: TaskTracker,
}
