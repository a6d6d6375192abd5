//! The layer's own answers, as `application/problem+json` (RFC 9457).

use std::time::Duration;

use axum_core::body::Body;
use http::{HeaderValue, Response, StatusCode, header};

use crate::key::KeyError;

/// Why the layer answered instead of the handler. Each kind has a fixed
/// status and a `type` URI under `PROBLEM_BASE`.
#[derive(Debug)]
pub(crate) enum Problem {
    MissingKey,
    InvalidKey(KeyError),
    BodyTooLarge { limit: usize },
    BodyUnreadable,
    BodyTimeout { after: Duration },
    KeyMismatch,
    InProgress { retry_after: Duration },
    StoreUnavailable,
    ResponseTooLarge { limit: usize },
    LeaseLost,
    CommitFailed,
    NoTransaction,
    DatabaseUnavailable,
    HandlerFailed,
}

/// Marks a response the layer made itself (in a response's extensions), so
/// that it is never stored: a 503 from the `Tx` extractor means "nothing
/// ran", not an answer to replay.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerAnswer;

/// The prefix of every problem `type` this crate sends; the fragment names
/// the kind (`#key-mismatch`), documented in [`crate::http`].
pub(crate) const PROBLEM_BASE: &str = "https://docs.rs/idempo/latest/idempo/http/index.html";

impl Problem {
    fn status(&self) -> StatusCode {
        match self {
            Problem::MissingKey | Problem::InvalidKey(_) | Problem::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            Problem::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Problem::KeyMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::InProgress { .. } | Problem::LeaseLost => StatusCode::CONFLICT,
            Problem::StoreUnavailable | Problem::CommitFailed | Problem::DatabaseUnavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Problem::ResponseTooLarge { .. } | Problem::NoTransaction | Problem::HandlerFailed => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Problem::MissingKey => "missing-key",
            Problem::InvalidKey(_) => "invalid-key",
            Problem::BodyTooLarge { .. } => "body-too-large",
            Problem::BodyUnreadable => "body-unreadable",
            Problem::BodyTimeout { .. } => "body-timeout",
            Problem::KeyMismatch => "key-mismatch",
            Problem::InProgress { .. } => "in-progress",
            Problem::StoreUnavailable => "store-unavailable",
            Problem::ResponseTooLarge { .. } => "response-too-large",
            Problem::LeaseLost => "lease-lost",
            Problem::CommitFailed => "commit-failed",
            Problem::NoTransaction => "no-transaction",
            Problem::DatabaseUnavailable => "database-unavailable",
            Problem::HandlerFailed => "handler-failed",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Problem::MissingKey => "Idempotency-Key required",
            Problem::InvalidKey(_) => "Invalid Idempotency-Key",
            Problem::BodyTooLarge { .. } => "Request body too large",
            Problem::BodyUnreadable => "Request body could not be read",
            Problem::BodyTimeout { .. } => "Request body too slow",
            Problem::KeyMismatch => "Idempotency-Key reused with a different request",
            Problem::InProgress { .. } => "A request with this Idempotency-Key is in progress",
            Problem::StoreUnavailable => "Idempotency store unavailable",
            Problem::ResponseTooLarge { .. } => "Response too large to store",
            Problem::LeaseLost => "Idempotency-Key taken over by another request",
            Problem::CommitFailed => "Could not commit",
            Problem::NoTransaction => "No idempotent transaction for this request",
            Problem::DatabaseUnavailable => "Database unavailable",
            Problem::HandlerFailed => "The request failed",
        }
    }

    fn detail(&self) -> String {
        match self {
            Problem::MissingKey => "this endpoint requires an Idempotency-Key header".into(),
            Problem::InvalidKey(e) => format!("{e}; a key is 1 to 255 characters of visible ASCII"),
            Problem::BodyTooLarge { limit } => {
                format!("the body exceeds the {limit}-byte limit for idempotent requests")
            }
            Problem::BodyUnreadable => "the request body ended with an error".into(),
            Problem::BodyTimeout { after } => {
                format!("the request body did not arrive within {after:?}; nothing was executed")
            }
            Problem::KeyMismatch => "this key was already used for a request with another \
                method, path or body; use a new key for a new request"
                .into(),
            Problem::InProgress { .. } => {
                "the first request with this key has not finished; retry later".into()
            }
            Problem::StoreUnavailable => {
                "the request was not executed because its key could not be checked; retry later"
                    .into()
            }
            Problem::ResponseTooLarge { limit } => format!(
                "the response exceeds the {limit}-byte limit for stored responses; \
                 the transaction was rolled back"
            ),
            Problem::LeaseLost => "this request ran past its lease and another request took the \
                key over; its writes were rolled back; retry to get the final answer"
                .into(),
            Problem::CommitFailed => {
                "the transaction could not be committed and nothing was stored; retry".into()
            }
            Problem::NoTransaction => "the Tx extractor needs the idempotency layer with a \
                PostgreSQL store on this route"
                .into(),
            Problem::DatabaseUnavailable => {
                "the database could not be reached; nothing was stored; retry later".into()
            }
            Problem::HandlerFailed => {
                "the handler failed with an internal error; nothing was stored; retry".into()
            }
        }
    }

    pub(crate) fn into_response(self) -> Response<Body> {
        let status = self.status();
        let body = serde_json::json!({
            "type": format!("{PROBLEM_BASE}#{}", self.kind()),
            "title": self.title(),
            "status": status.as_u16(),
            "detail": self.detail(),
        });
        let mut response = Response::new(Body::from(body.to_string()));
        *response.status_mut() = status;
        response.extensions_mut().insert(LayerAnswer);
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        let retry_after = match self {
            Problem::InProgress { retry_after } => Some(retry_after),
            // Nothing ran: a retry a moment later may find the store back.
            Problem::StoreUnavailable | Problem::DatabaseUnavailable => {
                Some(Duration::from_secs(1))
            }
            _ => None,
        };
        if let Some(retry_after) = retry_after {
            let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// `?` on idempo's (and, through it, sqlx's) errors in an axum handler: a
/// problem answer that the idempotency layer never stores, so the key is
/// released and a retry runs the request again. 503 when the database is
/// unreachable, read-only or out of resources ([`Error::is_unavailable`](crate::Error::is_unavailable)), 500 otherwise; the error itself is
/// logged, not sent.
impl axum_core::response::IntoResponse for crate::Error {
    fn into_response(self) -> axum_core::response::Response {
        tracing::warn!(error = %self, "request failed");
        if self.is_unavailable() {
            Problem::DatabaseUnavailable.into_response()
        } else {
            Problem::HandlerFailed.into_response()
        }
    }
}
