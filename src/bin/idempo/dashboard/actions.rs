//! The dead-letter actions (replay, discard, delete): admitted (not
//! read-only, the caller's CSRF token, a selection), counted and confirmed,
//! then done on exactly what was counted, and logged with who acted.

use axum::extract::{Form, State};
use axum::http::StatusCode;
use axum::response::Html;
use idempo::ops::dead_letters::{Filter, ReplayEvent, ReplayOptions};
use serde::Deserialize;

use super::auth::Caller;
use super::failure::Failure;
use super::letters::table;
use super::{App, Page, Shared, pages};

/// An action's form: one letter (`id`) or one cause (`queue` +
/// `fingerprint`), the CSRF token; once confirmed, `confirm` with what the
/// confirmation counted (`count` letters, none above row `upto`).
#[derive(Deserialize)]
pub(crate) struct ActionForm {
    csrf: Option<String>,
    id: Option<i64>,
    queue: Option<String>,
    fingerprint: Option<String>,
    confirm: Option<String>,
    count: Option<usize>,
    upto: Option<i64>,
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
    caller: Caller,
    Form(form): Form<ActionForm>,
) -> Page {
    act(&app, &caller, &form, Act::Replay).await
}

pub(crate) async fn discard(
    State(app): Shared,
    caller: Caller,
    Form(form): Form<ActionForm>,
) -> Page {
    act(&app, &caller, &form, Act::Discard).await
}

pub(crate) async fn purge(
    State(app): Shared,
    caller: Caller,
    Form(form): Form<ActionForm>,
) -> Page {
    act(&app, &caller, &form, Act::Delete).await
}

/// An action: admitted; then the live letters it selects counted and a
/// confirmation asked that carries the count and the highest row; then,
/// confirmed, done on those letters only (letters that arrived since have
/// higher rows), refused if what was counted changed.
async fn act(app: &App, caller: &Caller, form: &ActionForm, act: Act) -> Page {
    app.admit(caller, form.csrf.as_deref())?;
    let filter = form.filter().ok_or(Failure::Refused(
        StatusCode::BAD_REQUEST,
        "say which letters: id, or queue and fingerprint\n",
    ))?;
    let store = table(app).await?;
    let selected = store
        .list(&Filter {
            limit: Some(i64::MAX),
            ..filter.clone()
        })
        .await?;
    let rows: Vec<i64> = selected.iter().filter_map(|l| l.id).collect();
    if form.confirm.as_deref() != Some("1") {
        let upto = rows.iter().copied().max().unwrap_or(0);
        let mut fields = form.fields();
        fields.push(("count", rows.len().to_string()));
        fields.push(("upto", upto.to_string()));
        let fields: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (*k, v.as_str())).collect();
        return Ok(Html(pages::layout(
            "Confirm",
            &pages::confirm(
                (act.label(), rows.len() as u64, "dead letter(s)"),
                act.path(),
                "/dead-letters",
                &caller.csrf(&app.auth),
                &fields,
            ),
            false,
        )));
    }
    let (Some(count), Some(upto)) = (form.count, form.upto) else {
        return Err(Failure::Refused(
            StatusCode::BAD_REQUEST,
            "a confirmation carries what it counted: ask again\n",
        ));
    };
    let bound: Vec<i64> = rows.into_iter().filter(|row| *row <= upto).collect();
    if bound.len() != count {
        return Err(Failure::Changed(format!(
            "{} dead letter(s) of those you were shown are still there, not the {count} you confirmed: \
             another action or a consumer changed them",
            bound.len()
        )));
    }
    let message = if bound.is_empty() {
        "nothing to do".to_owned()
    } else {
        let exact = Filter {
            ids: bound,
            ..filter
        };
        let who = caller.operator();
        match act {
            Act::Replay => {
                let mut skipped = Vec::new();
                let report = store
                    .replay(&exact, &ReplayOptions::by(who), |event| {
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
                let n = store.discard(&exact, &who, false).await?;
                format!("{n} discarded (kept for audit until reaped)")
            }
            Act::Delete => format!("{} deleted", store.purge_now(&exact).await?),
        }
    };
    tracing::warn!(operator = %caller.operator(), "dashboard: {message}");
    eprintln!("dashboard: {}: {message}", caller.operator());
    Ok(Html(pages::layout("Done", &pages::done(&message), false)))
}
