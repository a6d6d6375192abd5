//! `idempo outbox failed|retry|discard`: [`FailedMessage`](idempo::outbox::FailedMessage)'s
//! `list`, `retry` and `discard`.

use anyhow::bail;
use clap::{Args, Subcommand};
use serde_json::json;

use crate::{Ctx, output};

#[derive(Subcommand)]
pub(crate) enum OutboxCommand {
    /// The messages the relay gave up on, oldest first, with why.
    Failed {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Put failed messages back to pending (attempts reset): the relay
    /// publishes them again.
    Retry(Selected),
    /// Delete failed messages: they are never published.
    Discard(Selected),
}

/// Which failed rows.
#[derive(Args)]
pub(crate) struct Selected {
    /// Only these rows (repeatable; `outbox failed` shows their ids).
    #[arg(long = "id", value_name = "ROW_ID")]
    ids: Vec<i64>,
    /// Every failed message.
    #[arg(long, conflicts_with = "ids")]
    all: bool,
}

impl Selected {
    /// The ids, `None` for all; an error when neither was said.
    fn ids(&self, verb: &str) -> anyhow::Result<Option<&[i64]>> {
        if self.ids.is_empty() && !self.all {
            bail!("say which failed messages to {verb}: --id ROW_ID (repeatable) or --all");
        }
        Ok((!self.all).then_some(self.ids.as_slice()))
    }

    /// Fails when fewer rows than named were found.
    fn check(&self, done: u64, verb: &str) -> anyhow::Result<()> {
        if !self.all && done < self.ids.len() as u64 {
            bail!(
                "{done} of {} row(s) {verb}: the others are not failed outbox rows",
                self.ids.len()
            );
        }
        Ok(())
    }
}

pub(crate) async fn exec(ctx: &Ctx, command: OutboxCommand) -> anyhow::Result<u8> {
    let pool = ctx.services.database().await?;
    match command {
        OutboxCommand::Failed { limit } => {
            let failed = idempo::outbox::FailedMessage::list(pool, limit).await?;
            if ctx.json {
                for f in &failed {
                    output::json(&json!({
                        "id": f.id, "transport": f.transport, "message_id": f.message_id,
                        "exchange": f.exchange,
                        "routing_key": f.routing_key, "ordering_key": f.ordering_key,
                        "attempts": f.attempts, "last_error": f.last_error,
                    }));
                }
            } else if failed.is_empty() {
                println!("no failed outbox messages");
            } else {
                let mut table = output::table(
                    &["ROW", "MESSAGE ID", "DESTINATION", "ATTEMPTS", "LAST ERROR"],
                    &[3],
                );
                for f in &failed {
                    let destination = if f.exchange.is_empty() {
                        format!("{} {}", f.transport, f.routing_key)
                    } else {
                        format!("{} {} / {}", f.transport, f.exchange, f.routing_key)
                    };
                    table.add_row(vec![
                        f.id.to_string(),
                        f.message_id.to_string(),
                        destination,
                        f.attempts.to_string(),
                        f.last_error.clone().unwrap_or_else(|| "-".into()),
                    ]);
                }
                output::print_table(table);
            }
        }
        OutboxCommand::Retry(selected) => {
            let retried =
                idempo::outbox::FailedMessage::retry(pool, selected.ids("retry")?).await?;
            selected.check(retried, "put back")?;
            if ctx.json {
                output::json(&json!({"retried": retried}));
            } else {
                println!("put {retried} failed message(s) back to pending");
            }
        }
        OutboxCommand::Discard(selected) => {
            let discarded =
                idempo::outbox::FailedMessage::discard(pool, selected.ids("discard")?).await?;
            selected.check(discarded, "discarded")?;
            if ctx.json {
                output::json(&json!({"discarded": discarded}));
            } else {
                println!("discarded {discarded} failed row(s)");
            }
        }
    }
    Ok(0)
}
