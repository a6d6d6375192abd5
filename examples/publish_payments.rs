//! Publishes random payments, some of them twice, to watch idempo drop the copies.
//!
//! ```text
//! cargo run --release --example publish_payments -- 1000
//! ```
//!
//! The argument is the number of distinct payments (default 1000); about 10 %
//! of them are published a second time with the same message id. Start the
//! `payments` example first: it declares the queue. At the end this prints the
//! balances the consumer must reach (the balances in `DATABASE_URL` before
//! publishing, plus these payments once each); compare with
//! `SELECT * FROM account_balances ORDER BY account`. Reads `AMQP_URL`,
//! `DATABASE_URL` and `PAYMENTS_QUEUE` like the consumer.

use std::collections::BTreeMap;

use anyhow::Context;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use rand::Rng;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let queue = std::env::var("PAYMENTS_QUEUE").unwrap_or_else(|_| "payments".to_owned());
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let count: usize = match std::env::args().nth(1) {
        Some(n) => n
            .parse()
            .context("the argument is the number of payments")?,
        None => 1000,
    };

    let connection = Connection::connect(&amqp_url, ConnectionProperties::default())
        .await
        .with_context(|| format!("cannot connect to RabbitMQ at {amqp_url}"))?;
    let channel = connection.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.as_str().into(), passive, FieldTable::default())
        .await
        .with_context(|| {
            format!(
                "queue {queue:?} does not exist: start the payments example first (it declares it)"
            )
        })?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;

    // The balances now: the consumer must reach them plus these payments.
    // Read before publishing, so that nothing published here is counted twice.
    let pool = sqlx::PgPool::connect(&database_url)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {database_url}"))?;
    let mut expected: BTreeMap<String, i64> =
        sqlx::query_as("SELECT account, balance_cents FROM account_balances")
            .fetch_all(&pool)
            .await
            .context(
                "cannot read account_balances: start the payments example first (it creates it)",
            )?
            .into_iter()
            .collect();
    pool.close().await;

    let mut rng = rand::rng();
    let mut published = 0usize;
    for _ in 0..count {
        let id = format!("pay-{:016x}", rng.random::<u64>());
        let account = format!("acct-{}", rng.random_range(0..10));
        let amount_cents: i64 = rng.random_range(1..10_000);
        let body =
            serde_json::json!({"account": account, "amount_cents": amount_cents}).to_string();
        *expected.entry(account).or_default() += amount_cents;
        let copies = if rng.random_bool(0.1) { 2 } else { 1 };
        for _ in 0..copies {
            let properties = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2);
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    properties,
                )
                .await?;
            published += 1;
        }
    }
    channel.wait_for_confirms().await?;
    println!("published {published} messages for {count} distinct payments to {queue:?}");
    println!("balances once the consumer has caught up (account_balances):");
    for (account, cents) in &expected {
        println!("  {account}: {cents}");
    }
    connection.close(200, "done".into()).await?;
    Ok(())
}
