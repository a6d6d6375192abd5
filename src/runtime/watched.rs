//! [`Watched`]: a state that the runtime updates and hosts read or wait on,
//! the one shape of the consumer's [`Health`](crate::runtime::health::Health) and the
//! relay's [`RelayHealth`](crate::relay::RelayHealth).

use std::fmt;
use std::sync::Arc;

use tokio::sync::watch;

/// Live state of a running part (consumer, relay), for readiness probes
/// and dashboards. Cheap to clone; all clones see the same state.
pub struct Watched<T> {
    inner: Arc<watch::Sender<T>>,
}

impl<T> Clone for Watched<T> {
    fn clone(&self) -> Self {
        Watched {
            inner: self.inner.clone(),
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for Watched<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Watched")
            .field(&*self.inner.borrow())
            .finish()
    }
}

impl<T: Clone> Watched<T> {
    pub(crate) fn new(initial: T) -> Self {
        Watched {
            inner: Arc::new(watch::Sender::new(initial)),
        }
    }

    /// The current state.
    pub fn snapshot(&self) -> T {
        self.inner.borrow().clone()
    }

    /// Waits until `condition` holds for the state, and returns that state.
    pub async fn wait_for(&self, mut condition: impl FnMut(&T) -> bool) -> T {
        let mut rx = self.inner.subscribe();
        let state = rx
            .wait_for(|s| condition(s))
            .await
            .expect("the sender lives as long as self");
        state.clone()
    }

    /// A receiver of every change, for a host that reacts to them (a
    /// readiness endpoint, a log of state changes).
    pub fn subscribe(&self) -> watch::Receiver<T> {
        self.inner.subscribe()
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut T)) {
        self.inner.send_modify(f);
    }
}
