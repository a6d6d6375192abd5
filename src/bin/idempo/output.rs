//! Everything the commands print: JSON lines, tables, the replay progress.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};

use idempo::ops::dlq::{DeadLetterDetail, Listing, Refusal, ReplaySummary};
use idempo::ops::maintenance::{Migration, MigrationStatus};
use idempo::ops::{Status, short_duration};
use serde::Serialize;
use serde_json::{Value, json};

/// How much of a body `dlq show` prints without `--full`.
const SHOWN: usize = 4096;

/// One JSON object on a line (keys in alphabetical order).
pub(crate) fn json(value: &impl Serialize) {
    // Through a `Value`, whose map keeps keys sorted.
    let value = serde_json::to_value(value).expect("the operations' values serialise");
    println!("{value}");
}

/// `-` for a missing value.
fn or_dash(value: Option<impl ToString>) -> String {
    value.map_or_else(|| "-".into(), |v| v.to_string())
}

pub(crate) fn status(s: &Status) {
    println!("CONSUMER                         CLAIMS   OLDEST   NEWEST   HORIZON");
    for c in &s.consumers {
        println!(
            "{:<32} {:>6} {:>8} {:>8} {:>9}",
            c.consumer,
            c.claims,
            or_dash(c.oldest_age.map(short_duration)),
            or_dash(c.newest_age.map(short_duration)),
            short_duration(c.redelivery_horizon)
        );
    }
    if !s.queues.is_empty() {
        println!();
        println!("QUEUE                            READY  CONSUMERS   DLQ  DELAY QUEUES");
        for q in &s.queues {
            let delays: Vec<String> = q
                .delay_queues
                .iter()
                .map(|d| format!("{}={}", d.queue, d.ready))
                .collect();
            println!(
                "{:<32} {:>5} {:>10} {:>5}  {}",
                q.queue,
                or_dash(q.ready),
                or_dash(q.consumers),
                or_dash(q.dlq_ready),
                delays.join(" ")
            );
        }
        println!(
            "(unacked counts need the management API: ready counts come from passive declares)"
        );
    }
    if let Some(o) = &s.outbox {
        println!();
        println!(
            "outbox: {} pending, {} failed, oldest pending {}",
            o.pending,
            o.failed,
            or_dash(o.oldest_pending_age.map(short_duration))
        );
    }
    // In the table names' order.
    for (table, states) in [
        ("dedup_window", &s.window),
        ("idempotency_keys", &s.http_keys),
    ] {
        for c in states.iter().flatten() {
            println!(
                "{table}: {} {} live, {} expired",
                c.state, c.live, c.expired
            );
        }
    }
    if let Some(letters) = s.dead_letters.as_ref().filter(|l| !l.is_empty()) {
        println!();
        println!(
            "DEAD LETTERS (table)  CONSUMER                 QUEUE                    COUNT  FINGERPRINT       REASON"
        );
        for l in letters {
            println!(
                "                      {:<24} {:<24} {:>5}  {:<17} {}",
                l.consumer, l.queue, l.count, l.fingerprint, l.reason
            );
        }
    }
    if let Some(instances) = s.instances.as_ref().filter(|i| !i.is_empty()) {
        println!();
        println!(
            "PROCESSES (heartbeats)  CONSUMER                 HOST:PID                 STATE         RELAY      LAST BEAT"
        );
        for i in instances {
            println!(
                "                        {:<24} {:<24} {:<13} {:<10} {} ago",
                i.consumer,
                format!("{}:{}", i.host, i.pid),
                i.state,
                i.relay.as_deref().unwrap_or("-"),
                short_duration(std::time::Duration::from_secs_f64(i.seen_secs_ago))
            );
        }
    }
    for warning in &s.warnings {
        println!("WARNING: {warning}");
    }
}

pub(crate) fn dead_letters(as_json: bool, listing: &Listing) {
    if as_json {
        listing.dead_letters.iter().for_each(json);
        return;
    }
    println!(
        "{:<24} {:<28} {:>4}  {:<24} {:<24} {:>6}  ERROR",
        "MESSAGE ID", "REASON", "ATT", "FIRST FAILURE", "LAST FAILURE", "SIZE"
    );
    for d in &listing.dead_letters {
        let text = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        let mut error = text(&d.error).replace('\n', " ");
        if error.chars().count() > 60 {
            error = error.chars().take(57).collect::<String>() + "...";
        }
        println!(
            "{:<24} {:<28} {:>4}  {:<24} {:<24} {:>6}  {error}",
            text(&d.message_id),
            d.reason,
            or_dash(d.attempts),
            text(&d.first_failure),
            text(&d.last_failure),
            d.size,
        );
    }
    println!(
        "{} shown of {} in {}",
        listing.dead_letters.len(),
        listing.ready,
        listing.dlq
    );
}

