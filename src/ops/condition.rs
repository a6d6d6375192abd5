//! [`Condition`]: how each item of a [`Status`] reads at a glance, decided
//! here once for every front end (the dashboard colours what this says).

use std::time::Duration;

use super::{QueueStatus, Status};
use crate::consumer::heartbeat::Instance;
use crate::dead_letters::model::LetterCount;
use crate::outbox::OutboxStatus;

/// How an item of a [`Status`] (a queue, a consumer process, the outbox, a
/// cause of dead letters) reads at a glance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Condition {
    /// Nothing to act on.
    Healthy,
    /// An operator should look: what the item's rule says.
    Attention,
    /// A consumer process that stopped or fell silent (no heartbeat for
    /// three beats): history, neither healthy nor in trouble.
    Stopped,
}

impl Condition {
    /// How old the oldest pending outbox message may get before the outbox
    /// needs attention (60 s): a relay publishes within milliseconds when it
    /// runs.
    pub const OUTBOX_PENDING_LIMIT: Duration = Duration::from_secs(60);

    /// `Attention` when `bad`, else `Healthy`.
    fn attention_if(bad: bool) -> Condition {
        if bad {
            Condition::Attention
        } else {
            Condition::Healthy
        }
    }

    /// A consumer process: [`Stopped`](Condition::Stopped) when not
    /// [alive](Instance::is_alive); [`Attention`](Condition::Attention) when
    /// alive but not consuming (reconnecting, paused), or its relay is
    /// blocked.
    pub fn of_instance(instance: &Instance) -> Condition {
        if !instance.is_alive() {
            return Condition::Stopped;
        }
        if instance.queue.is_empty() {
            // A relay of its own: healthy while it publishes.
            return Condition::attention_if(instance.state != "running");
        }
        Condition::attention_if(
            instance.state != "consuming" || instance.relay.as_deref() == Some("blocked"),
        )
    }

    /// The outbox: [`Attention`](Condition::Attention) when it holds a
    /// failed message, or its oldest pending one is older than
    /// [`OUTBOX_PENDING_LIMIT`](Self::OUTBOX_PENDING_LIMIT) (no relay runs, or it cannot publish).
    pub fn of_outbox(outbox: &OutboxStatus) -> Condition {
        let late = outbox
            .oldest_pending_age
            .is_some_and(|age| age.as_secs() > Self::OUTBOX_PENDING_LIMIT.as_secs());
        Condition::attention_if(outbox.failed > 0 || late)
    }

    /// A cause of live dead letters in the table:
    /// [`Attention`](Condition::Attention) while it holds any.
    pub fn of_dead_letters(letters: &LetterCount) -> Condition {
        Condition::attention_if(letters.count > 0)
    }
}

impl Status {
    /// The dead letters of `queue`: ready in its DLQ plus live in the table.
    pub fn dead_letters_of(&self, queue: &str) -> u64 {
        let in_dlq = self
            .queues
            .iter()
            .filter(|q| q.queue == queue)
            .filter_map(|q| q.dlq_ready)
            .map(u64::from)
            .sum::<u64>();
        let in_table = self
            .dead_letters
            .iter()
            .flatten()
            .filter(|l| l.queue == queue)
            .map(|l| u64::try_from(l.count).unwrap_or(0))
            .sum::<u64>();
        in_dlq + in_table
    }

    /// A queue: [`Attention`](Condition::Attention) when it has dead letters
    /// ([`dead_letters_of`](Status::dead_letters_of)), or messages are ready
    /// while none of its consumer processes is alive.
    pub fn queue_condition(&self, queue: &QueueStatus) -> Condition {
        let alive = self
            .instances
            .iter()
            .flatten()
            .any(|i| i.queue == queue.queue && i.is_alive());
        Condition::attention_if(
            self.dead_letters_of(&queue.queue) > 0 || (queue.ready.unwrap_or(0) > 0 && !alive),
        )
    }

    /// The outbox's condition ([`Condition::of_outbox`]); `None` when its
    /// table does not exist.
    pub fn outbox_condition(&self) -> Option<Condition> {
        self.outbox.as_ref().map(Condition::of_outbox)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outbox(failed: i64, oldest_secs: Option<u64>) -> OutboxStatus {
        OutboxStatus {
            failed,
            oldest_pending_age: oldest_secs.map(Duration::from_secs),
            ..OutboxStatus::default()
        }
    }

    #[test]
    fn the_outbox_needs_attention_on_a_failure_or_a_late_message() {
        assert_eq!(Condition::of_outbox(&outbox(0, None)), Condition::Healthy);
        assert_eq!(
            Condition::of_outbox(&outbox(0, Some(60))),
            Condition::Healthy
        );
        assert_eq!(
            Condition::of_outbox(&outbox(0, Some(61))),
            Condition::Attention
        );
        assert_eq!(Condition::of_outbox(&outbox(1, None)), Condition::Attention);
    }

    #[test]
    fn a_queue_needs_attention_with_dead_letters_or_ready_messages_and_no_consumer() {
        let queue = |ready, dlq_ready| QueueStatus {
            queue: "payments".into(),
            exists: true,
            ready: Some(ready),
            unacked: None,
            consumers: Some(0),
            dlq_ready,
            delay_queues: Vec::new(),
            transport: "amqp".into(),
        };
        let status = |q: QueueStatus| Status {
            consumers: Vec::new(),
            queues: vec![q],
            outbox: None,
            http_keys: None,
            window: None,
            dead_letters: None,
            instances: None,
            warnings: Vec::new(),
        };
        let idle = status(queue(0, Some(0)));
        assert_eq!(idle.queue_condition(&idle.queues[0]), Condition::Healthy);
        let dead = status(queue(0, Some(2)));
        assert_eq!(dead.dead_letters_of("payments"), 2);
        assert_eq!(dead.queue_condition(&dead.queues[0]), Condition::Attention);
        let unserved = status(queue(5, None));
        assert_eq!(
            unserved.queue_condition(&unserved.queues[0]),
            Condition::Attention
        );
        assert_eq!(unserved.outbox_condition(), None);
    }
}
