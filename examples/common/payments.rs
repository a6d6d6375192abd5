//! The payments domain shared by the `payments` example and the test suite:
//! its tables, its message and its handler.

use std::sync::Arc;

use idempo::Tx;
use idempo::consumer::{HandlerError, JsonBody, Message};
use idempo::outbox::{self, OutboxMessage};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// A payment message: `{"account": "...", "amount_cents": 123}`. The AMQP
/// `message_id` property carries the payment id.
///
/// Refused (dead-lettered as a permanent error, since no retry can fix them):
/// a negative amount, one above [`MAX_AMOUNT_CENTS`], an account name that is
/// empty, longer than [`MAX_ACCOUNT_LEN`] characters or holds control
/// characters (NUL included).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Payment {
    pub account: String,
    pub amount_cents: i64,
}

/// The largest amount accepted: a balance of many such payments stays far
/// from `bigint`'s limit.
pub const MAX_AMOUNT_CENTS: i64 = 1_000_000_000_000;

/// The longest account name accepted, in characters.
pub const MAX_ACCOUNT_LEN: usize = 64;

impl Payment {
    /// Why this payment can never be applied, if it cannot.
    pub fn invalid(&self) -> Option<String> {
        if self.amount_cents < 0 {
            return Some(format!("negative amount: {}", self.amount_cents));
        }
        if self.amount_cents > MAX_AMOUNT_CENTS {
            return Some(format!(
                "amount {} is above the limit of {MAX_AMOUNT_CENTS}",
                self.amount_cents
            ));
        }
        let len = self.account.chars().count();
        if len == 0 || len > MAX_ACCOUNT_LEN || self.account.chars().any(char::is_control) {
            return Some(format!(
                "account name must be 1 to {MAX_ACCOUNT_LEN} characters without control characters, got {len}"
            ));
        }
        None
    }
}

/// What the handler does besides applying: inject failures
/// (`PAYMENTS_FAIL_RATE`), forward each applied payment (`PAYMENTS_FORWARD_TO`).
/// A bare `f64` is a fail rate without forwarding.
#[derive(Debug, Clone, Default)]
pub struct Behaviour {
    /// Probability of a transient error after the writes.
    pub fail_rate: f64,
    /// The queue each applied payment is forwarded to, through the outbox.
    pub forward_to: Option<Arc<str>>,
}

impl From<f64> for Behaviour {
    fn from(fail_rate: f64) -> Self {
        Behaviour {
            fail_rate,
            forward_to: None,
        }
    }
}

/// The forwarded copy of a payment: the same body, through the default
/// exchange, with an id derived from the incoming one (stable across
/// redeliveries, so the consumer downstream deduplicates resends).
pub fn forwarded(to: &str, message_id: &str, payment: &Payment) -> OutboxMessage {
    OutboxMessage::json("", to, payment)
        .expect("a payment serialises")
        .derived_id(message_id, "forward")
}

