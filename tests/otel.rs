//! OpenTelemetry end to end (feature `otel`): two chained `payments`
//! examples export to a real OTLP/HTTP receiver of the test's own, and
//! their spans follow each payment from its producer's `traceparent`
//! through the first consumer, the relay's send and the second consumer,
//! by the messaging conventions; failures carry their error type; retries
//! keep their producer's link; metrics arrive. A collector that answers
//! slowly costs no payment and no throughput.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use support::example::{doubled_payments, signal, spawn_example, wait_exit};
use support::otlp::{Received, Receiver};
use support::{Broker, Db, eventually, payment_body, payments, unique};

const CONSUMER: i32 = 5;
const PRODUCER: i32 = 4;
const ERROR: i32 = 2;

async fn example_db() -> Db {
    let db = Db::with_pool_size(2).await;
    idempo::migrate(&db.pool).await.unwrap();
    payments::create_tables(&db.pool).await.unwrap();
    db
}

/// A producer's span context: 32 and 16 hex digits.
fn producer(i: usize) -> (String, String) {
    (
        format!("{:032x}", 0xabc0_0000 + i),
        format!("{:016x}", 0xfe00 + i),
    )
}

fn traceparent((trace, span): &(String, String)) -> String {
    format!("00-{trace}-{span}-01")
}

async fn publish_traced(broker: &Broker, queue: &str, id: &str, body: &[u8], tp: &str) {
    let mut headers = FieldTable::default();
    headers.insert("traceparent".into(), AMQPValue::LongString(tp.into()));
    let properties = BasicProperties::default()
        .with_message_id(id.into())
        .with_headers(headers);
    broker.publish_props(queue, properties, body).await;
}

fn otel_env<'a>(receiver: &'a Receiver, service: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.as_str()),
        ("OTEL_SERVICE_NAME", service),
        ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "500"),
    ]
}

fn process_spans<'a>(spans: &'a [Received], service: &str) -> Vec<&'a Received> {
    spans
        .iter()
        .filter(|s| s.service == service && s.span.kind == CONSUMER)
        .collect()
}

