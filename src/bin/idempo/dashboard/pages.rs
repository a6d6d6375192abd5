//! The dashboard's HTML, rendered on the server: every value escaped, no
//! script needed to use a page (the embedded script only refreshes them).

use std::fmt::Write;

use html_escape::{encode_double_quoted_attribute as attr, encode_text as text};
use idempo::ops::dead_letters::{Group, Letter, LetterDetail};
use idempo::ops::{Condition, OUTBOX_PENDING_LIMIT, short_duration};

use super::samples::Latest;
use idempo::outbox::{FailedMessage, OutboxStatus, PendingGroup};

/// The stylesheet, embedded: the dashboard works air-gapped.
pub(crate) const STYLE: &str = include_str!("style.css");

/// Refreshes `main` every 5 s without a full reload (pages work without it).
pub(crate) const SCRIPT: &str = include_str!("refresh.js");

/// The page around `body`.
pub(crate) fn layout(title: &str, body: &str, refresh: bool) -> String {
    format!(
        "<!doctype html><html lang=en><head><meta charset=utf-8>\
         <meta name=viewport content=\"width=device-width, initial-scale=1\">\
         <title>{title} · idempo</title><link rel=stylesheet href=/assets/style.css>\
         {script}</head><body><header><a href=/ class=brand>idempo</a>\
         <nav><a href=/>Overview</a><a href=/dead-letters>Dead letters</a><a href=/outbox>Outbox</a></nav>\
         </header><main id=main{refresh_attr}>{body}</main></body></html>",
        title = text(title),
        script = if refresh {
            "<script src=/assets/refresh.js defer></script>"
        } else {
            ""
        },
        refresh_attr = if refresh { " data-refresh" } else { "" },
    )
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

pub(crate) fn overview(
    latest: &Latest,
    charts: &[(String, Vec<f64>)],
    every: std::time::Duration,
) -> String {
    let status = &latest.status;
    let instances = status.instances.as_deref().unwrap_or_default();
    let mut out = format!(
        "<h1>Overview</h1><p class=rule>sampled {} ago by this dashboard, every {}; \
         rates per second from the consumers' heartbeats (written every {})</p>",
        short_duration(latest.taken.elapsed()),
        short_duration(every),
        short_duration(idempo::amqp::heartbeat::HEARTBEAT_EVERY),
    );
    out.push_str(
        "<section><h2>Queues</h2><p class=rule>red: a dead letter (in the queue's DLQ or the table), \
         or messages ready while no consumer process is alive (no heartbeat for 15 s)</p>",
    );
    out.push_str(
        "<table><tr><th>queue</th><th>ready</th><th>unacked</th><th>consumers attached</th>\
         <th>processes alive</th><th>deliveries/s</th><th>acks/s</th><th>retries/s</th>\
         <th>dead letters/s</th><th>claims/s</th><th>duplicates/s</th><th>dead letters</th>\
         <th>relay</th><th>delay queues</th></tr>",
    );
    for q in &status.queues {
        let point = latest.queues.get(&q.queue).cloned().unwrap_or_default();
        let mine: Vec<_> = instances.iter().filter(|i| i.queue == q.queue).collect();
        let alive = mine.iter().filter(|i| i.is_alive()).count();
        let relays: Vec<&str> = mine
            .iter()
            .filter(|i| i.is_alive())
            .filter_map(|i| i.relay.as_deref())
            .collect();
        let delays: Vec<String> = q
            .delay_queues
            .iter()
            .map(|d| format!("{}={}", d.queue, d.ready))
            .collect();
        let r = point.rates;
        let _ = write!(
            out,
            "<tr class={}><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{alive} of {}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            colour(status.queue_condition(q)),
            text(&q.queue),
            q.ready.map_or("-".into(), |r| r.to_string()),
            point.unacked.map_or("-".into(), |u| format!("{u:.0}")),
            q.consumers.map_or("-".into(), |c| c.to_string()),
            mine.len(),
            rate(r.deliveries),
            rate(r.acks),
            rate(r.retries),
            rate(r.dead_letters),
            rate(r.claims),
            rate(r.duplicates),
            point.dead,
            text(&if relays.is_empty() {
                "-".into()
            } else {
                relays.join(", ")
            }),
            text(&delays.join(" "))
        );
    }
    out.push_str("</table>");
    match &latest.management {
        Ok((url, _)) => {
            let _ = write!(
                out,
                "<p class=rule>unacked: RabbitMQ's management API at {}</p>",
                text(url)
            );
        }
        Err(why) => {
            let _ = write!(
                out,
                "<p class=rule>unacked: not known ({}); <code>--management-url</code> says where the API is</p>",
                text(why)
            );
        }
    }
    out.push_str("</section>");
    out.push_str(&chart_table(charts));
    out.push_str("<section><h2>Consumers</h2><table><tr><th>consumer</th><th>claims</th><th>newest claim</th><th>redelivery horizon</th></tr>");
    for c in &status.consumers {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            text(&c.consumer),
            c.claims,
            c.newest_age.map_or("-".into(), short_duration),
            short_duration(c.redelivery_horizon)
        );
    }
    out.push_str("</table>");
    if !instances.is_empty() {
        out.push_str(
            "<h3>Processes</h3><p class=rule>red: alive but not consuming, or its relay blocked; \
             grey: stopped or silent for 15 s (kept here 15 minutes)</p>\
             <table><tr><th>consumer</th><th>queue</th><th>host</th><th>pid</th><th>state</th><th>relay</th>\
             <th>up</th><th>last heartbeat</th><th>deliveries</th><th>processed</th><th>duplicates</th></tr>",
        );
        for i in instances {
            let class = colour(Condition::of_instance(i));
            let _ = write!(
                out,
                "<tr class={class}><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td>{}</td><td>{} ago</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                text(&i.consumer),
                text(&i.queue),
                text(&i.host),
                i.pid,
                text(&i.state),
                text(i.relay.as_deref().unwrap_or("-")),
                short_duration(std::time::Duration::from_secs_f64(i.up_secs)),
                short_duration(std::time::Duration::from_secs_f64(i.seen_secs_ago)),
                i.counters.deliveries,
                i.counters.processed,
                i.counters.duplicates
            );
        }
        out.push_str("</table>");
    }
    out.push_str("</section>");
    if let Some(letters) = &status.dead_letters {
        out.push_str(
            "<section><h2>Dead letters (table)</h2><p class=rule>red: any live dead letter</p>",
        );
        out.push_str("<table><tr><th>queue</th><th>count</th><th>reason</th><th>cause</th></tr>");
        for l in letters {
            let _ = write!(
                out,
                "<tr class={}><td>{}</td><td>{}</td><td>{}</td><td><a href=\"/dead-letters/group?queue={}&amp;fingerprint={}\">{}</a></td></tr>",
                colour(Condition::of_dead_letters(l)),
                text(&l.queue),
                l.count,
                text(&l.reason),
                attr(&urlencode(&l.queue)),
                attr(&urlencode(&l.fingerprint)),
                text(&l.fingerprint)
            );
        }
        out.push_str("</table></section>");
    }
    if let Some(o) = &status.outbox {
        let relays: Vec<String> = instances
            .iter()
            .filter(|i| i.is_alive())
            .filter_map(|i| i.relay.as_ref().map(|r| format!("{}: {r}", i.consumer)))
            .collect();
        let _ = write!(
            out,
            "<section><h2>Outbox</h2><p class=rule>red: a failed message, or the oldest pending one older than {}</p>\
             <p class={}>{} pending, {} failed, oldest pending {}</p><p>relays: {}</p></section>",
            short_duration(OUTBOX_PENDING_LIMIT),
            colour(Condition::of_outbox(o)),
            o.pending,
            o.failed,
            o.oldest_pending_age.map_or("-".into(), short_duration),
            text(&if relays.is_empty() {
                "none running".into()
            } else {
                relays.join(", ")
            })
        );
    }
    for w in &status.warnings {
        let _ = write!(out, "<p class=\"warning red\">{}</p>", text(&w.to_string()));
    }
    out
}

