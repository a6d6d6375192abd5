//! `idempo dlq list|show|replay|purge|discard|import`: [`idempo::ops::dlq`]
//! on a RabbitMQ DLQ, [`idempo::dead_letters`] (in `dead_letters.rs`)
//! on the table store.

use std::io::Write;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use idempo::dead_letters::{Filter, LetterState};
use idempo::ops::OpsError;
use idempo::ops::dlq::{self, PurgeOptions, ReplayEvent, ReplayOptions, Selection};
use serde_json::json;

use crate::dead_letters;
use crate::output::{self, Progress};
use crate::{ATTENTION, Ctx};

#[derive(Subcommand)]
pub(crate) enum DlqCommand {
    /// List dead letters (from a RabbitMQ DLQ they stay there, put back
    /// without spending a delivery attempt; a listing that stopped early
    /// moves them to its back).
    List {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        select: Select,
        /// One line per cause (fingerprint) with its count (table store).
        #[arg(long)]
        group: bool,
        /// At most this many dead letters (or groups).
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// One dead letter with its headers and body.
    Show {
        /// `[QUEUE] MESSAGE_ID`: the work queue (unless `--queue` names it)
        /// and the letter's message id.
        #[arg(value_name = "QUEUE MESSAGE_ID", num_args = 0..=2)]
        args: Vec<String>,
        /// The work queue.
        #[arg(long = "queue", value_name = "QUEUE")]
        queue: Option<String>,
        /// The letter's row id in the table store (instead of a message id).
        #[arg(long, value_name = "ROW_ID")]
        letter: Option<i64>,
        /// Where the dead letters are.
        #[arg(long, value_enum, default_value_t = Store::Auto)]
        store: Store,
        /// The whole body, not its first 4 KiB.
        #[arg(long)]
        full: bool,
    },
    /// Replay dead letters to their work queue: from the table store through
    /// the outbox, exactly once; from a RabbitMQ DLQ confirmed, then acked.
    Replay {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        select: Select,
        /// Every dead letter (required when no filter selects).
        #[arg(long)]
        all: bool,
        /// Say what would be replayed; move nothing.
        #[arg(long)]
        dry_run: bool,
        /// The work queue to publish to instead (RabbitMQ DLQ: for foreign
        /// messages without idempo's headers).
        #[arg(long, value_name = "QUEUE")]
        to: Option<String>,
        /// Replay ids already processed too (with another payload: dead-lettered again).
        #[arg(long)]
        force: bool,
        /// Wait this long after each message (spread a large replay out; on
        /// the table store, one letter per transaction then).
        #[arg(long, value_parser = humantime::parse_duration)]
        throttle: Option<Duration>,
        /// Replay at most this many (default: every one selected).
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Delete dead letters.
    Purge {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        select: Select,
        /// Only those whose last failure is older than this.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Option<Duration>,
        /// Do not ask.
        #[arg(long)]
        yes: bool,
        /// Delete at most this many (default: every one selected).
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Mark dead letters discarded (table store): kept for audit, then reaped.
    Discard {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        select: Select,
        /// Every live dead letter of the queue (required when no filter selects).
        #[arg(long)]
        all: bool,
    },
    /// Move a RabbitMQ dead-letter queue into the table store: each message
    /// is acked only after its row committed.
    Import {
        /// The dead-letter queue (e.g. `payments.dlq`), or its work queue.
        #[arg(value_name = "QUEUE")]
        queue: String,
    },
}

/// Where a command finds its dead letters.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Store {
    /// The table when it holds letters of the queue, else the RabbitMQ DLQ.
    Auto,
    /// The `dead_letters` table.
    Table,
    /// The RabbitMQ queue `<queue>.dlq`.
    Queue,
}

#[derive(Args)]
pub(crate) struct Target {
    /// The work queue (its RabbitMQ DLQ is `<queue>.dlq`), or that DLQ.
    #[arg(value_name = "QUEUE")]
    queue: Option<String>,
    /// The work queue, as a flag (instead of the argument).
    #[arg(long = "queue", value_name = "QUEUE", conflicts_with = "queue")]
    queue_flag: Option<String>,
    /// Where the dead letters are.
    #[arg(long, value_enum, default_value_t = Store::Auto)]
    store: Store,
}

impl Target {
    fn queue(&self) -> anyhow::Result<&str> {
        match (&self.queue, &self.queue_flag) {
            (Some(q), _) | (None, Some(q)) => Ok(q),
            (None, None) => bail!("say which queue: QUEUE or --queue QUEUE"),
        }
    }
}

#[derive(Args)]
pub(crate) struct Select {
    /// Only these message ids (repeatable).
    #[arg(long = "id", value_name = "MESSAGE_ID")]
    ids: Vec<String>,
    /// Only this reason (as in `x-idempo-reason`, e.g. `max attempts exceeded`).
    #[arg(long)]
    reason: Option<String>,
    /// Only this cause (table store; `dlq list --group` shows them).
    #[arg(long)]
    fingerprint: Option<String>,
    /// Only those of this consumer (table store).
    #[arg(long)]
    consumer: Option<String>,
    /// Only those that last failed within this long (table store), e.g. `2h`.
    #[arg(long, value_parser = humantime::parse_duration)]
    since: Option<Duration>,
    /// Only those whose JSON body matches this SQL/JSON path (table store),
    /// e.g. '$.account ? (@ == "alice")'.
    #[arg(long, value_name = "JSONPATH")]
    body_path: Option<String>,
    /// Only those in this state (table store): live (the default), replayed, discarded or all.
    #[arg(long, value_name = "STATE")]
    state: Option<String>,
}

impl Select {
    fn selection(&self) -> Selection {
        Selection {
            ids: self.ids.clone(),
            reason: self.reason.clone(),
        }
    }

    /// Whether a filter besides the queue selects.
    fn selects(&self) -> bool {
        !self.ids.is_empty()
            || self.reason.is_some()
            || self.fingerprint.is_some()
            || self.consumer.is_some()
            || self.since.is_some()
            || self.body_path.is_some()
    }

    /// The table-only filters, refused on a RabbitMQ DLQ.
    fn table_only(&self) -> Option<&'static str> {
        [
            (self.fingerprint.is_some(), "--fingerprint"),
            (self.consumer.is_some(), "--consumer"),
            (self.since.is_some(), "--since"),
            (self.body_path.is_some(), "--body-path"),
            (self.state.is_some(), "--state"),
        ]
        .into_iter()
        .find_map(|(set, flag)| set.then_some(flag))
    }

    fn filter(&self, queue: &str) -> anyhow::Result<Filter> {
        let (state, any_state) = match self.state.as_deref() {
            None | Some("live") => (Some(LetterState::Live), false),
            Some("replayed") => (Some(LetterState::Replayed), false),
            Some("discarded") => (Some(LetterState::Discarded), false),
            Some("all") => (None, true),
            Some(other) => bail!("--state {other:?}: say live, replayed, discarded or all"),
        };
        Ok(Filter {
            queue: Some(idempo::amqp::work_queue(queue).to_owned()),
            consumer: self.consumer.clone(),
            reason: self.reason.clone(),
            fingerprint: self.fingerprint.clone(),
            message_ids: self.ids.clone(),
            since: self.since.map(|ago| std::time::SystemTime::now() - ago),
            body_path: self.body_path.clone(),
            state,
            any_state,
            ..Filter::default()
        })
    }
}

pub(crate) async fn exec(ctx: &Ctx, command: DlqCommand) -> anyhow::Result<u8> {
    match command {
        DlqCommand::List {
            target,
            select,
            group,
            limit,
        } => {
            let queue = target.queue()?;
            if uses_table(ctx, target.store, queue, &select).await? {
                let filter = Filter {
                    limit: Some(i64::try_from(limit).unwrap_or(i64::MAX)),
                    ..select.filter(queue)?
                };
                return dead_letters::list(ctx, &filter, group).await;
            }
            if group {
                bail!("--group needs the table store (dead letters kept in PostgreSQL)");
            }
            let listing = dlq::list(&ctx.services, queue, &select.selection(), limit).await?;
            output::dead_letters(ctx.json, &listing);
        }
        DlqCommand::Show {
            args,
            queue,
            letter,
            store,
            full,
        } => {
            let (queue, message_id) = match (queue, args.as_slice()) {
                (Some(q), [id]) => (q, Some(id.clone())),
                (Some(q), []) => (q, None),
                (None, [q, id]) => (q.clone(), Some(id.clone())),
                (None, [q]) if letter.is_some() => (q.clone(), None),
                _ => bail!(
                    "say which letter: QUEUE MESSAGE_ID, --queue QUEUE MESSAGE_ID or --letter ROW_ID"
                ),
            };
            let select = Select::default_for(message_id.clone());
            if letter.is_some() || uses_table(ctx, store, &queue, &select).await? {
                return dead_letters::show(ctx, &queue, message_id.as_deref(), letter, full).await;
            }
            let Some(message_id) = message_id else {
                bail!("--letter needs the table store");
            };
            let dead = dlq::show(&ctx.services, &queue, &message_id).await?;
            output::dead_letter(ctx.json, &dead, full)?;
        }
        DlqCommand::Replay {
            target,
            select,
            all,
            dry_run,
            to,
            force,
            throttle,
            limit,
        } => {
            let queue = target.queue()?;
            if uses_table(ctx, target.store, queue, &select).await? {
                if !all && !select.selects() {
                    bail!(
                        "say which dead letters to replay: --id, --reason, --fingerprint, another filter, or --all"
                    );
                }
                let filter = Filter {
                    limit: limit.map(|l| i64::try_from(l).unwrap_or(i64::MAX)),
                    ..select.filter(queue)?
                };
                return dead_letters::replay(ctx, &filter, to, force, dry_run, throttle).await;
            }
            let options = ReplayOptions {
                all,
                dry_run,
                to,
                force,
                throttle,
                limit,
            };
            return replay(ctx, queue, &select.selection(), &options).await;
        }
        DlqCommand::Purge {
            target,
            select,
            older_than,
            yes,
            limit,
        } => {
            let queue = target.queue()?;
            if uses_table(ctx, target.store, queue, &select).await? {
                let mut filter = select.filter(queue)?;
                if limit.is_some() {
                    bail!(
                        "--limit is for a RabbitMQ DLQ: select the letters to purge with filters"
                    );
                }
                if let Some(age) = older_than {
                    filter.until = Some(std::time::SystemTime::now() - age);
                }
                return dead_letters::purge(ctx, &filter, yes).await;
            }
            let options = PurgeOptions { older_than, limit };
            return purge(ctx, queue, &select.selection(), &options, yes).await;
        }
        DlqCommand::Discard {
            target,
            select,
            all,
        } => {
            let queue = target.queue()?;
            if target.store == Store::Queue {
                bail!("discard needs the table store: a RabbitMQ DLQ can only be purged");
            }
            if !all && !select.selects() {
                bail!(
                    "say which dead letters to discard: --id, --reason, --fingerprint, another filter, or --all"
                );
            }
            return dead_letters::discard(ctx, &select.filter(queue)?).await;
        }
        DlqCommand::Import { queue } => return dead_letters::import(ctx, &queue).await,
    }
    Ok(0)
}

impl Select {
    /// A selection of one message id, for `show`.
    fn default_for(message_id: Option<String>) -> Select {
        Select {
            ids: message_id.into_iter().collect(),
            reason: None,
            fingerprint: None,
            consumer: None,
            since: None,
            body_path: None,
            state: None,
        }
    }
}

/// Whether the command works on the table store: asked for, or (auto) the
/// table holds letters of `queue`. Table-only filters on a RabbitMQ DLQ are
/// refused.
async fn uses_table(ctx: &Ctx, store: Store, queue: &str, select: &Select) -> anyhow::Result<bool> {
    let table = match store {
        Store::Table => true,
        Store::Queue => false,
        Store::Auto => match idempo::ops::dlq::table_holds(&ctx.services, queue).await {
            Ok(holds) => holds,
            // The queue's DLQ can still be read while PostgreSQL is away.
            Err(e) => {
                eprintln!(
                    "warning: cannot look for dead letters in PostgreSQL ({e}); reading the RabbitMQ DLQ"
                );
                false
            }
        },
    };
    if !table && let Some(flag) = select.table_only() {
        bail!(
            "{flag} needs the table store: no dead letters of {queue:?} are kept in PostgreSQL \
             (a consumer with dead_letters(DeadLetters::Table), or `idempo dlq import`)"
        );
    }
    Ok(table)
}

async fn replay(
    ctx: &Ctx,
    queue: &str,
    selection: &Selection,
    options: &ReplayOptions,
) -> anyhow::Result<u8> {
    let mut progress: Option<Progress> = None;
    let (mut replayed, mut skipped) = (0, 0);
    let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
    let summary = dlq::replay(&ctx.services, queue, selection, options, |event| match event {
        ReplayEvent::Started { total, .. } => progress = Some(Progress::new(ctx.json, total)),
        ReplayEvent::Skipped {
            message_id,
            refusal,
        } => {
            seen.extend(message_id.map(str::to_owned));
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
            seen.extend(message_id.map(str::to_owned));
            if ctx.json {
                output::json(&json!({"message_id": message_id, "would_replay_to": queue}));
            } else {
                println!("would replay {} to {queue}", message_id.unwrap_or_default());
            }
            replayed += 1;
        }
        ReplayEvent::Replayed { message_id, queue } => {
            seen.extend(message_id.map(str::to_owned));
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
    let missing: Vec<&String> = selection
        .ids
        .iter()
        .filter(|id| !seen.contains(*id))
        .collect();
    if !missing.is_empty() && missing.len() == selection.ids.len() {
        bail!("no dead letter of {queue:?} has the message id(s) {missing:?}");
    }
    if !missing.is_empty() {
        eprintln!("not found in the DLQ of {queue:?}: {missing:?}");
    }
    Ok(if summary.skipped.is_empty() && missing.is_empty() {
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
    if yes {
        // No question: delete while walking, one letter held at a time.
        let (dlq, deleted) = dlq::purge_now(&ctx.services, queue, selection, options).await?;
        if ctx.json {
            output::json(&json!({"deleted": deleted, "queue": dlq}));
        } else if deleted == 0 {
            println!("nothing to delete in {dlq}");
        } else {
            println!("deleted {deleted} dead letter(s) from {dlq}");
        }
        return Ok(0);
    }
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
