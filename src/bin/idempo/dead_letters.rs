//! `idempo dlq …` on the table store: [`idempo::dead_letters`] and
//! [`idempo::ops::dlq::import`], printed.

use std::io::Write;

use anyhow::bail;
use idempo::dead_letters::{self as store, Filter, ReplayOptions};
use serde_json::json;

use crate::output::{self, Progress};
use crate::{ATTENTION, Ctx};

/// How much of a body `dlq show` prints without `--full`.
const SHOWN: usize = 4096;

pub(crate) async fn list(ctx: &Ctx, filter: &Filter, group: bool) -> anyhow::Result<u8> {
    let pool = ctx.services.database().await?;
    if group {
        let groups = store::groups(pool, filter).await?;
        if ctx.json {
            groups.iter().for_each(output::json);
        } else {
            let mut table = output::table(
                &[
                    "COUNT",
                    "REASON",
                    "FINGERPRINT",
                    "LAST SEEN",
                    "SAMPLE ERROR",
                ],
                &[0],
            );
            for g in &groups {
                table.add_row(vec![
                    g.count.to_string(),
                    g.reason.clone(),
                    g.fingerprint.clone(),
                    g.last_seen.to_string(),
                    one_line(&g.sample_error, 80),
                ]);
            }
            output::print_table(table);
        }
        return Ok(0);
    }
    let letters = store::list(pool, filter).await?;
    if ctx.json {
        letters.iter().for_each(output::json);
    } else {
        let mut table = output::table(
            &[
                "ROW",
                "MESSAGE ID",
                "REASON",
                "ATTEMPTS",
                "LAST FAILED",
                "FINGERPRINT",
                "ERROR",
            ],
            &[3],
        );
        for l in &letters {
            table.add_row(vec![
                l.id.to_string(),
                one_line(l.message_id.as_deref().unwrap_or("-"), 25),
                l.reason.clone(),
                l.attempts.to_string(),
                l.last_failed_at.to_string(),
                l.fingerprint.clone(),
                one_line(&l.error, 60),
            ]);
        }
        output::print_table(table);
        if letters.is_empty() {
            println!("no dead letters");
        }
    }
    Ok(0)
}

pub(crate) async fn show(
    ctx: &Ctx,
    queue: &str,
    message_id: Option<&str>,
    row: Option<i64>,
    full: bool,
) -> anyhow::Result<u8> {
    let pool = ctx.services.database().await?;
    let id = match (row, message_id) {
        (Some(row), _) => row,
        (None, Some(message_id)) => {
            let filter = Filter {
                message_ids: vec![message_id.to_owned()],
                any_state: true,
                limit: Some(1_000),
                ..Filter::queue(idempo::amqp::work_queue(queue))
            };
            // The latest letter of that id (a replayed one may have failed again).
            match store::list(pool, &filter).await?.last() {
                Some(letter) => letter.id,
                None => bail!("no dead letter of {queue:?} has message id {message_id:?}"),
            }
        }
        (None, None) => bail!("say which letter: MESSAGE_ID or --letter ROW_ID"),
    };
    let Some(detail) = store::show(pool, id).await? else {
        bail!("no dead letter has row id {id}");
    };
    let shown = if full {
        &detail.body[..]
    } else {
        &detail.body[..detail.body.len().min(SHOWN)]
    };
    let body = String::from_utf8_lossy(shown);
    if ctx.json {
        let mut value = serde_json::to_value(&detail.letter)?;
        value["exchange"] = json!(detail.exchange);
        value["routing_key"] = json!(detail.routing_key);
        value["headers"] = detail.headers.clone();
        value["body"] = json!(body);
        value["body_truncated"] = json!(shown.len() < detail.body.len());
        output::json(&value);
        return Ok(0);
    }
    let l = &detail.letter;
    println!("row:           {}", l.id);
    println!("message id:    {}", l.message_id.as_deref().unwrap_or("-"));
    println!("consumer:      {}", l.consumer);
    println!("queue:         {}", l.queue);
    println!(
        "state:         {} (replayed {} time(s))",
        l.state, l.replay_count
    );
    println!("reason:        {}", l.reason);
    println!("error:         {}", l.error);
    println!("fingerprint:   {}", l.fingerprint);
    println!(
        "attempts:      {} (arrived {} time(s))",
        l.attempts, l.deliveries
    );
    println!("first failed:  {}", l.first_failed_at);
    println!("last failed:   {}", l.last_failed_at);
    println!(
        "routing:       exchange {:?}, routing key {:?}",
        detail.exchange, detail.routing_key
    );
    println!("headers:");
    if let Some(headers) = detail.headers.as_object() {
        for (name, value) in headers {
            let text = value
                .as_str()
                .map_or_else(|| value.to_string(), str::to_owned);
            println!("  {name}: {text}");
        }
    }
    println!(
        "body ({} bytes{}):",
        l.body_bytes,
        if shown.len() < detail.body.len() {
            ", first 4 KiB; --full for all"
        } else {
            ""
        }
    );
    println!("{}", body.escape_debug());
    Ok(0)
}

