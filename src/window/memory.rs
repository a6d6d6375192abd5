//! A bounded in-process dedup window.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::store::{Insertion, Reservation, WindowStore, bounded, check_key, check_value};
use crate::Result;

/// Seen ids in a `HashMap`, at most `capacity` of them.
///
/// **Capacity policy**: when full, expired entries are evicted first; if the
/// map is still full, the insert fails with [`StoreError::WindowFull`](crate::StoreError::WindowFull) rather than
/// forgetting a live id (which would let its duplicate through). Nothing
/// survives a restart; nothing is shared between processes.
#[derive(Debug)]
pub struct MemoryWindow {
    entries: Mutex<HashMap<String, Entry>>,
    capacity: usize,
}

#[derive(Debug)]
struct Entry {
    expires_at: Instant,
    state: State,
}

#[derive(Debug)]
enum State {
    Pending(i64),
    Seen(String),
}

/// When an entry made now for `d` expires: `d` is cut to
/// ten years, so that adding it to the clock cannot
/// overflow (`Instant + Duration` panics when it does).
fn expiry(now: Instant, d: Duration) -> Instant {
    // Ten years cannot overflow a monotonic clock; the fallbacks only make
    // sure that nothing here can panic.
    now.checked_add(bounded(d))
        .or_else(|| now.checked_add(Duration::from_secs(24 * 60 * 60)))
        .unwrap_or(now)
}

impl MemoryWindow {
    /// A window of at most `capacity` live ids.
    pub fn new(capacity: usize) -> Self {
        MemoryWindow {
            entries: Mutex::new(HashMap::new()),
            capacity,
        }
    }

    /// How many live entries (seen or reserved, not expired) are held. It
    /// walks the map: O(n).
    pub fn len(&self) -> usize {
        let now = Instant::now();
        self.lock().values().filter(|e| e.expires_at > now).count()
    }

    /// `true` when no live entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // Each change is one insert or remove: a poisoned map is consistent.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Inserts `entry` unless a live one is present; returns the live one's
    /// state otherwise.
    fn put(&self, key: &str, entry: Entry) -> Result<Option<Reservation>> {
        check_key(key)?;
        let now = Instant::now();
        let mut entries = self.lock();
        if let Some(live) = entries.get(key).filter(|e| e.expires_at > now) {
            return Ok(Some(match &live.state {
                State::Pending(_) => Reservation::Pending,
                State::Seen(value) => Reservation::Seen(value.clone()),
            }));
        }
        if !entries.contains_key(key) && entries.len() >= self.capacity {
            entries.retain(|_, e| e.expires_at > now);
            if entries.len() >= self.capacity {
                return Err(crate::StoreError::WindowFull {
                    capacity: self.capacity,
                }
                .into());
            }
        }
        entries.insert(key.to_owned(), entry);
        Ok(None)
    }

    fn pending(&self, key: &str, token: i64, f: impl FnOnce(&mut HashMap<String, Entry>)) -> bool {
        let mut entries = self.lock();
        let mine = matches!(entries.get(key), Some(Entry { state: State::Pending(t), expires_at })
            if *t == token && *expires_at > Instant::now());
        if mine {
            f(&mut entries);
        }
        mine
    }
}

impl WindowStore for MemoryWindow {
    async fn insert(&self, key: &str, value: &str, window: Duration) -> Result<Insertion> {
        check_value(value)?;
        let entry = Entry {
            expires_at: expiry(Instant::now(), window),
            state: State::Seen(value.to_owned()),
        };
        Ok(match self.put(key, entry)? {
            None => Insertion::New,
            Some(Reservation::Seen(value)) => Insertion::Seen(value),
            Some(_) => Insertion::Pending,
        })
    }

    async fn reserve(&self, key: &str, lease: Duration) -> Result<Reservation> {
        let token = crate::random::token()?;
        let entry = Entry {
            expires_at: expiry(Instant::now(), lease),
            state: State::Pending(token),
        };
        Ok(self
            .put(key, entry)?
            .unwrap_or(Reservation::Reserved { token }))
    }

    async fn record(&self, key: &str, token: i64, value: &str, window: Duration) -> Result<bool> {
        check_key(key)?;
        check_value(value)?;
        Ok(self.pending(key, token, |entries| {
            entries.insert(
                key.to_owned(),
                Entry {
                    expires_at: expiry(Instant::now(), window),
                    state: State::Seen(value.to_owned()),
                },
            );
        }))
    }

    async fn release(&self, key: &str, token: i64) -> Result<bool> {
        check_key(key)?;
        Ok(self.pending(key, token, |entries| {
            entries.remove(key);
        }))
    }

    async fn delete_expired(&self, limit: usize) -> Result<u64> {
        let now = Instant::now();
        let mut entries = self.lock();
        let expired: Vec<String> = entries
            .iter()
            .filter(|(_, e)| e.expires_at <= now)
            .map(|(k, _)| k.clone())
            .take(limit)
            .collect();
        for key in &expired {
            entries.remove(key);
        }
        Ok(expired.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_window_of_u64_max_seconds_is_cut_instead_of_panicking() {
        let window = MemoryWindow::new(4);
        let forever = Duration::from_secs(u64::MAX);
        assert!(window.insert("k", "v", forever).await.unwrap().is_new());
        assert_eq!(
            window.insert("k", "w", forever).await.unwrap(),
            Insertion::Seen("v".into())
        );
        let Reservation::Reserved { token } = window.reserve("r", forever).await.unwrap() else {
            panic!("free")
        };
        assert!(window.record("r", token, "x", forever).await.unwrap());
    }
}
