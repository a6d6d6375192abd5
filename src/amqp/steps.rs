//! The inbox steps of one unit, for per-message and batch mode alike: the
//! state machine that decides each delivery's [`Outcome`].
//!
//! A *unit* is one delivery (per-message mode) or a batch of them. Each unit
//! goes through the same steps; a batch that fails as a whole is split into
//! units of one, which go through them again:
//!
//! ```text
//! Decode ─► Claim (claims + BEGIN, one round trip) ─┬─ all Duplicate/Mismatch ─► decided (no transaction)
//!    │                                               └─ Fresh ─► Handle ─┬─ Ok ─► Commit (claim check + COMMIT, one round trip) ─► Processed
//!    └─ undecodable ─► DeadLetter                                        └─ error / panic / timeout ─► ROLLBACK ─► Failed
//!
//! Failed         = one delivery: its outcome (Retry, or DeadLetter for a permanent error)
//!                  a batch: Split ─► each delivery alone, from Decode
//! AwaitDatabase  = a connection-level error at any step ─► ROLLBACK ─► wait at the gate ─► Decode again
//!                  (shutdown or a closed channel: Abandoned; after 5 passes: Failed)
//! ```
//!
//! Dropping the future (shutdown timeout) at any `.await` is safe: before the
//! commit, the transaction rolls back when dropped and the unacked delivery
//! returns to the queue when the channel closes; during or after the commit,
//! the redelivery is claimed as a duplicate and acknowledged.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::{PgPool, Postgres, Transaction};

use super::Message;
use super::database_gate::DatabaseGate;
use super::handler::{Call, Prepare};
use super::outbox::Forwarding;
use super::outcome::{
    Abandon, Decide, HandlerRun, Outcome, guarded, handler_failed, mismatch, retry, timed_out,
    undecodable,
};
use super::stats::{Counter, Stats};
use crate::Error;
use crate::error::database_unavailable;
use crate::inbox::{self, Claim, Isolation};

/// Passes that end in a connection error although the database answered in
/// between: after this many, the error is the unit's (a statement that kills
/// its own connection, a second pool) and it fails like any other error.
const MAX_DATABASE_PASSES: u32 = 5;

/// The steps of one unit through the inbox: BEGIN, claim, handler, commit.
pub(crate) struct InboxSteps {
    pub(crate) consumer: String,
    pub(crate) pool: PgPool,
    pub(crate) handler: Arc<dyn Prepare>,
    pub(crate) handler_timeout: Duration,
    pub(crate) gate: Arc<DatabaseGate>,
    pub(crate) stats: Stats,
    /// How the unit commits what its handler staged.
    pub(crate) forwarding: Arc<Forwarding>,
    /// Whether the pool's sessions default to READ COMMITTED, once known:
    /// the claims then skip `SET TRANSACTION`.
    pub(crate) read_committed: tokio::sync::OnceCell<bool>,
}

/// Deliveries that go through the steps together: indexes into the messages.
struct Unit {
    members: Vec<usize>,
    /// Passes that ended at the database gate.
    passes: u32,
}

impl Unit {
    fn new(members: Vec<usize>) -> Self {
        Unit { members, passes: 0 }
    }

    fn ids<'m>(&self, messages: &'m [Message]) -> Vec<(&'m str, &'m [u8])> {
        self.members
            .iter()
            .map(|&m| (messages[m].id(), messages[m].body()))
            .collect()
    }

    fn messages(&self, messages: &[Message]) -> Vec<Message> {
        self.members.iter().map(|&m| messages[m].clone()).collect()
    }
}

