//! Where the consumer runtime and the [outbox](crate::outbox) meet: each
//! unit's [`Tx`] carries the unit's [`UnitOutbox`](crate::outbox::UnitOutbox)
//! (staging through the handler's guard finds it there), the unit commits
//! through it (its claim check writes the deferred messages), and the
//! consumer's own [`Relay`](super::Relay) is woken after a commit that
//! staged. Without feature `outbox` the same calls commit with
//! [`Inbox::commit`](crate::inbox::Inbox::commit) and run no relay.

use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};

use crate::Tx;
use crate::amqp::broker::Broker;
use crate::runtime::health::Health;

pub(crate) use imp::{Forwarding, Unit};

#[cfg(feature = "outbox")]
mod imp {
    use std::sync::Arc;

    use super::*;
    use crate::outbox::UnitOutbox;
    use crate::relay::{Relay, RelayLink};
    use crate::runtime::shutdown::ShutdownHandle;

    /// What a unit's handler staged.
    pub(crate) type Unit = Arc<UnitOutbox>;

    /// A consumer's side of the outbox: its relay link, if it runs a relay.
    #[derive(Debug)]
    pub(crate) struct Forwarding {
        relay: Option<RelayLink>,
    }

    impl Forwarding {
        pub(crate) fn new(relay: bool) -> Self {
            Forwarding {
                relay: relay.then(RelayLink::default),
            }
        }

        /// The handler's [`Tx`] for a unit's transaction, and the unit's
        /// record of what it stages.
        pub(crate) fn open(&self, tx: Transaction<'static, Postgres>) -> (Tx, Unit) {
            // With our relay publishing, it is woken after the commit, so
            // staging skips NOTIFY (a notifying commit holds a global lock).
            let quiet = self.relay.as_ref().is_some_and(RelayLink::is_publishing);
            let unit = Arc::new(UnitOutbox::new(quiet));
            (Tx::with_extension(tx, unit.clone()), unit)
        }

        /// Commits the unit (claim check, deferred messages), then wakes the
        /// relay if the unit staged.
        pub(crate) async fn commit(
            &self,
            unit: &Unit,
            tx: Transaction<'static, Postgres>,
            consumer: &str,
            message_id: &str,
            shape: crate::inbox::CommitShape,
        ) -> crate::Result<()> {
            crate::outbox::commit_unit(unit, tx, consumer, message_id, shape).await?;
            if unit.staged()
                && let Some(relay) = &self.relay
            {
                relay.wake();
            }
            Ok(())
        }

        /// Starts the consumer's relay, dormant until the handlers stage,
        /// with its state mirrored in the consumer's `health`.
        pub(crate) fn start_relay(
            &self,
            broker: &Broker,
            pool: &PgPool,
            consumer: &str,
            health: &Health,
        ) -> RunningRelay {
            let Some(link) = &self.relay else {
                return RunningRelay(None);
            };
            let relay = Relay::for_consumer(broker.clone(), pool.clone(), consumer, link.clone());
            let mut states = relay.health().subscribe();
            let mirror = health.clone();
            mirror.update(|s| s.relay = Some(states.borrow().state));
            let stop = relay.shutdown_handle();
            let task = tokio::spawn(async move {
                let run = relay.run();
                let forward = async {
                    while states.changed().await.is_ok() {
                        let state = states.borrow_and_update().state;
                        if mirror.snapshot().relay != Some(state) {
                            mirror.update(|s| s.relay = Some(state));
                        }
                    }
                };
                tokio::select! {
                    done = run => {
                        if let Err(e) = done {
                            tracing::error!(error = %e, "the consumer's outbox relay stopped");
                        }
                    }
                    () = forward => {}
                }
                mirror.update(|s| s.relay = Some(crate::relay::RelayState::Stopped));
            });
            RunningRelay(Some((stop, task)))
        }
    }

    /// The consumer's relay while it runs.
    pub(crate) struct RunningRelay(Option<(ShutdownHandle, tokio::task::JoinHandle<()>)>);

    impl RunningRelay {
        /// Stops the relay: what the drained handlers staged is published
        /// first, within `timeout`; past it, left pending for the next relay.
        pub(crate) async fn stop(self, timeout: Duration) {
            let Some((stop, mut task)) = self.0 else {
                return;
            };
            stop.shutdown();
            if tokio::time::timeout(timeout, &mut task).await.is_err() {
                stop.shutdown_now();
                let _ = task.await;
            }
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
        pub(crate) fn new(_relay: bool) -> Self {
            Forwarding
        }

        pub(crate) fn open(&self, tx: Transaction<'static, Postgres>) -> (Tx, Unit) {
            (Tx::new(tx), ())
        }

        pub(crate) async fn commit(
            &self,
            _unit: &Unit,
            tx: Transaction<'static, Postgres>,
            consumer: &str,
            message_id: &str,
            shape: crate::inbox::CommitShape,
        ) -> crate::Result<()> {
            crate::inbox::claim::commit_with(tx, consumer, message_id, "", shape).await
        }

        pub(crate) fn start_relay(
            &self,
            _broker: &Broker,
            _pool: &PgPool,
            _consumer: &str,
            _health: &Health,
        ) -> RunningRelay {
            RunningRelay
        }
    }

    /// No relay runs without the outbox.
    pub(crate) struct RunningRelay;

    impl RunningRelay {
        pub(crate) async fn stop(self, _timeout: Duration) {}
    }
}
