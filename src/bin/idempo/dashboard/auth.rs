//! Who may use the dashboard: the `--token` (a bearer header, or a session
//! its sign-in page opens), the CSRF token every action carries, and who
//! acted, for the audit trail. Secrets are compared in constant time;
//! failed sign-ins are logged and slowed down per address.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::Form;
use axum::extract::{ConnectInfo, Request, State};
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

/// How long a session lasts after its sign-in.
const SESSION_LIFETIME: Duration = Duration::from_secs(12 * 3600);

/// The shortest token `--token` takes.
pub(crate) const MIN_TOKEN_LEN: usize = 12;

/// Who made a request, as the audit trail records it (an extension the
/// sign-in check puts on every request it lets through).
#[derive(Clone, Debug)]
pub(crate) struct Identity(pub(crate) String);

/// One signed-in browser.
struct Session {
    /// Short, for the audit trail (not the secret).
    label: String,
    expires: Instant,
}

/// Failed sign-ins of one address.
struct Failures {
    count: u32,
    /// No attempt is looked at before this.
    locked_until: Instant,
}

/// The dashboard's secrets: the operator's token, a key of this process
/// for the CSRF tokens, the open sessions and the failed sign-ins.
pub(crate) struct Auth {
    token: Option<String>,
    key: [u8; 32],
    sessions: Mutex<HashMap<String, Session>>,
    failures: Mutex<HashMap<IpAddr, Failures>>,
}

impl Auth {
    pub(crate) fn new(token: Option<String>) -> Self {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).expect("the operating system gives random bytes");
        Auth {
            token,
            key,
            sessions: Mutex::default(),
            failures: Mutex::default(),
        }
    }

    /// Whether a token is required.
    pub(crate) fn required(&self) -> bool {
        self.token.is_some()
    }

    /// The CSRF token of `session` (or of this process, without sessions):
    /// the pages put it in every form.
    pub(crate) fn csrf(&self, session: Option<&str>) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("any key length");
        mac.update(b"csrf");
        if let Some(session) = session {
            mac.update(session.as_bytes());
        }
        hex::encode(mac.finalize().into_bytes())
    }

    /// Whether `given` is the CSRF token of `session`.
    pub(crate) fn is_csrf(&self, session: Option<&str>, given: &str) -> bool {
        bool::from(self.csrf(session).as_bytes().ct_eq(given.as_bytes()))
    }

    /// Whether `given` is the operator's token.
    fn is_token(&self, given: &str) -> bool {
        self.token
            .as_deref()
            .is_some_and(|token| bool::from(token.as_bytes().ct_eq(given.as_bytes())))
    }

    /// Who a request comes from, if it may see the dashboard: anyone when
    /// no token is required; else a bearer token, or an open session.
    fn identify(&self, headers: &HeaderMap) -> Option<String> {
        if !self.required() {
            return Some("local".into());
        }
        let bearer = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if bearer.is_some_and(|given| self.is_token(given.trim())) {
            return Some("bearer".into());
        }
        let cookie = CookieJar::from_headers(headers)
            .get(SESSION_COOKIE)
            .map(|c| c.value().to_owned())?;
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        sessions.retain(|_, s| s.expires > now);
        // Constant time per comparison: the ids are 256-bit random.
        sessions
            .iter()
            .find(|(id, _)| bool::from(id.as_bytes().ct_eq(cookie.as_bytes())))
            .map(|(_, s)| s.label.clone())
    }

    /// A new session: its secret id and its label.
    fn open_session(&self) -> (String, String) {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).expect("the operating system gives random bytes");
        let id = hex::encode(bytes);
        let label = format!("session-{}", &id[..8]);
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                id.clone(),
                Session {
                    label: label.clone(),
                    expires: Instant::now() + SESSION_LIFETIME,
                },
            );
        (id, label)
    }

    fn close_session(&self, id: &str) {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }

    /// How long `from` must still wait before its next sign-in attempt.
    fn locked(&self, from: IpAddr) -> Option<Duration> {
        let failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let left = failures
            .get(&from)?
            .locked_until
            .checked_duration_since(Instant::now())?;
        Some(left)
    }

    /// Counts a failed sign-in of `from`: 1 s after the third, doubling to
    /// 5 minutes.
    fn failed(&self, from: IpAddr) -> u32 {
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if failures.len() > 10_000 {
            // Bounded: the oldest locks are over anyway.
            let now = Instant::now();
            failures.retain(|_, f| f.locked_until > now);
        }
        let entry = failures.entry(from).or_insert(Failures {
            count: 0,
            locked_until: Instant::now(),
        });
        entry.count = entry.count.saturating_add(1);
        if entry.count >= 3 {
            let exponent = (entry.count - 3).min(9);
            let wait = Duration::from_secs(1 << exponent).min(Duration::from_secs(300));
            entry.locked_until = Instant::now() + wait;
        }
        entry.count
    }

    fn succeeded(&self, from: IpAddr) {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&from);
    }
}

