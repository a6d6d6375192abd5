//! The JetStream transport at start, on the machine's NATS server: what
//! would lose or mis-file messages is refused with what to do (names NATS
//! refuses, streams and durables that conflict, limits that discard, a new
//! durable that would replay what the claims forgot, a server without
//! JetStream).

mod support;

use std::sync::Arc;
use std::time::Duration;

use idempo::nats::{Consumer, NatsError};
use support::nats::{Nats, Running, WAIT, recording, stream_name};
use support::{Db, eventually, payment_body};

fn nats_error(e: &idempo::Error) -> &NatsError {
    e.downcast_ref::<NatsError>()
        .unwrap_or_else(|| panic!("not a NatsError: {e}"))
}

#[tokio::test]
async fn what_nats_would_refuse_or_lose_is_refused_at_start() {
    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let handler = recording(Arc::default(), false);
    // A name NATS refuses.
    let e = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream("pay ments")
        .handler(handler.clone())
        .build()
        .unwrap_err();
    assert!(
        matches!(
            nats_error(&e),
            NatsError::InvalidName { what: "stream", .. }
        ),
        "{e}"
    );
    let e = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream("payments")
        .subject("orders..paid")
        .handler(handler.clone())
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("empty token"), "{e}");

    // A stream whose subjects do not take the consumed subject.
    let stream = stream_name("other");
    nats.track(&stream);
    nats.js
        .create_stream(idempo::nats::async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{stream}.orders")],
            ..Default::default()
        })
        .await
        .unwrap();
    let run = |stream: String, subject: String| {
        let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(stream)
            .subject(subject)
            .handler(handler.clone())
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, consumer.run())
    };
    let e = run(stream.clone(), format!("{stream}.payments"))
        .await
        .expect("an error at start, not a wait")
        .unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::StreamConflict { .. }),
        "{e}"
    );
    // A durable consumer with a MaxDeliver that would drop messages.
    nats.js
        .get_stream(&stream)
        .await
        .unwrap()
        .create_consumer(
            idempo::nats::async_nats::jetstream::consumer::pull::Config {
                durable_name: Some(stream.clone()),
                max_deliver: 3,
                filter_subject: format!("{stream}.orders"),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let e = run(stream.clone(), format!("{stream}.orders"))
        .await
        .expect("an error at start")
        .unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::ConsumerConflict { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("MaxDeliver"), "{e}");
    // A missing stream when this consumer may not create it.
    let missing = stream_name("missing");
    let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
        .stream(&missing)
        .create_stream(false)
        .handler(handler.clone())
        .build()
        .unwrap();
    let e = consumer.run().await.unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
    assert!(
        nats.js.get_stream(&missing).await.is_err(),
        "nothing created"
    );
    nats.cleanup().await;
}

/// Issue 51 (4): topologies that lose or mis-file messages are refused at
/// start, with what to do.
#[tokio::test]
async fn a_topology_that_loses_or_misfiles_messages_is_refused_at_start() {
    use idempo::nats::async_nats::jetstream::consumer::{DeliverPolicy, pull};
    use idempo::nats::async_nats::jetstream::stream;

    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let handler = recording(Arc::default(), false);
    let start = |stream: &str| {
        let consumer = Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(stream)
            .handler(handler.clone())
            .build()
            .unwrap();
        tokio::time::timeout(WAIT, consumer.run())
    };
    let new_stream = |name: &str| stream::Config {
        name: name.to_owned(),
        subjects: vec![name.to_owned()],
        ..Default::default()
    };

    // A stream that deletes the oldest messages past 100, acknowledged or not.
    let limited = stream_name("limited");
    nats.track(&limited);
    nats.js
        .create_stream(stream::Config {
            max_messages: 100,
            ..new_stream(&limited)
        })
        .await
        .unwrap();
    let e = start(&limited)
        .await
        .expect("an error at start")
        .unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::StreamConflict { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("max_msgs limit (100)"), "{e}");
    // The same limit refusing publishes when full loses nothing: accepted.
    let refusing = stream_name("refusing");
    nats.track(&refusing);
    nats.js
        .create_stream(stream::Config {
            max_messages: 100,
            discard: stream::DiscardPolicy::New,
            ..new_stream(&refusing)
        })
        .await
        .unwrap();
    nats.publish(&refusing, Some("r-1"), &[], &payment_body("ann", 1))
        .await;
    let running = Running::start(
        Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(&refusing)
            .handler(handler.clone())
            .build()
            .unwrap(),
    );
    running.settled(1).await;
    running.stop().await;

    // A durable that waits less than the consumer before redelivering.
    let hasty = stream_name("hasty");
    nats.track(&hasty);
    let created = nats.js.create_stream(new_stream(&hasty)).await.unwrap();
    created
        .create_consumer(pull::Config {
            durable_name: Some(hasty.clone()),
            ack_wait: Duration::from_secs(2),
            ..Default::default()
        })
        .await
        .unwrap();
    let e = start(&hasty).await.expect("an error at start").unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::ConsumerConflict { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("ack wait (2s)"), "{e}");

    // A durable that skips what the stream held when it was created.
    let late = stream_name("late");
    nats.track(&late);
    let created = nats.js.create_stream(new_stream(&late)).await.unwrap();
    nats.publish(&late, Some("l-1"), &[], &payment_body("bo", 1))
        .await;
    created
        .create_consumer(pull::Config {
            durable_name: Some(late.clone()),
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await
        .unwrap();
    let e = start(&late).await.expect("an error at start").unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::ConsumerConflict { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("deliver policy New"), "{e}");
    assert_eq!(db.payments().await, 1, "only the accepted stream's payment");
    nats.cleanup().await;
}

/// Issue 51 (3): a durable set up anew would send the whole stream again;
/// messages older than the claims kept would run twice. Refused, with what
/// to do; a durable the operator creates is then used.
#[tokio::test]
async fn a_new_durable_is_refused_while_the_stream_holds_messages_older_than_the_claims() {
    use idempo::nats::async_nats::jetstream::consumer::pull;

    support::init_tracing();
    let db = Db::new().await;
    let mut nats = Nats::connect().await;
    let stream = stream_name("horizon");
    nats.track(&stream);
    let created = nats
        .js
        .create_stream(idempo::nats::async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![stream.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    for i in 0..3 {
        nats.publish(
            &stream,
            Some(&format!("h-{i}")),
            &[],
            &payment_body("al", 1),
        )
        .await;
    }
    // Claims kept one second: the stream's messages are older after two.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let handler = recording(Arc::default(), false);
    let build = || {
        Consumer::builder(support::nats::nats_url(), db.pool.clone())
            .stream(&stream)
            .retention(Duration::from_secs(1))
            .handler(handler.clone())
            .build()
            .unwrap()
    };
    let e = tokio::time::timeout(WAIT, build().run())
        .await
        .expect("an error at start")
        .unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::ConsumerConflict { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("older than the claims kept"), "{e}");
    assert!(e.to_string().contains("--deliver all"), "{e}");
    assert_eq!(db.payments().await, 0, "nothing applied");
    // The operator decides they were never processed.
    created
        .create_consumer(pull::Config {
            durable_name: Some(stream.clone()),
            ack_policy: idempo::nats::async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    let running = Running::start(build());
    running.settled(3).await;
    assert_eq!(db.payments().await, 3);
    running.stop().await;
    nats.cleanup().await;
}

#[tokio::test]
async fn a_server_without_jetstream_is_refused_at_start() {
    support::init_tracing();
    let db = Db::new().await;
    let port = support::free_port();
    let mut server = std::process::Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("nats-server (apt-get install nats-server)");
    let _kill = support::KillOnDrop(&mut server);
    let url = format!("nats://127.0.0.1:{port}");
    eventually("the server listens", WAIT, || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let consumer = Consumer::builder(url, db.pool.clone())
        .stream("payments")
        .handler(recording(Arc::default(), false))
        .build()
        .unwrap();
    let e = tokio::time::timeout(WAIT, consumer.run())
        .await
        .expect("an error at start, not a wait")
        .unwrap_err();
    assert!(
        matches!(nats_error(&e), NatsError::NoJetStream { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("-js"), "the error says how: {e}");
}