#[tokio::test]
async fn a_payment_is_traced_from_its_producer_through_two_chained_consumers() {
    support::payments_example_binary();
    let receiver = Receiver::start(Duration::ZERO).await;
    let (a_db, b_db, broker) = (
        example_db().await,
        example_db().await,
        Broker::connect().await,
    );
    let (a_queue, b_queue) = (unique("otel_a"), unique("otel_b"));
    broker.declare(&a_queue).await;
    broker.track(&b_queue);
    broker.track(&format!("{b_queue}.dlq"));
    broker.track(&format!("{a_queue}.dlq"));

    // Ten payments, each with a producer context of its own, and a poison
    // body with one too.
    let n = 10;
    let mut producers = BTreeMap::new();
    for i in 0..n {
        let id = format!("pay-{i}");
        let context = producer(i);
        let body = payment_body(&format!("acct-{}", i % 3), (i + 1) as i64);
        publish_traced(&broker, &a_queue, &id, &body, &traceparent(&context)).await;
        producers.insert(id, context);
    }
    let poison = producer(99);
    publish_traced(
        &broker,
        &a_queue,
        "poison-1",
        b"{not json",
        &traceparent(&poison),
    )
    .await;

    // A fails half its first attempts (retried after 50 ms) and forwards
    // what it applies to B through its outbox.
    let mut a_env = otel_env(&receiver, "payments-a");
    a_env.extend([
        ("PAYMENTS_FORWARD_TO", b_queue.as_str()),
        ("PAYMENTS_FAIL_RATE", "0.5"),
    ]);
    let a = spawn_example(&a_db.url, &a_queue, &a_env);
    eventually("A declared B's queue", Duration::from_secs(60), || async {
        broker.exists(&b_queue).await
    })
    .await;
    let b = spawn_example(&b_db.url, &b_queue, &otel_env(&receiver, "payments-b"));
    eventually(
        "every payment through both",
        Duration::from_secs(90),
        || async { a_db.claims().await == n as i64 && b_db.claims().await == n as i64 },
    )
    .await;
    // SIGTERM drains, then flushes what the exporters hold.
    signal(&a, "-TERM");
    signal(&b, "-TERM");
    assert!(wait_exit(a).await.success(), "A exits 0 on SIGTERM");
    assert!(wait_exit(b).await.success(), "B exits 0 on SIGTERM");
    assert_eq!(doubled_payments(&b_db).await, 0);

    let spans = receiver.spans();
    let a_spans = process_spans(&spans, "payments-a");
    let b_spans = process_spans(&spans, "payments-b");
    let mut retried = 0;
    for (id, (trace, span_id)) in &producers {
        // A's spans of this payment: one per attempt, the last processed.
        let attempts: Vec<&&Received> = a_spans
            .iter()
            .filter(|s| s.attr("messaging.message.id").as_deref() == Some(id))
            .collect();
        assert!(!attempts.is_empty(), "A traced {id}");
        for attempt in &attempts {
            assert_eq!(attempt.span.name, format!("process {a_queue}"));
            assert_eq!(&attempt.trace_id(), trace, "{id}: the producer's trace");
            assert_eq!(
                &attempt.parent_id(),
                span_id,
                "{id}: the producer is the parent"
            );
            assert!(
                attempt.links().contains(&(trace.clone(), span_id.clone())),
                "{id}: every attempt links to its producer: {:?}",
                attempt.links()
            );
            assert_eq!(
                attempt.attr("messaging.system").as_deref(),
                Some("rabbitmq")
            );
            assert_eq!(
                attempt.attr("messaging.operation.name").as_deref(),
                Some("process")
            );
            assert_eq!(
                attempt.attr("messaging.operation.type").as_deref(),
                Some("process")
            );
            assert_eq!(
                attempt.attr("messaging.consumer.group.name"),
                Some(a_queue.clone())
            );
            assert!(
                attempt
                    .attr("messaging.rabbitmq.message.delivery_tag")
                    .is_some()
            );
            assert!(
                attempt
                    .attr("messaging.rabbitmq.destination.routing_key")
                    .is_some()
            );
            assert!(attempt.attr("messaging.message.body.size").is_some());
            assert_eq!(attempt.attr("idempo.claim").as_deref(), Some("fresh"));
        }
        let done: Vec<_> = attempts
            .iter()
            .filter(|s| s.attr("idempo.settlement").as_deref() == Some("processed"))
            .collect();
        assert_eq!(done.len(), 1, "{id}: processed once");
        let failed: Vec<_> = attempts
            .iter()
            .filter(|s| s.attr("idempo.settlement").as_deref() == Some("retried"))
            .collect();
        for f in &failed {
            assert_eq!(f.status(), ERROR, "{id}: a failed attempt is an error");
            assert_eq!(f.attr("error.type").as_deref(), Some("handler_error"));
        }
        let last_attempt: u32 = done[0].attr("idempo.attempt").unwrap().parse().unwrap();
        assert_eq!(
            last_attempt as usize,
            failed.len() + 1,
            "{id}: attempts count up"
        );
        retried += failed.len();

        // The relay's send: a PRODUCER span in the same trace, child of
        // the span the payment was staged in.
        let a_ids: Vec<String> = attempts.iter().map(|s| s.span_id()).collect();
        let sends: Vec<&Received> = spans
            .iter()
            .filter(|s| {
                s.service == "payments-a" && s.span.kind == PRODUCER && &s.trace_id() == trace
            })
            .collect();
        assert_eq!(sends.len(), 1, "{id}: one send span");
        let send = sends[0];
        assert_eq!(send.span.name, format!("send {b_queue}"));
        assert_eq!(
            send.attr("messaging.destination.name"),
            Some(b_queue.clone())
        );
        assert!(send.attr("messaging.message.id").is_some());
        // B's process span continues the same trace, linked to A's staging.
        let in_b: Vec<&&Received> = b_spans.iter().filter(|s| &s.trace_id() == trace).collect();
        assert_eq!(
            in_b.len(),
            1,
            "{id}: B processed it once, in the producer's trace"
        );
        let b_span = in_b[0];
        assert_eq!(
            b_span.attr("idempo.settlement").as_deref(),
            Some("processed")
        );
        assert_eq!(
            b_span.attr("messaging.message.id"),
            send.attr("messaging.message.id")
        );
        let (link_trace, link_span) = b_span.links().pop().expect("B links to A");
        assert_eq!(&link_trace, trace);
        assert!(
            a_ids.contains(&link_span) || spans.iter().any(|s| s.span_id() == link_span),
            "B links to a span of A's"
        );
        assert_eq!(
            send.parent_id(),
            link_span,
            "the send is a child of the staging span"
        );
    }
    assert!(
        retried > 0,
        "at 50% failures some of ten payments were retried"
    );

    // The poison: an error with its type, dead-lettered, tied to its producer.
    let poisoned: Vec<&&Received> = a_spans
        .iter()
        .filter(|s| s.trace_id() == poison.0)
        .collect();
    assert_eq!(poisoned.len(), 1, "one span for the poison");
    assert_eq!(poisoned[0].status(), ERROR);
    assert_eq!(
        poisoned[0].attr("error.type").as_deref(),
        Some("undecodable_body")
    );
    assert_eq!(
        poisoned[0].attr("idempo.settlement").as_deref(),
        Some("dead_lettered")
    );

    let metrics = receiver.metric_names();
    for name in [
        "messaging.process.duration",
        "messaging.client.consumed.messages",
        "idempo.claims",
        "idempo.retries",
        "idempo.dead_letters",
        "messaging.client.sent.messages",
        "messaging.client.operation.duration",
    ] {
        assert!(
            metrics.contains(name),
            "metric {name} received: {metrics:?}"
        );
    }
}

