//! An AMQP service and a JetStream service on one database: each forwards
//! through the shared outbox to its own broker. The brokers hold traps that
//! the other relay would fill if it took a row that is not its own: a
//! RabbitMQ queue named like the JetStream forward stream, and a JetStream
//! stream on the subject of the AMQP forward queue. Both services are
//! SIGKILLed and restarted while they drain.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use idempo::nats::async_nats::jetstream;
use support::example::{signal, spawn_example};
use support::nats::{Nats, stream_name};
use support::{Broker, Db, eventually, payment_body, unique};

const N: usize = 600;
const WAIT: Duration = Duration::from_secs(180);

/// The id the example gives the forward of payment `id`.
fn forward_id(id: &str) -> String {
    crate::support::derived_id(id, "forward")
}

/// Every `Nats-Msg-Id` the stream holds, one per message.
async fn stream_ids(nats: &Nats, stream: &str) -> Vec<String> {
    let stream = nats.js.get_stream(stream).await.expect("the stream");
    let last = stream.cached_info().state.last_sequence;
    let mut ids = Vec::new();
    for sequence in 1..=last {
        if let Ok(message) = stream.get_raw_message(sequence).await {
            let id = message
                .headers
                .get("Nats-Msg-Id")
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default();
            ids.push(id);
        }
    }
    ids
}

async fn stream_messages(nats: &Nats, stream: &str) -> u64 {
    let mut stream = nats.js.get_stream(stream).await.expect("the stream");
    stream.info().await.expect("stream info").state.messages
}

#[tokio::test]
async fn an_amqp_and_a_nats_service_on_one_database_forward_only_to_their_own_broker() {
    support::init_tracing();
    // Built before any queue waits idle.
    support::payments_example_binary();
    let db = Db::new().await;
    let broker = Broker::connect().await;
    let mut nats = Nats::connect().await;
    let (a, n) = (unique("mix_a"), stream_name("mix_n"));
    let (a_f, n_f) = (format!("{a}_f"), format!("{n}_f"));
    broker.track(&a);
    broker.track(&a_f);
    nats.track(&n);
    nats.track(&n_f);
    // The traps: where the other relay would put a row it must not take.
    broker.declare(&n_f).await;
    let trap = format!("{n}_trap");
    nats.js
        .create_stream(jetstream::stream::Config {
            name: trap.clone(),
            subjects: vec![a_f.clone()],
            ..Default::default()
        })
        .await
        .expect("the trap stream on the AMQP forward's subject");
    nats.track(&trap);

    let url = support::nats::nats_url();
    let amqp_env = [("PAYMENTS_FORWARD_TO", a_f.as_str())];
    let nats_env = [
        ("PAYMENTS_TRANSPORT", "nats"),
        ("NATS_URL", url.as_str()),
        ("PAYMENTS_FORWARD_TO", n_f.as_str()),
    ];
    let mut amqp = spawn_example(&db.url, &a, &amqp_env);
    let mut jet = spawn_example(&db.url, &n, &nats_env);
    eventually("the AMQP service declared its queue", WAIT, || async {
        broker.exists(&a).await
    })
    .await;
    nats.wait_for_stream(&n).await;

    let a_ids: Vec<String> = (0..N).map(|i| format!("a-pay-{i}")).collect();
    let n_ids: Vec<String> = (0..N).map(|i| format!("n-pay-{i}")).collect();
    let messages: Vec<(String, Vec<u8>)> = a_ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.clone(), payment_body(&format!("a-{}", i % 5), 1)))
        .collect();
    broker.publish_many(&a, &messages).await;
    for (i, id) in n_ids.iter().enumerate() {
        let body = payment_body(&format!("n-{}", i % 5), 1);
        nats.publish(&n, Some(id), &[], &body).await;
    }

    // Both services killed three times while they drain, and started again.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(800)).await;
        signal(&amqp, "-KILL");
        signal(&jet, "-KILL");
        amqp = spawn_example(&db.url, &a, &amqp_env);
        jet = spawn_example(&db.url, &n, &nats_env);
    }
    eventually(&format!("{} payments applied", 2 * N), WAIT, || async {
        db.payments().await as usize >= 2 * N
    })
    .await;
    eventually("nothing pending in the outbox", WAIT, || async {
        db.count("SELECT count(*) FROM outbox WHERE state = 'pending'")
            .await
            == 0
    })
    .await;
    eventually(&format!("{N} forwards in {n_f}"), WAIT, || async {
        stream_messages(&nats, &n_f).await as usize >= N
    })
    .await;
    // The AMQP relay's last confirms: give them a moment to land.
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop((amqp, jet));

    assert_eq!(
        db.payments().await as usize,
        2 * N,
        "each payment applied once"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE state = 'failed'")
            .await,
        0,
        "no forward failed (a relay refused by the other broker fails its rows)"
    );
    // Each forward at its own broker, once per id.
    let at_rabbit: Vec<String> = broker
        .drain(&a_f)
        .await
        .into_iter()
        .map(|m| m.message_id.unwrap_or_default())
        .collect();
    let expected_a: BTreeSet<String> = a_ids.iter().map(|id| forward_id(id)).collect();
    let got_a: BTreeSet<String> = at_rabbit.iter().cloned().collect();
    assert_eq!(got_a, expected_a, "every AMQP forward reached RabbitMQ");
    // A SIGKILL between the broker's confirm and the row's delete publishes
    // that row again with the same id: the downstream claim deduplicates it.
    println!(
        "RabbitMQ forwards: {} copies of {} ids",
        at_rabbit.len(),
        got_a.len()
    );
    let at_jetstream = stream_ids(&nats, &n_f).await;
    let expected_n: BTreeSet<String> = n_ids.iter().map(|id| forward_id(id)).collect();
    let got_n: BTreeSet<String> = at_jetstream.iter().cloned().collect();
    assert_eq!(
        got_n, expected_n,
        "every JetStream forward reached JetStream"
    );
    assert_eq!(
        at_jetstream.len(),
        N,
        "JetStream's duplicate window keeps one copy of each forward"
    );
    // Nothing reached the other broker.
    assert_eq!(
        broker.ready(&n_f).await,
        0,
        "a JetStream forward was published to RabbitMQ"
    );
    assert_eq!(
        stream_messages(&nats, &trap).await,
        0,
        "an AMQP forward was published to JetStream"
    );
    nats.cleanup().await;
}

