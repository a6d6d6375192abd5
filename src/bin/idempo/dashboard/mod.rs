//! `idempo dashboard`: the web pages for the people on call, over the same
//! library functions as the other commands ([`Services::status`](idempo::ops::Services::status),
//! [`idempo::ops::dead_letters`]). Server-rendered from auto-escaping
//! templates (`pages.rs`), assets embedded; sessions, the token and CSRF
//! checks in `auth.rs`; the checks and headers of every request in
//! `guard.rs`; a server with bounded connections in `serve.rs`; the pages
//! of the dead letters in `letters.rs` and their actions in `actions.rs`,
//! the outbox's in `outbox.rs`; a handler's failure is a
//! [`Failure`](failure::Failure).

mod actions;
mod auth;
mod failure;
mod guard;
mod letter_pages;
mod letters;
mod outbox;
mod overview_page;
mod pages;
mod samples;
mod serve;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, bail};
use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::middleware;
use axum::response::{Html, IntoResponse};
use axum::routing::{get, post};
use clap::Args;
use idempo::ops::Services;
use idempo::ops::management::Management;
use sqlx::PgPool;

use crate::Ctx;
use auth::{Auth, Caller};
use failure::Failure;

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
    /// A trace backend's page for a trace, with `{trace_id}` where the id
    /// goes (`http://jaeger:16686/trace/{trace_id}`): a dead letter's
    /// trace id becomes a link to it.
    #[arg(long, value_name = "TEMPLATE", env = "IDEMPO_TRACE_URL")]
    trace_url: Option<String>,
}

struct App {
    services: Services,
    /// Where a probe asks why PostgreSQL does not answer.
    database_url: String,
    auth: Auth,
    read_only: bool,
    samples: samples::Samples,
    sample_every: std::time::Duration,
    dlq_views: letters::DlqViews,
    /// `--trace-url`, checked.
    trace_url: Option<String>,
}

impl App {
    /// The database pool; when PostgreSQL does not answer, why (the pool
    /// alone would say only that it timed out).
    async fn database(&self) -> Result<&PgPool, Failure> {
        match self.services.database().await {
            Ok(pool) => Ok(pool),
            Err(e) => {
                let e = crate::errors::with_cause(e.into(), &self.database_url).await;
                Err(Failure::Unavailable(crate::errors::error_line(&e)))
            }
        }
    }

    /// The checks every action passes first: not read-only, and the
    /// caller's CSRF token.
    fn admit(&self, caller: &Caller, csrf: Option<&str>) -> Result<(), Failure> {
        if self.read_only {
            return Err(Failure::READ_ONLY);
        }
        if !caller.is_csrf(&self.auth, csrf) {
            return Err(Failure::CSRF);
        }
        Ok(())
    }

    /// The CSRF token of `caller`'s forms, or none in read-only mode.
    fn csrf(&self, caller: &Caller) -> Option<String> {
        (!self.read_only).then(|| caller.csrf(&self.auth))
    }
}

type Shared = State<Arc<App>>;

/// What a page handler answers.
type Page = Result<Html<String>, Failure>;

pub(crate) async fn exec(ctx: &Ctx, args: DashboardArgs) -> anyhow::Result<u8> {
    if !args.listen.ip().is_loopback() && args.token.is_none() {
        bail!(
            "refusing to listen on {} without a token: anyone who reaches that address could \
             replay and delete dead letters; pass --token (or IDEMPO_DASHBOARD_TOKEN), or listen \
             on 127.0.0.1",
            args.listen
        );
    }
    if args
        .token
        .as_deref()
        .is_some_and(|t| t.chars().count() < auth::MIN_TOKEN_LEN)
    {
        bail!(
            "--token must be at least {} characters: a short one is guessed (e.g. `openssl rand -hex 16`)",
            auth::MIN_TOKEN_LEN
        );
    }
    let management = match &args.management_url {
        // A URL the operator gave must work: say so at start.
        Some(url) => Ok(Management::new(url)?),
        None => Management::for_services(&ctx.services).map_err(|e| e.to_string()),
    };
    if let Some(template) = &args.trace_url {
        letter_pages::check_trace_url(template)?;
    }
    let every = args.sample_every.max(std::time::Duration::from_millis(100));
    let app = Arc::new(App {
        // Concurrent actions each hold a connection (a replay's batch).
        services: ctx.services.clone().max_connections(8),
        database_url: ctx.database_url.clone(),
        auth: Auth::new(args.token),
        read_only: args.read_only,
        samples: samples::Samples::new(management),
        sample_every: every,
        dlq_views: letters::DlqViews::default(),
        trace_url: args.trace_url.filter(|t| !t.is_empty()),
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
    serve::serve(listener, router(app), async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await;
    Ok(0)
}

fn router(app: Arc<App>) -> Router {
    let pages = Router::new()
        .route("/", get(overview))
        .route("/dead-letters", get(letters::dead_letters))
        .route("/dead-letters/group", get(letters::group))
        .route("/dead-letters/{id}", get(letters::letter))
        .route("/dead-letters/replay", post(actions::replay))
        .route("/dead-letters/discard", post(actions::discard))
        .route("/dead-letters/purge", post(actions::purge))
        .route("/outbox", get(outbox::outbox))
        .route("/outbox/retry", post(outbox::retry))
        .route("/outbox/discard", post(outbox::discard))
        .route("/logout", get(auth::logout_page).post(auth::logout))
        .route_layer(middleware::from_fn_with_state(app.clone(), auth::signed_in));
    Router::new()
        .merge(pages)
        .route("/login", get(auth::login_page).post(auth::login))
        .route("/assets/style.css", get(style))
        .route("/assets/refresh.js", get(script))
        .layer(middleware::from_fn_with_state(app.clone(), guard::guard))
        .with_state(app)
}

/// Renders the latest sample: a page costs no query.
async fn overview(State(app): Shared) -> Page {
    let latest = app
        .samples
        .latest(&app.services)
        .await
        .map_err(Failure::Unavailable)?;
    let body = overview_page::overview(&latest, &app.samples.charts(), app.sample_every);
    Ok(Html(pages::layout("Overview", &body, true)))
}

async fn style() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        pages::STYLE,
    )
}

async fn script() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        pages::SCRIPT,
    )
}
