//! TLS to every service (feature `tls`): PostgreSQL (this machine's server
//! has `ssl = on` with Debian's snakeoil certificate, issued to `localhost`),
//! RabbitMQ's amqps listener on node 1 of the local cluster and the TLS-only
//! Redis beside it (`scripts/rabbitmq-cluster.sh start` makes both, with a CA
//! of their own). Each works with the right trust, and each misconfiguration
//! fails fast with `Error::Tls` naming the service, never a reconnect loop.

mod support;

use std::str::FromStr;
use std::time::{Duration, Instant};

use idempo::amqp::{Broker, Consumer, ConsumerBuilder};
use idempo::consumer::RedeliveryPolicy;
use idempo::consumer::mode::PerMessage;
use idempo::window::{DedupId, DedupWindow, RedisWindow, Scope};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::consumer::{Running, payments_consumer};
use support::{Db, cluster, unique};

/// Debian's snakeoil certificate: self-signed, so it is its own CA.
const SNAKEOIL: &str = "/etc/ssl/certs/ssl-cert-snakeoil.pem";

/// How fast a misconfiguration must be reported: well before a reconnect
/// loop would have given up (it never would).
const FAST: Duration = Duration::from_secs(30);

/// Whether this pool's session is encrypted, as the server sees it.
async fn encrypted(pool: &sqlx::PgPool) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .expect("read pg_stat_ssl")
}

fn with_query(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

/// The payments consumer of `queue` on `pool` (not the test's own).
fn payments_on(pool: sqlx::PgPool, queue: &str) -> ConsumerBuilder<PerMessage> {
    Consumer::builder(support::amqp_url(), pool)
        .queue(queue)
        .redelivery(RedeliveryPolicy::delayed([support::RETRY_DELAY]))
        .handler(|tx, message| support::payments::handle(tx, message, 0.0))
}

/// Runs a consumer on `pool` (with `broker`, or the standard one) until the
/// payment published on `publish` is applied.
async fn payment_applied_through(
    db: &Db,
    pool: sqlx::PgPool,
    broker: Option<Broker>,
    publish: &support::Broker,
) -> Running {
    let queue = unique("tls");
    publish.declare(&queue).await;
    let mut builder = payments_on(pool, &queue);
    if let Some(broker) = broker {
        builder = builder.broker(broker);
    }
    let running = Running::start(builder);
    publish.publish_payment(&queue, "p-1", "alice", 500).await;
    running.settled(1).await;
    assert_eq!(db.payments_for("p-1").await, 1);
    assert_eq!(db.balances().await.get("alice"), Some(&500));
    running
}

#[tokio::test]
async fn postgres_sslmode_require_and_verify_ca_carry_the_consumer() {
    support::init_tracing();
    let db = Db::new().await;
    let require = PgPoolOptions::new()
        .max_connections(2)
        .connect(&with_query(&db.url, "sslmode=require"))
        .await
        .expect("sslmode=require connects to this machine's PostgreSQL");
    assert!(encrypted(&require).await, "sslmode=require is encrypted");
    require.close().await;

    // verify-ca through the URL, as DATABASE_URL would give it.
    let url = with_query(
        &db.url,
        &format!("sslmode=verify-ca&sslrootcert={SNAKEOIL}"),
    );
    let verified = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("sslmode=verify-ca with the snakeoil certificate as the CA connects");
    assert!(encrypted(&verified).await);
    let broker = support::Broker::connect().await;
    let running = payment_applied_through(&db, verified, None, &broker).await;
    running.stop().await.unwrap();
}

#[tokio::test]
async fn postgres_verify_full_checks_the_host_name() {
    support::init_tracing();
    let db = Db::new().await;
    let options = PgConnectOptions::from_str(&db.url)
        .unwrap()
        .ssl_mode(sqlx::postgres::PgSslMode::VerifyFull)
        .ssl_root_cert(SNAKEOIL);
    let by_name = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone().host("localhost"))
        .await
        .expect("verify-full to localhost, the name the certificate carries, connects");
    assert!(encrypted(&by_name).await);
    by_name.close().await;

    // 127.0.0.1 is not a name the snakeoil certificate carries.
    let lazy = PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(options.host("127.0.0.1"));
    let refusal = run_until_refused(payments_on(lazy, &unique("tls"))).await;
    assert_tls_error(&refusal, "PostgreSQL");
}

