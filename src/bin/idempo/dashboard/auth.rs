//! Who may use the dashboard: the `--token` (a bearer header, or the session
//! cookie its sign-in page sets), and the CSRF token every action carries.
//! Compared in constant time.

use axum::Form;
use axum::extract::{Request, State};
use axum::http::header::{ACCEPT, AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum_extra::extract::CookieJar;
use axum_extra::extract::cookie::{Cookie, SameSite};
use hmac::{Hmac, Mac};
use serde::Deserialize;
use sha2::Sha256;
use subtle::ConstantTimeEq;

use super::{Shared, pages};

/// The session cookie's name.
pub(crate) const SESSION_COOKIE: &str = "idempo_session";

/// The dashboard's secrets: the operator's token, and a key of this process
/// from which the session cookie and the CSRF token are derived.
pub(crate) struct Auth {
    token: Option<String>,
    key: [u8; 32],
}

impl Auth {
    pub(crate) fn new(token: Option<String>) -> Self {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).expect("the operating system gives random bytes");
        Auth { token, key }
    }

    /// Whether a token is required.
    pub(crate) fn required(&self) -> bool {
        self.token.is_some()
    }

    fn derive(&self, purpose: &str) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("any key length");
        mac.update(purpose.as_bytes());
        if let Some(token) = &self.token {
            mac.update(token.as_bytes());
        }
        hex::encode(mac.finalize().into_bytes())
    }

    /// The session cookie's value: proves the token was given once.
    pub(crate) fn session(&self) -> String {
        self.derive("session")
    }

    /// The CSRF token the pages put in every form.
    pub(crate) fn csrf(&self) -> String {
        self.derive("csrf")
    }

    /// Whether `given` is the operator's token.
    pub(crate) fn is_token(&self, given: &str) -> bool {
        self.token
            .as_deref()
            .is_some_and(|token| bool::from(token.as_bytes().ct_eq(given.as_bytes())))
    }

    /// Whether `given` is the CSRF token.
    pub(crate) fn is_csrf(&self, given: &str) -> bool {
        bool::from(self.csrf().as_bytes().ct_eq(given.as_bytes()))
    }

    /// Whether a request may see the dashboard: no token required, or a
    /// bearer token, or the session cookie.
    pub(crate) fn allows(&self, headers: &HeaderMap) -> bool {
        if !self.required() {
            return true;
        }
        let bearer = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if bearer.is_some_and(|given| self.is_token(given.trim())) {
            return true;
        }
        CookieJar::from_headers(headers)
            .get(SESSION_COOKIE)
            .is_some_and(|cookie| {
                bool::from(self.session().as_bytes().ct_eq(cookie.value().as_bytes()))
            })
    }

    /// The session cookie: sent back only over HTTP (no script reads it),
    /// and only by this site's own pages.
    fn session_cookie(&self) -> Cookie<'static> {
        Cookie::build((SESSION_COOKIE, self.session()))
            .http_only(true)
            .same_site(SameSite::Strict)
            .path("/")
            .build()
    }
}

/// Every page but the sign-in and the assets: the token, or the cookie.
pub(crate) async fn signed_in(State(app): Shared, request: Request, next: Next) -> Response {
    if app.auth.allows(request.headers()) {
        return next.run(request).await;
    }
    let wants_html = request
        .headers()
        .get(ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"));
    if wants_html && request.method() == Method::GET {
        // A browser: the sign-in page (still a 401, for scripts that look).
        return (
            StatusCode::UNAUTHORIZED,
            Html(pages::layout("Sign in", &pages::login(false), false)),
        )
            .into_response();
    }
    (
        StatusCode::UNAUTHORIZED,
        [(WWW_AUTHENTICATE, "Bearer")],
        "a token is required\n",
    )
        .into_response()
}

pub(crate) async fn login_page() -> Html<String> {
    Html(pages::layout("Sign in", &pages::login(false), false))
}

#[derive(Deserialize)]
pub(crate) struct LoginForm {
    token: String,
}

/// The token, given once: the session cookie, and the overview.
pub(crate) async fn login(
    State(app): Shared,
    jar: CookieJar,
    Form(form): Form<LoginForm>,
) -> Response {
    if !app.auth.is_token(&form.token) {
        return (
            StatusCode::UNAUTHORIZED,
            Html(pages::layout("Sign in", &pages::login(true), false)),
        )
            .into_response();
    }
    (jar.add(app.auth.session_cookie()), Redirect::to("/")).into_response()
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use axum::http::header::COOKIE;

    use super::*;

    #[test]
    fn a_token_is_needed_when_one_is_set() {
        let open = Auth::new(None);
        assert!(open.allows(&HeaderMap::new()));
        let auth = Auth::new(Some("s3cret".into()));
        assert!(!auth.allows(&HeaderMap::new()));
        let mut bearer = HeaderMap::new();
        bearer.insert(AUTHORIZATION, HeaderValue::from_static("Bearer s3cret"));
        assert!(auth.allows(&bearer));
        let mut wrong = HeaderMap::new();
        wrong.insert(AUTHORIZATION, HeaderValue::from_static("Bearer s3cre"));
        assert!(!auth.allows(&wrong));
        let mut cookie = HeaderMap::new();
        let value = format!("a=b; {SESSION_COOKIE}={}", auth.session());
        cookie.insert(COOKIE, HeaderValue::from_str(&value).unwrap());
        assert!(auth.allows(&cookie));
        assert!(auth.is_csrf(&auth.csrf()));
        assert!(!auth.is_csrf("x"));
        let mut forged = HeaderMap::new();
        forged.insert(COOKIE, HeaderValue::from_static("idempo_session=00"));
        assert!(!auth.allows(&forged));
    }

    #[test]
    fn the_session_cookie_is_http_only_and_same_site() {
        let auth = Auth::new(Some("s3cret".into()));
        let set = auth.session_cookie().to_string();
        assert!(
            set.starts_with(&format!("{SESSION_COOKIE}={}", auth.session())),
            "{set}"
        );
        for attribute in ["HttpOnly", "SameSite=Strict", "Path=/"] {
            assert!(set.contains(attribute), "{set}");
        }
    }
}
