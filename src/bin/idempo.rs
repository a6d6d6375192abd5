//! `idempo`: the operations command for the people on call (issue #17).
//!
//! Status, dead letters (list, show, replay, purge), the migrations, and the
//! retention and expiry deletes, run once. Every command reads `AMQP_URL` and
//! `DATABASE_URL` (as the payments example does) and takes `--json`.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use clap::{Args, Parser, Subcommand};
use idempo::amqp::lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use idempo::amqp::lapin::types::{AMQPValue, FieldTable};
use idempo::amqp::lapin::{BasicProperties, Channel, Confirmation, Connection};
use idempo::amqp::{
    ATTEMPTS_HEADER, CONSUMER_HEADER, ERROR_HEADER, FIRST_FAILURE_HEADER, LAST_FAILURE_HEADER,
    MESSAGE_ID_HEADER, QUEUE_HEADER, REASON_HEADER, ROUTING_KEY_HEADER, RedeliveryPolicy,
};
use idempo::http::IdempotencyStore;
use idempo::window::WindowStore;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// The header a replayed copy carries its failure history in (a JSON array,
/// one object per replay: reason, error, attempts, first/last failure).
const REPLAY_HISTORY_HEADER: &str = "x-idempo-replay-history";

/// Headers a replay removes: the attempt counters start again.
const RESET_HEADERS: [&str; 5] = [
    REASON_HEADER,
    ERROR_HEADER,
    ATTEMPTS_HEADER,
    FIRST_FAILURE_HEADER,
    LAST_FAILURE_HEADER,
];

/// Exit code of a command that worked but found something an operator must act on.
const ATTENTION: u8 = 2;

#[derive(Parser)]
#[command(
    name = "idempo",
    version,
    about = "Operate idempo: status, dead letters, replay, cleanup"
)]
struct Cli {
    /// Print JSON (one object per line where a command lists things).
    #[arg(long, global = true)]
    json: bool,
    /// RabbitMQ (one or more comma-separated URLs).
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        global = true,
        hide_env_values = true
    )]
    amqp_url: String,
    /// PostgreSQL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres",
        global = true,
        hide_env_values = true
    )]
    database_url: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply idempo's migrations.
    Migrate {
        /// Apply nothing; exit non-zero when some migration is pending.
        #[arg(long)]
        check: bool,
    },
    /// Claims, queues, outbox, HTTP keys and window entries at a glance.
    Status(StatusArgs),
    /// Browse, replay and delete dead letters.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Delete claims older than `--older-than` (the retention reaper, once).
    Reap {
        /// Only this consumer (default: every consumer with claims).
        #[arg(long)]
        consumer: Vec<String>,
        /// Claims older than this go (`250ms`, `5s`, `2m`, `1h`, `7d`).
        #[arg(long, value_parser = parse_duration)]
        older_than: Duration,
        /// Rows per statement.
        #[arg(long, default_value_t = 1000)]
        batch: i64,
    },
    /// Delete expired HTTP idempotency keys and window entries (the cleanups, once).
    Cleanup {
        /// Rows per statement.
        #[arg(long, default_value_t = 1000)]
        batch: usize,
    },
}

#[derive(Args)]
struct StatusArgs {
    /// Only this consumer (repeatable).
    #[arg(long)]
    consumer: Vec<String>,
    /// Queues to inspect (repeatable; default: one per consumer with claims).
    #[arg(long)]
    queue: Vec<String>,
    /// The consumers' retry delays, for the delay queues and the redelivery horizon.
    #[arg(long, value_delimiter = ',', value_parser = parse_duration)]
    retry_delays: Vec<Duration>,
    /// The broker's consumer_timeout (RabbitMQ's default is 30 minutes).
    #[arg(long, value_parser = parse_duration, default_value = "30m")]
    consumer_timeout: Duration,
    /// The claims' retention (the reaper's `older_than`): warn when shorter
    /// than the redelivery horizon.
    #[arg(long, value_parser = parse_duration)]
    retention: Option<Duration>,
    /// Exit non-zero when a DLQ holds messages.
    #[arg(long)]
    fail_on_dlq: bool,
}