#[tokio::test]
async fn postgres_with_a_wrong_ca_fails_fast() {
    support::init_tracing();
    let db = Db::new().await;
    let url = with_query(
        &db.url,
        &format!(
            "sslmode=verify-ca&sslrootcert={}",
            cluster::cert("ca.pem").display()
        ),
    );
    let lazy = PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy(&url)
        .unwrap();
    let refusal = run_until_refused(payments_on(lazy, &unique("tls"))).await;
    assert_tls_error(&refusal, "PostgreSQL");
}

/// Runs a consumer that must refuse to start, and returns its error.
async fn run_until_refused(builder: ConsumerBuilder<PerMessage>) -> idempo::Error {
    let started = Instant::now();
    let outcome = tokio::time::timeout(FAST, builder.build().unwrap().run())
        .await
        .unwrap_or_else(|_| {
            panic!("a TLS misconfiguration must stop the consumer within {FAST:?}, not loop")
        });
    let error = outcome.expect_err("a consumer that cannot be trusted must not run");
    eprintln!("refused after {:?}: {error}", started.elapsed());
    error
}

fn assert_tls_error(error: &idempo::Error, service: &str) {
    match error {
        idempo::Error::Tls { service: s, reason } => {
            assert_eq!(s, service, "{error}");
            assert!(!reason.is_empty());
        }
        other => panic!("expected Error::Tls for {service}, got {other:?}"),
    }
    assert!(error.to_string().contains(service), "{error}");
}

fn amqps(ca: &str) -> Broker {
    amqps_with(idempo::ClientTls::new().ca_pem(cluster::read_cert(ca)))
}

fn amqps_with(tls: idempo::ClientTls) -> Broker {
    Broker::new(cluster::AMQPS_URL)
        .unwrap()
        .tls(&tls)
        .unwrap()
        .connection_timeout(Duration::from_secs(5))
}

#[tokio::test]
async fn amqps_with_the_clusters_ca_and_a_client_certificate() {
    support::init_tracing();
    cluster::require().await;
    let db = Db::new().await;
    // The test publishes over TLS too: Broker::connect is what publishers use.
    let publisher = amqps("ca.pem")
        .connect("idempo-test-tls-publisher")
        .await
        .expect("amqps with the cluster's CA connects");
    let publish = support::Broker::with(publisher, &cluster::node_url(1)).await;
    let broker = amqps_with(
        idempo::ClientTls::new()
            .ca_pem(cluster::read_cert("ca.pem"))
            .client_identity_pem(
                cluster::read_cert("client.pem"),
                cluster::read_cert("client.key"),
            ),
    );
    let running = payment_applied_through(&db, db.pool.clone(), Some(broker), &publish).await;

    // The broker sees the consumer's connection encrypted, with the client's certificate.
    let listing = cluster::ctl(
        1,
        &[
            "list_connections",
            "client_properties",
            "ssl",
            "peer_cert_subject",
            "-q",
            "--no-table-headers",
        ],
    );
    let consumer = listing
        .lines()
        .find(|line| line.contains("idempo:") && line.contains("idempo client"))
        .unwrap_or_else(|| panic!("no TLS connection with the client certificate:\n{listing}"));
    assert!(consumer.contains("true"), "{consumer}");
    running.stop().await.unwrap();
}

