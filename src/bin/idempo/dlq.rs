//! `idempo dlq list|show|replay|purge|discard|import`: thin commands over
//! [`idempo::ops::dead_letters`], whichever store keeps the letters
//! (printed by `dead_letters.rs`).

use std::io::Write;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use idempo::ops::OpsError;
use idempo::ops::dead_letters::{
    DeadLetterStore, Filter, LetterRef, LetterState, ReplayEvent, ReplayOptions, Store,
};
use serde_json::json;

use crate::dead_letters as print;
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
        #[arg(long, value_enum, default_value_t = StoreArg::Auto)]
        store: StoreArg,
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
pub(crate) enum StoreArg {
    /// The table when it holds letters of the queue, else the RabbitMQ DLQ.
    Auto,
    /// The `dead_letters` table.
    Table,
    /// The RabbitMQ queue `<queue>.dlq`.
    Queue,
}

impl From<StoreArg> for Store {
    fn from(store: StoreArg) -> Store {
        match store {
            StoreArg::Auto => Store::Auto,
            StoreArg::Table => Store::Table,
            StoreArg::Queue => Store::Queue,
        }
    }
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
    #[arg(long, value_enum, default_value_t = StoreArg::Auto)]
    store: StoreArg,
}

impl Target {
    fn queue(&self) -> anyhow::Result<&str> {
        match (&self.queue, &self.queue_flag) {
            (Some(q), _) | (None, Some(q)) => Ok(q),
            (None, None) => bail!("say which queue: QUEUE or --queue QUEUE"),
        }
    }

    async fn open(&self, ctx: &Ctx) -> anyhow::Result<(&str, DeadLetterStore)> {
        let queue = self.queue()?;
        let store = DeadLetterStore::open(&ctx.services, queue, self.store.into()).await?;
        Ok((queue, store))
    }
}

