//! The dashboard's HTML, rendered on the server with maud, which escapes
//! every value it interpolates; no script needed to use a page (the
//! embedded script only refreshes them). Text from the queues, the tables
//! and the services goes through [`untrusted`]: escaped control and bidi
//! characters, in a `<bdi>` of its own.

use std::borrow::Cow;

use idempo::ops::dead_letters::{Group, Letter, LetterDetail};
use idempo::ops::{Condition, OUTBOX_PENDING_LIMIT, short_duration};
use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::samples::Latest;
use idempo::outbox::{FailedMessage, OutboxStatus, PendingGroup};

/// The stylesheet, embedded: the dashboard works air-gapped.
pub(crate) const STYLE: &str = include_str!("style.css");

/// Refreshes `main` every 5 s without a full reload (pages work without it).
pub(crate) const SCRIPT: &str = include_str!("refresh.js");

/// The page around `body` (HTML rendered by this module).
pub(crate) fn layout(title: &str, body: &str, refresh: bool) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · idempo" }
                link rel="stylesheet" href="/assets/style.css";
                @if refresh {
                    script src="/assets/refresh.js" defer {}
                }
            }
            body {
                header {
                    a href="/" class="brand" { "idempo" }
                    nav {
                        a href="/" { "Overview" }
                        a href="/dead-letters" { "Dead letters" }
                        a href="/outbox" { "Outbox" }
                    }
                }
                main id="main" data-refresh[refresh] { (PreEscaped(body)) }
            }
        }
    }
    .into_string()
}

/// Text that came from outside the dashboard (queue names, message ids,
/// errors, headers, bodies): in a `<bdi>` of its own, so that a
/// right-to-left override inside cannot reorder the text around it, and
/// with its control and bidi control characters shown escaped
/// (`\u{1b}`, `\n`, `\u{202e}`) instead of acting on the page. maud
/// escapes the rest (`<`, `&`, quotes).
pub(crate) fn untrusted(text: &str) -> Markup {
    html! { bdi { (defang(text, false)) } }
}

/// A body as text: as [`untrusted`], its line breaks and tabs kept (a
/// pretty-printed JSON body stays readable inside `<pre>`).
fn untrusted_body(text: &str) -> Markup {
    html! { bdi { (defang(text, true)) } }
}

