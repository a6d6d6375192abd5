//! The state machine against the real PostgreSQL, without a broker: each test
//! decides synthetic messages and checks the outcomes and what committed.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::Tx;
use crate::runtime::handler::{EachMessage, HandlerError, WholeBatch};
use crate::runtime::health::Health;
use crate::runtime::message::JsonBody;

/// A schema of its own (named like the integration tests' schemas, so
/// that their cleanup also removes leftovers), migrated; 3 connections.
struct TestDb {
    pool: PgPool,
    admin: PgPool,
    schema: String,
}

impl TestDb {
    async fn new() -> TestDb {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "PostgreSQL is not reachable at {url}: {e}\nstart it with \
                     `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`"
                )
            });
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let schema = format!(
            "idempo_test_db_{secs}_unit_{}",
            crate::random::token().unwrap()
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA {schema}; CREATE TABLE {schema}.effects (id text NOT NULL)"
        )))
        .execute(&admin)
        .await
        .expect("create the test schema");
        let options = PgConnectOptions::from_str(&url)
            .unwrap()
            .options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(3)
            .connect_with(options)
            .await
            .expect("connect to the test schema");
        crate::migrate(&pool).await.expect("migrate");
        TestDb {
            pool,
            admin,
            schema,
        }
    }

    async fn effects(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT id FROM effects ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    async fn claims(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM processed_messages")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn drop(self) {
        self.pool.close().await;
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.schema
        )))
        .execute(&self.admin)
        .await;
    }
}

fn steps(pool: &PgPool, handler: Arc<dyn Prepare>) -> InboxSteps {
    let stats = Stats::new("unit");
    let gate = DatabaseGate::new(
        pool.clone(),
        Health::default(),
        stats.clone(),
        CancellationToken::new(),
    );
    InboxSteps {
        consumer: "unit".into(),
        pool: pool.clone(),
        handler,
        handler_timeout: Duration::from_secs(5),
        gate,
        stats,
        forwarding: Arc::new(Forwarding::new(false, "test")),
        sessions: tokio::sync::OnceCell::new(),
        inbox: crate::inbox::Inbox::new("unit"),
        checked_acquire: false,
        letters_in_table: true,
    }
}

fn nobody_leaves() -> Abandon {
    Abandon {
        shutdown: CancellationToken::new(),
        gone: None,
    }
}

/// Records the message id in `effects`; ids starting with `fail` fail
/// transiently after writing, `bad` fail permanently, `swallow` ignore a
/// failed statement, `rollback` end the transaction themselves.
async fn effect(tx: Tx, message: Message) -> Result<(), HandlerError> {
    let id = message.id().to_owned();
    let mut conn = tx.try_lock()?;
    sqlx::query("INSERT INTO effects (id) VALUES ($1)")
        .bind(&id)
        .execute(&mut *conn)
        .await?;
    if id.starts_with("fail") {
        return Err(HandlerError::transient("injected"));
    }
    if id.starts_with("bad") {
        return Err(HandlerError::permanent("a business rule"));
    }
    if id.starts_with("swallow") {
        let _ = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
    }
    if id.starts_with("rollback") {
        sqlx::query("ROLLBACK").execute(&mut *conn).await?;
    }
    Ok(())
}

fn each() -> Arc<dyn Prepare> {
    Arc::new(EachMessage::new(effect))
}

fn kinds(outcomes: &[Outcome]) -> Vec<String> {
    outcomes
        .iter()
        .map(|o| match o {
            Outcome::Processed => "processed".to_owned(),
            Outcome::Duplicate => "duplicate".to_owned(),
            Outcome::DeadLetter { reason, .. } => format!("dead letter: {reason}"),
            Outcome::Retry { .. } => "retry".to_owned(),
            Outcome::Abandoned => "abandoned".to_owned(),
        })
        .collect()
}

async fn decide(steps: &InboxSteps, messages: &[Message]) -> Vec<String> {
    kinds(&steps.run(messages, &nobody_leaves()).await)
}

/// Records the transaction's isolation level as the effect.
async fn isolation(tx: Tx, _message: Message) -> Result<(), HandlerError> {
    let mut conn = tx.try_lock()?;
    sqlx::query("INSERT INTO effects (id) SELECT current_setting('transaction_isolation')")
        .execute(&mut *conn)
        .await?;
    Ok(())
}

#[tokio::test]
async fn claims_and_handlers_run_at_read_committed_whatever_the_session_default() {
    let db = TestDb::new().await;
    // The default session (READ COMMITTED: SET TRANSACTION is skipped),
    // then sessions that default to SERIALIZABLE (it is sent).
    let options = db.pool.connect_options().as_ref().clone();
    let serializable = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.options([("default_transaction_isolation", "serializable")]))
        .await
        .expect("connect with a serializable default");
    for (n, pool) in [&db.pool, &serializable].into_iter().enumerate() {
        let steps = steps(pool, Arc::new(EachMessage::new(isolation)));
        let message = Message::for_test(&format!("iso-{n}"), b"{}");
        assert_eq!(decide(&steps, &[message]).await, ["processed"]);
        assert_eq!(
            steps.sessions.get().expect("asked once").read_committed,
            n == 0,
            "what the sessions default to"
        );
    }
    assert_eq!(db.effects().await, ["read committed", "read committed"]);
    serializable.close().await;
    db.drop().await;
}