#[derive(Subcommand)]
enum DlqCommand {
    /// List dead letters (they stay in the DLQ, in their order).
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
        #[arg(long, value_parser = parse_duration)]
        throttle: Option<Duration>,
    },
    /// Delete dead letters.
    Purge {
        queue: String,
        #[command(flatten)]
        select: Select,
        /// Only those whose last failure is older than this.
        #[arg(long, value_parser = parse_duration)]
        older_than: Option<Duration>,
        /// Do not ask.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Args, Clone, Default)]
struct Select {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("idempo: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("idempo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<u8> {
    let ctx = Ctx {
        json: cli.json,
        amqp_url: cli.amqp_url,
        database_url: cli.database_url,
    };
    match cli.command {
        Command::Migrate { check } => migrate(&ctx, check).await,
        Command::Status(args) => status(&ctx, args).await,
        Command::Dlq { command } => match command {
            DlqCommand::List { queue, select } => dlq_list(&ctx, &queue, select).await,
            DlqCommand::Show {
                queue,
                message_id,
                full,
            } => dlq_show(&ctx, &queue, &message_id, full).await,
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
                };
                dlq_replay(&ctx, &queue, select, options).await
            }
            DlqCommand::Purge {
                queue,
                select,
                older_than,
                yes,
            } => dlq_purge(&ctx, &queue, select, older_than, yes).await,
        },
        Command::Reap {
            consumer,
            older_than,
            batch,
        } => reap(&ctx, consumer, older_than, batch).await,
        Command::Cleanup { batch } => cleanup(&ctx, batch).await,
    }
}

struct Ctx {
    json: bool,
    amqp_url: String,
    database_url: String,
}

impl Ctx {
    async fn pool(&self) -> anyhow::Result<PgPool> {
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&self.database_url)
            .await
            .with_context(|| {
                format!(
                    "cannot connect to PostgreSQL at {}",
                    without_password(&self.database_url)
                )
            })
    }

    async fn broker(&self) -> anyhow::Result<Connection> {
        let urls = self
            .amqp_url
            .split(',')
            .map(|u| without_password(u.trim()))
            .collect::<Vec<_>>()
            .join(",");
        let broker = idempo::amqp::Broker::new(&self.amqp_url)
            .with_context(|| format!("AMQP_URL {urls} is invalid"))?
            .connection_timeout(Duration::from_secs(10));
        broker
            .connect("idempo-cli")
            .await
            .with_context(|| format!("cannot connect to RabbitMQ at {urls}"))
    }

    fn print(&self, value: &Value) {
        println!("{value}");
    }
}

/// `url` with its password replaced by `***`.
fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{path}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// `250ms`, `5s`, `2m`, `1h`, `7d`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} has no unit (ms, s, m, h, d)"))?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} does not start with a number"))?;
    Ok(match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        "d" => Duration::from_secs(n * 86_400),
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (ms, s, m, h, d)")),
    })
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => format!("{}ms", d.as_millis()),
        s if s < 120 => format!("{s}s"),
        s if s < 7_200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

// ---------------------------------------------------------------- migrate

async fn migrate(ctx: &Ctx, check: bool) -> anyhow::Result<u8> {
    let pool = ctx.pool().await?;
    let migrator = idempo::migrator();
    let applied = applied_migrations(&pool).await?;
    let pending: Vec<(i64, String)> = migrator
        .iter()
        .filter(|m| m.migration_type.is_up_migration())
        .filter(|m| !applied.contains(&m.version))
        .map(|m| (m.version, m.description.to_string()))
        .collect();
    if check {
        if ctx.json {
            ctx.print(&json!({
                "pending": pending.iter().map(|(v, d)| json!({"version": v, "description": d})).collect::<Vec<_>>(),
            }));
        } else if pending.is_empty() {
            println!("up to date: {} migrations applied", applied.len());
        } else {
            println!("{} pending migration(s):", pending.len());
            for (version, description) in &pending {
                println!("  {version:04} {description}");
            }
        }
        return Ok(if pending.is_empty() { 0 } else { 1 });
    }
    idempo::migrate(&pool).await.context("migrating failed")?;
    if ctx.json {
        ctx.print(&json!({"applied": pending.iter().map(|(v, _)| v).collect::<Vec<_>>()}));
    } else if pending.is_empty() {
        println!("up to date");
    } else {
        for (version, description) in &pending {
            println!("applied {version:04} {description}");
        }
    }
    Ok(0)
}

async fn applied_migrations(pool: &PgPool) -> anyhow::Result<Vec<i64>> {
    if !table_exists(pool, idempo::MIGRATIONS_TABLE).await? {
        return Ok(Vec::new());
    }
    let sql = format!(
        "SELECT version FROM {} WHERE success ORDER BY version",
        idempo::MIGRATIONS_TABLE
    );
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(pool)
        .await?)
}

async fn table_exists(pool: &PgPool, table: &str) -> anyhow::Result<bool> {
    let found: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(table)
        .fetch_one(pool)
        .await?;
    Ok(found.is_some())
}

// ---------------------------------------------------------------- status