/// Where a unit stands.
enum Step {
    /// Decode the bodies; one that does not decode leaves the unit, dead-lettered.
    Decode(Unit),
    /// Claim every id of the unit, opening the transaction (one round trip).
    Claim(Unit, Call),
    /// Run the handler over the unit, now only fresh messages.
    Handle(Unit, Call, Transaction<'static, Postgres>),
    /// Check that the claims are still in the transaction, and COMMIT.
    /// With what the handler staged in the outbox.
    Commit(Unit, Transaction<'static, Postgres>, Staging),
    /// A connection-level database error: wait at the gate, then decode again.
    AwaitDatabase(Unit, String),
    /// The unit failed: the outcome a delivery on its own gets; a batch is
    /// split instead.
    Failed(Unit, Outcome),
    /// Every member of the unit ends this way.
    Decided(Unit, Outcome),
    /// Every member's outcome is recorded.
    Done,
}

impl Decide for InboxSteps {
    fn decide<'a>(
        &'a self,
        messages: &'a [Message],
        abandon: &'a Abandon,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(self.run(messages, abandon))
    }
}

impl InboxSteps {
    /// Drives every unit to its end: the state machine.
    async fn run(&self, messages: &[Message], abandon: &Abandon) -> Vec<Outcome> {
        let mut decided: Vec<Option<Outcome>> = vec![None; messages.len()];
        let mut units = VecDeque::from([Unit::new((0..messages.len()).collect())]);
        while let Some(unit) = units.pop_front() {
            let mut step = Step::Decode(unit);
            loop {
                step = match step {
                    Step::Decode(unit) => self.decode(unit, messages, &mut decided),
                    Step::Claim(unit, call) => self.claim(unit, call, messages, &mut decided).await,
                    Step::Handle(unit, call, tx) => self.handle(unit, call, tx).await,
                    Step::Commit(unit, tx, staged) => self.commit(unit, tx, staged, messages).await,
                    Step::AwaitDatabase(unit, error) => {
                        self.await_database(unit, error, abandon).await
                    }
                    Step::Failed(unit, outcome) if unit.members.len() == 1 => {
                        Step::Decided(unit, outcome)
                    }
                    Step::Failed(unit, outcome) => {
                        // Something failed that may concern one delivery only:
                        // each goes through the steps on its own, in order.
                        let reason = match &outcome {
                            Outcome::DeadLetter { error, .. } | Outcome::Retry { error, .. } => {
                                error.as_str()
                            }
                            _ => "",
                        };
                        tracing::warn!(error = %reason, size = unit.members.len(), "batch failed; processing its deliveries one by one");
                        for &member in unit.members.iter().rev() {
                            units.push_front(Unit::new(vec![member]));
                        }
                        Step::Done
                    }
                    Step::Decided(unit, outcome) => {
                        for &member in &unit.members {
                            decided[member] = Some(outcome.clone());
                        }
                        Step::Done
                    }
                    Step::Done => break,
                };
            }
        }
        // Every member is decided above; a gap would be a bug, and leaving
        // that delivery unacked (redelivered) is the safe way to survive it.
        decided
            .into_iter()
            .map(|o| o.unwrap_or(Outcome::Abandoned))
            .collect()
    }

    fn decode(
        &self,
        mut unit: Unit,
        messages: &[Message],
        decided: &mut [Option<Outcome>],
    ) -> Step {
        loop {
            if unit.members.is_empty() {
                return Step::Done;
            }
            match self.handler.prepare(&unit.messages(messages)) {
                Ok(call) => return Step::Claim(unit, call),
                Err((i, e)) => {
                    let member = unit.members.remove(i);
                    decided[member] = Some(undecodable(&e));
                }
            }
        }
    }

