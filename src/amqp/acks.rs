//! The bookkeeping behind batch mode's coalesced acks: which delivery tags are settled, and how far one `multiple` ack may reach.

use std::collections::BTreeMap;

use lapin::Acker;
use tokio::sync::{Mutex, MutexGuard};

/// Tracks which delivery tags of one channel are settled, so that they can be
/// acked with `basic.ack(multiple = true)` once every lower tag is settled too.
///
/// A multiple ack acknowledges *every* outstanding tag up to its own, so it
/// may only be sent when nothing below it is still in flight (a batch still
/// committing, a retry still publishing). The settling code sends it while
/// holding the lock, so multiple acks leave in increasing order: acking a tag
/// twice would make the broker close the channel.
pub(crate) struct AckTracker {
    state: Mutex<State<Acker>>,
}

/// The bookkeeping, apart from lapin so that it can be tested on its own.
pub(crate) struct State<A> {
    /// The lowest tag not yet settled (lapin numbers deliveries from 1).
    next: u64,
    /// Settled tags at or above `next`: `Some` waits for the multiple ack,
    /// `None` was settled on its own (acked, nacked or dead-lettered).
    settled: BTreeMap<u64, Option<A>>,
}

/// A tag reported twice, or below the watermark: the session must reconnect
/// rather than risk a multiple ack over unsettled tags.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Misplaced(pub(crate) u64);

impl<A> State<A> {
    /// The lowest tag not yet settled.
    pub(crate) fn watermark(&self) -> u64 {
        self.next
    }

    fn new() -> Self {
        State {
            next: 1,
            settled: BTreeMap::new(),
        }
    }

    /// Records settled tags; returns what to send the multiple ack with, if
    /// the watermark passed a tag that waits for one. A delivery left unacked
    /// on purpose (abandoned at shutdown) is never recorded, so nothing above
    /// it is ever covered by a multiple ack.
    pub(crate) fn record(
        &mut self,
        tags: impl IntoIterator<Item = (u64, Option<A>)>,
    ) -> Result<Option<A>, Misplaced> {
        for (tag, acker) in tags {
            if tag < self.next || self.settled.contains_key(&tag) {
                return Err(Misplaced(tag));
            }
            self.settled.insert(tag, acker);
        }
        let mut ack_with = None;
        while let Some(entry) = self.settled.remove(&self.next) {
            if entry.is_some() {
                ack_with = entry;
            }
            self.next += 1;
        }
        Ok(ack_with)
    }
}

impl AckTracker {
    /// One tracker per channel: its tags start at 1. (Were lapin's automatic
    /// recovery ever turned on, a recovered channel would restart its tags
    /// under the same tracker; `record` refuses them.)
    pub(crate) fn new() -> Self {
        AckTracker {
            state: Mutex::new(State::new()),
        }
    }

    /// The bookkeeping, locked: record tags and send the ack it allows
    /// before letting go.
    pub(crate) async fn lock(&self) -> MutexGuard<'_, State<Acker>> {
        self.state.lock().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(tags: std::ops::RangeInclusive<u64>) -> Vec<(u64, Option<u64>)> {
        tags.map(|t| (t, Some(t))).collect()
    }

    #[test]
    fn a_batch_is_acked_up_to_its_last_tag_once_lower_tags_are_settled() {
        let mut s = State::new();
        assert_eq!(s.record(pending(1..=3)), Ok(Some(3)));
        assert_eq!(s.next, 4);
    }

    #[test]
    fn a_later_batch_waits_for_an_earlier_one_still_in_flight() {
        let mut s = State::new();
        // Tags 4..=6 finish first: nothing may be acked while 1..=3 run.
        assert_eq!(s.record(pending(4..=6)), Ok(None));
        assert_eq!(s.record(pending(1..=3)), Ok(Some(6)));
    }

    #[test]
    fn a_tag_settled_on_its_own_is_passed_but_never_acked_again() {
        let mut s = State::new();
        // Tag 2 was dead-lettered and acked on its own; 3 is the batch's last.
        assert_eq!(
            s.record([(1, Some(1)), (2, None), (3, Some(3))]),
            Ok(Some(3))
        );
        // A run of tags settled on their own needs no multiple ack.
        assert_eq!(s.record([(4, None), (5, None)]), Ok(None));
        assert_eq!(s.next, 6);
    }

    #[test]
    fn an_unsettled_tag_holds_back_everything_above_it() {
        let mut s = State::new();
        // Tag 2 is abandoned (never recorded): 3 and 4 must not be acked.
        assert_eq!(s.record([(1, Some(1))]), Ok(Some(1)));
        assert_eq!(s.record(pending(3..=4)), Ok(None));
        assert_eq!(s.next, 2);
    }

    #[test]
    fn a_tag_reported_twice_or_below_the_watermark_is_refused() {
        let mut s = State::new();
        assert_eq!(s.record(pending(1..=2)), Ok(Some(2)));
        assert_eq!(s.record(pending(2..=2)), Err(Misplaced(2)));
        assert_eq!(s.record(pending(5..=5)), Ok(None));
        assert_eq!(s.record(pending(5..=5)), Err(Misplaced(5)));
    }
}