async fn status(ctx: &Ctx, args: StatusArgs) -> anyhow::Result<u8> {
    let pool = ctx.pool().await?;
    let mut warnings: Vec<String> = Vec::new();
    let delays = if args.retry_delays.is_empty() {
        RedeliveryPolicy::default().delays().to_vec()
    } else {
        args.retry_delays.clone()
    };
    let horizon = delays.iter().sum::<Duration>() + args.consumer_timeout;

    // Consumers.
    let rows: Vec<(String, i64, Option<f64>, Option<f64>)> =
        if table_exists(&pool, "processed_messages").await? {
            sqlx::query_as(
                "SELECT consumer, count(*), \
                    extract(epoch FROM now() - min(processed_at))::float8, \
                    extract(epoch FROM now() - max(processed_at))::float8 \
             FROM processed_messages \
             WHERE cardinality($1::text[]) = 0 OR consumer = ANY($1) \
             GROUP BY consumer ORDER BY consumer",
            )
            .bind(&args.consumer)
            .fetch_all(&pool)
            .await?
        } else {
            warnings.push("idempo's tables do not exist: run `idempo migrate`".into());
            Vec::new()
        };
    let mut consumers = Vec::new();
    for (consumer, claims, oldest, newest) in &rows {
        consumers.push(json!({
            "consumer": consumer,
            "claims": claims,
            "oldest_age_secs": oldest,
            "newest_age_secs": newest,
            "redelivery_horizon_secs": horizon.as_secs_f64(),
        }));
    }
    if let Some(retention) = args.retention
        && retention < horizon
    {
        warnings.push(format!(
            "retention {} is shorter than the redelivery horizon {} (retries {} + consumer_timeout {}): \
             a late redelivery would be processed again",
            human(retention),
            human(horizon),
            human(delays.iter().sum()),
            human(args.consumer_timeout)
        ));
    }

    // Queues.
    let queues: Vec<String> = if args.queue.is_empty() {
        rows.iter().map(|r| r.0.clone()).collect()
    } else {
        args.queue.clone()
    };
    let mut queue_rows = Vec::new();
    if !queues.is_empty() {
        let connection = ctx.broker().await?;
        for queue in &queues {
            let work = passive(&connection, queue).await?;
            if work.is_none() && !args.queue.is_empty() {
                bail!("queue {queue:?} does not exist");
            }
            let dlq = passive(&connection, &format!("{queue}.dlq")).await?;
            let mut delay_rows = Vec::new();
            for delay in &delays {
                let name = idempo::amqp::delay_queue(queue, *delay);
                if let Some((ready, _)) = passive(&connection, &name).await? {
                    delay_rows.push(json!({"queue": name, "ready": ready}));
                }
            }
            if let Some((ready, _)) = dlq
                && ready > 0
                && args.fail_on_dlq
            {
                warnings.push(format!("{queue}.dlq holds {ready} dead letter(s)"));
            }
            queue_rows.push(json!({
                "queue": queue,
                "exists": work.is_some(),
                "ready": work.map(|w| w.0),
                "consumers": work.map(|w| w.1),
                "dlq_ready": dlq.map(|d| d.0),
                "delay_queues": delay_rows,
            }));
        }
        let _ = connection.close(200, "bye".into()).await;
    }

    // Outbox.
    let outbox = if table_exists(&pool, "outbox").await? {
        let s = idempo::outbox::status(&pool).await?;
        if s.failed > 0 {
            warnings.push(format!(
                "the outbox holds {} failed message(s) the relay gave up on",
                s.failed
            ));
        }
        Some(json!({
            "pending": s.pending,
            "failed": s.failed,
            "oldest_pending_age_secs": s.oldest_pending_age.map(|d| d.as_secs_f64()),
        }))
    } else {
        None
    };

    // HTTP keys and window entries.
    let mut expiring = BTreeMap::new();
    for table in ["idempotency_keys", "dedup_window"] {
        if !table_exists(&pool, table).await? {
            continue;
        }
        let sql = format!(
            "SELECT state, count(*) FILTER (WHERE expires_at > clock_timestamp()), \
                    count(*) FILTER (WHERE expires_at <= clock_timestamp()) \
             FROM {table} GROUP BY state ORDER BY state"
        );
        let by_state: Vec<(String, i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .fetch_all(&pool)
            .await?;
        expiring.insert(
            table,
            by_state
                .iter()
                .map(|(state, live, expired)| json!({"state": state, "live": live, "expired": expired}))
                .collect::<Vec<_>>(),
        );
    }

    if ctx.json {
        ctx.print(&json!({
            "consumers": consumers,
            "queues": queue_rows,
            "outbox": outbox,
            "http_keys": expiring.get("idempotency_keys"),
            "window": expiring.get("dedup_window"),
            "warnings": warnings,
        }));
    } else {
        println!("CONSUMER                         CLAIMS   OLDEST   NEWEST   HORIZON");
        for (consumer, claims, oldest, newest) in &rows {
            let age = |s: &Option<f64>| {
                s.map(|s| human(Duration::from_secs_f64(s.max(0.0))))
                    .unwrap_or_else(|| "-".into())
            };
            println!(
                "{consumer:<32} {claims:>6} {:>8} {:>8} {:>9}",
                age(oldest),
                age(newest),
                human(horizon)
            );
        }
        if !queue_rows.is_empty() {
            println!();
            println!("QUEUE                            READY  CONSUMERS   DLQ  DELAY QUEUES");
            for q in &queue_rows {
                let show = |v: &Value| {
                    if v.is_null() {
                        "-".to_owned()
                    } else {
                        v.to_string()
                    }
                };
                let delays = q["delay_queues"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|d| {
                                format!("{}={}", d["queue"].as_str().unwrap_or(""), d["ready"])
                            })
                            .collect::<Vec<_>>()
                            .join(" ")
                    })
                    .unwrap_or_default();
                println!(
                    "{:<32} {:>5} {:>10} {:>5}  {delays}",
                    q["queue"].as_str().unwrap_or(""),
                    show(&q["ready"]),
                    show(&q["consumers"]),
                    show(&q["dlq_ready"]),
                );
            }
            println!(
                "(unacked counts need the management API: ready counts come from passive declares)"
            );
        }
        if let Some(o) = &outbox {
            println!();
            println!(
                "outbox: {} pending, {} failed, oldest pending {}",
                o["pending"],
                o["failed"],
                o["oldest_pending_age_secs"]
                    .as_f64()
                    .map(|s| human(Duration::from_secs_f64(s)))
                    .unwrap_or_else(|| "-".into())
            );
        }
        for (table, states) in &expiring {
            for s in states {
                println!(
                    "{table}: {} {} live, {} expired",
                    s["state"].as_str().unwrap_or(""),
                    s["live"],
                    s["expired"]
                );
            }
        }
        for warning in &warnings {
            println!("WARNING: {warning}");
        }
    }
    Ok(if warnings.is_empty() { 0 } else { ATTENTION })
}

