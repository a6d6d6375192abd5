//! Where each delivery of a unit goes, whatever carries it: the seam between
//! the delivery logic and its transport. [`Router`] finds each message's id,
//! has the unit decided (the inbox steps of `steps.rs`, or a dedup window)
//! and turns each [`Outcome`] into a [`Route`]: ack, dead-letter, delay,
//! requeue or leave. The AMQP adapter carries routes out over lapin
//! (`amqp/delivery.rs`); the test harness (`crate::testing`, feature `testing`)
//! records them, so both run this same code.

use std::sync::Arc;
use std::time::Duration;

use crate::runtime::dead_letter::DeadLetterReason;
use crate::runtime::header_names::{
    CONSUMER_HEADER, ERROR_HEADER, MESSAGE_ID_HEADER, MESSAGE_ID_SEAL_HEADER, QUEUE_HEADER,
    ROUTING_KEY_HEADER,
};
use crate::runtime::headers::{Failures, original_routing_key, truncate};
use crate::runtime::letters::{Filing, LetterStore, NewLetter, Stored};
use crate::runtime::message::HeaderValue;
use crate::runtime::message::Message;
use crate::runtime::message_id::MessageIdSource;
use crate::runtime::outcome::{Abandon, Decide, Outcome, RetryCause, invalid_id};
use crate::runtime::redelivery::{Mode, RedeliveryPolicy};
use crate::runtime::seal::{Keyring, claimed_id};
use crate::runtime::transport::Letter;
use crate::wait::Waited;

/// Error texts in headers are cut to this: a frame carries the headers whole.
const MAX_ERROR_HEADER: usize = 4096;

/// How long a copy waits for the consumer's key before it goes out unsealed.
const KEY_WAIT: Duration = Duration::from_millis(500);

/// What a transport does with one decided delivery.
#[derive(Debug, Clone)]
pub(crate) enum Route {
    /// Processed (`duplicate: false`) or a duplicate: ack.
    Ack { duplicate: bool },
    /// Publish a copy to the dead-letter queue with its reason, then ack.
    DeadLetter {
        reason: DeadLetterReason,
        error: String,
        failures: Failures,
    },
    /// Deliver again after `delay` (AMQP: a copy to the delay queue, then ack).
    Delay {
        delay: Duration,
        cause: RetryCause,
        error: String,
        failures: Failures,
    },
    /// Hand the delivery back (nack with requeue) after `pause`.
    Requeue {
        pause: Duration,
        cause: RetryCause,
        error: String,
    },
    /// Leave it unacked: it returns when its channel closes.
    Abandon,
}

/// The transport-free part of a consumer's delivery path (one per consumer).
pub(crate) struct Router {
    /// The transport's name (its dead letters are replayed there).
    pub(crate) transport: &'static str,
    pub(crate) consumer: String,
    pub(crate) queue: String,
    pub(crate) message_id: MessageIdSource,
    /// Seals the ids idempo's copies carry forward, and checks them.
    pub(crate) keys: Arc<Keyring>,
    pub(crate) decide: Arc<dyn Decide>,
    pub(crate) redelivery: RedeliveryPolicy,
    /// The runtime's own dead-letter store, when letters go there instead of
    /// the transport's.
    pub(crate) letters: Option<Arc<dyn LetterStore>>,
    /// Whether a message's attempts are its transport's delivery count
    /// (JetStream), which grows also when a delivery ends without an
    /// outcome: see [`Router::delivered_too_often`].
    pub(crate) counts_deliveries: bool,
}

impl Router {
    /// Inserts the dead letter of `message` in the letter store, waiting
    /// (with backoff) while PostgreSQL cannot take it, until `abandon`.
    /// `None` when letters go to the transport's store instead.
    pub(crate) async fn store_dead_letter(
        &self,
        message: &Message,
        letter: &Letter<'_>,
        failures: &Failures,
        abandon: &Abandon,
    ) -> Option<Stored> {
        let store = self.letters.as_deref()?;
        let (reason, error) = (letter.reason, letter.error);
        let routing_key = original_routing_key(message);
        let letter = NewLetter {
            transport: self.transport,
            consumer: &self.consumer,
            queue: &self.queue,
            message,
            routing_key: &routing_key,
            headers: &letter.headers,
            reason: reason.as_str(),
            error,
            attempts: failures.attempts,
            first_failed_at: &failures.first_failure,
            last_failed_at: &failures.last_failure,
        };
        let waited = crate::wait::until_database_answers(
            "cannot store the dead letter",
            (Duration::from_millis(100), Duration::from_secs(10)),
            abandon.wait(),
            || store.insert(&letter),
            crate::Error::is_unavailable,
        )
        .await;
        Some(match waited {
            Waited::Done(Filing::Filed) => Stored::Yes,
            Waited::Done(Filing::Processed) => Stored::Processed,
            Waited::Failed(e) => Stored::Refused(e),
            Waited::Stopped => Stored::Abandoned,
        })
    }

