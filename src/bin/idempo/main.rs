//! `idempo`: the operations command for the people on call (issue #17).
//!
//! Status, dead letters (list, show, replay, purge), the migrations, and the
//! retention and expiry deletes, run once. Every command reads `AMQP_URL`,
//! `DATABASE_URL` and, for `amqps://`, `AMQP_CA_FILE`,
//! `AMQP_CLIENT_CERT_FILE` and `AMQP_CLIENT_KEY_FILE` (as the payments
//! example does) and takes `--json`. Every variable is read by clap, as the
//! `env` of its flag: the flag wins, and `--help` names the variable.
//!
//! A thin client of [`idempo::ops`]: each command file declares its
//! arguments and calls one library function; `output.rs` prints.

mod dashboard;
mod dead_letters;
mod dlq;
mod errors;
mod maintenance;
mod outbox;
mod output;
mod partitions;
mod status;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::builder::{OsStringValueParser, TypedValueParser};
use clap::{Parser, Subcommand};
use idempo::ClientTls;
use idempo::ops::Services;

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
    /// NATS, where the JetStream consumers' streams are (for their depth).
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        global = true,
        hide_env_values = true
    )]
    nats_url: String,
    /// CA certificates (PEM) to trust for amqps:// instead of the system's.
    #[arg(long, global = true, value_name = "FILE", env = "AMQP_CA_FILE", value_parser = file())]
    amqp_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for amqps://.
    #[arg(long, global = true, value_name = "FILE", env = "AMQP_CLIENT_CERT_FILE", value_parser = file())]
    amqp_client_cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM, unencrypted).
    #[arg(long, global = true, value_name = "FILE", env = "AMQP_CLIENT_KEY_FILE", value_parser = file())]
    amqp_client_key_file: Option<PathBuf>,
    /// Who runs the command: recorded, with this host's name, on the dead
    /// letters it replays or discards.
    #[arg(
        long,
        global = true,
        value_name = "NAME",
        env = "USER",
        default_value = "unknown",
        hide_env_values = true
    )]
    operator: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply idempo's migrations.
    Migrate(maintenance::MigrateArgs),
    /// Claims, queues, outbox, HTTP keys and window entries at a glance.
    Status(status::StatusArgs),
    /// Serve the web dashboard (127.0.0.1:8740 unless --listen says otherwise).
    Dashboard(dashboard::DashboardArgs),
    /// Browse, replay and delete dead letters.
    Dlq {
        #[command(subcommand)]
        command: dlq::DlqCommand,
    },
    /// The outbox's failed messages: list them, put them back to pending.
    Outbox {
        #[command(subcommand)]
        command: outbox::OutboxCommand,
    },
    /// Delete claims older than `--older-than` (the retention reaper, once).
    Reap(maintenance::ReapArgs),
    /// Delete expired HTTP idempotency keys and window entries (the cleanups, once).
    Cleanup(maintenance::CleanupArgs),
    /// The partitioned inbox: switch to it, maintain its partitions, list them.
    Partitions {
        #[command(subcommand)]
        command: partitions::PartitionsCommand,
    },
}

/// A file flag's parser: any path, also an empty one (which names no file,
/// so that an empty variable counts as unset, as it does for the consumers).
fn file() -> impl TypedValueParser<Value = PathBuf> {
    OsStringValueParser::new().map(PathBuf::from)
}

/// What every command gets: the services and the output mode.
struct Ctx {
    json: bool,
    services: Services,
    /// `--operator`: who runs the command.
    operator: String,
    /// `--database-url`: where a probe asks why PostgreSQL does not answer.
    database_url: String,
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
    // An empty variable names no file, as `ClientTls::from_env` reads it.
    let named = |file: Option<PathBuf>| file.filter(|f| !f.as_os_str().is_empty());
    let tls = match ClientTls::files(
        named(cli.amqp_ca_file),
        named(cli.amqp_client_cert_file),
        named(cli.amqp_client_key_file),
    ) {
        Ok(tls) => tls,
        Err(e) => {
            eprintln!(
                "idempo: {e} (--amqp-client-cert-file/AMQP_CLIENT_CERT_FILE and \
                 --amqp-client-key-file/AMQP_CLIENT_KEY_FILE)"
            );
            return ExitCode::FAILURE;
        }
    };
    // Traces over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set: a replay's
    // publishes, the dashboard's requests.
    let telemetry = match idempo::otel::Telemetry::from_env("idempo") {
        Ok(telemetry) => telemetry,
        Err(e) => {
            eprintln!("idempo: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(telemetry) = &telemetry {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        tracing_subscriber::registry()
            .with(telemetry.layer())
            .init();
    }
    let ctx = Ctx {
        json: cli.json,
        operator: cli.operator,
        database_url: cli.database_url.clone(),
        services: Services::new(cli.amqp_url, cli.database_url)
            .nats(cli.nats_url)
            .connection_name("idempo-cli")
            .broker_tls(tls),
    };
    let outcome = runtime.block_on(async {
        let outcome = match cli.command {
            Command::Migrate(args) => maintenance::migrate(&ctx, args).await,
            Command::Status(args) => status::exec(&ctx, args).await,
            Command::Dashboard(args) => dashboard::exec(&ctx, args).await,
            Command::Dlq { command } => dlq::exec(&ctx, command).await,
            Command::Outbox { command } => outbox::exec(&ctx, command).await,
            Command::Reap(args) => maintenance::reap(&ctx, args).await,
            Command::Cleanup(args) => maintenance::cleanup(&ctx, args).await,
            Command::Partitions { command } => partitions::exec(&ctx, command).await,
        };
        match outcome {
            Err(e) => Err(errors::with_cause(e, &ctx.database_url).await),
            done => done,
        }
    });
    if let Some(telemetry) = telemetry {
        telemetry.shutdown();
    }
    match outcome {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("idempo: {}", errors::error_line(&e));
            ExitCode::FAILURE
        }
    }
}