/// The charts of the last 15 minutes, one row per series.
fn chart_table(charts: &[(String, Vec<f64>)]) -> String {
    if charts.is_empty() {
        return "<p class=rule>charts: the last 15 minutes; they appear after the second sample</p>"
            .into();
    }
    let mut out = String::from(
        "<section><h2>Last 15 minutes</h2><table class=charts><tr><th>series</th><th>chart</th><th>now</th></tr>",
    );
    for (name, values) in charts {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            text(name),
            sparkline(values),
            rate(values.last().copied().unwrap_or_default())
        );
    }
    out.push_str("</table></section>");
    out
}

/// A small SVG line of `values`, scaled to its own maximum.
fn sparkline(values: &[f64]) -> String {
    let max = values.iter().copied().fold(0.0f64, f64::max).max(1.0);
    let step = 160.0 / (values.len().max(2) - 1) as f64;
    let points: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, v)| format!("{:.1},{:.1}", i as f64 * step, 30.0 - v / max * 28.0))
        .collect();
    format!(
        "<svg class=chart viewBox=\"0 0 160 32\" role=img aria-label=\"max {max:.0}\"><polyline points=\"{}\"/></svg>",
        points.join(" ")
    )
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
    let mut out = String::from("<h1>Dead letters</h1>");
    if let Some(q) = queue {
        let _ = write!(out, "<p>queue {}</p>", text(q));
    }
    if groups.is_empty() {
        out.push_str("<p>No live dead letters in the table.</p>");
        return out;
    }
    out.push_str("<table><tr><th>queue</th><th>count</th><th>reason</th><th>first seen</th><th>last seen</th><th>sample error</th><th>cause</th></tr>");
    for g in groups {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=error>{}</td>\
             <td><a class=group href=\"/dead-letters/group?queue={}&amp;fingerprint={}\">{}</a></td></tr>",
            text(&g.queue),
            g.count,
            text(&g.reason),
            text(&time(g.first_seen)),
            text(&time(g.last_seen)),
            text(&g.sample_error),
            attr(&urlencode(&g.queue)),
            attr(&urlencode(&g.fingerprint)),
            text(&g.fingerprint)
        );
    }
    out.push_str("</table>");
    out
}