    /// Gives each message its id and decides the unit: one outcome per
    /// message, in order. A message without a usable id is final at once.
    pub(crate) async fn outcomes(
        &self,
        messages: &mut [Message],
        abandon: &Abandon,
    ) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; messages.len()];
        for (message, outcome) in messages.iter_mut().zip(&mut outcomes) {
            match self.identify(message, abandon).await {
                Ok(id) => {
                    message.set_id(id);
                    *outcome = self.delivered_too_often(message);
                }
                Err(settle) => *outcome = Some(settle),
            }
        }
        let pending: Vec<usize> = (0..messages.len())
            .filter(|&i| outcomes[i].is_none())
            .collect();
        if !pending.is_empty() {
            let unit: Vec<Message> = pending.iter().map(|&i| messages[i].clone()).collect();
            let decided = self.decide.decide(&unit, abandon).await;
            for (i, outcome) in pending.into_iter().zip(decided) {
                outcomes[i] = Some(outcome);
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or(Outcome::Abandoned))
            .collect()
    }

    /// A delivery its transport delivered twice as often as the policy
    /// allows attempts: each delivery before must have ended without an
    /// outcome (the process died in the handler, every time). It is
    /// dead-lettered before the handler runs again, so that one message
    /// cannot take down every consumer in turn. Only where the attempts are
    /// the transport's delivery count. A message processed already (its
    /// acks lost, or its first delivery held past the ack wait by an
    /// outage) is no letter: the letter table finds its claim and the
    /// delivery is acknowledged as a duplicate.
    fn delivered_too_often(&self, message: &Message) -> Option<Outcome> {
        if !self.counts_deliveries {
            return None;
        }
        let previous = message.failed_attempts();
        let limit = self.redelivery.max_attempts.saturating_mul(2);
        (previous >= limit).then(|| Outcome::DeadLetter {
            reason: DeadLetterReason::AttemptsExhausted,
            error: format!(
                "delivered {} times without an outcome (the process handling it may have died \
                 each time); the policy allows {} attempts",
                previous.saturating_add(1),
                self.redelivery.max_attempts
            ),
        })
    }

    /// The id to deduplicate `message` on: the one an idempo copy carries
    /// forward under a valid seal, else the configured source's. A copy's
    /// seal needs the consumer's key: while the database cannot give it, the
    /// delivery waits (and is abandoned at shutdown).
    async fn identify(&self, message: &Message, abandon: &Abandon) -> Result<String, Outcome> {
        if claimed_id(message).is_some() {
            let Some(seal) = self.keys.wait(abandon.wait()).await else {
                return Err(Outcome::Abandoned);
            };
            if let Some(id) = seal.carried_id(message) {
                return crate::message_id::validate_message_id(&id)
                    .map(|()| id)
                    .map_err(invalid_id);
            }
        }
        self.message_id.extract(message).map_err(invalid_id)
    }

    /// Where `outcome` sends `message`: a transient failure goes to the delay
    /// queue of its attempt, or to the dead letters once the attempts are
    /// used up.
    pub(crate) fn route(&self, message: &Message, outcome: Outcome) -> Route {
        match outcome {
            Outcome::Processed => Route::Ack { duplicate: false },
            Outcome::Duplicate => Route::Ack { duplicate: true },
            Outcome::DeadLetter { reason, error } => Route::DeadLetter {
                reason,
                error,
                failures: Failures::record(message),
            },
            Outcome::Retry {
                cause,
                error,
                requested_delay,
            } => {
                let failures = Failures::record(message);
                match &self.redelivery.mode {
                    Mode::Requeue(pause) => Route::Requeue {
                        pause: *pause,
                        cause,
                        error,
                    },
                    Mode::Delayed(_) if failures.attempts >= self.redelivery.max_attempts => {
                        Route::DeadLetter {
                            reason: DeadLetterReason::AttemptsExhausted,
                            error: format!(
                                "{} attempts failed; the last: {error}",
                                failures.attempts
                            ),
                            failures,
                        }
                    }
                    Mode::Delayed(_) => {
                        let delay = self
                            .redelivery
                            .delay_for(failures.attempts, requested_delay);
                        Route::Delay {
                            delay,
                            cause,
                            error,
                            failures,
                        }
                    }
                }
            }
            Outcome::Abandoned => Route::Abandon,
        }
    }

    /// The headers of a copy of `message` that failed with `error`: the
    /// error, who failed it, its first routing key, its id (sealed, so the
    /// copy is deduplicated on it) and its failure history.
    pub(crate) async fn failure_headers(
        &self,
        message: &Message,
        error: &str,
        failures: &Failures,
    ) -> Vec<(&'static str, HeaderValue)> {
        let text = |s: &str| HeaderValue::Text(s.to_owned());
        let mut headers = vec![
            (ERROR_HEADER, text(truncate(error, MAX_ERROR_HEADER))),
            (CONSUMER_HEADER, text(&self.consumer)),
            (QUEUE_HEADER, text(&self.queue)),
            (ROUTING_KEY_HEADER, text(&original_routing_key(message))),
        ];
        // An id-less original has nothing to carry forward (an empty header
        // would only get in the way of an operator who adds one to replay it).
        if !message.id().is_empty() {
            headers.push((MESSAGE_ID_HEADER, text(message.id())));
            // Without the key (the database down since the start), the copy
            // goes out unsealed: its id is then taken from its properties
            // again. Waited for briefly only: poison is dead-lettered while
            // the database is down.
            let seal = match self.keys.loaded() {
                Some(seal) => Some(seal),
                None => tokio::time::timeout(KEY_WAIT, self.keys.get())
                    .await
                    .ok()
                    .and_then(|loaded| loaded.ok()),
            };
            match seal {
                Some(seal) => {
                    let seal = seal.seal(message.id(), message);
                    headers.push((MESSAGE_ID_SEAL_HEADER, text(&seal)));
                }
                None => tracing::debug!("copy sent without a seal: the key is not loaded yet"),
            }
        }
        headers.extend(failures.headers());
        headers
    }
}
