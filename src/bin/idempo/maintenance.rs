//! `idempo migrate`, `reap` and `cleanup`: [`idempo::ops::maintenance`].

use std::time::Duration;

use clap::Args;
use idempo::ops::maintenance::Progress;
use idempo::ops::short_duration;
use serde_json::json;

use crate::{Ctx, output};

#[derive(Args)]
pub(crate) struct MigrateArgs {
    /// Apply nothing; exit non-zero when some migration is pending.
    #[arg(long)]
    check: bool,
}

#[derive(Args)]
pub(crate) struct ReapArgs {
    /// Only this consumer (default: every consumer with claims).
    #[arg(long)]
    consumer: Vec<String>,
    /// Claims older than this go (`250ms`, `5s`, `2m`, `1h`, `7d`).
    #[arg(long, value_parser = humantime::parse_duration)]
    older_than: Duration,
    /// Rows per statement (at least 1).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
    batch: i64,
}

#[derive(Args)]
pub(crate) struct CleanupArgs {
    /// Rows per statement (at least 1).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
}

pub(crate) async fn migrate(ctx: &Ctx, args: MigrateArgs) -> anyhow::Result<u8> {
    if args.check {
        let status = ctx.services.migrate_status().await?;
        output::migration_status(ctx.json, &status);
        return Ok(if status.is_up_to_date() { 0 } else { 1 });
    }
    let applied = ctx.services.migrate().await?;
    output::migrated(ctx.json, &applied);
    Ok(0)
}

pub(crate) async fn reap(ctx: &Ctx, args: ReapArgs) -> anyhow::Result<u8> {
    let reaped = ctx
        .services
        .reap(
            &args.consumer,
            args.older_than,
            args.batch,
            |progress| match progress {
                Progress::Started { name } if !ctx.json => eprintln!(
                    "reaping {name}: claims older than {}",
                    short_duration(args.older_than)
                ),
                Progress::Done(d) if ctx.json => {
                    output::json(&json!({"consumer": d.name, "deleted": d.deleted}));
                }
                Progress::Done(d) => println!("{}: {} claim(s) deleted", d.name, d.deleted),
                _ => {}
            },
        )
        .await?;
    if !ctx.json {
        let total: u64 = reaped.iter().map(|d| d.deleted).sum();
        println!("{total} claim(s) deleted");
    }
    Ok(0)
}

pub(crate) async fn cleanup(ctx: &Ctx, args: CleanupArgs) -> anyhow::Result<u8> {
    let spinner = output::spinner(ctx.json);
    let cleaned = ctx
        .services
        .cleanup(
            usize::try_from(args.batch).unwrap_or(usize::MAX),
            |progress| match progress {
                Progress::Batch { name, deleted } => {
                    spinner.set_message(format!("{name}: {deleted} expired deleted"));
                }
                Progress::Done(_) => spinner.set_message(String::new()),
                _ => {}
            },
        )
        .await;
    spinner.finish_and_clear();
    let cleaned = cleaned?;
    for d in &cleaned {
        if ctx.json {
            output::json(&json!({"table": d.name, "deleted": d.deleted}));
        } else {
            println!("{}: {} expired row(s) deleted", d.name, d.deleted);
        }
    }
    Ok(0)
}