#[tokio::test]
async fn amqps_with_a_wrong_ca_fails_fast() {
    support::init_tracing();
    cluster::require().await;
    let db = Db::new().await;
    let builder = payments_consumer(&db, &unique("tls")).broker(amqps("wrong-ca.pem"));
    let refusal = run_until_refused(builder).await;
    assert_tls_error(&refusal, "RabbitMQ");
    assert!(
        refusal.to_string().contains("localhost:5691"),
        "the error names the node: {refusal}"
    );
}

#[tokio::test]
async fn amqps_to_a_plain_port_fails_fast() {
    support::init_tracing();
    cluster::require().await;
    let db = Db::new().await;
    let plain = Broker::new("amqps://guest:guest@localhost:5681/%2f")
        .unwrap()
        .tls(&idempo::ClientTls::new().ca_pem(cluster::read_cert("ca.pem")))
        .unwrap()
        .connection_timeout(Duration::from_secs(5));
    let refusal = run_until_refused(payments_consumer(&db, &unique("tls")).broker(plain)).await;
    assert_tls_error(&refusal, "RabbitMQ");
}

fn redis_tls(ca: &str, client_certificate: bool) -> idempo::ClientTls {
    let tls = idempo::ClientTls::new().ca_pem(cluster::read_cert(ca));
    if client_certificate {
        tls.client_identity_pem(
            cluster::read_cert("client.pem"),
            cluster::read_cert("client.key"),
        )
    } else {
        tls
    }
}

fn rediss_url() -> String {
    format!("rediss://localhost:{}", cluster::REDISS_PORT)
}

#[tokio::test]
async fn rediss_with_the_ca_and_a_client_certificate() {
    cluster::require().await;
    let store = RedisWindow::connect_with_tls(&rediss_url(), &redis_tls("ca.pem", true))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "rediss with the cluster's CA connects: {e}\n{}",
                cluster::START_CLUSTER
            )
        });
    let window = DedupWindow::new(store.with_prefix(unique("tls")));
    let (scope, id) = (Scope::queue("tls"), DedupId::new("m-1").unwrap());
    assert!(window.insert(&scope, &id).await.unwrap(), "a new id");
    assert!(!window.insert(&scope, &id).await.unwrap(), "seen over TLS");

    idempo::http::RedisStore::connect_with_tls(&rediss_url(), &redis_tls("ca.pem", true))
        .await
        .expect("the HTTP store connects over TLS too");
}

#[tokio::test]
async fn rediss_misconfigurations_fail_fast() {
    cluster::require().await;
    for (what, tls) in [
        ("a wrong CA", redis_tls("wrong-ca.pem", true)),
        ("no client certificate", redis_tls("ca.pem", false)),
    ] {
        let started = Instant::now();
        let error = RedisWindow::connect_with_tls(&rediss_url(), &tls)
            .await
            .err()
            .unwrap_or_else(|| panic!("{what}: must not connect"));
        assert!(
            started.elapsed() < FAST,
            "{what}: took {:?}",
            started.elapsed()
        );
        eprintln!("{what}: {error}");
        assert!(
            matches!(error, idempo::Error::Tls { .. })
                || matches!(
                    idempo::StoreError::of(&error),
                    Some(idempo::StoreError::Redis(_))
                ),
            "{what}: {error:?}"
        );
        if what == "a wrong CA" {
            assert_tls_error(&error, "Redis");
        }
    }
}

/// Node 1 of the local cluster (its amqps listener), without waiting for
/// the others: failover tests elsewhere may have one of them stopped.
async fn require_node_1() {
    let probe = cluster::connect(1).await;
    let _ = probe.close(200, "probe".into()).await;
}

