//! The transport conformance kit: the same checks, run against every
//! transport the runtime settles through (Watermill's
//! `pubsub/tests/test_pubsub.go` is the model: one list of checks, a
//! `Features` value per transport saying what it can show). Today: the AMQP
//! adapter on the real RabbitMQ, the JetStream adapter on the real NATS
//! server (feature `nats`), and `idempo::testing`'s harness.
//!
//! Each check publishes payments whose body says how the handler behaves,
//! and compares what became of each message (applied once, a duplicate, a
//! dead letter with its reason) and when each attempt ran.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use idempo::Tx;
use idempo::consumer::{HandlerError, Message, RedeliveryPolicy};
use idempo::testing::{Delivered, Harness};
use serde::{Deserialize, Serialize};
use support::consumer::{Running, consumer_for};
use support::{Broker, Db, eventually, payments};

/// The delay the checks configure for a retry: long enough to measure,
/// short enough for a test.
const DELAY: Duration = Duration::from_millis(700);

/// What a transport can show (the checks it cannot run are listed, not
/// silently passed).
#[derive(Debug, Clone, Copy)]
struct Features {
    /// Its connection can be cut and comes back by itself.
    reconnect: bool,
    /// It keeps the messages of a group in order (AMQP's dispatcher does;
    /// the harness delivers what it is given).
    ordered_groups: bool,
}

/// A kit message: a payment, and how its handler behaves.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct KitPayment {
    account: String,
    amount_cents: i64,
    #[serde(default)]
    fail: Fail,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
enum Fail {
    #[default]
    Never,
    /// A transient error on the first attempt only.
    Once,
    /// A permanent error on every attempt.
    Always,
}

/// What became of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ended {
    Applied,
    Duplicate,
    DeadLettered { reason: String },
}

/// When each id's handler attempts started, in order.
type Attempts = Arc<Mutex<HashMap<String, Vec<Instant>>>>;

/// The kit's handler: records the attempt, then behaves as the body says;
/// a successful attempt applies the payment in the delivery's transaction.
fn kit_handler(
    attempts: Attempts,
) -> impl Fn(Tx, Message) -> BoxFuture<'static, Result<(), HandlerError>> + Clone + Send + Sync + 'static
{
    move |tx: Tx, message: Message| {
        let attempts = attempts.clone();
        Box::pin(async move {
            let kit: KitPayment = message.json()?;
            let attempt = {
                let mut seen = attempts.lock().unwrap();
                let list = seen.entry(message.id().to_owned()).or_default();
                list.push(Instant::now());
                list.len()
            };
            match kit.fail {
                Fail::Always => return Err(HandlerError::permanent("refused for good")),
                Fail::Once if attempt == 1 => {
                    return Err(HandlerError::transient("downstream unavailable"));
                }
                _ => {}
            }
            let payment = payments::Payment {
                account: kit.account,
                amount_cents: kit.amount_cents,
            };
            payments::apply(tx, message.id(), &payment, 0.0).await?;
            Ok(())
        })
    }
}

fn payment(id: &str, account: &str, fail: Fail) -> (String, KitPayment) {
    let kit = KitPayment {
        account: account.into(),
        amount_cents: 100,
        fail,
    };
    (id.to_owned(), kit)
}

/// A transport under test.
trait Transport {
    fn name(&self) -> &'static str;
    fn features(&self) -> Features;
    /// The handler's attempts so far.
    fn attempts(&self) -> Attempts;
    /// Delivers each message once (in order, one group) and waits until each
    /// ended, retries included.
    async fn deliver(&mut self, messages: &[(String, KitPayment)]) -> Vec<Ended>;
    /// Delivers `message`, then the copy a lost acknowledgement brings
    /// back; returns how the copy ended.
    async fn deliver_again(&mut self, message: &(String, KitPayment)) -> Ended;
    /// Cuts the transport's connection (only with `features.reconnect`).
    async fn cut(&mut self);
    /// How many times the payment `id` was applied.
    async fn applied(&self, id: &str) -> i64;
}