    async fn claim(
        &self,
        unit: Unit,
        call: Call,
        messages: &[Message],
        decided: &mut [Option<Outcome>],
    ) -> Step {
        let ids = unit.ids(messages);
        // Asked once; until an answer comes, the claim sets the level itself.
        let isolation = match self
            .read_committed
            .get_or_try_init(|| inbox::reads_committed_by_default(&self.pool))
            .await
        {
            Ok(true) => Isolation::Default,
            _ => Isolation::Set,
        };
        let claimed = inbox::begin_claims(&self.pool, &self.consumer, &ids, isolation).await;
        let (claims, tx) = match claimed {
            Ok(claimed) => (claimed.claims, claimed.tx),
            Err(e) => return database_error(unit, "claim failed", e),
        };
        let mut fresh = Vec::with_capacity(claims.len());
        for (&member, claim) in unit.members.iter().zip(claims) {
            match claim {
                Claim::Fresh => fresh.push(member),
                Claim::Duplicate => decided[member] = Some(Outcome::Duplicate),
                Claim::Mismatch => decided[member] = Some(self.mismatch(&messages[member])),
            }
        }
        let Some(tx) = tx.filter(|_| !fresh.is_empty()) else {
            return Step::Done;
        };
        let all_fresh = fresh.len() == unit.members.len();
        let unit = Unit {
            members: fresh,
            passes: unit.passes,
        };
        // The usual case: the call decoded for the whole unit serves.
        if all_fresh {
            return Step::Handle(unit, call, tx);
        }
        match self.handler.prepare(&unit.messages(messages)) {
            Ok(call) => Step::Handle(unit, call, tx),
            // Decoded once already: a type that decodes differently the
            // second time fails the unit.
            Err((_, e)) => {
                rollback(tx).await;
                Step::Failed(unit, undecodable(&e))
            }
        }
    }

    async fn handle(&self, unit: Unit, call: Call, tx: Transaction<'static, Postgres>) -> Step {
        let (tx, staging) = self.forwarding.open(tx);
        let run = guarded(|| call(tx.clone()), self.handler_timeout, &self.stats).await;

        let Some(tx) = tx.take() else {
            // The guard lives on in a task the handler spawned; the
            // transaction rolls back when that guard is dropped.
            return Step::Failed(
                unit,
                retry(
                    "handler finished while a task it spawned still holds the transaction",
                    "rolled back",
                ),
            );
        };
        match run {
            HandlerRun::Done => Step::Commit(unit, tx, staging),
            HandlerRun::Failed(e) => {
                rollback(tx).await;
                if database_unavailable(e.source()) {
                    return Step::AwaitDatabase(
                        unit,
                        format!("the database refused the handler: {e}"),
                    );
                }
                Step::Failed(unit, handler_failed(e))
            }
            HandlerRun::Panicked(panic) => {
                rollback(tx).await;
                Step::Failed(unit, retry("handler panicked", panic))
            }
            HandlerRun::TimedOut => {
                rollback(tx).await;
                Step::Failed(unit, timed_out(self.handler_timeout))
            }
        }
    }

    async fn commit(
        &self,
        unit: Unit,
        tx: Transaction<'static, Postgres>,
        staging: Staging,
        messages: &[Message],
    ) -> Step {
        // One claim tells for the whole unit: a statement fails in an aborted
        // transaction, and a ROLLBACK took every claim.
        let id = messages[unit.members[0]].id();
        let committed = self
            .forwarding
            .commit(&staging, tx, &self.consumer, id)
            .await;
        match committed {
            Ok(()) => Step::Decided(unit, Outcome::Processed),
            Err(e) if e.is_connection_error() => {
                // Maybe committed, maybe not: never ack. The next pass (or
                // the redelivery) is either claimed as a duplicate or runs afresh.
                self.stats.incr(Counter::CommitFailures);
                Step::AwaitDatabase(unit, format!("commit outcome unknown: {e}"))
            }
            Err(e) if e.is_unavailable() => {
                // Refused, so not committed (a read-only or full server).
                Step::AwaitDatabase(unit, format!("commit refused: {e}"))
            }
            Err(Error::ClaimLost { .. }) => Step::Failed(
                unit,
                retry(
                    "the handler ended the transaction itself",
                    "its writes and the claim are gone",
                ),
            ),
            Err(e) if e.is_aborted_transaction() => Step::Failed(
                unit,
                retry(
                    "the handler left the transaction aborted (did it ignore a failed statement?)",
                    e,
                ),
            ),
            Err(e) => {
                self.stats.incr(Counter::CommitFailures);
                Step::Failed(unit, retry("commit failed", e))
            }
        }
    }

