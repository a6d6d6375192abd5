//! Read-only views of the inbox for operations tools (`idempo::ops`, the
//! `idempo` command and its dashboard): counts and ages of claims.

use std::time::Duration;

use sqlx::PgPool;

#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;

/// One consumer's claims: how many, and how old the oldest and newest are.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerClaims {
    /// The consumer's name (for the AMQP runtime: its queue).
    pub consumer: String,
    /// How many claims it holds.
    pub claims: i64,
    /// How long ago its oldest claim was made.
    pub oldest: Option<Duration>,
    /// How long ago its newest claim was made.
    pub newest: Option<Duration>,
}

impl ConsumerClaims {
    /// The claims of every consumer that has some (only those in `only`,
    /// unless it is empty), ordered by consumer. Scans the claims of the
    /// consumers asked about: meant for an operator's status command, not a
    /// hot path.
    ///
    /// ```no_run
    /// # async fn doc(pool: sqlx::PgPool) -> idempo::Result<()> {
    /// use idempo::inbox::ConsumerClaims;
    ///
    /// for c in ConsumerClaims::list(&pool, &[]).await? {
    ///     println!("{}: {} claims, oldest {:?} ago", c.consumer, c.claims, c.oldest);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Database`] when the query fails (also when the table does not
    /// exist: run [`migrate`](crate::migrate)).
    pub async fn list(pool: &PgPool, only: &[String]) -> Result<Vec<ConsumerClaims>> {
        let rows: Vec<(String, i64, Option<f64>, Option<f64>)> = sqlx::query_as(
            "SELECT consumer, count(*), \
                    extract(epoch FROM now() - min(processed_at))::float8, \
                    extract(epoch FROM now() - max(processed_at))::float8 \
             FROM processed_messages \
             WHERE cardinality($1::text[]) = 0 OR consumer = ANY($1) \
             GROUP BY consumer ORDER BY consumer",
        )
        .bind(only)
        .fetch_all(pool)
        .await?;
        let age = |secs: Option<f64>| secs.map(|s| Duration::from_secs_f64(s.max(0.0)));
        Ok(rows
            .into_iter()
            .map(|(consumer, claims, oldest, newest)| ConsumerClaims {
                consumer,
                claims,
                oldest: age(oldest),
                newest: age(newest),
            })
            .collect())
    }

    /// How many claims were ever inserted into the `processed_messages`
    /// table of the connection's schema, by every consumer, from
    /// PostgreSQL's statistics (cheap; counts claims whose transaction
    /// rolled back too, and restarts at a statistics reset): the difference
    /// of two readings is a claim rate, for dashboards. A partitioned
    /// table's partitions are summed (a partition dropped takes its count
    /// with it).
    ///
    /// # Errors
    /// [`Error::Database`] when the query fails.
    pub async fn inserted_total(pool: &PgPool) -> Result<i64> {
        Ok(sqlx::query_scalar(
            // pg_partition_tree is empty for a plain table.
            "SELECT coalesce(sum(n_tup_ins), 0)::int8 FROM pg_stat_user_tables \
             WHERE relid = to_regclass('processed_messages') \
                OR relid IN (SELECT relid FROM pg_partition_tree(to_regclass('processed_messages')))",
        )
        .fetch_one(pool)
        .await?)
    }
}