/// Drains `n` payments with the example and returns how long it took.
async fn drain(db: &Db, broker: &Broker, n: usize, env: &[(&str, &str)]) -> Duration {
    let queue = unique("otel_load");
    broker.declare(&queue).await;
    let load = support::example::publish_load(broker, &queue, n, false).await;
    let started = Instant::now();
    let example = spawn_example(&db.url, &queue, env);
    eventually("the load drained", Duration::from_secs(120), || async {
        db.claims().await == n as i64
    })
    .await;
    let took = started.elapsed();
    signal(&example, "-TERM");
    assert!(wait_exit(example).await.success(), "SIGTERM exits 0");
    assert_eq!(db.balances().await, load.expected, "balances add up");
    took
}

#[tokio::test]
async fn a_slow_collector_costs_no_payment_and_no_throughput() {
    support::payments_example_binary();
    let broker = Broker::connect().await;
    let n = 1500;
    // A collector that takes 3 s per answer, and one that is not there.
    let slow = Receiver::start(Duration::from_secs(3)).await;
    let gone = "http://127.0.0.1:9"; // discard: nothing listens
    let plain_db = example_db().await;
    let plain = drain(&plain_db, &broker, n, &[]).await;
    for (what, endpoint) in [("slow", slow.endpoint.as_str()), ("down", gone)] {
        let db = example_db().await;
        let env = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ];
        let took = drain(&db, &broker, n, &env).await;
        assert_eq!(db.claims().await, n as i64, "{what}: every payment applied");
        assert_eq!(doubled_payments(&db).await, 0, "{what}: none twice");
        // Generous: a shared machine's noise, not a blocked exporter (which
        // would take 3 s per span batch).
        assert!(
            took < plain * 2 + Duration::from_secs(5),
            "{what} collector: {took:?} against {plain:?} without export"
        );
    }
    assert!(slow.requests() > 0, "the slow collector was sent spans");
}

#[tokio::test]
async fn each_keyed_request_span_says_whether_its_key_was_new_replayed_or_in_conflict() {
    let receiver = Receiver::start(Duration::ZERO).await;
    let db = Db::new().await;
    let addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    /// Killed if the test fails while it runs.
    struct Server(std::process::Child);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut server = std::process::Command::new(support::example_binary("http_payments"))
        .env("DATABASE_URL", &db.url)
        .env("IDEMPOTENCY_STORE", "postgres")
        .env("HTTP_ADDR", addr.to_string())
        .env("RUST_LOG", "error")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint)
        .env("OTEL_SERVICE_NAME", "http-payments")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .stdout(std::process::Stdio::null())
        .spawn()
        .map(Server)
        .expect("start the http_payments example");
    let http = reqwest::Client::new();
    let url = format!("http://{addr}/payments");
    eventually("the example listens", Duration::from_secs(60), || async {
        tokio::net::TcpStream::connect(addr).await.is_ok()
    })
    .await;
    let post = |key: &'static str, cents: i64| {
        http.post(&url)
            .header("Idempotency-Key", key)
            .header("X-User-Id", "otel-user")
            .header("content-type", "application/json")
            .body(format!(
                r#"{{"account":"acc-otel","amount_cents":{cents}}}"#
            ))
            .send()
    };
    let first = post("otel-key-1", 5).await.unwrap();
    let status = first.status();
    assert!(
        status.is_success(),
        "{status}: {}",
        first.text().await.unwrap()
    );
    let again = post("otel-key-1", 5).await.unwrap();
    assert!(again.status().is_success());
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(post("otel-key-1", 6).await.unwrap().status(), 422);
    drop(http);
    // SIGTERM: the server drains, then flushes its spans.
    let status = std::process::Command::new("kill")
        .args(["-TERM", &server.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exited = tokio::time::timeout(Duration::from_secs(40), async {
        loop {
            if let Some(status) = server.0.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let Ok(status) = exited else {
        panic!("the server did not exit within 40 s of SIGTERM");
    };
    assert!(status.success(), "SIGTERM exits 0");

    let outcomes: Vec<String> = receiver
        .spans()
        .iter()
        .filter(|s| s.service == "http-payments" && s.span.name == "idempotency_key")
        .filter_map(|s| s.attr("idempo.key.outcome"))
        .collect();
    assert_eq!(outcomes, ["new", "replayed", "conflict"], "in order");
}
