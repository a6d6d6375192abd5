//! [`MemoryBroker`]: queues in the test's own process, for a consumer on
//! the [`Memory`](super::Memory) transport that runs as in production
//! (`Consumer::run`), with redeliveries, delays and dead letters, and no
//! broker to start: what the transport conformance kit runs on.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};
use tokio::sync::Notify;

use crate::runtime::message::Message;

/// Queues of messages in this process. Cheap to clone: clones share the
/// queues. A consumer reads one with
/// [`MemoryBroker::consumer`]; a test publishes with
/// [`publish`](MemoryBroker::publish).
#[derive(Debug, Clone, Default)]
pub struct MemoryBroker {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    queues: Mutex<HashMap<String, Queue>>,
    /// Woken when a message is ready in any queue, or a session is cut.
    ready: Notify,
}

#[derive(Debug, Default)]
struct Queue {
    ready: VecDeque<Stored>,
    /// Delivered and not settled, by delivery tag, with their session.
    unsettled: HashMap<u64, (u64, Stored)>,
    next_tag: u64,
    /// Sessions cut since they began: their deliveries come back.
    sessions: u64,
    dead: Vec<Stored>,
}

/// A message as the broker keeps it.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    pub(crate) body: Vec<u8>,
    pub(crate) properties: BasicProperties,
    pub(crate) redelivered: bool,
}

impl MemoryBroker {
    /// An empty broker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts a message in `queue`: `id` as its transport id (the
    /// `message_id` the consumer deduplicates on by default), `headers` as
    /// text headers.
    pub fn publish(
        &self,
        queue: &str,
        id: &str,
        body: impl Into<Vec<u8>>,
        headers: &[(&str, &str)],
    ) {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(
                (*name).into(),
                AMQPValue::LongString(LongString::from(*value)),
            );
        }
        let properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_delivery_mode(2)
            .with_headers(table);
        self.put(
            queue,
            Stored {
                body: body.into(),
                properties,
                redelivered: false,
            },
        );
    }

    /// The dead letters of `queue` (its consumer's own store), with their
    /// headers (`x-idempo-reason`, ...), oldest first.
    pub fn dead_letters(&self, queue: &str) -> Vec<Message> {
        self.with_queue(queue, |q| {
            q.dead.iter().map(|s| s.message(queue, 0)).collect()
        })
    }

    /// How many messages `queue` holds, ready or delivered and not settled.
    pub fn depth(&self, queue: &str) -> usize {
        self.with_queue(queue, |q| q.ready.len() + q.unsettled.len())
    }

    /// Ends every consumer session on `queue` as a lost connection would:
    /// what they had not settled is delivered again, flagged redelivered.
    pub fn cut(&self, queue: &str) {
        self.with_queue(queue, |q| {
            q.sessions += 1;
            let lost: Vec<Stored> = q.unsettled.drain().map(|(_, (_, s))| s).collect();
            for mut stored in lost {
                stored.redelivered = true;
                q.ready.push_back(stored);
            }
        });
        self.inner.ready.notify_waiters();
    }

    fn with_queue<R>(&self, queue: &str, f: impl FnOnce(&mut Queue) -> R) -> R {
        let mut queues = self.inner.queues.lock().unwrap_or_else(|p| p.into_inner());
        f(queues.entry(queue.to_owned()).or_default())
    }

    pub(crate) fn put(&self, queue: &str, stored: Stored) {
        self.with_queue(queue, |q| q.ready.push_back(stored));
        self.inner.ready.notify_waiters();
    }

    /// Puts `stored` in `queue` after `delay`.
    pub(crate) fn put_later(&self, queue: &str, stored: Stored, delay: Duration) {
        let (broker, queue) = (self.clone(), queue.to_owned());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            broker.put(&queue, stored);
        });
    }

    pub(crate) fn dead_letter(&self, queue: &str, stored: Stored) {
        self.with_queue(queue, |q| q.dead.push(stored));
    }

    /// The session now open on `queue`.
    pub(crate) fn session(&self, queue: &str) -> u64 {
        self.with_queue(queue, |q| q.sessions)
    }

    /// The next ready message of `queue` for `session`, waiting for one;
    /// `None` once the session was cut.
    pub(crate) async fn next(&self, queue: &str, session: u64) -> Option<(u64, Stored)> {
        loop {
            let woken = self.inner.ready.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let taken = self.with_queue(queue, |q| {
                if q.sessions != session {
                    return Err(());
                }
                let Some(stored) = q.ready.pop_front() else {
                    return Ok(None);
                };
                q.next_tag += 1;
                let tag = q.next_tag;
                q.unsettled.insert(tag, (session, stored.clone()));
                Ok(Some((tag, stored)))
            });
            match taken {
                Err(()) => return None,
                Ok(Some(taken)) => return Some(taken),
                Ok(None) => woken.await,
            }
        }
    }

    /// Settles delivery `tag` of `queue` (acknowledged, or moved elsewhere
    /// by the caller); `false` when its session was cut meanwhile (it is
    /// back in the queue).
    pub(crate) fn settle(&self, queue: &str, tag: u64) -> bool {
        self.with_queue(queue, |q| q.unsettled.remove(&tag).is_some())
    }
}

impl Stored {
    /// The message a consumer receives.
    pub(crate) fn message(&self, queue: &str, tag: u64) -> Message {
        Message::with_properties(
            self.body.clone(),
            self.properties.clone(),
            "",
            queue,
            self.redelivered,
            tag,
        )
    }
}
