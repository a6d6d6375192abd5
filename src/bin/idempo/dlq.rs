//! `idempo dlq list|show|replay|purge`: [`idempo::ops::dlq`].

use std::io::Write;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use idempo::ops::OpsError;
use idempo::ops::dlq::{self, PurgeOptions, ReplayEvent, ReplayOptions, Selection};
use serde_json::json;

use crate::output::{self, Progress};
use crate::{ATTENTION, Ctx};

#[derive(Subcommand)]
pub(crate) enum DlqCommand {
    /// List dead letters (they stay in the DLQ, put back without spending a
    /// delivery attempt; a listing that stopped early moves them to its back).
    List {
        /// The work queue (its DLQ is `<queue>.dlq`) or the DLQ itself.
        queue: String,
        #[command(flatten)]
        select: Select,
    },
    /// One dead letter with its headers and body.
    Show {
        queue: String,
        message_id: String,
        /// The whole body, not its first 4 KiB.
        #[arg(long)]
        full: bool,
    },
    /// Move dead letters back to their work queue (confirmed, then acked).
    Replay {
        queue: String,
        #[command(flatten)]
        select: Select,
        /// Every dead letter (required when neither `--id` nor `--reason` selects).
        #[arg(long)]
        all: bool,
        /// Say what would be replayed; move nothing.
        #[arg(long)]
        dry_run: bool,
        /// The work queue for foreign messages (without idempo's headers).
        #[arg(long)]
        to: Option<String>,
        /// Replay ids already processed with a different payload too.
        #[arg(long)]
        force: bool,
        /// Wait this long after each message (spread a large replay out).
        #[arg(long, value_parser = humantime::parse_duration)]
        throttle: Option<Duration>,
    },
    /// Delete dead letters.
    Purge {
        queue: String,
        #[command(flatten)]
        select: Select,
        /// Only those whose last failure is older than this.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Option<Duration>,
        /// Do not ask.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Args)]
pub(crate) struct Select {
    /// Only these message ids (repeatable).
    #[arg(long = "id")]
    ids: Vec<String>,
    /// Only this reason (as in `x-idempo-reason`, e.g. `max attempts exceeded`).
    #[arg(long)]
    reason: Option<String>,
    /// At most this many (for list: default 100).
    #[arg(long)]
    limit: Option<usize>,
}

impl Select {
    fn selection(&self) -> Selection {
        Selection {
            ids: self.ids.clone(),
            reason: self.reason.clone(),
        }
    }
}

pub(crate) async fn exec(ctx: &Ctx, command: DlqCommand) -> anyhow::Result<u8> {
    match command {
        DlqCommand::List { queue, select } => {
            let limit = select.limit.unwrap_or(100);
            let listing = dlq::list(&ctx.services, &queue, &select.selection(), limit).await?;
            output::dead_letters(ctx.json, &listing);
        }
        DlqCommand::Show {
            queue,
            message_id,
            full,
        } => {
            let dead = dlq::show(&ctx.services, &queue, &message_id).await?;
            output::dead_letter(ctx.json, &dead, full)?;
        }
        DlqCommand::Replay {
            queue,
            select,
            all,
            dry_run,
            to,
            force,
            throttle,
        } => {
            let options = ReplayOptions {
                all,
                dry_run,
                to,
                force,
                throttle,
                limit: select.limit,
            };
            return replay(ctx, &queue, &select.selection(), &options).await;
        }
        DlqCommand::Purge {
            queue,
            select,
            older_than,
            yes,
        } => {
            let options = PurgeOptions {
                older_than,
                limit: select.limit,
            };
            return purge(ctx, &queue, &select.selection(), &options, yes).await;
        }
    }
    Ok(0)
}

async fn replay(
    ctx: &Ctx,
    queue: &str,
    selection: &Selection,
    options: &ReplayOptions,
) -> anyhow::Result<u8> {
    let mut progress: Option<Progress> = None;
    let (mut replayed, mut skipped) = (0, 0);
    let summary = dlq::replay(&ctx.services, queue, selection, options, |event| match event {
        ReplayEvent::Started { total, .. } => progress = Some(Progress::new(ctx.json, total)),
        ReplayEvent::Skipped {
            message_id,
            refusal,
        } => {
            let why = output::refusal(refusal);
            if ctx.json {
                output::json(&json!({"message_id": message_id, "skipped": why}));
            } else if !progress.as_ref().is_some_and(Progress::is_bar) {
                println!("skipped {}: {why}", message_id.unwrap_or_default());
            }
            skipped += 1;
            if let Some(p) = &mut progress {
                p.tick(replayed, skipped);
            }
        }
        ReplayEvent::WouldReplay { message_id, queue } => {
            if ctx.json {
                output::json(&json!({"message_id": message_id, "would_replay_to": queue}));
            } else {
                println!("would replay {} to {queue}", message_id.unwrap_or_default());
            }
            replayed += 1;
        }
        ReplayEvent::Replayed { message_id, queue } => {
            replayed += 1;
            if ctx.json {
                output::json(&json!({"message_id": message_id, "replayed_to": queue}));
            }
            if let Some(p) = &mut progress {
                p.tick(replayed, skipped);
            }
        }
        _ => {}
    })
    .await
    .map_err(|e| match e {
        // The library's words, with this command's flags.
        OpsError::NothingSelected => {
            anyhow::anyhow!("say which dead letters to replay: --id, --reason or --all")
        }
        OpsError::TargetQueueNotFound { queue } => anyhow::anyhow!(
            "the work queue {queue:?} does not exist: start its consumer (which declares it) or pass --to"
        ),
        e => e.into(),
    })?;
    if let Some(p) = &progress {
        p.done();
    }
    output::replay_summary(ctx.json, &summary);
    Ok(if summary.skipped.is_empty() {
        0
    } else {
        ATTENTION
    })
}

async fn purge(
    ctx: &Ctx,
    queue: &str,
    selection: &Selection,
    options: &PurgeOptions,
    yes: bool,
) -> anyhow::Result<u8> {
    let plan = dlq::purge(&ctx.services, queue, selection, options).await?;
    let dlq = plan.dlq().to_owned();
    if plan.is_empty() {
        println!("nothing to delete in {dlq}");
        plan.keep().await;
        return Ok(0);
    }
    if !yes {
        eprint!("delete {} dead letter(s) from {dlq}? [y/N] ", plan.len());
        let _ = std::io::stderr().flush();
        let mut answer = String::new();
        let _ = std::io::stdin().read_line(&mut answer);
        if !matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes") {
            plan.keep().await;
            bail!("not confirmed: nothing deleted (--yes to skip the question)");
        }
    }
    let deleted = plan.delete().await?;
    if ctx.json {
        output::json(&json!({"deleted": deleted, "queue": dlq}));
    } else {
        println!("deleted {deleted} dead letter(s) from {dlq}");
    }
    Ok(0)
}