pub(crate) fn dead_letter(
    as_json: bool,
    dead: &DeadLetterDetail,
    full: bool,
) -> anyhow::Result<()> {
    let truncated = !full && dead.body.len() > SHOWN;
    let body = if truncated {
        &dead.body[..SHOWN]
    } else {
        &dead.body[..]
    };
    let parsed: Option<Value> = serde_json::from_slice(&dead.body).ok();
    let summary = serde_json::to_value(&dead.summary)?;
    if as_json {
        let mut out = summary;
        out["headers"] = json!(dead.headers);
        out["body"] = match (&parsed, truncated) {
            (Some(v), false) => v.clone(),
            _ => Value::String(String::from_utf8_lossy(body).into_owned()),
        };
        out["truncated"] = Value::Bool(truncated);
        json(&out);
        return Ok(());
    }
    for (name, value) in summary.as_object().into_iter().flatten() {
        println!(
            "{name:<16} {}",
            value.as_str().map_or(value.to_string(), str::to_owned)
        );
    }
    println!("headers:");
    for (name, value) in &dead.headers {
        println!("  {name}: {value}");
    }
    println!("body ({} bytes):", dead.body.len());
    match (&parsed, truncated) {
        (Some(v), false) => println!("{}", serde_json::to_string_pretty(v)?),
        _ => println!("{}", String::from_utf8_lossy(body)),
    }
    if truncated {
        println!("... truncated at {SHOWN} bytes: --full for the whole body");
    }
    Ok(())
}

/// Why a dead letter was not replayed, with the flag that changes it.
pub(crate) fn refusal(refusal: Refusal) -> String {
    match refusal {
        Refusal::Foreign => {
            "foreign (no x-idempo-original-queue): name the work queue with --to".into()
        }
        Refusal::PayloadMismatch => {
            "its id was already processed with a different payload (--force to replay anyway)"
                .into()
        }
        other => other.to_string(),
    }
}

pub(crate) fn replay_summary(as_json: bool, summary: &ReplaySummary) {
    let skipped: BTreeMap<String, u64> = summary
        .skipped
        .iter()
        .map(|(r, n)| (refusal(*r), *n))
        .collect();
    if as_json {
        json(&json!({"summary": {
            "replayed": summary.replayed,
            "dry_run": summary.dry_run,
            "skipped": skipped,
        }}));
        return;
    }
    let verb = if summary.dry_run {
        "would replay"
    } else {
        "replayed"
    };
    println!(
        "{verb} {}, skipped {}",
        summary.replayed,
        summary.skipped_total()
    );
    for (why, n) in &skipped {
        println!("  {n} skipped: {why}");
    }
}

pub(crate) fn migration_status(as_json: bool, status: &MigrationStatus) {
    if as_json {
        json(&json!({"pending": status.pending}));
    } else if status.is_up_to_date() {
        println!("up to date: {} migrations applied", status.applied.len());
    } else {
        println!("{} pending migration(s):", status.pending.len());
        for m in &status.pending {
            println!("  {:04} {}", m.version, m.description);
        }
    }
}

pub(crate) fn migrated(as_json: bool, applied: &[Migration]) {
    if as_json {
        json(&json!({"applied": applied.iter().map(|m| m.version).collect::<Vec<_>>()}));
    } else if applied.is_empty() {
        println!("up to date");
    } else {
        for m in applied {
            println!("applied {:04} {}", m.version, m.description);
        }
    }
}

/// A progress line on a terminal (redrawn), plain counts every 100 otherwise.
pub(crate) struct Progress {
    bar: bool,
    quiet: bool,
    total: u32,
}

impl Progress {
    pub(crate) fn new(as_json: bool, total: u32) -> Progress {
        Progress {
            bar: !as_json && std::io::stderr().is_terminal(),
            quiet: as_json,
            total,
        }
    }

    /// Whether it redraws a bar (then per-message lines are left out).
    pub(crate) fn is_bar(&self) -> bool {
        self.bar
    }

    pub(crate) fn tick(&mut self, done: u64, skipped: u64) {
        if self.quiet {
            return;
        }
        let n = done + skipped;
        if self.bar {
            let total = u64::from(self.total.max(1));
            let width = 30;
            let filled = (n.min(total) * width / total) as usize;
            eprint!(
                "\r[{}{}] {n}/{total} replayed {done} skipped {skipped}",
                "#".repeat(filled),
                " ".repeat(width as usize - filled)
            );
            let _ = std::io::stderr().flush();
        } else if n.is_multiple_of(100) {
            eprintln!("{n} done: replayed {done}, skipped {skipped}");
        }
    }

    pub(crate) fn done(&self) {
        if self.bar {
            eprintln!();
        }
    }
}

/// An error and its causes on one line, each cause once: a library error
/// often shows its cause in its own message too (`database error: X`, then
/// `X` as its source), which `{:#}` would print twice.
pub(crate) fn error_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}
