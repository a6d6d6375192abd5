//! The relay's side of the `outbox` table (no broker here): lock a batch of
//! due rows, keep the first of each ordering key, and write down what the
//! broker said (delete or mark the published rows, record failed attempts),
//! in one transaction per batch. `relay::Relay` publishes in between. All the
//! relay's SQL lives here.

use std::collections::HashMap;
use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};

use super::packed::{self, Staged};
use crate::backoff;

/// The channel the staging trigger notifies on commit.
pub(crate) const NOTIFY_CHANNEL: &str = "idempo_outbox";

/// How a refused or unroutable message is retried: attempts, and the
/// backoff between them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RetrySchedule {
    pub(crate) max_attempts: u32,
    pub(crate) min: Duration,
    pub(crate) max: Duration,
}

/// A key whose first pending row this batch does not hold: `Some(wait)`
/// when that row waits for its retry, `None` when another relay holds it.
pub(crate) type Blocked = (String, Option<Duration>);

/// One relay batch: the transaction that holds its rows' locks.
pub(crate) struct Batch {
    tx: Transaction<'static, Postgres>,
}

impl Batch {
    /// Begins a batch. The takeover bound rides on BEGIN: no round trip of
    /// its own. The commit need not wait for its flush: a mark lost in a
    /// server crash only makes those rows go out again, with the same ids.
    pub(crate) async fn begin(
        pool: &PgPool,
        takeover_after: Duration,
    ) -> Result<Self, sqlx::Error> {
        let begin = format!(
            "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {}; \
             SET LOCAL synchronous_commit = off",
            takeover_after.as_millis()
        );
        let tx = pool.begin_with(sqlx::AssertSqlSafe(begin)).await?;
        Ok(Batch { tx })
    }

    /// Locks up to `limit` due pending rows of `transport`, lowest id
    /// first, skipping rows other relays hold and the keys in `parked`.
    pub(crate) async fn lock_due(
        &mut self,
        transport: &str,
        limit: usize,
        parked: &[String],
    ) -> Result<Vec<Row>, sqlx::Error> {
        sqlx::query_as(
            "SELECT id, exchange, routing_key, message_id, body, content_type, correlation_id, \
                    persistent, headers::text AS headers, ordering_key, attempts, packed, messages, \
                    properties, envelope, transport \
             FROM outbox \
             WHERE state = 'pending' AND transport = $3 AND next_attempt_at <= now() \
               AND (ordering_key IS NULL OR NOT (ordering_key = ANY($2::text[]))) \
             ORDER BY id LIMIT $1 \
             FOR UPDATE SKIP LOCKED",
        )
        .bind(limit as i64)
        .bind(parked)
        .bind(transport)
        .fetch_all(&mut *self.tx)
        .await
    }

    /// The rows this relay may publish now: all unkeyed ones, and of each
    /// key the run of rows that starts at the key's first pending row (an
    /// earlier one held by another relay, or waiting for its retry, holds the
    /// key back). Also returns the keys held back.
    pub(crate) async fn first_of_each_key(
        &mut self,
        rows: Vec<Row>,
    ) -> Result<(Vec<Row>, Vec<Blocked>), sqlx::Error> {
        let mut keys: Vec<&str> = rows
            .iter()
            .filter_map(|r| r.ordering_key.as_deref())
            .collect();
        if keys.is_empty() {
            return Ok((rows, Vec::new()));
        }
        keys.sort_unstable();
        keys.dedup();
        let last = rows.last().map_or(0, |r| r.id);
        // Rows of one batch share their transport: keys are per transport.
        let transport = rows.first().map_or("", |r| r.transport.as_str());
        // A plain read: it sees rows that other relays hold locked.
        let pending: Vec<(String, i64, Option<f64>)> = sqlx::query_as(
            "SELECT ordering_key, id, \
                    CASE WHEN next_attempt_at > now() \
                         THEN extract(epoch FROM next_attempt_at - now())::float8 END \
             FROM outbox \
             WHERE state = 'pending' AND transport = $3 AND ordering_key = ANY($1) AND id <= $2 \
             ORDER BY ordering_key, id",
        )
        .bind(&keys)
        .bind(last)
        .bind(transport)
        .fetch_all(&mut *self.tx)
        .await?;
        let mut mine: HashMap<&str, Vec<i64>> = HashMap::new();
        for row in &rows {
            if let Some(key) = &row.ordering_key {
                mine.entry(key).or_default().push(row.id);
            }
        }
        // Per key: how many of my rows continue the key's run of pending rows.
        let mut allowed: HashMap<String, usize> = HashMap::new();
        let mut blocked: HashMap<String, Option<f64>> = HashMap::new();
        for (key, id, wait) in pending {
            let Some(ids) = mine.get(key.as_str()) else {
                continue;
            };
            if blocked.contains_key(&key) {
                continue;
            }
            let n = allowed.entry(key.clone()).or_insert(0);
            if ids.get(*n) == Some(&id) {
                *n += 1;
            } else {
                blocked.insert(key, wait);
            }
        }
        let blocked = blocked
            .into_iter()
            .map(|(key, wait)| (key, wait.map(|secs| Duration::from_secs_f64(secs.max(0.0)))))
            .collect();
        let mut kept = Vec::with_capacity(rows.len());
        for row in rows {
            let Some(key) = row.ordering_key.as_deref() else {
                kept.push(row);
                continue;
            };
            if let Some(n) = allowed.get_mut(key).filter(|n| **n > 0) {
                *n -= 1;
                kept.push(row);
            }
        }
        Ok((kept, blocked))
    }

