//! The transport conformance kit (`idempo::testing::conformance::Report::transport`)
//! run against idempo's own transports: RabbitMQ on the real broker,
//! JetStream on the real NATS server (feature `nats`), and the in-memory
//! broker of `idempo::testing`. Each one implements only how the kit starts
//! a consumer on it, publishes to it, cuts it and reads what its relay
//! published; the checks are the kit's.

mod support;

use std::collections::HashMap;
use std::sync::Mutex;

use idempo::consumer::ConsumerBuilder;
use idempo::testing::conformance::{self, TransportUnderTest};
use idempo::testing::{Memory, MemoryBroker};
use support::{Broker, Db};

/// RabbitMQ: queues declared by the consumer, a cut is its connection
/// closed by `rabbitmqctl`.
struct Rabbit {
    broker: Broker,
    /// What was taken from each destination so far (reading takes it).
    received: Mutex<HashMap<String, Vec<String>>>,
}

impl TransportUnderTest for Rabbit {
    type Transport = idempo::amqp::Amqp;

    fn consumer(&self, source: &str, pool: sqlx::PgPool) -> ConsumerBuilder<idempo::amqp::Amqp> {
        self.broker.track(source);
        idempo::amqp::Consumer::builder(support::amqp_url(), pool)
            .queue(source)
            .connection_name(source)
    }

    async fn publish(
        &self,
        source: &str,
        id: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), String> {
        let mut table = idempo::amqp::lapin::types::FieldTable::default();
        for (name, value) in headers {
            table.insert(
                (*name).into(),
                idempo::amqp::lapin::types::AMQPValue::LongString((*value).into()),
            );
        }
        let properties = idempo::amqp::lapin::BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(table);
        self.broker.publish_props(source, properties, body).await;
        Ok(())
    }

    async fn cut(&self, source: &str) -> bool {
        support::close_connections_named(source) > 0
    }

    fn forward_to(
        &self,
        consumer: ConsumerBuilder<idempo::amqp::Amqp>,
        destination: &str,
    ) -> Option<ConsumerBuilder<idempo::amqp::Amqp>> {
        self.broker.track(destination);
        Some(consumer.declare_like_own(destination))
    }

    async fn received(&self, destination: &str) -> Result<Vec<String>, String> {
        let taken = self.broker.drain(destination).await;
        let mut received = self.received.lock().unwrap();
        let all = received.entry(destination.to_owned()).or_default();
        all.extend(taken.into_iter().filter_map(|m| m.message_id));
        Ok(all.clone())
    }
}

/// `idempo::testing`'s in-memory broker.
struct InMemory {
    broker: MemoryBroker,
}

impl TransportUnderTest for InMemory {
    type Transport = Memory;

    fn consumer(&self, source: &str, pool: sqlx::PgPool) -> ConsumerBuilder<Memory> {
        self.broker.consumer(source, pool)
    }

    async fn publish(
        &self,
        source: &str,
        id: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), String> {
        self.broker.publish(source, id, body, headers);
        Ok(())
    }

    async fn cut(&self, source: &str) -> bool {
        self.broker.cut(source);
        true
    }
}

#[tokio::test]
async fn the_amqp_transport_conforms() {
    support::init_tracing();
    let db = Db::new().await;
    let rabbit = Rabbit {
        broker: Broker::connect().await,
        received: Mutex::default(),
    };
    let report = conformance::Report::transport(&rabbit, &db.pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(report.skipped.is_empty(), "{report}");
    println!("amqp: {report}");
}

#[tokio::test]
async fn the_in_memory_transport_conforms() {
    let db = Db::new().await;
    let memory = InMemory {
        broker: MemoryBroker::new(),
    };
    let report = conformance::Report::transport(&memory, &db.pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The in-memory transport has no outbox relay: the harness drains the
    // outbox itself (Harness::drain).
    assert_eq!(
        report.skipped,
        ["the_outbox_forwards_with_a_stable_id"],
        "{report}"
    );
    println!("memory: {report}");
}

#[cfg(feature = "nats")]
mod jetstream {
    use super::*;
    use support::nats::{Nats, OwnServer};

    /// JetStream on a server of the test's own, so that a cut is the
    /// server stopped and started again (its store kept); streams created
    /// by the consumer; the kit's id in a header, since a second publish
    /// under one `Nats-Msg-Id` is dropped by JetStream itself (the kit's
    /// redelivery check needs it delivered).
    struct JetStream {
        server: Mutex<OwnServer>,
        url: String,
        js: idempo::nats::async_nats::jetstream::Context,
    }

    impl TransportUnderTest for JetStream {
        type Transport = idempo::nats::Nats;

        fn consumer(
            &self,
            source: &str,
            pool: sqlx::PgPool,
        ) -> ConsumerBuilder<idempo::nats::Nats> {
            idempo::nats::Consumer::builder(self.url.clone(), pool)
                .stream(source)
                .message_id(idempo::consumer::MessageIdSource::Header("kit-id".into()))
        }

        async fn publish(
            &self,
            source: &str,
            id: &str,
            extra: &[(&str, &str)],
            body: &[u8],
        ) -> Result<(), String> {
            let mut headers = idempo::nats::async_nats::HeaderMap::new();
            headers.insert("kit-id", id);
            for (name, value) in extra {
                headers.insert(*name, *value);
            }
            self.js
                .publish_with_headers(source.to_owned(), headers, body.to_vec().into())
                .await
                .map_err(|e| e.to_string())?
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }

        async fn cut(&self, _source: &str) -> bool {
            let mut server = self.server.lock().unwrap();
            server.kill();
            server.restart();
            true
        }

        fn forward_to(
            &self,
            consumer: ConsumerBuilder<idempo::nats::Nats>,
            destination: &str,
        ) -> Option<ConsumerBuilder<idempo::nats::Nats>> {
            Some(consumer.relay_stream(destination))
        }

        async fn received(&self, destination: &str) -> Result<Vec<String>, String> {
            let Ok(stream) = self.js.get_stream(destination).await else {
                return Ok(Vec::new());
            };
            let last = stream.cached_info().state.last_sequence;
            let mut ids = Vec::new();
            for sequence in 1..=last {
                if let Ok(message) = stream.get_raw_message(sequence).await
                    && let Some(id) = message.headers.get("Nats-Msg-Id")
                {
                    ids.push(id.as_str().to_owned());
                }
            }
            Ok(ids)
        }
    }

    #[tokio::test]
    async fn the_jetstream_transport_conforms() {
        support::init_tracing();
        let db = Db::new().await;
        let server = OwnServer::start();
        let url = server.url();
        support::eventually("the server listens", support::nats::WAIT, || async {
            tokio::net::TcpStream::connect(("127.0.0.1", server.port))
                .await
                .is_ok()
        })
        .await;
        let nats = Nats::connect_to(&url).await;
        let jetstream = JetStream {
            server: Mutex::new(server),
            url,
            js: nats.js.clone(),
        };
        let report = conformance::Report::transport(&jetstream, &db.pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(report.skipped.is_empty(), "{report}");
        println!("nats: {report}");
    }
}
