//! The machine's NATS server with JetStream, for the JetStream transport's
//! tests: a client that publishes with confirmation, and fresh stream
//! names. A test that cannot reach it fails with the command that starts it.

use std::time::Duration;

use idempo::nats::async_nats;
use idempo::nats::async_nats::jetstream::{self, Context};

pub const START_NATS: &str = "start it with `start-stop-daemon --start --oknodo --background \
     --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server \
     -l /var/log/nats-server.log` (or `docker compose up -d nats`), or point NATS_URL at a \
     server with JetStream";

pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A JetStream client; deletes the streams it was told about when asked.
pub struct Nats {
    pub client: async_nats::Client,
    pub js: Context,
    streams: Vec<String>,
}

impl Nats {
    pub async fn connect() -> Nats {
        Nats::connect_to(&nats_url()).await
    }

    pub async fn connect_to(url: &str) -> Nats {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .connect(url)
            .await
            .unwrap_or_else(|e| panic!("NATS is not reachable at {url}: {e}; {START_NATS}"));
        let js = jetstream::new(client.clone());
        Nats {
            client,
            js,
            streams: Vec::new(),
        }
    }

    /// Remembers `stream` for [`cleanup`](Self::cleanup).
    pub fn track(&mut self, stream: &str) {
        self.streams.push(stream.to_owned());
    }

    /// Publishes and waits for JetStream's PubAck; `true` when JetStream
    /// took it as a duplicate of an earlier `Nats-Msg-Id`.
    pub async fn publish(
        &self,
        subject: &str,
        msg_id: Option<&str>,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> bool {
        let mut map = async_nats::HeaderMap::new();
        if let Some(id) = msg_id {
            map.insert("Nats-Msg-Id", id);
        }
        for (name, value) in headers {
            map.insert(*name, *value);
        }
        let ack = self
            .js
            .publish_with_headers(subject.to_owned(), map, body.to_vec().into())
            .await
            .expect("publish")
            .await
            .expect("PubAck");
        ack.duplicate
    }

    /// Messages the durable consumer has not acknowledged yet (pending and
    /// in flight).
    pub async fn unacknowledged(&self, stream: &str, consumer: &str) -> u64 {
        let mut stream = self.js.get_stream(stream).await.expect("stream");
        let consumer: jetstream::consumer::PullConsumer =
            stream.get_consumer(consumer).await.expect("consumer");
        let mut consumer = consumer;
        let info = consumer.info().await.expect("consumer info");
        let _ = stream.info().await;
        info.num_pending + info.num_ack_pending as u64
    }

    pub async fn cleanup(&self) {
        for stream in &self.streams {
            let _ = self.js.delete_stream(stream).await;
        }
    }
}

/// A stream (and subject) name no other test uses.
pub fn stream_name(what: &str) -> String {
    super::unique(what).replace(['.', ' '], "_")
}
