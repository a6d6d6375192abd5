//! The kit's JetStream adapter: a real consumer on the machine's NATS server.

use super::*;

/// The JetStream adapter: a real consumer on the machine's NATS server.
pub(crate) struct Nats {
    db: Db,
    pub(crate) nats: support::nats::Nats,
    stream: String,
    pub(crate) consumer: Option<support::nats::Running>,
    attempts: Attempts,
    published: u64,
}

impl Nats {
    pub(crate) async fn new() -> Nats {
        support::init_tracing();
        let db = Db::new().await;
        let mut nats = support::nats::Nats::connect().await;
        let stream = support::nats::stream_name("kit");
        nats.track(&stream);
        let attempts = Attempts::default();
        let consumer = idempo::nats::Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(&stream)
            // The kit's id in a header: its lost-ack copy is a second
            // publish, which JetStream would drop under the same Nats-Msg-Id.
            .message_id(idempo::consumer::MessageIdSource::Header("kit-id".into()))
            .redelivery(RedeliveryPolicy::delayed([DELAY]).max_attempts(3))
            .handler(kit_handler(attempts.clone()))
            .build()
            .expect("valid configuration");
        let consumer = Some(support::nats::Running::start(consumer));
        let t = Nats {
            db,
            nats,
            stream,
            consumer,
            attempts,
            published: 0,
        };
        t.nats.wait_for_stream(&t.stream).await;
        t
    }

    async fn publish(&mut self, (id, kit): &(String, KitPayment)) {
        let body = serde_json::to_vec(kit).unwrap();
        self.nats
            .publish(&self.stream, None, &[("kit-id", id.as_str())], &body)
            .await;
        self.published += 1;
    }

    async fn settled(&self) {
        self.consumer
            .as_ref()
            .unwrap()
            .settled(self.published)
            .await;
    }

    fn stats(&self) -> idempo::consumer::StatsSnapshot {
        self.consumer.as_ref().unwrap().stats.snapshot()
    }
}

impl Transport for Nats {
    fn name(&self) -> &'static str {
        "nats"
    }

    fn features(&self) -> Features {
        // Reconnects are tested on a server of the test's own
        // (nats_faults.rs); JetStream has no message groups.
        Features {
            reconnect: false,
            ordered_groups: false,
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
        let mut ended = Vec::with_capacity(messages.len());
        for (id, _) in messages {
            let letter: Option<String> = sqlx::query_scalar(
                "SELECT reason FROM dead_letters WHERE queue = $1 AND message_id = $2",
            )
            .bind(&self.stream)
            .bind(id)
            .fetch_optional(&self.db.pool)
            .await
            .unwrap();
            ended.push(match letter {
                Some(reason) => Ended::DeadLettered { reason },
                None if self.db.payments_for(id).await > 0 => Ended::Applied,
                None => Ended::DeadLettered {
                    reason: "not applied".into(),
                },
            });
        }
        ended
    }

    async fn deliver_again(&mut self, message: &(String, KitPayment)) -> Ended {
        self.deliver(std::slice::from_ref(message)).await;
        let before = self.stats().duplicates;
        self.publish(message).await;
        self.settled().await;
        if self.stats().duplicates == before + 1 {
            Ended::Duplicate
        } else {
            Ended::Applied
        }
    }

    async fn cut(&mut self) {
        unreachable!("not a feature of this kit's NATS transport");
    }

    async fn applied(&self, id: &str) -> i64 {
        self.db.payments_for(id).await
    }
}
