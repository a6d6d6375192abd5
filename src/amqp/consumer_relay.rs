//! The relay a consumer runs for its pool (feature `outbox`): started
//! beside the consumer, its state mirrored in the consumer's health, and
//! stopped after the handlers drained so that what they staged goes out.

use std::time::Duration;

use sqlx::PgPool;

use crate::amqp::broker::Broker;
use crate::runtime::forwarding::Forwarding;
use crate::runtime::health::Health;

pub(crate) use imp::RunningRelay;

#[cfg(feature = "outbox")]
mod imp {
    use super::*;
    use crate::relay::Relay;
    use crate::runtime::shutdown::ShutdownHandle;

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

        /// Starts the consumer's relay, dormant until the handlers stage,
        /// with its state mirrored in the consumer's `health`.
        pub(crate) fn start(
            forwarding: &Forwarding,
            broker: &Broker,
            pool: &PgPool,
            consumer: &str,
            health: &Health,
        ) -> RunningRelay {
            let Some(link) = forwarding.relay_link() else {
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
}

#[cfg(not(feature = "outbox"))]
mod imp {
    use super::*;

    /// No relay runs without the outbox.
    pub(crate) struct RunningRelay;

    impl RunningRelay {
        pub(crate) fn start(
            _forwarding: &Forwarding,
            _broker: &Broker,
            _pool: &PgPool,
            _consumer: &str,
            _health: &Health,
        ) -> RunningRelay {
            RunningRelay
        }

        pub(crate) async fn stop(self, _timeout: Duration) {}
    }
}
