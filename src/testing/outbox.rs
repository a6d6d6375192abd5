//! What a harness's deliveries staged in the outbox: all of it
//! ([`Harness::outbox`]), the relay's run over it ([`Harness::drain`]), and
//! what one delivery's transaction staged ([`Delivered::staged`]).

use std::time::Duration;

use super::harness::Harness;
use crate::outbox::OutboxMessage;
use crate::outbox::batch::{Batch, Failures, Row};
use crate::{Error, Result};

#[cfg(doc)]
use super::delivered::Delivered;

impl Harness {
    /// The messages waiting in the outbox (staged by committed handlers,
    /// not yet published), in the order the relay takes them.
    ///
    /// # Errors
    /// [`Error::Database`] when the outbox cannot be read.
    pub async fn outbox(&self) -> Result<Vec<OutboxMessage>> {
        let mut batch = Batch::begin(self.pool(), Duration::from_secs(60)).await?;
        let rows = batch
            .lock_due(
                <super::transport::Memory as crate::runtime::transport::Transport>::NAME,
                i32::MAX as usize,
                &[],
            )
            .await?;
        batch.rollback().await?;
        unpack(rows)
    }

    /// Runs the relay's batches (lock due rows, first of each ordering key,
    /// delete what was published) against an in-memory sink that confirms
    /// everything, until the outbox is empty; returns the messages in
    /// publish order.
    ///
    /// # Errors
    /// [`Error::Database`] when a batch fails.
    pub async fn drain(&self) -> Result<Vec<OutboxMessage>> {
        let mut published = Vec::new();
        loop {
            let mut batch = Batch::begin(self.pool(), Duration::from_secs(60)).await?;
            let rows = batch
                .lock_due(
                    <super::transport::Memory as crate::runtime::transport::Transport>::NAME,
                    100,
                    &[],
                )
                .await?;
            if rows.is_empty() {
                batch.rollback().await?;
                return Ok(published);
            }
            let (rows, _held_back) = batch.first_of_each_key(rows).await?;
            let mut confirmed = Vec::with_capacity(rows.len());
            for row in rows {
                let (id, key) = (row.id, row.ordering_key.clone());
                let staged = row.unpack().map_err(Error::Config)?;
                published.extend(
                    staged
                        .into_iter()
                        .map(|s| OutboxMessage::from_staged(s, key.clone())),
                );
                confirmed.push(id);
            }
            batch
                .settle(&confirmed, false, Vec::new(), &mut Failures::default())
                .await?;
        }
    }

    /// What the transaction that claimed `id` staged (rows written in
    /// one transaction share its `xmin`), not yet published.
    pub(super) async fn staged_by(&self, id: &str) -> Result<Vec<OutboxMessage>> {
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT o.id, o.exchange, o.routing_key, o.message_id, o.body, o.content_type, \
                    o.correlation_id, o.persistent, o.headers::text AS headers, o.ordering_key, \
                    o.attempts, o.packed, o.messages, o.properties, o.envelope, o.transport \
             FROM outbox o, processed_messages p \
             WHERE p.consumer = $1 AND p.message_id = $2 AND o.xmin::text = p.xmin::text \
             ORDER BY o.id",
        )
        .bind(self.consumer())
        .bind(id)
        .fetch_all(self.pool())
        .await?;
        unpack(rows)
    }
}

/// The messages of outbox rows, with their rows' ordering keys.
fn unpack(rows: Vec<Row>) -> Result<Vec<OutboxMessage>> {
    let mut messages = Vec::new();
    for row in rows {
        let key = row.ordering_key.clone();
        let staged = row.unpack().map_err(Error::Config)?;
        messages.extend(
            staged
                .into_iter()
                .map(|s| OutboxMessage::from_staged(s, key.clone())),
        );
    }
    Ok(messages)
}
