//! One batch published to RabbitMQ, and what the broker said of each
//! message: the confirms of the batch, then, when the broker closed the
//! channel over one message, the search for that message so that the
//! refusal is its own and the others go out.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::frame::{broker_size_limit, frame};
use super::link::BrokerLink;
use crate::amqp::fit;
use crate::amqp::publish::PublishError;
use crate::outbox::packed::Staged;
use crate::relay::said::{Envelope, Said};

/// The relay's session on RabbitMQ: a batch published on the confirm
/// channel, the broker's alarm, the channel reopened after a close.
impl crate::relay::Link for BrokerLink {
    async fn publish(&mut self, envelopes: &[Envelope]) -> Vec<Vec<Said>> {
        let sends = super::send_span::Sends::open(envelopes);
        let said = publish(self.confirm_timeout, self, envelopes).await;
        sends.close(envelopes, &said);
        said
    }

    fn blocked(&self) -> Option<String> {
        BrokerLink::blocked(self)
    }

    async fn unblocked(&mut self) {
        BrokerLink::unblocked(self).await;
    }

    async fn prepare(&mut self) -> Result<(), String> {
        self.ensure_channel().await
    }

    fn is_connected(&self) -> bool {
        BrokerLink::is_connected(self)
    }

    async fn after_unanswered(&mut self) -> Result<(), String> {
        self.replace_channel().await
    }
}

/// What the broker's answer to one publish of a batch says.
fn said_of(result: std::result::Result<(), PublishError>) -> Said {
    match result {
        Ok(()) => Said::Confirmed,
        Err(e @ (PublishError::Nacked | PublishError::Returned(_))) => Said::Refused {
            error: e.to_string(),
            certain: false,
        },
        Err(e) => Said::Unknown(e.to_string()),
    }
}

/// How much longer than the confirm timeout a publish may take before it is
/// dropped: `ConfirmChannel` closes a timed-out channel, and a blocked
/// connection never sends that close.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Publishes the batch's messages with their confirms in flight
/// together; then, if the channel failed under them on a live
/// connection, the unanswered ones one at a time. Says what became of
/// each message of each envelope.
pub(super) async fn publish(
    confirm_timeout: Duration,
    broker: &mut BrokerLink,
    envelopes: &[Envelope],
) -> Vec<Vec<Said>> {
    let frame_max = broker.frame_max();
    let mut said: Vec<Vec<Said>> = Vec::with_capacity(envelopes.len());
    let mut sent = Vec::new();
    let mut frames = Vec::new();
    for (e, envelope) in envelopes.iter().enumerate() {
        let mut row = Vec::with_capacity(envelope.messages.len());
        for (i, message) in envelope.messages.iter().enumerate() {
            let frame = frame(message);
            // A header frame over frame_max closes the whole connection
            // (FRAME_ERROR): never sent.
            match fit::check(&frame.properties, frame_max) {
                Ok(()) => {
                    sent.push((e, i));
                    frames.push(frame);
                    row.push(Said::Unknown(String::new()));
                }
                Err(fit::TooLarge { size, .. }) => row.push(Said::Refused {
                    error: format!(
                        "its properties and headers take {size} bytes, above the connection's \
                         frame_max of {frame_max} bytes (the broker would close the connection: FRAME_ERROR)"
                    ),
                    certain: true,
                }),
            }
        }
        said.push(row);
    }
    if frames.is_empty() {
        return said;
    }
    let deadline = Instant::now() + confirm_timeout;
    // Bounded here too: a timed-out channel is closed, and a blocked
    // connection never sends the close.
    let results = tokio::time::timeout(
        confirm_timeout + CLOSE_GRACE,
        broker.channel().publish_all(frames),
    )
    .await;
    match results {
        Ok(results) => {
            for ((e, i), result) in sent.into_iter().zip(results) {
                said[e][i] = said_of(result);
            }
        }
        Err(_) => {
            let why = format!("no publisher confirm within {:?}", confirm_timeout);
            for (e, i) in sent {
                said[e][i] = Said::Unknown(why.clone());
            }
        }
    }
    let unanswered = said.iter().flatten().any(|s| s.unknown().is_some());
    if unanswered && broker.is_connected() && broker.blocked().is_none() {
        isolate(broker, envelopes, &mut said, deadline).await;
    }
    said
}

