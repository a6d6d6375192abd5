//! Heartbeats: every running consumer writes its state and counters to
//! `idempo_heartbeats` every few seconds, so that `idempo dashboard` (another
//! process, maybe another host) can show deliveries, duplicates, retries and
//! dead letters per second, and the relay's state, of every instance.
//!
//! A heartbeat that fails (the database away, the table not migrated) is
//! logged at debug level and tried again at the next beat: it never slows or
//! stops the consumer.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::runtime::health::Health;
use crate::runtime::stats::{Stats, StatsSnapshot};

/// How often a running consumer writes its heartbeat ([`Instance::HEARTBEAT_EVERY`]).
pub(crate) const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// Rows not written for this long are deleted (by the next consumer start).
const FORGET_AFTER: &str = "1 day";

/// One consumer process as its last heartbeat described it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Instance {
    /// `host:pid:random`, new at every start.
    pub instance: String,
    /// The consumer's name.
    pub consumer: String,
    /// The queue it consumes.
    pub queue: String,
    /// The host it runs on.
    pub host: String,
    /// Its process id there.
    pub pid: i32,
    /// Seconds since it started.
    pub up_secs: f64,
    /// Seconds since its last heartbeat (more than a few: it is gone).
    pub seen_secs_ago: f64,
    /// The runtime's state (`consuming`, `reconnecting`, `stopped`, ...).
    pub state: String,
    /// The state of the outbox relay it runs (`running`, `blocked`, ...).
    pub relay: Option<String>,
    /// Its counters since it started.
    pub counters: StatsSnapshot,
    /// The transport its queue is on: `amqp`, or `nats` (the queue is then
    /// a JetStream stream).
    pub transport: String,
}

impl Instance {
    /// How often a running consumer (or relay) writes its heartbeat: 5 s.
    pub const HEARTBEAT_EVERY: Duration = HEARTBEAT_EVERY;

    /// Whether its last heartbeat is recent (three beats) and it has not stopped.
    pub fn is_alive(&self) -> bool {
        self.state != "stopped" && self.seen_secs_ago < 3.0 * HEARTBEAT_EVERY.as_secs_f64()
    }
}

/// A row of `idempo_heartbeats` as [`instances`] reads it.
#[cfg(feature = "ops")]
#[derive(sqlx::FromRow)]
struct Row {
    instance: String,
    consumer: String,
    queue: String,
    host: String,
    pid: i32,
    up_secs: f64,
    seen_secs_ago: f64,
    state: String,
    relay: Option<String>,
    counters: serde_json::Value,
    transport: String,
}

/// Who is beating.
#[derive(Clone)]
pub(crate) struct Identity {
    pub(crate) instance: String,
    pub(crate) consumer: String,
    pub(crate) queue: String,
    /// The transport its queue is on: `amqp` or `nats`.
    pub(crate) transport: &'static str,
}

impl Identity {
    pub(crate) fn new(consumer: &str, queue: &str) -> Self {
        let host = crate::host::name();
        Identity {
            instance: format!("{host}:{}:{:08x}", std::process::id(), fastrand::u32(..)),
            consumer: consumer.to_owned(),
            queue: queue.to_owned(),
            transport: "amqp",
        }
    }

    /// The same, for a consumer of another transport.
    pub(crate) fn on(mut self, transport: &'static str) -> Self {
        self.transport = transport;
        self
    }
}

/// Writes a heartbeat now, every [`HEARTBEAT_EVERY`] and when the runtime's
/// state changes, until `stop` (the caller writes the last one, `stopped`,
/// after the runtime ended).
pub(crate) async fn beat_periodically(
    pool: PgPool,
    who: Identity,
    stats: Stats,
    health: Health,
    stop: CancellationToken,
) {
    if let Err(e) = forget_stale(&pool).await {
        tracing::debug!(error = %e, "heartbeat: cannot delete stale rows");
    }
    loop {
        let state = health.snapshot().state;
        beat_once(&pool, &who, &stats, &health, None).await;
        // A change of state is written at once (consuming, reconnecting, ...).
        tokio::select! {
            () = tokio::time::sleep(HEARTBEAT_EVERY) => {}
            _ = health.wait_for(|s| s.state != state) => {}
            () = stop.cancelled() => break,
        }
    }
}

/// One heartbeat; `state` overrides the runtime's (the last one: `stopped`).
pub(crate) async fn beat_once(
    pool: &PgPool,
    who: &Identity,
    stats: &Stats,
    health: &Health,
    state: Option<&str>,
) {
    let snapshot = health.snapshot();
    let state = state.map_or_else(|| lower(snapshot.state), str::to_owned);
    #[cfg(feature = "outbox")]
    let relay = snapshot.relay.map(lower);
    #[cfg(not(feature = "outbox"))]
    let relay: Option<String> = None;
    let counters = serde_json::to_value(stats.snapshot()).unwrap_or_default();
    write(pool, who, &state, relay.as_deref(), counters).await;
}

/// Writes one heartbeat row.
pub(crate) async fn write(
    pool: &PgPool,
    who: &Identity,
    state: &str,
    relay: Option<&str>,
    counters: serde_json::Value,
) {
    let written = sqlx::query(
        "INSERT INTO idempo_heartbeats \
             (instance, consumer, queue, host, pid, state, relay, counters, transport) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
         ON CONFLICT (instance) DO UPDATE SET seen_at = now(), state = EXCLUDED.state, \
             relay = EXCLUDED.relay, counters = EXCLUDED.counters",
    )
    .bind(&who.instance)
    .bind(&who.consumer)
    .bind(&who.queue)
    .bind(crate::host::name())
    .bind(std::process::id() as i32)
    .bind(state)
    .bind(relay)
    .bind(counters)
    .bind(who.transport)
    .execute(pool)
    .await;
    if let Err(e) = written {
        tracing::debug!(error = %e, "heartbeat not written");
    }
}

/// A state's name as stored: its variant in lower case.
pub(crate) fn lower(state: impl std::fmt::Debug) -> String {
    format!("{state:?}").to_lowercase()
}

async fn forget_stale(pool: &PgPool) -> Result<u64> {
    let sql =
        format!("DELETE FROM idempo_heartbeats WHERE seen_at < now() - interval '{FORGET_AFTER}'");
    Ok(sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(pool)
        .await?
        .rows_affected())
}

/// The instances that wrote a heartbeat within `within`, by consumer and
/// start.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when the query fails (also
/// when the table does not exist: run [`migrate`](crate::migrate)).
#[cfg(feature = "ops")]
pub(crate) async fn instances(pool: &PgPool, within: Duration) -> Result<Vec<Instance>> {
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT instance, consumer, queue, host, pid, \
                extract(epoch FROM now() - started_at)::float8 AS up_secs, \
                extract(epoch FROM now() - seen_at)::float8 AS seen_secs_ago, state, relay, counters, \
                transport \
         FROM idempo_heartbeats WHERE seen_at > now() - make_interval(secs => $1) \
         ORDER BY consumer, started_at",
    )
    .bind(within.as_secs_f64())
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Instance {
            instance: r.instance,
            consumer: r.consumer,
            queue: r.queue,
            host: r.host,
            pid: r.pid,
            up_secs: r.up_secs.max(0.0),
            seen_secs_ago: r.seen_secs_ago.max(0.0),
            state: r.state,
            relay: r.relay,
            counters: serde_json::from_value(r.counters).unwrap_or_default(),
            transport: r.transport,
        })
        .collect())
}