    /// Writes down the batch and commits: the `confirmed` rows deleted (or,
    /// with `keep_published`, marked done), the refused messages of packed
    /// rows as rows of their own, every failed attempt. Returns the rows
    /// deleted and the messages given up.
    pub(crate) async fn settle(
        mut self,
        confirmed: &[i64],
        keep_published: bool,
        unpacked: Vec<(i64, Vec<Staged>, Failures)>,
        failures: &mut Failures,
    ) -> Result<(u64, usize), sqlx::Error> {
        for (row, messages, retry) in &unpacked {
            retry.insert_unpacked(&mut self.tx, *row, messages).await?;
        }
        let mut deleted = 0;
        if !confirmed.is_empty() {
            let query = if keep_published {
                "UPDATE outbox SET state = 'done', published_at = now(), \
                 attempts = attempts + 1 WHERE id = ANY($1)"
            } else {
                "DELETE FROM outbox WHERE id = ANY($1)"
            };
            let done = sqlx::query(query)
                .bind(confirmed)
                .execute(&mut *self.tx)
                .await?;
            if !keep_published {
                deleted = done.rows_affected();
            }
        }
        for (_, _, retry) in unpacked {
            failures.absorb(retry);
        }
        let given_up = failures.record(&mut self.tx).await?;
        self.tx.commit().await?;
        Ok((deleted, given_up))
    }

    /// Ends a batch that found nothing to publish.
    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }
}

/// Whether any row of `transport` is pending: a dormant relay's reason to
/// start.
pub(crate) async fn any_pending(pool: &PgPool, transport: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM outbox WHERE state = 'pending' AND transport = $1)",
    )
    .bind(transport)
    .fetch_one(pool)
    .await
}

/// Vacuums the outbox when the server's autovacuum is off (deleted rows
/// keep their space until a VACUUM); does nothing when it is on.
pub(crate) async fn vacuum_if_autovacuum_is_off(pool: &PgPool) -> Result<(), sqlx::Error> {
    let autovacuum: String = sqlx::query_scalar("SELECT current_setting('autovacuum')")
        .fetch_one(pool)
        .await?;
    if autovacuum != "off" {
        return Ok(());
    }
    // Not in a transaction: VACUUM refuses to run inside one.
    sqlx::raw_sql("VACUUM outbox").execute(pool).await?;
    Ok(())
}

/// A row as the relay reads it.
#[derive(sqlx::FromRow)]
pub(crate) struct Row {
    pub(crate) id: i64,
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) message_id: String,
    pub(crate) body: Vec<u8>,
    pub(crate) content_type: Option<String>,
    pub(crate) correlation_id: Option<String>,
    pub(crate) persistent: bool,
    pub(crate) headers: String,
    pub(crate) ordering_key: Option<String>,
    pub(crate) attempts: i32,
    pub(crate) packed: Option<Vec<u8>>,
    pub(crate) messages: i32,
    /// Exact properties in AMQP's encoding (rows staged before `envelope`).
    pub(crate) properties: Option<Vec<u8>>,
    /// Exact properties in idempo's encoding.
    pub(crate) envelope: Option<Vec<u8>>,
    pub(crate) transport: String,
}

impl Row {
    /// The messages the row carries: itself, or its packed ones.
    pub(crate) fn unpack(self) -> std::result::Result<Vec<Staged>, String> {
        match self.packed {
            Some(packed) => packed::decode(&packed, &self.transport),
            None => Ok(vec![Staged {
                exchange: self.exchange,
                routing_key: self.routing_key,
                message_id: self.message_id,
                content_type: self.content_type,
                correlation_id: self.correlation_id,
                persistent: self.persistent,
                headers: self.headers,
                body: self.body,
                exact: self.envelope,
                legacy: self.properties,
                transport: self.transport,
            }]),
        }
    }
}

/// Failed attempts of one batch, written with one statement.
#[derive(Default)]
pub(crate) struct Failures {
    ids: Vec<i64>,
    errors: Vec<String>,
    give_up: Vec<bool>,
    delays: Vec<f64>,
    /// Give-ups and delays of unpacked messages, written by `insert_unpacked`.
    counted: Vec<(bool, f64)>,
}

