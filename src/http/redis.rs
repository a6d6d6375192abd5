//! The Redis idempotency store (feature `redis`).

use std::fmt;
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionManager;

use super::record::{Fingerprint, RecordKey, StoredResponse};
use super::store::{Begin, FencingToken, IdempotencyStore, Operation};
use crate::redis_connection::px;
use crate::{Error, Result};

/// Records in Redis: per record a *lease* key (`SET NX PX`, holding the
/// fencing token and fingerprint) and a *data* key with the completed
/// response, which expires with the TTL. Each operation is one Lua script,
/// so it is atomic.
///
/// Shared by every instance of the app and fast; durable only as far as the
/// Redis server is configured to be (with no persistence, a restart forgets
/// every key and the next retry executes again). The two keys of a record
/// share a hash tag, so the store works on a Redis Cluster too.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    prefix: String,
    scripts: Scripts,
}

#[derive(Clone)]
struct Scripts {
    begin: Script,
    extend: Script,
    complete: Script,
    release: Script,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

// KEYS[1] lease, KEYS[2] data; ARGV[1] "token:fingerprint", ARGV[2] lease ms.
// Returns {1, data, 0} when complete, {0, '', 0} when started, {2, lease
// value, lease ms left} when another request holds the lease.
const BEGIN: &str = r"
local data = redis.call('GET', KEYS[2])
if data then return {1, data, 0} end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {0, '', 0} end
return {2, redis.call('GET', KEYS[1]) or '', redis.call('PTTL', KEYS[1])}
";

// The other scripts act only while the lease key still carries the caller's
// token: ARGV[1] is "<token>:", the prefix of its lease value.

// KEYS[1] lease; ARGV[2] lease ms.
const EXTEND: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

// KEYS[1] lease, KEYS[2] data; ARGV[2] the encoded response, ARGV[3] ttl ms.
// The data (the fingerprint's hex from the lease value, then the response) is
// written and the lease dropped in one step.
const COMPLETE: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], string.sub(v, #ARGV[1] + 1) .. ARGV[2], 'PX', ARGV[3])
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
";

// KEYS[1] lease.
const RELEASE: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

impl RedisStore {
    /// A store on an existing connection manager, with keys under
    /// `idempo:http:`.
    pub fn new(conn: ConnectionManager) -> Self {
        RedisStore {
            conn,
            prefix: "idempo:http:".into(),
            scripts: Scripts {
                begin: Script::new(BEGIN),
                extend: Script::new(EXTEND),
                complete: Script::new(COMPLETE),
                release: Script::new(RELEASE),
            },
        }
    }

    /// Connects to `url` (`redis://127.0.0.1:6379`) with a 2-second
    /// connection and response timeout, so that a Redis outage fails requests
    /// quickly (503) instead of hanging them.
    ///
    /// # Errors
    /// [`StoreError::Redis`](crate::StoreError::Redis) when the URL is invalid or Redis cannot be reached.
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

    /// Puts the keys under `prefix` instead of `idempo:http:`.
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    fn keys(&self, key: &RecordKey) -> (String, String) {
        // The braces are a hash tag: both keys land on one cluster slot.
        let tag = key.hex();
        (
            format!("{}{{{tag}}}:lease", self.prefix),
            format!("{}{{{tag}}}:data", self.prefix),
        )
    }
}

/// The lease key's value: whose lease it is (`<token>:`) and for which
/// request (the fingerprint in hex, 64 characters).
fn lease_value(token: FencingToken, fingerprint: &Fingerprint) -> String {
    format!("{}{}", owner(token), hex::encode(fingerprint.as_bytes()))
}

/// The prefix of the lease value that proves ownership.
fn owner(token: FencingToken) -> String {
    format!("{}:", token.get())
}

const FINGERPRINT_HEX: usize = 64;

impl IdempotencyStore for RedisStore {
    async fn begin(&self, operation: Operation<'_>) -> Result<Begin> {
        let (lease, data) = self.keys(operation.key);
        // Random tokens: unique with overwhelming probability, and unlike a
        // counter they need no key of their own that could expire and restart.
        let token = FencingToken::new(crate::random::token()?);
        let reply: (i64, Vec<u8>, i64) = self
            .scripts
            .begin
            .key(&lease)
            .key(&data)
            .arg(lease_value(token, operation.fingerprint))
            .arg(px(operation.lease))
            .invoke_async(&mut self.conn.clone())
            .await?;
        match reply {
            (0, _, _) => Ok(Begin::Started(token)),
            (1, stored, _) => {
                let expected = hex::encode(operation.fingerprint.as_bytes());
                let Some((fingerprint, response)) = stored.split_at_checked(FINGERPRINT_HEX) else {
                    return Err(Error::CorruptRecord("stored record is truncated".into()));
                };
                if fingerprint != expected.as_bytes() {
                    return Ok(Begin::Mismatch);
                }
                Ok(Begin::Completed(StoredResponse::decode(response)?))
            }
            (2, holder, left_ms) => {
                let expected = hex::encode(operation.fingerprint.as_bytes());
                if holder.ends_with(expected.as_bytes()) {
                    let lease_left = u64::try_from(left_ms).ok().map(Duration::from_millis);
                    Ok(Begin::InProgress { lease_left })
                } else {
                    Ok(Begin::Mismatch)
                }
            }
            (other, _, _) => Err(Error::CorruptRecord(format!(
                "unexpected begin script reply {other}"
            ))),
        }
    }

    async fn extend(&self, key: &RecordKey, token: FencingToken, lease: Duration) -> Result<bool> {
        let (lease_key, _) = self.keys(key);
        let extended: i64 = self
            .scripts
            .extend
            .key(&lease_key)
            .arg(owner(token))
            .arg(px(lease))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(extended == 1)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool> {
        let (lease_key, data_key) = self.keys(key);
        let completed: i64 = self
            .scripts
            .complete
            .key(&lease_key)
            .key(&data_key)
            .arg(owner(token))
            .arg(response.encode())
            .arg(px(ttl))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(completed == 1)
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<bool> {
        let (lease_key, _) = self.keys(key);
        let released: i64 = self
            .scripts
            .release
            .key(&lease_key)
            .arg(owner(token))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(released == 1)
    }

    async fn delete_expired(&self, _limit: usize) -> Result<u64> {
        Ok(0) // PX expiry deletes records by itself
    }
}
