//! `idempo dashboard`: the web pages for the people on call, over the same
//! library functions as the other commands ([`idempo::ops::status`],
//! [`idempo::dead_letters`]). Server-rendered (`pages.rs`), assets
//! embedded, token and CSRF checks in `auth.rs`.

mod auth;
mod pages;
mod samples;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, bail};
use axum::Router;
use axum::extract::{ConnectInfo, Form, Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use clap::Args;
use idempo::dead_letters::{self as store, Filter, ReplayOptions};
use idempo::ops::Services;
use idempo::ops::management::Management;
use serde::Deserialize;

use crate::Ctx;
use auth::{Auth, SESSION_COOKIE};

/// Where the dashboard listens unless told.
const DEFAULT_LISTEN: &str = "127.0.0.1:8740";

#[derive(Args)]
pub(crate) struct DashboardArgs {
    /// The address and port to listen on; a non-loopback one needs --token.
    #[arg(long, value_name = "ADDR:PORT", default_value = DEFAULT_LISTEN)]
    listen: SocketAddr,
    /// The token every request must carry (`Authorization: Bearer`, or the
    /// session cookie its sign-in page sets).
    #[arg(long, env = "IDEMPO_DASHBOARD_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Show no action and refuse every one.
    #[arg(long)]
    read_only: bool,
    /// How often the overview's charts are sampled (they cover 15 minutes).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, default_value = "10s")]
    sample_every: std::time::Duration,
    /// RabbitMQ's management API (`http://user:password@host:15672`), for
    /// the queues' unacked messages; by default the first AMQP node's host,
    /// port 15672, with the AMQP URL's credentials. Optional: without it the
    /// overview shows everything else.
    #[arg(
        long,
        value_name = "URL",
        env = "RABBITMQ_MANAGEMENT_URL",
        hide_env_values = true
    )]
    management_url: Option<String>,
}

struct App {
    services: Services,
    auth: Auth,
    read_only: bool,
    samples: samples::Samples,
    sample_every: std::time::Duration,
}

type Shared = State<Arc<App>>;

