//! How `idempo dlq` prints dead letters, whichever store keeps them.

use std::collections::BTreeMap;

use idempo::ops::dead_letters::{Group, Letter, LetterDetail, Refusal, ReplayReport};
use serde_json::{Value, json};

use crate::output::{json, print_table, table};

/// How much of a body `dlq show` prints without `--full`.
const SHOWN: usize = 4096;

/// A time as the tables print it.
fn time(t: Option<std::time::SystemTime>) -> String {
    t.map_or_else(
        || "-".into(),
        |t| humantime::format_rfc3339_millis(t).to_string(),
    )
}

pub(crate) fn letters(as_json: bool, location: &str, letters: &[Letter]) {
    if as_json {
        letters.iter().for_each(json);
        return;
    }
    let mut rows = table(
        &[
            "ROW",
            "MESSAGE ID",
            "REASON",
            "TRANSPORT",
            "ATT",
            "LAST FAILED",
            "SIZE",
            "FINGERPRINT",
            "ERROR",
        ],
        &[4, 6],
    );
    for l in letters {
        rows.add_row(vec![
            l.id.map_or_else(|| "-".into(), |id| id.to_string()),
            one_line(l.message_id.as_deref().unwrap_or("-"), 25),
            l.reason.clone(),
            l.transport.clone(),
            l.attempts.map_or_else(|| "-".into(), |n| n.to_string()),
            time(l.last_failed_at),
            l.body_bytes.to_string(),
            l.fingerprint.clone(),
            one_line(l.error.as_deref().unwrap_or("-"), 60),
        ]);
    }
    print_table(rows);
    println!("{} shown from {location}", letters.len());
}

pub(crate) fn groups(as_json: bool, groups: &[Group]) {
    if as_json {
        groups.iter().for_each(json);
        return;
    }
    let mut rows = table(
        &[
            "COUNT",
            "REASON",
            "FINGERPRINT",
            "LAST SEEN",
            "SAMPLE ERROR",
        ],
        &[0],
    );
    for g in groups {
        rows.add_row(vec![
            g.count.to_string(),
            g.reason.clone(),
            g.fingerprint.clone(),
            time(g.last_seen),
            one_line(&g.sample_error, 80),
        ]);
    }
    print_table(rows);
}

pub(crate) fn letter(as_json: bool, detail: &LetterDetail, full: bool) -> anyhow::Result<()> {
    let truncated = !full && detail.body.len() > SHOWN;
    let body = if truncated {
        &detail.body[..SHOWN]
    } else {
        &detail.body[..]
    };
    let parsed: Option<Value> = serde_json::from_slice(&detail.body).ok();
    let mut fields = serde_json::to_value(&detail.letter)?;
    fields["exchange"] = json!(detail.exchange);
    if as_json {
        let mut out = fields;
        out["headers"] = detail.headers.clone();
        out["body"] = match (&parsed, truncated) {
            (Some(v), false) => v.clone(),
            _ => Value::String(String::from_utf8_lossy(body).into_owned()),
        };
        out["truncated"] = Value::Bool(truncated);
        json(&out);
        return Ok(());
    }
    // Name and value: a table without a header.
    let mut rows = table(&[], &[]);
    for (name, value) in fields.as_object().into_iter().flatten() {
        if !value.is_null() {
            rows.add_row(vec![name.clone(), text(value)]);
        }
    }
    print_table(rows);
    println!("headers:");
    for (name, value) in detail.headers.as_object().into_iter().flatten() {
        println!("  {name}: {}", text(value));
    }
    println!("body ({} bytes):", detail.body.len());
    match (&parsed, truncated) {
        (Some(v), false) => println!("{}", serde_json::to_string_pretty(v)?),
        _ => println!("{}", String::from_utf8_lossy(body).escape_debug()),
    }
    if truncated {
        println!("... truncated at {SHOWN} bytes: --full for the whole body");
    }
    Ok(())
}

/// A JSON value as one line of text: a string as it is.
fn text(value: &Value) -> String {
    value
        .as_str()
        .map_or_else(|| value.to_string(), |s| one_line(s, usize::MAX))
}

/// Why a dead letter was not replayed, with the flag that changes it.
pub(crate) fn refusal(refusal: Refusal) -> String {
    match refusal {
        Refusal::Foreign => {
            "foreign (no x-idempo-original-queue): name the work queue with --to".into()
        }
        Refusal::NoSuchQueue => {
            format!("{refusal}: start its consumer (which declares it) or pass --to")
        }
        Refusal::PayloadMismatch | Refusal::AlreadyProcessed => {
            format!("{refusal} (--force to replay anyway)")
        }
        other => other.to_string(),
    }
}

/// The last line of `dlq replay`. With `--json`, `summary` keeps the shape
/// earlier versions printed for a RabbitMQ DLQ.
pub(crate) fn replay_report(as_json: bool, table: bool, report: &ReplayReport) {
    let skipped: BTreeMap<String, u64> = report
        .skipped
        .iter()
        .map(|(r, n)| (refusal(*r), *n))
        .collect();
    if as_json {
        json(&json!({
            "replayed": report.replayed,
            "dry_run": report.dry_run,
            "skipped": report.skipped_total(),
            "summary": {
                "replayed": report.replayed,
                "dry_run": report.dry_run,
                "skipped": skipped,
            },
        }));
        return;
    }
    let verb = if report.dry_run {
        "would replay"
    } else {
        "replayed"
    };
    let through = if table && !report.dry_run {
        " through the outbox (the consumers' relay publishes them)"
    } else {
        ""
    };
    println!(
        "{verb} {}{through}, skipped {}",
        report.replayed,
        report.skipped_total()
    );
    for (why, n) in &skipped {
        println!("  {n} skipped: {why}");
    }
}

/// `text` on one line, at most `max` characters.
fn one_line(text: &str, max: usize) -> String {
    let line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(max)
        .collect();
    if text.chars().count() > max {
        format!("{line}…")
    } else {
        line
    }
}