/// A RabbitMQ DLQ's letters, read-only (the table store is not in use).
pub(crate) fn queue_dlq(dlq: &str, letters: &[Letter]) -> String {
    let mut out = format!(
        "<h2>RabbitMQ dead-letter queue {} ({} shown, read-only here)</h2>\
         <p class=rule>replay or delete them with <code>idempo dlq</code>, or keep dead letters in \
         PostgreSQL (<code>DeadLetters::Table</code>, <code>idempo dlq import</code>) to act on them here</p>\
         <table><tr><th>message id</th><th>reason</th><th>attempts</th><th>last failure</th><th>size</th><th>error</th></tr>",
        text(dlq),
        letters.len()
    );
    for d in letters {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=error>{}</td></tr>",
            text(d.message_id.as_deref().unwrap_or("-")),
            text(&d.reason),
            d.attempts.map_or("-".into(), |a| a.to_string()),
            text(&time(d.last_failed_at)),
            d.body_bytes,
            text(d.error.as_deref().unwrap_or("-"))
        );
    }
    out.push_str("</table>");
    out
}

/// A form that POSTs an action, with the CSRF token.
fn action(path: &str, csrf: &str, fields: &[(&str, &str)], label: &str) -> String {
    let mut out = format!("<form method=post action=\"{}\">", attr(path));
    let _ = write!(
        out,
        "<input type=hidden name=csrf value=\"{}\">",
        attr(csrf)
    );
    for (name, value) in fields {
        let _ = write!(
            out,
            "<input type=hidden name=\"{}\" value=\"{}\">",
            attr(name),
            attr(value)
        );
    }
    let _ = write!(out, "<button type=submit>{}</button></form>", text(label));
    out
}