pub(crate) async fn exec(ctx: &Ctx, args: DashboardArgs) -> anyhow::Result<u8> {
    if !args.listen.ip().is_loopback() && args.token.is_none() {
        bail!(
            "refusing to listen on {} without a token: anyone who reaches that address could \
             replay and delete dead letters; pass --token (or IDEMPO_DASHBOARD_TOKEN), or listen \
             on 127.0.0.1",
            args.listen
        );
    }
    if args.token.as_deref().is_some_and(str::is_empty) {
        bail!("--token must not be empty");
    }
    let management = match &args.management_url {
        // A URL the operator gave must work: say so at start.
        Some(url) => Ok(Management::new(url)?),
        None => Management::for_services(&ctx.services).map_err(|e| e.to_string()),
    };
    let every = args.sample_every.max(std::time::Duration::from_millis(100));
    let app = Arc::new(App {
        services: ctx.services.clone(),
        auth: Auth::new(args.token),
        read_only: args.read_only,
        samples: samples::Samples::new(management),
        sample_every: every,
    });
    let sampler = app.clone();
    tokio::spawn(async move {
        loop {
            if let Err(e) = sampler.samples.take(&sampler.services).await {
                tracing::warn!(error = %e, "dashboard: sample not taken");
            }
            tokio::time::sleep(every).await;
        }
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let local = listener.local_addr()?;
    println!("idempo dashboard listening on http://{local}/");
    axum::serve(
        listener,
        router(app).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(0)
}

fn router(app: Arc<App>) -> Router {
    let pages = Router::new()
        .route("/", get(overview))
        .route("/dead-letters", get(dead_letters))
        .route("/dead-letters/group", get(group))
        .route("/dead-letters/{id}", get(letter))
        .route("/dead-letters/replay", post(replay))
        .route("/dead-letters/discard", post(discard))
        .route("/dead-letters/purge", post(purge))
        .route("/outbox", get(outbox))
        .route("/outbox/retry", post(outbox_retry))
        .route("/outbox/discard", post(outbox_discard))
        .route_layer(middleware::from_fn_with_state(app.clone(), signed_in));
    Router::new()
        .merge(pages)
        .route("/login", get(login_page).post(login))
        .route("/assets/style.css", get(style))
        .route("/assets/refresh.js", get(script))
        .with_state(app)
}

/// Every page but the sign-in and the assets: the token, or the cookie.
async fn signed_in(State(app): Shared, request: Request, next: Next) -> Response {
    if app.auth.allows(request.headers()) {
        return next.run(request).await;
    }
    let wants_html = request
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"));
    if wants_html && request.method() == axum::http::Method::GET {
        // A browser: the sign-in page (still a 401, for scripts that look).
        return (
            StatusCode::UNAUTHORIZED,
            Html(pages::layout("Sign in", &pages::login(false), false)),
        )
            .into_response();
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        "a token is required\n",
    )
        .into_response()
}

/// A failure shown as a page, without a password or URL of a service.
fn failure(e: impl std::fmt::Display) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Html(pages::layout(
            "Unavailable",
            &format!(
                "<h1>Unavailable</h1><p class=red>{}</p>",
                html_escape::encode_text(&e.to_string())
            ),
            true,
        )),
    )
        .into_response()
}

/// Renders the latest sample: a page costs no query.
async fn overview(State(app): Shared) -> Response {
    match app.samples.latest(&app.services).await {
        Ok(latest) => {
            let body = pages::overview(&latest, &app.samples.charts(), app.sample_every);
            Html(pages::layout("Overview", &body, true)).into_response()
        }
        Err(e) => failure(e),
    }
}

#[derive(Deserialize)]
struct QueueQuery {
    queue: Option<String>,
    fingerprint: Option<String>,
    /// Paging a group: the letters after this row.
    after: Option<i64>,
}

/// Letters per page of a group.
const PAGE: i64 = 100;

async fn dead_letters(State(app): Shared, Query(q): Query<QueueQuery>) -> Response {
    let filter = Filter {
        queue: q.queue.clone().filter(|q| !q.is_empty()),
        ..Filter::default()
    };
    let pool = match app.services.database().await {
        Ok(pool) => pool,
        Err(e) => return failure(e),
    };
    let groups = match store::groups(pool, &filter).await {
        Ok(groups) => groups,
        Err(e) => return failure(e),
    };
    let mut body = pages::groups(filter.queue.as_deref(), &groups);
    // Not kept in the table: the queue's RabbitMQ DLQ, shown read-only
    // (browsed without spending a delivery attempt).
    if let (true, Some(queue)) = (groups.is_empty(), &filter.queue) {
        match idempo::ops::dlq::list(&app.services, queue, &Default::default(), 100).await {
            Ok(listing) => body.push_str(&pages::queue_dlq(&listing)),
            Err(e) => body.push_str(&format!(
                "<p class=rule>{}</p>",
                html_escape::encode_text(&e.to_string())
            )),
        }
    }
    Html(pages::layout("Dead letters", &body, true)).into_response()
}

async fn group(State(app): Shared, Query(q): Query<QueueQuery>) -> Response {
    let (Some(queue), Some(fingerprint)) = (q.queue, q.fingerprint) else {
        return (
            StatusCode::BAD_REQUEST,
            "queue and fingerprint are required\n",
        )
            .into_response();
    };
    let pool = match app.services.database().await {
        Ok(pool) => pool,
        Err(e) => return failure(e),
    };
    let filter = Filter {
        fingerprint: Some(fingerprint.clone()),
        limit: Some(PAGE),
        after_id: q.after,
        ..Filter::queue(queue.as_str())
    };
    match store::list(pool, &filter).await {
        Ok(letters) => {
            let csrf = (!app.read_only).then(|| app.auth.csrf());
            let mut body = pages::group(&queue, &fingerprint, &letters, csrf.as_deref());
            if let (true, Some(last)) = (letters.len() as i64 == PAGE, letters.last()) {
                body.push_str(&format!(
                    "<p><a href=\"/dead-letters/group?queue={}&amp;fingerprint={}&amp;after={}\">next page</a></p>",
                    html_escape::encode_double_quoted_attribute(&pages::urlencode(&queue)),
                    html_escape::encode_double_quoted_attribute(&pages::urlencode(&fingerprint)),
                    last.id
                ));
            }
            Html(pages::layout("Dead letters of one cause", &body, true)).into_response()
        }
        Err(e) => failure(e),
    }
}

async fn letter(State(app): Shared, Path(id): Path<i64>) -> Response {
    let pool = match app.services.database().await {
        Ok(pool) => pool,
        Err(e) => return failure(e),
    };
    match store::show(pool, id).await {
        Ok(Some(detail)) => {
            let csrf = (!app.read_only).then(|| app.auth.csrf());
            Html(pages::layout(
                "Dead letter",
                &pages::letter(&detail, csrf.as_deref()),
                false,
            ))
            .into_response()
        }
        Ok(None) => (StatusCode::NOT_FOUND, "no such dead letter\n").into_response(),
        Err(e) => failure(e),
    }
}

/// An action's form: one letter (`id`) or one cause (`queue` +
/// `fingerprint`), the CSRF token, and `confirm` once confirmed.
#[derive(Deserialize)]
struct ActionForm {
    csrf: Option<String>,
    id: Option<i64>,
    queue: Option<String>,
    fingerprint: Option<String>,
    confirm: Option<String>,
}

impl ActionForm {
    fn filter(&self) -> Option<Filter> {
        match (self.id, &self.queue, &self.fingerprint) {
            (Some(id), _, _) => Some(Filter {
                ids: vec![id],
                ..Filter::default()
            }),
            (None, Some(queue), Some(fingerprint)) => Some(Filter {
                fingerprint: Some(fingerprint.clone()),
                ..Filter::queue(queue.as_str())
            }),
            _ => None,
        }
    }

    fn fields(&self) -> Vec<(&'static str, String)> {
        let mut fields = Vec::new();
        if let Some(id) = self.id {
            fields.push(("id", id.to_string()));
        }
        if let Some(queue) = &self.queue {
            fields.push(("queue", queue.clone()));
        }
        if let Some(fingerprint) = &self.fingerprint {
            fields.push(("fingerprint", fingerprint.clone()));
        }
        fields
    }
}

/// The checks every action passes first: not read-only, the CSRF token, a
/// selection.
fn admit(app: &App, form: &ActionForm) -> Result<Filter, (StatusCode, &'static str)> {
    if app.read_only {
        return Err((StatusCode::FORBIDDEN, "the dashboard is read-only\n"));
    }
    if !form.csrf.as_deref().is_some_and(|t| app.auth.is_csrf(t)) {
        return Err((StatusCode::FORBIDDEN, "missing or wrong CSRF token\n"));
    }
    form.filter().ok_or((
        StatusCode::BAD_REQUEST,
        "say which letters: id, or queue and fingerprint\n",
    ))
}

/// The confirmation step of an action on `count` letters: the same form
/// again, with `confirm`.
fn confirmation(app: &App, form: &ActionForm, what: &str, path: &str, count: u64) -> Response {
    let fields = form.fields();
    let fields: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Html(pages::layout(
        "Confirm",
        &pages::confirm(
            (what, count, "dead letter(s)"),
            path,
            "/dead-letters",
            &app.auth.csrf(),
            &fields,
        ),
        false,
    ))
    .into_response()
}

fn operator(from: SocketAddr) -> String {
    format!("idempo-dashboard:{}", from.ip())
}

/// What an action does to the letters it selects.
#[derive(Clone, Copy)]
enum Act {
    Replay,
    Discard,
    Delete,
}

impl Act {
    fn label(self) -> &'static str {
        match self {
            Act::Replay => "Replay",
            Act::Discard => "Discard",
            Act::Delete => "Delete",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Act::Replay => "/dead-letters/replay",
            Act::Discard => "/dead-letters/discard",
            Act::Delete => "/dead-letters/purge",
        }
    }
}

