//! Everything the commands print: JSON lines, tables, progress.

use std::io::IsTerminal;

use comfy_table::{CellAlignment, Table, presets};
use idempo::ops::maintenance::{Migration, MigrationStatus};
use idempo::ops::{Status, short_duration};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use serde_json::json;

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

/// A table as the commands print it: plain ASCII without borders, columns
/// apart by two spaces, one row a line, so that `awk` and `cut` can split it.
/// `right` names the columns aligned right (the counts); no header when
/// `header` is empty.
pub(crate) fn table(header: &[&str], right: &[usize]) -> Table {
    let mut table = Table::new();
    table.load_style(presets::NOTHING);
    if !header.is_empty() {
        table.set_header(header.to_vec());
    }
    for &i in right {
        if let Some(column) = table.column_mut(i) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    table
}

/// Prints `table`.
pub(crate) fn print_table(table: Table) {
    println!("{}", render(table));
}

/// `table` as text, without the spaces that pad its last column.
fn render(mut table: Table) -> String {
    // No padding on the left: the first column starts the line.
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    table.trim_fmt()
}

pub(crate) fn status(s: &Status) {
    let mut consumers = table(
        &["CONSUMER", "CLAIMS", "OLDEST", "NEWEST", "HORIZON"],
        &[1, 2, 3, 4],
    );
    for c in &s.consumers {
        consumers.add_row(vec![
            c.consumer.clone(),
            c.claims.to_string(),
            or_dash(c.oldest_age.map(short_duration)),
            or_dash(c.newest_age.map(short_duration)),
            short_duration(c.redelivery_horizon),
        ]);
    }
    print_table(consumers);
    if !s.queues.is_empty() {
        println!();
        let mut queues = table(
            &[
                "QUEUE",
                "READY",
                "UNACKED",
                "CONSUMERS",
                "DLQ",
                "DELAY QUEUES",
            ],
            &[1, 2, 3, 4],
        );
        for q in &s.queues {
            let delays: Vec<String> = q
                .delay_queues
                .iter()
                .map(|d| format!("{}={}", d.queue, d.ready))
                .collect();
            queues.add_row(vec![
                q.label(),
                or_dash(q.ready),
                or_dash(q.unacked),
                or_dash(q.consumers),
                or_dash(q.dlq_ready),
                delays.join(" "),
            ]);
        }
        print_table(queues);
        println!(
            "(RabbitMQ's unacked counts need the management API: ready counts come from passive declares)"
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
        // The first column is the section's title, its cells empty.
        let mut table = table(
            &[
                "DEAD LETTERS (table)",
                "CONSUMER",
                "QUEUE",
                "COUNT",
                "FINGERPRINT",
                "REASON",
            ],
            &[3],
        );
        for l in letters {
            table.add_row(vec![
                String::new(),
                l.consumer.clone(),
                l.queue.clone(),
                l.count.to_string(),
                l.fingerprint.clone(),
                l.reason.clone(),
            ]);
        }
        print_table(table);
    }
    if let Some(instances) = s.instances.as_ref().filter(|i| !i.is_empty()) {
        println!();
        let mut table = table(
            &[
                "PROCESSES (heartbeats)",
                "CONSUMER",
                "HOST:PID",
                "STATE",
                "RELAY",
                "LAST BEAT",
            ],
            &[],
        );
        for i in instances {
            table.add_row(vec![
                String::new(),
                i.consumer.clone(),
                format!("{}:{}", i.host, i.pid),
                i.state.clone(),
                i.relay.clone().unwrap_or_else(|| "-".into()),
                format!(
                    "{} ago",
                    short_duration(std::time::Duration::from_secs_f64(i.seen_secs_ago))
                ),
            ]);
        }
        print_table(table);
    }
    for warning in &s.warnings {
        println!("WARNING: {warning}");
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

/// Whether progress is drawn: not with `--json`, and only on a terminal.
fn draws(as_json: bool) -> bool {
    !as_json && std::io::stderr().is_terminal()
}

/// A replay's progress: a bar on a terminal, plain counts every 100
/// messages otherwise (a log keeps them), nothing with `--json`.
pub(crate) struct Progress {
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl Progress {
    pub(crate) fn new(as_json: bool, total: u32) -> Progress {
        let bar = draws(as_json).then(|| {
            let style = ProgressStyle::with_template("[{bar:30}] {pos}/{len} {msg}")
                .expect("the template parses")
                .progress_chars("#> ");
            ProgressBar::with_draw_target(Some(u64::from(total)), ProgressDrawTarget::stderr())
                .with_style(style)
        });
        Progress {
            bar,
            quiet: as_json,
        }
    }

    /// Whether it draws a bar (then per-message lines are left out).
    pub(crate) fn is_bar(&self) -> bool {
        self.bar.is_some()
    }

    pub(crate) fn tick(&mut self, done: u64, skipped: u64) {
        let n = done + skipped;
        match &self.bar {
            Some(bar) => {
                bar.set_position(n);
                bar.set_message(format!("replayed {done} skipped {skipped}"));
            }
            None if !self.quiet && n.is_multiple_of(100) => {
                eprintln!("{n} done: replayed {done}, skipped {skipped}");
            }
            None => {}
        }
    }

    /// Leaves the bar's last state on the screen.
    pub(crate) fn done(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

/// A count redrawn on a terminal (a spinner and a message), hidden when
/// stderr is not one or with `--json`.
pub(crate) fn spinner(as_json: bool) -> ProgressBar {
    if !draws(as_json) {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template("{spinner} {msg}").expect("the template parses");
    let spinner =
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()).with_style(style);
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    spinner
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_plain_columns_two_spaces_apart() {
        let mut counts = table(&["QUEUE", "READY", "DELAY QUEUES"], &[1]);
        counts.add_row(vec!["payments", "3", "payments.retry.10s=1"]);
        counts.add_row(vec!["a", "12", ""]);
        assert_eq!(
            render(counts),
            "QUEUE     READY  DELAY QUEUES\n\
             payments      3  payments.retry.10s=1\n\
             a            12"
        );
        let mut fields = table(&[], &[]);
        fields.add_row(vec!["reason", "rejected"]);
        assert_eq!(render(fields), "reason  rejected");
    }
}