/// Ready messages and consumers of `queue`, or `None` when it does not exist.
/// A fresh channel each time: a failed passive declare closes its channel.
async fn passive(connection: &Connection, queue: &str) -> anyhow::Result<Option<(u32, u32)>> {
    let channel = connection.create_channel().await?;
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    match declared {
        Ok(q) => {
            let _ = channel.close(200, "bye".into()).await;
            Ok(Some((q.message_count(), q.consumer_count())))
        }
        Err(e) if e.to_string().contains("NOT_FOUND") || e.to_string().contains("404") => Ok(None),
        Err(e) => Err(anyhow!(e).context(format!("cannot inspect queue {queue:?}"))),
    }
}

// ---------------------------------------------------------------- dead letters

/// The DLQ of `queue`: `queue` itself when it already ends in `.dlq`.
fn dlq_name(queue: &str) -> String {
    if queue.ends_with(".dlq") {
        queue.to_owned()
    } else {
        format!("{queue}.dlq")
    }
}

/// A dead letter fetched (unacked) from the DLQ.
struct Dead {
    tag: u64,
    properties: BasicProperties,
    body: Vec<u8>,
    routing_key: String,
}

impl Dead {
    fn header(&self, name: &str) -> Option<String> {
        let value = self.properties.headers().as_ref()?.inner().get(name)?;
        text(value)
    }

    fn message_id(&self) -> Option<String> {
        self.header(MESSAGE_ID_HEADER).or_else(|| {
            self.properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str().to_owned())
        })
    }

    fn foreign(&self) -> bool {
        self.header(QUEUE_HEADER).is_none()
    }

    fn reason(&self) -> String {
        self.header(REASON_HEADER)
            .unwrap_or_else(|| "foreign".into())
    }

    fn attempts(&self) -> Option<u64> {
        self.header(ATTEMPTS_HEADER).and_then(|a| a.parse().ok())
    }

    fn selected(&self, select: &Select) -> bool {
        let id_ok =
            select.ids.is_empty() || self.message_id().is_some_and(|id| select.ids.contains(&id));
        let reason_ok = select.reason.as_ref().is_none_or(|r| *r == self.reason());
        id_ok && reason_ok
    }

    fn summary(&self) -> Value {
        json!({
            "message_id": self.message_id(),
            "reason": self.reason(),
            "attempts": self.attempts(),
            "error": self.header(ERROR_HEADER),
            "first_failure": self.header(FIRST_FAILURE_HEADER),
            "last_failure": self.header(LAST_FAILURE_HEADER),
            "consumer": self.header(CONSUMER_HEADER),
            "original_queue": self.header(QUEUE_HEADER),
            "routing_key": self.header(ROUTING_KEY_HEADER).unwrap_or_else(|| self.routing_key.clone()),
            "size": self.body.len(),
            "foreign": self.foreign(),
        })
    }

    fn headers_json(&self) -> Value {
        let mut map = serde_json::Map::new();
        if let Some(headers) = self.properties.headers() {
            for (name, value) in headers.inner() {
                map.insert(
                    name.to_string(),
                    text(value).map_or_else(|| Value::String(format!("{value:?}")), Value::String),
                );
            }
        }
        Value::Object(map)
    }
}

fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::ByteArray(b) => Some(String::from_utf8_lossy(b.as_slice()).into_owned()),
        AMQPValue::ShortShortInt(n) => Some(n.to_string()),
        AMQPValue::ShortShortUInt(n) => Some(n.to_string()),
        AMQPValue::ShortInt(n) => Some(n.to_string()),
        AMQPValue::ShortUInt(n) => Some(n.to_string()),
        AMQPValue::LongInt(n) => Some(n.to_string()),
        AMQPValue::LongUInt(n) => Some(n.to_string()),
        AMQPValue::LongLongInt(n) => Some(n.to_string()),
        _ => None,
    }
}

/// A channel on the DLQ of `queue`, after checking that the DLQ exists.
async fn open_dlq(ctx: &Ctx, queue: &str) -> anyhow::Result<(Connection, Channel, String, u32)> {
    let connection = ctx.broker().await?;
    let dlq = dlq_name(queue);
    let Some((ready, _)) = passive(&connection, &dlq).await? else {
        bail!("queue {dlq:?} does not exist (is {queue:?} the right queue, on the right vhost?)");
    };
    let channel = connection.create_channel().await?;
    Ok((connection, channel, dlq, ready))
}

/// Fetches the next dead letter, unacked: it stays on this channel until
/// acked (deleted) or the channel closes (back into the DLQ).
async fn next(channel: &Channel, dlq: &str) -> anyhow::Result<Option<Dead>> {
    let got = channel
        .basic_get(dlq.into(), BasicGetOptions { no_ack: false })
        .await
        .with_context(|| format!("cannot read {dlq}"))?;
    Ok(got.map(|m| {
        let delivery = m.delivery;
        Dead {
            tag: delivery.delivery_tag,
            properties: delivery.properties,
            body: delivery.data,
            routing_key: delivery.routing_key.to_string(),
        }
    }))
}

/// Walks the DLQ once (every message is held unacked, so none comes twice)
/// and returns the ones `select` picks, at most `limit`.
async fn scan(
    channel: &Channel,
    dlq: &str,
    select: &Select,
    limit: usize,
    mut keep: impl FnMut(&Dead) -> bool,
) -> anyhow::Result<Vec<Dead>> {
    let mut picked = Vec::new();
    while picked.len() < limit {
        let Some(dead) = next(channel, dlq).await? else {
            break;
        };
        if dead.selected(select) && keep(&dead) {
            picked.push(dead);
        }
    }
    Ok(picked)
}

async fn dlq_list(ctx: &Ctx, queue: &str, select: Select) -> anyhow::Result<u8> {
    let (connection, channel, dlq, ready) = open_dlq(ctx, queue).await?;
    let limit = select.limit.unwrap_or(100);
    let found = scan(&channel, &dlq, &select, limit, |_| true).await?;
    // Closing the channel returns every fetched message to the DLQ.
    let _ = channel.close(200, "browsed".into()).await;
    let _ = connection.close(200, "bye".into()).await;
    if ctx.json {
        for dead in &found {
            ctx.print(&dead.summary());
        }
    } else {
        println!(
            "{:<24} {:<28} {:>4}  {:<24} {:<24} {:>6}  ERROR",
            "MESSAGE ID", "REASON", "ATT", "FIRST FAILURE", "LAST FAILURE", "SIZE"
        );
        for dead in &found {
            let s = dead.summary();
            let field = |name: &str| s[name].as_str().unwrap_or("-").to_owned();
            let mut error = field("error").replace('\n', " ");
            if error.chars().count() > 60 {
                error = error.chars().take(57).collect::<String>() + "...";
            }
            println!(
                "{:<24} {:<28} {:>4}  {:<24} {:<24} {:>6}  {error}",
                field("message_id"),
                field("reason"),
                dead.attempts().map_or("-".into(), |a| a.to_string()),
                field("first_failure"),
                field("last_failure"),
                dead.body.len(),
            );
        }
        println!("{} shown of {ready} in {dlq}", found.len());
    }
    Ok(0)
}

