//! What every request must show before a handler runs, and what every
//! response carries: without a token, a loopback `Host` only (a page of
//! another site cannot reach the dashboard through a rebound DNS name); a
//! POST only from the dashboard's own pages; security headers.

use axum::extract::{Request, State};
use axum::http::header::{self, HeaderName, HeaderValue};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::Shared;

/// The headers of every response. No inline script or style: every page
/// works under `default-src 'self'`.
const SECURITY_HEADERS: [(HeaderName, &str); 4] = [
    (
        header::CONTENT_SECURITY_POLICY,
        "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; \
         form-action 'self'; frame-ancestors 'none'",
    ),
    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    // Not `no-referrer`: browsers then send `Origin: null` on the pages' own
    // POSTs, which could not be told from a cross-site one.
    (header::REFERRER_POLICY, "same-origin"),
    (header::X_FRAME_OPTIONS, "DENY"),
];

pub(crate) async fn guard(State(app): Shared, request: Request, next: Next) -> Response {
    let headers = request.headers();
    if !app.auth.required() && !loopback_host(headers) {
        return (
            StatusCode::MISDIRECTED_REQUEST,
            "without --token the dashboard answers only to localhost, 127.0.0.1 or [::1]\n",
        )
            .into_response();
    }
    if request.method() == Method::POST && cross_site(headers) {
        return (
            StatusCode::FORBIDDEN,
            "a cross-site form: actions come only from the dashboard's own pages\n",
        )
            .into_response();
    }
    let mut response = next.run(request).await;
    let out = response.headers_mut();
    for (name, value) in SECURITY_HEADERS {
        out.insert(name, HeaderValue::from_static(value));
    }
    // Pages hold data: never from a cache. Assets say otherwise themselves.
    out.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// Whether the request's `Host` names this machine's loopback.
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        // [::1]:8740
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _port)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether a browser says the request comes from another site: its
/// `Sec-Fetch-Site`, or an `Origin` whose host is not the request's `Host`.
fn cross_site(headers: &HeaderMap) -> bool {
    let fetch_site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    if fetch_site.is_some_and(|site| site == "cross-site" || site == "same-site") {
        return true;
    }
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let origin_host = origin.split_once("://").map(|(_, rest)| rest);
    origin_host.is_none() || origin_host != host
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn only_loopback_names_are_loopback_hosts() {
        for host in [
            "127.0.0.1:8740",
            "localhost:8740",
            "[::1]:8740",
            "127.0.0.1",
            "LOCALHOST",
        ] {
            assert!(loopback_host(&headers(&[("host", host)])), "{host}");
        }
        for host in [
            "rebind.attacker.example",
            "rebind.attacker.example:8740",
            "10.0.0.1:8740",
        ] {
            assert!(!loopback_host(&headers(&[("host", host)])), "{host}");
        }
        assert!(!loopback_host(&HeaderMap::new()));
    }

    #[test]
    fn posts_from_other_sites_are_cross_site() {
        assert!(!cross_site(&headers(&[("host", "127.0.0.1:8740")])));
        assert!(!cross_site(&headers(&[
            ("host", "127.0.0.1:8740"),
            ("origin", "http://127.0.0.1:8740"),
            ("sec-fetch-site", "same-origin"),
        ])));
        assert!(cross_site(&headers(&[
            ("host", "127.0.0.1:8740"),
            ("origin", "http://evil.example"),
        ])));
        assert!(cross_site(&headers(&[
            ("host", "127.0.0.1:8740"),
            ("origin", "null"),
        ])));
        assert!(cross_site(&headers(&[
            ("host", "127.0.0.1:8740"),
            ("sec-fetch-site", "cross-site"),
        ])));
    }
}
