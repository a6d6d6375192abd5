//! The harness's own PostgreSQL schema: created and migrated for each
//! harness, dropped by `close`, and leftovers of harnesses that were never
//! closed dropped by a later one.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

use std::sync::Arc;

use super::fault::{CUT_SETUP, Outage};
use crate::{Error, Result};

/// Connections of a harness's own pool: enough for a few deliveries at once
/// and the database gate's probe, small enough for parallel tests.
const POOL_SIZE: u32 = 4;

/// Schemas of harnesses that were never closed are dropped by a later
/// harness once they are this old.
const LEFTOVER_AGE: Duration = Duration::from_secs(3600);

/// The prefix of every harness schema.
const SCHEMA_PREFIX: &str = "idempo_harness_";

/// A new schema on `admin`'s server with idempo's tables, the harness's
/// fault objects and the user's setup, and a pool that works in it.
pub(super) async fn isolate(
    admin: &PgPool,
    setup: &[String],
    outage: &Arc<Outage>,
) -> Result<(PgPool, String)> {
    let options = admin.connect_options();
    let url = format!(
        "postgres://{}@{}:{}/{}",
        options.get_username(),
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or_default()
    );
    reap_leftovers(admin).await.map_err(|e| {
        // An outage, not a mistake: a database error, naming the URL.
        if !crate::sqlstate::is_unavailable(&e) {
            return Error::Database(e);
        }
        Error::Database(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            format!(
                "the test harness cannot use PostgreSQL at {url}: {e} (is it running? e.g. \
                 `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`)"
            ),
        )))
    })?;
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let schema = format!("{SCHEMA_PREFIX}{secs}_{}", crate::random::token()?);
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(admin)
        .await?;
    let options = (*options)
        .clone()
        .options([("search_path", schema.as_str())]);
    let (on_connect, on_acquire) = (outage.clone(), outage.clone());
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            let outage = on_connect.clone();
            Box::pin(async move { outage.apply(conn).await })
        })
        .before_acquire(move |conn, _| {
            let outage = on_acquire.clone();
            Box::pin(async move { outage.apply(conn).await.map(|()| true) })
        })
        .connect_with(options)
        .await?;
    let prepared = async {
        crate::migrate(&pool).await?;
        sqlx::raw_sql(CUT_SETUP).execute(&pool).await?;
        for sql in setup {
            sqlx::raw_sql(AssertSqlSafe(sql.as_str()))
                .execute(&pool)
                .await?;
        }
        Ok::<(), Error>(())
    };
    if let Err(e) = prepared.await {
        drop_schema(admin, &pool, &schema).await;
        return Err(e);
    }
    Ok((pool, schema))
}

/// Drops the schemas of harnesses that were never closed, once they are old.
async fn reap_leftovers(admin: &PgPool) -> std::result::Result<(), sqlx::Error> {
    let names: Vec<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)")
            .bind(SCHEMA_PREFIX)
            .fetch_all(admin)
            .await?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    for name in names {
        let created = name
            .strip_prefix(SCHEMA_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|secs| secs.parse::<u64>().ok());
        let ours = name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if ours && created.is_some_and(|c| now.saturating_sub(c) > LEFTOVER_AGE.as_secs()) {
            // Another harness may be reaping the same one: an error is fine.
            let _ = sqlx::raw_sql(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {name} CASCADE"
            )))
            .execute(admin)
            .await;
        }
    }
    Ok(())
}

pub(super) async fn drop_schema(admin: &PgPool, pool: &PgPool, schema: &str) {
    pool.close().await;
    if let Err(e) = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(admin)
    .await
    {
        tracing::warn!(%schema, error = %e, "cannot drop the harness's schema");
    }
}