/// The session cookie: sent back only over HTTP (no script reads it), only
/// by this site's own pages, for the session's lifetime; `Secure` when the
/// dashboard is reached over TLS (a proxy in front says so).
fn session_cookie(value: String, headers: &HeaderMap) -> Cookie<'static> {
    let tls = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|p| p.eq_ignore_ascii_case("https"));
    // Max-Age through the parser: the builder wants the `time` crate's type.
    let mut cookie = Cookie::parse(format!(
        "{SESSION_COOKIE}={value}; Max-Age={}",
        SESSION_LIFETIME.as_secs()
    ))
    .expect("a hex value and a number parse");
    cookie.set_http_only(true);
    cookie.set_same_site(SameSite::Strict);
    cookie.set_path("/");
    cookie.set_secure(tls);
    cookie
}

/// Who is asking, for a page handler: their identity (from the sign-in
/// check), their session (for the CSRF token) and their address.
pub(crate) struct Caller {
    identity: String,
    session: Option<String>,
    from: SocketAddr,
}

impl Caller {
    /// The CSRF token this caller's forms carry.
    pub(crate) fn csrf(&self, auth: &Auth) -> String {
        auth.csrf(self.session.as_deref())
    }

    /// Whether `given` is this caller's CSRF token.
    pub(crate) fn is_csrf(&self, auth: &Auth, given: Option<&str>) -> bool {
        given.is_some_and(|t| auth.is_csrf(self.session.as_deref(), t))
    }

    /// Who acted, as the letters and the log record it:
    /// `idempo-dashboard:<session or bearer>@<address>`.
    pub(crate) fn operator(&self) -> String {
        format!("idempo-dashboard:{}@{}", self.identity, self.from.ip())
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        let identity = parts
            .extensions
            .get::<Identity>()
            .map_or_else(|| "anonymous".into(), |i| i.0.clone());
        let from = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |c| c.0);
        Ok(Caller {
            identity,
            session: session_of(&parts.headers),
            from,
        })
    }
}

/// The session id of a request, if it carries one.
pub(crate) fn session_of(headers: &HeaderMap) -> Option<String> {
    CookieJar::from_headers(headers)
        .get(SESSION_COOKIE)
        .map(|c| c.value().to_owned())
}

