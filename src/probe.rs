//! Why PostgreSQL does not answer. sqlx's pool retries a refused connection
//! silently until its acquire timeout and then says only "pool timed out
//! while waiting for an open connection": one direct connection attempt,
//! outside the pool, finds the reason. The dedup window, the `idempo`
//! command and the examples ask this one function.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

/// How long [`why_unreachable`] waits for PostgreSQL to answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// What one direct connection attempt found.
#[derive(Debug)]
pub(crate) enum Probe {
    /// It failed: the reason (for example "connection refused").
    Failed(sqlx::Error),
    /// No answer within the timeout: a blackholed address, a hung server.
    Silent,
    /// It connected: the server answers (a pool that timed out was
    /// exhausted, or its statement waited on a lock).
    Answers,
}

/// One connection attempt with `options`, of at most `timeout`, closed
/// again when it succeeds.
pub(crate) async fn probe(options: &PgConnectOptions, timeout: Duration) -> Probe {
    // tokio's `time` comes with sqlx's runtime-tokio, which idempo always enables.
    match tokio::time::timeout(timeout, options.connect()).await {
        Ok(Err(e)) => Probe::Failed(e),
        Ok(Ok(connection)) => {
            let _ = tokio::time::timeout(timeout, connection.close()).await;
            Probe::Answers
        }
        Err(_) => Probe::Silent,
    }
}

/// Where `options` point, as an operator names it: `host:port`.
pub(crate) fn address(options: &PgConnectOptions) -> String {
    format!("{}:{}", options.get_host(), options.get_port())
}

/// Why PostgreSQL at `database_url` cannot be reached, in one line for an
/// operator: its address (never the password), the reason, and how to start
/// it. `None` when it answers (a pool that timed out was exhausted, or was
/// waiting for it to start) or when the URL does not parse (the connection's
/// own error says so better). Waits at most 3 s.
///
/// Ask it when a pool reports [`sqlx::Error::PoolTimedOut`]:
///
/// ```no_run
/// # async fn doc(url: &str) -> Result<(), Box<dyn std::error::Error>> {
/// let pool = match sqlx::PgPool::connect(url).await {
///     Ok(pool) => pool,
///     Err(sqlx::Error::PoolTimedOut) => match idempo::probe::why_unreachable(url).await {
///         // "cannot reach PostgreSQL at 127.0.0.1:5432 (... Connection refused ...): start it ..."
///         Some(why) => return Err(why.into()),
///         None => return Err(sqlx::Error::PoolTimedOut.into()),
///     },
///     Err(e) => return Err(e.into()),
/// };
/// # drop(pool); Ok(()) }
/// ```
pub async fn why_unreachable(database_url: &str) -> Option<String> {
    let options = PgConnectOptions::from_str(database_url).ok()?;
    let why = match probe(&options, PROBE_TIMEOUT).await {
        Probe::Failed(e) => e.to_string(),
        Probe::Silent => format!("no answer within {} s", PROBE_TIMEOUT.as_secs()),
        Probe::Answers => return None,
    };
    Some(format!(
        "cannot reach PostgreSQL at {} ({why}): {HOW_TO_START}",
        address(&options)
    ))
}

/// How to start PostgreSQL, said after the reason it cannot be reached.
const HOW_TO_START: &str = "start it with `docker compose up -d` (idempo's docker-compose.yml), \
     or on Debian `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`; \
     or point DATABASE_URL at yours";

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_closed_port_is_named_with_the_reason_and_how_to_start_it() {
        let why = why_unreachable("postgres://postgres:hunter2@127.0.0.1:1/db")
            .await
            .expect("nothing listens on port 1");
        assert!(
            why.starts_with("cannot reach PostgreSQL at 127.0.0.1:1 ("),
            "{why}"
        );
        assert!(why.contains("refused"), "{why}");
        assert!(why.contains("docker compose up -d"), "{why}");
        assert!(!why.contains("hunter2"), "{why}");
    }

    #[tokio::test]
    async fn a_url_that_does_not_parse_is_left_to_the_connection_error() {
        assert!(
            why_unreachable("postgres://postgres@127.0.0.1:port/db")
                .await
                .is_none()
        );
    }
}