pub(crate) fn group(
    queue: &str,
    fingerprint: &str,
    letters: &[Letter],
    csrf: Option<&str>,
) -> String {
    let mut out = format!(
        "<h1>Dead letters of one cause</h1><p>queue {} · cause {} · {} shown</p>",
        text(queue),
        text(fingerprint),
        letters.len()
    );
    if let Some(csrf) = csrf {
        out.push_str("<div class=actions>");
        let fields = [("queue", queue), ("fingerprint", fingerprint)];
        out.push_str(&action(
            "/dead-letters/replay",
            csrf,
            &fields,
            "Replay this group…",
        ));
        out.push_str(&action(
            "/dead-letters/discard",
            csrf,
            &fields,
            "Discard this group…",
        ));
        out.push_str(&action(
            "/dead-letters/purge",
            csrf,
            &fields,
            "Delete this group…",
        ));
        out.push_str("</div>");
    }
    out.push_str("<table><tr><th>row</th><th>message id</th><th>attempts</th><th>last failed</th><th>error</th></tr>");
    for l in letters {
        let _ = write!(
            out,
            "<tr><td><a href=\"/dead-letters/{id}\">{id}</a></td><td>{}</td><td>{}</td><td>{}</td><td class=error>{}</td></tr>",
            text(l.message_id.as_deref().unwrap_or("-")),
            or_dash(l.attempts),
            text(&time(l.last_failed_at)),
            text(l.error.as_deref().unwrap_or("-")),
            id = or_dash(l.id),
        );
    }
    out.push_str("</table>");
    out
}

pub(crate) fn outbox(
    status: &OutboxStatus,
    pending: &[PendingGroup],
    failed: &[FailedMessage],
    csrf: Option<&str>,
) -> String {
    let mut out = format!(
        "<h1>Outbox</h1><p class=rule>red: a failed message, or the oldest pending one older than {}</p>\
         <p class={}>{} pending, {} failed, oldest pending {}</p>",
        short_duration(OUTBOX_PENDING_LIMIT),
        colour(Condition::of_outbox(status)),
        status.pending,
        status.failed,
        status.oldest_pending_age.map_or("-".into(), short_duration)
    );
    out.push_str("<h2>Pending by destination</h2><table><tr><th>exchange</th><th>routing key</th><th>ordering key</th><th>messages</th><th>oldest</th></tr>");
    for p in pending {
        let exchange = if p.exchange.is_empty() && p.routing_key.is_empty() {
            "(packed rows)"
        } else {
            &p.exchange
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0} s</td></tr>",
            text(exchange),
            text(&p.routing_key),
            text(p.ordering_key.as_deref().unwrap_or("-")),
            p.messages,
            p.oldest_secs
        );
    }
    out.push_str("</table><h2>Failed</h2>");
    if let (Some(csrf), false) = (csrf, failed.is_empty()) {
        out.push_str(&action(
            "/outbox/retry",
            csrf,
            &[],
            "Retry every failed message",
        ));
        out.push_str(&action(
            "/outbox/discard",
            csrf,
            &[],
            "Discard every failed message",
        ));
    }
    out.push_str("<table><tr><th>row</th><th>message id</th><th>destination</th><th>attempts</th><th>last error</th><th></th></tr>");
    for f in failed {
        let retry = match csrf {
            Some(csrf) => {
                let row = [("id", f.id.to_string())];
                let row: Vec<(&str, &str)> = row.iter().map(|(k, v)| (*k, v.as_str())).collect();
                action("/outbox/retry", csrf, &row, "Retry")
                    + &action("/outbox/discard", csrf, &row, "Discard")
            }
            None => String::new(),
        };
        let _ = write!(
            out,
            "<tr class=red><td>{}</td><td>{}</td><td>{} / {}</td><td>{}</td><td class=error>{}</td><td>{retry}</td></tr>",
            f.id,
            text(&f.message_id),
            text(&f.exchange),
            text(&f.routing_key),
            f.attempts,
            text(f.last_error.as_deref().unwrap_or("-"))
        );
    }
    out.push_str("</table>");
    out
}