async fn dlq_show(ctx: &Ctx, queue: &str, message_id: &str, full: bool) -> anyhow::Result<u8> {
    let (connection, channel, dlq, _) = open_dlq(ctx, queue).await?;
    let select = Select {
        ids: vec![message_id.to_owned()],
        ..Select::default()
    };
    let found = scan(&channel, &dlq, &select, 1, |_| true).await?;
    let _ = channel.close(200, "browsed".into()).await;
    let _ = connection.close(200, "bye".into()).await;
    let Some(dead) = found.into_iter().next() else {
        bail!("no dead letter with message id {message_id:?} in {dlq}");
    };
    const SHOWN: usize = 4096;
    let truncated = !full && dead.body.len() > SHOWN;
    let body = if truncated {
        &dead.body[..SHOWN]
    } else {
        &dead.body[..]
    };
    let parsed: Option<Value> = serde_json::from_slice(&dead.body).ok();
    if ctx.json {
        let mut out = dead.summary();
        out["headers"] = dead.headers_json();
        out["body"] = match (&parsed, truncated) {
            (Some(v), false) => v.clone(),
            _ => Value::String(String::from_utf8_lossy(body).into_owned()),
        };
        out["truncated"] = Value::Bool(truncated);
        ctx.print(&out);
    } else {
        let s = dead.summary();
        for (name, value) in s.as_object().into_iter().flatten() {
            println!(
                "{name:<16} {}",
                value.as_str().map_or(value.to_string(), str::to_owned)
            );
        }
        println!("headers:");
        for (name, value) in dead.headers_json().as_object().into_iter().flatten() {
            println!("  {name}: {}", value.as_str().unwrap_or(""));
        }
        println!("body ({} bytes):", dead.body.len());
        match (&parsed, truncated) {
            (Some(v), false) => println!("{}", serde_json::to_string_pretty(v)?),
            _ => println!("{}", String::from_utf8_lossy(body)),
        }
        if truncated {
            println!("... truncated at {SHOWN} bytes: --full for the whole body");
        }
    }
    Ok(0)
}

struct ReplayOptions {
    all: bool,
    dry_run: bool,
    to: Option<String>,
    force: bool,
    throttle: Option<Duration>,
}

/// Why a dead letter was not replayed.
fn refusal(dead: &Dead, to: Option<&str>, mismatched: bool, force: bool) -> Option<String> {
    if dead.foreign() && to.is_none() {
        return Some("foreign (no x-idempo-original-queue): name the work queue with --to".into());
    }
    if mismatched && !force {
        return Some(
            "its id was already processed with a different payload (--force to replay anyway)"
                .into(),
        );
    }
    None
}

/// Whether the inbox holds `dead`'s id for its consumer with another body's hash.
async fn mismatched(pool: &PgPool, dead: &Dead) -> anyhow::Result<bool> {
    let (Some(consumer), Some(id)) = (dead.header(CONSUMER_HEADER), dead.message_id()) else {
        return Ok(false);
    };
    let stored: Option<Option<Vec<u8>>> = sqlx::query_scalar(
        "SELECT payload_sha256 FROM processed_messages WHERE consumer = $1 AND message_id = $2",
    )
    .bind(consumer)
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(
        matches!(stored, Some(Some(hash)) if hash[..] != idempo::inbox::payload_sha256(&dead.body)[..]),
    )
}

/// The copy to publish: same id, body and properties; the attempt counters
/// dropped and the failure history appended to [`REPLAY_HISTORY_HEADER`].
fn replayed_properties(dead: &Dead) -> BasicProperties {
    let mut headers = FieldTable::default();
    let mut history: Vec<Value> = dead
        .header(REPLAY_HISTORY_HEADER)
        .and_then(|h| serde_json::from_str(&h).ok())
        .unwrap_or_default();
    history.push(json!({
        "reason": dead.header(REASON_HEADER),
        "error": dead.header(ERROR_HEADER),
        "attempts": dead.attempts(),
        "first_failure": dead.header(FIRST_FAILURE_HEADER),
        "last_failure": dead.header(LAST_FAILURE_HEADER),
    }));
    if let Some(old) = dead.properties.headers() {
        for (name, value) in old.inner() {
            if !RESET_HEADERS.contains(&name.as_str()) && name.as_str() != REPLAY_HISTORY_HEADER {
                headers.insert(name.clone(), value.clone());
            }
        }
    }
    headers.insert(
        REPLAY_HISTORY_HEADER.into(),
        AMQPValue::LongString(Value::Array(history).to_string().into()),
    );
    dead.properties.clone().with_headers(headers)
}