/// Which transport each staged message's row names: the default outside a
/// consumer, the one a message names, and never one packed row for two.
#[tokio::test]
async fn each_staged_message_is_written_for_its_own_transport() {
    use idempo::outbox::{self, OutboxError, OutboxMessage};

    let db = Db::new().await;
    let mut tx = db.pool.begin().await.unwrap();
    let messages = [
        OutboxMessage::new("", "to-rabbit", b"1".to_vec()).message_id("m-1"),
        OutboxMessage::new("", "to-jet", b"2".to_vec())
            .message_id("m-2")
            .transport("nats"),
        OutboxMessage::new("", "to-jet", b"3".to_vec())
            .message_id("m-3")
            .transport("nats"),
    ];
    outbox::stage_all(&mut *tx, messages).await.unwrap();
    // Two messages of one transport, unkeyed: packed in one row.
    let both_nats = [
        OutboxMessage::new("", "to-jet", b"4".to_vec())
            .message_id("m-4")
            .transport("nats"),
        OutboxMessage::new("", "to-jet", b"5".to_vec())
            .message_id("m-5")
            .transport("nats"),
    ];
    outbox::stage_all(&mut *tx, both_nats).await.unwrap();
    tx.commit().await.unwrap();
    let rows: Vec<(String, String, i32)> =
        sqlx::query_as("SELECT message_id, transport, messages FROM outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let rows: Vec<(&str, &str, i32)> = rows
        .iter()
        .map(|(id, t, n)| (id.as_str(), t.as_str(), *n))
        .collect();
    assert_eq!(
        rows,
        [
            ("m-1", "amqp", 1),
            ("m-2", "nats", 1),
            ("m-3", "nats", 1),
            ("m-4", "nats", 2)
        ],
        "a row per message when transports differ; one packed row for one transport"
    );
    let refused = outbox::stage(
        &mut db.pool.acquire().await.unwrap(),
        OutboxMessage::new("", "q", b"x".to_vec()).transport("Rabbit MQ"),
    )
    .await;
    assert!(
        matches!(
            refused,
            Err(OutboxError::InvalidField {
                field: "transport",
                ..
            })
        ),
        "{refused:?}"
    );
}
