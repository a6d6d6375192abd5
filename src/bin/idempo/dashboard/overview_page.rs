//! The overview page: the health of each consumer, queue, delay queue and
//! the outbox as `idempo::ops` decided it, with rates and their charts.

use idempo::ops::{Condition, short_duration};
use maud::{Markup, html};

use super::letter_pages::group_link;
use super::pages::{colour, or_dash, outbox_summary, untrusted};
use super::samples::Latest;

/// A rate as the overview shows it.
fn rate(r: f64) -> String {
    if r >= 10.0 {
        format!("{r:.0}")
    } else {
        format!("{r:.1}")
    }
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
            (short_duration(idempo::consumer::heartbeat::Instance::HEARTBEAT_EVERY)) ")"
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
                        td { (untrusted(&q.label())) }
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
            @if status.queues.iter().any(|q| q.transport == "nats") {
                p class="rule" { "unacked of a JetStream stream: its durable consumers' acks pending, from the server" }
            }
            @if status.queues.iter().any(|q| q.transport == "amqp") {
                @match &latest.management {
                    Ok((url, _)) => {
                        p class="rule" { "unacked of a RabbitMQ queue: the management API at " (untrusted(url)) }
                    }
                    Err(why) => {
                        p class="rule" {
                            "unacked of a RabbitMQ queue: not known (" (untrusted(why)) "); "
                            code { "--management-url" } " says where the API is"
                        }
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
                (outbox_summary(o))
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

#[cfg(test)]
mod tests {
    use super::*;

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
