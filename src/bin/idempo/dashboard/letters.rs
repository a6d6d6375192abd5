//! The dead-letter pages: causes (groups), one cause, one letter, over
//! [`idempo::ops::dead_letters`]; and a queue's RabbitMQ DLQ, browsed
//! without changing it more than one walk at a time (`actions.rs` has the
//! actions).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Html;
use idempo::ops::Services;
use idempo::ops::dead_letters::{DeadLetterStore, Filter, Letter, LetterRef, Store};
use serde::Deserialize;

use super::auth::Caller;
use super::failure::Failure;
use super::{App, Page, Shared, letter_pages, pages};

#[derive(Deserialize)]
pub(crate) struct QueueQuery {
    queue: Option<String>,
    fingerprint: Option<String>,
    /// Paging a group: the letters after this row.
    after: Option<i64>,
}

/// Letters per page of a group.
const PAGE: i64 = 100;

/// Causes shown at most on the dead-letters page (the largest first).
const GROUPS: i64 = 100;

/// How long a DLQ's listing is shown again instead of walking it again.
const DLQ_FRESH: Duration = Duration::from_secs(10);

/// The table store (the dashboard acts only on letters kept in PostgreSQL).
pub(super) async fn table(app: &App) -> Result<DeadLetterStore, Failure> {
    Ok(DeadLetterStore::table(app.database().await?.clone()))
}

pub(crate) async fn dead_letters(State(app): Shared, Query(q): Query<QueueQuery>) -> Page {
    let queue = q.queue.clone().filter(|q| !q.is_empty());
    let filter = Filter {
        queue: queue.clone(),
        limit: Some(GROUPS + 1),
        ..Filter::default()
    };
    let mut groups = table(&app).await?.groups(&filter).await?;
    let more = groups.len() as i64 > GROUPS;
    groups.truncate(GROUPS as usize);
    let mut body = letter_pages::groups(queue.as_deref(), &groups);
    if more {
        body.push_str(
            &maud::html! {
                p.rule { "the " (GROUPS) " largest causes are shown: pick a queue to narrow" }
            }
            .into_string(),
        );
    }
    let Some(queue) = queue.filter(|_| groups.is_empty()) else {
        return Ok(Html(pages::layout("Dead letters", &body, true)));
    };
    // Not kept in the table: the queue's RabbitMQ DLQ. Reading it takes its
    // letters and puts them back behind the rest: never in read-only mode,
    // one walk per queue at a time, finished even if the browser leaves,
    // and not refreshed by the page.
    if app.read_only {
        body.push_str(
            &maud::html! {
                p.rule {
                    "letters of " (queue) " may be in its RabbitMQ dead-letter queue: "
                    "a read-only dashboard does not browse it (a browse moves its letters); "
                    code { "idempo dlq list " (queue) }
                }
            }
            .into_string(),
        );
        return Ok(Html(pages::layout("Dead letters", &body, true)));
    }
    match app.dlq_views.list(&app.services, &queue).await {
        Ok((dlq, letters)) => body.push_str(&letter_pages::queue_dlq(&dlq, &letters)),
        Err(why) => body.push_str(&maud::html! { p.rule { (why) } }.into_string()),
    }
    Ok(Html(pages::layout("Dead letters", &body, false)))
}

pub(crate) async fn group(State(app): Shared, caller: Caller, Query(q): Query<QueueQuery>) -> Page {
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
    let csrf = app.csrf(&caller);
    let mut body = letter_pages::group(&queue, &fingerprint, &letters, csrf.as_deref());
    if let (true, Some(last)) = (letters.len() as i64 == PAGE, letters.last()) {
        let next = format!(
            "/dead-letters/group?queue={}&fingerprint={}&after={}",
            pages::urlencode(&queue),
            pages::urlencode(&fingerprint),
            last.id.unwrap_or_default()
        );
        body.push_str(&maud::html! { p { a href=(next) { "next page" } } }.into_string());
    }
    Ok(Html(pages::layout(
        "Dead letters of one cause",
        &body,
        true,
    )))
}

pub(crate) async fn letter(State(app): Shared, caller: Caller, Path(id): Path<i64>) -> Page {
    let detail = table(&app)
        .await?
        .show(&LetterRef::Row(id))
        .await?
        .ok_or(Failure::Refused(
            StatusCode::NOT_FOUND,
            "no such dead letter\n",
        ))?;
    let csrf = app.csrf(&caller);
    Ok(Html(pages::layout(
        "Dead letter",
        &letter_pages::letter(&detail, csrf.as_deref(), app.trace_url.as_deref()),
        false,
    )))
}

/// One listing of a DLQ.
type Listing = (String, Vec<Letter>);

/// The last listing of one DLQ and when it was made, behind the lock that
/// lets one walk at a time.
type Slot = Arc<tokio::sync::Mutex<Option<(Instant, Listing)>>>;

/// The DLQ listings the dashboard made, one walk per queue at a time.
#[derive(Default)]
pub(crate) struct DlqViews {
    queues: Mutex<HashMap<String, Slot>>,
}

impl DlqViews {
    /// The DLQ of `queue` and its first 100 letters: a listing younger than
    /// [`DLQ_FRESH`], or a new walk run in a task of its own (a browser that
    /// leaves does not cut it short: a walk cut short could leave letters
    /// held, then put back twice).
    async fn list(&self, services: &Services, queue: &str) -> Result<Listing, String> {
        let slot = self
            .queues
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(queue.to_owned())
            .or_default()
            .clone();
        let (services, queue) = (services.clone(), queue.to_owned());
        let walk = tokio::spawn(async move {
            let mut last = slot.lock_owned().await;
            if let Some((at, listing)) = &*last
                && at.elapsed() < DLQ_FRESH
            {
                return Ok(listing.clone());
            }
            let store = DeadLetterStore::open(&services, &queue, Store::Queue)
                .await
                .map_err(|e| crate::errors::cause_line(&e))?;
            let letters = store
                .list(&Filter::default())
                .await
                .map_err(|e| crate::errors::cause_line(&e))?;
            let listing = (store.location(), letters);
            *last = Some((Instant::now(), listing.clone()));
            Ok(listing)
        });
        walk.await.map_err(|e| e.to_string())?
    }
}