async fn replay(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    Form(form): Form<ActionForm>,
) -> Response {
    act(&app, from, &form, Act::Replay).await
}

async fn discard(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    Form(form): Form<ActionForm>,
) -> Response {
    act(&app, from, &form, Act::Discard).await
}

async fn purge(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    Form(form): Form<ActionForm>,
) -> Response {
    act(&app, from, &form, Act::Delete).await
}

/// An action: admitted, then the count of what it selects and a
/// confirmation, then (confirmed) done, logged with the operator's address.
async fn act(app: &App, from: SocketAddr, form: &ActionForm, act: Act) -> Response {
    let filter = match admit(app, form) {
        Ok(filter) => filter,
        Err(refused) => return refused.into_response(),
    };
    let pool = match app.services.database().await {
        Ok(pool) => pool,
        Err(e) => return failure(e),
    };
    if form.confirm.as_deref() != Some("1") {
        return match store::count(pool, &filter).await {
            Ok(count) => confirmation(app, form, act.label(), act.path(), count),
            Err(e) => failure(e),
        };
    }
    let done = match act {
        Act::Replay => store::replay(pool, &filter, &ReplayOptions::by(operator(from)), |_| {})
            .await
            .map(|report| {
                let mut message = format!(
                    "{} replayed through the outbox (the consumers' relay publishes them), {} skipped",
                    report.replayed,
                    report.skipped.len()
                );
                for (row, why) in &report.skipped {
                    message.push_str(&format!("; row {row}: {why}"));
                }
                message
            }),
        Act::Discard => store::discard(pool, &filter, &operator(from))
            .await
            .map(|n| format!("{n} discarded (kept for audit until reaped)")),
        Act::Delete => store::purge(pool, &filter)
            .await
            .map(|n| format!("{n} deleted")),
    };
    match done {
        Ok(message) => {
            tracing::warn!(operator = %from, "dashboard: {message}");
            eprintln!("dashboard: {}: {message}", from.ip());
            Html(pages::layout("Done", &pages::done(&message), false)).into_response()
        }
        Err(e) => failure(e),
    }
}