/// The body shown: text when it is, a hex dump of the first bytes otherwise;
/// at most 16 KiB either way.
fn body_preview(body: &[u8]) -> String {
    const SHOWN: usize = 16 * 1024;
    let shown = &body[..body.len().min(SHOWN)];
    let more = if body.len() > SHOWN {
        format!(" (first {SHOWN} of {} bytes)", body.len())
    } else {
        String::new()
    };
    match std::str::from_utf8(shown) {
        Ok(s) => format!("<pre class=body>{}</pre>{}", text(s), text(&more)),
        Err(_) => format!(
            "<pre class=body>binary: {}</pre>{}",
            hex::encode(&shown[..shown.len().min(512)]),
            text(&more)
        ),
    }
}

pub(crate) fn letter(detail: &LetterDetail, csrf: Option<&str>) -> String {
    let l = &detail.letter;
    let mut out = format!(
        "<h1>Dead letter {}</h1><dl>\
         <dt>message id</dt><dd>{}</dd><dt>queue</dt><dd>{}</dd><dt>consumer</dt><dd>{}</dd>\
         <dt>state</dt><dd>{} (replayed {} time(s))</dd><dt>reason</dt><dd>{}</dd>\
         <dt>error</dt><dd class=error>{}</dd><dt>attempts</dt><dd>{} (arrived {} time(s))</dd>\
         <dt>first failed</dt><dd>{}</dd><dt>last failed</dt><dd>{}</dd>\
         <dt>routing</dt><dd>exchange {} · routing key {}</dd></dl>",
        or_dash(l.id),
        text(l.message_id.as_deref().unwrap_or("-")),
        text(l.queue.as_deref().unwrap_or("-")),
        text(l.consumer.as_deref().unwrap_or("-")),
        text(l.state.as_str()),
        l.replay_count,
        text(&l.reason),
        text(l.error.as_deref().unwrap_or("-")),
        or_dash(l.attempts),
        l.deliveries,
        text(&time(l.first_failed_at)),
        text(&time(l.last_failed_at)),
        text(&format!("{:?}", detail.exchange)),
        text(&format!("{:?}", l.routing_key)),
    );
    if let (Some(csrf), "live") = (csrf, l.state.as_str()) {
        let id = or_dash(l.id);
        out.push_str("<div class=actions>");
        out.push_str(&action(
            "/dead-letters/replay",
            csrf,
            &[("id", &id)],
            "Replay…",
        ));
        out.push_str(&action(
            "/dead-letters/discard",
            csrf,
            &[("id", &id)],
            "Discard…",
        ));
        out.push_str("</div>");
    }
    out.push_str("<h2>Headers</h2><table>");
    if let Some(headers) = detail.headers.as_object() {
        for (name, value) in headers {
            let shown = value
                .as_str()
                .map_or_else(|| value.to_string(), str::to_owned);
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td></tr>",
                text(name),
                text(&shown)
            );
        }
    }
    out.push_str("</table><h2>Body</h2>");
    out.push_str(&body_preview(&detail.body));
    out
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
    format!(
        "<h1>Confirm</h1><p>{} {count} {}?</p>{}<p><a href=\"{}\">Cancel</a></p>",
        text(what),
        text(items),
        action(path, csrf, &fields, &format!("{what} {count}")),
        attr(cancel)
    )
}

/// What an action did.
pub(crate) fn done(message: &str) -> String {
    format!(
        "<h1>Done</h1><p class=result>{}</p><p><a href=/dead-letters>Back to the dead letters</a></p>",
        text(message)
    )
}

pub(crate) fn login(failed: bool) -> String {
    format!(
        "<h1>Sign in</h1>{}<form method=post action=/login>\
         <label>Token <input type=password name=token autofocus></label>\
         <button type=submit>Sign in</button></form>",
        if failed {
            "<p class=red>That is not the token.</p>"
        } else {
            ""
        }
    )
}

/// A query-string value, percent-encoded.
pub(crate) fn urlencode(value: &str) -> String {
    form_urlencoded::byte_serialize(value.as_bytes()).collect()
}
