//! The Redis dedup window (feature `redis`).

use std::fmt;
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionManager;

use super::store::{Insertion, Reservation, WindowStore, bounded, check_key, check_value};
use crate::redis_connection::px;
use crate::{Error, Result};

/// Seen ids as Redis keys that expire with the window: an insert is
/// `SET key value NX PX window` (one round trip; with `GET`, so a duplicate
/// also returns the first value). A reservation is the same key holding a
/// pending marker with the lease as its expiry; recording and releasing it
/// are Lua scripts that check the marker first.
///
/// Needs Redis 7.0 or later (`SET` with both `NX` and `GET`).
///
/// ```no_run
/// # async fn doc() -> idempo::Result<()> {
/// use idempo::window::{DedupWindow, RedisWindow};
///
/// // From a URL: no need to depend on the redis crate yourself.
/// let window = DedupWindow::new(RedisWindow::connect("redis://127.0.0.1:6379").await?);
/// # Ok(()) }
/// ```
///
/// Fast and shared; what survives a restart depends on the server's
/// persistence (with none, every id is forgotten and duplicates that arrive
/// after the restart pass).
#[derive(Clone)]
pub struct RedisWindow {
    conn: ConnectionManager,
    prefix: String,
    record: Script,
    release: Script,
}

impl fmt::Debug for RedisWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisWindow")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

// Values: "s<value>" for a seen id, "p<token>" for a reservation.
const RECORD: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
";

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

impl RedisWindow {
    /// A window on an existing connection manager (of the redis crate, version
    /// 1.8), keys under `idempo:window:`. Without a manager of your own, use
    /// [`connect`](Self::connect) with a URL.
    pub fn new(conn: ConnectionManager) -> Self {
        RedisWindow {
            conn,
            prefix: "idempo:window:".into(),
            record: Script::new(RECORD),
            release: Script::new(RELEASE),
        }
    }

    /// Connects to `url` (`redis://host:port/db`, or `rediss://` for TLS),
    /// with 2-second connection and response timeouts, so that a Redis outage
    /// fails calls quickly instead of hanging them. Keys under `idempo:window:`.
    ///
    /// # Errors
    /// [`StoreError::Redis`](crate::StoreError::Redis) when the URL does not parse or Redis cannot be
    /// reached; [`Error::Config`] for a `rediss://` URL without feature `tls`.
    pub async fn connect(url: &str) -> Result<Self> {
        Ok(Self::new(
            crate::redis_connection::connect(url, None).await?,
        ))
    }

    /// Connects to a `rediss://` URL with these TLS settings (a CA to trust
    /// instead of the system's roots, a client certificate for mutual
    /// TLS). A plain `rediss://` URL with the system's roots works with
    /// [`connect`](Self::connect).
    ///
    /// # Errors
    /// [`Error::Tls`](crate::Error::Tls) when the handshake is refused (a wrong
    /// CA, a host name the certificate does not name, a port without TLS);
    /// [`Error::Certificate`](crate::Error::Certificate) naming a file that is
    /// missing or unusable;
    /// [`StoreError::Redis`](crate::StoreError::Redis) when Redis cannot be reached.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub async fn connect_with_tls(url: &str, tls: &crate::ClientTls) -> Result<Self> {
        Ok(Self::new(
            crate::redis_connection::connect(url, Some(tls)).await?,
        ))
    }

    /// Puts the keys under `prefix` instead of `idempo:window:`.
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// `SET key value NX GET PX ttl`: `None` when it was set, else the value
    /// that was there.
    async fn set_nx(&self, key: &str, value: &str, ttl: Duration) -> Result<Option<String>> {
        check_key(key)?;
        Ok(redis::cmd("SET")
            .arg(self.key(key))
            .arg(value)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(px(bounded(ttl)))
            .query_async(&mut self.conn.clone())
            .await?)
    }
}

fn found(value: String) -> Result<Reservation> {
    match value.split_at_checked(1) {
        Some(("s", seen)) => Ok(Reservation::Seen(seen.to_owned())),
        Some(("p", _)) => Ok(Reservation::Pending),
        _ => Err(Error::CorruptRecord(format!(
            "unexpected dedup window value {value:?}"
        ))),
    }
}

impl WindowStore for RedisWindow {
    async fn insert(&self, key: &str, value: &str, window: Duration) -> Result<Insertion> {
        check_value(value)?;
        match self.set_nx(key, &format!("s{value}"), window).await? {
            None => Ok(Insertion::New),
            Some(there) => Ok(match found(there)? {
                Reservation::Seen(value) => Insertion::Seen(value),
                _ => Insertion::Pending,
            }),
        }
    }

    async fn reserve(&self, key: &str, lease: Duration) -> Result<Reservation> {
        let token = crate::random::token()?;
        match self.set_nx(key, &format!("p{token}"), lease).await? {
            None => Ok(Reservation::Reserved { token }),
            Some(value) => found(value),
        }
    }

    async fn record(&self, key: &str, token: i64, value: &str, window: Duration) -> Result<bool> {
        check_key(key)?;
        check_value(value)?;
        let done: i64 = self
            .record
            .key(self.key(key))
            .arg(format!("p{token}"))
            .arg(format!("s{value}"))
            .arg(px(bounded(window)))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(done == 1)
    }

    async fn release(&self, key: &str, token: i64) -> Result<bool> {
        check_key(key)?;
        let done: i64 = self
            .release
            .key(self.key(key))
            .arg(format!("p{token}"))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(done == 1)
    }

    async fn delete_expired(&self, _limit: usize) -> Result<u64> {
        Ok(0) // PX expiry deletes entries by itself
    }
}
