//! The dead-letter and outbox pages: causes, one queue's dead-letter
//! queue, one cause's letters, one letter, and the outbox's pending and
//! failed rows. Every value from a queue or a table goes through
//! [`untrusted`].

use idempo::ops::dead_letters::{Group, Letter, LetterDetail};
use idempo::outbox::{FailedMessage, OutboxStatus, PendingGroup};
use maud::{Markup, html};

use super::pages::{action, or_dash, outbox_summary, time, untrusted, untrusted_body, urlencode};

/// The link to the letters of one cause: the query values percent-encoded
/// (maud escapes the attribute).
pub(crate) fn group_link(queue: &str, fingerprint: &str) -> String {
    format!(
        "/dead-letters/group?queue={}&fingerprint={}",
        urlencode(queue),
        urlencode(fingerprint)
    )
}

pub(crate) fn groups(queue: Option<&str>, groups: &[Group]) -> String {
    html! {
        h1 { "Dead letters" }
        @if let Some(q) = queue {
            p { "queue " (untrusted(q)) }
        }
        @if groups.is_empty() {
            p { "No live dead letters in the table." }
        } @else {
            table {
                tr {
                    th { "queue" } th { "count" } th { "reason" } th { "first seen" }
                    th { "last seen" } th { "sample error" } th { "cause" }
                }
                @for g in groups {
                    tr {
                        td { (untrusted(&g.queue)) }
                        td { (g.count) }
                        td { (untrusted(&g.reason)) }
                        td { (time(g.first_seen)) }
                        td { (time(g.last_seen)) }
                        td class="error" { (untrusted(&g.sample_error)) }
                        td {
                            a class="group" href=(group_link(&g.queue, &g.fingerprint)) {
                                (untrusted(&g.fingerprint))
                            }
                        }
                    }
                }
            }
        }
    }
    .into_string()
}

/// A RabbitMQ DLQ's letters, read-only (the table store is not in use).
pub(crate) fn queue_dlq(dlq: &str, letters: &[Letter]) -> String {
    html! {
        h2 {
            "RabbitMQ dead-letter queue " (untrusted(dlq)) " (" (letters.len())
            " shown, read-only here)"
        }
        p class="rule" {
            "replay or delete them with " code { "idempo dlq" }
            ", or keep dead letters in PostgreSQL (" code { "DeadLetters::Table" } ", "
            code { "idempo dlq import" } ") to act on them here"
        }
        table {
            tr {
                th { "message id" } th { "reason" } th { "attempts" } th { "last failure" }
                th { "size" } th { "error" }
            }
            @for d in letters {
                tr {
                    td { (untrusted(d.message_id.as_deref().unwrap_or("-"))) }
                    td { (untrusted(&d.reason)) }
                    td { (or_dash(d.attempts)) }
                    td { (time(d.last_failed_at)) }
                    td { (d.body_bytes) }
                    td class="error" { (untrusted(d.error.as_deref().unwrap_or("-"))) }
                }
            }
        }
    }
    .into_string()
}

pub(crate) fn group(
    queue: &str,
    fingerprint: &str,
    letters: &[Letter],
    csrf: Option<&str>,
) -> String {
    let fields = [("queue", queue), ("fingerprint", fingerprint)];
    html! {
        h1 { "Dead letters of one cause" }
        p {
            "queue " (untrusted(queue)) " · cause " (untrusted(fingerprint)) " · "
            (letters.len()) " shown"
        }
        @if let Some(csrf) = csrf {
            div class="actions" {
                (action("/dead-letters/replay", csrf, &fields, "Replay this group…"))
                (action("/dead-letters/discard", csrf, &fields, "Discard this group…"))
                (action("/dead-letters/purge", csrf, &fields, "Delete this group…"))
            }
        }
        table {
            tr {
                th { "row" } th { "message id" } th { "transport" } th { "attempts" }
                th { "last failed" } th { "error" }
            }
            @for l in letters {
                @let id = or_dash(l.id);
                tr {
                    td { a href={ "/dead-letters/" (id) } { (id) } }
                    td { (untrusted(l.message_id.as_deref().unwrap_or("-"))) }
                    td { (untrusted(&l.transport)) }
                    td { (or_dash(l.attempts)) }
                    td { (time(l.last_failed_at)) }
                    td class="error" { (untrusted(l.error.as_deref().unwrap_or("-"))) }
                }
            }
        }
    }
    .into_string()
}