/// The bidi control characters (Unicode's `Bidi_Control`): ALM, LRM, RLM,
/// the embeddings and overrides U+202A–U+202E, the isolates U+2066–U+2069.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with its control characters as Rust escapes them (`\n`,
/// `\u{1b}`) and its bidi control characters as `\u{202e}`; the other
/// characters as they are.
fn defang(text: &str, keep_layout: bool) -> Cow<'_, str> {
    let kept = |c: char| keep_layout && matches!(c, '\n' | '\t');
    if !text
        .chars()
        .any(|c| (c.is_control() && !kept(c)) || is_bidi_control(c))
    {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if kept(c) {
            out.push(c);
        } else if c.is_control() {
            out.extend(c.escape_debug());
        } else if is_bidi_control(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// The colour of what [`idempo::ops`] decided: the rule beside it says why.
fn colour(condition: Condition) -> &'static str {
    match condition {
        Condition::Attention => "red",
        Condition::Stopped => "muted",
        _ => "green",
    }
}

/// A rate as the overview shows it.
fn rate(r: f64) -> String {
    if r >= 10.0 {
        format!("{r:.0}")
    } else {
        format!("{r:.1}")
    }
}

/// The link to the letters of one cause: the query values percent-encoded
/// (maud escapes the attribute).
fn group_link(queue: &str, fingerprint: &str) -> String {
    format!(
        "/dead-letters/group?queue={}&fingerprint={}",
        urlencode(queue),
        urlencode(fingerprint)
    )
}

/// Causes the overview lists at most (the largest): thousands of causes
/// would make a page of megabytes, refreshed every 5 s.
const OVERVIEW_CAUSES: usize = 50;

/// The largest [`OVERVIEW_CAUSES`] of `letters`.
fn largest(
    letters: &[idempo::ops::dead_letters::LetterCount],
) -> Vec<&idempo::ops::dead_letters::LetterCount> {
    let mut sorted: Vec<_> = letters.iter().collect();
    sorted.sort_by_key(|l| std::cmp::Reverse(l.count));
    sorted.truncate(OVERVIEW_CAUSES);
    sorted
}

pub(crate) fn overview(
    latest: &Latest,
    charts: &[(String, Vec<f64>)],
    every: std::time::Duration,
) -> String {
    let status = &latest.status;
    let instances = status.instances.as_deref().unwrap_or_default();
    html! {
        h1 { "Overview" }
        p class="rule" {
            "sampled " (short_duration(latest.taken.elapsed())) " ago by this dashboard, every "
            (short_duration(every))
            "; rates per second from the consumers' heartbeats (written every "
            (short_duration(idempo::amqp::heartbeat::HEARTBEAT_EVERY)) ")"
        }
        section {
            h2 { "Queues" }
            p class="rule" {
                "red: a dead letter (in the queue's DLQ or the table), \
                 or messages ready while no consumer process is alive (no heartbeat for 15 s)"
            }
            table {
                tr {
                    th { "queue" } th { "ready" } th { "unacked" } th { "consumers attached" }
                    th { "processes alive" } th { "deliveries/s" } th { "acks/s" } th { "retries/s" }
                    th { "dead letters/s" } th { "claims/s" } th { "duplicates/s" } th { "dead letters" }
                    th { "relay" } th { "delay queues" }
                }
                @for q in &status.queues {
                    @let point = latest.queues.get(&q.queue).cloned().unwrap_or_default();
                    @let mine: Vec<_> = instances.iter().filter(|i| i.queue == q.queue).collect();
                    @let alive = mine.iter().filter(|i| i.is_alive()).count();
                    @let relays: Vec<&str> = mine
                        .iter()
                        .filter(|i| i.is_alive())
                        .filter_map(|i| i.relay.as_deref())
                        .collect();
                    @let delays: Vec<String> = q
                        .delay_queues
                        .iter()
                        .map(|d| format!("{}={}", d.queue, d.ready))
                        .collect();
                    @let r = point.rates;
                    tr class=(colour(status.queue_condition(q))) {
                        td { (untrusted(&q.queue)) }
                        td { (or_dash(q.ready)) }
                        td { (point.unacked.map_or("-".into(), |u| format!("{u:.0}"))) }
                        td { (or_dash(q.consumers)) }
                        td { (alive) " of " (mine.len()) }
                        td { (rate(r.deliveries)) }
                        td { (rate(r.acks)) }
                        td { (rate(r.retries)) }
                        td { (rate(r.dead_letters)) }
                        td { (rate(r.claims)) }
                        td { (rate(r.duplicates)) }
                        td { (point.dead) }
                        td {
                            @if relays.is_empty() { "-" } @else { (untrusted(&relays.join(", "))) }
                        }
                        td { (untrusted(&delays.join(" "))) }
                    }
                }
            }
            @match &latest.management {
                Ok((url, _)) => {
                    p class="rule" { "unacked: RabbitMQ's management API at " (untrusted(url)) }
                }
                Err(why) => {
                    p class="rule" {
                        "unacked: not known (" (untrusted(why)) "); "
                        code { "--management-url" } " says where the API is"
                    }
                }
            }
        }
        (chart_table(charts))
        section {
            h2 { "Consumers" }
            table {
                tr { th { "consumer" } th { "claims" } th { "newest claim" } th { "redelivery horizon" } }
                @for c in &status.consumers {
                    tr {
                        td { (untrusted(&c.consumer)) }
                        td { (c.claims) }
                        td { (c.newest_age.map_or("-".into(), short_duration)) }
                        td { (short_duration(c.redelivery_horizon)) }
                    }
                }
            }
            @if !instances.is_empty() {
                h3 { "Processes" }
                p class="rule" {
                    "red: alive but not consuming, or its relay blocked; \
                     grey: stopped or silent for 15 s (kept here 15 minutes)"
                }
                table {
                    tr {
                        th { "consumer" } th { "queue" } th { "host" } th { "pid" } th { "state" }
                        th { "relay" } th { "up" } th { "last heartbeat" } th { "deliveries" }
                        th { "processed" } th { "duplicates" }
                    }
                    @for i in instances {
                        tr class=(colour(Condition::of_instance(i))) {
                            td { (untrusted(&i.consumer)) }
                            td { (untrusted(&i.queue)) }
                            td { (untrusted(&i.host)) }
                            td { (i.pid) }
                            td { (untrusted(&i.state)) }
                            td { (untrusted(i.relay.as_deref().unwrap_or("-"))) }
                            td { (short_duration(std::time::Duration::from_secs_f64(i.up_secs))) }
                            td {
                                (short_duration(std::time::Duration::from_secs_f64(i.seen_secs_ago)))
                                " ago"
                            }
                            td { (i.counters.deliveries) }
                            td { (i.counters.processed) }
                            td { (i.counters.duplicates) }
                        }
                    }
                }
            }
        }
        @if let Some(letters) = &status.dead_letters {
            section {
                h2 { "Dead letters (table)" }
                p class="rule" { "red: any live dead letter" }
                table {
                    tr { th { "queue" } th { "count" } th { "reason" } th { "cause" } }
                    @for l in largest(letters) {
                        tr class=(colour(Condition::of_dead_letters(l))) {
                            td { (untrusted(&l.queue)) }
                            td { (l.count) }
                            td { (untrusted(&l.reason)) }
                            td {
                                a href=(group_link(&l.queue, &l.fingerprint)) {
                                    (untrusted(&l.fingerprint))
                                }
                            }
                        }
                    }
                }
                @if letters.len() > OVERVIEW_CAUSES {
                    p class="rule" {
                        (letters.len() - OVERVIEW_CAUSES) " more causes: "
                        a href="/dead-letters" { "the dead letters page" }
                    }
                }
            }
        }
        @if let Some(o) = &status.outbox {
            @let relays: Vec<String> = instances
                .iter()
                .filter(|i| i.is_alive())
                .filter_map(|i| i.relay.as_ref().map(|r| format!("{}: {r}", i.consumer)))
                .collect();
            section {
                h2 { "Outbox" }
                p class="rule" {
                    "red: a failed message, or the oldest pending one older than "
                    (short_duration(OUTBOX_PENDING_LIMIT))
                }
                p class=(colour(Condition::of_outbox(o))) {
                    (o.pending) " pending, " (o.failed) " failed, oldest pending "
                    (o.oldest_pending_age.map_or("-".into(), short_duration))
                }
                p {
                    "relays: "
                    @if relays.is_empty() { "none running" } @else { (untrusted(&relays.join(", "))) }
                }
            }
        }
        @for w in &status.warnings {
            p class="warning red" { (untrusted(&w.to_string())) }
        }
    }
    .into_string()
}

/// The charts of the last 15 minutes, one row per series.
fn chart_table(charts: &[(String, Vec<f64>)]) -> Markup {
    html! {
        @if charts.is_empty() {
            p class="rule" { "charts: the last 15 minutes; they appear after the second sample" }
        } @else {
            section {
                h2 { "Last 15 minutes" }
                table class="charts" {
                    tr { th { "series" } th { "chart" } th { "now" } }
                    @for (name, values) in charts {
                        tr {
                            td { (untrusted(name)) }
                            td { (sparkline(values)) }
                            td { (rate(values.last().copied().unwrap_or_default())) }
                        }
                    }
                }
            }
        }
    }
}

/// A small SVG line of `values`, scaled to its own maximum.
fn sparkline(values: &[f64]) -> Markup {
    let max = values.iter().copied().fold(0.0f64, f64::max).max(1.0);
    let step = 160.0 / (values.len().max(2) - 1) as f64;
    let points: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, v)| format!("{:.1},{:.1}", i as f64 * step, 30.0 - v / max * 28.0))
        .collect();
    html! {
        svg class="chart" viewBox="0 0 160 32" role="img" aria-label={ "max " (format!("{max:.0}")) } {
            polyline points=(points.join(" ")) {}
        }
    }
}

