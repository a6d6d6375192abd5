//! What the Redis stores share: how they connect and how they express TTLs.

use std::time::Duration;

use redis::aio::ConnectionManager;

use crate::Result;

/// A connection manager for `url` with 2-second connection and response
/// timeouts, so that a Redis outage fails calls quickly instead of hanging them.
pub(crate) async fn connect(url: &str) -> Result<ConnectionManager> {
    let client = redis::Client::open(url)?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_secs(2)))
        .set_number_of_retries(1);
    Ok(ConnectionManager::new_with_config(client, config).await?)
}

/// A `PX` argument: whole milliseconds, at least 1 (Redis refuses 0).
pub(crate) fn px(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}