pub(crate) async fn replay(
    ctx: &Ctx,
    filter: &Filter,
    to: Option<String>,
    force: bool,
    dry_run: bool,
    throttle: Option<std::time::Duration>,
) -> anyhow::Result<u8> {
    let pool = ctx.services.database().await?;
    if !filter.message_ids.is_empty() {
        let found = store::list(
            pool,
            &Filter {
                limit: Some(i64::MAX),
                ..filter.clone()
            },
        )
        .await?;
        let missing: Vec<&String> = filter
            .message_ids
            .iter()
            .filter(|id| !found.iter().any(|l| l.message_id.as_ref() == Some(*id)))
            .collect();
        if !missing.is_empty() {
            bail!("no live dead letter has the message id(s) {missing:?}");
        }
    }
    let options = ReplayOptions {
        to,
        force,
        throttle,
        batch_size: if throttle.is_some() { 1 } else { 100 },
        ..ReplayOptions::by(operator(ctx))
    };
    let counted = store::replay(
        pool,
        filter,
        &ReplayOptions {
            dry_run: true,
            ..options.clone()
        },
        |_| {},
    )
    .await?;
    if dry_run {
        if ctx.json {
            output::json(&json!({"would_replay": counted.replayed}));
        } else {
            println!("would replay {} dead letter(s)", counted.replayed);
        }
        return Ok(0);
    }
    let mut progress = Progress::new(
        ctx.json,
        u32::try_from(counted.replayed).unwrap_or(u32::MAX),
    );
    let report = store::replay(pool, filter, &options, |report| {
        progress.tick(report.replayed, report.skipped.len() as u64);
    })
    .await?;
    progress.done();
    if ctx.json {
        for (row, why) in &report.skipped {
            output::json(&json!({"row": row, "skipped": why}));
        }
        output::json(&json!({"replayed": report.replayed, "skipped": report.skipped.len()}));
    } else {
        for (row, why) in &report.skipped {
            println!("skipped row {row}: {why}");
        }
        println!(
            "replayed {} dead letter(s) through the outbox (the consumers' relay publishes them), skipped {}",
            report.replayed,
            report.skipped.len()
        );
    }
    Ok(if report.skipped.is_empty() {
        0
    } else {
        ATTENTION
    })
}

pub(crate) async fn purge(ctx: &Ctx, filter: &Filter, yes: bool) -> anyhow::Result<u8> {
    let pool = ctx.services.database().await?;
    let count = store::count(pool, filter).await?;
    if count == 0 {
        println!("nothing to delete");
        return Ok(0);
    }
    if !yes {
        eprint!("delete {count} dead letter(s) from the table? [y/N] ");
        let _ = std::io::stderr().flush();
        let mut answer = String::new();
        let _ = std::io::stdin().read_line(&mut answer);
        if !matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes") {
            bail!("not confirmed: nothing deleted (--yes to skip the question)");
        }
    }
    let deleted = store::purge(pool, filter).await?;
    if ctx.json {
        output::json(&json!({"deleted": deleted}));
    } else {
        println!("deleted {deleted} dead letter(s)");
    }
    Ok(0)
}

pub(crate) async fn discard(ctx: &Ctx, filter: &Filter) -> anyhow::Result<u8> {
    let pool = ctx.services.database().await?;
    let discarded = store::discard(pool, filter, &operator(ctx)).await?;
    if ctx.json {
        output::json(&json!({"discarded": discarded}));
    } else {
        println!("discarded {discarded} dead letter(s) (kept until reaped)");
    }
    Ok(0)
}

pub(crate) async fn import(ctx: &Ctx, queue: &str) -> anyhow::Result<u8> {
    let spinner = output::spinner(ctx.json);
    let summary = idempo::ops::dlq::import(&ctx.services, queue, |n| {
        if !spinner.is_hidden() {
            spinner.set_message(format!("{n} imported"));
        } else if !ctx.json && n.is_multiple_of(100) {
            eprintln!("{n} imported");
        }
    })
    .await;
    spinner.finish_and_clear();
    let summary = summary?;
    if ctx.json {
        output::json(&summary);
    } else {
        println!(
            "imported {} dead letter(s) from {} into the table",
            summary.imported, summary.dlq
        );
    }
    Ok(0)
}

/// Who runs the command, as recorded on replayed and discarded letters.
fn operator(ctx: &Ctx) -> String {
    idempo::ops::operator("idempo-cli", &ctx.operator)
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