/// A time as the pages show it, `-` when unknown.
fn time(t: Option<std::time::SystemTime>) -> String {
    t.map_or_else(
        || "-".into(),
        |t| humantime::format_rfc3339_millis(t).to_string(),
    )
}

/// A value, or `-` when there is none.
fn or_dash(value: Option<impl ToString>) -> String {
    value.map_or_else(|| "-".into(), |v| v.to_string())
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

/// A form that POSTs an action, with the CSRF token.
fn action(path: &str, csrf: &str, fields: &[(&str, &str)], label: &str) -> Markup {
    html! {
        form method="post" action=(path) {
            input type="hidden" name="csrf" value=(csrf);
            @for (name, value) in fields {
                input type="hidden" name=(name) value=(value);
            }
            button type="submit" { (label) }
        }
    }
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
                th { "row" } th { "message id" } th { "attempts" } th { "last failed" } th { "error" }
            }
            @for l in letters {
                @let id = or_dash(l.id);
                tr {
                    td { a href={ "/dead-letters/" (id) } { (id) } }
                    td { (untrusted(l.message_id.as_deref().unwrap_or("-"))) }
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
        p class="rule" {
            "red: a failed message, or the oldest pending one older than "
            (short_duration(OUTBOX_PENDING_LIMIT))
        }
        p class=(colour(Condition::of_outbox(status))) {
            (status.pending) " pending, " (status.failed) " failed, oldest pending "
            (status.oldest_pending_age.map_or("-".into(), short_duration))
        }
        h2 { "Pending by destination" }
        table {
            tr {
                th { "exchange" } th { "routing key" } th { "ordering key" } th { "messages" }
                th { "oldest" }
            }
            @for p in pending {
                tr {
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
                    td { (untrusted(&f.exchange)) " / " (untrusted(&f.routing_key)) }
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

pub(crate) fn letter(detail: &LetterDetail, csrf: Option<&str>) -> String {
    let l = &detail.letter;
    let id = or_dash(l.id);
    html! {
        h1 { "Dead letter " (id) }
        dl {
            dt { "message id" } dd { (untrusted(l.message_id.as_deref().unwrap_or("-"))) }
            dt { "queue" } dd { (untrusted(l.queue.as_deref().unwrap_or("-"))) }
            dt { "consumer" } dd { (untrusted(l.consumer.as_deref().unwrap_or("-"))) }
            dt { "state" } dd { (l.state.as_str()) " (replayed " (l.replay_count) " time(s))" }
            dt { "reason" } dd { (untrusted(&l.reason)) }
            dt { "error" } dd class="error" { (untrusted(l.error.as_deref().unwrap_or("-"))) }
            dt { "attempts" } dd { (or_dash(l.attempts)) " (arrived " (l.deliveries) " time(s))" }
            dt { "first failed" } dd { (time(l.first_failed_at)) }
            dt { "last failed" } dd { (time(l.last_failed_at)) }
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

/// The confirmation step of an action: what it would do, and the button.
/// The confirmation of `what` on `count` `items` ("dead letter(s)"): the
/// action's form again with `confirm`, or back to `cancel`.
pub(crate) fn confirm(
    (what, count, items): (&str, u64, &str),
    path: &str,
    cancel: &str,
    csrf: &str,
    fields: &[(&str, &str)],
) -> String {
    let mut fields = fields.to_vec();
    fields.push(("confirm", "1"));
    html! {
        h1 { "Confirm" }
        p { (what) " " (count) " " (items) "?" }
        (action(path, csrf, &fields, &format!("{what} {count}")))
        p { a href=(cancel) { "Cancel" } }
    }
    .into_string()
}

/// What an action did.
pub(crate) fn done(message: &str) -> String {
    html! {
        h1 { "Done" }
        p class="result" { (untrusted(message)) }
        p { a href="/dead-letters" { "Back to the dead letters" } }
    }
    .into_string()
}

pub(crate) fn login(failed: bool) -> String {
    html! {
        h1 { "Sign in" }
        @if failed {
            p class="red" { "That is not the token." }
        }
        form method="post" action="/login" {
            label { "Token " input type="password" name="token" autofocus; }
            button type="submit" { "Sign in" }
        }
    }
    .into_string()
}

/// A query-string value, percent-encoded.
pub(crate) fn urlencode(value: &str) -> String {
    form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untrusted_text_is_escaped_isolated_and_its_controls_shown() {
        let shown =
            untrusted("<b>&\"q\"</b>\u{1b}[31m\n\u{202e}evil\u{2066}\u{7f}\u{0}").into_string();
        assert_eq!(
            shown,
            "<bdi>&lt;b&gt;&amp;&quot;q&quot;&lt;/b&gt;\\u{1b}[31m\\n\\u{202e}evil\\u{2066}\\u{7f}\\0</bdi>"
        );
        // Plain text (and non-ASCII that is neither) as it is.
        assert_eq!(
            untrusted("payments·é").into_string(),
            "<bdi>payments·é</bdi>"
        );
        for c in ['\u{061c}', '\u{200e}', '\u{200f}', '\u{202a}', '\u{2069}'] {
            assert!(
                !untrusted(&c.to_string()).into_string().contains(c),
                "{c:?}"
            );
        }
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

    #[test]
    fn pages_have_no_inline_script_style_or_handler() {
        let body = login(true);
        for page in [
            layout("Sign in", &body, true),
            layout("Sign in", &body, false),
        ] {
            assert!(page.starts_with("<!DOCTYPE html>"), "{page}");
            assert!(!page.contains("style="), "{page}");
            // No event handler attribute (` onclick=`, ` onload=`, ...).
            let handler = page.split(" on").skip(1).any(|rest| {
                let name = rest.trim_start_matches(|c: char| c.is_ascii_alphabetic());
                name.len() < rest.len() && name.starts_with('=')
            });
            assert!(!handler, "{page}");
            assert_eq!(
                page.matches("<script").count(),
                page.matches("<script src=\"/assets/refresh.js\" defer></script>")
                    .count(),
                "{page}"
            );
        }
        let refreshed = layout("T<", "<p>x</p>", true);
        assert!(
            refreshed.contains("<title>T&lt; · idempo</title>"),
            "{refreshed}"
        );
        assert!(
            refreshed.contains("<main id=\"main\" data-refresh><p>x</p></main>"),
            "{refreshed}"
        );
        assert!(!layout("T", "", false).contains("data-refresh"));
        assert!(
            body.contains("<input type=\"password\" name=\"token\" autofocus>"),
            "{body}"
        );
    }

    #[test]
    fn a_chart_is_an_svg_line() {
        let svg = sparkline(&[0.0, 2.0]).into_string();
        assert_eq!(
            svg,
            "<svg class=\"chart\" viewBox=\"0 0 160 32\" role=\"img\" aria-label=\"max 2\">\
             <polyline points=\"0.0,30.0 160.0,2.0\"></polyline></svg>"
        );
    }
}
