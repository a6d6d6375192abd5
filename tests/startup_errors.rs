//! Wrong settings at start, as an operator makes them: each binary
//! (`payments`, `http_payments`, `idempo`) exits with a clear error (or, for
//! an outage, keeps trying) without a panic, and never prints a password.

mod support;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use support::{Db, amqp_url, database_url, example_binary, unique};

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
        let mut full = vec![
            "--database-url",
            "postgres://postgres@127.0.0.1:5432/postgres",
        ];
        let amqp = amqp_url();
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
        idempo::check_migrations(&pool).await.expect("current");
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
    let behind = idempo::check_migrations(&empty.pool).await.unwrap_err();
    assert!(
        matches!(&behind, idempo::Error::SchemaBehind { missing } if !missing.is_empty()),
        "{behind}"
    );
}