/// After the channel failed under a batch on a live connection (the
/// broker closes a channel over one message: `NOT_FOUND` for a missing
/// exchange, `PRECONDITION_FAILED`), finds that message so that the
/// error is its refusal (an attempt) and the others go out: the
/// unanswered messages are published again on a new channel, those the
/// broker's reason names (the missing exchange, a body over its size
/// limit) one at a time first, the rest together, halved while a half
/// keeps failing. A key with a refused message keeps its later ones for
/// after its retry. Stops at `deadline` (the batch's rows stay locked
/// meanwhile), or when the connection is lost or blocked: the rest stay
/// unknown.
async fn isolate(
    broker: &mut BrokerLink,
    envelopes: &[Envelope],
    said: &mut [Vec<Said>],
    deadline: Instant,
) {
    let mut groups = VecDeque::new();
    let mut failed: Vec<(usize, usize)> = positions(said, |s| s.unknown().is_some());
    loop {
        if !failed.is_empty() {
            if !broker.is_connected() || broker.blocked().is_some() || broker.channel().is_usable()
            {
                // Not a channel the broker closed over a message: no answer.
                return;
            }
            let (e, i) = failed[0];
            let why = said[e][i].unknown().unwrap_or_default().to_owned();
            if let [(e, i)] = failed[..] {
                // The one message the channel failed under.
                let message = &envelopes[e].messages[i];
                // A body over the broker's max_message_size never fits.
                let certain =
                    broker_size_limit(&why).is_some_and(|limit| message.body.len() > limit);
                said[e][i] = Said::Refused {
                    error: format!("the broker closed the channel over it: {why}"),
                    certain,
                };
            } else {
                let (named, others): (Vec<_>, Vec<_>) = failed
                    .drain(..)
                    .partition(|&(e, i)| named_by(&why, &envelopes[e].messages[i]));
                if named.is_empty() {
                    let (first, second) = others.split_at(others.len() / 2);
                    groups.push_front(second.to_vec());
                    groups.push_front(first.to_vec());
                } else {
                    groups.push_front(others);
                    for one in named.into_iter().rev() {
                        groups.push_front(vec![one]);
                    }
                }
            }
        }
        let Some(group) = groups.pop_front() else {
            return;
        };
        if Instant::now() >= deadline
            || broker.blocked().is_some()
            || broker.ensure_channel().await.is_err()
        {
            return;
        }
        let group = publishable(envelopes, said, group);
        let frames = group
            .iter()
            .map(|&(e, i)| frame(&envelopes[e].messages[i]))
            .collect();
        let results = tokio::time::timeout_at(
            (deadline + CLOSE_GRACE).into(),
            broker.channel().publish_all(frames),
        )
        .await;
        let Ok(results) = results else { return };
        for (&(e, i), result) in group.iter().zip(results) {
            said[e][i] = said_of(result);
        }
        failed = group
            .into_iter()
            .filter(|&(e, i)| said[e][i].unknown().is_some())
            .collect();
    }
}

/// The (envelope, message) positions whose outcome satisfies `which`, in
/// batch order.
fn positions(said: &[Vec<Said>], which: impl Fn(&Said) -> bool) -> Vec<(usize, usize)> {
    said.iter()
        .enumerate()
        .flat_map(|(e, row)| row.iter().enumerate().map(move |(i, s)| (e, i, s)))
        .filter(|(_, _, s)| which(s))
        .map(|(e, i, _)| (e, i))
        .collect()
}

/// The messages of `group` that may go out now: not those of a key whose
/// earlier message was refused or is still unanswered outside the group
/// (the channel keeps the group's own order).
fn publishable(
    envelopes: &[Envelope],
    said: &[Vec<Said>],
    group: Vec<(usize, usize)>,
) -> Vec<(usize, usize)> {
    let mut kept = Vec::with_capacity(group.len());
    let mut in_group = HashSet::new();
    for (e, i) in group {
        let held = envelopes[e].key.as_deref().is_some_and(|key| {
            (0..e).any(|earlier| {
                envelopes[earlier].key.as_deref() == Some(key)
                    && said[earlier].iter().enumerate().any(|(j, s)| match s {
                        Said::Refused { .. } => true,
                        Said::Unknown(_) => !in_group.contains(&(earlier, j)),
                        Said::Confirmed => false,
                    })
            })
        });
        if !held {
            kept.push((e, i));
            in_group.insert((e, i));
        }
    }
    kept
}

/// Whether the broker's reason for closing the channel names `message`:
/// its exchange (`NOT_FOUND - no exchange 'x'`, `ACCESS_REFUSED`), or its
/// body's size (`message size .. is larger than configured max size ..`).
fn named_by(reason: &str, message: &Staged) -> bool {
    (!message.exchange.is_empty() && reason.contains(&format!("exchange '{}'", message.exchange)))
        || broker_size_limit(reason).is_some_and(|limit| message.body.len() > limit)
}
