//! CPU time of the three processes a message costs on this machine: the
//! consumer (this process), the PostgreSQL backends serving its pool (and
//! every PostgreSQL process, WAL writer and checkpointer included), and the
//! RabbitMQ node it talks to. Read from `/proc/<pid>/stat` (user + system
//! time, in clock ticks) before and after a phase; Linux only.
//!
//! The consumer's figure includes the counting proxy (`pg_trips.rs`) when it
//! runs in this process: measure with `BENCH_COUNT_TRIPS=0` for the
//! consumer's own CPU.

use sqlx::PgPool;

/// CPU ticks spent so far by each side (`None`: could not be read).
#[derive(Debug, Default, Clone, Copy)]
pub struct Ticks {
    pub consumer: Option<u64>,
    pub backends: Option<u64>,
    pub postgres: Option<u64>,
    pub broker: Option<u64>,
}

/// Per message, in microseconds of CPU.
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct PerMessage {
    pub consumer_us: Option<f64>,
    pub backends_us: Option<f64>,
    pub postgres_us: Option<f64>,
    pub broker_us: Option<f64>,
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// User + system ticks of `pid`, from `/proc/<pid>/stat`.
fn process_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: the fields after it start after ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after ')'.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// The pids whose command name is `comm`.
fn pids_named(comm: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == comm)
        })
        .collect()
}

/// The pid listening on TCP `port` (from `ss`), if any.
pub fn listener_pid(port: u16) -> Option<String> {
    let out = std::process::Command::new("ss")
        .args(["-Hltnp", &format!("sport = :{port}")])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let at = text.find("pid=")? + 4;
    Some(
        text[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect(),
    )
}

/// Reads every side now. `application_name` names the pool whose backends
/// count; `broker` is the broker's pid.
pub async fn sample(admin: &PgPool, application_name: &str, broker: Option<&str>) -> Ticks {
    let backends: Option<Vec<i32>> =
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
            .bind(application_name)
            .fetch_all(admin)
            .await
            .ok();
    Ticks {
        consumer: process_ticks("self"),
        backends: backends.map(|pids| {
            pids.iter()
                .filter_map(|p| process_ticks(&p.to_string()))
                .sum()
        }),
        postgres: Some(
            pids_named("postgres")
                .iter()
                .filter_map(|p| process_ticks(p))
                .sum(),
        ),
        broker: broker.and_then(process_ticks),
    }
}

/// The CPU microseconds per message between `before` and `after`.
pub fn per_message(before: Ticks, after: Ticks, messages: u64) -> PerMessage {
    let us = |b: Option<u64>, a: Option<u64>| {
        Some(a?.saturating_sub(b?) as f64 * 1e6 / TICKS_PER_SECOND / messages.max(1) as f64)
    };
    PerMessage {
        consumer_us: us(before.consumer, after.consumer),
        backends_us: us(before.backends, after.backends),
        postgres_us: us(before.postgres, after.postgres),
        broker_us: us(before.broker, after.broker),
    }
}
