//! The outbox page (pending by destination, failed rows) and its actions:
//! failed rows put back to pending, or discarded.

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, Form, State};
use axum::response::Html;
use serde::Deserialize;

use super::{App, Page, Shared, pages};

pub(crate) async fn outbox(State(app): Shared) -> Page {
    let pool = app.database().await?;
    let (status, pending, failed) = tokio::join!(
        idempo::outbox::status(pool),
        idempo::outbox::pending_by_destination(pool, 200),
        idempo::outbox::failed(pool, 200),
    );
    let csrf = (!app.read_only).then(|| app.auth.csrf());
    let body = pages::outbox(&status?, &pending?, &failed?, csrf.as_deref());
    Ok(Html(pages::layout("Outbox", &body, true)))
}

#[derive(Deserialize)]
pub(crate) struct OutboxForm {
    csrf: Option<String>,
    id: Option<i64>,
    confirm: Option<String>,
}

pub(crate) async fn retry(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    Form(form): Form<OutboxForm>,
) -> Page {
    act(&app, from, &form, false).await
}

pub(crate) async fn discard(
    State(app): Shared,
    ConnectInfo(from): ConnectInfo<SocketAddr>,
    Form(form): Form<OutboxForm>,
) -> Page {
    act(&app, from, &form, true).await
}

/// Failed outbox rows (one, or all) put back to pending, or discarded.
async fn act(app: &App, from: SocketAddr, form: &OutboxForm, discard: bool) -> Page {
    app.admit(form.csrf.as_deref())?;
    let pool = app.database().await?;
    let ids = form.id.map(|id| vec![id]);
    if discard && form.confirm.as_deref() != Some("1") {
        // Deleting cannot be undone: say how many first.
        let count = match &ids {
            Some(_) => 1,
            None => idempo::outbox::status(pool).await?.failed.max(0) as u64,
        };
        let id = form.id.map(|id| id.to_string());
        let fields: Vec<(&str, &str)> = id.iter().map(|id| ("id", id.as_str())).collect();
        return Ok(Html(pages::layout(
            "Confirm",
            &pages::confirm(
                ("Discard", count, "failed outbox row(s)"),
                "/outbox/discard",
                "/outbox",
                &app.auth.csrf(),
                &fields,
            ),
            false,
        )));
    }
    let message = if discard {
        let n = idempo::outbox::discard_failed(pool, ids.as_deref()).await?;
        format!("{n} failed row(s) discarded")
    } else {
        let n = idempo::outbox::retry_failed(pool, ids.as_deref()).await?;
        format!("{n} failed row(s) back to pending")
    };
    tracing::warn!(operator = %from, "dashboard: outbox: {message}");
    eprintln!("dashboard: {}: outbox: {message}", from.ip());
    Ok(Html(pages::layout(
        "Done",
        &format!(
            "<h1>Done</h1><p class=result>{message}</p><p><a href=/outbox>Back to the outbox</a></p>"
        ),
        false,
    )))
}
