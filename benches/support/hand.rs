//! The hand-written consumer the benches measure idempo against: what a
//! careful team writes without a framework. Per delivery: `BEGIN`, the claim
//! (`INSERT … ON CONFLICT DO NOTHING`), the payment's two writes when the
//! claim is fresh, `COMMIT`, then the ack; all statements prepared (sqlx
//! caches them per connection). Retention, when it runs, is a `DELETE` reaper.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::BasicAckOptions;
use sqlx::PgPool;
use tokio::sync::Semaphore;

use crate::payments::Payment;

/// The claim in idempo's `processed_messages`, as consumer `hand` (the burst
/// bench: the same table and index as idempo's claims).
pub const CLAIM_IN_PROCESSED_MESSAGES: &str = "INSERT INTO processed_messages (consumer, message_id) \
     VALUES ('hand', $1) ON CONFLICT DO NOTHING";

/// The claim in a table of the loop's own ([`OWN_CLAIMS_TABLE`]), which its
/// [`reap`]er trims.
pub const CLAIM_IN_OWN_TABLE: &str =
    "INSERT INTO hand_claims (message_id) VALUES ($1) ON CONFLICT DO NOTHING";

/// The loop's own claims table: the key, and when it was claimed (indexed,
/// for the reaper).
pub const OWN_CLAIMS_TABLE: &str = "
    CREATE TABLE IF NOT EXISTS hand_claims (
        message_id   text        PRIMARY KEY,
        processed_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE INDEX IF NOT EXISTS hand_claims_processed_at ON hand_claims (processed_at);";

/// Rows one reaper statement deletes at most (short transactions, short locks).
const REAP_BATCH: i64 = 5_000;

/// One delivery: `BEGIN`, `claim`, the payment's two writes when the claim
/// is fresh (then `written` runs, before the commit), `COMMIT`. Returns
/// whether the claim was fresh.
pub async fn apply(
    pool: &PgPool,
    claim: &'static str,
    id: &str,
    payment: &Payment,
    written: impl Future<Output = ()>,
) -> sqlx::Result<bool> {
    let mut tx = pool.begin().await?;
    let fresh = sqlx::query(claim)
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected()
        == 1;
    if fresh {
        write_payment(&mut tx, id, payment).await?;
        written.await;
    }
    tx.commit().await?;
    Ok(fresh)
}

/// One batch: `BEGIN`, the claims with one `unnest … RETURNING` (as
/// consumer `hand`), one bulk insert of the fresh payments, one grouped
/// balance upsert, `written`, `COMMIT`. `payment(i)` decodes `ids[i]`'s
/// payment; only the fresh ones are decoded.
pub async fn apply_batch(
    pool: &PgPool,
    ids: &[String],
    payment: impl Fn(usize) -> anyhow::Result<Payment>,
    written: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    let fresh: Vec<String> = sqlx::query_scalar(
        "INSERT INTO processed_messages (consumer, message_id) SELECT 'hand', id FROM unnest($1::text[]) id ORDER BY id \
         ON CONFLICT DO NOTHING RETURNING message_id",
    )
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?;
    let fresh: std::collections::HashSet<String> = fresh.into_iter().collect();
    let (mut f_ids, mut accounts, mut amounts) = (Vec::new(), Vec::new(), Vec::new());
    for (i, id) in ids.iter().enumerate() {
        if fresh.contains(id) {
            let p = payment(i)?;
            f_ids.push(id.clone());
            accounts.push(p.account);
            amounts.push(p.amount_cents);
        }
    }
    sqlx::query("INSERT INTO payments (message_id, account, amount_cents) SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])")
        .bind(&f_ids)
        .bind(&accounts)
        .bind(&amounts)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO account_balances (account, balance_cents) SELECT account, sum(amount) \
         FROM unnest($1::text[], $2::bigint[]) AS t(account, amount) GROUP BY account ORDER BY account \
         ON CONFLICT (account) DO UPDATE SET balance_cents = account_balances.balance_cents + excluded.balance_cents",
    )
    .bind(&accounts)
    .bind(&amounts)
    .execute(&mut *tx)
    .await?;
    written.await;
    tx.commit().await?;
    Ok(())
}

/// The payment's two writes: its row, and the delta on its account's balance.
pub async fn write_payment(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    id: &str,
    p: &Payment,
) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO payments (message_id, account, amount_cents) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(&p.account)
        .bind(p.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "INSERT INTO account_balances (account, balance_cents) VALUES ($1, $2) \
         ON CONFLICT (account) DO UPDATE SET balance_cents = account_balances.balance_cents + excluded.balance_cents",
    )
    .bind(&p.account)
    .bind(p.amount_cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The message id of a delivery (empty when it has none).
pub fn message_id(delivery: &lapin::message::Delivery) -> String {
    delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default()
}

/// Each delivery in a task of its own, 16 at a time: `handle(delivery,
/// received)` settles it, and its error, if any, is printed.
pub async fn each_delivery<F, Fut>(mut consumer: lapin::Consumer, handle: F) -> anyhow::Result<()>
where
    F: Fn(lapin::message::Delivery, Instant) -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(16));
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery?;
        let received = Instant::now();
        let permit = permits.clone().acquire_owned().await?;
        let work = handle(delivery, received);
        tokio::spawn(async move {
            if let Err(e) = work.await {
                eprintln!("hand-written consumer: {e}");
            }
            drop(permit);
        });
    }
    Ok(())
}

/// The per-message loop at concurrency 16 ([`each_delivery`]): [`apply`]
/// with `claim`, the ack after the commit, then the delivery counted in
/// `done`. `written(received)` runs after a fresh delivery's writes.
pub async fn per_message<F, Fut>(
    consumer: lapin::Consumer,
    pool: PgPool,
    claim: &'static str,
    done: Arc<AtomicU64>,
    written: F,
) -> anyhow::Result<()>
where
    F: Fn(Instant) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    each_delivery(consumer, move |delivery, received| {
        let (pool, done, written) = (pool.clone(), done.clone(), written.clone());
        async move {
            let id = message_id(&delivery);
            let payment: Payment = serde_json::from_slice(&delivery.data)?;
            apply(&pool, claim, &id, &payment, written(received)).await?;
            delivery.acker.ack(BasicAckOptions::default()).await?;
            done.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    })
    .await
}

/// The reaper a hand-written loop runs beside it: every `every`, delete the
/// claims of [`OWN_CLAIMS_TABLE`] older than `horizon`, [`REAP_BATCH`] rows
/// per statement, until a statement deletes fewer. Runs until aborted.
pub async fn reap(pool: PgPool, horizon: Duration, every: Duration) {
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        loop {
            let deleted = sqlx::query(
                "DELETE FROM hand_claims WHERE message_id IN \
                 (SELECT message_id FROM hand_claims \
                  WHERE processed_at < now() - make_interval(secs => $1) LIMIT $2)",
            )
            .bind(horizon.as_secs_f64())
            .bind(REAP_BATCH)
            .execute(&pool)
            .await;
            match deleted {
                Ok(done) if done.rows_affected() < REAP_BATCH as u64 => break,
                Ok(_) => {}
                Err(e) => {
                    eprintln!("hand-written reaper: {e}");
                    break;
                }
            }
        }
    }
}
