//! Coalesced acknowledgements for batch mode: one `multiple` ack per run of settled tags.

use std::collections::BTreeMap;

use lapin::Acker;
use lapin::options::BasicAckOptions;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// Tracks which delivery tags of one channel are settled, and acks them with
/// `basic.ack(multiple = true)` once every lower tag is settled too.
///
/// A multiple ack acknowledges *every* outstanding tag up to its own, so it
/// may only be sent when nothing below it is still in flight (a batch still
/// committing, a retry still publishing). Acks go out under the lock, in
/// increasing order: acking a tag twice would make the broker close the channel.
pub(crate) struct AckTracker {
    state: Mutex<State>,
    /// Cancelled when the tracker sees a tag it cannot place: the session
    /// must reconnect rather than risk a multiple ack over unsettled tags.
    broken: CancellationToken,
}

struct State {
    /// The lowest tag not yet settled (lapin numbers deliveries from 1).
    next: u64,
    /// Settled tags at or above `next`: `Some` waits for the multiple ack,
    /// `None` was settled on its own (acked, nacked or dead-lettered).
    settled: BTreeMap<u64, Option<Acker>>,
}

impl AckTracker {
    /// One tracker per channel: its tags start at 1. (Were lapin's automatic
    /// recovery ever turned on, a recovered channel would restart its tags
    /// under the same tracker; that is caught below.)
    pub(crate) fn new(broken: CancellationToken) -> Self {
        AckTracker {
            state: Mutex::new(State {
                next: 1,
                settled: BTreeMap::new(),
            }),
            broken,
        }
    }

    /// Records settled tags and sends the multiple ack they make possible.
    /// A delivery left unacked on purpose (abandoned at shutdown) is never
    /// recorded, so nothing above it is acked by a multiple ack.
    pub(crate) async fn settle(&self, tags: impl IntoIterator<Item = (u64, Option<Acker>)>) {
        let mut state = self.state.lock().await;
        for (tag, acker) in tags {
            if tag < state.next || state.settled.contains_key(&tag) {
                tracing::error!(
                    tag,
                    next = state.next,
                    "delivery tag reported twice or out of range; reconnecting"
                );
                self.broken.cancel();
                return;
            }
            state.settled.insert(tag, acker);
        }
        let mut ack_with = None;
        loop {
            let next = state.next;
            let Some(entry) = state.settled.remove(&next) else {
                break;
            };
            if entry.is_some() {
                ack_with = entry;
            }
            state.next += 1;
        }
        if let Some(acker) = ack_with {
            match acker.ack(BasicAckOptions { multiple: true }).await {
                Ok(true) => {}
                // Committed work: the redeliveries will be claimed as duplicates.
                Ok(false) => tracing::warn!(
                    "ack not sent (channel closed); the redeliveries will be deduplicated"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "ack failed; the redeliveries will be deduplicated")
                }
            }
        }
    }
}