#[tokio::test]
async fn amqp_to_the_tls_port_says_to_use_amqps() {
    support::init_tracing();
    require_node_1().await;
    let db = Db::new().await;
    let plain_to_tls = Broker::new("amqp://guest:guest@localhost:5691/%2f")
        .unwrap()
        .connection_timeout(Duration::from_secs(5));
    let refusal =
        run_until_refused(payments_consumer(&db, &unique("tls")).broker(plain_to_tls)).await;
    assert!(
        matches!(
            idempo::amqp::AmqpError::of(&refusal),
            Some(idempo::amqp::AmqpError::BrokerRefused { .. })
        ),
        "{refusal:?}"
    );
    let text = refusal.to_string();
    assert!(text.contains("use amqps://"), "{text}");
    assert!(text.contains("localhost:5691"), "{text}");
    assert!(!text.contains("ParserErrors"), "{text}");
}

#[tokio::test]
async fn rediss_to_a_plain_redis_says_it_does_not_speak_tls() {
    let started = Instant::now();
    let error = RedisWindow::connect("rediss://127.0.0.1:6379")
        .await
        .expect_err("a plain Redis cannot carry rediss://");
    eprintln!("{:?}: {error}", started.elapsed());
    assert_tls_error(&error, "Redis");
    assert!(error.to_string().contains("does not speak TLS"), "{error}");
    assert!(started.elapsed() < FAST);
}

/// Writes `contents` to a fresh file of this test run and returns its path.
fn scratch_file(name: &str, contents: &[u8]) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/tmp")
        .join(unique("certs"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

/// The cluster's client key, encrypted with a passphrase (PKCS#8).
fn encrypted_client_key() -> std::path::PathBuf {
    let path = scratch_file("encrypted.key", b"");
    let out = std::process::Command::new("openssl")
        .args([
            "pkcs8",
            "-topk8",
            "-v2",
            "aes-256-cbc",
            "-passout",
            "pass:secret",
            "-in",
        ])
        .arg(cluster::cert("client.key"))
        .arg("-out")
        .arg(&path)
        .output()
        .expect("run openssl");
    assert!(out.status.success(), "openssl: {out:?}");
    path
}

#[tokio::test]
async fn certificate_file_mistakes_name_the_file_and_what_is_wrong() {
    require_node_1().await;
    use idempo::ClientTls;
    let client = cluster::cert("client.pem");
    let key = cluster::cert("client.key");
    let missing = std::path::PathBuf::from("/nonexistent/idempo/ca.pem");
    let cases = [
        (
            ClientTls::new().ca_file(scratch_file("garbage.pem", b"not a certificate")),
            "no certificate in PEM",
        ),
        (
            ClientTls::new().ca_file(scratch_file("empty.pem", b"")),
            "is empty",
        ),
        (
            ClientTls::new().ca_file(&key),
            "holds a private key, not a certificate",
        ),
        (
            ClientTls::new().ca_file(&missing),
            "certificate file not found: /nonexistent/idempo/ca.pem",
        ),
        (
            ClientTls::new()
                .ca_file(cluster::cert("ca.pem"))
                .client_identity_files(&client, encrypted_client_key()),
            "encrypted private key: decrypt it first",
        ),
        (
            ClientTls::new()
                .ca_file(cluster::cert("ca.pem"))
                .client_identity_files(&client, &client),
            "holds a certificate, not a private key",
        ),
    ];
    for (files, expected) in cases {
        let error = Broker::new(cluster::AMQPS_URL)
            .unwrap()
            .tls(&files)
            .expect_err("an unusable file is refused before connecting");
        let text = error.to_string();
        let named = match &error {
            idempo::Error::Certificate(e) => e.path().to_owned(),
            other => panic!("expected Error::Certificate, got {other:?}"),
        };
        assert!(text.contains(expected), "{text}");
        assert!(
            text.contains(&*named.to_string_lossy()),
            "names the file: {text}"
        );
    }
    // The right files connect.
    let broker = Broker::new(cluster::AMQPS_URL)
        .unwrap()
        .tls(
            &ClientTls::new()
                .ca_file(cluster::cert("ca.pem"))
                .client_identity_files(&client, &key),
        )
        .unwrap();
    let connection = broker.connect("idempo-test-tls-files").await.unwrap();
    let _ = connection.close(200, "bye".into()).await;
}