async fn dlq_replay(
    ctx: &Ctx,
    queue: &str,
    select: Select,
    options: ReplayOptions,
) -> anyhow::Result<u8> {
    if !options.all && select.ids.is_empty() && select.reason.is_none() {
        bail!("say which dead letters to replay: --id, --reason or --all");
    }
    let pool = ctx.pool().await?;
    let (connection, channel, dlq, ready) = open_dlq(ctx, queue).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let limit = select.limit.unwrap_or(usize::MAX);
    let mut progress = Progress::new(ctx.json, ready.min(limit.try_into().unwrap_or(u32::MAX)));
    let mut replayed = 0u64;
    let mut skipped: BTreeMap<String, u64> = BTreeMap::new();
    let mut checked_targets: BTreeMap<String, bool> = BTreeMap::new();
    let mut seen = 0usize;
    while seen < limit {
        let Some(dead) = next(&channel, &dlq).await? else {
            break;
        };
        if !dead.selected(&select) {
            continue; // stays unacked: back into the DLQ when the channel closes
        }
        seen += 1;
        let target = dead.header(QUEUE_HEADER).or_else(|| options.to.clone());
        let mismatch = mismatched(&pool, &dead).await?;
        if let Some(why) = refusal(&dead, options.to.as_deref(), mismatch, options.force) {
            if ctx.json {
                ctx.print(&json!({"message_id": dead.message_id(), "skipped": why}));
            } else if !progress.bar {
                println!("skipped {}: {why}", dead.message_id().unwrap_or_default());
            }
            *skipped.entry(why).or_default() += 1;
            progress.tick(replayed, &skipped);
            continue;
        }
        let target = target.expect("a target unless refused");
        if !*checked_targets.entry(target.clone()).or_insert(false) {
            if passive(&connection, &target).await?.is_none() {
                bail!(
                    "the work queue {target:?} does not exist: start its consumer (which declares it) or pass --to"
                );
            }
            checked_targets.insert(target.clone(), true);
        }
        if options.dry_run {
            if ctx.json {
                ctx.print(&json!({"message_id": dead.message_id(), "would_replay_to": target}));
            } else {
                println!(
                    "would replay {} to {target}",
                    dead.message_id().unwrap_or_default()
                );
            }
            replayed += 1;
            continue;
        }
        // Crash here: nothing published; the message is in the DLQ.
        let confirm = channel
            .basic_publish(
                "".into(),
                target.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &dead.body,
                replayed_properties(&dead),
            )
            .await?
            .await?;
        if !matches!(confirm, Confirmation::Ack(None)) {
            bail!(
                "the broker did not confirm the copy of {:?} to {target:?} ({confirm:?}); it stays in the DLQ",
                dead.message_id()
            );
        }
        // Crash here: the copy is in the work queue and the original in the
        // DLQ; a second replay publishes it again and the consumer drops it as a duplicate.
        channel
            .basic_ack(dead.tag, BasicAckOptions::default())
            .await
            .context("acking the replayed dead letter")?;
        replayed += 1;
        if ctx.json {
            ctx.print(&json!({"message_id": dead.message_id(), "replayed_to": target}));
        }
        progress.tick(replayed, &skipped);
        if let Some(pause) = options.throttle {
            tokio::time::sleep(pause).await;
        }
    }
    progress.done();
    let _ = channel.close(200, "replayed".into()).await;
    let _ = connection.close(200, "bye".into()).await;
    let verb = if options.dry_run {
        "would replay"
    } else {
        "replayed"
    };
    if ctx.json {
        ctx.print(&json!({"summary": {"replayed": replayed, "dry_run": options.dry_run, "skipped": skipped}}));
    } else {
        println!(
            "{verb} {replayed}, skipped {}",
            skipped.values().sum::<u64>()
        );
        for (why, n) in &skipped {
            println!("  {n} skipped: {why}");
        }
    }
    Ok(if skipped.is_empty() { 0 } else { ATTENTION })
}

/// A progress line on a terminal (redrawn), plain counts every 100 otherwise.
struct Progress {
    bar: bool,
    quiet: bool,
    total: u32,
}

impl Progress {
    fn new(json: bool, total: u32) -> Progress {
        Progress {
            bar: !json && std::io::stderr().is_terminal(),
            quiet: json,
            total,
        }
    }

    fn tick(&mut self, done: u64, skipped: &BTreeMap<String, u64>) {
        if self.quiet {
            return;
        }
        let skipped: u64 = skipped.values().sum();
        let n = done + skipped;
        if self.bar {
            let total = u64::from(self.total.max(1));
            let width = 30;
            let filled = (n.min(total) * width / total) as usize;
            eprint!(
                "\r[{}{}] {n}/{total} replayed {done} skipped {skipped}",
                "#".repeat(filled),
                " ".repeat(width as usize - filled)
            );
            let _ = std::io::stderr().flush();
        } else if n.is_multiple_of(100) {
            eprintln!("{n} done: replayed {done}, skipped {skipped}");
        }
    }

    fn done(&self) {
        if self.bar {
            eprintln!();
        }
    }
}

/// Parses the `2026-12-01T02:19:47.123Z` the runtime writes.
fn parse_rfc3339(text: &str) -> Option<SystemTime> {
    let b = text.as_bytes();
    if b.len() < 20 {
        return None;
    }
    let num = |r: std::ops::Range<usize>| text.get(r)?.parse::<i64>().ok();
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second;
    Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
}

