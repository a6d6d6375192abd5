//! Settling: the one place that turns each delivery's [`Route`] into calls
//! on its [`Transport`], with the dead-letter table, counting, health and
//! the fallbacks around them.
//!
//! ```text
//! Ack (processed, duplicate) ─► finish: ack (AMQP batch mode: one multiple ack)
//! DeadLetter ─► table store? insert (waits out an outage) ─► letter_stored
//!               refused by the table ─► the transport's store
//!            ─► transport dead_letter ─► TooLarge: reject (the broker's own dead-lettering)
//!                                      └► Failed: requeue after a pause (never acked)
//! Delay ─► transport retry_later ─► TooLarge: DeadLetter (headers too large to retry)
//!                                └► Failed: requeue after a pause
//! Requeue ─► transport requeue after the policy's pause
//! Abandon ─► nothing: the delivery returns when its channel closes
//! ```

use std::time::Duration;

use super::dead_letter::DeadLetterReason;
use super::header_names::REASON_HEADER;
use super::headers::Failures;
use super::health::Health;
use super::letters::Stored;
use super::message::HeaderValue;
use super::message::Message;
use super::outcome::{Abandon, Settled};
use super::route::{Route, Router};
use super::stats::{Counter, Stats};
use super::trace;
use super::transport::{Finished, Later, Letter, Refused, Transport};

/// How long the original waits before it is handed back when its copy
/// could not be sent.
const FALLBACK_PAUSE: Duration = Duration::from_secs(1);

/// What settling needs besides the transport: the router (failure headers,
/// the table store), health and stats.
pub(crate) struct Settle<'a> {
    pub(crate) router: &'a Router,
    pub(crate) health: &'a Health,
    pub(crate) stats: &'a Stats,
    pub(crate) log_limit: &'a LogLimit,
}

/// Logs a repeated failure at ERROR at most once every 10 s (a missing
/// queue fails every copy), at debug otherwise.
#[derive(Debug, Default)]
pub(crate) struct LogLimit {
    last: std::sync::Mutex<Option<std::time::Instant>>,
}

impl LogLimit {
    const EVERY: Duration = Duration::from_secs(10);