/// The example's tables, created if missing. `payments` has NO unique key
/// on `message_id` on purpose: a double effect must stay visible.
pub const TABLES: &str = "
    CREATE TABLE IF NOT EXISTS payments (
        message_id   text        NOT NULL,
        account      text        NOT NULL,
        amount_cents bigint      NOT NULL,
        created_at   timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE IF NOT EXISTS account_balances (
        account       text   PRIMARY KEY,
        balance_cents bigint NOT NULL
    );";

/// Creates the example's [`TABLES`] if missing, one process at a time:
/// two `CREATE TABLE IF NOT EXISTS` at once can both go ahead, and one then
/// fails (`duplicate key ... pg_type_typname_nsp_index`).
pub async fn create_tables(pool: &PgPool) -> sqlx::Result<()> {
    // One implicit transaction: the lock is held until the tables committed.
    let locked = format!("SELECT pg_advisory_xact_lock({TABLES_LOCK}); {TABLES}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(locked))
        .execute(pool)
        .await?;
    Ok(())
}

/// The advisory lock key the example's table creations take.
pub const TABLES_LOCK: i64 = 0x6964_656d_706f_5442;

/// Checks that the tables of [`create_tables`] exist, without DDL (for a
/// role that may not create tables).
pub async fn check_tables(pool: &PgPool) -> anyhow::Result<()> {
    for table in ["payments", "account_balances"] {
        let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
            .bind(table)
            .fetch_one(pool)
            .await?;
        anyhow::ensure!(
            exists.is_some(),
            "table {table:?} does not exist: start once with PAYMENTS_MIGRATE=1 as a role that may create tables"
        );
    }
    Ok(())
}

/// Applies one payment in the claim's transaction: insert the payment row,
/// then add the amount to the account's balance (a non-idempotent delta).
///
/// `fail_rate` is the probability of a transient error *after* both writes,
/// to exercise the rollback.
pub async fn apply(
    tx: Tx,
    message_id: &str,
    payment: &Payment,
    behaviour: impl Into<Behaviour>,
) -> Result<(), HandlerError> {
    let behaviour = behaviour.into();
    if let Some(why) = payment.invalid() {
        return Err(HandlerError::permanent(why));
    }
    // A database error that no retry can fix (out of range, a constraint) is
    // permanent through `?` (ErrorKind::of); the rest are retried.
    let mut tx = tx.try_lock()?;
    sqlx::query("INSERT INTO payments (message_id, account, amount_cents) VALUES ($1, $2, $3)")
        .bind(message_id)
        .bind(&payment.account)
        .bind(payment.amount_cents)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO account_balances (account, balance_cents) VALUES ($1, $2)
         ON CONFLICT (account) DO UPDATE
         SET balance_cents = account_balances.balance_cents + excluded.balance_cents",
    )
    .bind(&payment.account)
    .bind(payment.amount_cents)
    .execute(&mut *tx)
    .await?;
    if let Some(to) = &behaviour.forward_to {
        outbox::stage(&mut tx, forwarded(to, message_id, payment)).await?;
    }
    injected_failure(behaviour.fail_rate)
}

/// The handler as registered with the consumer: the body is decoded before
/// the transaction begins (an undecodable one is dead-lettered), then
/// [`apply`] runs under the message's id.
pub async fn handle(
    tx: Tx,
    (JsonBody(payment), message): (JsonBody<Payment>, Message),
    behaviour: impl Into<Behaviour>,
) -> Result<(), HandlerError> {
    apply(tx, message.id(), &payment, behaviour).await
}

/// The batch handler: ONE bulk insert of the payments and ONE grouped balance
/// upsert for the whole batch (accounts sorted, so concurrent batches lock
/// balance rows in the same order). Batching pays only when the business
/// writes are batched too.
pub async fn handle_batch(
    tx: Tx,
    batch: Vec<(JsonBody<Payment>, Message)>,
    behaviour: impl Into<Behaviour>,
) -> Result<(), HandlerError> {
    let behaviour = behaviour.into();
    if let Some(why) = batch.iter().find_map(|(JsonBody(p), _)| p.invalid()) {
        // The batch falls back to one message at a time; this one is then
        // dead-lettered alone.
        return Err(HandlerError::permanent(why));
    }
    let ids: Vec<&str> = batch.iter().map(|(_, m)| m.id()).collect();
    let accounts: Vec<&str> = batch
        .iter()
        .map(|(JsonBody(p), _)| p.account.as_str())
        .collect();
    let amounts: Vec<i64> = batch
        .iter()
        .map(|(JsonBody(p), _)| p.amount_cents)
        .collect();
    let mut tx = tx.try_lock()?;
    sqlx::query(
        "INSERT INTO payments (message_id, account, amount_cents) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])",
    )
    .bind(&ids)
    .bind(&accounts)
    .bind(&amounts)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO account_balances (account, balance_cents) \
         SELECT account, sum(amount) FROM unnest($1::text[], $2::bigint[]) AS t(account, amount) \
         GROUP BY account ORDER BY account \
         ON CONFLICT (account) DO UPDATE \
         SET balance_cents = account_balances.balance_cents + excluded.balance_cents",
    )
    .bind(&accounts)
    .bind(&amounts)
    .execute(&mut *tx)
    .await?;
    if let Some(to) = &behaviour.forward_to {
        // One statement for the whole batch's forwards.
        let forwards = batch
            .iter()
            .map(|(JsonBody(p), m)| forwarded(to, m.id(), p));
        outbox::stage_all(&mut tx, forwards).await?;
    }
    injected_failure(behaviour.fail_rate)
}

/// With probability `fail_rate`, a transient error *after* the writes, to
/// exercise the rollback (PAYMENTS_FAIL_RATE).
fn injected_failure(fail_rate: f64) -> Result<(), HandlerError> {
    if fail_rate > 0.0 && rand::random::<f64>() < fail_rate {
        return Err(HandlerError::transient(
            "injected failure (PAYMENTS_FAIL_RATE)",
        ));
    }
    Ok(())
}
