//! Where the delivery runtime and the [outbox](crate::outbox) meet: each
//! unit's [`Tx`] carries the unit's [`UnitOutbox`](crate::outbox::UnitOutbox)
//! (staging through the handler's guard finds it there), the unit commits
//! through it (its commit writes the deferred messages), and the relay the
//! consumer runs (if any) is woken after a commit that staged. Without
//! feature `outbox` the same calls commit the unit alone and wake nothing.

use sqlx::{Postgres, Transaction};

use crate::Tx;
use crate::runtime::unit_tx;

pub(crate) use imp::{Forwarding, Unit};

#[cfg(feature = "outbox")]
mod imp {
    use std::sync::Arc;

    use super::*;
    use crate::outbox::{RelayLink, UnitOutbox};
    use crate::tx::Attachment;

    /// What a unit's handler staged.
    pub(crate) type Unit = Arc<UnitOutbox>;

    /// A consumer's side of the outbox: its relay link, if it runs a relay.
    #[derive(Debug)]
    pub(crate) struct Forwarding {
        relay: Option<RelayLink>,
        /// The consumer's transport: where its handlers' messages go.
        transport: &'static str,
    }

    impl Forwarding {
        pub(crate) fn new(relay: bool, transport: &'static str) -> Self {
            Forwarding {
                relay: relay.then(RelayLink::default),
                transport,
            }
        }

        /// The link to the relay the consumer runs, if it runs one.
        pub(crate) fn relay_link(&self) -> Option<&RelayLink> {
            self.relay.as_ref()
        }

        /// The handler's [`Tx`] for a unit's transaction, and the unit's
        /// record of what it stages.
        pub(crate) fn open(&self, tx: Transaction<'static, Postgres>) -> (Tx, Unit) {
            // With our relay publishing, it is woken after the commit, so
            // staging skips NOTIFY (a notifying commit holds a global lock).
            let quiet = self.relay.as_ref().is_some_and(RelayLink::is_publishing);
            let unit = Arc::new(UnitOutbox::new(quiet, self.transport));
            (Tx::new(tx, Some(unit.clone() as Attachment)), unit)
        }

        /// Commits the unit with its deferred messages, then wakes the relay
        /// if the unit staged. `message_id` names the unit in an error.
        pub(crate) async fn commit(
            &self,
            unit: &Unit,
            tx: Transaction<'static, Postgres>,
            message_id: &str,
        ) -> crate::Result<()> {
            let statements = crate::outbox::deferred_statements(unit)?;
            unit_tx::commit(tx, message_id, &statements).await?;
            if unit.staged()
                && let Some(relay) = &self.relay
            {
                relay.wake();
            }
            Ok(())
        }
    }
}

#[cfg(not(feature = "outbox"))]
mod imp {
    use super::*;

    /// Nothing to record without the outbox.
    pub(crate) type Unit = ();

    /// Without the outbox: plain commits, no relay.
    #[derive(Debug)]
    pub(crate) struct Forwarding;

    impl Forwarding {
        pub(crate) fn new(_relay: bool, _transport: &'static str) -> Self {
            Forwarding
        }

        pub(crate) fn open(&self, tx: Transaction<'static, Postgres>) -> (Tx, Unit) {
            (Tx::new(tx, None), ())
        }

        pub(crate) async fn commit(
            &self,
            _unit: &Unit,
            tx: Transaction<'static, Postgres>,
            message_id: &str,
        ) -> crate::Result<()> {
            unit_tx::commit(tx, message_id, "").await
        }
    }
}