impl Failures {
    /// A failed attempt of `(row id, its attempts so far, message id)`.
    pub(crate) fn push(
        &mut self,
        schedule: &RetrySchedule,
        row: (i64, i32, &str),
        error: String,
        certain: bool,
    ) {
        let (id, attempts, message_id) = row;
        let attempt = u32::try_from(attempts).unwrap_or(0).saturating_add(1);
        let give_up = certain || attempt >= schedule.max_attempts;
        let delay = backoff::full_jitter(backoff::ceiling(schedule.min, schedule.max, attempt))
            .max(schedule.min);
        if give_up {
            tracing::error!(%message_id, %error, attempts = attempt, "outbox relay: giving up on a message; it stays in the outbox as failed");
        } else {
            tracing::warn!(%message_id, %error, attempt, ?delay, "outbox relay: message not accepted; retrying later");
        }
        self.ids.push(id);
        self.errors.push(error);
        self.give_up.push(give_up);
        self.delays.push(delay.as_secs_f64());
    }

    /// Takes over the (already written) failures of unpacked messages, for
    /// the counts.
    pub(crate) fn absorb(&mut self, other: Failures) {
        self.counted
            .extend(other.give_up.into_iter().zip(other.delays));
    }

    /// Every failed attempt of the batch, written here or unpacked.
    pub(crate) fn attempts(&self) -> usize {
        self.ids.len() + self.counted.len()
    }

    /// When the earliest retry scheduled by the batch is due.
    pub(crate) fn next_retry(&self) -> Option<Duration> {
        self.give_up
            .iter()
            .copied()
            .zip(self.delays.iter().copied())
            .chain(self.counted.iter().copied())
            .filter(|(given_up, _)| !given_up)
            .map(|(_, secs)| Duration::from_secs_f64(secs))
            .min()
    }

    /// Writes the refused messages of packed row `row` as rows of their own,
    /// with their attempt recorded and the packed row's age.
    pub(crate) async fn insert_unpacked(
        &self,
        tx: &mut sqlx::PgConnection,
        row: i64,
        messages: &[Staged],
    ) -> std::result::Result<(), sqlx::Error> {
        let text = |f: fn(&Staged) -> Option<&str>| -> Vec<Option<&str>> {
            messages.iter().map(f).collect()
        };
        let bodies: Vec<&[u8]> = messages.iter().map(|m| m.body.as_slice()).collect();
        let persistent: Vec<bool> = messages.iter().map(|m| m.persistent).collect();
        sqlx::query(
            "INSERT INTO outbox (exchange, routing_key, message_id, body, content_type, \
                                 correlation_id, persistent, headers, attempts, last_error, \
                                 state, next_attempt_at, created_at, properties, envelope, \
                                 transport) \
             SELECT e, r, i, b, c, k, p, h::jsonb, o.attempts + 1, err, \
                    CASE WHEN g THEN 'failed' ELSE 'pending' END, \
                    now() + make_interval(secs => d), o.created_at, pr, ev, o.transport \
             FROM outbox AS o, \
                  unnest($2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[], \
                         $7::text[], $8::bool[], $9::text[], $10::text[], $11::bool[], \
                         $12::float8[], $13::bytea[], $14::bytea[]) \
                  WITH ORDINALITY AS t(e, r, i, b, c, k, p, h, err, g, d, pr, ev, n) \
             WHERE o.id = $1 ORDER BY n",
        )
        .bind(row)
        .bind(text(|m| Some(&m.exchange)))
        .bind(text(|m| Some(&m.routing_key)))
        .bind(text(|m| Some(&m.message_id)))
        .bind(&bodies)
        .bind(text(|m| m.content_type.as_deref()))
        .bind(text(|m| m.correlation_id.as_deref()))
        .bind(&persistent)
        .bind(text(|m| Some(&m.headers)))
        .bind(&self.errors)
        .bind(&self.give_up)
        .bind(&self.delays)
        .bind(
            messages
                .iter()
                .map(|m| m.legacy.as_deref())
                .collect::<Vec<_>>(),
        )
        .bind(
            messages
                .iter()
                .map(|m| m.exact.as_deref())
                .collect::<Vec<_>>(),
        )
        .execute(tx)
        .await?;
        Ok(())
    }

    /// Records the attempts; returns how many messages were given up.
    pub(crate) async fn record(
        &self,
        tx: &mut sqlx::PgConnection,
    ) -> std::result::Result<usize, sqlx::Error> {
        let absorbed = self.counted.iter().filter(|(g, _)| *g).count();
        if self.ids.is_empty() {
            return Ok(absorbed);
        }
        sqlx::query(
            "UPDATE outbox AS o SET attempts = o.attempts + 1, last_error = f.error, \
                    state = CASE WHEN f.give_up THEN 'failed' ELSE 'pending' END, \
                    next_attempt_at = now() + make_interval(secs => f.delay) \
             FROM unnest($1::bigint[], $2::text[], $3::bool[], $4::float8[]) \
                  AS f(id, error, give_up, delay) \
             WHERE o.id = f.id",
        )
        .bind(&self.ids)
        .bind(&self.errors)
        .bind(&self.give_up)
        .bind(&self.delays)
        .execute(tx)
        .await?;
        Ok(self.give_up.iter().filter(|g| **g).count() + absorbed)
    }
}