#[derive(Args, Default)]
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
    fn filter(&self, queue: &str) -> anyhow::Result<Filter> {
        let (state, any_state) = match self.state.as_deref() {
            None => (None, false),
            Some("all") => (None, true),
            Some(name) => match LetterState::parse(name) {
                Some(state) => (Some(state), false),
                None => bail!("--state {name:?}: say live, replayed, discarded or all"),
            },
        };
        Ok(Filter {
            queue: Some(idempo::amqp::Amqp::work_queue(queue).to_owned()),
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

/// A count as the library's limit.
fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

pub(crate) async fn exec(ctx: &Ctx, command: DlqCommand) -> anyhow::Result<u8> {
    match command {
        DlqCommand::List {
            target,
            select,
            group,
            limit: most,
        } => {
            let (queue, store) = target.open(ctx).await?;
            let filter = Filter {
                limit: Some(limit(most)),
                ..select.filter(queue)?
            };
            if group {
                print::groups(ctx.json, &store.groups(&filter).await?);
            } else {
                print::letters(ctx.json, &store.location(), &store.list(&filter).await?);
            }
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
            let (which, store) = match (letter, message_id) {
                (Some(row), _) => (LetterRef::Row(row), Store::Table),
                (None, Some(id)) => (LetterRef::MessageId(id), store.into()),
                (None, None) => bail!("say which letter: MESSAGE_ID or --letter ROW_ID"),
            };
            let store = DeadLetterStore::open(&ctx.services, &queue, store).await?;
            let Some(detail) = store.show(&which).await? else {
                match which {
                    LetterRef::Row(row) => bail!("no dead letter has row id {row}"),
                    LetterRef::MessageId(id) => bail!(
                        "no dead letter of {queue:?} has message id {id:?} (in {})",
                        store.location()
                    ),
                }
            };
            print::letter(ctx.json, &detail, full)?;
        }
        DlqCommand::Replay {
            target,
            select,
            all,
            dry_run,
            to,
            force,
            throttle,
            limit: most,
        } => {
            let (queue, store) = target.open(ctx).await?;
            let filter = Filter {
                limit: most.map(limit),
                ..select.filter(queue)?
            };
            let options = ReplayOptions {
                all,
                dry_run,
                to,
                force,
                throttle,
                ..ReplayOptions::by(operator(ctx))
            };
            return replay(ctx, queue, &store, &filter, &options).await;
        }
        DlqCommand::Purge {
            target,
            select,
            older_than,
            yes,
            limit: most,
        } => {
            let (queue, store) = target.open(ctx).await?;
            let filter = Filter {
                until: older_than.map(|age| std::time::SystemTime::now() - age),
                limit: most.map(limit),
                ..select.filter(queue)?
            };
            return purge(ctx, &store, &filter, yes).await;
        }
        DlqCommand::Discard {
            target,
            select,
            all,
        } => {
            let (queue, store) = target.open(ctx).await?;
            let filter = select.filter(queue)?;
            let discarded = store
                .discard(&filter, &operator(ctx), all)
                .await
                .map_err(|e| match e {
                    OpsError::NothingSelected => anyhow::anyhow!(
                        "say which dead letters to discard: --id, --reason, --fingerprint, another filter, or --all"
                    ),
                    e => e.into(),
                })?;
            if ctx.json {
                output::json(&json!({"discarded": discarded}));
            } else {
                println!("discarded {discarded} dead letter(s) (kept until reaped)");
            }
        }
        DlqCommand::Import { queue } => return import(ctx, &queue).await,
    }
    Ok(0)
}

async fn replay(
    ctx: &Ctx,
    queue: &str,
    store: &DeadLetterStore,
    filter: &Filter,
    options: &ReplayOptions,
) -> anyhow::Result<u8> {
    let mut progress: Option<Progress> = None;
    let (mut replayed, mut skipped) = (0, 0);
    let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
    let report = store
        .replay(filter, options, |event| match event {
            ReplayEvent::Started { total } => {
                progress = Some(Progress::new(ctx.json, u32::try_from(total).unwrap_or(u32::MAX)));
            }
            ReplayEvent::Skipped {
                message_id,
                row,
                refusal,
            } => {
                seen.extend(message_id.map(str::to_owned));
                let why = print::refusal(refusal);
                let what = message_id.map_or_else(|| format!("row {}", row.unwrap_or_default()), str::to_owned);
                if ctx.json {
                    output::json(&json!({"message_id": message_id, "row": row, "skipped": why}));
                } else if !progress.as_ref().is_some_and(Progress::is_bar) {
                    println!("skipped {what}: {why}");
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
            OpsError::NothingSelected => anyhow::anyhow!(
                "say which dead letters to replay: --id, --reason, --fingerprint, another filter, or --all"
            ),
            OpsError::TargetQueueNotFound { queue } => anyhow::anyhow!(
                "the work queue {queue:?} does not exist: start its consumer (which declares it) or pass --to"
            ),
            e => e.into(),
        })?;
    if let Some(p) = &progress {
        p.done();
    }
    print::replay_report(ctx.json, store.is_table(), &report);
    // A dry run of the table counts without naming letters.
    let missing: Vec<&String> = if options.dry_run && store.is_table() {
        Vec::new()
    } else {
        filter
            .message_ids
            .iter()
            .filter(|id| !seen.contains(*id))
            .collect()
    };
    if !missing.is_empty() && missing.len() == filter.message_ids.len() {
        bail!("no live dead letter of {queue:?} has the message id(s) {missing:?}");
    }
    if !missing.is_empty() {
        eprintln!("not found in {}: {missing:?}", store.location());
    }
    Ok(if report.skipped.is_empty() && missing.is_empty() {
        0
    } else {
        ATTENTION
    })
}

async fn purge(
    ctx: &Ctx,
    store: &DeadLetterStore,
    filter: &Filter,
    yes: bool,
) -> anyhow::Result<u8> {
    let location = store.location();
    let deleted = if yes {
        // No question: a DLQ is walked holding one letter at a time.
        store.purge_now(filter).await?
    } else {
        let plan = store.purge(filter).await?;
        if plan.is_empty() {
            plan.keep().await;
            0
        } else {
            eprint!(
                "delete {} dead letter(s) from {location}? [y/N] ",
                plan.len()
            );
            let _ = std::io::stderr().flush();
            let mut answer = String::new();
            let _ = std::io::stdin().read_line(&mut answer);
            if !matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes") {
                plan.keep().await;
                bail!("not confirmed: nothing deleted (--yes to skip the question)");
            }
            plan.delete().await?
        }
    };
    if ctx.json {
        output::json(&json!({"deleted": deleted, "queue": location}));
    } else if deleted == 0 {
        println!("nothing to delete in {location}");
    } else {
        println!("deleted {deleted} dead letter(s) from {location}");
    }
    Ok(0)
}

async fn import(ctx: &Ctx, queue: &str) -> anyhow::Result<u8> {
    let spinner = output::spinner(ctx.json);
    let report = ctx
        .services
        .import_dead_letters(queue, |n| {
            if !spinner.is_hidden() {
                spinner.set_message(format!("{n} imported"));
            } else if !ctx.json && n.is_multiple_of(100) {
                eprintln!("{n} imported");
            }
        })
        .await;
    spinner.finish_and_clear();
    let report = report?;
    if ctx.json {
        output::json(&report);
    } else {
        println!(
            "imported {} dead letter(s) from {} into the table",
            report.imported, report.dlq
        );
    }
    Ok(0)
}

/// Who runs the command, as recorded on replayed and discarded letters.
fn operator(ctx: &Ctx) -> String {
    idempo::ops::dead_letters::ReplayOptions::by_operator("idempo-cli", &ctx.operator).by
}
