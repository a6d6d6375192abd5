//! One unit of deliveries on its way, whatever the transport: counted, in
//! the transport's span tied to its producers, decided and settled through
//! [`Settle`] while the transport's [`while_running`](Transport::while_running)
//! keeps its deliveries alive.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::health::Health;
use super::message::Message;
use super::outcome::{Abandon, Settled};
use super::route::Router;
use super::settle::{LogLimit, Settle};
use super::stats::{Counter, Stats};
use super::trace;
use super::transport::Transport;

/// What runs a consumer's units: its transport, its router, and what
/// settling reports to.
pub(crate) struct Units<T: Transport> {
    pub(crate) transport: Arc<T>,
    pub(crate) router: Arc<Router>,
    /// A wait for the database or the dead-letter table gives up when this
    /// fires (the consumer's graceful shutdown).
    pub(crate) shutdown: CancellationToken,
    pub(crate) health: Health,
    pub(crate) stats: Stats,
    pub(crate) log_limit: LogLimit,
}

impl<T: Transport> Units<T> {
    /// Decides and settles one unit; how each delivery was settled, in order.
    pub(crate) async fn run(self: Arc<Self>, unit: Vec<(Message, T::Receipt)>) -> Vec<Settled> {
        let decided = self.decide(unit).await;
        decided.into_iter().map(|(settled, _)| settled).collect()
    }

    /// [`run`](Self::run), with the id each delivery was deduplicated on.
    pub(crate) async fn decide(
        self: Arc<Self>,
        unit: Vec<(Message, T::Receipt)>,
    ) -> Vec<(Settled, String)> {
        let mut messages = Vec::with_capacity(unit.len());
        let mut receipts = Vec::with_capacity(unit.len());
        for (message, receipt) in unit {
            self.stats.incr(Counter::Deliveries);
            messages.push(message);
            receipts.push(receipt);
        }
        let span = self.transport.span(&self.router.consumer, &messages);
        trace::link_producers(&span, &messages);
        // The unit's deliveries share a session: the first one's tells when
        // they are beyond settling.
        let abandon = Abandon {
            shutdown: self.shutdown.clone(),
            gone: receipts.first().and_then(|r| self.transport.gone(r)),
        };
        let alive = self.transport.while_running(&receipts);
        let settle = Settle {
            router: &self.router,
            health: &self.health,
            stats: &self.stats,
            log_limit: &self.log_limit,
        };
        let work = settle
            .decide(&*self.transport, messages, receipts, &abandon)
            .instrument(span);
        tokio::pin!(work);
        tokio::select! {
            settled = &mut work => settled,
            () = alive => work.await,
        }
    }
}