#[derive(Deserialize)]
struct OutboxForm {
    csrf: Option<String>,
    id: Option<i64>,
    confirm: Option<String>,
}

async fn outbox_retry(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    Form(form): Form<OutboxForm>,
) -> Response {
    outbox_act(&app, from, &form, false).await
}

async fn outbox_discard(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    Form(form): Form<OutboxForm>,
) -> Response {
    outbox_act(&app, from, &form, true).await
}

/// Failed outbox rows (one, or all) put back to pending, or discarded.
async fn outbox_act(app: &App, from: SocketAddr, form: &OutboxForm, discard: bool) -> Response {
    if app.read_only {
        return (StatusCode::FORBIDDEN, "the dashboard is read-only\n").into_response();
    }
    if !form.csrf.as_deref().is_some_and(|t| app.auth.is_csrf(t)) {
        return (StatusCode::FORBIDDEN, "missing or wrong CSRF token\n").into_response();
    }
    let pool = match app.services.database().await {
        Ok(pool) => pool,
        Err(e) => return failure(e),
    };
    let ids = form.id.map(|id| vec![id]);
    if discard && form.confirm.as_deref() != Some("1") {
        // Deleting cannot be undone: say how many first.
        let count = match (&ids, idempo::outbox::status(pool).await) {
            (Some(_), _) => 1,
            (None, Ok(status)) => status.failed.max(0) as u64,
            (None, Err(e)) => return failure(e),
        };
        let id = form.id.map(|id| id.to_string());
        let fields: Vec<(&str, &str)> = id.iter().map(|id| ("id", id.as_str())).collect();
        return Html(pages::layout(
            "Confirm",
            &pages::confirm(
                ("Discard", count, "failed outbox row(s)"),
                "/outbox/discard",
                "/outbox",
                &app.auth.csrf(),
                &fields,
            ),
            false,
        ))
        .into_response();
    }
    let done = if discard {
        idempo::outbox::discard_failed(pool, ids.as_deref())
            .await
            .map(|n| format!("{n} failed row(s) discarded"))
    } else {
        idempo::outbox::retry_failed(pool, ids.as_deref())
            .await
            .map(|n| format!("{n} failed row(s) back to pending"))
    };
    match done {
        Ok(message) => {
            tracing::warn!(operator = %from, "dashboard: outbox: {message}");
            eprintln!("dashboard: {}: outbox: {message}", from.ip());
            Html(pages::layout(
                "Done",
                &format!(
                    "<h1>Done</h1><p class=result>{message}</p><p><a href=/outbox>Back to the outbox</a></p>"
                ),
                false,
            ))
            .into_response()
        }
        Err(e) => failure(e),
    }
}

async fn outbox(State(app): Shared) -> Response {
    let pool = match app.services.database().await {
        Ok(pool) => pool,
        Err(e) => return failure(e),
    };
    let (status, pending, failed) = tokio::join!(
        idempo::outbox::status(pool),
        idempo::outbox::pending_by_destination(pool, 200),
        idempo::outbox::failed(pool, 200),
    );
    match (status, pending, failed) {
        (Ok(status), Ok(pending), Ok(failed)) => {
            let csrf = (!app.read_only).then(|| app.auth.csrf());
            let body = pages::outbox(&status, &pending, &failed, csrf.as_deref());
            Html(pages::layout("Outbox", &body, true)).into_response()
        }
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => failure(e),
    }
}

async fn login_page() -> Html<String> {
    Html(pages::layout("Sign in", &pages::login(false), false))
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(State(app): Shared, Form(form): Form<LoginForm>) -> Response {
    if !app.auth.is_token(&form.token) {
        return (
            StatusCode::UNAUTHORIZED,
            Html(pages::layout("Sign in", &pages::login(true), false)),
        )
            .into_response();
    }
    let cookie = format!(
        "{SESSION_COOKIE}={}; HttpOnly; SameSite=Strict; Path=/",
        app.auth.session()
    );
    let mut response = Redirect::to("/").into_response();
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

async fn style() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        pages::STYLE,
    )
}

async fn script() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        pages::SCRIPT,
    )
}