pub(crate) fn outbox(
    status: &OutboxStatus,
    pending: &[PendingGroup],
    failed: &[FailedMessage],
    csrf: Option<&str>,
) -> String {
    html! {
        h1 { "Outbox" }
        (outbox_summary(status))
        h2 { "Pending by destination" }
        table {
            tr {
                th { "transport" } th { "exchange" } th { "routing key" } th { "ordering key" }
                th { "messages" } th { "oldest" }
            }
            @for p in pending {
                tr {
                    td { (untrusted(&p.transport)) }
                    td {
                        @if p.exchange.is_empty() && p.routing_key.is_empty() {
                            "(packed rows)"
                        } @else {
                            (untrusted(&p.exchange))
                        }
                    }
                    td { (untrusted(&p.routing_key)) }
                    td { (untrusted(p.ordering_key.as_deref().unwrap_or("-"))) }
                    td { (p.messages) }
                    td { (format!("{:.0}", p.oldest_secs)) " s" }
                }
            }
        }
        h2 { "Failed" }
        @if let (Some(csrf), false) = (csrf, failed.is_empty()) {
            (action("/outbox/retry", csrf, &[], "Retry every failed message"))
            (action("/outbox/discard", csrf, &[], "Discard every failed message"))
        }
        table {
            tr {
                th { "row" } th { "message id" } th { "destination" } th { "attempts" }
                th { "last error" } th {}
            }
            @for f in failed {
                @let id = f.id.to_string();
                tr class="red" {
                    td { (f.id) }
                    td { (untrusted(&f.message_id)) }
                    td {
                        (untrusted(&f.transport)) " " (untrusted(&f.exchange)) " / "
                        (untrusted(&f.routing_key))
                    }
                    td { (f.attempts) }
                    td class="error" { (untrusted(f.last_error.as_deref().unwrap_or("-"))) }
                    td {
                        @if let Some(csrf) = csrf {
                            (action("/outbox/retry", csrf, &[("id", &id)], "Retry"))
                            (action("/outbox/discard", csrf, &[("id", &id)], "Discard"))
                        }
                    }
                }
            }
        }
    }
    .into_string()
}

/// The body shown: text when it is, a hex dump of the first bytes otherwise;
/// at most 16 KiB either way.
fn body_preview(body: &[u8]) -> Markup {
    const SHOWN: usize = 16 * 1024;
    let shown = &body[..body.len().min(SHOWN)];
    html! {
        @match std::str::from_utf8(shown) {
            Ok(s) => { pre class="body" { (untrusted_body(s)) } }
            Err(_) => {
                pre class="body" { "binary: " (hex::encode(&shown[..shown.len().min(512)])) }
            }
        }
        @if body.len() > SHOWN {
            " (first " (SHOWN) " of " (body.len()) " bytes)"
        }
    }
}

/// Refuses a `--trace-url` that would link nowhere useful.
pub(crate) fn check_trace_url(template: &str) -> anyhow::Result<()> {
    if template.is_empty() {
        return Ok(());
    }
    if !template.contains(TRACE_ID) {
        anyhow::bail!(
            "--trace-url/IDEMPO_TRACE_URL {template:?} has no {TRACE_ID}: write where the trace \
             id goes, e.g. http://localhost:16686/trace/{TRACE_ID}"
        );
    }
    if !(template.starts_with("http://") || template.starts_with("https://")) {
        anyhow::bail!("--trace-url/IDEMPO_TRACE_URL {template:?} is not an http(s) URL");
    }
    Ok(())
}

const TRACE_ID: &str = "{trace_id}";

/// The trace id, linked to the backend's page when there is a template.
fn trace(trace_id: Option<&str>, template: Option<&str>) -> Markup {
    html! {
        @match (trace_id, template) {
            (Some(id), Some(template)) => a href=(template.replace(TRACE_ID, id)) { (id) },
            (Some(id), None) => (id),
            (None, _) => "-",
        }
    }
}