async fn dlq_purge(
    ctx: &Ctx,
    queue: &str,
    select: Select,
    older_than: Option<Duration>,
    yes: bool,
) -> anyhow::Result<u8> {
    let (connection, channel, dlq, _) = open_dlq(ctx, queue).await?;
    let now = SystemTime::now();
    let old_enough = |dead: &Dead| match older_than {
        None => true,
        Some(age) => dead
            .header(LAST_FAILURE_HEADER)
            .and_then(|t| parse_rfc3339(&t))
            .is_some_and(|t| now.duration_since(t).unwrap_or_default() >= age),
    };
    let limit = select.limit.unwrap_or(usize::MAX);
    let picked = scan(&channel, &dlq, &select, limit, old_enough).await?;
    if picked.is_empty() {
        println!("nothing to delete in {dlq}");
        return Ok(0);
    }
    if !yes {
        eprint!("delete {} dead letter(s) from {dlq}? [y/N] ", picked.len());
        let _ = std::io::stderr().flush();
        let mut answer = String::new();
        let _ = std::io::stdin().read_line(&mut answer);
        if !matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes") {
            let _ = channel.close(200, "not purged".into()).await;
            bail!("not confirmed: nothing deleted (--yes to skip the question)");
        }
    }
    for dead in &picked {
        channel
            .basic_ack(dead.tag, BasicAckOptions::default())
            .await?;
    }
    // The close waits for the acks to be sent.
    let _ = channel.close(200, "purged".into()).await;
    let _ = connection.close(200, "bye".into()).await;
    if ctx.json {
        ctx.print(&json!({"deleted": picked.len(), "queue": dlq}));
    } else {
        println!("deleted {} dead letter(s) from {dlq}", picked.len());
    }
    Ok(0)
}

// ---------------------------------------------------------------- reap and cleanup

async fn reap(
    ctx: &Ctx,
    consumers: Vec<String>,
    older_than: Duration,
    batch: i64,
) -> anyhow::Result<u8> {
    let pool = ctx.pool().await?;
    let consumers = if consumers.is_empty() {
        sqlx::query_scalar("SELECT DISTINCT consumer FROM processed_messages ORDER BY 1")
            .fetch_all(&pool)
            .await?
    } else {
        consumers
    };
    let mut total = 0;
    for consumer in &consumers {
        if !ctx.json {
            eprintln!(
                "reaping {consumer}: claims older than {}",
                human(older_than)
            );
        }
        let deleted = idempo::inbox::delete_processed_before(&pool, consumer, older_than, batch)
            .await
            .with_context(|| format!("reaping {consumer}"))?;
        total += deleted;
        if ctx.json {
            ctx.print(&json!({"consumer": consumer, "deleted": deleted}));
        } else {
            println!("{consumer}: {deleted} claim(s) deleted");
        }
    }
    if !ctx.json {
        println!("{total} claim(s) deleted");
    }
    Ok(0)
}

async fn cleanup(ctx: &Ctx, batch: usize) -> anyhow::Result<u8> {
    let pool = ctx.pool().await?;
    let batch = batch.max(1);
    let mut results = Vec::new();
    if table_exists(&pool, "idempotency_keys").await? {
        let store = idempo::http::PostgresStore::new(pool.clone());
        let n = in_batches(ctx, "idempotency_keys", batch, || {
            store.delete_expired(batch)
        })
        .await?;
        results.push(("idempotency_keys", n));
    }
    if table_exists(&pool, "dedup_window").await? {
        let store = idempo::window::PostgresWindow::new(pool.clone());
        let n = in_batches(ctx, "dedup_window", batch, || store.delete_expired(batch)).await?;
        results.push(("dedup_window", n));
    }
    for (table, n) in results {
        if ctx.json {
            ctx.print(&json!({"table": table, "deleted": n}));
        } else {
            println!("{table}: {n} expired row(s) deleted");
        }
    }
    Ok(0)
}

/// Calls `delete` (one bounded batch) until a batch comes back short; returns
/// the total, with a running count on stderr unless `--json`.
async fn in_batches<F, Fut, E>(
    ctx: &Ctx,
    table: &str,
    batch: usize,
    mut delete: F,
) -> anyhow::Result<u64>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<u64, E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let mut n = 0;
    loop {
        let deleted = delete().await?;
        n += deleted;
        if !ctx.json {
            eprint!("\r{table}: {n} expired deleted");
        }
        if deleted < batch as u64 {
            break;
        }
    }
    if !ctx.json {
        eprintln!();
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(
            without_password("amqp://guest:secret@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(
            without_password("postgres://postgres@h/db"),
            "postgres://postgres@h/db"
        );
    }

    #[test]
    fn timestamps_round_trip() {
        let t = parse_rfc3339("2026-12-01T02:19:47.123Z").unwrap();
        assert_eq!(
            t.duration_since(UNIX_EPOCH).unwrap().as_secs(),
            1_796_091_587
        );
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(604_800));
    }
}