/// The AMQP adapter: a real consumer on RabbitMQ.
struct Amqp {
    db: Db,
    broker: Broker,
    queue: String,
    name: String,
    consumer: Option<Running>,
    attempts: Attempts,
    published: u64,
}

impl Amqp {
    async fn new() -> Amqp {
        let (db, broker, queue) = support::setup().await;
        let attempts = Attempts::default();
        let name = support::unique("kit");
        let builder = consumer_for(&db, &queue)
            .redelivery(RedeliveryPolicy::delayed([DELAY]).max_attempts(3))
            .connection_name(name.clone())
            .handler(kit_handler(attempts.clone()))
            .message_groups();
        let consumer = Some(Running::start(builder));
        Amqp {
            db,
            broker,
            queue,
            name,
            consumer,
            attempts,
            published: 0,
        }
    }

    async fn publish(&mut self, (id, kit): &(String, KitPayment)) {
        let body = serde_json::to_vec(kit).unwrap();
        self.broker
            .publish_props(
                &self.queue,
                idempo::amqp::lapin::BasicProperties::default()
                    .with_message_id(id.as_str().into())
                    .with_delivery_mode(2)
                    .with_headers(idempo::amqp::lapin::types::FieldTable::from(
                        std::collections::BTreeMap::from([(
                            idempo::headers::GROUP_ID_HEADER.into(),
                            idempo::amqp::lapin::types::AMQPValue::LongString("kit".into()),
                        )]),
                    )),
                &body,
            )
            .await;
        self.published += 1;
    }

    async fn settled(&self) {
        let consumer = self.consumer.as_ref().unwrap();
        consumer.settled(self.published).await;
    }

    async fn ended(&self, id: &str) -> Ended {
        let applied: i64 = self.db.payments_for(id).await;
        if applied > 0 {
            return Ended::Applied;
        }
        Ended::DeadLettered {
            reason: "not applied".into(),
        }
    }
}

impl Transport for Amqp {
    fn name(&self) -> &'static str {
        "amqp"
    }

    fn features(&self) -> Features {
        Features {
            reconnect: true,
            ordered_groups: true,
        }
    }

    fn attempts(&self) -> Attempts {
        self.attempts.clone()
    }

    async fn deliver(&mut self, messages: &[(String, KitPayment)]) -> Vec<Ended> {
        for message in messages {
            self.publish(message).await;
        }
        self.settled().await;
        let letters = self
            .broker
            .drain(&idempo::amqp::dead_letter_queue(&self.queue))
            .await;
        let mut ended = Vec::with_capacity(messages.len());
        for (id, _) in messages {
            match letters
                .iter()
                .find(|l| l.message_id.as_deref() == Some(id.as_str()))
            {
                Some(letter) => ended.push(Ended::DeadLettered {
                    reason: letter.reason().to_owned(),
                }),
                None => ended.push(self.ended(id).await),
            }
        }
        ended
    }

    async fn deliver_again(&mut self, message: &(String, KitPayment)) -> Ended {
        self.deliver(std::slice::from_ref(message)).await;
        let before = self.consumer.as_ref().unwrap().stats().duplicates;
        // The broker's redelivery of a delivery whose ack was lost is, to
        // the consumer, a second copy with the same id and body.
        self.publish(message).await;
        self.settled().await;
        let after = self.consumer.as_ref().unwrap().stats().duplicates;
        if after == before + 1 {
            Ended::Duplicate
        } else {
            self.ended(&message.0).await
        }
    }

    async fn cut(&mut self) {
        support::close_connections_named(&self.name);
    }

    async fn applied(&self, id: &str) -> i64 {
        self.db.payments_for(id).await
    }
}

/// `idempo::testing`: the runtime settles through the harness's recorder.
struct Testing {
    harness: Harness,
    attempts: Attempts,
}