pub(crate) fn letter(detail: &LetterDetail, csrf: Option<&str>, trace_url: Option<&str>) -> String {
    let l = &detail.letter;
    let id = or_dash(l.id);
    html! {
        h1 { "Dead letter " (id) }
        dl {
            dt { "message id" } dd { (untrusted(l.message_id.as_deref().unwrap_or("-"))) }
            dt { "queue" } dd { (untrusted(l.queue.as_deref().unwrap_or("-"))) }
            dt { "consumer" } dd { (untrusted(l.consumer.as_deref().unwrap_or("-"))) }
            dt { "transport" } dd { (untrusted(&l.transport)) }
            dt { "state" } dd { (l.state.as_str()) " (replayed " (l.replay_count) " time(s))" }
            dt { "reason" } dd { (untrusted(&l.reason)) }
            dt { "error" } dd class="error" { (untrusted(l.error.as_deref().unwrap_or("-"))) }
            dt { "attempts" } dd { (or_dash(l.attempts)) " (arrived " (l.deliveries) " time(s))" }
            dt { "first failed" } dd { (time(l.first_failed_at)) }
            dt { "last failed" } dd { (time(l.last_failed_at)) }
            dt { "trace" } dd { (trace(detail.trace_id(), trace_url)) }
            dt { "routing" }
            dd {
                "exchange " (untrusted(&format!("{:?}", detail.exchange)))
                " · routing key " (untrusted(&format!("{:?}", l.routing_key)))
            }
        }
        @if let (Some(csrf), "live") = (csrf, l.state.as_str()) {
            div class="actions" {
                (action("/dead-letters/replay", csrf, &[("id", &id)], "Replay…"))
                (action("/dead-letters/discard", csrf, &[("id", &id)], "Discard…"))
            }
        }
        h2 { "Headers" }
        table {
            @if let Some(headers) = detail.headers.as_object() {
                @for (name, value) in headers {
                    @let shown = value.as_str().map_or_else(|| value.to_string(), str::to_owned);
                    tr { td { (untrusted(name)) } td { (untrusted(&shown)) } }
                }
            }
        }
        h2 { "Body" }
        (body_preview(&detail.body))
    }
    .into_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dashboard::pages::{confirm, done};

    #[test]
    fn a_trace_id_links_to_the_template_only_when_one_is_set() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        let linked = trace(
            Some(id),
            Some("https://t.example/trace/{trace_id}?a=1&b=\"x"),
        )
        .into_string();
        assert_eq!(
            linked,
            format!("<a href=\"https://t.example/trace/{id}?a=1&amp;b=&quot;x\">{id}</a>")
        );
        assert_eq!(trace(Some(id), None).into_string(), id);
        assert_eq!(trace(None, Some("https://t/{trace_id}")).into_string(), "-");
        assert!(check_trace_url("http://jaeger:16686/trace/{trace_id}").is_ok());
        assert!(check_trace_url("http://jaeger:16686/trace/").is_err());
        assert!(check_trace_url("javascript:alert('{trace_id}')").is_err());
    }

    #[test]
    fn hostile_values_stay_text_and_attribute_values() {
        let q = "q\"><script>alert(1)</script>\u{202e}";
        let page = groups(Some(q), &[]);
        assert_eq!(
            page,
            "<h1>Dead letters</h1><p>queue <bdi>q&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;\
             \\u{202e}</bdi></p><p>No live dead letters in the table.</p>"
        );
        let asked = confirm(
            ("Replay", 20, "dead letter(s)"),
            "/dead-letters/replay",
            "/dead-letters",
            "tok\"en",
            &[("queue", q)],
        );
        assert!(
            asked.contains("<p>Replay 20 dead letter(s)?</p>"),
            "{asked}"
        );
        assert!(
            asked.contains("<button type=\"submit\">Replay 20</button>"),
            "{asked}"
        );
        assert!(
            asked.contains("name=\"csrf\" value=\"tok&quot;en\""),
            "{asked}"
        );
        assert!(asked.contains("name=\"confirm\" value=\"1\""), "{asked}");
        assert!(!asked.contains("<script"), "{asked}");
        let done = done("1 replayed; row 2: <i>\u{202e}</i>");
        assert!(
            done.contains("<bdi>1 replayed; row 2: &lt;i&gt;\\u{202e}&lt;/i&gt;</bdi>"),
            "{done}"
        );
    }
}