/// Every page but the sign-in and the assets: the token, or a session. The
/// request goes on with its [`Identity`].
pub(crate) async fn signed_in(State(app): Shared, mut request: Request, next: Next) -> Response {
    if let Some(who) = app.auth.identify(request.headers()) {
        request.extensions_mut().insert(Identity(who));
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

/// The token, given once: a new session, and the overview. A wrong one is
/// logged, and an address that keeps trying waits longer each time.
pub(crate) async fn login(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    jar: CookieJar,
    Form(form): Form<LoginForm>,
) -> Response {
    if let Some(wait) = app.auth.locked(from.ip()) {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [(
                axum::http::header::RETRY_AFTER,
                wait.as_secs().max(1).to_string(),
            )],
            "too many failed sign-ins from this address: wait and try again\n",
        )
            .into_response();
    }
    if !app.auth.is_token(&form.token) {
        let count = app.auth.failed(from.ip());
        tracing::warn!(address = %from.ip(), count, "dashboard: failed sign-in");
        eprintln!(
            "dashboard: failed sign-in from {} ({count} in a row)",
            from.ip()
        );
        return (
            StatusCode::UNAUTHORIZED,
            Html(pages::layout("Sign in", &pages::login(true), false)),
        )
            .into_response();
    }
    app.auth.succeeded(from.ip());
    let (id, label) = app.auth.open_session();
    tracing::info!(address = %from.ip(), session = %label, "dashboard: signed in");
    eprintln!("dashboard: {} signed in as {label}", from.ip());
    (jar.add(session_cookie(id, &headers)), Redirect::to("/")).into_response()
}

/// The sign-out page: one button, posting the caller's CSRF token.
pub(crate) async fn logout_page(State(app): Shared, caller: Caller) -> Html<String> {
    let body = maud::html! {
        h1 { "Sign out" }
        form method="post" action="/logout" {
            input type="hidden" name="csrf" value=(caller.csrf(&app.auth));
            button type="submit" { "Sign out" }
        }
    };
    Html(pages::layout("Sign out", &body.into_string(), false))
}

#[derive(Deserialize)]
pub(crate) struct LogoutForm {
    csrf: Option<String>,
}

/// Ends the request's session (with its CSRF token) and clears the cookie.
pub(crate) async fn logout(
    State(app): Shared,
    jar: CookieJar,
    headers: HeaderMap,
    Form(form): Form<LogoutForm>,
) -> Response {
    let session = session_of(&headers);
    let valid = form
        .csrf
        .as_deref()
        .is_some_and(|t| app.auth.is_csrf(session.as_deref(), t));
    if !valid {
        return (StatusCode::FORBIDDEN, "a valid CSRF token is required\n").into_response();
    }
    if let Some(id) = &session {
        app.auth.close_session(id);
    }
    let gone = Cookie::build((SESSION_COOKIE, "")).path("/").build();
    (jar.remove(gone), Redirect::to("/login")).into_response()
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use axum::http::header::COOKIE;

    use super::*;

    fn with_cookie(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let value = format!("a=b; {SESSION_COOKIE}={value}");
        headers.insert(COOKIE, HeaderValue::from_str(&value).unwrap());
        headers
    }

    #[test]
    fn a_token_or_an_open_session_is_needed_when_a_token_is_set() {
        let open = Auth::new(None);
        assert_eq!(open.identify(&HeaderMap::new()).as_deref(), Some("local"));
        let auth = Auth::new(Some("s3cret-token".into()));
        assert!(auth.identify(&HeaderMap::new()).is_none());
        let mut bearer = HeaderMap::new();
        bearer.insert(
            AUTHORIZATION,
            HeaderValue::from_static("Bearer s3cret-token"),
        );
        assert_eq!(auth.identify(&bearer).as_deref(), Some("bearer"));
        let mut wrong = HeaderMap::new();
        wrong.insert(
            AUTHORIZATION,
            HeaderValue::from_static("Bearer s3cret-toke"),
        );
        assert!(auth.identify(&wrong).is_none());
        let (one, label) = auth.open_session();
        let (two, _) = auth.open_session();
        assert_ne!(one, two, "each sign-in has a session of its own");
        assert_eq!(auth.identify(&with_cookie(&one)), Some(label));
        assert!(auth.identify(&with_cookie("00")).is_none());
        auth.close_session(&one);
        assert!(auth.identify(&with_cookie(&one)).is_none(), "logged out");
        assert!(auth.identify(&with_cookie(&two)).is_some());
        // CSRF tokens are per session.
        assert!(auth.is_csrf(Some(&two), &auth.csrf(Some(&two))));
        assert!(!auth.is_csrf(Some(&two), &auth.csrf(Some(&one))));
        assert!(!auth.is_csrf(None, "x"));
    }

    #[test]
    fn failed_sign_ins_lock_the_address_out_longer_each_time() {
        let auth = Auth::new(Some("s3cret-token".into()));
        let from: IpAddr = "192.0.2.1".parse().unwrap();
        assert!(auth.locked(from).is_none());
        auth.failed(from);
        auth.failed(from);
        assert!(auth.locked(from).is_none(), "two mistakes are free");
        auth.failed(from);
        let first = auth.locked(from).expect("locked after the third");
        auth.failed(from);
        assert!(auth.locked(from).unwrap() > first);
        auth.succeeded(from);
        assert!(auth.locked(from).is_none());
    }

    #[test]
    fn the_session_cookie_is_http_only_same_site_and_expires() {
        let mut headers = HeaderMap::new();
        let plain = session_cookie("v".into(), &headers).to_string();
        for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=43200"] {
            assert!(plain.contains(attribute), "{plain}");
        }
        assert!(!plain.contains("Secure"), "{plain}");
        headers.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        let tls = session_cookie("v".into(), &headers).to_string();
        assert!(tls.contains("Secure"), "{tls}");
    }
}