#[tokio::test]
async fn a_fresh_message_commits_once_and_its_copies_are_duplicates_or_mismatches() {
    let db = TestDb::new().await;
    let steps = steps(&db.pool, each());
    let first = Message::for_test("pay-1", b"100");
    assert_eq!(
        decide(&steps, std::slice::from_ref(&first)).await,
        ["processed"]
    );
    assert_eq!(decide(&steps, &[first]).await, ["duplicate"]);
    let reused = Message::for_test("pay-1", b"999");
    assert_eq!(
        decide(&steps, &[reused]).await,
        ["dead letter: message id reused with a different payload"]
    );
    assert_eq!(db.effects().await, ["pay-1"], "one effect");
    db.drop().await;
}

#[tokio::test]
async fn failing_handlers_commit_nothing_and_say_how_to_settle() {
    let db = TestDb::new().await;
    let steps = steps(&db.pool, each());
    for (id, expected) in [
        ("fail-1", "retry"),
        ("bad-1", "dead letter: permanent handler error"),
        ("swallow-1", "retry"),
        ("rollback-1", "retry"),
    ] {
        let outcome = decide(&steps, &[Message::for_test(id, b"{}")]).await;
        assert_eq!(outcome, [expected], "{id}");
    }
    assert!(db.effects().await.is_empty(), "every write rolled back");
    assert_eq!(db.claims().await, 0, "and every claim");
    db.drop().await;
}

/// A unit's commit (`SELECT; <deferred rows>COMMIT AND CHAIN`, one round
/// trip) commits a fresh message and what its handler deferred to the
/// outbox once, refuses a transaction the handler aborted or ended (the
/// deferred row with it), and leaves no connection in a transaction.
#[cfg(feature = "outbox")]
#[tokio::test]
async fn a_unit_commits_once_and_refuses_aborted_or_ended_transactions() {
    use crate::outbox::{OutboxMessage, stage};
    let db = TestDb::new().await;
    let forwarding = |tx: Tx, message: Message| async move {
        {
            let mut conn = tx.try_lock()?;
            stage(&mut conn, OutboxMessage::new("", "next", b"{}".to_vec())).await?;
        }
        effect(tx, message).await
    };
    let steps = steps(&db.pool, Arc::new(EachMessage::new(forwarding)));
    let first = Message::for_test("pay-1", b"100");
    assert_eq!(
        decide(&steps, std::slice::from_ref(&first)).await,
        ["processed"]
    );
    assert_eq!(decide(&steps, &[first]).await, ["duplicate"]);
    for refused in ["swallow-1", "rollback-1"] {
        let message = Message::for_test(refused, b"{}");
        assert_eq!(decide(&steps, &[message]).await, ["retry"], "{refused}");
    }
    assert_eq!(db.effects().await, ["pay-1"], "none of the refused");
    assert_eq!(db.claims().await, 1);
    let staged: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(staged, 1, "the processed message's deferred row only");
    // Every connection of the pool at once: none is still in the chained
    // transaction (its statements would share one start time).
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(db.pool.acquire().await.unwrap());
    }
    for conn in &mut conns {
        // A simple query: one statement, one implicit transaction.
        let row = sqlx::raw_sql("SELECT now() = statement_timestamp()")
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        let outside: bool = sqlx::Row::get(&row, 0);
        assert!(outside, "a connection was left in a transaction");
    }
    drop(conns);
    db.drop().await;
}

/// A unit's transaction opens on an idle connection without the pool's
/// ping; one that died while idle is replaced, not reported.
#[tokio::test]
async fn a_unit_begins_on_another_connection_when_an_idle_one_is_dead() {
    let db = TestDb::new().await;
    let mut conns = Vec::new();
    let mut pids: Vec<i32> = Vec::new();
    for _ in 0..3 {
        let mut conn = db.pool.acquire().await.unwrap();
        pids.push(
            sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *conn)
                .await
                .unwrap(),
        );
        conns.push(conn);
    }
    drop(conns);
    while db.pool.num_idle() < 3 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sqlx::query("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS t(pid)")
        .bind(&pids)
        .execute(&db.admin)
        .await
        .unwrap();
    loop {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)")
                .bind(&pids)
                .fetch_one(&db.admin)
                .await
                .unwrap();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut tx = crate::runtime::unit_tx::begin(&db.pool, Isolation::Default, true)
        .await
        .expect("a live connection in place of the dead ones");
    let live: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(live, 1);
    drop(tx);
    db.drop().await;
}

mod batch;