impl Testing {
    async fn new() -> Testing {
        let attempts = Attempts::default();
        // The harness works in a schema of its own.
        let harness = Harness::new(support::small_pool().await, "kit")
            .setup(payments::TABLES)
            .handler(kit_handler(attempts.clone()))
            .configure(|c| c.redelivery(RedeliveryPolicy::delayed([DELAY]).max_attempts(3)))
            .await
            .expect("the harness starts");
        Testing { harness, attempts }
    }

    /// Delivers `message` and its retries, each after the delay the runtime
    /// asked for, as a broker would.
    async fn until_ended(&self, message: Message) -> Ended {
        let mut message = message;
        loop {
            match self.harness.deliver(message).await.expect("delivered") {
                Delivered::Acked { .. } => return Ended::Applied,
                Delivered::Duplicate => return Ended::Duplicate,
                Delivered::Retried { delay, copy, .. } => {
                    tokio::time::sleep(delay).await;
                    message = copy;
                }
                Delivered::DeadLettered { reason, .. } => {
                    return Ended::DeadLettered {
                        reason: reason.as_str().to_owned(),
                    };
                }
                other => panic!("unexpected settlement: {other}"),
            }
        }
    }
}

impl Transport for Testing {
    fn name(&self) -> &'static str {
        "testing"
    }

    fn features(&self) -> Features {
        Features {
            reconnect: false,
            ordered_groups: false,
        }
    }

    fn attempts(&self) -> Attempts {
        self.attempts.clone()
    }

    async fn deliver(&mut self, messages: &[(String, KitPayment)]) -> Vec<Ended> {
        let mut ended = Vec::with_capacity(messages.len());
        for (id, kit) in messages {
            let message = self.harness.json(id, kit);
            ended.push(self.until_ended(message).await);
        }
        ended
    }

    async fn deliver_again(&mut self, (id, kit): &(String, KitPayment)) -> Ended {
        let message = self.harness.json(id, kit);
        match self.harness.deliver_after_lost_ack(message).await.unwrap() {
            Delivered::Duplicate => Ended::Duplicate,
            Delivered::Acked { .. } => Ended::Applied,
            other => panic!("unexpected settlement: {other}"),
        }
    }

    async fn cut(&mut self) {
        unreachable!("the harness has no connection to cut");
    }

    /// Payments are written in the harness's own schema.
    async fn applied(&self, id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE message_id = $1")
            .bind(id)
            .fetch_one(self.harness.pool())
            .await
            .unwrap()
    }
}

#[cfg(feature = "nats")]
#[path = "kit/nats.rs"]
mod nats_kit;
#[cfg(feature = "nats")]
use nats_kit::Nats;

// ---------------------------------------------------------------- the checks

/// A committed delivery is settled once, and its effect is there once.
async fn settles_after_commit<T: Transport>(t: &mut T) {
    let message = payment("settle-1", "alice", Fail::Never);
    let ended = t.deliver(std::slice::from_ref(&message)).await;
    assert_eq!(
        ended,
        [Ended::Applied],
        "{}: settles_after_commit",
        t.name()
    );
    assert_eq!(t.applied("settle-1").await, 1, "{}", t.name());
}

/// The copy a lost acknowledgement brings back is a duplicate: no second
/// effect.
async fn a_lost_ack_redelivers_a_duplicate<T: Transport>(t: &mut T) {
    let message = payment("lost-ack-1", "bob", Fail::Never);
    let ended = t.deliver_again(&message).await;
    assert_eq!(
        ended,
        Ended::Duplicate,
        "{}: a_lost_ack_redelivers_a_duplicate",
        t.name()
    );
    assert_eq!(t.applied("lost-ack-1").await, 1, "{}", t.name());
}