    fn allow(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        match *last {
            Some(at) if now.duration_since(at) < Self::EVERY => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

impl Settle<'_> {
    /// Decides a unit of `messages` (with their transport's `receipts`, in
    /// order) and settles it through `transport`: the path every transport's
    /// deliveries take once they are messages. Runs in the unit's process
    /// span, which it records the decision on. How each was settled, with
    /// the id it was deduplicated on.
    pub(crate) async fn decide<T: Transport>(
        &self,
        transport: &T,
        mut messages: Vec<Message>,
        receipts: Vec<T::Receipt>,
        abandon: &Abandon,
    ) -> Vec<(Settled, String)> {
        let outcomes = self.router.outcomes(&mut messages, abandon).await;
        let routes: Vec<_> = outcomes
            .into_iter()
            .zip(&messages)
            .map(|(outcome, message)| self.router.route(message, outcome))
            .collect();
        if let ([message], [route]) = (messages.as_slice(), routes.as_slice()) {
            trace::decided(&tracing::Span::current(), message, route);
        }
        let ids: Vec<String> = messages.iter().map(|m| m.id().to_owned()).collect();
        let items = messages.into_iter().zip(receipts).collect();
        let settled = self.unit(transport, items, routes, abandon).await;
        if let [one] = settled.as_slice() {
            trace::settled(&tracing::Span::current(), *one);
        }
        settled.into_iter().zip(ids).collect()
    }

    /// Settles a unit: one route per delivery, in order; `abandon` ends a
    /// wait for the dead-letter table.
    pub(crate) async fn unit<T: Transport>(
        &self,
        transport: &T,
        items: Vec<(Message, T::Receipt)>,
        routes: Vec<Route>,
        abandon: &Abandon,
    ) -> Vec<Settled> {
        let mut settled = Vec::with_capacity(items.len());
        let mut finished = Vec::with_capacity(items.len());
        for ((message, receipt), route) in items.into_iter().zip(routes) {
            let done = match route {
                Route::Ack { duplicate } => {
                    let (counter, done) = if duplicate {
                        tracing::debug!("duplicate acknowledged without running the handler");
                        (Counter::Duplicates, Settled::Duplicate)
                    } else {
                        (Counter::Processed, Settled::Processed)
                    };
                    self.stats.incr(counter);
                    finished.push(Finished::Ack { receipt, duplicate });
                    settled.push(done);
                    continue;
                }
                Route::DeadLetter {
                    reason,
                    error,
                    failures,
                } => {
                    self.dead_letter(
                        transport, &message, &receipt, reason, &error, failures, abandon,
                    )
                    .await
                }
                Route::Delay {
                    delay,
                    error,
                    failures,
                    ..
                } => {
                    self.delay(
                        transport, &message, &receipt, delay, &error, failures, abandon,
                    )
                    .await
                }
                Route::Requeue { pause, error, .. } => {
                    tracing::warn!(%error, "transient failure; requeueing");
                    self.stats.incr(Counter::Retried);
                    transport.requeue(&message, &receipt, pause, &error).await;
                    Settled::Retried
                }
                Route::Abandon => Settled::Abandoned,
            };
            finished.push(match done {
                Settled::Abandoned => Finished::Abandoned(receipt),
                // A letter found processed: acknowledged as the duplicate it is.
                Settled::Duplicate => {
                    self.stats.incr(Counter::Duplicates);
                    Finished::Ack {
                        receipt,
                        duplicate: true,
                    }
                }
                _ => Finished::Settled(receipt),
            });
            settled.push(done);
        }
        transport.finish(finished).await;
        settled
    }

    #[allow(clippy::too_many_arguments)]
    async fn delay<T: Transport>(
        &self,
        transport: &T,
        message: &Message,
        receipt: &T::Receipt,
        delay: Duration,
        error: &str,
        failures: Failures,
        abandon: &Abandon,
    ) -> Settled {
        let headers = self.router.failure_headers(message, error, &failures).await;
        let later = Later {
            delay,
            attempts: failures.attempts,
            error,
            headers,
        };
        match transport.retry_later(message, receipt, later).await {
            Ok(()) => {
                tracing::warn!(%error, attempts = failures.attempts, ?delay, "transient failure; retrying later");
                self.stats.incr(Counter::Retried);
            }
            // Sent, it would fail the same way every time: it never can be
            // retried.
            Err(Refused::TooLarge(why)) => {
                let error = format!("{why}; the last failure: {error}");
                let reason = DeadLetterReason::HeadersTooLarge;
                return Box::pin(self.dead_letter(
                    transport, message, receipt, reason, &error, failures, abandon,
                ))
                .await;
            }
            Err(Refused::Failed(why)) => {
                let error = format!("cannot send the retry: {why}");
                self.copy_failed(transport, message, receipt, error).await;
            }
        }
        Settled::Retried
    }

    #[allow(clippy::too_many_arguments)]
    async fn dead_letter<T: Transport>(
        &self,
        transport: &T,
        message: &Message,
        receipt: &T::Receipt,
        reason: DeadLetterReason,
        error: &str,
        failures: Failures,
        abandon: &Abandon,
    ) -> Settled {
        let mut headers = self.router.failure_headers(message, error, &failures).await;
        headers.push((REASON_HEADER, HeaderValue::Text(reason.as_str().to_owned())));
        let letter = Letter {
            reason,
            error,
            headers,
        };
        if let Some(stored) = self
            .router
            .store_dead_letter(message, &letter, &failures, abandon)
            .await
        {
            match stored {
                Stored::Yes => {
                    self.stats.dead_lettered(reason);
                    tracing::warn!(%reason, %error, "dead-lettered to the letter store");
                    transport.letter_stored(message, receipt, letter).await;
                    return Settled::DeadLettered;
                }
                Stored::Processed => {
                    tracing::info!(%reason, "not dead-lettered: the message was processed already");
                    return Settled::Duplicate;
                }
                Stored::Abandoned => return Settled::Abandoned,
                Stored::Refused(e) => {
                    let refused = format!(
                        "the dead-letter table refused the letter ({e}); sending it to the queue"
                    );
                    tracing::error!(error = %refused);
                    self.health.record_error(refused);
                }
            }
        }
        match transport.dead_letter(message, receipt, letter).await {
            Ok(trimmed) => {
                self.stats.dead_lettered(reason);
                if trimmed.is_empty() {
                    tracing::warn!(%reason, %error, "dead-lettered");
                } else {
                    tracing::warn!(%reason, %error, ?trimmed, "dead-lettered with headers trimmed to fit the frame size");
                }
                Settled::DeadLettered
            }
            Err(Refused::TooLarge(why)) => {
                // Even idempo's own headers do not fit (a tiny frame size):
                // the broker's own dead-lettering moves the original as it is.
                let error = format!("cannot dead-letter ({reason}): {why}; rejecting the original");
                tracing::error!(%error);
                self.health.record_error(error);
                self.stats.dead_lettered(reason);
                transport.reject(receipt).await;
                Settled::DeadLettered
            }
            Err(Refused::Failed(why)) => {
                let error = format!("cannot dead-letter ({reason}) {why}");
                self.copy_failed(transport, message, receipt, error).await;
                Settled::Retried
            }
        }
    }

    /// A copy was not sent: the original goes back after a pause, never
    /// acked, so nothing is lost.
    async fn copy_failed<T: Transport>(
        &self,
        transport: &T,
        message: &Message,
        receipt: &T::Receipt,
        error: String,
    ) {
        if self.log_limit.allow() {
            tracing::error!(%error, "requeueing the original instead");
        } else {
            tracing::debug!(%error, "requeueing the original instead");
        }
        self.health.record_error(error.clone());
        self.stats.incr(Counter::Retried);
        self.stats.incr(Counter::PublishFailures);
        transport
            .requeue(message, receipt, FALLBACK_PAUSE, &error)
            .await;
    }
}
