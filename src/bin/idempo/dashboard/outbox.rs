//! The outbox page (pending by destination, failed rows) and its actions:
//! failed rows put back to pending, or discarded (confirmed first, and done
//! only on the rows the confirmation counted).

use axum::extract::{Form, State};
use axum::response::Html;
use serde::Deserialize;

use super::auth::Caller;
use super::failure::Failure;
use super::{App, Page, Shared, letter_pages, pages};

/// Failed rows looked at, at most, for a confirmation.
const FAILED_AT_MOST: i64 = 100_000;

pub(crate) async fn outbox(State(app): Shared, caller: Caller) -> Page {
    let pool = app.database().await?;
    let (status, pending, failed) = tokio::join!(
        idempo::outbox::OutboxStatus::read(pool),
        idempo::outbox::PendingGroup::list(pool, 200),
        idempo::outbox::FailedMessage::list(pool, 200),
    );
    let csrf = app.csrf(&caller);
    let body = letter_pages::outbox(&status?, &pending?, &failed?, csrf.as_deref());
    Ok(Html(pages::layout("Outbox", &body, true)))
}

#[derive(Deserialize)]
pub(crate) struct OutboxForm {
    csrf: Option<String>,
    id: Option<i64>,
    confirm: Option<String>,
    count: Option<usize>,
    upto: Option<i64>,
}

pub(crate) async fn retry(
    State(app): Shared,
    caller: Caller,
    Form(form): Form<OutboxForm>,
) -> Page {
    act(&app, &caller, &form, false).await
}

pub(crate) async fn discard(
    State(app): Shared,
    caller: Caller,
    Form(form): Form<OutboxForm>,
) -> Page {
    act(&app, &caller, &form, true).await
}

/// Failed outbox rows (one, or all) put back to pending, or discarded.
async fn act(app: &App, caller: &Caller, form: &OutboxForm, discard: bool) -> Page {
    app.admit(caller, form.csrf.as_deref())?;
    let pool = app.database().await?;
    let failed: Vec<i64> = idempo::outbox::FailedMessage::list(pool, FAILED_AT_MOST)
        .await?
        .iter()
        .map(|m| m.id)
        .filter(|id| form.id.is_none_or(|one| one == *id))
        .collect();
    if discard && form.confirm.as_deref() != Some("1") {
        // Deleting cannot be undone: say how many first, and bind to them.
        let mut fields = vec![
            ("count", failed.len().to_string()),
            (
                "upto",
                failed.iter().copied().max().unwrap_or(0).to_string(),
            ),
        ];
        if let Some(id) = form.id {
            fields.push(("id", id.to_string()));
        }
        let fields: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (*k, v.as_str())).collect();
        return Ok(Html(pages::layout(
            "Confirm",
            &pages::confirm(
                ("Discard", failed.len() as u64, "failed outbox row(s)"),
                "/outbox/discard",
                "/outbox",
                &caller.csrf(&app.auth),
                &fields,
            ),
            false,
        )));
    }
    let rows: Vec<i64> = if discard {
        let (Some(count), Some(upto)) = (form.count, form.upto) else {
            return Err(Failure::Changed(
                "a confirmation carries what it counted: ask again".into(),
            ));
        };
        let bound: Vec<i64> = failed.into_iter().filter(|id| *id <= upto).collect();
        if bound.len() != count {
            return Err(Failure::Changed(format!(
                "{} of the failed rows you were shown are still failed, not the {count} you confirmed",
                bound.len()
            )));
        }
        bound
    } else {
        failed
    };
    let message = if discard {
        let n = idempo::outbox::FailedMessage::discard(pool, Some(&rows)).await?;
        format!("{n} failed row(s) discarded")
    } else {
        let n = idempo::outbox::FailedMessage::retry(pool, Some(&rows)).await?;
        format!("{n} failed row(s) back to pending")
    };
    tracing::warn!(operator = %caller.operator(), "dashboard: outbox: {message}");
    eprintln!("dashboard: {}: outbox: {message}", caller.operator());
    Ok(Html(pages::layout("Done", &pages::done(&message), false)))
}
