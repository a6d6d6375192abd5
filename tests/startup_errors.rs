//! Wrong settings at start, as an operator makes them: each binary
//! (`payments`, `http_payments`, `idempo`) exits with a clear error (or, for
//! an outage, keeps trying) without a panic, and never prints a password.

mod support;

use idempo::amqp::AmqpError;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use idempo::amqp::Consumer;
use support::{Db, ServiceUrl, amqp_url, database_url, example_binary, unique};

/// Passwords that must never appear in any output.
const SECRETS: [&str; 5] = ["se/cret", "S3cretPW", "QpW9x", "Pw2nd", "R3disPW"];

fn assert_no_secret(out: &str, what: &str) {
    for secret in SECRETS {
        assert!(!out.contains(secret), "{what} printed {secret:?}:\n{out}");
    }
    assert!(!out.contains("panicked"), "{what} panicked:\n{out}");
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `binary` with `env` until it exits, or kills it after `limit` (a
/// binary that keeps retrying an outage); the output either way.
fn run_for(
    binary: &std::path::Path,
    env: &[(&str, &str)],
    args: &[&str],
    limit: Duration,
) -> (Option<i32>, String) {
    let mut command = Command::new(binary);
    command
        .args(args)
        .env("RUST_LOG", "info")
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command.spawn().expect("start the binary");
    let start = std::time::Instant::now();
    loop {
        if child.try_wait().expect("poll the child").is_some() {
            break;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("the binary's output");
    (out.status.code(), text(&out))
}

fn idempo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idempo"))
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("AMQP_URL")
        .output()
        .expect("run idempo")
}

/// A binary, its environment, and what the case is.
type Case<'a> = (
    &'a std::path::Path,
    Vec<(&'static str, String)>,
    &'static str,
);

#[test]
fn no_binary_prints_a_password_when_it_cannot_connect() {
    let payments = example_binary("payments");
    let http = example_binary("http_payments");
    let good_db = database_url();
    let quick = Duration::from_secs(30);
    let cases: Vec<Case<'_>> = vec![
        (
            &payments,
            vec![
                (
                    "DATABASE_URL",
                    "postgres://postgres:se/cret@127.0.0.1:1/db".into(),
                ),
                ("AMQP_URL", amqp_url()),
            ],
            "payments, a password with a slash",
        ),
        (
            &payments,
            vec![
                (
                    "DATABASE_URL",
                    "postgres://postgres@127.0.0.1:1/db?password=QpW9x".into(),
                ),
                ("AMQP_URL", amqp_url()),
            ],
            "payments, a password parameter",
        ),
        (
            &http,
            vec![
                (
                    "DATABASE_URL",
                    "postgres://postgres:S3cretPW@127.0.0.1:1/db".into(),
                ),
                ("HTTP_ADDR", "127.0.0.1:0".into()),
            ],
            "http_payments, PostgreSQL",
        ),
        (
            &http,
            vec![
                ("DATABASE_URL", good_db.clone()),
                ("IDEMPOTENCY_STORE", "redis".into()),
                ("REDIS_URL", "redis://:R3disPW@127.0.0.1:1".into()),
                ("HTTP_ADDR", "127.0.0.1:0".into()),
            ],
            "http_payments, Redis",
        ),
    ];
    for (binary, env, what) in cases {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (code, out) = run_for(binary, &env, &[], quick);
        assert!(
            matches!(code, Some(c) if c != 0),
            "{what} exits non-zero: {code:?}\n{out}"
        );
        assert_no_secret(&out, what);
    }
    // A broker list with a separator it may not know: retried, never printed whole.
    let (_, out) = run_for(
        &payments,
        &[
            ("DATABASE_URL", &good_db),
            (
                "AMQP_URL",
                "amqp://g:S3cretPW@127.0.0.1:1/%2f;amqp://h:Pw2nd@127.0.0.1:2/%2f",
            ),
            ("PAYMENTS_QUEUE", &unique("secret_list")),
        ],
        &[],
        Duration::from_secs(5),
    );
    assert_no_secret(&out, "payments, an AMQP_URL list");
    for args in [
        vec![
            "--database-url",
            "postgres://postgres:se/cret@127.0.0.1:1/db",
            "status",
        ],
        vec![
            "--database-url",
            "postgres://postgres@127.0.0.1:1/db?password=QpW9x",
            "--amqp-url",
            "amqp://g:S3cretPW@127.0.0.1:1/%2f",
            "status",
        ],
    ] {
        let out = idempo(&args);
        assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
        assert_no_secret(&text(&out), "idempo");
    }
}

#[test]
fn the_idempo_command_names_each_cause_once() {
    let out = idempo(&[
        "--database-url",
        "postgres://postgres@127.0.0.1:1/db",
        "--amqp-url",
        "amqp://127.0.0.1:1",
        "migrate",
        "--check",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let line = err.lines().next().unwrap_or_default();
    // The cause, where it is and how to start it, not the pool's timeout.
    assert!(
        line.contains("cannot reach PostgreSQL at 127.0.0.1:1")
            && line.contains("refused")
            && line.contains("docker compose up -d"),
        "{line}"
    );
    assert!(!err.contains("pool timed out"), "{err}");
    let causes: Vec<&str> = line.split(": ").collect();
    for (i, cause) in causes.iter().enumerate() {
        assert!(
            !causes[i + 1..].contains(cause),
            "{cause:?} is repeated in {line:?}"
        );
    }
}

#[test]
fn queue_names_over_the_amqp_limit_are_refused_up_front() {
    let payments = example_binary("payments");
    // 250 bytes: the queue fits, its delay queues (".retry.1s") do not.
    let long = format!("q{}", "x".repeat(249));
    let (code, out) = run_for(
        &payments,
        &[
            ("DATABASE_URL", &database_url()),
            ("AMQP_URL", &amqp_url()),
            ("PAYMENTS_QUEUE", &long),
        ],
        &[],
        Duration::from_secs(60),
    );
    assert!(matches!(code, Some(c) if c != 0), "{code:?}\n{out}");
    assert!(out.contains("delay queue name"), "{out}");
    assert!(out.contains("at most 255 bytes"), "{out}");
    assert!(!out.contains("panicked"), "{out}");

    let huge = "q".repeat(300);
    for args in [
        vec!["status", "--queue", huge.as_str()],
        vec!["dlq", "list", huge.as_str()],
    ] {
        let (database, amqp) = (database_url(), amqp_url());
        let mut full = vec!["--database-url", database.as_str()];
        full.extend(["--amqp-url", amqp.as_str()]);
        full.extend(args.iter().copied());
        let out = idempo(&full);
        let err = text(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("bytes long"), "{args:?}: {err}");
        assert!(err.contains("at most 255 bytes"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn a_concurrency_the_broker_cannot_honour_is_refused_not_truncated() {
    let (code, out) = run_for(
        &example_binary("payments"),
        &[
            ("DATABASE_URL", &database_url()),
            ("AMQP_URL", &amqp_url()),
            ("PAYMENTS_QUEUE", &unique("concurrency")),
            ("PAYMENTS_CONCURRENCY", "100000"),
        ],
        &[],
        Duration::from_secs(60),
    );
    assert!(matches!(code, Some(c) if c != 0), "{code:?}\n{out}");
    assert!(out.contains("PAYMENTS_CONCURRENCY"), "{out}");
}

/// A login role that may read and write the tables of `db`'s schema but not
/// create anything; dropped at the end.
struct Restricted {
    role: String,
    url: String,
}

impl Restricted {
    async fn on(db: &Db) -> Restricted {
        let role = unique("role");
        let schema = &db.schema;
        for sql in [
            format!("CREATE ROLE {role} LOGIN"),
            format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
            format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}"
            ),
            format!("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {role}"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&db.pool)
                .await
                .expect("set up the restricted role");
        }
        // The test database's URL (with its search_path), as this role.
        let (scheme, rest) = db.url.split_once("://").expect("a URL");
        let address = rest.rsplit_once('@').map_or(rest, |(_, address)| address);
        let url = format!("{scheme}://{role}@{address}");
        Restricted { role, url }
    }

    async fn drop(self, db: &Db) {
        let schema = &db.schema;
        for sql in [
            format!(
                "REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {}",
                self.role
            ),
            format!(
                "REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {}",
                self.role
            ),
            format!("REVOKE ALL ON SCHEMA {schema} FROM {}", self.role),
            format!("DROP ROLE {}", self.role),
        ] {
            let _ = sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&db.pool)
                .await;
        }
    }
}

#[tokio::test]
async fn a_role_without_create_runs_once_the_schema_is_current_and_is_told_when_it_is_not() {
    let db = Db::new().await;
    let broker = support::Broker::connect().await;
    let queue = unique("least_privilege");
    broker.declare(&queue).await;
    let restricted = Restricted::on(&db).await;
    // The library: nothing to do, no DDL, for a role that may not create.
    {
        let pool = sqlx::PgPool::connect(&restricted.url)
            .await
            .expect("connect as the role");
        idempo::migrate(&pool)
            .await
            .expect("migrate with a current schema needs no DDL");
        idempo::Schema::Check.apply(&pool).await.expect("current");
        pool.close().await;
    }
    broker.publish_payment(&queue, "lp-1", "alice", 5).await;
    let log = std::fs::File::create(format!(
        "{}/target/tmp/least-privilege.log",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("the example's log");
    let example = support::example::spawn_example_to(
        &restricted.url,
        &queue,
        &[("PAYMENTS_MIGRATE", "0"), ("RUST_LOG", "warn")],
        log,
    );
    support::eventually(
        "the payment applied by the restricted role",
        Duration::from_secs(30),
        || async { db.payments_for("lp-1").await == 1 },
    )
    .await;
    drop(example);
    restricted.drop(&db).await;

    // A schema that is behind: told, not migrated behind the operator's back.
    let empty = Db::empty().await;
    let (code, out) = run_for(
        &example_binary("payments"),
        &[
            ("DATABASE_URL", &empty.url),
            ("AMQP_URL", &amqp_url()),
            ("PAYMENTS_QUEUE", &queue),
            ("PAYMENTS_MIGRATE", "0"),
        ],
        &[],
        Duration::from_secs(60),
    );
    assert!(matches!(code, Some(c) if c != 0), "{code:?}\n{out}");
    assert!(
        out.contains("PAYMENTS_MIGRATE=1") || out.contains("schema is behind"),
        "{out}"
    );
    let behind = idempo::Schema::Check.apply(&empty.pool).await.unwrap_err();
    assert!(
        matches!(&behind, idempo::Error::SchemaBehind { missing } if !missing.is_empty()),
        "{behind}"
    );
}

/// A throw-away RabbitMQ user (password `pw`) and vhost on the shared broker,
/// with the permissions given; both deleted at the end.
struct BrokerUser {
    user: String,
    vhost: String,
}

fn ctl(args: &[&str]) {
    let out = support::rabbitmqctl()
        .args(args)
        .output()
        .expect("run rabbitmqctl");
    assert!(out.status.success(), "rabbitmqctl {args:?}: {out:?}");
}

impl BrokerUser {
    /// `permissions`: configure, write, read (regexps); `None`: no access.
    fn new(permissions: Option<[&str; 3]>) -> BrokerUser {
        let (user, vhost) = (unique("user"), unique("vhost"));
        ctl(&["add_user", &user, "pw"]);
        ctl(&["add_vhost", &vhost]);
        if let Some([configure, write, read]) = permissions {
            ctl(&[
                "set_permissions",
                "-p",
                &vhost,
                &user,
                configure,
                write,
                read,
            ]);
        }
        BrokerUser { user, vhost }
    }

    fn url(&self) -> String {
        ServiceUrl::amqp()
            .with_user(&self.user, Some("pw"))
            .with_path(&self.vhost)
            .into()
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = support::rabbitmqctl()
            .args(["delete_user", &self.user])
            .output();
        let _ = support::rabbitmqctl()
            .args(["delete_vhost", &self.vhost])
            .output();
    }
}

/// Runs a consumer that must refuse to start, and returns its error.
async fn refused_at_start(builder: impl support::consumer::Build) -> idempo::Error {
    let running = support::consumer::Running::start(builder);
    tokio::time::timeout(Duration::from_secs(30), running.task)
        .await
        .expect("a configuration error ends run() instead of a reconnect loop")
        .expect("no panic")
        .expect_err("a consumer the broker refuses does not run")
}

#[tokio::test]
async fn broker_configuration_errors_end_the_start_with_the_cause_in_either_mode() {
    support::init_tracing();
    let db = Db::new().await;
    let no_access = BrokerUser::new(None);
    // May read and write, may not declare (configure) anything.
    let no_configure = BrokerUser::new(Some(["", ".*", ".*"]));
    let queue = unique("refused");
    let cases = [
        (
            ServiceUrl::amqp().with_password("wrongpw").into(),
            "ACCESS_REFUSED",
        ),
        // Words that a text match once took for TLS failures, or did not.
        (
            ServiceUrl::amqp().with_path("alerts").into(),
            "vhost alerts not found",
        ),
        (
            ServiceUrl::amqp().with_path("billing").into(),
            "vhost billing not found",
        ),
        (no_access.url(), "refused for user"),
    ];
    for batch in [false, true] {
        for (url, cause) in &cases {
            let builder = Consumer::builder(url.clone(), db.pool.clone()).queue(&queue);
            let error = if batch {
                refused_at_start(
                    builder
                        .batch_handler(|tx, batch| support::payments::handle_batch(tx, batch, 0.0)),
                )
                .await
            } else {
                refused_at_start(
                    builder.handler(|tx, message| support::payments::handle(tx, message, 0.0)),
                )
                .await
            };
            assert!(
                matches!(AmqpError::of(&error), Some(AmqpError::BrokerRefused { .. })),
                "{url} (batch: {batch}): {error:?}"
            );
            let line = error.to_string();
            assert!(line.contains(cause), "{url}: {line}");
            assert!(!line.contains('\n'), "one line: {line}");
            assert!(!line.contains("wrongpw"), "no password: {line}");
        }
        // Connected, then refused the declaration of its queue.
        let builder = Consumer::builder(no_configure.url(), db.pool.clone()).queue(&queue);
        let error = if batch {
            refused_at_start(
                builder.batch_handler(|tx, batch| support::payments::handle_batch(tx, batch, 0.0)),
            )
            .await
        } else {
            refused_at_start(
                builder.handler(|tx, message| support::payments::handle(tx, message, 0.0)),
            )
            .await
        };
        match AmqpError::of(&error) {
            Some(AmqpError::AccessRefused { operation, broker }) => {
                assert!(operation.contains(&queue), "{error}");
                assert!(broker.contains("ACCESS_REFUSED"), "{error}");
            }
            other => panic!("expected AccessRefused (batch: {batch}), got {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_refusal_after_a_good_start_is_retried_reported_and_counted() {
    support::init_tracing();
    let db = Db::new().await;
    let user = BrokerUser::new(Some([".*", ".*", ".*"]));
    let queue = unique("refused_later");
    let name = unique("refused_later_conn");
    let running = support::consumer::Running::start(
        Consumer::builder(user.url(), db.pool.clone())
            .queue(&queue)
            .connection_name(&name)
            .handler(|tx, message| support::payments::handle(tx, message, 0.0)),
    );
    let publisher = idempo::amqp::Broker::new(&user.url())
        .unwrap()
        .connect("idempo-test-refused-later")
        .await
        .expect("the user connects");
    let publish = support::Broker::with(publisher, &user.url()).await;
    support::eventually("the queue declared", Duration::from_secs(30), || async {
        publish.exists(&queue).await
    })
    .await;
    publish.publish_payment(&queue, "rl-1", "alice", 5).await;
    running.settled(1).await;

    // The operator changes the password: the consumer's next sessions are refused.
    ctl(&["change_password", &user.user, "other"]);
    support::close_connections_named(&name);
    support::eventually("a refusal counted", Duration::from_secs(30), || async {
        running.stats().broker_refusals >= 1
    })
    .await;
    let error = running.health.snapshot().last_error.unwrap_or_default();
    assert!(error.contains("ACCESS_REFUSED"), "{error}");
    assert!(
        !running.task.is_finished(),
        "retried, not fatal, after a good start"
    );

    // Fixed: it consumes again.
    ctl(&["change_password", &user.user, "pw"]);
    publish.publish_payment(&queue, "rl-2", "alice", 5).await;
    running.settled(2).await;
    assert_eq!(db.payments_for("rl-2").await, 1);
    running.stop().await.unwrap();
}

#[tokio::test]
async fn a_hung_node_and_a_refused_node_are_both_named_within_one_timeout_each() {
    // Accepts TCP and never answers.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hung_port = hung.local_addr().unwrap().port();
    let closed_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let broker = idempo::amqp::Broker::new(&format!(
        "amqp://127.0.0.1:{hung_port},amqp://127.0.0.1:{closed_port}"
    ))
    .unwrap();
    let started = std::time::Instant::now();
    let error = broker.connect("idempo-test-hung").await.unwrap_err();
    let took = started.elapsed();
    drop(hung);
    eprintln!("{took:?}: {error}");
    let timeout = Duration::from_secs(10); // Broker's default connection timeout
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(3),
        "one documented timeout for the hung node: took {took:?}"
    );
    match AmqpError::of(&error) {
        Some(AmqpError::BrokerUnreachable { nodes }) => {
            assert_eq!(nodes.len(), 2, "{error}");
            assert!(nodes[0].node.contains(&hung_port.to_string()), "{error}");
            assert!(nodes[0].reason.contains("no answer within 10s"), "{error}");
            assert!(nodes[1].node.contains(&closed_port.to_string()), "{error}");
            assert!(nodes[1].reason.contains("refused"), "{error}");
        }
        other => panic!("expected BrokerUnreachable, got {other:?}"),
    }
    assert!(
        !error.to_string().contains("invalid configuration"),
        "{error}"
    );
}

#[test]
fn the_payments_example_exits_on_a_wrong_password_with_the_cause_in_one_line() {
    let (code, out) = run_for(
        &example_binary("payments"),
        &[
            ("DATABASE_URL", &database_url()),
            (
                "AMQP_URL",
                ServiceUrl::amqp().with_password("Pw2nd").as_str(),
            ),
            ("PAYMENTS_QUEUE", &unique("wrong_password")),
        ],
        &[],
        Duration::from_secs(60),
    );
    assert!(matches!(code, Some(c) if c != 0), "exits: {code:?}\n{out}");
    let last = out
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    assert!(
        last.contains("ACCESS_REFUSED"),
        "the cause, last: {last}\n{out}"
    );
    assert_no_secret(&out, "payments, a wrong password");
}

/// A file of this test run holding `contents`.
fn scratch_file(name: &str, contents: &[u8]) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/tmp")
        .join(unique("files"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn certificate_file_mistakes_stop_the_payments_example_naming_the_file() {
    let garbage = scratch_file("garbage.pem", b"this is no certificate\n");
    let empty = scratch_file("empty.pem", b"");
    let db = database_url();
    let sep = if db.contains('?') { '&' } else { '?' };
    let verify = format!("{db}{sep}sslmode=verify-ca&sslrootcert={}", empty.display());
    let queue = unique("cert_files");
    let amqps = support::cluster::AMQPS_URL;
    let cases: [(Vec<(&str, String)>, String); 3] = [
        (
            vec![
                ("AMQP_URL", amqps.into()),
                ("SSL_CERT_FILE", garbage.display().to_string()),
            ],
            format!("no certificate in PEM file {}", garbage.display()),
        ),
        (
            vec![("DATABASE_URL", verify)],
            format!("certificate file {} is empty", empty.display()),
        ),
        (
            vec![
                ("AMQP_URL", amqps.into()),
                ("AMQP_CA_FILE", "/nonexistent/idempo/ca.pem".into()),
            ],
            "certificate file not found: /nonexistent/idempo/ca.pem".into(),
        ),
    ];
    for (env, expected) in cases {
        let mut all: Vec<(&str, String)> = vec![
            ("DATABASE_URL", database_url()),
            ("AMQP_URL", amqp_url()),
            ("PAYMENTS_QUEUE", queue.clone()),
        ];
        all.extend(env);
        // The last value of a variable wins.
        let all: Vec<(&str, &str)> = all.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (code, out) = run_for(
            &example_binary("payments"),
            &all,
            &[],
            Duration::from_secs(60),
        );
        assert!(matches!(code, Some(c) if c != 0), "exits: {code:?}\n{out}");
        assert!(out.contains(&expected), "expected {expected:?}:\n{out}");
    }
}

#[tokio::test]
async fn payments_and_idempo_take_the_amqp_ca_and_client_certificate_from_the_environment() {
    use support::cluster;
    let probe = cluster::connect(1).await;
    let _ = probe.close(200, "probe".into()).await;
    let db = Db::new().await;
    let queue = unique("amqps_env");
    let publish = support::Broker::on_cluster_node(1).await;
    publish.declare(&queue).await;
    publish
        .publish_payment(&queue, "amqps-env-1", "alice", 7)
        .await;
    let ca = cluster::cert("ca.pem").display().to_string();
    let client = cluster::cert("client.pem").display().to_string();
    let key = cluster::cert("client.key").display().to_string();
    let log = std::fs::File::create(format!(
        "{}/target/tmp/amqps-env.log",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("the example's log");
    let example = support::example::spawn_example_to(
        &db.url,
        &queue,
        &[
            ("RUST_LOG", "info"),
            ("AMQP_URL", cluster::AMQPS_URL),
            ("AMQP_CA_FILE", &ca),
            ("AMQP_CLIENT_CERT_FILE", &client),
            ("AMQP_CLIENT_KEY_FILE", &key),
        ],
        log,
    );
    support::eventually(
        "the payment applied over amqps",
        Duration::from_secs(60),
        || async { db.payments_for("amqps-env-1").await == 1 },
    )
    .await;
    let listing = cluster::ctl(
        1,
        &[
            "list_connections",
            "client_properties",
            "peer_cert_subject",
            "-q",
            "--no-table-headers",
        ],
    );
    assert!(
        listing
            .lines()
            .any(|l| l.contains(&queue) && l.contains("idempo client")),
        "the example's connection presents the client certificate:\n{listing}"
    );
    drop(example);

    // The command reads the same variables; a flag replaces one.
    let idempo = |ca_flag: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idempo"));
        command
            .args(["--amqp-url", cluster::AMQPS_URL, "--database-url", &db.url])
            .env("AMQP_CA_FILE", &ca)
            .env("AMQP_CLIENT_CERT_FILE", &client)
            .env("AMQP_CLIENT_KEY_FILE", &key);
        if let Some(file) = ca_flag {
            command.args(["--amqp-ca-file", file]);
        }
        command.args(["status", "--queue", &queue]);
        command.output().expect("run idempo")
    };
    let out = idempo(None);
    assert!(
        matches!(out.status.code(), Some(0 | 2)),
        "status over amqps: {}",
        text(&out)
    );
    assert!(text(&out).contains(&queue), "{}", text(&out));
    let wrong = cluster::cert("wrong-ca.pem").display().to_string();
    let out = idempo(Some(&wrong));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("UnknownIssuer"), "{}", text(&out));
}

/// A user who may read and declare but not publish (no write permission): a
/// dead letter or retry copy is refused (`ACCESS_REFUSED` closes its
/// channel). That is the copy's failure: the original is handed back, the
/// channel reopened, and the session goes on; before, every refusal ended
/// the session (a reconnect loop while the other messages waited).
#[tokio::test]
async fn a_refused_copy_does_not_end_the_session() {
    support::init_tracing();
    let db = Db::new().await;
    // May only read: AMQP_URL's user (guest) declares the queues (declaring
    // needs write on the default exchange too).
    let user = BrokerUser::new(Some(["", "", ".*"]));
    let guest = ServiceUrl::amqp().with_path(&user.vhost);
    ctl(&[
        "set_permissions",
        "-p",
        &user.vhost,
        &guest.user(),
        ".*",
        ".*",
        ".*",
    ]);
    let queue = unique("no_write");
    let guest = guest.to_string();
    let connection = lapin::Connection::connect(&guest, lapin::ConnectionProperties::default())
        .await
        .expect("guest connects to the test vhost");
    let broker = support::Broker::with(connection, &guest).await;
    broker.declare(&queue).await;
    let running = support::consumer::Running::start(
        Consumer::builder(user.url(), db.pool.clone())
            .queue(&queue)
            .declare(false)
            .handler(|tx, message| support::payments::handle(tx, message, 0.0)),
    );
    // A permanent failure: its dead letter is refused, again and again.
    broker
        .publish_payment(&queue, "pay-negative", "nw", -1)
        .await;
    for n in 0..20 {
        broker
            .publish_payment(&queue, &format!("pay-{n}"), "nw", 1)
            .await;
    }
    support::eventually(
        "the 20 payments applied",
        Duration::from_secs(60),
        || async { db.payments().await == 20 },
    )
    .await;
    // Let the refused dead letter go round a few times.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stats = running.stats();
    assert!(
        stats.publish_failures >= 1,
        "the copy was refused: {stats:?}"
    );
    assert_eq!(
        (stats.reconnects, stats.session_failures),
        (0, 0),
        "a refused copy ended the session: {stats:?}"
    );
    assert!(!running.task.is_finished(), "the consumer still runs");
    running.stop().await.expect("a graceful stop");
}

/// A newcomer without the services: the first failure names the service,
/// its address and how to start it, in one line; an absent broker is
/// retried without flooding the log.
#[test]
fn a_missing_service_is_named_with_its_address_and_how_to_start_it() {
    let payments = example_binary("payments");
    let (code, out) = run_for(
        &payments,
        &[
            ("DATABASE_URL", "postgres://postgres@127.0.0.1:1/db"),
            ("AMQP_URL", &amqp_url()),
        ],
        &[],
        Duration::from_secs(60),
    );
    assert!(matches!(code, Some(c) if c != 0), "exits: {code:?}\n{out}");
    let line = out
        .lines()
        .find(|l| l.contains("cannot reach PostgreSQL at 127.0.0.1:1"))
        .unwrap_or_else(|| panic!("no line names PostgreSQL and its address:\n{out}"));
    assert!(
        line.contains("refused") && line.contains("docker compose up -d"),
        "why and how to start it, in the same line: {line}"
    );
    assert!(!out.contains("pool timed out"), "{out}");

    let (_, out) = run_for(
        &payments,
        &[
            ("DATABASE_URL", &database_url()),
            ("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f"),
            ("PAYMENTS_QUEUE", &unique("no_broker")),
        ],
        &[],
        Duration::from_secs(10),
    );
    let hints: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("RabbitMQ does not answer at amqp://guest:***@127.0.0.1:1"))
        .collect();
    assert_eq!(hints.len(), 1, "one hint:\n{out}");
    assert!(
        hints[0].contains("rabbitmq-server -detached"),
        "{}",
        hints[0]
    );
    // Backoff from 100 ms: about eight attempts in 10 s, of which the 1st,
    // 2nd, 4th and 8th are logged.
    let logged = out.matches("cannot reach RabbitMQ").count();
    assert!(
        (1..=4).contains(&logged),
        "{logged} failures logged in 10 s:\n{out}"
    );
    assert!(!out.contains("cannot connect to this node"), "{out}");
}
