//! The link between a consumer and the relay it runs: the consumer wakes it
//! after a commit that staged, the relay says whether it is publishing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// The consumer's end of the relay it runs: wakes it after a commit that
/// staged (no `NOTIFY` needed), and tells whether it is publishing. Cheap to
/// clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct RelayLink {
    /// A stored permit: the relay sees a wake-up it was not waiting for yet.
    wake: Arc<Notify>,
    publishing: Arc<AtomicBool>,
}

impl RelayLink {
    /// A commit that staged messages: the relay publishes them now (and
    /// leaves its dormancy if it was dormant).
    pub(crate) fn wake(&self) {
        self.wake.notify_one();
    }

    /// Whether the relay is connected and publishing: staging may then skip
    /// `NOTIFY`, since the relay is woken directly.
    pub(crate) fn is_publishing(&self) -> bool {
        self.publishing.load(Ordering::Relaxed)
    }

    /// Waits for the next [`wake`](RelayLink::wake), or takes the one
    /// stored since the last wait.
    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }
}

/// Marks the link as publishing while it lives.
pub(crate) struct Publishing<'a>(&'a RelayLink);

impl<'a> Publishing<'a> {
    pub(crate) fn start(link: &'a RelayLink) -> Self {
        link.publishing.store(true, Ordering::Relaxed);
        Publishing(link)
    }
}

impl Drop for Publishing<'_> {
    fn drop(&mut self) {
        self.0.publishing.store(false, Ordering::Relaxed);
    }
}
