//! The dead-letter pages (groups by cause, one group, one letter) and their
//! actions (replay, discard, delete), over [`idempo::ops::dead_letters`].

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, Form, Path, Query, State};
use axum::http::StatusCode;
use axum::response::Html;
use idempo::ops::dead_letters::{
    DeadLetterStore, Filter, LetterRef, ReplayEvent, ReplayOptions, Store,
};
use serde::Deserialize;

use super::failure::Failure;
use super::{App, Page, Shared, pages};

#[derive(Deserialize)]
pub(crate) struct QueueQuery {
    queue: Option<String>,
    fingerprint: Option<String>,
    /// Paging a group: the letters after this row.
    after: Option<i64>,
}

/// Letters per page of a group.
const PAGE: i64 = 100;

pub(crate) async fn dead_letters(State(app): Shared, Query(q): Query<QueueQuery>) -> Page {
    let filter = Filter {
        queue: q.queue.clone().filter(|q| !q.is_empty()),
        ..Filter::default()
    };
    let groups = table(&app).await?.groups(&filter).await?;
    let mut body = pages::groups(filter.queue.as_deref(), &groups);
    // Not kept in the table: the queue's RabbitMQ DLQ, shown read-only
    // (browsed without spending a delivery attempt).
    if let (true, Some(queue)) = (groups.is_empty(), &filter.queue) {
        let listed = match DeadLetterStore::open(&app.services, queue, Store::Queue).await {
            Ok(dlq) => dlq
                .list(&Filter::default())
                .await
                .map(|l| (dlq.location(), l)),
            Err(e) => Err(e),
        };
        match listed {
            Ok((dlq, letters)) => body.push_str(&pages::queue_dlq(&dlq, &letters)),
            Err(e) => body.push_str(&format!(
                "<p class=rule>{}</p>",
                html_escape::encode_text(&crate::errors::cause_line(&e))
            )),
        }
    }
    Ok(Html(pages::layout("Dead letters", &body, true)))
}

pub(crate) async fn group(State(app): Shared, Query(q): Query<QueueQuery>) -> Page {
    let (Some(queue), Some(fingerprint)) = (q.queue, q.fingerprint) else {
        return Err(Failure::Refused(
            StatusCode::BAD_REQUEST,
            "queue and fingerprint are required\n",
        ));
    };
    let filter = Filter {
        fingerprint: Some(fingerprint.clone()),
        limit: Some(PAGE),
        after_id: q.after,
        ..Filter::queue(queue.as_str())
    };
    let letters = table(&app).await?.list(&filter).await?;
    let csrf = (!app.read_only).then(|| app.auth.csrf());
    let mut body = pages::group(&queue, &fingerprint, &letters, csrf.as_deref());
    if let (true, Some(last)) = (letters.len() as i64 == PAGE, letters.last()) {
        body.push_str(&format!(
            "<p><a href=\"/dead-letters/group?queue={}&amp;fingerprint={}&amp;after={}\">next page</a></p>",
            html_escape::encode_double_quoted_attribute(&pages::urlencode(&queue)),
            html_escape::encode_double_quoted_attribute(&pages::urlencode(&fingerprint)),
            last.id.unwrap_or_default()
        ));
    }
    Ok(Html(pages::layout(
        "Dead letters of one cause",
        &body,
        true,
    )))
}

pub(crate) async fn letter(State(app): Shared, Path(id): Path<i64>) -> Page {
    let detail = table(&app)
        .await?
        .show(&LetterRef::Row(id))
        .await?
        .ok_or(Failure::Refused(
            StatusCode::NOT_FOUND,
            "no such dead letter\n",
        ))?;
    let csrf = (!app.read_only).then(|| app.auth.csrf());
    Ok(Html(pages::layout(
        "Dead letter",
        &pages::letter(&detail, csrf.as_deref()),
        false,
    )))
}

/// An action's form: one letter (`id`) or one cause (`queue` +
/// `fingerprint`), the CSRF token, and `confirm` once confirmed.
#[derive(Deserialize)]
pub(crate) struct ActionForm {
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
fn admit(app: &App, form: &ActionForm) -> Result<Filter, Failure> {
    app.admit(form.csrf.as_deref())?;
    form.filter().ok_or(Failure::Refused(
        StatusCode::BAD_REQUEST,
        "say which letters: id, or queue and fingerprint\n",
    ))
}

/// The confirmation step of an action on `count` letters: the same form
/// again, with `confirm`.
fn confirmation(app: &App, form: &ActionForm, act: Act, count: u64) -> Html<String> {
    let fields = form.fields();
    let fields: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Html(pages::layout(
        "Confirm",
        &pages::confirm(
            (act.label(), count, "dead letter(s)"),
            act.path(),
            "/dead-letters",
            &app.auth.csrf(),
            &fields,
        ),
        false,
    ))
}

/// Who did an action, as the letters record it.
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

pub(crate) async fn replay(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    Form(form): Form<ActionForm>,
) -> Page {
    act(&app, from, &form, Act::Replay).await
}

pub(crate) async fn discard(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    Form(form): Form<ActionForm>,
) -> Page {
    act(&app, from, &form, Act::Discard).await
}

pub(crate) async fn purge(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    Form(form): Form<ActionForm>,
) -> Page {
    act(&app, from, &form, Act::Delete).await
}

/// An action: admitted, then the count of what it selects and a
/// confirmation, then (confirmed) done, logged with the operator's address.
async fn act(app: &App, from: SocketAddr, form: &ActionForm, act: Act) -> Page {
    let filter = admit(app, form)?;
    let store = table(app).await?;
    if form.confirm.as_deref() != Some("1") {
        let count = store.count(&filter).await?;
        return Ok(confirmation(app, form, act, count));
    }
    let message = match act {
        Act::Replay => {
            let mut skipped = Vec::new();
            let report = store
                .replay(&filter, &ReplayOptions::by(operator(from)), |event| {
                    if let ReplayEvent::Skipped { row, refusal, .. } = event {
                        skipped.push(format!("row {}: {refusal}", row.unwrap_or_default()));
                    }
                })
                .await?;
            let mut message = format!(
                "{} replayed through the outbox (the consumers' relay publishes them), {} skipped",
                report.replayed,
                report.skipped_total()
            );
            for why in &skipped {
                message.push_str(&format!("; {why}"));
            }
            message
        }
        Act::Discard => {
            let n = store.discard(&filter, &operator(from), false).await?;
            format!("{n} discarded (kept for audit until reaped)")
        }
        Act::Delete => format!("{} deleted", store.purge_now(&filter).await?),
    };
    tracing::warn!(operator = %from, "dashboard: {message}");
    eprintln!("dashboard: {}: {message}", from.ip());
    Ok(Html(pages::layout("Done", &pages::done(&message), false)))
}

/// The table store (the dashboard acts only on letters kept in PostgreSQL).
async fn table(app: &App) -> Result<DeadLetterStore, Failure> {
    Ok(DeadLetterStore::table(app.database().await?.clone()))
}
