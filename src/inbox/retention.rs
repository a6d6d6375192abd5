//! Retention of the plain `processed_messages`: deleting claims that can no
//! longer be redelivered (a partitioned table drops whole partitions
//! instead: [`Inbox::maintain`](super::Inbox::maintain)).

use std::time::Duration;

use sqlx::PgPool;

use crate::error::Result;

/// Deletes `consumer`'s claims older than `age`, `batch` rows per statement,
/// and returns how many rows went. A partitioned `processed_messages` loses
/// nothing here (`ONLY`: a ctid names no row across partitions); its claims
/// go with their partitions ([`Inbox::maintain`](super::Inbox::maintain)).
pub(crate) async fn delete_processed_before(
    pool: &PgPool,
    consumer: &str,
    age: Duration,
    batch: i64,
) -> Result<u64> {
    let mut total = 0;
    loop {
        let deleted = sqlx::query(
            "DELETE FROM ONLY processed_messages WHERE ctid = ANY(ARRAY(\
                 SELECT ctid FROM ONLY processed_messages \
                 WHERE consumer = $1 AND processed_at < now() - make_interval(secs => $2) \
                 LIMIT $3 FOR UPDATE SKIP LOCKED))",
        )
        .bind(consumer)
        .bind(age.as_secs_f64())
        .bind(batch)
        .execute(pool)
        .await?
        .rows_affected();
        total += deleted;
        if deleted < batch.max(1) as u64 {
            return Ok(total);
        }
    }
}
