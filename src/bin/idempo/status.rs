//! `idempo status`: [`Services::status`](idempo::ops::Services::status).

use std::time::Duration;

use clap::Args;
use idempo::ops::StatusOptions;

use crate::{ATTENTION, Ctx, output};

#[derive(Args)]
pub(crate) struct StatusArgs {
    /// Only this consumer (repeatable).
    #[arg(long)]
    consumer: Vec<String>,
    /// Queues to inspect (repeatable; default: one per consumer with claims).
    #[arg(long)]
    queue: Vec<String>,
    /// The consumers' retry delays, for the delay queues and the redelivery horizon.
    #[arg(long, value_delimiter = ',', value_parser = humantime::parse_duration)]
    retry_delays: Vec<Duration>,
    /// The consumers' max_attempts (the default policy's 10), for the
    /// redelivery horizon: every retry at the longest delay.
    #[arg(long, value_name = "N")]
    max_attempts: Option<u32>,
    /// The broker's consumer_timeout (RabbitMQ's default is 30 minutes).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30m")]
    consumer_timeout: Duration,
    /// The claims' retention (the reaper's `older_than`): warn when shorter
    /// than the redelivery horizon.
    #[arg(long, value_parser = humantime::parse_duration)]
    retention: Option<Duration>,
    /// Exit non-zero when a DLQ (or the dead-letter table) holds messages.
    #[arg(long)]
    fail_on_dlq: bool,
}

pub(crate) async fn exec(ctx: &Ctx, args: StatusArgs) -> anyhow::Result<u8> {
    let options = StatusOptions {
        consumers: args.consumer,
        queues: args.queue,
        retry_delays: args.retry_delays,
        max_attempts: args.max_attempts,
        consumer_timeout: args.consumer_timeout,
        retention: args.retention,
        fail_on_dlq: args.fail_on_dlq,
    };
    let status = ctx.services.status(&options).await?;
    if ctx.json {
        output::json(&status);
    } else {
        output::status(&status);
    }
    Ok(if status.needs_attention() {
        ATTENTION
    } else {
        0
    })
}
