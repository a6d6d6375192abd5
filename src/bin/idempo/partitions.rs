//! `idempo partitions switch|maintain|list`: [`idempo::inbox::partitioned`].

use std::time::Duration;

use clap::{Args, Subcommand};
use idempo::inbox::partitioned::{self, Partitioning};
use serde_json::json;

use crate::{Ctx, output};

#[derive(Subcommand)]
pub(crate) enum PartitionsCommand {
    /// Turn the plain processed_messages into the partitioned one, keeping
    /// every claim (stop the consumers first; start them partitioned after).
    Switch(Cut),
    /// Create partitions ahead and retire those beyond the retention, once
    /// (skipped while another instance maintains).
    Maintain {
        /// The consumer whose retention this registers.
        #[arg(long)]
        consumer: String,
        #[command(flatten)]
        cut: Cut,
    },
    /// The partitions, oldest first.
    List,
}

#[derive(Args)]
pub(crate) struct Cut {
    /// How long claims are kept (`7d`, `1h`); default: forever.
    #[arg(long, value_parser = humantime::parse_duration)]
    retention: Option<Duration>,
    /// Each partition's length (default: an eighth of the retention).
    #[arg(long, value_parser = humantime::parse_duration)]
    period: Option<Duration>,
    /// Periods created ahead of the current one.
    #[arg(long, default_value_t = 2)]
    ahead: u32,
}

impl Cut {
    fn partitioning(&self) -> Partitioning {
        let p = Partitioning::new().ahead(self.ahead);
        match self.period {
            Some(period) => p.period(period),
            None => p,
        }
    }
}

pub(crate) async fn exec(ctx: &Ctx, command: PartitionsCommand) -> anyhow::Result<u8> {
    match command {
        PartitionsCommand::Switch(cut) => {
            let pool = ctx.services.database().await?;
            let s = cut.partitioning().switch(pool, cut.retention).await?;
            if ctx.json {
                output::json(
                    &json!({"already": s.already, "before": s.before, "created": s.created}),
                );
            } else if s.already {
                println!("processed_messages is partitioned already");
            } else {
                println!(
                    "processed_messages is partitioned: the claims before the switch are in {}, {} partition(s) created",
                    s.before.unwrap_or_default(),
                    s.created.len()
                );
            }
        }
        PartitionsCommand::Maintain { consumer, cut } => {
            let pool = ctx.services.database().await?;
            let m = idempo::inbox::Inbox::new(consumer.as_str())
                .maintain(pool, cut.retention, &cut.partitioning())
                .await?;
            if ctx.json {
                output::json(
                    &json!({"skipped": m.skipped, "created": m.created, "dropped": m.dropped, "forgotten": m.forgotten}),
                );
            } else if m.skipped {
                println!("another instance is maintaining the partitions: skipped");
            } else {
                println!(
                    "{} created, {} dropped, {} consumer(s) gone longer than their retention forgotten",
                    m.created.len(),
                    m.dropped.len(),
                    m.forgotten.len()
                );
            }
        }
        PartitionsCommand::List => {
            let pool = ctx.services.database().await?;
            for p in partitioned::Partition::list(pool).await? {
                if ctx.json {
                    output::json(&json!({"name": p.name, "upper_epoch_secs": p.upper_epoch_secs}));
                } else {
                    println!(
                        "{}\t{}",
                        p.name,
                        p.upper_epoch_secs.map_or("-".into(), |u| u.to_string())
                    );
                }
            }
        }
    }
    Ok(0)
}
