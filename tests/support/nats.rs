//! The machine's NATS server with JetStream, for the JetStream transport's
//! tests: a client that publishes with confirmation, and fresh stream
//! names. A test that cannot reach it fails with the command that starts it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempo::Tx;
use idempo::consumer::{HandlerError, Message};
use idempo::nats::Consumer;
use tokio::task::JoinHandle;

use super::{eventually, payments};

pub const WAIT: Duration = Duration::from_secs(30);

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
            .connect(url.split(',').collect::<Vec<_>>())
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

    /// Waits until `stream` exists (a consumer creates it at start).
    pub async fn wait_for_stream(&self, stream: &str) {
        eventually(&format!("the stream {stream} exists"), WAIT, || async {
            self.js.get_stream(stream).await.is_ok()
        })
        .await;
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

/// A consumer running in the background.
pub struct Running {
    pub shutdown: idempo::consumer::ShutdownHandle,
    pub stats: idempo::consumer::Stats,
    pub health: idempo::consumer::Health,
    pub task: JoinHandle<idempo::Result<()>>,
}

impl Running {
    pub fn start(consumer: Consumer) -> Running {
        Running {
            shutdown: consumer.shutdown_handle(),
            stats: consumer.stats(),
            health: consumer.health(),
            task: tokio::spawn(consumer.run()),
        }
    }

    pub async fn settled(&self, n: u64) {
        eventually(&format!("{n} deliveries settled"), WAIT, || async {
            let s = self.stats.snapshot();
            s.processed + s.duplicates + s.dead_lettered >= n
        })
        .await;
    }

    pub async fn stop(self) {
        self.shutdown.shutdown();
        self.task
            .await
            .expect("consumer task")
            .expect("a graceful stop");
    }
}

/// The payments example's handler, recording when each id's attempts ran.
pub fn recording(
    attempts: Arc<Mutex<HashMap<String, Vec<Instant>>>>,
    fail_first: bool,
) -> impl Fn(Tx, Message) -> futures::future::BoxFuture<'static, Result<(), HandlerError>>
+ Clone
+ Send
+ Sync
+ 'static {
    move |tx: Tx, message: Message| {
        let attempts = attempts.clone();
        Box::pin(async move {
            let payment: payments::Payment = message.json()?;
            let n = {
                let mut seen = attempts.lock().unwrap();
                let list = seen.entry(message.id().to_owned()).or_default();
                list.push(Instant::now());
                list.len()
            };
            if fail_first && n == 1 {
                return Err(HandlerError::transient("downstream unavailable"));
            }
            payments::apply(tx, message.id(), &payment, 0.0).await?;
            Ok(())
        })
    }
}

pub struct OwnServer {
    pub port: u16,
    store: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl OwnServer {
    pub fn start() -> OwnServer {
        let store = std::env::temp_dir().join(super::unique("nats-store"));
        let mut server = OwnServer {
            port: super::free_port(),
            store,
            child: None,
        };
        server.restart();
        server
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn restart(&mut self) {
        self.child = Some(
            std::process::Command::new("nats-server")
                .args([
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-js",
                    "-sd",
                ])
                .arg(&self.store)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("nats-server (apt-get install nats-server)"),
        );
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}
