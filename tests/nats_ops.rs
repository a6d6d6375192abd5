//! The operator's tools on a JetStream consumer, on the machine's NATS
//! server: `idempo status` and the dashboard show its stream as a JetStream
//! stream, with the pending and unacked counts JetStream gives, and its
//! outbox relay as running while it publishes.

mod support;

use std::sync::Arc;

use futures::StreamExt;
use idempo::nats::Consumer;
use idempo::nats::async_nats::jetstream::consumer::PullConsumer;
use support::nats::{Nats, Running, WAIT, recording, stream_name};
use support::{Db, eventually, payment_body};

#[tokio::test]
async fn idempo_status_shows_a_jetstream_consumer_with_what_its_stream_holds() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("status");
    nats.track(&stream);
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&stream)
        .handler(recording(Arc::default(), false))
        .build()
        .unwrap();
    let running = Running::start(consumer);
    nats.wait_for_stream(&stream).await;
    // Stopped, it leaves its heartbeat (transport nats) and its durable
    // consumer: what is published now waits in the stream.
    running.stop().await;
    for i in 0..7 {
        nats.publish(
            &stream,
            Some(&format!("wait-{i}")),
            &[],
            &payment_body("gus", 1),
        )
        .await;
    }
    // Three of them taken by a client that does not acknowledge (yet).
    let durable: PullConsumer = nats
        .js
        .get_stream(&stream)
        .await
        .unwrap()
        .get_consumer(&stream)
        .await
        .unwrap();
    let held: Vec<_> = durable
        .fetch()
        .max_messages(3)
        .messages()
        .await
        .unwrap()
        .collect()
        .await;
    assert_eq!(held.len(), 3);
    let out = support::cli::run(&db, &["--json", "status"]);
    assert!(out.status.success());
    let status = support::cli::json_lines(&out);
    let queues = status[0]["queues"].as_array().expect("queues");
    let ours = queues
        .iter()
        .find(|q| q["queue"] == stream.as_str())
        .unwrap_or_else(|| panic!("the stream is listed: {}", status[0]));
    assert_eq!(ours["transport"], "nats", "{ours}");
    assert_eq!(ours["ready"], 4, "the stream's pending messages: {ours}");
    assert_eq!(ours["unacked"], 3, "delivered, not acknowledged: {ours}");
    assert_eq!(ours["exists"], true);
    let text = support::cli::run(&db, &["status"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&format!("{stream} (nats stream)")),
        "labelled as a stream: {text}"
    );
    assert_eq!(db.payments().await, 0);
    nats.cleanup().await;
}

/// Issue 51 (8): a JetStream consumer forwarding through the outbox shows
/// its relay as running, in `idempo status` and on the dashboard, with its
/// stream labelled and its unacked count from JetStream.
#[tokio::test]
async fn a_jetstream_relay_at_work_is_shown_running_with_its_stream_labelled() {
    use support::example::spawn_example;

    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let (from, to) = (stream_name("ops_from"), stream_name("ops_to"));
    nats.track(&from);
    nats.track(&to);
    let url = support::nats::nats_url();
    let _example = spawn_example(
        &db.url,
        &from,
        &[
            ("PAYMENTS_TRANSPORT", "nats"),
            ("NATS_URL", url.as_str()),
            ("PAYMENTS_FORWARD_TO", to.as_str()),
        ],
    );
    nats.wait_for_stream(&from).await;
    for i in 0..5 {
        nats.publish(
            &from,
            Some(&format!("ops-{i}")),
            &[],
            &payment_body("ida", 1),
        )
        .await;
    }
    eventually("5 forwards in the target stream", WAIT, || async {
        match nats.js.get_stream(&to).await {
            Ok(mut s) => s.info().await.is_ok_and(|i| i.state.messages == 5),
            Err(_) => false,
        }
    })
    .await;
    let relay_of_ours = |status: &serde_json::Value| {
        status["instances"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|i| i["queue"] == from.as_str())
            .map(|i| i["relay"].clone())
    };
    eventually("the relay running in `idempo status`", WAIT, || async {
        let out = support::cli::run(&db, &["--json", "status"]);
        let status = support::cli::json_lines(&out);
        relay_of_ours(&status[0]) == Some(serde_json::json!("running"))
    })
    .await;

    let board = support::cli::dashboard(&db, &["--sample-every", "300ms"]);
    eventually(
        "the dashboard shows the relay and the stream",
        WAIT,
        || async {
            let page = reqwest::get(format!("{}/", board.url))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            page.contains(&format!("{from} (nats stream)"))
                && !page.contains("none running")
                && page.contains("running")
                && page.contains("unacked of a JetStream stream")
        },
    )
    .await;
    nats.cleanup().await;
}