/// A transient failure is retried after the policy's delay, and applied
/// once.
async fn the_delay_is_honoured<T: Transport>(t: &mut T) {
    let message = payment("delay-1", "carol", Fail::Once);
    let ended = t.deliver(std::slice::from_ref(&message)).await;
    assert_eq!(
        ended,
        [Ended::Applied],
        "{}: the_delay_is_honoured",
        t.name()
    );
    assert_eq!(t.applied("delay-1").await, 1, "{}", t.name());
    let attempts = t.attempts();
    let seen = attempts.lock().unwrap()["delay-1"].clone();
    assert_eq!(seen.len(), 2, "{}: two attempts", t.name());
    let waited = seen[1] - seen[0];
    assert!(
        waited >= DELAY,
        "{}: the retry ran {waited:?} after the failure, before the delay of {DELAY:?}",
        t.name()
    );
}

/// A permanent failure is dead-lettered with its reason, and has no effect.
async fn a_dead_letter_carries_its_reason<T: Transport>(t: &mut T) {
    let message = payment("poison-1", "dave", Fail::Always);
    let ended = t.deliver(std::slice::from_ref(&message)).await;
    assert_eq!(
        ended,
        [Ended::DeadLettered {
            reason: idempo::consumer::DeadLetterReason::PermanentError
                .as_str()
                .into()
        }],
        "{}: a_dead_letter_carries_its_reason",
        t.name()
    );
    assert_eq!(t.applied("poison-1").await, 0, "{}", t.name());
}

/// After its connection is cut, the transport comes back and settles what
/// follows, each message once.
async fn it_reconnects<T: Transport>(t: &mut T) {
    if !t.features().reconnect {
        return;
    }
    t.cut().await;
    let message = payment("after-cut-1", "erin", Fail::Never);
    let ended = t.deliver(std::slice::from_ref(&message)).await;
    assert_eq!(ended, [Ended::Applied], "{}: it_reconnects", t.name());
    assert_eq!(t.applied("after-cut-1").await, 1, "{}", t.name());
}

/// Messages of one group are handled in the order they were published.
async fn a_group_keeps_its_order<T: Transport>(t: &mut T) {
    if !t.features().ordered_groups {
        return;
    }
    let messages: Vec<_> = (0..20)
        .map(|i| payment(&format!("order-{i:02}"), "frank", Fail::Never))
        .collect();
    let ended = t.deliver(&messages).await;
    assert!(
        ended.iter().all(|e| *e == Ended::Applied),
        "{}: {ended:?}",
        t.name()
    );
    let attempts = t.attempts();
    let seen = attempts.lock().unwrap();
    let mut order: Vec<(&Instant, &String)> =
        messages.iter().map(|(id, _)| (&seen[id][0], id)).collect();
    order.sort();
    let ids: Vec<&String> = order.into_iter().map(|(_, id)| id).collect();
    let published: Vec<&String> = messages.iter().map(|(id, _)| id).collect();
    assert_eq!(ids, published, "{}: a_group_keeps_its_order", t.name());
}

/// Every check, in order, against one transport.
async fn conformance<T: Transport>(t: &mut T) {
    settles_after_commit(t).await;
    a_lost_ack_redelivers_a_duplicate(t).await;
    the_delay_is_honoured(t).await;
    a_dead_letter_carries_its_reason(t).await;
    it_reconnects(t).await;
    a_group_keeps_its_order(t).await;
}

#[tokio::test]
async fn the_amqp_adapter_conforms() {
    let mut amqp = Amqp::new().await;
    conformance(&mut amqp).await;
    let consumer = amqp.consumer.take().unwrap();
    consumer.stop().await.expect("a graceful stop");
    eventually(
        "nothing left in the queue",
        support::consumer::WAIT,
        || async { amqp.broker.ready(&amqp.queue).await == 0 },
    )
    .await;
}

#[tokio::test]
async fn the_testing_harness_conforms() {
    let mut testing = Testing::new().await;
    conformance(&mut testing).await;
    testing.harness.close().await;
}

#[cfg(feature = "nats")]
#[tokio::test]
async fn the_jetstream_adapter_conforms() {
    let mut nats = Nats::new().await;
    conformance(&mut nats).await;
    nats.consumer.take().unwrap().stop().await;
    nats.nats.cleanup().await;
}