    async fn await_database(&self, mut unit: Unit, error: String, abandon: &Abandon) -> Step {
        unit.passes += 1;
        if unit.passes >= MAX_DATABASE_PASSES {
            return Step::Failed(
                unit,
                retry("connection errors although the database answers", error),
            );
        }
        self.gate.report_down(&error);
        tokio::select! {
            () = self.gate.wait_available() => Step::Decode(unit),
            () = abandon.wait() => Step::Decided(unit, Outcome::Abandoned),
        }
    }

    fn mismatch(&self, message: &Message) -> Outcome {
        mismatch(&self.consumer, &self.stats, message)
    }

    #[cfg(test)]
    fn gate_is_open(&self) -> bool {
        self.gate.is_available()
    }
}

/// What a unit's handler staged in the outbox, for its commit.
type Staging = super::outbox::Unit;

/// A database that cannot take writes now sends the unit to the gate;
/// anything else fails it.
fn database_error(unit: Unit, context: &str, e: Error) -> Step {
    if e.is_unavailable() {
        Step::AwaitDatabase(unit, format!("{context}: {e}"))
    } else {
        Step::Failed(unit, retry(context, e))
    }
}

async fn rollback(tx: Transaction<'static, Postgres>) {
    if let Err(e) = tx.rollback().await {
        // A broken connection rolls back by itself on the server.
        tracing::debug!(error = %e, "rollback failed");
    }
}

/// The state machine against the real PostgreSQL, without a broker: each test
/// decides synthetic messages and checks the outcomes and what committed.
#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::Tx;
    use crate::amqp::JsonBody;
    use crate::amqp::handler::{EachMessage, HandlerError, WholeBatch};
    use crate::amqp::health::Health;

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
            let schema = format!("idempo_test_db_{secs}_unit_{}", crate::random::token());
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
            forwarding: Arc::new(Forwarding::new(false)),
            read_committed: tokio::sync::OnceCell::new(),
        }
    }

    fn nobody_leaves() -> Abandon {
        Abandon {
            shutdown: CancellationToken::new(),
            channel: None,
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
                *steps.read_committed.get().expect("asked once"),
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

    /// A batch handler: writes an effect per message, then, when an id of
    /// the batch starts with `swallow`, ignores a failed statement (the
    /// transaction is aborted), and when one starts with `rollback`, ends the
    /// transaction itself (after every write, so none escapes it); records
    /// the ids of each call.
    fn whole_batch(calls: Arc<std::sync::Mutex<Vec<Vec<String>>>>) -> Arc<dyn Prepare> {
        let handler = move |tx: Tx, batch: Vec<Message>| {
            let ids: Vec<String> = batch.iter().map(|m| m.id().to_owned()).collect();
            calls.lock().unwrap().push(ids.clone());
            async move {
                let mut conn = tx.try_lock()?;
                for id in &ids {
                    sqlx::query("INSERT INTO effects (id) VALUES ($1)")
                        .bind(id)
                        .execute(&mut *conn)
                        .await?;
                }
                if ids.iter().any(|id| id.starts_with("swallow")) {
                    let _ = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
                }
                if ids.iter().any(|id| id.starts_with("rollback")) {
                    sqlx::query("ROLLBACK").execute(&mut *conn).await?;
                }
                Ok(())
            }
        };
        Arc::new(WholeBatch::new(handler))
    }

    #[tokio::test]
    async fn a_batch_handler_that_aborts_or_ends_its_transaction_commits_nothing() {
        let db = TestDb::new().await;
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let steps = steps(&db.pool, whole_batch(calls.clone()));
        for prefix in ["swallow", "rollback"] {
            let batch: Vec<Message> = (1..=3)
                .map(|n| Message::for_test(&format!("{prefix}-{n}"), b"{}"))
                .collect();
            assert_eq!(
                decide(&steps, &batch).await,
                ["retry", "retry", "retry"],
                "{prefix}"
            );
            assert!(db.effects().await.is_empty(), "{prefix}: no effect commits");
            assert_eq!(db.claims().await, 0, "{prefix}: and no claim");
        }
        let sizes: Vec<usize> = calls.lock().unwrap().iter().map(Vec::len).collect();
        assert_eq!(
            sizes,
            [3, 1, 1, 1, 3, 1, 1, 1],
            "each batch failed whole, then each delivery alone"
        );
        db.drop().await;
    }

    #[tokio::test]
    async fn a_batch_whose_handler_aborts_for_one_delivery_commits_the_others_once() {
        let db = TestDb::new().await;
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let steps = steps(&db.pool, whole_batch(calls.clone()));
        let batch = [
            Message::for_test("ok-1", b"1"),
            Message::for_test("swallow-1", b"2"),
            Message::for_test("ok-2", b"3"),
            Message::for_test("rollback-1", b"4"),
        ];
        assert_eq!(
            decide(&steps, &batch).await,
            ["processed", "retry", "processed", "retry"]
        );
        assert_eq!(db.effects().await, ["ok-1", "ok-2"]);
        assert_eq!(db.claims().await, 2);
        // The redelivery of the whole batch: the committed ones are duplicates.
        assert_eq!(
            decide(&steps, &batch).await,
            ["duplicate", "retry", "duplicate", "retry"]
        );
        assert_eq!(db.effects().await, ["ok-1", "ok-2"], "effects once");
        db.drop().await;
    }

    /// Fresh ids, one processed before, one repeated in the batch with the
    /// same body and with another: a batch handler sees the fresh ones once,
    /// and the outcomes are those of the same deliveries one by one.
    #[tokio::test]
    async fn a_batch_handler_decides_copies_and_reused_ids_as_per_message_mode_does() {
        let batch = [
            Message::for_test("n-1", b"1"),
            Message::for_test("p-0", b"0"), // processed before: duplicate
            Message::for_test("n-1", b"1"), // repeated, same body: duplicate
            Message::for_test("n-1", b"other"), // repeated, other body: mismatch
            Message::for_test("n-2", b"2"),
            Message::for_test("p-0", b"zzz"), // processed before, other body
        ];
        let expected = [
            "processed",
            "duplicate",
            "duplicate",
            "dead letter: message id reused with a different payload",
            "processed",
            "dead letter: message id reused with a different payload",
        ];

        let db = TestDb::new().await;
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let batched = steps(&db.pool, whole_batch(calls.clone()));
        assert_eq!(
            decide(&batched, &[Message::for_test("p-0", b"0")]).await,
            ["processed"]
        );
        assert_eq!(decide(&batched, &batch).await, expected);
        assert_eq!(db.effects().await, ["n-1", "n-2", "p-0"], "effects once");
        assert_eq!(db.claims().await, 3);
        assert_eq!(
            *calls.lock().unwrap(),
            [
                vec!["p-0".to_owned()],
                vec!["n-1".to_owned(), "n-2".to_owned()]
            ],
            "one call for the batch, with its fresh messages only"
        );
        // Again: everything is a copy now, and the handler is not called.
        let again = decide(&batched, &batch).await;
        assert_eq!(
            again,
            [
                "duplicate",
                "duplicate",
                "duplicate",
                "dead letter: message id reused with a different payload",
                "duplicate",
                "dead letter: message id reused with a different payload",
            ]
        );
        assert_eq!(calls.lock().unwrap().len(), 2);
        db.drop().await;

        // The same deliveries one by one, per-message mode.
        let db = TestDb::new().await;
        let single = steps(&db.pool, each());
        assert_eq!(
            decide(&single, &[Message::for_test("p-0", b"0")]).await,
            ["processed"]
        );
        let mut one_by_one = Vec::new();
        for message in &batch {
            one_by_one.extend(decide(&single, std::slice::from_ref(message)).await);
        }
        assert_eq!(one_by_one, expected);
        assert_eq!(db.effects().await, ["n-1", "n-2", "p-0"]);
        db.drop().await;
    }

    #[tokio::test]
    async fn an_undecodable_body_is_dead_lettered_before_any_database_work() {
        let db = TestDb::new().await;
        let typed = |_tx: Tx, JsonBody(_n): JsonBody<i64>| async { Ok(()) };
        let steps = steps(&db.pool, Arc::new(EachMessage::new(typed)));
        let outcome = decide(&steps, &[Message::for_test("pay-x", b"not json")]).await;
        assert_eq!(outcome, ["dead letter: undecodable body"]);
        assert_eq!(db.claims().await, 0);
        db.drop().await;
    }

    #[tokio::test]
    async fn a_batch_claims_once_and_a_failure_splits_it_into_single_deliveries() {
        let db = TestDb::new().await;
        let steps = steps(&db.pool, each());
        assert_eq!(
            decide(&steps, &[Message::for_test("b-0", b"0")]).await,
            ["processed"]
        );
        let batch = [
            Message::for_test("b-1", b"1"),
            Message::for_test("b-0", b"0"), // processed before: duplicate
            Message::for_test("b-0", b"zzz"), // reused with another body
            Message::for_test("b-2", b"2"),
            Message::for_test("b-1", b"1"), // twice in the batch: the first wins
            Message::for_test("fail-b", b"3"), // fails the batch: split
        ];
        assert_eq!(
            decide(&steps, &batch).await,
            [
                "processed",
                "duplicate",
                "dead letter: message id reused with a different payload",
                "processed",
                "duplicate",
                "retry",
            ]
        );
        assert_eq!(db.effects().await, ["b-0", "b-1", "b-2"]);
        db.drop().await;
    }

    #[tokio::test]
    async fn a_batch_handler_gets_the_fresh_messages_of_a_batch_at_once() {
        let db = TestDb::new().await;
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = calls.clone();
        let batch_handler = move |tx: Tx, batch: Vec<Message>| {
            seen.lock().unwrap().push(batch.len());
            async move {
                for message in batch {
                    effect(tx.clone(), message).await?;
                }
                Ok(())
            }
        };
        let steps = steps(&db.pool, Arc::new(WholeBatch::new(batch_handler)));
        let first = [
            Message::for_test("w-1", b"1"),
            Message::for_test("w-2", b"2"),
        ];
        assert_eq!(decide(&steps, &first).await, ["processed", "processed"]);
        let again = [
            Message::for_test("w-1", b"1"),
            Message::for_test("w-3", b"3"),
            Message::for_test("w-4", b"4"),
        ];
        assert_eq!(
            decide(&steps, &again).await,
            ["duplicate", "processed", "processed"]
        );
        assert_eq!(
            *calls.lock().unwrap(),
            [2, 2],
            "one call per batch, fresh only"
        );
        db.drop().await;
    }

    #[tokio::test]
    async fn a_delivery_waiting_for_the_database_is_abandoned_at_shutdown() {
        // A pool on a port where nothing listens: every BEGIN fails to connect.
        let pool = PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(200))
            .connect_lazy("postgres://postgres@127.0.0.1:9/none")
            .unwrap();
        let steps = steps(&pool, each());
        let abandon = nobody_leaves();
        abandon.shutdown.cancel();
        let outcomes = steps
            .run(&[Message::for_test("pay-1", b"1")], &abandon)
            .await;
        assert_eq!(kinds(&outcomes), ["abandoned"], "left unacked, not retried");
        assert!(!steps.gate_is_open(), "the gate knows the database is down");
    }
}
