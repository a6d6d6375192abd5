//! [`Failure`]: why a page or an action was not served, as the response
//! the dashboard gives, so that every handler returns `Result` and uses `?`.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};

use super::pages;

/// Why a request was not served.
#[derive(Debug)]
pub(crate) enum Failure {
    /// A service (PostgreSQL, RabbitMQ) failed: a 503 page saying why,
    /// without a password or a service's URL.
    Unavailable(String),
    /// What a confirmation counted changed before it was confirmed: a 409
    /// page saying what, nothing done.
    Changed(String),
    /// The dashboard refuses the request: its status and one line.
    Refused(StatusCode, &'static str),
}

impl Failure {
    /// The read-only dashboard refuses every action.
    pub(crate) const READ_ONLY: Failure =
        Failure::Refused(StatusCode::FORBIDDEN, "the dashboard is read-only\n");

    /// An action without the caller's CSRF token.
    pub(crate) const CSRF: Failure =
        Failure::Refused(StatusCode::FORBIDDEN, "missing or wrong CSRF token\n");
}

/// Every library error reads as the service that failed; its causes once,
/// without sqlx's line of PostgreSQL's source.
impl<E: std::error::Error + 'static> From<E> for Failure {
    fn from(error: E) -> Self {
        Failure::Unavailable(crate::errors::cause_line(&error))
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        match self {
            Failure::Unavailable(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                Html(pages::layout(
                    "Unavailable",
                    &maud::html! { h1 { "Unavailable" } p.red { (pages::untrusted(&why)) } }
                        .into_string(),
                    true,
                )),
            )
                .into_response(),
            Failure::Changed(what) => (
                StatusCode::CONFLICT,
                Html(pages::layout(
                    "Changed",
                    &maud::html! {
                        h1 { "Nothing done" }
                        p.red { (pages::untrusted(&what)) }
                        p { a href="/dead-letters" { "Look again" } }
                    }
                    .into_string(),
                    false,
                )),
            )
                .into_response(),
            Failure::Refused(status, why) => (status, why).into_response(),
        }
    }
}
