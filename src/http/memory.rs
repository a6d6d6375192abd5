//! An in-process idempotency store, for tests and single-process apps.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::record::{Fingerprint, RecordKey, StoredResponse};
use super::store::{Begin, FencingToken, IdempotencyStore, Operation};
use crate::Result;

/// Records in a `HashMap` behind a mutex.
///
/// Nothing survives a restart and nothing is shared between processes: run
/// more than one instance of the app and the same key can be executed once
/// per instance. Use [`PostgresStore`](super::PostgresStore) or `RedisStore`
/// for that. Expired records are dropped by [`run_cleanup`](super::IdempotencyStore::run_cleanup)
/// (or when their key is used again).
///
/// Cloning is cheap and shares the records: give a clone to each layer (and
/// to [`run_cleanup`](super::IdempotencyStore::run_cleanup)) that must see the same keys.
///
/// Bounded: at most 100,000 records (or
/// [`with_capacity`](Self::with_capacity)). When it is full of live records,
/// a new key is refused with [`StoreError::IdempotencyStoreFull`](crate::StoreError::IdempotencyStoreFull)
/// (the layer answers 503 with `Retry-After`) rather than evicting one: an
/// evicted record's retry would run again. Expired records make room first.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    records: Arc<Mutex<HashMap<[u8; 32], Record>>>,
    next_token: Arc<AtomicI64>,
    capacity: usize,
}

/// The default capacity of a [`MemoryStore`].
pub(crate) const DEFAULT_CAPACITY: usize = 100_000;

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::with_capacity(DEFAULT_CAPACITY)
    }
}

#[derive(Debug)]
struct Record {
    fingerprint: Fingerprint,
    expires_at: Instant,
    state: State,
}

#[derive(Debug)]
enum State {
    InProgress {
        token: FencingToken,
        locked_until: Instant,
    },
    Complete(StoredResponse),
}

impl MemoryStore {
    /// An empty store of 100,000 records.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store of at most `capacity` records (at least 1).
    pub fn with_capacity(capacity: usize) -> Self {
        MemoryStore {
            records: Arc::default(),
            next_token: Arc::default(),
            capacity: capacity.max(1),
        }
    }

    /// How many records (live or expired) are held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// `true` when no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Record>> {
        // A panic while the map is locked leaves no half-made record (each
        // change is one assignment), so a poisoned map is still consistent.
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn token(&self) -> FencingToken {
        FencingToken::new(self.next_token.fetch_add(1, Ordering::Relaxed) + 1)
    }
}

/// The caller's in-progress record, if it still is theirs.
fn owned<'a>(
    records: &'a mut HashMap<[u8; 32], Record>,
    key: &RecordKey,
    token: FencingToken,
) -> Option<&'a mut Record> {
    records
        .get_mut(key.digest())
        .filter(|record| matches!(record.state, State::InProgress { token: t, .. } if t == token))
}

impl IdempotencyStore for MemoryStore {
    async fn begin(&self, operation: Operation<'_>) -> Result<Begin> {
        let now = Instant::now();
        let mut records = self.lock();
        if let Some(record) = records.get_mut(operation.key.digest())
            && record.expires_at > now
        {
            if record.fingerprint != *operation.fingerprint {
                return Ok(Begin::Mismatch);
            }
            match &record.state {
                State::Complete(response) => return Ok(Begin::Completed(response.clone())),
                State::InProgress { locked_until, .. } if *locked_until > now => {
                    return Ok(Begin::InProgress {
                        lease_left: Some(*locked_until - now),
                    });
                }
                State::InProgress { .. } => {} // the lease ran out: take it over
            }
        }
        if records.len() >= self.capacity && !records.contains_key(operation.key.digest()) {
            records.retain(|_, record| record.expires_at > now);
            if records.len() >= self.capacity {
                return Err(crate::StoreError::IdempotencyStoreFull {
                    capacity: self.capacity,
                }
                .into());
            }
        }
        let token = self.token();
        records.insert(
            *operation.key.digest(),
            Record {
                fingerprint: *operation.fingerprint,
                expires_at: now + operation.ttl.max(operation.lease),
                state: State::InProgress {
                    token,
                    locked_until: now + operation.lease,
                },
            },
        );
        Ok(Begin::Started(token))
    }

    async fn extend(&self, key: &RecordKey, token: FencingToken, lease: Duration) -> Result<bool> {
        let locked_until = Instant::now() + lease;
        let mut records = self.lock();
        let Some(record) = owned(&mut records, key, token) else {
            return Ok(false);
        };
        record.state = State::InProgress {
            token,
            locked_until,
        };
        record.expires_at = record.expires_at.max(locked_until);
        Ok(true)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool> {
        let mut records = self.lock();
        let Some(record) = owned(&mut records, key, token) else {
            return Ok(false);
        };
        record.state = State::Complete(response.clone());
        record.expires_at = Instant::now() + ttl;
        Ok(true)
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<bool> {
        let mut records = self.lock();
        if owned(&mut records, key, token).is_none() {
            return Ok(false);
        }
        records.remove(key.digest());
        Ok(true)
    }

    async fn delete_expired(&self, limit: usize) -> Result<u64> {
        let now = Instant::now();
        let mut records = self.lock();
        let expired: Vec<[u8; 32]> = records
            .iter()
            .filter(|(_, record)| record.expires_at <= now)
            .map(|(digest, _)| *digest)
            .take(limit)
            .collect();
        for digest in &expired {
            records.remove(digest);
        }
        Ok(expired.len() as u64)
    }
}
